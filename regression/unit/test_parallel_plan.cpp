// ptrain-test: np=1 labels=quick timeout=60
// Plan figures for known models: the GPT-2 124M count and ZeRO memory ratios.
#include <gtest/gtest.h>

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
