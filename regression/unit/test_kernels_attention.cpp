// ptrain-test: np=1 labels=quick timeout=120
// Blockwise attention against a naive (T x T) reference, its backward against central
// finite differences in fp64, and the context-parallel contract: attention over all keys
// equals the lse-merge of attentions over disjoint key chunks, and per-chunk backwards
// with the merged out/lse sum to the full backward.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "kernels/attention.hpp"
#include "util/error.hpp"
#include "test_support.hpp"

using namespace ptrain;
using namespace ptrain::kernels;
using namespace ptrain::test;

namespace {


// Naive attention: element (b, t, c) of q at q[(b*Tq + t)*qld + qoff + c], likewise k, v.
// Materialises every score row; masks key j for query i when causal and
// k_pos0 + j > q_pos0 + i.
struct Naive {
  HVec out, lse;
};
Naive naive_attention(const HVec& q, int qld, int qoff, const HVec& kv, int kvld, int koff,
                      int voff, int B, int Tq, int Tk, int NH, int HS, bool causal, int q_pos0,
                      int k_pos0) {
  const int C = NH * HS;
  Naive r{HVec(std::size_t(B) * Tq * C, 0.0), HVec(std::size_t(B) * NH * Tq, kNegInf)};
  const double scale = 1 / std::sqrt(double(HS));
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < Tq; ++i) {
        std::vector<double> s(Tk, kNegInf);
        double m = kNegInf;
        for (int j = 0; j < Tk; ++j) {
          if (causal && k_pos0 + j > q_pos0 + i) continue;
          double d = 0;
          for (int c = 0; c < HS; ++c)
            d += q[(b * Tq + i) * qld + qoff + h * HS + c] *
                 kv[(b * Tk + j) * kvld + koff + h * HS + c];
          s[j] = d * scale;
          m = std::max(m, s[j]);
        }
        if (m == kNegInf) continue;
        double sum = 0;
        for (int j = 0; j < Tk; ++j) sum += s[j] == kNegInf ? 0 : std::exp(s[j] - m);
        for (int j = 0; j < Tk; ++j) {
          if (s[j] == kNegInf) continue;
          const double p = std::exp(s[j] - m) / sum;
          for (int c = 0; c < HS; ++c)
            r.out[(b * Tq + i) * C + h * HS + c] += p * kv[(b * Tk + j) * kvld + voff + h * HS + c];
        }
        r.lse[(b * NH + h) * Tq + i] = m + std::log(sum);
      }
  return r;
}

Naive naive_qkv(const HVec& qkv, int B, int T, int NH, int HS, bool causal) {
  const int C = NH * HS;
  return naive_attention(qkv, 3 * C, 0, qkv, 3 * C, C, 2 * C, B, T, T, NH, HS, causal, 0, 0);
}

template <class T>
Naive run_qkv(const HVec& qkv, int B, int Tn, int NH, int HS, const AttentionConfig& cfg) {
  Kokkos::View<T*> out("out", std::size_t(B) * Tn * NH * HS), lse("lse", std::size_t(B) * NH * Tn);
  attention_forward<T>(out, lse, dev<T>(qkv), B, Tn, NH, HS, cfg);
  return {host(out), host(lse)};
}

AttentionConfig blocks(int bq, int bk, bool causal = true) {
  AttentionConfig c;
  c.q_block = bq;
  c.k_block = bk;
  c.causal = causal;
  return c;
}

TEST(KernelsAttention, ForwardMatchesNaiveForAnyBlocking) {
  const int B = 2, NH = 2, HS = 3;
  for (int Tn : {1, 7, 16})
    for (bool causal : {true, false}) {
      const HVec qkv = random_vec(std::size_t(B) * Tn * 3 * NH * HS, 100 + Tn, -2, 2);
      const Naive ref = naive_qkv(qkv, B, Tn, NH, HS, causal);
      for (auto [bq, bk] : std::vector<std::pair<int, int>>{
               {2, 3}, {3, 2}, {1, 1}, {7, 7}, {4, 8}, {5, 6}, {64, 128}}) {
        const auto cfg = blocks(bq, bk, causal);
        const Naive d = run_qkv<double>(qkv, B, Tn, NH, HS, cfg);
        EXPECT_LT(rel_err(d.out, ref.out), 1e-14) << "T " << Tn << " blocks " << bq << "," << bk;
        EXPECT_LT(rel_err(d.lse, ref.lse), 1e-14) << "T " << Tn << " blocks " << bq << "," << bk;
        const Naive f = run_qkv<float>(qkv, B, Tn, NH, HS, cfg);
        EXPECT_LT(rel_err(f.out, ref.out), 1e-6) << "T " << Tn << " blocks " << bq << "," << bk;
        EXPECT_LT(rel_err(f.lse, ref.lse), 1e-6) << "T " << Tn << " blocks " << bq << "," << bk;
      }
    }
}

