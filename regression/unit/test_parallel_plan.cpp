// ptrain-test: np=1 labels=quick timeout=60
// Plan figures for known models: the GPT-2 124M count and ZeRO memory ratios.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "deck/deck.hpp"
#include "parallel/plan.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"

using namespace ptrain;
using parallel::FitChange;

namespace {
Config gpt2_124m(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> o = {"model%n_layer=12", "model%d_model=768", "model%n_head=12",
                                "model%vocab=50257", "model%seq_len=1024"};
  o.insert(o.end(), extra.begin(), extra.end());
  return deck::parse_text("", "<test>", o);
}
constexpr int kP = int(MemCategory::params), kG = int(MemCategory::grads),
              kO = int(MemCategory::optimizer);
}  // namespace

TEST(Plan, Gpt2SmallHas124439808Parameters) {
  EXPECT_EQ(model::global_parameter_count(gpt2_124m()), 124439808);
}

TEST(Plan, TensorParallelShardsSumToTheWholeModel) {
  // Every tp rank's shard, minus the replicated tensors counted tp-1 extra times and the
  // padded vocabulary rows, is the model.
  Config c = gpt2_124m({"parallel%tp=4"});
  deck::validate(c, 4);
  std::int64_t sum = 0, replicated = 0, padding = 0;
  for (int t = 0; t < 4; ++t) {
    model::ShardCoord sc;
    sc.t = t, sc.tp = 4;
    for (const auto& chunk : model::build_layout(c, sc))
      for (const auto& s : chunk.tensors) {
        sum += s.numel;
        std::int64_t slab = 0;
        for (const auto& b : s.slabs) slab += b.numel();
        padding += s.numel - slab;
        if (s.local_shape == s.global_shape) replicated += s.numel;
      }
  }
  EXPECT_EQ(padding, (50260 - 50257) * 768);
  EXPECT_EQ(sum - padding - replicated * 3 / 4, 124439808);
}

TEST(Plan, ZeroStagesShardStateInExactRatios) {
  const int D = 4;
  std::array<parallel::MemoryEstimate, 4> m;
  for (int z = 0; z < 4; ++z) {
    Config c = gpt2_124m(
        {"parallel%zero=" + std::to_string(z), "train%global_batch=8", "train%micro_batch=2"});
    deck::validate(c, D);
    m[z] = parallel::estimate_memory(c, {});
  }
  const double P = double(m[0].local_params);
  const double shard = double((m[0].local_params + D - 1) / D);
  EXPECT_EQ(P, 124439808.0);  // tp = 1: no padding
  // ZeRO 0: params, grads, two moments, all whole (fp32).
  EXPECT_DOUBLE_EQ(m[0].bytes[kP], 4 * P);
  EXPECT_DOUBLE_EQ(m[0].bytes[kG], 4 * P);
  EXPECT_DOUBLE_EQ(m[0].bytes[kO], 8 * P);
  // ZeRO 1: moments sharded over D; 2: + gradients; 3: + parameters.
  EXPECT_DOUBLE_EQ(m[1].bytes[kO], 8 * shard);
  EXPECT_DOUBLE_EQ(m[1].bytes[kG], 4 * P);
  EXPECT_DOUBLE_EQ(m[2].bytes[kG], 4 * shard);
  EXPECT_DOUBLE_EQ(m[2].bytes[kP], 4 * P);
  EXPECT_DOUBLE_EQ(m[3].bytes[kP], 4 * shard);
  EXPECT_DOUBLE_EQ(m[3].bytes[kO], 8 * shard);
  // Activations do not depend on the stage.
  EXPECT_DOUBLE_EQ(m[0].bytes[int(MemCategory::activations)],
                   m[3].bytes[int(MemCategory::activations)]);
}

TEST(Plan, DataParallelTrafficIsTheRingFormula) {
  Config c = gpt2_124m({"train%global_batch=8", "train%micro_batch=2"});
  deck::validate(c, 4);
  const auto comm = parallel::estimate_comm(c, {});
  ASSERT_EQ(comm[0].group, GroupKind::dense_grad);
  EXPECT_DOUBLE_EQ(comm[0].bytes_per_step, 2.0 * 3 / 4 * 124439808.0 * 4);
}

TEST(Plan, PipelineBubble) {
  Config c = gpt2_124m({"parallel%pp=4", "train%global_batch=16", "train%micro_batch=1"});
  deck::validate(c, 4);
  EXPECT_DOUBLE_EQ(parallel::pipeline_bubble(c), 3.0 / (16 + 3));
}

namespace {
// 2 layers of width 64 (4 heads), 32 positions, 2 micro-batches of 2 per step, fp32.
Config small_cp(int cp, const std::string& layout, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> o = {"model%n_layer=2",
                                "model%d_model=64",
                                "model%n_head=4",
                                "model%seq_len=32",
                                "train%micro_batch=2",
                                "train%global_batch=4",
                                "parallel%cp=" + std::to_string(cp),
                                "parallel%cp_layout='" + layout + "'"};
  o.insert(o.end(), extra.begin(), extra.end());
  return deck::parse_text("", "<test>", o);
}
double cp_bytes(const Config& c, const model::ShardCoord& sc = {}) {
  for (const auto& e : parallel::estimate_comm(c, sc))
    if (e.group == GroupKind::cp) return e.bytes_per_step;
  ADD_FAILURE() << "no cp estimate";
  return -1;
}
constexpr int kA = int(MemCategory::activations), kW = int(MemCategory::workspace);
}  // namespace

