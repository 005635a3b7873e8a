// ptrain-test: np=1,2,4 labels=quick timeout=120
// comm/, the conformance suite of every Comm implementation: every operation on the world
// group, for every element type, against values computed here rank by rank (integers, so
// every sum is exact in every type); and the counters: bytes per operation by the formulas
// of comm/comm.hpp (the same whatever the implementation), exposed time, one table row per
// kind of group shared by its Comms, size-1 groups not "used". Every operation runs on the
// transport PTRAIN_TEST_TRANSPORT: direct MPI here, the staged transport (host copies in and
// out around each operation) in test_comm_staged.cpp, which includes this file; and
// test_comm_hierarchical*.cpp run it all on a HierarchicalComm (PTRAIN_TEST_HIERARCHICAL).
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "comm/comm.hpp"
#include "grid/layout.hpp"
#include "test_support.hpp"
#include "util/error.hpp"

using namespace ptrain;

#ifndef PTRAIN_TEST_TRANSPORT
#define PTRAIN_TEST_TRANSPORT Transport::mpi
#endif
using ptrain::test::world_rank;
using ptrain::test::world_size;

namespace {

// The Comm under test over `comm`: an MpiComm, or with PTRAIN_TEST_HIERARCHICAL a
// HierarchicalComm whose nodes are ranks {0, 1}, {2, 3} (so that at 4 ranks its numbering,
// local-major, differs from the communicator's).
std::unique_ptr<Comm> test_comm(MPI_Comm comm, const char* name) {
#ifdef PTRAIN_TEST_HIERARCHICAL
  int r = 0;
  if (comm != MPI_COMM_NULL) MPI_Comm_rank(comm, &r);
  return std::make_unique<HierarchicalComm>(comm, name, r / 2, PTRAIN_TEST_TRANSPORT);
#else
  return std::make_unique<MpiComm>(comm, name, PTRAIN_TEST_TRANSPORT);
#endif
}

// Element i of what rank r contributes: an integer in [-26, 26].
double value(int r, std::size_t i) { return double((r * 37 + int(i) * 11) % 53) - 26; }
// Element i of the block rank `from` sends to rank `to`.
double value(int from, int to, std::size_t i) { return value(from * 8 + to + 1, i); }

const double kSentinel = -99;  // after the end of every receive buffer: must stay untouched

// Uneven per-rank counts with zeros: D=2 {3, 0}, D=4 {3, 0, 7, 9}; and reversed, so that
// rank 0 also gets a zero.
std::vector<int> uneven_counts(int D, bool reversed) {
  std::vector<int> c(std::size_t(D), 0);
  for (int r = 0; r < D; ++r) c[std::size_t(r)] = r % 3 == 1 ? 0 : 2 * r + 3;
  if (reversed) std::reverse(c.begin(), c.end());
  return c;
}

std::vector<int> offsets(const std::vector<int>& counts) {
  std::vector<int> o(counts.size(), 0);
  std::partial_sum(counts.begin(), counts.end() - 1, o.begin() + 1);
  return o;
}

int total(const std::vector<int>& counts) {
  return std::accumulate(counts.begin(), counts.end(), 0);
}

// recv holds blocks of counts[b] elements (one per sending rank, say), element j of block b
// equal to expected(b, j), then the sentinel.
template <class T, class F>
void expect_blocks(const std::vector<T>& recv, const std::vector<int>& counts, F expected) {
  std::size_t k = 0;
  for (int b = 0; b < int(counts.size()); ++b)
    for (std::size_t j = 0; j < std::size_t(counts[std::size_t(b)]); ++j, ++k)
      EXPECT_EQ(recv[k], T(expected(b, j))) << "block " << b << ", element " << j;
  ASSERT_EQ(recv.size(), k + 1);
  EXPECT_EQ(recv[k], T(kSentinel)) << "written past the end";
}

const GroupTraffic& row(const std::vector<GroupTraffic>& table, const std::string& group) {
  const auto it = std::find_if(table.begin(), table.end(),
                               [&](const GroupTraffic& t) { return t.group == group; });
  if (it == table.end()) throw Error("no table row " + group);
  return *it;
}

template <class T>
class CommOps : public testing::Test {};
using ElementTypes = testing::Types<float, double, std::int32_t, std::int64_t, bf16>;
TYPED_TEST_SUITE(CommOps, ElementTypes);

// bf16 sums and maxima combine in fp32 and round once: with two ranks each element is
// bf16(float(a) + float(b)), exactly (fp32 addition commutes). Random values, so that most
// sums round; a NaN on one rank stays NaN.
TEST(CommBf16, TwoRanksSumInFp32AndRoundOnce) {
  const auto c_owner = test_comm(MPI_COMM_WORLD, "test-ops");
  Comm& c = *c_owner;
  if (c.size() != 2) GTEST_SKIP() << "needs exactly 2 ranks";
  const std::size_t n = 4096;
  const test::HVec mine = test::random_vec(n, 11 + unsigned(c.rank()), -3, 3);
  const test::HVec other = test::random_vec(n, 11 + unsigned(1 - c.rank()), -3, 3);
  std::vector<bf16> sum(n), max(n);
  for (std::size_t i = 0; i < n; ++i) sum[i] = max[i] = bf16(float(mine[i]));
  sum[7] = bf16(c.rank() == 0 ? NAN : 1.0f);
  max[7] = sum[7];
  c.all_reduce_sum(sum.data(), n).wait();
  c.all_reduce_max(max.data(), n).wait();
  int rounded = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (i == 7) continue;
    const float a = bf16(float(mine[i])), b = bf16(float(other[i]));
    ASSERT_EQ(sum[i].bits, bf16(a + b).bits) << i;
    ASSERT_EQ(max[i].bits, bf16(std::max(a, b)).bits) << i;
    rounded += float(sum[i]) != a + b;
  }
  EXPECT_GT(rounded, int(n) / 4) << "the test should exercise rounding";
  EXPECT_TRUE(std::isnan(float(sum[7])));
  EXPECT_TRUE(std::isnan(float(max[7])));
}