TEST(KernelsAttention, ForwardAtModelLikeHeadSize) {
  const int B = 1, Tn = 37, NH = 3, HS = 16;
  const HVec qkv = random_vec(std::size_t(B) * Tn * 3 * NH * HS, 7, -1, 1);
  const Naive ref = naive_qkv(qkv, B, Tn, NH, HS, true);
  for (const auto& cfg : {AttentionConfig{}, blocks(5, 7)}) {
    const Naive f = run_qkv<float>(qkv, B, Tn, NH, HS, cfg);
    EXPECT_LT(rel_err(f.out, ref.out), 1e-6);
    EXPECT_LT(rel_err(f.lse, ref.lse), 1e-6);
  }
}

// Queries and packed K/V in separate buffers, at position offsets (a context-parallel step).
TEST(KernelsAttention, SeparateBuffersPositionOffsetsAndEmptyRows) {
  const int B = 2, Tq = 5, Tk = 8, NH = 2, HS = 3, C = NH * HS;
  const HVec q = random_vec(std::size_t(B) * Tq * C, 11),
             kv = random_vec(std::size_t(B) * Tk * 2 * C, 12);
  auto qv = dev<double>(q), kvv = dev<double>(kv);
  const Heads<const double> qh(qv, 0, C), kh(kvv, 0, 2 * C), vh(kvv, C, 2 * C);
  for (auto [q0, k0] : std::vector<std::pair<int, int>>{{6, 0}, {0, 3}, {2, 2}, {0, 40}}) {
    AttentionConfig cfg = blocks(2, 3);
    cfg.q_pos0 = q0;
    cfg.k_pos0 = k0;
    Kokkos::View<double*> out("out", B * Tq * C), lse("lse", B * NH * Tq);
    attention_forward<double>(out, lse, qh, kh, vh, B, Tq, Tk, NH, HS, cfg);
    const Naive ref = naive_attention(q, C, 0, kv, 2 * C, 0, C, B, Tq, Tk, NH, HS, true, q0, k0);
    EXPECT_LT(rel_err(host(out), ref.out), 1e-14) << q0 << "," << k0;
    EXPECT_LT(rel_err(host(lse), ref.lse), 1e-14) << q0 << "," << k0;
    if (k0 > q0) {  // query row 0 sees no key
      EXPECT_EQ(host(lse)[0], kNegInf);
      EXPECT_EQ(host(out)[0], 0.0);
    }
  }
}

void check_backward_fd(const AttentionConfig& cfg) {
  const int B = 2, Tn = 7, NH = 2, HS = 3, C = NH * HS;
  const HVec qkv = random_vec(std::size_t(B) * Tn * 3 * C, 21, -1.5, 1.5);
  const HVec R = random_vec(std::size_t(B) * Tn * C, 22);
  auto loss = [&](const HVec& x) { return dot(run_qkv<double>(x, B, Tn, NH, HS, cfg).out, R); };
  const Naive fwd = run_qkv<double>(qkv, B, Tn, NH, HS, cfg);
  auto dqkv = dev<double>(HVec(qkv.size(), 5.0));  // overwritten
  attention_backward<double>(dqkv, dev<double>(R), dev<double>(fwd.out), dev<double>(fwd.lse),
                             dev<double>(qkv), B, Tn, NH, HS, cfg);
  EXPECT_LT(rel_err(host(dqkv), fd_grad(qkv, loss)), 1e-6)
      << "blocks " << cfg.q_block << "," << cfg.k_block << " causal " << cfg.causal;
  // fp32 backward agrees with fp64
  auto dqkvf = dev<float>(HVec(qkv.size()));
  const Naive fwdf = run_qkv<float>(qkv, B, Tn, NH, HS, cfg);
  attention_backward<float>(dqkvf, dev<float>(R), dev<float>(fwdf.out), dev<float>(fwdf.lse),
                            dev<float>(qkv), B, Tn, NH, HS, cfg);
  EXPECT_LT(rel_err(host(dqkvf), host(dqkv)), 1e-5);
}

TEST(KernelsAttention, BackwardMatchesFiniteDifferences) {
  check_backward_fd(blocks(2, 3));
  check_backward_fd(blocks(3, 2));
  check_backward_fd(blocks(3, 2, false));
  check_backward_fd(blocks(64, 128));
  check_backward_fd(blocks(5, 7));  // row groups of every size the kernel has (1 to 6)
}

