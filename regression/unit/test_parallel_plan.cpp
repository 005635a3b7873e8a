// ptrain-test: np=1 labels=quick timeout=60
// Plan figures for known models: the GPT-2 124M count and ZeRO memory ratios.
#include <gtest/gtest.h>

#include <algorithm>

#include "deck/deck.hpp"
#include "parallel/plan.hpp"
#include "util/memory.hpp"

using namespace ptrain;

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
    sc.t = t, sc.T = 4;
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
    sc.p = p, sc.P = 2, sc.C = 2;
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
    sc.C = cp;
    const auto m = parallel::estimate_memory(c, sc);
    EXPECT_DOUBLE_EQ(m.bytes[kA] * cp, m1.bytes[kA]);  // every kept activation scales with S/C
    const auto act = model::activation_sizes(model::dims_of(c), sc, 2, 32 / cp, true);
    EXPECT_DOUBLE_EQ(m.bytes[kW], double(act.scratch) * 4 + parallel::estimate_ring(c).workspace);
  }
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
  sc.T = T, sc.C = C, sc.E = E;
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
    EXPECT_DOUBLE_EQ(act(c, {}), 4.0 * double(a.kept(2) + a.recompute));
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