TEST(Plan, ContextParallelRingTrafficIsExact) {
  for (const std::string layout : {"zigzag", "contiguous"}) {
    SCOPED_TRACE(layout);
    // cp = 2: a block is K and V of 2 samples x 16 positions x 64 wide, fp32 = 16 KiB.
    Config c2 = small_cp(2, layout);
    deck::validate(c2, 2);
    const auto r2 = parallel::estimate_ring(c2);
    EXPECT_DOUBLE_EQ(r2.block, 2.0 * 2 * 16 * 64 * 4);
    EXPECT_DOUBLE_EQ(r2.forward, 16384);                  // C-1 = 1 K/V block
    EXPECT_DOUBLE_EQ(r2.backward, 3 * 16384);             // 1 K/V + 2 dK/dV
    EXPECT_DOUBLE_EQ(cp_bytes(c2), 2 * 2 * 4 * 16384.0);  // m * layers * (3C-2) blocks
    // Backward workspace: 5 blocks, out and dout (2*16*64 each) and lse (2*4*16).
    EXPECT_DOUBLE_EQ(r2.workspace, 5 * 16384 + (2 * 2 * 16 * 64 + 2 * 4 * 16) * 4.0);
    // cp = 4: blocks of 8 positions (8 KiB); 3 forward, 3 + 4 backward.
    Config c4 = small_cp(4, layout);
    deck::validate(c4, 4);
    const auto r4 = parallel::estimate_ring(c4);
    EXPECT_DOUBLE_EQ(r4.block, 8192);
    EXPECT_DOUBLE_EQ(r4.forward, 3 * 8192);
    EXPECT_DOUBLE_EQ(r4.backward, 7 * 8192);
    EXPECT_DOUBLE_EQ(r4.per_layer(), 10 * 8192);
    EXPECT_DOUBLE_EQ(cp_bytes(c4), 2 * 2 * 10 * 8192.0);
    // Tensor parallelism halves the heads each rank sends.
    Config t2 = small_cp(2, layout, {"parallel%tp=2"});
    deck::validate(t2, 4);
    EXPECT_DOUBLE_EQ(parallel::estimate_ring(t2).block, 8192);
    EXPECT_DOUBLE_EQ(cp_bytes(t2), 2 * 2 * 4 * 8192.0);
  }
  // Without cp nothing goes round.
  Config c1 = small_cp(1, "zigzag");
  deck::validate(c1, 1);
  EXPECT_DOUBLE_EQ(parallel::estimate_ring(c1).per_layer(), 0);
  EXPECT_DOUBLE_EQ(parallel::estimate_ring(c1).workspace, 0);
  EXPECT_DOUBLE_EQ(cp_bytes(c1), 0);
}

TEST(Plan, ContextParallelTrafficCountsTheStagesLayers) {
  // pp = 2 over 4 layers split 3 + 1: each stage's ranks send for their own layers.
  Config c = small_cp(2, "zigzag", {"parallel%pp=2"});
  c.model.n_layer = 4, c.parallel.pp_layers[0] = 3, c.parallel.pp_layers[1] = 1;
  deck::validate(c, 4);
  const int layers[2] = {3, 1};
  for (int p = 0; p < 2; ++p) {
    model::ShardCoord sc;
    sc.p = p, sc.pp = 2, sc.cp = 2;
    EXPECT_DOUBLE_EQ(cp_bytes(c, sc), 2.0 * layers[p] * 4 * 16384);
  }
}

TEST(Plan, ContextParallelCutsActivationsAndAddsTheRingWorkspace) {
  Config c1 = small_cp(1, "zigzag");
  deck::validate(c1, 1);
  const auto m1 = parallel::estimate_memory(c1, {});
  for (int cp : {2, 4}) {
    Config c = small_cp(cp, "zigzag");
    deck::validate(c, cp);
    model::ShardCoord sc;
    sc.cp = cp;
    const auto m = parallel::estimate_memory(c, sc);
    EXPECT_DOUBLE_EQ(m.bytes[kA] * cp, m1.bytes[kA]);  // every kept activation scales with S/C
    const auto act = model::activation_sizes(model::dims_of(c), sc, 2, 32 / cp, true);
    // The attention kernel's blocks are Kokkos team scratch, not a tracked allocation.
    EXPECT_DOUBLE_EQ(m.bytes[kW], double(act.scratch) * 4 + parallel::estimate_ring(c).workspace);
  }
  const auto act1 = model::activation_sizes(model::dims_of(c1), {}, 2, 32, true);
  EXPECT_DOUBLE_EQ(m1.bytes[kW], double(act1.scratch) * 4);
}

namespace {
// 2 MoE blocks of width 64 (4 heads, F = 256), 4 experts, top 2, 32 positions, micro-batches
// of 2, global batch 4, fp32; `extra` adds keys or replaces these.
Config small_moe(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> o = {"model%n_layer=2", "model%d_model=64",    "model%n_head=4",
                                "model%vocab=64",  "model%seq_len=32",    "model%n_expert=4",
                                "model%top_k=2",   "train%micro_batch=2", "train%global_batch=4"};
  for (const auto& e : extra) {
    const auto key = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
    auto it =
        std::find_if(o.begin(), o.end(), [&](const std::string& kv) { return key(kv) == key(e); });
    if (it != o.end())
      *it = e;
    else
      o.push_back(e);
  }
  return deck::parse_text("", "<test>", o);
}
double group_bytes(const Config& c, GroupKind g, const model::ShardCoord& sc = {}) {
  for (const auto& e : parallel::estimate_comm(c, sc))
    if (e.group == g) return e.bytes_per_step;
  return -1;  // no estimate for the group
}
model::ShardCoord coord(int T, int C, int E) {
  model::ShardCoord sc;
  sc.tp = T, sc.cp = C, sc.ep = E;
  return sc;
}
}  // namespace