// Naive causal backward of packed qkv (B, T, 3C) for upstream gradient dout (B, T, C), with
// the whole probability matrix: dV = P^T dO, dS = P (dO V^T - rowsum(P dO V^T)), dQ = s dS K,
// dK = s dS^T Q.
HVec naive_backward_qkv(const HVec& qkv, const HVec& dout, int B, int T, int NH, int HS) {
  const int C = NH * HS, ld = 3 * C;
  const double scale = 1 / std::sqrt(double(HS));
  HVec d(qkv.size(), 0.0);
  auto at = [&](int b, int t, int part, int h, int c) {
    return std::size_t(b * T + t) * ld + std::size_t(part) * C + std::size_t(h) * HS + c;
  };
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < T; ++i) {
        std::vector<double> p(std::size_t(i) + 1), dp(std::size_t(i) + 1);
        double m = kNegInf, sum = 0, pdp = 0;
        for (int j = 0; j <= i; ++j) {
          double s = 0;
          for (int c = 0; c < HS; ++c) s += qkv[at(b, i, 0, h, c)] * qkv[at(b, j, 1, h, c)];
          p[j] = s * scale;
          m = std::max(m, p[j]);
        }
        for (int j = 0; j <= i; ++j) sum += p[j] = std::exp(p[j] - m);
        for (int j = 0; j <= i; ++j) {
          p[j] /= sum;
          dp[j] = 0;
          for (int c = 0; c < HS; ++c)
            dp[j] += dout[std::size_t(b * T + i) * C + h * HS + c] * qkv[at(b, j, 2, h, c)];
          pdp += p[j] * dp[j];
        }
        for (int j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - pdp) * scale;
          for (int c = 0; c < HS; ++c) {
            d[at(b, j, 2, h, c)] += p[j] * dout[std::size_t(b * T + i) * C + h * HS + c];
            d[at(b, i, 0, h, c)] += ds * qkv[at(b, j, 1, h, c)];
            d[at(b, j, 1, h, c)] += ds * qkv[at(b, i, 0, h, c)];
          }
        }
      }
  return d;
}

// Head sizes of one to four whole 16-wide tiles, and blockings whose causal row groups
// compute scores over one to four tiles and a partial one: forward and backward against
// the naive ones.
TEST(KernelsAttention, ModelSizedHeadsMatchNaiveForwardAndBackward) {
  const int B = 2, Tn = 100, NH = 2;
  for (int HS : {16, 32, 48, 64}) {
    const int C = NH * HS;
    const HVec qkv = random_vec(std::size_t(B) * Tn * 3 * C, 40 + HS, -1, 1);
    const HVec R = random_vec(std::size_t(B) * Tn * C, 41 + HS);
    const Naive ref = naive_qkv(qkv, B, Tn, NH, HS, true);
    const HVec dref = naive_backward_qkv(qkv, R, B, Tn, NH, HS);
    for (const auto& cfg : {AttentionConfig{}, blocks(48, 40), blocks(37, 64)}) {
      const Naive d = run_qkv<double>(qkv, B, Tn, NH, HS, cfg);
      EXPECT_LT(rel_err(d.out, ref.out), 1e-13) << "HS " << HS << " blocks " << cfg.q_block;
      auto dqkv = dev<double>(HVec(qkv.size(), 5.0));  // overwritten
      attention_backward<double>(dqkv, dev<double>(R), dev<double>(d.out), dev<double>(d.lse),
                                 dev<double>(qkv), B, Tn, NH, HS, cfg);
      EXPECT_LT(rel_err(host(dqkv), dref), 1e-12) << "HS " << HS << " blocks " << cfg.q_block;
      const Naive f = run_qkv<float>(qkv, B, Tn, NH, HS, cfg);
      EXPECT_LT(rel_err(f.out, ref.out), 1e-6) << "HS " << HS << " blocks " << cfg.q_block;
      auto dqkvf = dev<float>(HVec(qkv.size(), 5.0));
      attention_backward<float>(dqkvf, dev<float>(R), dev<float>(f.out), dev<float>(f.lse),
                                dev<float>(qkv), B, Tn, NH, HS, cfg);
      EXPECT_LT(rel_err(host(dqkvf), dref), 1e-5) << "HS " << HS << " blocks " << cfg.q_block;
    }
  }
}