TYPED_TEST(CommOps, AllReduceSumAndMax) {
  using T = TypeParam;
  const auto c_owner = test_comm(MPI_COMM_WORLD, "test-ops");
  Comm& c = *c_owner;
  const std::size_t n = 37;
  std::vector<T> sum(n), max(n);
  for (std::size_t i = 0; i < n; ++i) sum[i] = max[i] = T(value(c.rank(), i));
  Request a = c.all_reduce_sum(sum.data(), n);
  Request b = c.all_reduce_max(max.data(), n);  // two in flight on one group
  b.wait();
  a.wait();
  for (std::size_t i = 0; i < n; ++i) {
    double s = 0, m = -std::numeric_limits<double>::infinity();
    for (int r = 0; r < c.size(); ++r) {
      s += value(r, i);
      m = std::max(m, value(r, i));
    }
    EXPECT_EQ(sum[i], T(s)) << i;
    EXPECT_EQ(max[i], T(m)) << i;
  }
}

TYPED_TEST(CommOps, ReduceScatterUnevenAndZeroCounts) {
  using T = TypeParam;
  const auto c_owner = test_comm(MPI_COMM_WORLD, "test-ops");
  Comm& c = *c_owner;
  const int me = c.rank();
  for (bool reversed : {false, true}) {
    const std::vector<int> counts = uneven_counts(c.size(), reversed);
    const std::size_t mine = std::size_t(counts[std::size_t(me)]);
    std::vector<T> send(std::size_t(total(counts))), recv(mine + 1, T(kSentinel));
    for (std::size_t k = 0; k < send.size(); ++k) send[k] = T(value(me, k));
    // The counts are a temporary: the Request keeps what MPI reads until completion.
    c.reduce_scatter_sum(send.data(), recv.data(), uneven_counts(c.size(), reversed)).wait();
    const std::size_t first = std::size_t(offsets(counts)[std::size_t(me)]);
    SCOPED_TRACE(testing::Message() << "reversed " << reversed);
    expect_blocks(recv, {int(mine)}, [&](int, std::size_t j) {
      double s = 0;
      for (int r = 0; r < c.size(); ++r) s += value(r, first + j);
      return s;
    });
  }
}

