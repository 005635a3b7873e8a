// ptrain-test: np=1 labels=quick timeout=120 threads=4
// Blockwise attention against a naive (T x T) reference, its backward against central
// finite differences in fp64, and the context-parallel contract: attention over all keys
// equals the lse-merge of attentions over disjoint key chunks, and per-chunk backwards
// with the merged out/lse sum to the full backward. bf16 storage (fp32 arithmetic, fp32 lse)
// against the fp64 kernels on the same bf16-rounded inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/parallel.hpp"
#include "test_support.hpp"
#include "util/bf16.hpp"
#include "util/element_types.hpp"
#include "util/error.hpp"

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
  Kokkos::View<T*> out("out", std::size_t(B) * Tn * NH * HS);
  Kokkos::View<accumulate_t<T>*> lse("lse", std::size_t(B) * NH * Tn);
  attention_forward<T>(out, lse, dev<T>(qkv), B, Tn, NH, HS, cfg);
  return {host(out), host(lse)};
}

// Every test runs on each kernel: the host kernel, and the device kernel with one thread a
// team and with three (threads own rows of a tile, so three exercises rows split unevenly).
struct Variant {
  KernelShape kernel;
  int team_size;
};
Variant g_variant{KernelShape::host, 0};

class KernelsAttention : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override { g_variant = GetParam(); }
};

// The variant's kernel with default blocks.
AttentionConfig base() {
  AttentionConfig c;
  c.kernel = g_variant.kernel;
  c.team_size = g_variant.team_size;
  return c;
}

AttentionConfig blocks(int bq, int bk, bool causal = true) {
  AttentionConfig c = base();
  c.q_block = bq;
  c.k_block = bk;
  c.causal = causal;
  return c;
}