TEST(Plan, ExpertParallelAllToAllIsExact) {
  // ep = 2, one micro-batch of 2 x 32 tokens per rank: each rank sends k*B*S = 128 rows of
  // 64 floats, half of them to the other rank (16 KiB), out and back, forward and backward;
  // the forward's counts are El = 2 int32 for the one peer.
  Config c = small_moe({"parallel%ep=2"});
  deck::validate(c, 2);
  const auto x = parallel::estimate_experts(c);
  EXPECT_EQ(x.tokens, 64);
  EXPECT_EQ(x.capacity, 40);  // ceil(1.25 * 2 * 64 / 4)
  EXPECT_DOUBLE_EQ(x.counts, 8);
  EXPECT_DOUBLE_EQ(x.rows, 2.0 * 2 * 32 * 64 * 4 / 2);
  EXPECT_DOUBLE_EQ(x.forward, 8 + 2 * 16384.0);
  EXPECT_DOUBLE_EQ(x.backward, 2 * 16384.0);
  EXPECT_DOUBLE_EQ(group_bytes(c, GroupKind::ep, coord(1, 1, 2)), 1 * 2 * (8 + 4 * 16384.0));
  // ep = 4 (global batch 8: one micro-batch each): 3/4 of the rows leave, 3 peers x 1 count.
  Config c4 = small_moe({"parallel%ep=4", "train%global_batch=8"});
  deck::validate(c4, 4);
  const auto x4 = parallel::estimate_experts(c4);
  EXPECT_DOUBLE_EQ(x4.counts, 12);
  EXPECT_DOUBLE_EQ(x4.rows, 2.0 * 2 * 32 * 64 * 4 * 3 / 4);
  EXPECT_DOUBLE_EQ(x4.per_layer(), 12 + 4 * 24576.0);
  // With cp = 2 a rank routes its 16 positions of each sample; capacity is over the whole
  // micro-batch. moe_every = 2: one MoE block of two.
  Config cc =
      small_moe({"parallel%ep=2", "parallel%cp=2", "model%moe_every=2", "model%capacity_factor=0"});
  deck::validate(cc, 4);
  const auto xc = parallel::estimate_experts(cc);
  EXPECT_EQ(xc.tokens, 64);
  EXPECT_EQ(xc.capacity, 0);  // dropless
  EXPECT_DOUBLE_EQ(xc.rows, 2.0 * 2 * 16 * 64 * 4 / 2);
  EXPECT_DOUBLE_EQ(group_bytes(cc, GroupKind::ep, coord(1, 2, 2)), 1 * 1 * (8 + 4 * 8192.0));
  // No expert parallelism, no all-to-all; no experts, no estimate at all.
  Config c1 = small_moe();
  deck::validate(c1, 1);
  EXPECT_DOUBLE_EQ(parallel::estimate_experts(c1).per_layer(), 0);
  EXPECT_EQ(parallel::estimate_experts(c1).capacity, 40);
  EXPECT_DOUBLE_EQ(group_bytes(c1, GroupKind::ep), 0);
  EXPECT_EQ(parallel::estimate_experts(small_cp(1, "zigzag")).capacity, 0);
}

TEST(Plan, ExpertMemoryAndGradientGroups) {
  // Per expert 2*F*C + F + C = 33,088 elements; 2 per rank at ep = 2, in 2 layers.
  Config c = small_moe({"parallel%ep=2"});
  deck::validate(c, 2);
  const auto m = parallel::estimate_memory(c, coord(1, 1, 2));
  EXPECT_EQ(m.expert_params, 2 * 2 * 33088);
  EXPECT_DOUBLE_EQ(m.expert_param_bytes, 4.0 * 132352);
  EXPECT_DOUBLE_EQ(m.expert_grad_bytes, 4.0 * 132352);
  EXPECT_DOUBLE_EQ(m.expert_optimizer_bytes, 8.0 * 132352);  // AdamW's two moments
  // tp = 2 halves each expert's hidden width; the proj bias stays whole.
  Config t = small_moe({"parallel%ep=2", "parallel%tp=2"});
  deck::validate(t, 4);
  EXPECT_EQ(parallel::estimate_memory(t, coord(2, 1, 2)).expert_params,
            2 * 2 * (2 * 128 * 64 + 128 + 64));
  // ep = 2: dense gradients over dense-grad (2 ranks), experts over expert-grad (1 rank).
  EXPECT_DOUBLE_EQ(group_bytes(c, GroupKind::dense_grad, coord(1, 1, 2)),
                   2 * 0.5 * 4.0 * double(m.dense_params));
  EXPECT_DOUBLE_EQ(group_bytes(c, GroupKind::expert_grad, coord(1, 1, 2)), 0);
  // ep = 1: one group takes every gradient, experts included (data_parallel.hpp).
  Config d = small_moe({"parallel%cp=2"});
  deck::validate(d, 2);
  const auto md = parallel::estimate_memory(d, coord(1, 2, 1));
  EXPECT_DOUBLE_EQ(group_bytes(d, GroupKind::dense_grad, coord(1, 2, 1)),
                   2 * 0.5 * 4.0 * double(md.local_params));
  EXPECT_DOUBLE_EQ(group_bytes(d, GroupKind::expert_grad, coord(1, 2, 1)), -1);
  // ZeRO 1 at ep = 1 over 2 data-parallel ranks: the moments are sharded, experts' too.
  Config z = small_moe({"parallel%zero=1"});
  deck::validate(z, 2);
  const auto mz = parallel::estimate_memory(z, {});
  EXPECT_DOUBLE_EQ(mz.expert_optimizer_bytes, 8.0 * double(mz.expert_params) / 2);
  EXPECT_DOUBLE_EQ(mz.expert_grad_bytes, 4.0 * double(mz.expert_params));
}

