// ptrain-test: np=1,2,4 labels=quick timeout=120
// comm/ HierarchicalComm: the whole conformance suite of test_comm.cpp on it (nodes of two
// ranks: {0, 1}, {2, 3}), then what is its own: the local-major numbering, the bytes each level
// carries, calls in flight waited for in any order (every level starts them in the group's
// order), the factory's choice, and groups it cannot take.
#ifndef PTRAIN_TEST_HIERARCHICAL
#define PTRAIN_TEST_HIERARCHICAL 1
#endif
#include "test_comm.cpp"

namespace {

HierarchicalComm two_per_node(const char* name) {
  return HierarchicalComm(MPI_COMM_WORLD, name, world_rank() / 2, PTRAIN_TEST_TRANSPORT);
}

TEST(CommHierarchical, RanksAreNumberedLocalMajor) {
  HierarchicalComm c = two_per_node("test-h-order");
  const int L = std::min(world_size(), 2), N = world_size() / L;
  EXPECT_EQ(c.ranks_per_node(), L);
  EXPECT_EQ(c.nodes(), N);
  // World rank w is the (w % 2)-th rank of node w / 2: rank (w % 2) * N + w / 2.
  EXPECT_EQ(c.rank(), (world_rank() % L) * N + world_rank() / L);
}

// Each level counts, on its own row, what its own call carries.
TEST(CommHierarchical, LevelsCountTheirShare) {
  HierarchicalComm c = two_per_node("test-h-bytes");
  const double L = c.ranks_per_node(), N = c.nodes(), D = c.size();
  const std::size_t n = 1001;  // pieces of 501 and 500 inside a node of 2
  const double mine = world_size() == 1 ? 1001 : (world_rank() % 2 == 0 ? 501 : 500);
  std::vector<double> x(n, 1.0);
  const auto before = traffic_by_group();
  c.all_reduce_sum(x.data(), n).wait();
  auto since = traffic_since(before);
  EXPECT_DOUBLE_EQ(row(since, "test-h-bytes").stats.bytes, 2 * (D - 1) / D * double(n) * 8);
  EXPECT_DOUBLE_EQ(row(since, "test-h-bytes-intra").stats.bytes, 2 * (L - 1) / L * double(n) * 8);
  EXPECT_DOUBLE_EQ(row(since, "test-h-bytes-inter").stats.bytes, 2 * (N - 1) / N * mine * 8);
  for (double v : x) ASSERT_EQ(v, D);

  // Reduce-scatter and all-gather: the node level carries (L-1)/L of everything, the
  // inter-node level (N-1)/N of this rank's chunk (its local index's pieces).
  const std::vector<int> counts = uneven_counts(c.size(), false);
  const int l = world_rank() % 2;
  double chunk = 0;
  for (int k = 0; k < c.nodes(); ++k) chunk += counts[std::size_t(l * c.nodes() + k)];
  std::vector<double> send(std::size_t(total(counts)), 1.0), recv(send.size());
  const auto mid = traffic_by_group();
  c.reduce_scatter_sum(send.data(), recv.data(), counts).wait();
  c.all_gather(recv.data(), send.data(), counts).wait();
  since = traffic_since(mid);
  EXPECT_DOUBLE_EQ(row(since, "test-h-bytes-intra").stats.bytes,
                   2 * (L - 1) / L * total(counts) * 8);
  EXPECT_DOUBLE_EQ(row(since, "test-h-bytes-inter").stats.bytes, 2 * (N - 1) / N * chunk * 8);
}

// Twelve calls of three kinds in flight, waited for in an order that differs from rank to
// rank (ranks of one node reversed against each other): each level must still start them in
// the group's order everywhere, or the sums mix or the job hangs.
TEST(CommHierarchical, CallsInFlightWaitedForInAnyOrder) {
  HierarchicalComm c = two_per_node("test-h-flight");
  const int me = c.rank(), D = c.size();
  const std::vector<int> counts = uneven_counts(D, true);
  std::vector<std::vector<double>> sums, scattered, gathered, sends;
  std::vector<Request> requests;
  for (int k = 0; k < 4; ++k) {
    const std::size_t n = 5 + 97 * std::size_t(k);
    sums.emplace_back(n);
    for (std::size_t i = 0; i < n; ++i) sums.back()[i] = value(me + k, i);
    sends.emplace_back(std::size_t(total(counts)));
    for (std::size_t i = 0; i < sends.back().size(); ++i) sends.back()[i] = value(me + 2 * k, i);
    scattered.emplace_back(std::size_t(counts[std::size_t(me)]));
    gathered.emplace_back(std::size_t(total(counts)));
  }
  for (int k = 0; k < 4; ++k) {
    requests.push_back(c.all_reduce_sum(sums[std::size_t(k)].data(), sums[std::size_t(k)].size()));
    requests.push_back(c.reduce_scatter_sum(sends[std::size_t(k)].data(),
                                            scattered[std::size_t(k)].data(), counts));
    // Rank r's piece of gather k is its own values, k-shifted.
    std::vector<double>& g = gathered[std::size_t(k)];
    const int at = offsets(counts)[std::size_t(me)];
    for (int j = 0; j < counts[std::size_t(me)]; ++j) g[std::size_t(at + j)] = value(me - k, j);
    requests.push_back(c.all_gather(g.data() + at, g.data(), counts));
  }
  if (world_rank() % 2 == 1) std::reverse(requests.begin(), requests.end());
  for (Request& r : requests) r.wait();
  const std::vector<int> at = offsets(counts);
  for (int k = 0; k < 4; ++k) {
    for (std::size_t i = 0; i < sums[std::size_t(k)].size(); ++i) {
      double s = 0;
      for (int r = 0; r < D; ++r) s += value(r + k, i);
      ASSERT_EQ(sums[std::size_t(k)][i], s) << "all-reduce " << k << ", element " << i;
    }
    for (int j = 0; j < counts[std::size_t(me)]; ++j) {
      double s = 0;
      for (int r = 0; r < D; ++r) s += value(r + 2 * k, std::size_t(at[std::size_t(me)] + j));
      ASSERT_EQ(scattered[std::size_t(k)][std::size_t(j)], s) << "reduce-scatter " << k;
    }
    for (int r = 0; r < D; ++r)
      for (int j = 0; j < counts[std::size_t(r)]; ++j)
        ASSERT_EQ(gathered[std::size_t(k)][std::size_t(at[std::size_t(r)] + j)], value(r - k, j))
            << "all-gather " << k << ", rank " << r;
  }
}

// The factory makes one where the group spans nodes with the same number, more than one, of
// its ranks on each; an MpiComm otherwise.
TEST(CommHierarchical, TheFactoryTakesOnlyEvenMultiNodeGroups) {
  const int w = world_rank(), W = world_size();
  const NodeSpan pairs = W == 4 ? NodeSpan::two_level : NodeSpan::one_node;
  EXPECT_EQ(node_span(MPI_COMM_WORLD, w / 2), pairs);
  EXPECT_EQ(node_span(MPI_COMM_WORLD, 0), NodeSpan::one_node);
  EXPECT_EQ(node_span(MPI_COMM_WORLD, w),
            W == 1 ? NodeSpan::one_node : NodeSpan::flat);  // 1 per node
  if (W == 4) {
    EXPECT_EQ(node_span(MPI_COMM_WORLD, w == 0 ? 0 : 1), NodeSpan::flat);  // 1 and 3
  }
  const auto made = make_comm(MPI_COMM_WORLD, "test-h-factory", {w / 2, true, false});
  EXPECT_EQ(made->describe().rfind("hierarchical (", 0) == 0, W == 4) << made->describe();
  const std::string mpi = to_string(default_transport());
  EXPECT_EQ(make_comm(MPI_COMM_WORLD, "test-h-factory", {w / 2, false, false})->describe(), mpi);
  EXPECT_EQ(make_comm(MPI_COMM_WORLD, "test-h-factory")->describe(), mpi);
  // NCCL where allowed is for CUDA builds: a CPU build's groups inside a node stay on MPI.
  if (!nccl_available()) {
    EXPECT_EQ(make_comm(MPI_COMM_WORLD, "test-h-factory", {0, true, true})->describe(), mpi);
  }
  if (W == 4) {
    try {
      HierarchicalComm(MPI_COMM_WORLD, "test-h-uneven", w == 0 ? 0 : 1);
      ADD_FAILURE() << "nodes of 1 and 3 ranks were taken";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(),
                   "comm: group 'test-h-uneven' has 1 to 3 ranks per node; a hierarchical "
                   "group needs the same number on each node");
    }
  }
}

}  // namespace
