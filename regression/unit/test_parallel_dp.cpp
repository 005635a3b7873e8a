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
#include "util/mpi.hpp"

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
  std::vector<double> loss, norm, bytes, tp_bytes, weights;
  std::vector<double> intra_bytes, inter_bytes;  // a hierarchical dense-grad group's levels
  std::string transports;
  double val_loss = 0;  // after the last step: evaluation sees the updated parameters
  std::vector<std::array<std::size_t, 6>> memory;
};

// The whole model in one-rank flat order from every rank's shard: each rank places the
// elements of its slabs at their global positions (NaN: not held here); replicas
// (data-parallel copies, tensors every tp rank holds) are averaged, after checking every
// element was placed.
std::vector<double> global_weights(const Config& c, const model::ChunkLayout& local,
                                   const std::vector<double>& data, MPI_Comm comm) {
  Config one = c;
  one.parallel.tp = 1;
  const auto whole = model::build_layout(one, {}).at(0);
  std::vector<double> sum(std::size_t(whole.numel), 0.0), count(sum.size(), 0.0);
  for (const auto& t : local.tensors) {
    const auto& g = whole.find(t.name);
    std::int64_t k = t.offset;  // local flat index of the slab's first element
    for (const auto& slab : t.slabs)
      for (std::int64_t e = 0; e < slab.numel(); ++e, ++k) {
        if (std::isnan(data[std::size_t(k)])) continue;
        const auto at = std::size_t(g.offset + test::global_index(t.global_shape, slab, e));
        sum[at] += data[std::size_t(k)];
        count[at] += 1;
      }
  }
  MPI_Allreduce(MPI_IN_PLACE, sum.data(), int(sum.size()), MPI_DOUBLE, MPI_SUM, comm);
  MPI_Allreduce(MPI_IN_PLACE, count.data(), int(count.size()), MPI_DOUBLE, MPI_SUM, comm);
  for (std::size_t i = 0; i < sum.size(); ++i) {
    EXPECT_GT(count[i], 0) << "element " << i << " held by no rank";
    sum[i] /= std::max(count[i], 1.0);
  }
  return sum;
}

// The bytes of table row `group` in `traffic` (0 when there is no such row).
double row_bytes(const std::vector<GroupTraffic>& traffic, const std::string& group) {
  for (const GroupTraffic& t : traffic)
    if (t.group == group) return t.stats.bytes;
  return 0;
}

// ranks_per_node > 0: the grid's nodes are simulated, that many ranks each.
template <class T>
RunRecord train(const Config& c, MPI_Comm comm, int ranks_per_node = 0) {
  Grid grid(comm, GridShape::from_config(c), false, ranks_per_node);
  RunRecord run;
  {
    parallel::Trainer<Uniform<T>> trainer(c, grid);
    run.transports = trainer.transports();
    trainer.data_parallel().init_weights(std::uint64_t(c.run.seed));
    for (std::int64_t s = 1; s <= c.run.steps; ++s) {
      const auto before = traffic_by_group();
      const auto r = trainer.step(s);
      const auto traffic = traffic_since(before);
      trainer.check_replicas(s);  // every grid's replicas agree bit for bit (no false alarm)
      run.loss.push_back(r.loss);
      run.norm.push_back(r.grad_norm);
      run.bytes.push_back(traffic[std::size_t(GroupKind::dense_grad)].stats.bytes);
      run.tp_bytes.push_back(traffic[std::size_t(GroupKind::tp)].stats.bytes);
      run.intra_bytes.push_back(row_bytes(traffic, "dense-grad-intra"));
      run.inter_bytes.push_back(row_bytes(traffic, "dense-grad-inter"));
    }
    run.val_loss = trainer.evaluate().loss;
    // The masters this rank updates, at their flat places (NaN elsewhere: held by others).
    auto& dp = trainer.data_parallel();
    std::vector<double> local(std::size_t(dp.layout().numel), std::nan(""));
    const auto masters = staging::to_host(dp.update_params());
    for (const auto& p : dp.update_pieces())
      for (std::int64_t i = p.lo; i < p.hi; ++i)
        local[std::size_t(i)] = double(masters[std::size_t(p.at + i - p.lo)]);
    run.weights = global_weights(c, trainer.stage().layout(), local, comm);
  }
  return run;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }

// |a - b| / |b| over whole vectors (the final weights of two runs).
double rel_rms(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

template <class T>
void compare_with_one_rank(int zero, double tol, std::map<std::string, std::string> extra = {}) {
  extra["parallel%zero"] = std::to_string(zero);
  if (sizeof(T) == 4) extra["model%dtype"] = "'fp32'";
  if (world_size() > 1 && extra.count("parallel%tp") == 0) {
    const auto layout = model::build_layout(config_for(1, {{"parallel%zero", "0"}}), {}).at(0);
    ASSERT_NE(layout.numel % world_size(), 0) << "the flat size should not divide evenly";
  }
  auto single = extra;  // the reference: the same model and batch on one rank
  single.erase("parallel%tp");
  const RunRecord one = train<T>(config_for(1, single), MPI_COMM_SELF);
  const RunRecord many = train<T>(config_for(world_size(), extra), MPI_COMM_WORLD);
  ASSERT_EQ(one.loss.size(), many.loss.size());
  for (std::size_t s = 0; s < one.loss.size(); ++s) {
    EXPECT_LT(rel(many.loss[s], one.loss[s]), tol) << "loss, step " << s + 1;
    EXPECT_LT(rel(many.norm[s], one.norm[s]), tol) << "grad norm, step " << s + 1;
  }
  ASSERT_EQ(one.weights.size(), many.weights.size());
  EXPECT_LT(rel_rms(many.weights, one.weights), tol) << "final weights";
  EXPECT_LT(rel(many.val_loss, one.val_loss), tol) << "validation loss after the last step";
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

// Tensor parallelism (alone and with data parallelism and ZeRO): the same training.
TEST(TensorParallel, AllRanksAsTpMatchOneRank) {
  const std::string T = std::to_string(world_size());
  if (world_size() == 1 || world_size() > 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  // n_head = tp (heads 4 -> 1 per rank at 4), a vocabulary 37 that tp does not divide.
  std::map<std::string, std::string> tp = {
      {"parallel%tp", T}, {"model%n_head", T}, {"model%d_model", "16"}};
  compare_with_one_rank<double>(0, 1e-10, tp);
  compare_with_one_rank<float>(0, 1e-5, tp);
}

TEST(TensorParallel, SequenceParallelMatchesOneRank) {
  const std::string T = std::to_string(world_size());
  if (world_size() == 1 || world_size() > 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  std::map<std::string, std::string> sp = {{"parallel%tp", T},
                                           {"model%n_head", T},
                                           {"model%d_model", "16"},
                                           {"parallel%sequence_parallel", ".true."}};
  compare_with_one_rank<double>(0, 1e-10, sp);
  compare_with_one_rank<float>(0, 1e-5, sp);
}

TEST(TensorParallel, Tp2WithDataParallelAndZero) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks (tp 2 x dp 2)";
  std::map<std::string, std::string> tp = {
      {"parallel%tp", "2"}, {"model%n_head", "2"}, {"model%d_model", "16"}};
  for (int z : {0, 1, 3}) compare_with_one_rank<double>(z, 1e-10, tp);
  tp["parallel%sequence_parallel"] = ".true.";
  for (int z : {1, 3}) compare_with_one_rank<double>(z, 1e-10, tp);
}

TEST(TensorParallel, BytesPerStepAreTwoAllReducesPerLayerEachWay) {
  const int T = world_size();
  if (T == 1) GTEST_SKIP() << "needs more than one rank";
  const Config c = config_for(
      T, {{"parallel%tp", std::to_string(T)}, {"model%n_head", "4"}, {"model%d_model", "16"}});
  const RunRecord r = train<double>(c, MPI_COMM_WORLD);
  const double ring = 2.0 * (T - 1) / T, w = 8, L = double(c.model.n_layer);
  const double BT = double(c.train.micro_batch * c.model.seq_len), C = double(c.model.d_model);
  const double m = double(c.train.global_batch / c.train.micro_batch);
  // Per micro-batch: forward embedding + 2 per block, backward head + 2 per block, each an
  // all-reduce of (B*T, C); the loss's row max and (sum-exp, target) of B*T. (The gradient
  // norm's scalar is summed over the whole grid at once, not on this group.)
  const double expect = m * ring * w * ((2 + 4 * L) * BT * C + 3 * BT);
  for (double b : r.tp_bytes) EXPECT_DOUBLE_EQ(b, expect);

  // Sequence parallel: each all-reduce becomes a reduce-scatter plus an all-gather of the
  // same total; LayerNorm parameter gradients (2C per LayerNorm) are summed over tp.
  Config sp = c;
  sp.parallel.sequence_parallel = true;
  const RunRecord q = train<double>(sp, MPI_COMM_WORLD);
  const double expect_sp = m * ring * w * ((2 + 4 * L) * BT * C + 3 * BT + (2 * L + 1) * 2 * C);
  for (double b : q.tp_bytes) EXPECT_DOUBLE_EQ(b, expect_sp);
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
    // (The loss and the squared norm are summed in one all-reduce over the whole grid, not
    // on this group.)
    const double ring = double(D - 1) / D;
    const double expect[4] = {
        2 * ring * N * w,                    // all-reduce (not the padding)
        2 * ring * N * w + ring * Npad * w,  // + all-gather params (padded: in place)
        m * ring * N * w + ring * Npad * w,  // reduce-scatter + gather
        // + every unit gathered for its forward and again for its backward, but the
        // embedding (kept for the tied head) once per step
        m * ring * N * w + m * ring * 2 * (N - emb) * w + ring * emb * w};
    for (double b : r.bytes) EXPECT_DOUBLE_EQ(b, expect[z]) << "ZeRO " << z;
  }
}

// Over 2 simulated nodes of 2 ranks the dense-grad group reduces in two levels: every ZeRO
// stage trains as the flat reduction does (fp64, 1e-12), and each level carries its formula:
// per all-reduce of n, 2(L-1)/L n inside the nodes and 2(N-1)/N n/L across; per
// reduce-scatter or all-gather of n, (L-1)/L n inside and (N-1)/N of the local index's chunk
// (n/L here, the shards being even up to one element) across.
TEST(DataParallel, HierarchicalReductionMatchesTheFlatOne) {
  if (world_size() != 4) GTEST_SKIP() << "needs 2 nodes of 2 ranks";
  for (int z = 0; z <= 3; ++z) {
    SCOPED_TRACE(testing::Message() << "ZeRO " << z);
    const Config flat =
        config_for(4, {{"parallel%zero", std::to_string(z)}, {"backend%comm", "'mpi'"}});
    const Config two_levels = config_for(4, {{"parallel%zero", std::to_string(z)}});
    const RunRecord a = train<double>(flat, MPI_COMM_WORLD, 2);
    const RunRecord b = train<double>(two_levels, MPI_COMM_WORLD, 2);
    const std::string mpi = to_string(default_transport());
    EXPECT_EQ(a.transports, "dense-grad " + mpi);
    EXPECT_EQ(b.transports, "dense-grad hierarchical (2 nodes x 2 ranks, " + mpi + ")");
    for (std::size_t s = 0; s < a.loss.size(); ++s) {
      EXPECT_LT(rel(b.loss[s], a.loss[s]), 1e-12) << "loss, step " << s + 1;
      EXPECT_LT(rel(b.norm[s], a.norm[s]), 1e-12) << "grad norm, step " << s + 1;
      EXPECT_DOUBLE_EQ(b.bytes[s], a.bytes[s]) << "the group's own row counts the same";
      EXPECT_EQ(a.intra_bytes[s] + a.inter_bytes[s], 0);
    }
    EXPECT_LT(rel_rms(b.weights, a.weights), 1e-12) << "final weights";
    // Per call of n elements the flat ring counts (D-1)/D n per rank (twice for an
    // all-reduce) and the node level (L-1)/L n: 2/3 of it, on every rank. Across the nodes a
    // rank carries (N-1)/N of its local index's chunk, uneven between ranks when ZeRO 3's
    // windows are; over all ranks the chunks add up to N n, so the inter-node bytes of the
    // whole group are (N-1)/(D-1) = 1/3 of the flat ones.
    for (std::size_t s = 0; s < b.loss.size(); ++s) {
      EXPECT_NEAR(b.intra_bytes[s], b.bytes[s] * 2 / 3, 1e-9 * b.bytes[s])
          << "inside the nodes, step " << s + 1;
      double sums[2] = {b.inter_bytes[s], b.bytes[s]};
      MPI_Allreduce(MPI_IN_PLACE, sums, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
      EXPECT_NEAR(sums[0], sums[1] / 3, 1e-9 * sums[1]) << "across the nodes, step " << s + 1;
    }
  }
}

// Hybrid sharding (parallel%zero_scope = 'node') over 2 simulated nodes of 2 ranks, two
// micro-batches a step: ZeRO 1-3 train as the global shards do (fp64, 1e-12), over a flat
// dense-grad group and a two-level one. Shards are cut over the L = 2 ranks of a node: the
// node level carries ZeRO 2/3's reduce-scatters and the parameter gathers, (L-1)/L n each
// (ZeRO 1 keeps its all-reduce over the whole group); across the nodes each rank all-reduces
// its shard once a step, 2(N-1)/N of it, N n in all over the 4 ranks.
TEST(DataParallel, HybridShardingMatchesTheGlobalShards) {
  if (world_size() != 4) GTEST_SKIP() << "needs 2 nodes of 2 ranks";
  const std::string mpi = to_string(default_transport());
  for (int z = 1; z <= 3; ++z) {
    for (const char* comm : {"'mpi'", "'auto'"}) {
      SCOPED_TRACE(testing::Message() << "ZeRO " << z << ", backend%comm = " << comm);
      std::map<std::string, std::string> kv = {
          {"parallel%zero", std::to_string(z)}, {"train%micro_batch", "1"}, {"backend%comm", comm}};
      const RunRecord a = train<double>(config_for(4, kv), MPI_COMM_WORLD, 2);
      kv["parallel%zero_scope"] = "'node'";
      const Config c = config_for(4, kv);
      const RunRecord b = train<double>(c, MPI_COMM_WORLD, 2);
      const std::string whole = std::string(comm) == "'mpi'"
                                    ? "dense-grad " + mpi
                                    : "dense-grad hierarchical (2 nodes x 2 ranks, " + mpi + ")";
      EXPECT_EQ(b.transports, whole + ", dense-grad-intra " + mpi + ", dense-grad-inter " + mpi);
      for (std::size_t s = 0; s < a.loss.size(); ++s) {
        EXPECT_LT(rel(b.loss[s], a.loss[s]), 1e-12) << "loss, step " << s + 1;
        EXPECT_LT(rel(b.norm[s], a.norm[s]), 1e-12) << "grad norm, step " << s + 1;
      }
      EXPECT_LT(rel_rms(b.weights, a.weights), 1e-12) << "final weights";
      EXPECT_LT(std::abs(b.val_loss - a.val_loss), 1e-12 * std::abs(a.val_loss));
      if (std::string(comm) != "'mpi'") continue;
      // The levels' formulas (the flat group's own row counts only ZeRO 1's all-reduce).
      const auto layout = model::build_layout(c, {}).at(0);
      const double N = double(layout.numel), w = 8, L = 2, m = 2;
      const double Npad = double((layout.numel + 1) / 2 * 2);
      double emb = 0;
      for (const auto& u : model::units_of(layout))
        if (u.kind == model::Unit::embedding) emb = double(u.hi - u.lo);
      const double ring = (L - 1) / L;
      const double node[4] = {0, ring * Npad * w, m * ring * N * w + ring * Npad * w,
                              m * ring * N * w + m * ring * 2 * (N - emb) * w + ring * emb * w};
      for (std::size_t s = 0; s < b.loss.size(); ++s) {
        EXPECT_DOUBLE_EQ(b.bytes[s], z == 1 ? 2 * 0.75 * N * w : 0.0) << "step " << s + 1;
        EXPECT_DOUBLE_EQ(b.intra_bytes[s], node[z]) << "inside the node, step " << s + 1;
        double across = b.inter_bytes[s];
        MPI_Allreduce(MPI_IN_PLACE, &across, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        EXPECT_DOUBLE_EQ(across, z == 1 ? 0.0 : 2 * N * w) << "across the nodes, step " << s + 1;
      }
    }
  }
}

// The same with a pipeline whose tied embedding is summed over both ends' replicas: pp 2 x
// dp 2, the stage axis fastest, so each dense-grad group has one rank on each node (L = 1:
// every shard whole, replicated over 2 nodes).
TEST(DataParallel, HybridShardingWithAPipelineMatchesTheGlobalShards) {
  if (world_size() != 4) GTEST_SKIP() << "needs 2 nodes of 2 ranks";
  for (int z = 1; z <= 3; ++z) {
    SCOPED_TRACE(testing::Message() << "ZeRO " << z);
    std::map<std::string, std::string> kv = {{"parallel%zero", std::to_string(z)},
                                             {"parallel%pp", "2"},
                                             {"parallel%order", "'p','t','c','e','d'"},
                                             {"train%micro_batch", "1"}};
    const RunRecord a = train<double>(config_for(4, kv), MPI_COMM_WORLD, 2);
    kv["parallel%zero_scope"] = "'node'";
    const RunRecord b = train<double>(config_for(4, kv), MPI_COMM_WORLD, 2);
    EXPECT_NE(b.transports.find("dense-grad-inter"), std::string::npos) << b.transports;
    for (std::size_t s = 0; s < a.loss.size(); ++s) {
      EXPECT_LT(rel(b.loss[s], a.loss[s]), 1e-12) << "loss, step " << s + 1;
      EXPECT_LT(rel(b.norm[s], a.norm[s]), 1e-12) << "grad norm, step " << s + 1;
    }
    EXPECT_LT(rel_rms(b.weights, a.weights), 1e-12) << "final weights";
  }
}

// run%consistency_every: after two checked steps rank `flip` flips a bit of its compute
// weights (its last tensor); the next check throws on every rank alike. Returns the message
// ("" when nothing differs) after checking every rank got the same one.
std::string flip_and_check(const Config& c, int flip, int ranks_per_node = 0) {
  Grid grid(MPI_COMM_WORLD, GridShape::from_config(c), false, ranks_per_node);
  parallel::Trainer<Fp64> trainer(c, grid);
  for (int k = 0; k < trainer.chunks(); ++k)
    trainer.data_parallel(k).init_weights(std::uint64_t(c.run.seed));
  for (std::int64_t s = 1; s <= 2; ++s) {
    trainer.step(s);
    trainer.check_replicas(s);
  }
  if (world_rank() == flip) {
    EXPECT_NE(trainer.data_parallel(trainer.chunks() - 1).flip_weight_bit(), "");
  }
  std::string message;
  try {
    trainer.check_replicas(3);
  } catch (const Error& e) {
    EXPECT_TRUE(e.on_all_ranks());
    EXPECT_EQ(e.exit_code(), kExitRuntime);
    message = e.what();
  }
  const auto all = mpi::all_gather(MPI_COMM_WORLD, message);
  for (const auto& m : all) EXPECT_EQ(m, message) << "rank " << world_rank();
  return message;
}

std::string differs(const std::string& what) {
  return "step 3: replicas differ: " + what +
         ", found by run%consistency_every; no checkpoint was written from this state";
}

TEST(DataParallel, ReplicaCheckNamesAFlippedBit) {
  if (world_size() != 4) GTEST_SKIP() << "a vote needs more than 2 replicas";
  const std::string h = mpi::host_name();
  // Data-parallel copies under ZeRO 0-2 (whole weights on every rank): rank 1 outvoted.
  for (int z = 0; z <= 2; ++z)
    EXPECT_EQ(flip_and_check(config_for(4, {{"parallel%zero", std::to_string(z)}}), 1),
              differs("ln_f.bias on rank 1 (host " + h +
                      ") differs from ranks 0, 2 and 3 (data-parallel replicas)"))
        << "ZeRO " << z;
  // ZeRO 3 keeps one shard a rank: nothing holds a copy of rank 1's ...
  EXPECT_EQ(flip_and_check(config_for(4, {{"parallel%zero", "3"}}), 1), "");
  // ... unless shards are kept per node: rank 1's copy is rank 3's on the other node.
  EXPECT_EQ(flip_and_check(
                config_for(4, {{"parallel%zero", "3"}, {"parallel%zero_scope", "'node'"}}), 1, 2),
            differs("ln_f.bias differs between rank 1 (host " + h + ") and rank 3 (host " + h +
                    ") (replicas on other nodes, parallel%zero_scope = 'node'; no majority says "
                    "which is wrong)"));
  // tp-replicated tensors over tp 2 (ranks 0, 1 and 2, 3), ZeRO 3 over dp (1, 3): rank 3's
  // shard holds ln_f.bias; the copy of 1 and 3 differs from that of 0 and 2 (a tie).
  const std::map<std::string, std::string> tp = {
      {"parallel%tp", "2"}, {"parallel%zero", "3"}, {"model%n_head", "2"}, {"model%d_model", "16"}};
  EXPECT_EQ(flip_and_check(config_for(4, tp), 3),
            differs("ln_f.bias differs between rank 0 (host " + h + ") and rank 1 (host " + h +
                    ") (tp ranks; under ZeRO 3 a rank stands for the copy its data-parallel "
                    "group shards; no majority says which is wrong)"));
  // wte on the first stage (ranks 0, 1) and its tied copy on the last (ranks 2, 3).
  for (int z : {1, 3}) {
    const Config pp = config_for(4, {{"parallel%pp", "2"}, {"parallel%zero", std::to_string(z)}});
    const std::string want =
        z == 1 ? "wte.weight on rank 3 (host " + h +
                     ") differs from ranks 0, 1 and 2 (wte and its tied copy on the last pipeline "
                     "stage)"
               : "wte.weight differs between ranks 0 and 1 (hosts " + h + ", " + h +
                     ") and ranks 2 and 3 (hosts " + h + ", " + h +
                     ") (wte and its tied copy on the last pipeline stage; under ZeRO 3 a rank "
                     "stands for the copy its data-parallel group shards; no majority says which "
                     "is wrong)";
    EXPECT_EQ(flip_and_check(pp, 3), differs(want)) << "ZeRO " << z;
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
    parallel::Trainer<Fp64> trainer(c, grid);
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