TYPED_TEST(CommOps, AllGatherInPlaceAndNot) {
  using T = TypeParam;
  const auto c_owner = test_comm(MPI_COMM_WORLD, "test-ops");
  Comm& c = *c_owner;
  const int me = c.rank();
  for (bool reversed : {false, true})
    for (bool in_place : {false, true}) {
      const std::vector<int> counts = uneven_counts(c.size(), reversed), at = offsets(counts);
      const std::size_t mine = std::size_t(counts[std::size_t(me)]);
      std::vector<T> recv(std::size_t(total(counts)) + 1, T(kSentinel)), piece(mine);
      for (std::size_t j = 0; j < mine; ++j) piece[j] = T(value(me, j));
      T* send = piece.data();
      if (in_place) {
        send = recv.data() + at[std::size_t(me)];
        std::copy(piece.begin(), piece.end(), send);
      }
      c.all_gather(send, recv.data(), counts).wait();
      SCOPED_TRACE(testing::Message() << "reversed " << reversed << ", in place " << in_place);
      expect_blocks(recv, counts, [](int r, std::size_t j) { return value(r, j); });
    }
}

// Every rank sends two messages to its right neighbour, receives posted first and matched by
// tag although the sends come in the other order.
TYPED_TEST(CommOps, SendRecvRingMatchedByTag) {
  using T = TypeParam;
  const auto c_owner = test_comm(MPI_COMM_WORLD, "test-ops");
  Comm& c = *c_owner;
  const int D = c.size(), me = c.rank(), left = (me + D - 1) % D, right = (me + 1) % D;
  const std::size_t n7 = 11, n8 = 4;
  std::vector<T> in7(n7 + 1, T(kSentinel)), in8(n8 + 1, T(kSentinel)), out7(n7), out8(n8);
  for (std::size_t i = 0; i < n7; ++i) out7[i] = T(value(me, i));
  for (std::size_t i = 0; i < n8; ++i) out8[i] = T(value(me + 50, i));
  Request r7 = c.recv(in7.data(), n7, left, 7);
  Request r8 = c.recv(in8.data(), n8, left, 8);
  Request s8 = c.send(out8.data(), n8, right, 8);
  Request s7 = c.send(out7.data(), n7, right, 7);
  for (Request* r : {&r7, &r8, &s8, &s7}) r->wait();
  expect_blocks(in7, {int(n7)}, [&](int, std::size_t i) { return value(left, i); });
  expect_blocks(in8, {int(n8)}, [&](int, std::size_t i) { return value(left + 50, i); });
}

TYPED_TEST(CommOps, AllToAll) {
  using T = TypeParam;
  const auto c_owner = test_comm(MPI_COMM_WORLD, "test-ops");
  Comm& c = *c_owner;
  const std::size_t D = std::size_t(c.size()), n = 5;
  std::vector<T> send(D * n), recv(D * n + 1, T(kSentinel));
  for (std::size_t d = 0; d < D; ++d)
    for (std::size_t i = 0; i < n; ++i) send[d * n + i] = T(value(c.rank(), int(d), i));
  c.all_to_all(send.data(), recv.data(), n).wait();
  expect_blocks(recv, std::vector<int>(D, int(n)),
                [&](int s, std::size_t i) { return value(s, c.rank(), i); });
}

TYPED_TEST(CommOps, AllToAllvUnevenAndZeroCounts) {
  using T = TypeParam;
  const auto c_owner = test_comm(MPI_COMM_WORLD, "test-ops");
  Comm& c = *c_owner;
  const int D = c.size(), me = c.rank();
  auto sends = [](int from, int to) { return (from + 2 * to) % 3; };  // 0, 1 or 2 elements
  std::vector<int> send_counts(static_cast<std::size_t>(D)), recv_counts(send_counts);
  for (int r = 0; r < D; ++r) {
    send_counts[std::size_t(r)] = sends(me, r);
    recv_counts[std::size_t(r)] = sends(r, me);
  }
  std::vector<T> send, recv(std::size_t(total(recv_counts)) + 1, T(kSentinel));
  for (int d = 0; d < D; ++d)
    for (std::size_t i = 0; i < std::size_t(sends(me, d)); ++i) send.push_back(T(value(me, d, i)));
  c.all_to_allv(send.data(), send_counts, recv.data(), recv_counts).wait();
  expect_blocks(recv, recv_counts, [&](int s, std::size_t i) { return value(s, me, i); });
}

