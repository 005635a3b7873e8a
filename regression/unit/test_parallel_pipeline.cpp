// ptrain-test: np=4 labels=quick timeout=300
// The pipeline's activation memory, as the tracked allocator sees it: GPipe keeps every
// micro-batch of the step in flight on every stage, 1F1B at most p - rank, so at p = 4 and
// m = 8 the activations of stage r shrink by m / min(p - r, m); interleaved keeps its checked
// in-flight count per chunk. A step under each schedule stays within what was allocated and
// gives the same loss and gradient norm (the schedules change the order of work, never the
// order in which gradients accumulate). The zero-bubble schedules: ZB-H1 holds 1F1B's peak
// (its first rank is 1F1B's), ZB-V what its plan says, on every rank.
#include <gtest/gtest.h>

#include <map>

#include "deck/deck.hpp"
#include "grid/grid.hpp"
#include "parallel/plan.hpp"
#include "parallel/trainer.hpp"
#include "test_support.hpp"
#include "util/memory.hpp"

using namespace ptrain;
using ptrain::test::world_size;

namespace {

// The test's pipeline (p = 4, m = 8 micro-batches of one sample, 8 layers); `extra` adds keys
// or replaces these.
Config config_for(const std::string& schedule, int v,
                  const std::map<std::string, std::string>& extra = {}) {
  std::map<std::string, std::string> kv = {{"model%n_layer", "8"},
                                           {"model%d_model", "16"},
                                           {"model%n_head", "2"},
                                           {"model%vocab", "29"},
                                           {"model%seq_len", "8"},
                                           {"model%dtype", "'fp64'"},
                                           {"train%global_batch", "8"},
                                           {"train%micro_batch", "1"},
                                           {"parallel%pp", "4"},
                                           {"parallel%dp", "1"},
                                           {"run%steps", "1"},
                                           {"parallel%pp_schedule", "'" + schedule + "'"},
                                           {"parallel%virtual_stages", std::to_string(v)}};
  for (const auto& [k, value] : extra) kv[k] = value;
  std::vector<std::string> o;
  for (const auto& [k, value] : kv) o.push_back(k + "=" + value);
  Config c = deck::parse_text("", "<test>", o);
  deck::validate(c, 4);
  return c;
}

struct Measured {
  double activations = 0;  // bytes allocated for the activation slots on this rank
  double peak = 0;         // activation-category peak over a training step
  double loss = 0, norm = 0;
};

Measured measure(const Config& c) {
  const auto act = std::size_t(MemCategory::activations);
  Grid grid(MPI_COMM_WORLD, GridShape::from_config(c), false);
  const double before = double(memory::stats().current[act]);
  Measured m;
  parallel::Trainer<Fp64> trainer(c, grid);
  for (int k = 0; k < trainer.chunks(); ++k) trainer.data_parallel(k).init_weights(7);
  m.activations = double(memory::stats().current[act]) - before;
  memory::reset_peaks();
  const auto r = trainer.step(1);
  m.peak = double(memory::stats().peak[act]) - before;
  m.loss = r.loss;
  m.norm = r.grad_norm;
  return m;
}

}  // namespace

TEST(Pipeline, OneFOneBKeepsFewerMicroBatchesThanGPipe) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const Measured gpipe = measure(config_for("gpipe", 1));
  const Measured f1b = measure(config_for("1f1b", 1));
  const double m = 8, expected = m / std::min(4.0 - rank, m);
  std::printf("[rank %d] activations: gpipe %.0f B, 1f1b %.0f B, ratio %.3f (expected %.3f)\n",
              rank, gpipe.activations, f1b.activations, gpipe.activations / f1b.activations,
              expected);
  EXPECT_NEAR(gpipe.activations / f1b.activations, expected, 1e-12 * expected);
  EXPECT_LE(gpipe.peak, gpipe.activations);
  EXPECT_LE(f1b.peak, f1b.activations);
  EXPECT_EQ(gpipe.loss, f1b.loss);
  EXPECT_EQ(gpipe.norm, f1b.norm);
}

TEST(Pipeline, InterleavedComputesTheSameStep) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const Measured f1b = measure(config_for("1f1b", 1));
  const Measured inter = measure(config_for("interleaved", 2));
  EXPECT_LE(inter.peak, inter.activations);
  EXPECT_NEAR(inter.loss, f1b.loss, 1e-13 * f1b.loss);
  EXPECT_NEAR(inter.norm, f1b.norm, 1e-12 * f1b.norm);
}

