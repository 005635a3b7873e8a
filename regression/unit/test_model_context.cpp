// ptrain-test: np=1,2,4 labels=quick timeout=120
// Context parallelism at the layer: ring attention over the cp group (every rank of the
// world here) against the whole-sequence kernel on one rank, for the zigzag and contiguous
// layouts, with chunks that are several kernel blocks long and not aligned to them: the
// forward's out and lse, and the backward's d(qkv), of this rank's rows. And the balance:
// zigzag gives every rank the same causal work (counted), contiguous the known imbalance.
#include <gtest/gtest.h>

#include "comm/comm.hpp"
#include "kernels/attention.hpp"
#include "model/context_parallel.hpp"
#include "test_support.hpp"
#include "util/error.hpp"

using namespace ptrain;
using ptrain::test::HVec;
using ptrain::test::world_rank;
using ptrain::test::world_size;

namespace {

TEST(SequencePieces, EveryPositionOnceAndZigzagPairs) {
  for (int C : {1, 2, 3, 4})
    for (bool zigzag : {true, false}) {
      const int S = 24;
      std::vector<int> seen(S, 0);
      for (int c = 0; c < C; ++c) {
        const auto pieces = model::sequence_pieces(S, c, C, zigzag);
        ASSERT_EQ(pieces.size(), zigzag && C > 1 ? 2u : 1u);
        int local = 0;
        for (const auto& p : pieces) {
          EXPECT_EQ(p.local, local);
          local += p.len;
        }
        EXPECT_EQ(local, S / C);
        for (int pos : model::sequence_positions(pieces)) ++seen[std::size_t(pos)];
        if (zigzag && C > 1) {
          EXPECT_EQ(pieces[0].global, c * S / (2 * C));
          EXPECT_EQ(pieces[1].global, (2 * C - 1 - c) * S / (2 * C));
        }
      }
      for (int n : seen) EXPECT_EQ(n, 1);
    }
  EXPECT_THROW(model::sequence_pieces(30, 0, 4, true), Error);  // 8 does not divide 30
}

// The local rows (B, L, width) of whole (B, S, width) rows at `positions`.
HVec local_rows(const HVec& whole, int B, int S, int width, const std::vector<int>& positions) {
  HVec out;
  for (int b = 0; b < B; ++b)
    for (int pos : positions)
      for (int k = 0; k < width; ++k)
        out.push_back(whole[(std::size_t(b) * S + std::size_t(pos)) * width + std::size_t(k)]);
  return out;
}

double max_abs_diff(const HVec& a, const HVec& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

class Ring : public testing::TestWithParam<bool> {};

TEST_P(Ring, EqualsWholeSequenceAttention) {
  const int C = world_size();
  if (C == 1) GTEST_SKIP() << "the ring needs 2 or more ranks";
  const bool zigzag = GetParam();
  // Chunks of 100 positions (zigzag) or 200: two kernel blocks of 64 and a ragged one.
  const int B = 2, NH = 2, HS = 8, Cl = NH * HS, S = 200 * C;
  const HVec qkv = test::random_vec(std::size_t(B) * S * 3 * Cl, 11);
  const HVec dout = test::random_vec(std::size_t(B) * S * Cl, 12);

  // One rank's whole-sequence attention: the reference.
  auto out_w = Kokkos::View<double*>("out", std::size_t(B) * S * Cl);
  auto lse_w = Kokkos::View<double*>("lse", std::size_t(B) * NH * S);
  auto dqkv_w = Kokkos::View<double*>("dqkv", qkv.size());
  kernels::attention_forward<double>(out_w, lse_w, test::dev<double>(qkv), B, S, NH, HS);
  kernels::attention_backward<double>(dqkv_w, test::dev<double>(dout), out_w, lse_w,
                                      test::dev<double>(qkv), B, S, NH, HS);

  MpiComm comm(MPI_COMM_WORLD, "cp");
  const model::ContextParallel cp(&comm, S, zigzag);
  const int L = cp.local_len();
  const std::vector<int> pos = model::sequence_positions(cp.pieces());
  ASSERT_EQ(int(pos.size()), L);
  auto out = Kokkos::View<double*>("out_l", std::size_t(B) * L * Cl);
  auto lse = Kokkos::View<double*>("lse_l", std::size_t(B) * NH * L);
  auto dqkv = Kokkos::View<double*>("dqkv_l", std::size_t(B) * L * 3 * Cl);
  const auto qkv_l = test::dev<double>(local_rows(qkv, B, S, 3 * Cl, pos));
  model::ring_attention_forward<double>(cp, B, NH, HS, qkv_l, out, lse);
  model::ring_attention_backward<double>(cp, B, NH, HS, qkv_l, out, lse,
                                         test::dev<double>(local_rows(dout, B, S, Cl, pos)), dqkv);

  EXPECT_LT(max_abs_diff(test::host(out), local_rows(test::host(out_w), B, S, Cl, pos)), 1e-13);
  // lse (B, NH, S): rows of one value
  EXPECT_LT(max_abs_diff(test::host(lse), local_rows(test::host(lse_w), B * NH, S, 1, pos)), 1e-12);
  EXPECT_LT(max_abs_diff(test::host(dqkv), local_rows(test::host(dqkv_w), B, S, 3 * Cl, pos)),
            1e-12);
}

TEST_P(Ring, ZigzagBalancesTheCausalWork) {
  const int C = world_size();
  if (C == 1) GTEST_SKIP() << "the ring needs 2 or more ranks";
  const bool zigzag = GetParam();
  const int B = 1, NH = 2, HS = 4, Cl = NH * HS, S = 16 * C;
  MpiComm comm(MPI_COMM_WORLD, "cp");
  const model::ContextParallel cp(&comm, S, zigzag);
  const int L = cp.local_len();
  auto out = Kokkos::View<double*>("out", std::size_t(B) * L * Cl);
  auto lse = Kokkos::View<double*>("lse", std::size_t(B) * NH * L);
  model::ring_attention_forward<double>(
      cp, B, NH, HS, test::dev<double>(test::random_vec(std::size_t(B) * L * 3 * Cl, 3)), out, lse);

  std::vector<long long> pairs(static_cast<std::size_t>(C), 0);
  long long mine = cp.attention_pairs();
  MPI_Allgather(&mine, 1, MPI_LONG_LONG, pairs.data(), 1, MPI_LONG_LONG, MPI_COMM_WORLD);
  // Every causal pair of the sequence is scored exactly once somewhere: S(S+1)/2 per head.
  long long total = 0;
  for (long long p : pairs) total += p;
  EXPECT_EQ(total, (long long)B * NH * S * (S + 1) / 2);
  // Position i sees i+1 keys: a rank scores the sum of (i+1) over its positions.
  for (int r = 0; r < C; ++r) {
    long long expect = 0;
    for (int i : model::sequence_positions(model::sequence_pieces(S, r, C, zigzag)))
      expect += (long long)B * NH * (i + 1);
    EXPECT_EQ(pairs[std::size_t(r)], expect) << "rank " << r;
  }
  const auto [lo, hi] = std::minmax_element(pairs.begin(), pairs.end());
  if (zigzag) {
    EXPECT_EQ(*lo, *hi);  // within the 1%: exactly equal
  } else {
    // chunk c of C, length l = S/C: l*c*l + l(l+1)/2; last over first = (2C-1) l/(l+1) + ...
    const double l = double(S) / C, ratio = (l * (C - 1) * l + l * (l + 1) / 2) / (l * (l + 1) / 2);
    EXPECT_DOUBLE_EQ(double(*hi) / double(*lo), ratio);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, Ring, testing::Bool(), [](const testing::TestParamInfo<bool>& p) {
  return p.param ? "zigzag" : "contiguous";
});

}  // namespace