TEST(Plan, MoeRoutingTrafficOnTensorAndContextGroups) {
  // tp = 2: a MoE layer also sums its gates' gradient (b*s*k floats) over tp:
  // m = 2 micro-batches x 2 layers x 2(T-1)/T x 2*32*2*4 B.
  Config t = small_moe({"parallel%tp=2"}), t0 = small_moe({"parallel%tp=2", "model%n_expert=0"});
  deck::validate(t, 2), deck::validate(t0, 2);
  EXPECT_DOUBLE_EQ(group_bytes(t, GroupKind::tp, coord(2, 1, 1)) -
                       group_bytes(t0, GroupKind::tp, coord(2, 1, 1)),
                   2 * 2 * 1.0 * 2 * 32 * 2 * 4);
  // cp = 2: the forward gathers the group's choices ((C-1) * 2*16*2 int32) and sums E = 4
  // mean probabilities (2(C-1)/C * 4 doubles), per MoE layer and micro-batch.
  Config c = small_moe({"parallel%cp=2"}), c0 = small_moe({"parallel%cp=2", "model%n_expert=0"});
  deck::validate(c, 2), deck::validate(c0, 2);
  EXPECT_DOUBLE_EQ(group_bytes(c, GroupKind::cp, coord(1, 2, 1)) -
                       group_bytes(c0, GroupKind::cp, coord(1, 2, 1)),
                   2 * 2 * (2 * 16 * 2 * 4.0 + 4 * 8.0));
}

TEST(Plan, RecomputationRerunsForwardCollectivesAndShrinksActivations) {
  const auto act = [](const Config& c, const model::ShardCoord& sc) {
    return parallel::estimate_memory(c, sc).bytes[kA];
  };
  for (const std::string mode : {"selective", "full"}) {
    SCOPED_TRACE(mode);
    const std::string r = "train%recompute='" + mode + "'";
    // Activations: what blocks keep (2 micro-batches' worth of slots: 1 without a pipeline)
    // and one block's recomputed tensors, from model::activation_sizes.
    Config c = small_moe({r}), none = small_moe();
    deck::validate(c, 1), deck::validate(none, 1);
    const auto a = model::activation_sizes(model::dims_of(c), {}, 2, 32, true, false,
                                           model::recompute_mode(mode));
    EXPECT_DOUBLE_EQ(act(c, {}), 4.0 * double(a.kept(2) + a.head + a.recompute + a.kept_stats(2) +
                                              a.head_stats + a.recompute_stats));
    EXPECT_NE(act(c, {}), act(none, {}));
    Config dense = small_moe({r, "model%n_expert=0"}), dense0 = small_moe({"model%n_expert=0"});
    deck::validate(dense, 1), deck::validate(dense0, 1);
    EXPECT_LT(act(dense, {}), act(dense0, {}));
    const bool full = mode == "full";
    // tp = 2 with SP (one (b, s, h) activation is 2*32*64*4 = 16 KiB; m = 2, L = 2): full
    // reruns each block's 2 reduce-scatter/all-gather pairs, selective its 2 LayerNorm
    // all-gathers.
    Config t = small_moe({r, "parallel%tp=2", "parallel%sequence_parallel=.true."}),
           t0 = small_moe({"parallel%tp=2", "parallel%sequence_parallel=.true."});
    deck::validate(t, 2), deck::validate(t0, 2);
    EXPECT_DOUBLE_EQ(group_bytes(t, GroupKind::tp, coord(2, 1, 1)) -
                         group_bytes(t0, GroupKind::tp, coord(2, 1, 1)),
                     2 * 2 * (full ? 2.0 : 1.0) * 16384);
    // cp = 2: each attention's forward ring again (one 16 KiB K/V block: 2 x 2*16*64*4 B);
    // full also the routing.
    Config c2 = small_moe({r, "parallel%cp=2"}), c20 = small_moe({"parallel%cp=2"});
    deck::validate(c2, 2), deck::validate(c20, 2);
    EXPECT_DOUBLE_EQ(group_bytes(c2, GroupKind::cp, coord(1, 2, 1)) -
                         group_bytes(c20, GroupKind::cp, coord(1, 2, 1)),
                     2 * 2 * (16384 + (full ? 2 * 16 * 2 * 4.0 + 4 * 8.0 : 0.0)));
    // ep = 2: full routes again (the forward's counts and rows out and back).
    Config e = small_moe({r, "parallel%ep=2"}), e0 = small_moe({"parallel%ep=2"});
    deck::validate(e, 2), deck::validate(e0, 2);
    EXPECT_DOUBLE_EQ(group_bytes(e, GroupKind::ep, coord(1, 1, 2)) -
                         group_bytes(e0, GroupKind::ep, coord(1, 1, 2)),
                     full ? 2 * (8 + 2 * 16384.0) : 0.0);
  }
  // Without SP, selective recomputation sends nothing more over tp.
  Config t = small_moe({"train%recompute='selective'", "parallel%tp=2"}),
         t0 = small_moe({"parallel%tp=2"});
  deck::validate(t, 2), deck::validate(t0, 2);
  EXPECT_DOUBLE_EQ(group_bytes(t, GroupKind::tp, coord(2, 1, 1)),
                   group_bytes(t0, GroupKind::tp, coord(2, 1, 1)));
}