namespace {
// The plan's activation figure for this rank (pp = 4, no other axis): what --plan prints.
double planned_activations(const Config& c) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return parallel::estimate_memory(c, parallel::plan_shard(c, 0, rank, 0))
      .bytes[std::size_t(MemCategory::activations)];
}
}  // namespace

TEST(Pipeline, ZeroBubbleH1KeepsOneFOneBsPeakAndItsPlan) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const Config zc = config_for("zb-h1", 1);
  const Measured f1b = measure(config_for("1f1b", 1)), zb = measure(zc);
  std::printf("[rank %d] activations: 1f1b %.0f B, zb-h1 %.0f B (plan %.0f B)\n", rank,
              f1b.activations, zb.activations, planned_activations(zc));
  // The first rank, which holds the most in 1F1B, is 1F1B's itself (whole backwards); every
  // rank holds min(p, m) micro-batches, each exactly what the plan counts (W records too).
  if (rank == 0) {
    EXPECT_EQ(zb.activations, f1b.activations);
  }
  EXPECT_EQ(zb.activations, planned_activations(zc));
  EXPECT_LE(zb.peak, zb.activations);
  EXPECT_NEAR(zb.loss, f1b.loss, 1e-13 * f1b.loss);
  EXPECT_NEAR(zb.norm, f1b.norm, 1e-12 * f1b.norm);
}

TEST(Pipeline, ZeroBubbleVMatchesItsPlan) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const Config vc = config_for("zb-v", 2);
  const Measured f1b = measure(config_for("1f1b", 1)), zb = measure(vc);
  EXPECT_EQ(zb.activations, planned_activations(vc));
  EXPECT_LE(zb.peak, zb.activations);
  EXPECT_NEAR(zb.loss, f1b.loss, 1e-13 * f1b.loss);
  EXPECT_NEAR(zb.norm, f1b.norm, 1e-12 * f1b.norm);
}

namespace {
// Bytes this rank sent on `group` in step 2 of a trainer of `c`, and the plan's figure for
// its shard.
std::pair<double, double> step_bytes(const Config& c, GroupKind group) {
  Grid grid(MPI_COMM_WORLD, GridShape::from_config(c), false);
  parallel::Trainer<Fp64> trainer(c, grid);
  for (int k = 0; k < trainer.chunks(); ++k) trainer.data_parallel(k).init_weights(7);
  trainer.step(1);
  const auto before = traffic_by_group();
  trainer.step(2);
  const double sent = traffic_since(before)[std::size_t(group)].stats.bytes;
  double planned = -1;
  const auto coord = parallel::plan_shard(c, grid.coord(Axis::t), grid.coord(Axis::p), 0);
  for (const auto& e : parallel::estimate_comm(c, coord))
    if (e.group == group) planned = e.bytes_per_step;
  return {sent, planned};
}

// p = 2 (4 layers) and a second axis of 2 for the split backward's traffic.
Config split_config(const std::string& schedule, std::map<std::string, std::string> extra) {
  extra.insert({{"model%n_layer", "4"}, {"parallel%pp", "2"}, {"run%steps", "2"}});
  return config_for(schedule, schedule == "zb-v" ? 2 : 1, extra);
}
}  // namespace

// A split backward's W gathers the sequence-parallel rows of its output gradients again and
// reruns a recomputation (its collectives, and under ZeRO 3 its parameters' gathers): the
// plan counts them, to the byte.
TEST(Pipeline, SplitBackwardTrafficIsPlanned) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  for (const std::string schedule : {"1f1b", "zb-h1", "zb-v"}) {
    SCOPED_TRACE(schedule);
    for (const std::string recompute : {"none", "selective", "full"}) {
      SCOPED_TRACE(recompute);
      const std::string r = "'" + recompute + "'";
      const auto tp = step_bytes(split_config(schedule, {{"parallel%tp", "2"},
                                                         {"train%recompute", r},
                                                         {"parallel%sequence_parallel", ".true."}}),
                                 GroupKind::tp);
      EXPECT_DOUBLE_EQ(tp.first, tp.second);
      const auto dp = step_bytes(
          split_config(schedule,
                       {{"parallel%dp", "2"}, {"parallel%zero", "3"}, {"train%recompute", r}}),
          GroupKind::dense_grad);
      EXPECT_DOUBLE_EQ(dp.first, dp.second);
    }
  }
}