TEST(KernelsAttention, MergeOfKeyChunksEqualsFullAndChunkBackwardsSum) {
  const int B = 2, Tn = 7, NH = 2, HS = 3, C = NH * HS, half = 3;
  const HVec qkv = random_vec(std::size_t(B) * Tn * 3 * C, 31, -2, 2);
  const HVec R = random_vec(std::size_t(B) * Tn * C, 32);
  auto qkvv = dev<double>(qkv);
  const std::size_t bstride = std::size_t(Tn) * 3 * C;
  const Heads<const double> q(qkvv, 0, 3 * C);
  // keys [0, half) and [half, T) of every sequence
  const Heads<const double> k1(qkvv, C, 3 * C, bstride), v1(qkvv, 2 * C, 3 * C, bstride);
  const Heads<const double> k2(qkvv, C + half * 3 * C, 3 * C, bstride),
      v2(qkvv, 2 * C + half * 3 * C, 3 * C, bstride);
  for (bool causal : {true, false}) {
    AttentionConfig cfg1 = blocks(2, 2, causal), cfg2 = blocks(3, 2, causal);
    cfg2.k_pos0 = half;
    Kokkos::View<double*> out("out", B * Tn * C), lse("lse", B * NH * Tn);
    Kokkos::View<double*> out2("out2", B * Tn * C), lse2("lse2", B * NH * Tn);
    attention_forward<double>(out, lse, q, k1, v1, B, Tn, half, NH, HS, cfg1);
    attention_forward<double>(out2, lse2, q, k2, v2, B, Tn, Tn - half, NH, HS, cfg2);
    attention_merge<double>(out, lse, out2, lse2, B, Tn, NH, HS);
    const Naive full = run_qkv<double>(qkv, B, Tn, NH, HS, blocks(2, 3, causal));
    EXPECT_LT(rel_err(host(out), full.out), 1e-14);
    EXPECT_LT(rel_err(host(lse), full.lse), 1e-14);

    // backward per key chunk with the merged out/lse, accumulated, equals the full backward
    auto dqkv = dev<double>(HVec(qkv.size()));
    auto dfull = dev<double>(HVec(qkv.size()));
    auto dout = dev<double>(R);
    attention_backward<double>(dfull, dout, out, lse, qkvv, B, Tn, NH, HS, blocks(2, 3, causal));
    const Heads<double> dq(dqkv, 0, 3 * C);
    const Heads<double> dk1(dqkv, C, 3 * C, bstride), dv1(dqkv, 2 * C, 3 * C, bstride);
    const Heads<double> dk2(dqkv, C + half * 3 * C, 3 * C, bstride),
        dv2(dqkv, 2 * C + half * 3 * C, 3 * C, bstride);
    attention_backward<double>(dq, dk1, dv1, dout, out, lse, q, k1, v1, B, Tn, half, NH, HS, cfg1,
                               true);
    attention_backward<double>(dq, dk2, dv2, dout, out, lse, q, k2, v2, B, Tn, Tn - half, NH, HS,
                               cfg2, true);
    EXPECT_LT(rel_err(host(dqkv), host(dfull)), 1e-13);
  }
}

TEST(KernelsAttention, MergeHandlesRowsWithoutKeys) {
  const int B = 1, Tn = 2, NH = 1, HS = 2;
  auto oa = dev<double>({1, 2, 3, 4}), la = dev<double>({kNegInf, 0.5});
  auto ob = dev<double>({5, 6, 7, 8}), lb = dev<double>({kNegInf, kNegInf});
  attention_merge<double>(oa, la, ob, lb, B, Tn, NH, HS);
  EXPECT_EQ(host(oa), (HVec{0, 0, 3, 4}));
  EXPECT_EQ(host(la), (HVec{kNegInf, 0.5}));
  auto oc = dev<double>({1, 1, 2, 2}), lc = dev<double>({std::log(3.0), 0.0});
  auto od = dev<double>({3, 3, 4, 4}), ld = dev<double>({std::log(1.0), 0.0});
  attention_merge<double>(oc, lc, od, ld, B, Tn, NH, HS);
  const HVec o = host(oc), l = host(lc);
  EXPECT_NEAR(o[0], 0.75 * 1 + 0.25 * 3, 1e-15);
  EXPECT_NEAR(o[2], 0.5 * 2 + 0.5 * 4, 1e-15);
  EXPECT_NEAR(l[0], std::log(4.0), 1e-15);
  EXPECT_NEAR(l[1], std::log(2.0), 1e-15);
}

TEST(KernelsAttention, RejectsBadConfigAndShortViews) {
  const int B = 1, Tn = 4, NH = 1, HS = 2;
  auto qkv = dev<double>(HVec(B * Tn * 3 * NH * HS));
  Kokkos::View<double*> out("out", B * Tn * NH * HS), lse("lse", B * NH * Tn);
  EXPECT_THROW(attention_forward<double>(out, lse, qkv, B, Tn, NH, HS, blocks(0, 2)), Error);
  EXPECT_THROW(attention_forward<double>(out, lse, qkv, B, Tn + 1, NH, HS), Error);
  Kokkos::View<double*> short_lse("lse", B * NH * Tn - 1);
  EXPECT_THROW(attention_forward<double>(out, short_lse, qkv, B, Tn, NH, HS), Error);
}

}  // namespace