TEST_P(KernelsAttention, ForwardMatchesNaiveForAnyBlocking) {
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

TEST_P(KernelsAttention, ForwardAtModelLikeHeadSize) {
  const int B = 1, Tn = 37, NH = 3, HS = 16;
  const HVec qkv = random_vec(std::size_t(B) * Tn * 3 * NH * HS, 7, -1, 1);
  const Naive ref = naive_qkv(qkv, B, Tn, NH, HS, true);
  for (const auto& cfg : {base(), blocks(5, 7)}) {
    const Naive f = run_qkv<float>(qkv, B, Tn, NH, HS, cfg);
    EXPECT_LT(rel_err(f.out, ref.out), 1e-6);
    EXPECT_LT(rel_err(f.lse, ref.lse), 1e-6);
  }
}

// Queries and packed K/V in separate buffers, at position offsets (a context-parallel step).
TEST_P(KernelsAttention, SeparateBuffersPositionOffsetsAndEmptyRows) {
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

TEST_P(KernelsAttention, BackwardMatchesFiniteDifferences) {
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
TEST_P(KernelsAttention, ModelSizedHeadsMatchNaiveForwardAndBackward) {
  const int B = 2, Tn = 100, NH = 2;
  for (int HS : {16, 32, 48, 64}) {
    const int C = NH * HS;
    const HVec qkv = random_vec(std::size_t(B) * Tn * 3 * C, 40 + HS, -1, 1);
    const HVec R = random_vec(std::size_t(B) * Tn * C, 41 + HS);
    const Naive ref = naive_qkv(qkv, B, Tn, NH, HS, true);
    const HVec dref = naive_backward_qkv(qkv, R, B, Tn, NH, HS);
    for (const auto& cfg : {base(), blocks(48, 40), blocks(37, 64)}) {
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

TEST_P(KernelsAttention, MergeOfKeyChunksEqualsFullAndChunkBackwardsSum) {
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

TEST_P(KernelsAttention, MergeHandlesRowsWithoutKeys) {
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

TEST_P(KernelsAttention, RejectsBadConfigAndShortViews) {
  const int B = 1, Tn = 4, NH = 1, HS = 2;
  auto qkv = dev<double>(HVec(B * Tn * 3 * NH * HS));
  Kokkos::View<double*> out("out", B * Tn * NH * HS), lse("lse", B * NH * Tn);
  EXPECT_THROW(attention_forward<double>(out, lse, qkv, B, Tn, NH, HS, blocks(0, 2)), Error);
  EXPECT_THROW(attention_forward<double>(out, lse, qkv, B, Tn + 1, NH, HS), Error);
  Kokkos::View<double*> short_lse("lse", B * NH * Tn - 1);
  EXPECT_THROW(attention_forward<double>(out, short_lse, qkv, B, Tn, NH, HS), Error);
}

// ---- bf16: q, k, v, out, dout and the gradients stored in bf16; arithmetic and lse in fp32 ----
//
// Every input is rounded to bf16 before the fp64 reference sees it, so only the kernels' own
// rounding is measured. bf16 has an 8-bit significand: rounding a value to it once moves it by
// at most u = 2^-8 of itself. The kernels compute in fp32 (relative error of order 1e-7 times a
// growth of at most a few hundred at these sizes, negligible against u) and round each output
// once, where they store it. So:
//  - out: per element |out - ref| <= u |ref| + (fp32 error); in a row's max norm,
//    max |out - ref| / max |ref| <= u (1 + 1e-4) < 1.5 u. Norm-wise rel_err is about u / sqrt(3)
//    (rounding errors spread uniformly); its bound 4 u is loose on purpose.
//  - lse: fp32 and never rounded to bf16, so fp32 accuracy: relative 1e-5.
//  - gradients: their own final rounding (<= u), plus the rounding of out, which the backward
//    reads in D = rowsum(dO * O): up to u of each term of D, entering dS = P (dP - D) and so all
//    three gradients (dO is bf16 too, but rounded before the reference sees it). Two roundings
//    of size u: about 2 u norm-wise at most, and the bound 4 u allows another factor 2 for
//    growth of out's rounding through dP - D. With key chunks (context parallelism) out is
//    rounded twice (chunk, merge) and dQ once per chunk: a third and fourth rounding, still
//    within 4 u norm-wise as measured (printed). A kernel that accumulated in bf16 shows errors
//    of several u even norm-wise (Bf16ErrorBoundsCatchBf16Accumulation).
// And exactly: the bf16 kernels run the fp32 block code on operands widened to fp32, so every
// bf16 result is the fp32 kernel's result on the same (bf16-valued) inputs, rounded once.
constexpr double kU = 1.0 / 256;  // 2^-8

double round_bf16(double x) { return double(float(bf16(float(x)))); }
HVec round_bf16(HVec v) {
  for (auto& x : v) x = round_bf16(x);
  return v;
}

// The largest max-norm relative error of a row: over the rows (b, t, h) of (B, Tq, NH*HS)
// outputs whose query (at position q_pos0 + t, causal against keys from position 0) sees at
// least min_keys keys, max_d |a - ref| / max_d |ref|.
double worst_row_err(const HVec& a, const HVec& ref, int B, int Tq, int NH, int HS, int q_pos0,
                     int min_keys) {
  double worst = 0;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < Tq; ++t) {
      if (q_pos0 + t + 1 < min_keys) continue;
      for (int h = 0; h < NH; ++h) {
        double num = 0, den = 0;
        for (int d = 0; d < HS; ++d) {
          const std::size_t i = (std::size_t(b) * Tq + t) * NH * HS + std::size_t(h) * HS + d;
          num = std::max(num, std::abs(a[i] - ref[i]));
          den = std::max(den, std::abs(ref[i]));
        }
        worst = std::max(worst, num / std::max(den, 1e-300));
      }
    }
  return worst;
}

// max_i |a - ref| / max(1, |ref|) over finite entries (the lse; -inf must match).
double lse_err(const HVec& a, const HVec& ref) {
  EXPECT_EQ(a.size(), ref.size());
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) || std::isinf(ref[i])) {
      EXPECT_EQ(a[i], ref[i]) << "lse entry " << i;
      continue;
    }
    e = std::max(e, std::abs(a[i] - ref[i]) / std::max(1.0, std::abs(ref[i])));
  }
  return e;
}

struct Bf16Shape {
  int B, Tn, NH, HS;
};
// Causal self-attention with T not a multiple of the blocks; T = 130 has rows of 128+ keys.
const std::vector<Bf16Shape> kBf16Shapes = {{2, 77, 3, 32}, {2, 130, 2, 64}};

TEST_P(KernelsAttention, Bf16ForwardIsFp32ArithmeticRoundedOnce) {
  for (const auto& [B, Tn, NH, HS] : kBf16Shapes) {
    const HVec qkv = round_bf16(random_vec(std::size_t(B) * Tn * 3 * NH * HS, 50 + HS, -1, 1));
    for (const auto& cfg : {base(), blocks(5, 7), blocks(48, 40)}) {
      const Naive ref = run_qkv<double>(qkv, B, Tn, NH, HS, cfg);
      const Naive h = run_qkv<bf16>(qkv, B, Tn, NH, HS, cfg);
      const double e_out = rel_err(h.out, ref.out);
      const double e_row = worst_row_err(h.out, ref.out, B, Tn, NH, HS, 0, 1);
      const double e_lse = lse_err(h.lse, ref.lse);
      std::printf(
          "bf16 forward T=%d HS=%d blocks %d,%d: out rel_err %.2e (%.2f u), worst row "
          "%.2f u; lse %.1e\n",
          Tn, HS, cfg.q_block, cfg.k_block, e_out, e_out / kU, e_row / kU, e_lse);
      EXPECT_LT(e_out, 4 * kU) << "T " << Tn << " HS " << HS << " blocks " << cfg.q_block;
      EXPECT_LT(e_row, 1.5 * kU) << "T " << Tn << " HS " << HS << " blocks " << cfg.q_block;
      EXPECT_LT(e_lse, 1e-5) << "T " << Tn << " HS " << HS << " blocks " << cfg.q_block;
      // The fp32 kernel on the same inputs, rounded once.
      const Naive f = run_qkv<float>(qkv, B, Tn, NH, HS, cfg);
      EXPECT_EQ(differing(h.out, round_bf16(f.out)), 0u) << "T " << Tn << " HS " << HS;
      EXPECT_EQ(differing(h.lse, f.lse), 0u) << "T " << Tn << " HS " << HS;
    }
  }
}

// One query row as the forward would compute it were its scratch bf16: the score, the running
// max and sum and the output accumulator rounded to bf16 after every key. Returns out (HS).
HVec bf16_scratch_row(const HVec& qkv, int b, int t, int h, int Tn, int NH, int HS) {
  const int C = NH * HS;
  auto at = [&](int pos, int part, int c) {
    return float(qkv[(std::size_t(b) * Tn + pos) * 3 * C + std::size_t(part) * C + h * HS + c]);
  };
  auto r = [](float x) { return float(bf16(x)); };
  const float scale = 1 / std::sqrt(float(HS));
  float m = -std::numeric_limits<float>::infinity(), l = 0;
  std::vector<float> acc(HS, 0.0f);
  for (int j = 0; j <= t; ++j) {
    float dot = 0;
    for (int c = 0; c < HS; ++c) dot += at(t, 0, c) * at(j, 1, c);
    const float s = r(dot * scale), m_new = std::max(m, s);
    const float corr = r(std::exp(m - m_new)), p = r(std::exp(s - m_new));
    l = r(l * corr + p);
    for (int c = 0; c < HS; ++c) acc[c] = r(acc[c] * corr + p * at(j, 2, c));
    m = m_new;
  }
  HVec o(HS);
  for (int c = 0; c < HS; ++c) o[c] = r(acc[c] / l);
  return o;
}

// The bounds above can fail: on the rows that see 128 or more keys, a forward with bf16 scratch
// (emulated on the host) misses the row bound 1.5 u, and even the norm-wise 4 u, by far; the
// kernels meet them.
TEST_P(KernelsAttention, Bf16ErrorBoundsCatchBf16Accumulation) {
  const int B = 1, Tn = 130, NH = 2, HS = 64, C = NH * HS, first = 127;  // rows 127.. see 128+
  const HVec qkv = round_bf16(random_vec(std::size_t(B) * Tn * 3 * C, 60, -1, 1));
  const Naive ref = run_qkv<double>(qkv, B, Tn, NH, HS, base());
  const Naive h = run_qkv<bf16>(qkv, B, Tn, NH, HS, base());
  const int rows = Tn - first;
  HVec emulated(std::size_t(rows) * C), kernel(emulated.size()), exact(emulated.size());
  for (int t = first; t < Tn; ++t)
    for (int hd = 0; hd < NH; ++hd) {
      const HVec o = bf16_scratch_row(qkv, 0, t, hd, Tn, NH, HS);
      for (int d = 0; d < HS; ++d) {
        const std::size_t i = std::size_t(t - first) * C + hd * HS + d;
        emulated[i] = o[d];
        kernel[i] = h.out[std::size_t(t) * C + hd * HS + d];
        exact[i] = ref.out[std::size_t(t) * C + hd * HS + d];
      }
    }
  const double row_emulated = worst_row_err(emulated, exact, 1, rows, NH, HS, first, 128);
  const double row_kernel = worst_row_err(kernel, exact, 1, rows, NH, HS, first, 128);
  const double norm_emulated = rel_err(emulated, exact), norm_kernel = rel_err(kernel, exact);
  std::printf(
      "rows of 128+ keys: worst row %.2f u (kernel) vs %.2f u (bf16 scratch); "
      "norm-wise %.2f u vs %.2f u\n",
      row_kernel / kU, row_emulated / kU, norm_kernel / kU, norm_emulated / kU);
  EXPECT_LT(row_kernel, 1.5 * kU);
  EXPECT_GT(row_emulated, 1.5 * kU);
  EXPECT_LT(norm_kernel, 4 * kU);
  EXPECT_GT(norm_emulated, 4 * kU);
}

TEST_P(KernelsAttention, Bf16BackwardMatchesFp64AndAccumulatesInFp32) {
  for (const auto& [B, Tn, NH, HS] : kBf16Shapes) {
    const int C = NH * HS;
    const HVec qkv = round_bf16(random_vec(std::size_t(B) * Tn * 3 * C, 70 + HS, -1, 1));
    const HVec R = round_bf16(random_vec(std::size_t(B) * Tn * C, 71 + HS));
    for (const auto& cfg : {base(), blocks(5, 7)}) {
      const Naive d = run_qkv<double>(qkv, B, Tn, NH, HS, cfg);
      auto dref_v = dev<double>(HVec(qkv.size()));
      attention_backward<double>(dref_v, dev<double>(R), dev<double>(d.out), dev<double>(d.lse),
                                 dev<double>(qkv), B, Tn, NH, HS, cfg);
      const HVec dref = host(dref_v);
      // The bf16 forward's out (bf16) and lse (fp32) feed the bf16 backward.
      const Naive h = run_qkv<bf16>(qkv, B, Tn, NH, HS, cfg);
      auto qkvh = dev<bf16>(qkv), douth = dev<bf16>(R), outh = dev<bf16>(h.out);
      auto lseh = dev<float>(h.lse);
      auto dh = dev<bf16>(HVec(qkv.size(), 5.0));  // overwritten
      attention_backward<bf16>(dh, douth, outh, lseh, qkvh, B, Tn, NH, HS, cfg);
      const double e = rel_err(host(dh), dref);
      // fp32 on the same inputs, rounded once
      auto df = dev<float>(HVec(qkv.size()));
      attention_backward<float>(df, dev<float>(R), dev<float>(h.out), lseh, dev<float>(qkv), B, Tn,
                                NH, HS, cfg);
      EXPECT_EQ(differing(host(dh), round_bf16(host(df))), 0u) << "T " << Tn << " HS " << HS;

      // accumulate = true onto bf16 gradients G0 of the same size: T(float(G0) + contribution)
      double rms = 0;
      for (double x : dref) rms += x * x;
      rms = std::sqrt(rms / dref.size());
      const HVec G0 = round_bf16(random_vec(qkv.size(), 72 + HS, -rms, rms));
      auto ga = dev<bf16>(G0);
      const Heads<const bf16> q(qkvh, 0, 3 * C), k(qkvh, C, 3 * C), v(qkvh, 2 * C, 3 * C);
      attention_backward<bf16>(Heads<bf16>(ga, 0, 3 * C), Heads<bf16>(ga, C, 3 * C),
                               Heads<bf16>(ga, 2 * C, 3 * C), douth, outh, lseh, q, k, v, B, Tn, Tn,
                               NH, HS, cfg, true);
      HVec gref = G0;
      for (std::size_t i = 0; i < gref.size(); ++i) gref[i] += dref[i];
      const double ea = rel_err(host(ga), gref);
      auto gf = dev<float>(G0), qkvf = dev<float>(qkv);
      const Heads<const float> qf(qkvf, 0, 3 * C), kf(qkvf, C, 3 * C), vf(qkvf, 2 * C, 3 * C);
      attention_backward<float>(Heads<float>(gf, 0, 3 * C), Heads<float>(gf, C, 3 * C),
                                Heads<float>(gf, 2 * C, 3 * C), dev<float>(R), dev<float>(h.out),
                                lseh, qf, kf, vf, B, Tn, Tn, NH, HS, cfg, true);
      EXPECT_EQ(differing(host(ga), round_bf16(host(gf))), 0u) << "T " << Tn << " HS " << HS;

      std::printf(
          "bf16 backward T=%d HS=%d blocks %d,%d: dqkv rel_err %.2e (%.2f u), "
          "accumulated %.2e (%.2f u)\n",
          Tn, HS, cfg.q_block, cfg.k_block, e, e / kU, ea, ea / kU);
      EXPECT_LT(e, 4 * kU) << "T " << Tn << " HS " << HS << " blocks " << cfg.q_block;
      EXPECT_LT(ea, 4 * kU) << "T " << Tn << " HS " << HS << " blocks " << cfg.q_block;
    }
  }
}

// Context parallelism in bf16: key chunks at k_pos0 merged (fp32 lse), per-chunk backwards
// accumulated; and a query chunk at q_pos0 whose rows see 81 to 130 keys.
TEST_P(KernelsAttention, Bf16KeyAndQueryChunksMatchFp64) {
  const int B = 2, Tn = 130, NH = 2, HS = 32, C = NH * HS, half = 70;
  const HVec qkv = round_bf16(random_vec(std::size_t(B) * Tn * 3 * C, 81, -1, 1));
  const HVec R = round_bf16(random_vec(std::size_t(B) * Tn * C, 82));
  const std::size_t bstride = std::size_t(Tn) * 3 * C;
  const Naive full = run_qkv<double>(qkv, B, Tn, NH, HS, base());
  auto dfull_v = dev<double>(HVec(qkv.size()));
  attention_backward<double>(dfull_v, dev<double>(R), dev<double>(full.out), dev<double>(full.lse),
                             dev<double>(qkv), B, Tn, NH, HS);
  const HVec dfull = host(dfull_v);

  auto qkvh = dev<bf16>(qkv);
  const Heads<const bf16> q(qkvh, 0, 3 * C);
  const Heads<const bf16> k1(qkvh, C, 3 * C, bstride), v1(qkvh, 2 * C, 3 * C, bstride);
  const Heads<const bf16> k2(qkvh, C + half * 3 * C, 3 * C, bstride),
      v2(qkvh, 2 * C + half * 3 * C, 3 * C, bstride);
  AttentionConfig cfg1 = blocks(64, 64), cfg2 = blocks(48, 40);
  cfg2.k_pos0 = half;
  Kokkos::View<bf16*> out("out", B * Tn * C), out2("out2", B * Tn * C);
  Kokkos::View<float*> lse("lse", B * NH * Tn), lse2("lse2", B * NH * Tn);
  attention_forward<bf16>(out, lse, q, k1, v1, B, Tn, half, NH, HS, cfg1);
  attention_forward<bf16>(out2, lse2, q, k2, v2, B, Tn, Tn - half, NH, HS, cfg2);
  // attention_merge<bf16> is the fp32 merge of the widened parts, rounded once
  auto outf = dev<float>(host(out)), lsef = dev<float>(host(lse));
  attention_merge<float>(outf, lsef, dev<float>(host(out2)), dev<float>(host(lse2)), B, Tn, NH, HS);
  attention_merge<bf16>(out, lse, out2, lse2, B, Tn, NH, HS);
  EXPECT_EQ(differing(host(out), round_bf16(host(outf))), 0u);
  EXPECT_EQ(differing(host(lse), host(lsef)), 0u);
  const double e_out = rel_err(host(out), full.out), e_lse = lse_err(host(lse), full.lse);
  EXPECT_LT(e_out, 4 * kU);
  EXPECT_LT(e_lse, 1e-5);

  auto dqkv = dev<bf16>(HVec(qkv.size()));
  auto dout = dev<bf16>(R);
  const Heads<bf16> dq(dqkv, 0, 3 * C);
  const Heads<bf16> dk1(dqkv, C, 3 * C, bstride), dv1(dqkv, 2 * C, 3 * C, bstride);
  const Heads<bf16> dk2(dqkv, C + half * 3 * C, 3 * C, bstride),
      dv2(dqkv, 2 * C + half * 3 * C, 3 * C, bstride);
  attention_backward<bf16>(dq, dk1, dv1, dout, out, lse, q, k1, v1, B, Tn, half, NH, HS, cfg1,
                           true);
  attention_backward<bf16>(dq, dk2, dv2, dout, out, lse, q, k2, v2, B, Tn, Tn - half, NH, HS, cfg2,
                           true);
  const double e_grad = rel_err(host(dqkv), dfull);
  EXPECT_LT(e_grad, 4 * kU);

  // Queries [q0, T) of each sequence (q_pos0 = q0) against all keys, forward and backward.
  const int q0 = 80, Tq = Tn - q0;
  AttentionConfig cq = blocks(16, 64);
  cq.q_pos0 = q0;
  auto qkvd = dev<double>(qkv);
  const Heads<const double> qd(qkvd, q0 * 3 * C, 3 * C, bstride), kd(qkvd, C, 3 * C),
      vd(qkvd, 2 * C, 3 * C);
  const Heads<const bf16> qc(qkvh, q0 * 3 * C, 3 * C, bstride), kc(qkvh, C, 3 * C),
      vc(qkvh, 2 * C, 3 * C);
  const HVec Rc = round_bf16(random_vec(std::size_t(B) * Tq * C, 83));
  Kokkos::View<double*> outd("outd", B * Tq * C), lsed("lsed", B * NH * Tq);
  Kokkos::View<bf16*> outc("outc", B * Tq * C);
  Kokkos::View<float*> lsec("lsec", B * NH * Tq);
  attention_forward<double>(outd, lsed, qd, kd, vd, B, Tq, Tn, NH, HS, cq);
  attention_forward<bf16>(outc, lsec, qc, kc, vc, B, Tq, Tn, NH, HS, cq);
  const double e_qout = rel_err(host(outc), host(outd));
  const double e_qrow = worst_row_err(host(outc), host(outd), B, Tq, NH, HS, q0, 128);
  const double e_qlse = lse_err(host(lsec), host(lsed));
  EXPECT_LT(e_qout, 4 * kU);
  EXPECT_LT(e_qrow, 1.5 * kU);
  EXPECT_LT(e_qlse, 1e-5);
  auto dd = dev<double>(HVec(qkv.size()));
  auto dc = dev<bf16>(HVec(qkv.size()));
  attention_backward<double>(Heads<double>(dd, q0 * 3 * C, 3 * C, bstride),
                             Heads<double>(dd, C, 3 * C), Heads<double>(dd, 2 * C, 3 * C),
                             dev<double>(Rc), outd, lsed, qd, kd, vd, B, Tq, Tn, NH, HS, cq);
  attention_backward<bf16>(Heads<bf16>(dc, q0 * 3 * C, 3 * C, bstride), Heads<bf16>(dc, C, 3 * C),
                           Heads<bf16>(dc, 2 * C, 3 * C), dev<bf16>(Rc), outc, lsec, qc, kc, vc, B,
                           Tq, Tn, NH, HS, cq);
  const double e_qgrad = rel_err(host(dc), host(dd));
  EXPECT_LT(e_qgrad, 4 * kU);
  std::printf(
      "bf16 key chunks: out %.2f u, lse %.1e, dqkv %.2f u; query chunk: out %.2f u "
      "(worst row %.2f u), lse %.1e, dqkv %.2f u\n",
      e_out / kU, e_lse, e_grad / kU, e_qout / kU, e_qrow / kU, e_qlse, e_qgrad / kU);
}

TEST_P(KernelsAttention, Bf16MergeHandlesRowsWithoutKeys) {
  const int B = 1, Tn = 2, NH = 1, HS = 2;
  auto oa = dev<bf16>({1, 2, 3, 4});
  auto la = dev<float>({kNegInf, 0.5});
  auto ob = dev<bf16>({5, 6, 7, 8});
  auto lb = dev<float>({kNegInf, kNegInf});
  attention_merge<bf16>(oa, la, ob, lb, B, Tn, NH, HS);
  EXPECT_EQ(host(oa), (HVec{0, 0, 3, 4}));
  EXPECT_EQ(host(la), (HVec{kNegInf, 0.5}));
}

// The device kernel's result does not depend on its team size: each output element is summed
// by one thread in a fixed order. Needs a space with more than one thread (the Kokkos OpenMP
// build; ctest gives this test 4).
TEST(KernelsAttentionDevice, ResultDoesNotDependOnTeamSize) {
  if (Kokkos::DefaultExecutionSpace().concurrency() < 2)
    GTEST_SKIP() << "one thread: every team size is 1 here";
  const int B = 2, Tn = 130, NH = 2, HS = 64, C = NH * HS;
  const HVec qkv = random_vec(std::size_t(B) * Tn * 3 * C, 91, -1, 1);
  const HVec R = random_vec(std::size_t(B) * Tn * C, 92);
  HVec out1, dqkv1;
  for (int team : {1, 2, 3, 4}) {
    AttentionConfig cfg;
    cfg.kernel = KernelShape::device;
    cfg.team_size = team;
    const Naive f = run_qkv<float>(qkv, B, Tn, NH, HS, cfg);
    auto dqkv = dev<float>(HVec(qkv.size()));
    attention_backward<float>(dqkv, dev<float>(R), dev<float>(f.out), dev<float>(f.lse),
                              dev<float>(qkv), B, Tn, NH, HS, cfg);
    if (team == 1) {
      out1 = f.out;
      dqkv1 = host(dqkv);
      continue;
    }
    EXPECT_EQ(differing(f.out, out1), 0u) << "team size " << team;
    EXPECT_EQ(differing(host(dqkv), dqkv1), 0u) << "team size " << team;
  }
}

// The host kernel's result does not depend on the thread count: each block (a query block of
// a head forward, a head backward) is one thread's, summed in a fixed order. On a Serial
// Kokkos the threads are ptrain's own, set here; a Kokkos OpenMP build fixes its own at start.
template <class T>
void expect_host_threads_agree() {
  const int B = 3, Tn = 131, NH = 2, HS = 40, C = NH * HS;  // partial blocks and tiles
  const HVec qkv = random_vec(std::size_t(B) * Tn * 3 * C, 93, -1, 1);
  const HVec R = random_vec(std::size_t(B) * Tn * C, 94);
  AttentionConfig cfg;
  cfg.kernel = KernelShape::host;
  HVec out1, dqkv1;
  for (int threads : {1, 2, 3}) {
    set_host_threads(threads);
    const Naive f = run_qkv<T>(qkv, B, Tn, NH, HS, cfg);
    auto dqkv = dev<T>(HVec(qkv.size()));
    attention_backward<T>(dqkv, dev<T>(R), dev<T>(f.out), dev<accumulate_t<T>>(f.lse), dev<T>(qkv),
                          B, Tn, NH, HS, cfg);
    if (threads == 1) {
      out1 = f.out;
      dqkv1 = host(dqkv);
      continue;
    }
    EXPECT_EQ(differing(f.out, out1), 0u) << threads << " threads";
    EXPECT_EQ(differing(host(dqkv), dqkv1), 0u) << threads << " threads";
  }
  set_host_threads(1);
}
TEST(KernelsAttentionHost, ResultDoesNotDependOnThreadCount) {
  if (!PTRAIN_OWN_HOST_THREADS) GTEST_SKIP() << "Kokkos' host backend fixes its threads at start";
  expect_host_threads_agree<float>();
  expect_host_threads_agree<bf16>();
}

// Each launch's team scratch at GPT-2 124M and 350M shapes (head size 64, T = 1024) and 13B
// (head size 128, T = 2048), whole sequences and context-parallel chunks, fits the 48 KiB a
// CUDA block gets by default; the host kernel's does not (why there are two).
TEST(KernelsAttentionDevice, ScratchFitsAGpuBlockAtGptShapes) {
  struct Shape {
    const char* model;
    int HS, Tq, Tk;
  };
  const std::vector<Shape> shapes = {{"124M", 64, 1024, 1024},
                                     {"350M", 64, 1024, 1024},
                                     {"13B", 128, 2048, 2048},
                                     {"13B cp4 chunk", 128, 256, 1024}};
  AttentionConfig dev_cfg;
  dev_cfg.kernel = KernelShape::device;
  for (const Shape& s : shapes) {
    const AttentionScratch f = attention_scratch<float>(s.Tq, s.Tk, s.HS, dev_cfg);
    const AttentionScratch h = attention_scratch<bf16>(s.Tq, s.Tk, s.HS, dev_cfg);
    const AttentionScratch d = attention_scratch<double>(s.Tq, s.Tk, s.HS, dev_cfg);
    std::printf("%s (HS %d): device scratch fp32 %zu/%zu B, bf16 %zu/%zu B, fp64 %zu/%zu B\n",
                s.model, s.HS, f.forward, f.backward, h.forward, h.backward, d.forward, d.backward);
    for (const AttentionScratch& a : {f, h, d}) {
      EXPECT_LE(a.forward, kDeviceScratchBytes) << s.model;
      EXPECT_LE(a.backward, kDeviceScratchBytes) << s.model;
      EXPECT_GT(a.forward, kDeviceScratchBytes / 2) << s.model << ": tiles shrank too far";
    }
  }
#if !PTRAIN_DEVICE_BUILD
  AttentionConfig host_cfg;
  host_cfg.kernel = KernelShape::host;
  const AttentionScratch host = attention_scratch<float>(1024, 1024, 64, host_cfg);
  EXPECT_GT(host.forward, kDeviceScratchBytes);
  EXPECT_GT(host.backward, kDeviceScratchBytes);
#endif
}

}  // namespace

// A device build has only the device kernel.
const std::vector<Variant> kVariants = {
#if !PTRAIN_DEVICE_BUILD
    {KernelShape::host, 0},
#endif
    {KernelShape::device, 1},
    {KernelShape::device, 3}};
INSTANTIATE_TEST_SUITE_P(Kernels, KernelsAttention, ::testing::ValuesIn(kVariants),
                         [](const ::testing::TestParamInfo<Variant>& v) {
                           return v.param.kernel == KernelShape::host
                                      ? std::string("host")
                                      : "device_team" + std::to_string(v.param.team_size);
                         });
