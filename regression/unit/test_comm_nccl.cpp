// ptrain-test: np=1 labels=quick timeout=120
// comm/ NcclComm. A CPU build has no NCCL: make_nccl_comm refuses in one line, and make_comm
// keeps groups on MPI. A CUDA build (regression/gpu/check.sh runs this on one GPU; NCCL puts
// no two ranks on one device) runs every operation on tensor memory through a one-rank NCCL
// communicator (in place and not, zero counts; f32, f64, i32, i64 and bf16), host-space
// buffers through MPI, and the refusal of single messages on tensor memory.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "comm/comm.hpp"
#include "test_support.hpp"
#include "util/error.hpp"

using namespace ptrain;

namespace {

#if !defined(PTRAIN_ENABLE_CUDA)

TEST(CommNccl, ACpuBuildRefusesNcclAndKeepsMpi) {
  EXPECT_FALSE(nccl_available());
  try {
    make_nccl_comm(MPI_COMM_WORLD, "tp");
    ADD_FAILURE() << "a CPU build made an NCCL Comm";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "comm: group 'tp': NCCL needs a CUDA build (-DPTRAIN_ENABLE_CUDA=ON)");
  }
  EXPECT_EQ(make_comm(MPI_COMM_WORLD, "test-nccl", {0, false, true})->describe(), "mpi");
}

#else

// n elements of value(i) + shift in tensor memory.
template <class T>
Kokkos::View<T*> filled(std::size_t n, double shift) {
  test::HVec h(n);
  for (std::size_t i = 0; i < n; ++i) h[i] = double((i * 7) % 23) - 11 + shift;
  return test::dev<T>(h);
}

template <class T>
class CommNcclOps : public testing::Test {};
using Types = testing::Types<float, double, std::int32_t, std::int64_t, bf16>;
TYPED_TEST_SUITE(CommNcclOps, Types);

TYPED_TEST(CommNcclOps, EveryOperationOnOneRank) {
  using T = TypeParam;
  const auto c = make_nccl_comm(MPI_COMM_WORLD, "test-nccl");
  ASSERT_EQ(c->describe(), "nccl");
  ASSERT_EQ(c->size(), 1) << "one GPU: NCCL cannot put two ranks on it";
  const std::size_t n = 37;
  const test::HVec want = test::host(filled<T>(n, 0));

  auto sum = filled<T>(n, 0), max = filled<T>(n, 0);
  Request a = c->all_reduce_sum(sum.data(), n);
  Request b = c->all_reduce_max(max.data(), n);  // two in flight
  b.wait();
  a.wait();
  EXPECT_EQ(test::host(sum), want);
  EXPECT_EQ(test::host(max), want);

  for (int count : {0, int(n)}) {  // a zero count, and the whole buffer
    Kokkos::View<T*> send = filled<T>(n, 0), recv("recv", n);
    c->reduce_scatter_sum(send.data(), recv.data(), {count}).wait();
    c->all_gather(send.data(), recv.data(), {count}).wait();
    const test::HVec got = test::host(recv);
    for (int i = 0; i < count; ++i) EXPECT_EQ(got[std::size_t(i)], want[std::size_t(i)]) << i;
  }
  auto in_place = filled<T>(n, 0);
  c->all_gather(in_place.data(), in_place.data(), {int(n)}).wait();
  EXPECT_EQ(test::host(in_place), want);

  Kokkos::View<T*> out("out", n);
  auto data = filled<T>(n, 0);
  c->all_to_all(data.data(), out.data(), n).wait();
  EXPECT_EQ(test::host(out), want);
  Kokkos::View<T*> outv("outv", n);
  c->all_to_allv(data.data(), {int(n)}, outv.data(), {int(n)}).wait();
  EXPECT_EQ(test::host(outv), want);

  // Single messages are refused: posted one by one on one stream they could deadlock.
  Kokkos::View<T*> got("got", n);
  EXPECT_THROW(c->recv(got.data(), n, 0, 0), Error);

  // Host buffers go to MPI.
  std::vector<T> h(n, T(2));
  c->all_reduce_sum(h.data(), n, Space::host).wait();
  EXPECT_EQ(double(h[3]), 2.0);
}

#endif

}  // namespace
