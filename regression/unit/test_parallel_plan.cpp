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
    for (const auto& chunk : model::build_layout(c, {t, 4, 0, 1, 0, 1, 1}))
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
