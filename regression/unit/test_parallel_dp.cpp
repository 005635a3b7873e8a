// ptrain-test: np=1,2,4 labels=quick timeout=300
// Data parallelism and every ZeRO stage against the one-rank run on the same global batch:
// loss and gradient norm per step and the final weights (fp64 to 1e-10, fp32 to 1e-5);
// the bytes each rank sends per step against the ring formulas; memory per category.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "deck/deck.hpp"
#include "grid/grid.hpp"
#include "parallel/trainer.hpp"
#include "test_support.hpp"

using namespace ptrain;
using ptrain::test::world_rank;
using ptrain::test::world_size;

namespace {

Config config_for(int world, std::map<std::string, std::string> extra) {
  std::map<std::string, std::string> kv = {
      {"model%n_layer", "2"},        {"model%d_model", "15"},         {"model%n_head", "3"},
      {"model%vocab", "37"},         {"model%seq_len", "8"},          {"model%ffn_mult", "2"},
      {"model%dtype", "'fp64'"},     {"train%global_batch", "8"},     {"train%micro_batch", "2"},
      {"train%lr", "1e-2"},          {"train%warmup", "1"},           {"train%clip", "0.5"},
      {"train%weight_decay", "0.1"}, {"parallel%bucket_mb", "0.002"}, {"run%steps", "3"}};
  for (auto& [k, v] : extra) kv[k] = v;
  std::vector<std::string> o;
  for (const auto& [k, v] : kv) o.push_back(k + "=" + v);
  Config c = deck::parse_text("", "<test>", o);
  deck::validate(c, world);
  return c;
}

// d_model 15 makes the flat size 15 * 309 = 4635, divisible by neither 2 nor 4, and the
// 0.002 MiB buckets (262 doubles) cut through tensors.

struct RunRecord {
  std::vector<double> loss, norm, bytes, weights;
  std::vector<std::array<std::size_t, 6>> memory;
};

template <class T>
RunRecord train(const Config& c, MPI_Comm comm) {
  Grid grid(comm, GridShape::from_config(c), false);
  RunRecord run;
  {
    parallel::Trainer<T> trainer(c, grid);
    trainer.data_parallel().init_weights(trainer.model(), std::uint64_t(c.run.seed));
    for (std::int64_t s = 1; s <= c.run.steps; ++s) {
      const auto r = trainer.step(s);
      run.loss.push_back(r.loss);
      run.norm.push_back(r.grad_norm);
      run.bytes.push_back(r.comm_bytes);
    }
    for (T w : trainer.data_parallel().gather_weights()) run.weights.push_back(double(w));
  }
  return run;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }

template <class T>
void compare_with_one_rank(int zero, double tol, std::map<std::string, std::string> extra = {}) {
  extra["parallel%zero"] = std::to_string(zero);
  if (sizeof(T) == 4) extra["model%dtype"] = "'fp32'";
  if (world_size() > 1) {
    const auto layout = model::build_layout(config_for(1, extra), {}).at(0);
    ASSERT_NE(layout.numel % world_size(), 0) << "the flat size should not divide evenly";
  }
  const RunRecord one = train<T>(config_for(1, extra), MPI_COMM_SELF);
  const RunRecord many = train<T>(config_for(world_size(), extra), MPI_COMM_WORLD);
  ASSERT_EQ(one.loss.size(), many.loss.size());
  for (std::size_t s = 0; s < one.loss.size(); ++s) {
    EXPECT_LT(rel(many.loss[s], one.loss[s]), tol) << "loss, step " << s + 1;
    EXPECT_LT(rel(many.norm[s], one.norm[s]), tol) << "grad norm, step " << s + 1;
  }
  ASSERT_EQ(one.weights.size(), many.weights.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < one.weights.size(); ++i) {
    num += (many.weights[i] - one.weights[i]) * (many.weights[i] - one.weights[i]);
    den += one.weights[i] * one.weights[i];
  }
  EXPECT_LT(std::sqrt(num / den), tol) << "final weights";
  // The run must have learnt something, or equality would prove little.
  EXPECT_LT(one.loss.back(), one.loss.front());
}

}  // namespace