// What each call adds to the Comm's bytes, against the formulas in comm/comm.hpp.
TYPED_TEST(CommOps, BytesPerOperationAreTheFormulas) {
  using T = TypeParam;
  const auto c_owner = test_comm(MPI_COMM_WORLD, "test-bytes");
  Comm& c = *c_owner;
  const int me = c.rank();
  const double D = c.size(), w = sizeof(T);
  const auto calls0 = c.stats().calls;
  auto bytes_of = [&](auto&& op) {
    const double before = c.stats().bytes;
    op();
    return c.stats().bytes - before;
  };
  std::vector<T> a(64, T(1)), b(64);
  const std::vector<int> counts = uneven_counts(c.size(), false);
  const double n = total(counts);
  EXPECT_DOUBLE_EQ(bytes_of([&] { c.all_reduce_sum(a.data(), 10).wait(); }),
                   2 * (D - 1) / D * 10 * w);
  EXPECT_DOUBLE_EQ(bytes_of([&] { c.all_reduce_max(a.data(), 10).wait(); }),
                   2 * (D - 1) / D * 10 * w);
  EXPECT_DOUBLE_EQ(bytes_of([&] { c.reduce_scatter_sum(a.data(), b.data(), counts).wait(); }),
                   (D - 1) / D * n * w);
  EXPECT_DOUBLE_EQ(bytes_of([&] { c.all_gather(a.data(), b.data(), counts).wait(); }),
                   (D - 1) / D * n * w);
  Request in;
  EXPECT_DOUBLE_EQ(bytes_of([&] { in = c.recv(b.data(), 6, (me + c.size() - 1) % c.size(), 0); }),
                   0);
  EXPECT_DOUBLE_EQ(bytes_of([&] { c.send(a.data(), 6, (me + 1) % c.size(), 0).wait(); }), 6 * w);
  in.wait();
  EXPECT_DOUBLE_EQ(bytes_of([&] { c.all_to_all(a.data(), b.data(), 3).wait(); }), (D - 1) * 3 * w);
  std::vector<int> ones(std::size_t(c.size()), 1);
  ones[std::size_t(me)] = 2;  // to itself: not counted
  std::vector<int> from(std::size_t(c.size()), 1);
  from[std::size_t(me)] = 2;
  EXPECT_DOUBLE_EQ(bytes_of([&] { c.all_to_allv(a.data(), ones, b.data(), from).wait(); }),
                   (D - 1) * w);
  double x[3] = {1, 2, 3};
  EXPECT_DOUBLE_EQ(bytes_of([&] { c.all_reduce_sum_now(x, 3); }), 2 * (D - 1) / D * 3 * 8);
  EXPECT_EQ(c.stats().calls - calls0, 9);
  c.reset_stats();
  EXPECT_EQ(c.stats().bytes, 0);
  EXPECT_EQ(c.stats().calls, 0);
}

TEST(CommTable, RowsStartWithTheGridGroupsInOrder) {
  const auto table = traffic_by_group();
  ASSERT_GE(table.size(), std::size_t(kNumGroupKinds));
  for (int g = 0; g < kNumGroupKinds; ++g)
    EXPECT_EQ(table[std::size_t(g)].group, group_name(GroupKind(g)));
  EXPECT_FALSE(table[std::size_t(GroupKind::embed)].used) << "no Comm of that kind here";
}

TEST(CommTable, CommsOfOneKindShareARow) {
  const auto before = traffic_by_group();
  const auto a_owner = test_comm(MPI_COMM_WORLD, "test-shared");
  const auto b_owner = test_comm(MPI_COMM_WORLD, "test-shared");
  Comm &a = *a_owner, &b = *b_owner;
  std::vector<double> x(20, 1.0);
  a.all_reduce_sum(x.data(), 20).wait();
  b.all_reduce_sum(x.data(), 7).wait();
  b.all_reduce_sum_now(x.data(), 3);
  const auto since = traffic_since(before);
  EXPECT_EQ(std::count_if(since.begin(), since.end(),
                          [](const GroupTraffic& t) { return t.group == "test-shared"; }),
            1);
  const GroupTraffic& t = row(since, "test-shared");
  EXPECT_EQ(t.used, world_size() > 1);
  EXPECT_DOUBLE_EQ(t.stats.bytes, a.stats().bytes + b.stats().bytes);
  EXPECT_NEAR(t.stats.exposed_s, a.stats().exposed_s + b.stats().exposed_s, 1e-12);
  EXPECT_EQ(t.stats.calls, 3);

  // The next difference counts only what came after.
  const auto mid = traffic_by_group();
  a.all_reduce_sum(x.data(), 5).wait();
  const double D = world_size();
  EXPECT_DOUBLE_EQ(row(traffic_since(mid), "test-shared").stats.bytes, 2 * (D - 1) / D * 5 * 8);
  EXPECT_EQ(row(traffic_since(mid), "test-shared").stats.calls, 1);
}