// ---- Will it fit? -------------------------------------------------------------------------

TEST(Fit, SizesAsUsersWriteThem) {
  EXPECT_EQ(parse_bytes("80GiB"), 80.0 * (1 << 30));
  EXPECT_EQ(parse_bytes("80 GiB"), 80.0 * (1 << 30));
  EXPECT_EQ(parse_bytes("80g"), 80.0 * (1 << 30));  // Slurm's --mem=80G
  EXPECT_EQ(parse_bytes("512MiB"), 512.0 * (1 << 20));
  EXPECT_EQ(parse_bytes("1.5TB"), 1.5e12);
  EXPECT_EQ(parse_bytes("25GB/s"), 25e9);
  EXPECT_EQ(parse_bytes("1048576"), 1048576.0);
  EXPECT_EQ(parse_bytes("4kib"), 4096.0);
  EXPECT_EQ(parse_bytes("1EiB"), std::pow(1024.0, 6));
  for (const char* bad :
       {"", "GiB", "80XB", "-1GiB", "0", "80GiBs", "nan", "0.5B", "1e-300GiB", "1e30GiB"})
    EXPECT_FALSE(parse_bytes(bad).has_value()) << bad;
}

TEST(Fit, BudgetIsTheFlagOrTheNodeSharedOrUnknownOnAGpu) {
  Config c = gpt2_124m();
  EXPECT_EQ(parallel::memory_budget(c, {80.0 * (1 << 30), 0}, 4).bytes, 80.0 * (1 << 30));
  const NodeMemory node = node_memory();
  ASSERT_GT(node.bytes, 0);
  EXPECT_DOUBLE_EQ(parallel::memory_budget(c, {}, 4).bytes, node.bytes / 4);
  c.backend.device = "cuda";
  EXPECT_EQ(parallel::memory_budget(c, {}, 4).bytes, 0);
  EXPECT_NE(parallel::memory_budget(c, {}, 4).source.find("--memory"), std::string::npos);
  EXPECT_EQ(parallel::memory_budget(c, {1e9, 0}, 4).bytes, 1e9);
}

namespace {
// The deck with `sets` (as --set would give them) applied, validated for `world`: a key of
// `sets` replaces the same key of `base`.
Config with_sets(const std::vector<std::string>& base, const std::vector<std::string>& sets,
                 int world) {
  const auto key = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
  std::vector<std::string> o;
  for (const auto& b : base)
    if (std::none_of(sets.begin(), sets.end(),
                     [&](const std::string& s) { return key(s) == key(b); }))
      o.push_back(b);
  o.insert(o.end(), sets.begin(), sets.end());
  Config c = deck::parse_text("", "<test>", o);
  deck::validate(c, world);
  return c;
}
std::vector<std::string> gpt2_keys(const std::vector<std::string>& extra) {
  std::vector<std::string> o = {"model%n_layer=12", "model%d_model=768", "model%n_head=12",
                                "model%vocab=50257", "model%seq_len=1024"};
  o.insert(o.end(), extra.begin(), extra.end());
  return o;
}
double largest(const Config& c) { return parallel::largest_shard(c).bytes; }
}  // namespace

TEST(Fit, LargestShardIsTheLargestStage) {
  // pp = 2, 9 + 3 layers: the first stage holds more blocks and more micro-batches in flight.
  Config c = gpt2_124m(
      {"parallel%pp=2", "parallel%pp_layers=9,3", "train%global_batch=8", "train%micro_batch=2"});
  deck::validate(c, 2);
  const auto big = parallel::largest_shard(c);
  EXPECT_EQ(big.p, 0);
  EXPECT_DOUBLE_EQ(big.bytes,
                   parallel::estimate_memory(c, parallel::plan_shard(c, 0, 0, 0)).total());
  EXPECT_GT(big.bytes, parallel::estimate_memory(c, parallel::plan_shard(c, 0, 1, 0)).total());
}