TEST(DataParallel, Zero0MatchesOneRankFp64) { compare_with_one_rank<double>(0, 1e-10); }
TEST(DataParallel, Zero1MatchesOneRankFp64) { compare_with_one_rank<double>(1, 1e-10); }
TEST(DataParallel, Zero2MatchesOneRankFp64) { compare_with_one_rank<double>(2, 1e-10); }
TEST(DataParallel, Zero3MatchesOneRankFp64) { compare_with_one_rank<double>(3, 1e-10); }
TEST(DataParallel, EveryStageMatchesOneRankFp32) {
  for (int z = 0; z <= 3; ++z) compare_with_one_rank<float>(z, 1e-5);
}
TEST(DataParallel, SgdAndOneMicroBatchPerRank) {
  for (int z : {0, 3})
    compare_with_one_rank<double>(
        z, 1e-10,
        {{"train%optimizer", "'sgd'"}, {"train%micro_batch", "1"}, {"train%global_batch", "4"}});
}

TEST(DataParallel, BytesPerStepAreTheRingFormulas) {
  const int D = world_size();
  for (int z = 0; z <= 3; ++z) {
    const Config c = config_for(D, {{"parallel%zero", std::to_string(z)}});
    const RunRecord r = train<double>(c, MPI_COMM_WORLD);
    const auto layout = model::build_layout(c, {}).at(0);
    const double N = double(layout.numel), w = 8;
    const double Npad = double((layout.numel + D - 1) / D * D);
    double emb = 0;
    for (const auto& u : model::units_of(layout))
      if (u.kind == model::Unit::embedding) emb = double(u.hi - u.lo);
    const double m = double(c.train.global_batch / (c.train.micro_batch * D));
    const double ring = double(D - 1) / D, norm = 2 * ring * 8;  // + the norm's scalar sum
    const double expect[4] = {
        2 * ring * Npad * w + norm,                    // all-reduce
        2 * ring * Npad * w + ring * Npad * w + norm,  // + all-gather params
        m * ring * N * w + ring * Npad * w + norm,     // reduce-scatter + gather
        // + every unit gathered for its forward and again for its backward, but the
        // embedding (kept for the tied head) once per step
        m * ring * N * w + m * ring * 2 * (N - emb) * w + ring * emb * w + norm};
    for (double b : r.bytes) EXPECT_DOUBLE_EQ(b, expect[z]) << "ZeRO " << z;
  }
}

TEST(DataParallel, ShardedStateUsesItsShareOfMemory) {
  const int D = world_size();
  if (D == 1) GTEST_SKIP() << "needs more than one rank";
  auto measure = [&](int z, int world, MPI_Comm comm) {
    const Config c = config_for(world, {{"parallel%zero", std::to_string(z)},
                                        {"model%d_model", "64"},
                                        {"model%n_head", "4"},
                                        {"model%vocab", "301"}});
    Grid grid(comm, GridShape::from_config(c), false);
    const auto base = memory::stats().current;
    parallel::Trainer<double> trainer(c, grid);
    std::array<double, 3> used{};
    for (int k : {0, 1, 2})
      used[std::size_t(k)] = double(memory::stats().current[std::size_t(k)] - base[std::size_t(k)]);
    return used;  // params, grads, optimizer
  };
  const auto whole = measure(0, 1, MPI_COMM_SELF);
  const double ideal[4][3] = {
      {1, 1, 1}, {1, 1, 1.0 / D}, {1, 1.0 / D, 1.0 / D}, {1.0 / D, 1.0 / D, 1.0 / D}};
  for (int z = 0; z <= 3; ++z) {
    const auto mine = measure(z, D, MPI_COMM_WORLD);
    for (int k = 0; k < 3; ++k)
      EXPECT_NEAR(mine[std::size_t(k)] / whole[std::size_t(k)], ideal[z][k], 0.05 * ideal[z][k])
          << "ZeRO " << z << " category " << k;
  }
}