TEST(CommTable, SizeOneGroupsAreNotUsed) {
  const auto self_owner = test_comm(MPI_COMM_SELF, "test-self");
  Comm& self = *self_owner;
  double x[4] = {1, 2, 3, 4};
  self.all_reduce_sum(x, 4).wait();
  EXPECT_EQ(x[3], 4);
  const auto table = traffic_by_group();
  const GroupTraffic& t = row(table, "test-self");
  EXPECT_FALSE(t.used);
  EXPECT_EQ(t.stats.bytes, 0);
  EXPECT_EQ(t.stats.calls, 1);
  // Once a Comm of a kind spans ranks, the kind is used.
  const auto world = test_comm(MPI_COMM_WORLD, "test-self");
  EXPECT_EQ(row(traffic_by_group(), "test-self").used, world_size() > 1);
}

// Time blocked in a wait (or in all_reduce_sum_now) is exposed time, of the Comm, its row and
// the process-wide total (what the straggler report subtracts from a phase).
TEST(CommTable, WaitsCountAsExposedTime) {
  if (world_size() == 1) GTEST_SKIP() << "needs a second rank to wait for";
  const auto c_owner = test_comm(MPI_COMM_WORLD, "test-exposed");
  Comm& c = *c_owner;
  const double process_before = exposed_seconds();
  double x = 1;
  if (c.rank() == 0) {
    usleep(60000);
    c.send(&x, 1, 1, 3).wait();
  } else if (c.rank() == 1) {
    c.recv(&x, 1, 0, 3).wait();
    EXPECT_GE(c.stats().exposed_s, 0.05);
  }
  const double before = c.stats().exposed_s;
  if (c.rank() == 0) usleep(60000);
  c.all_reduce_sum_now(&x, 1);
  if (c.rank() != 0) {
    EXPECT_GE(c.stats().exposed_s - before, 0.05);
  }
  EXPECT_DOUBLE_EQ(row(traffic_by_group(), "test-exposed").stats.exposed_s, c.stats().exposed_s);
  EXPECT_NEAR(exposed_seconds() - process_before, c.stats().exposed_s, 1e-9);
}

TEST(CommErrors, BadArgumentsAreRefusedBeforeMpi) {
  const auto c_owner = test_comm(MPI_COMM_WORLD, "test-errors");
  Comm& c = *c_owner;
  std::vector<double> x(8);
  EXPECT_THROW(c.all_gather(x.data(), x.data(), std::vector<int>(std::size_t(c.size()) + 1, 1)),
               Error);
  EXPECT_THROW(
      c.reduce_scatter_sum(x.data(), x.data(), std::vector<int>(std::size_t(c.size()), -1)), Error);
  EXPECT_THROW(c.send(x.data(), 1, c.size(), 0), Error);
  EXPECT_THROW(c.recv(x.data(), 1, -1, 0), Error);
  EXPECT_THROW(test_comm(MPI_COMM_NULL, "pp"), Error);
}

}  // namespace

TEST(CommTransport, TheTransportAskedForIsTheOneUsed) {
  const auto c_owner = test_comm(MPI_COMM_WORLD, "test-ops");
  Comm& c = *c_owner;
  const std::string transport = to_string(PTRAIN_TEST_TRANSPORT);
#ifdef PTRAIN_TEST_HIERARCHICAL
  const int L = std::min(world_size(), 2);
  EXPECT_EQ(c.describe(),
            cat("hierarchical (", world_size() / L, " nodes x ", L, " ranks, ", transport, ")"));
#else
  EXPECT_EQ(c.describe(), transport);
#endif
  // On a CPU build tensor memory is host memory: MPI reaches it directly.
  EXPECT_EQ(default_transport(), Transport::mpi);
  EXPECT_STREQ(to_string(Transport::staged_mpi), "staged-mpi");
}