// Hybrid sharding: dp 8 on 2 ranks per node, ZeRO 1-3 shards over the 2 ranks of a node
// (4 replicas): each sharded category 4x its global share; across the nodes ZeRO 2/3 send
// 2(N-1)/N of the 1/L shard once a step, and nothing stays unaccounted.
TEST(Plan, HybridShardingShardsOverTheNode) {
  const std::vector<std::string> keys = {
      "model%n_layer=2",  "model%d_model=64",    "model%n_head=4",       "model%vocab=64",
      "model%seq_len=32", "train%micro_batch=1", "train%global_batch=16"};
  for (int z = 1; z <= 3; ++z) {
    SCOPED_TRACE(testing::Message() << "ZeRO " << z);
    const std::string zero = "parallel%zero=" + std::to_string(z);
    const Config global = with_sets(keys, {zero}, 8);
    const Config node = with_sets(keys, {zero, "parallel%zero_scope='node'"}, 8);
    EXPECT_EQ(parallel::plan_shard(node, 0, 0, 0, 2).zero_shards, 2);
    EXPECT_EQ(parallel::plan_shard(global, 0, 0, 0, 2).zero_shards, 0);
    const auto g = parallel::estimate_memory(global, parallel::plan_shard(global, 0, 0, 0, 2));
    const auto h = parallel::estimate_memory(node, parallel::plan_shard(node, 0, 0, 0, 2));
    const int sharded[3][3] = {
        {int(MemCategory::optimizer)},
        {int(MemCategory::optimizer), int(MemCategory::grads)},
        {int(MemCategory::optimizer), int(MemCategory::grads), int(MemCategory::params)}};
    for (int k = 0; k < z; ++k) {
      const int c = sharded[z - 1][k];
      EXPECT_NEAR(h.bytes[std::size_t(c)] / g.bytes[std::size_t(c)], 4.0, 0.01) << "category " << c;
    }
    const auto comm = parallel::estimate_comm(node, parallel::plan_shard(node, 0, 0, 0, 2));
    const auto& dp = comm.at(0);
    ASSERT_EQ(dp.group, GroupKind::dense_grad);
    const double n = double(h.local_params) * 4, ring_l = 0.5, ring_nodes = 0.75, m = 2;
    EXPECT_DOUBLE_EQ(dp.inter_only, z == 1 ? 0.0 : 2 * ring_nodes * n / 2);
    const double gather = z == 3 ? 0 : ring_l * n;
    if (z == 1) {
      EXPECT_DOUBLE_EQ(dp.bytes_per_step, 2 * 7.0 / 8 * n + gather);
    } else if (z == 2) {
      EXPECT_DOUBLE_EQ(dp.intra_only, m * ring_l * n + gather);
    }
    EXPECT_DOUBLE_EQ(dp.bytes_per_step - dp.intra_only - dp.inter_only,
                     z == 1 ? 2 * 7.0 / 8 * n : 0.0);
  }
}

TEST(Fit, PipelineMessageBuffersAndTheTiedSumAreComm) {
  // pp = 2, 1F1B, m = 4 micro-batches of 2: rank 0 holds two message buffers (a send still in
  // flight when the next gradient's receive is posted), each one stage input 2*32*64 floats,
  // and the whole wte (64 x 64) to sum its gradient with the last stage's.
  const std::vector<std::string> keys = {
      "model%n_layer=2",  "model%d_model=64",    "model%n_head=4",       "model%vocab=64",
      "model%seq_len=32", "train%micro_batch=2", "train%global_batch=8", "parallel%pp=2"};
  Config c = with_sets(keys, {}, 2),
         c1 = with_sets({"model%n_layer=2", "model%d_model=64", "model%n_head=4", "model%vocab=64",
                         "model%seq_len=32", "train%micro_batch=2", "train%global_batch=8"},
                        {}, 1);
  for (int p = 0; p < 2; ++p)
    EXPECT_DOUBLE_EQ(parallel::estimate_memory(c, parallel::plan_shard(c, 0, p, 0))
                         .bytes[int(MemCategory::comm)],
                     (2 * 2 * 32 * 64 + 64 * 64) * 4.0);
  EXPECT_DOUBLE_EQ(parallel::estimate_memory(c1, {}).bytes[int(MemCategory::comm)], 0);
}

TEST(Fit, NothingToChangeWhenItFits) {
  Config c = gpt2_124m({"train%global_batch=4", "train%micro_batch=4"});
  deck::validate(c, 1);
  const auto rates = parallel::step_rates(c, 0);
  EXPECT_TRUE(parallel::fit_changes(c, 1, 1, largest(c), rates).empty());
  Layout layout(GridShape::from_config(c), 1, 1);
  EXPECT_EQ(parallel::fit_refusal(c, layout, {largest(c), "--memory"}, 0), "");
  EXPECT_EQ(parallel::fit_refusal(c, layout, {0, "unknown"}, 0), "");  // no budget, no verdict
}

TEST(Fit, RecomputationOnOneRankCostsWhatItRunsAgain) {
  // One rank, micro-batch 4 of 4: only recomputation and a smaller micro-batch can help.
  const auto keys =
      gpt2_keys({"train%global_batch=4", "train%micro_batch=4", "backend%peak_gflops=100"});
  Config c = with_sets(keys, {}, 1);
  Config sel = with_sets(keys, {"train%recompute='selective'"}, 1);
  Config full = with_sets(keys, {"train%recompute='full'"}, 1);
  ASSERT_LT(largest(full), largest(sel));
  ASSERT_LT(largest(sel), largest(c));
  const double budget = (largest(sel) + largest(c)) / 2;  // selective fits, none does not
  const auto rates = parallel::step_rates(c, 0);
  EXPECT_FALSE(rates.gflops_assumed);
  EXPECT_TRUE(rates.bandwidth_assumed);
  const auto changes = parallel::fit_changes(c, 1, 1, budget, rates);
  ASSERT_FALSE(changes.empty());
  bool selective = false;
  for (const auto& ch : changes) {
    // Each change fits with the figure the plan gives for the deck with it.
    const Config with = with_sets(keys, ch.sets, 1);
    EXPECT_DOUBLE_EQ(ch.largest, largest(with));
    EXPECT_LE(ch.largest, budget);
    EXPECT_EQ(ch.extra_bytes, 0);  // one rank: nothing is sent
    if (ch.sets == std::vector<std::string>{"train%recompute='selective'"}) {
      selective = true;
      // The attention's forward again (4*L*h*s per token) and elementwise LayerNorm and GELU:
      // a few percent of the model FLOPs.
      const double tokens = 4.0 * 1024;
      EXPECT_GT(ch.extra_flops, 4.0 * 12 * 768 * 1024 * tokens);
      EXPECT_LT(ch.fraction, 0.05);
      const double expected = ch.extra_flops / (model::flops_per_token(c) * tokens);
      EXPECT_NEAR(ch.fraction, expected, 1e-12 * expected);
    }
    // full is a superset of selective, knob by knob: never offered next to it.
    EXPECT_NE(ch.sets.front(), "train%recompute='full'");
  }
  EXPECT_TRUE(selective);
  for (std::size_t i = 1; i < changes.size(); ++i)
    EXPECT_LE(changes[i - 1].extra_seconds, changes[i].extra_seconds);
  // Just above what full needs (and below selective): full is the only recomputation offered,
  // at one more forward of the blocks (a third of their FLOPs, all but the head's 6*V*h).
  const auto only_full = parallel::fit_changes(c, 1, 1, (largest(full) + largest(sel)) / 2, rates);
  bool found = false;
  for (const auto& ch : only_full)
    if (ch.sets == std::vector<std::string>{"train%recompute='full'"}) {
      found = true;
      const double per_token = (model::flops_per_token(c) - 6.0 * 50257 * 768) / 3;
      EXPECT_DOUBLE_EQ(ch.extra_flops, per_token * 4 * 1024);
      EXPECT_GT(ch.fraction, 0.2);  // GPT-2 124M: the LM head is a quarter of the FLOPs
      EXPECT_LT(ch.fraction, 0.34);
    }
  EXPECT_TRUE(found);
}

TEST(Fit, ZeroStagesGridAndMicroBatchOnFourRanks) {
  // dp = 4 on one node of 4: ZeRO stages, tp or pp x2 (dp 2) and smaller micro-batches.
  const auto keys =
      gpt2_keys({"train%global_batch=16", "train%micro_batch=4", "backend%peak_gflops=100"});
  Config c = with_sets(keys, {}, 4);
  Config z1 = with_sets(keys, {"parallel%zero=1"}, 4);
  const double budget = (largest(c) + largest(z1)) / 2;
  ASSERT_LT(largest(z1), budget);
  FitChange least;
  const auto rates = parallel::step_rates(c, 25e9);
  EXPECT_FALSE(rates.bandwidth_assumed);
  const auto changes = parallel::fit_changes(c, 4, 4, budget, rates, &least);
  ASSERT_FALSE(changes.empty());
  std::set<std::string> seen;
  for (const auto& ch : changes) {
    for (const auto& s : ch.sets) seen.insert(s.substr(0, s.find('=')));
    const Config with = with_sets(keys, ch.sets, 4);
    EXPECT_DOUBLE_EQ(ch.largest, largest(with)) << ch.sets.front();
    EXPECT_LE(ch.largest, budget);
    if (ch.sets == std::vector<std::string>{"parallel%zero=1"}) {
      // ZeRO 1 adds the parameter all-gather, (D-1)/D*S, at 25 GB/s.
      const double S = 4.0 * 124439808;
      EXPECT_DOUBLE_EQ(ch.extra_bytes, 0.75 * S);
      EXPECT_NEAR(ch.extra_seconds, 0.75 * S / 25e9, 1e-12);
    }
  }
  EXPECT_TRUE(seen.count("parallel%zero"));
  EXPECT_TRUE(seen.count("train%micro_batch"));
  EXPECT_TRUE(seen.count("parallel%tp") || seen.count("parallel%pp"));
  // No change is another one plus more.
  for (const auto& a : changes)
    for (const auto& b : changes) {
      std::set<std::string> sa(a.sets.begin(), a.sets.end()), sb(b.sets.begin(), b.sets.end());
      if (sb.size() > sa.size()) {
        EXPECT_FALSE(std::includes(sb.begin(), sb.end(), sa.begin(), sa.end()));
      }
    }
  // tp stays within a node: with one rank per node only pp may grow.
  for (const auto& ch : parallel::fit_changes(c, 4, 1, budget, rates))
    for (const auto& s : ch.sets) EXPECT_EQ(s.rfind("parallel%tp", 0), std::string::npos);
}

TEST(Fit, NothingFitsSaysTheLeastAnyReachesAndTheRunRefusesInOneLine) {
  const auto keys = gpt2_keys({"train%global_batch=4", "train%micro_batch=4"});
  Config c = with_sets(keys, {}, 1);
  FitChange least;
  EXPECT_TRUE(parallel::fit_changes(c, 1, 1, 1e6, parallel::step_rates(c, 0), &least).empty());
  EXPECT_GT(least.largest, 1e6);
  EXPECT_DOUBLE_EQ(least.largest, largest(with_sets(keys, least.sets, 1)));
  Layout layout(GridShape::from_config(c), 1, 1);
  const std::string none = parallel::fit_refusal(c, layout, {1e6, "--memory"}, 0);
  EXPECT_EQ(none.find('\n'), std::string::npos);
  EXPECT_NE(none.find("will not fit"), std::string::npos);
  EXPECT_NE(none.find("no change of train%recompute"), std::string::npos);
  // A budget recomputation meets: the line names the cheapest change, its memory and cost.
  Config sel = with_sets(keys, {"train%recompute='selective'"}, 1);
  const double budget = (largest(sel) + largest(c)) / 2;
  const auto changes = parallel::fit_changes(c, 1, 1, budget, parallel::step_rates(c, 0));
  ASSERT_FALSE(changes.empty());
  const std::string line = parallel::fit_refusal(c, layout, {budget, "--memory"}, 0);
  EXPECT_EQ(line.find('\n'), std::string::npos);
  EXPECT_NE(line.find("cheapest first: --set " + changes[0].sets[0]), std::string::npos) << line;
  EXPECT_NE(line.find(format_bytes(changes[0].largest)), std::string::npos) << line;
}

TEST(Fit, PlanReportTableAndAdviceAgree) {
  const auto keys = gpt2_keys({"train%global_batch=16", "train%micro_batch=4"});
  Config c = with_sets(keys, {}, 4);
  Layout layout(GridShape::from_config(c), 4, 4);
  Config full3 = with_sets(keys, {"train%recompute='full'", "parallel%zero=3"}, 4);
  const std::string r = parallel::plan_report(c, layout, {largest(c) / 2, 0});
  EXPECT_NE(r.find("DOES NOT FIT: " + format_bytes(largest(c))), std::string::npos);
  EXPECT_NE(r.find("largest shard by train%recompute x parallel%zero"), std::string::npos);
  EXPECT_NE(r.find(format_bytes(largest(full3))), std::string::npos);  // the table's corner
  EXPECT_NE(r.find("*" + format_bytes(largest(c)) + " over"), std::string::npos);
  EXPECT_NE(r.find("changes that make every shard fit, cheapest first"), std::string::npos);
  const std::string fits = parallel::plan_report(c, layout, {largest(c), 0});
  EXPECT_NE(fits.find("every shard fits"), std::string::npos);
  EXPECT_EQ(fits.find("changes that make"), std::string::npos);
}

TEST(Fit, AFailedAllocationNamesRankCategoryLabelAndSize) {
  try {
    TrackedView<double> huge(MemCategory::activations, "test.huge", std::size_t(1) << 58);
    FAIL() << "a 2 EiB allocation succeeded";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.exit_code(), kExitRuntime);
    EXPECT_NE(what.find("out of memory on rank 0: " + format_bytes(std::pow(2.0, 61))),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("for activations ('test.huge')"), std::string::npos) << what;
  }
  EXPECT_EQ(memory::stats().current[int(MemCategory::activations)], 0u);
}

namespace {

// The plan's line under a group's bytes: "intra-node X, inter-node Y (k of n ...)".
std::string split_line(const std::string& report, const std::string& group) {
  const std::size_t at = report.find("\n  " + group + " ", report.find("communication per step"));
  if (at == std::string::npos) return "";
  const std::size_t next = report.find('\n', at + 1);
  const std::size_t end = report.find('\n', next + 1);
  return report.substr(next + 1, end - next - 1);
}

}  // namespace

// dp 4 over 2 nodes of 2: the flat ring 0-1-2-3-0 has 2 of its 4 links between nodes, so half
// of each rank's bytes; tp 2 inside a node, none. One node: no split at all.
TEST(Plan, CommunicationSplitsIntoIntraAndInterNodeBytes) {
  const auto keys = gpt2_keys({"train%global_batch=16", "train%micro_batch=4"});
  const Config dp4 = with_sets(keys, {"parallel%dp=4"}, 4);
  const std::string two =
      parallel::plan_report(dp4, Layout(GridShape::from_config(dp4), 4, 2), {0, 0});
  const auto estimates = parallel::estimate_comm(dp4, parallel::plan_shard(dp4, 0, 0, 0));
  double bytes = 0;
  for (const auto& e : estimates)
    if (e.group == GroupKind::dense_grad) bytes = e.bytes_per_step;
  // dp 4 over 2 nodes of 2 reduces in two levels: (N-1)/(D-1) = 1/3 of the bytes cross.
  const std::string line = split_line(two, "dense-grad");
  EXPECT_NE(line.find("(two levels: inside 2 nodes of 2, then across them"), std::string::npos)
      << two;
  EXPECT_NE(line.find("inter-node " + format_bytes(bytes / 3)), std::string::npos) << line;
  // As one ring (backend%comm = 'mpi'), half of the ring's links cross.
  const Config flat = with_sets(keys, {"parallel%dp=4", "backend%comm='mpi'"}, 4);
  const std::string ring =
      split_line(parallel::plan_report(flat, Layout(GridShape::from_config(flat), 4, 2), {0, 0}),
                 "dense-grad");
  EXPECT_NE(ring.find("(2 of 4 ring links on another node)"), std::string::npos) << ring;
  EXPECT_NE(ring.find("inter-node " + format_bytes(bytes / 2)), std::string::npos) << ring;
  const Config tp2 = with_sets(keys, {"parallel%dp=2", "parallel%tp=2"}, 4);
  const std::string r =
      parallel::plan_report(tp2, Layout(GridShape::from_config(tp2), 4, 2), {0, 0});
  EXPECT_NE(split_line(r, "tp").find("inter-node 0 B (0 of 2 ring links"), std::string::npos) << r;
  EXPECT_NE(split_line(r, "dense-grad").find("(2 of 2 ring links"), std::string::npos) << r;
  const std::string one =
      parallel::plan_report(dp4, Layout(GridShape::from_config(dp4), 4, 4), {0, 0});
  EXPECT_EQ(one.find("inter-node"), std::string::npos) << one;
}
