// ptrain-test: np=1 labels=quick timeout=120
// Kernels against independent oracles: gemm against a naive loop, every backward against
// central finite differences in fp64, cross-entropy against a naive softmax (also split
// over two vocab shards), and a whole tiny GPT (fp32 against fp64, fp64 against finite
// differences). Attention has its own file.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/detail_math.hpp"
#include "kernels/gemm.hpp"
#include "kernels/kernels.hpp"
#include "kernels/parallel.hpp"
#include "test_support.hpp"
#include "util/checksum.hpp"
#include "util/error.hpp"

using namespace ptrain;
using namespace ptrain::kernels;
using namespace ptrain::test;

namespace {

constexpr double kFdTol = 1e-6;

// ---- gemm ------------------------------------------------------------------------------

template <class T>
void check_gemm_against_naive(double tol) {
  const int M = 5, N = 4, K = 3;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const int a_rows = ta ? K : M, a_cols = ta ? M : K;
      const int b_rows = tb ? N : K, b_cols = tb ? K : N;
      const int lda = a_cols + 2, ldb = b_cols + 1, ldc = N + 3;
      const std::size_t a_off = 3, b_off = 1, c_off = 2;
      const HVec A = random_vec(a_off + a_rows * lda, 1), B = random_vec(b_off + b_rows * ldb, 2);
      const HVec C0 = random_vec(c_off + M * ldc, 3);
      const double alpha = 0.7, beta = 0.3;
      auto Cv = dev<T>(C0);
      gemm<T>(ta, tb, M, N, K, T(alpha), dev<T>(A), a_off, lda, dev<T>(B), b_off, ldb, T(beta), Cv,
              c_off, ldc);
      HVec expect = C0;
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
          double s = 0;
          for (int k = 0; k < K; ++k) {
            const double a = ta ? A[a_off + k * lda + i] : A[a_off + i * lda + k];
            const double b = tb ? B[b_off + j * ldb + k] : B[b_off + k * ldb + j];
            s += a * b;
          }
          expect[c_off + i * ldc + j] = alpha * s + beta * C0[c_off + i * ldc + j];
        }
      EXPECT_LT(rel_err(host(Cv), expect), tol) << "trans_a " << ta << " trans_b " << tb;
      // the padding between rows is untouched
      const HVec got = host(Cv);
      for (int i = 0; i < M; ++i)
        for (int j = N; j < ldc && c_off + i * ldc + j < got.size(); ++j)
          EXPECT_EQ(got[c_off + i * ldc + j], double(T(C0[c_off + i * ldc + j])));
    }
}

TEST(KernelsGemm, MatchesNaiveWithTransposesOffsetsAndStrides) {
  check_gemm_against_naive<double>(1e-14);
  check_gemm_against_naive<float>(1e-6);
}

// bf16 operands, fp32 accumulation, fp32 or bf16 C, at shapes that cross the 512-wide blocks
// and panels in M, N and K, with offsets, strides and every transpose. The reference is the
// fp64 product of the same (bf16) inputs. Products of bf16 are exact in fp32, so the error is
// the fp32 sum's: at most (K + 2) 2^-24 of sum_k |alpha a b| + |beta c| per element (the
// standard bound); a bf16 C adds one rounding, 2^-8 of the value (8-bit significand).
template <class Out>
void check_bf16_gemm(bool ta, bool tb, int M, int N, int K) {
  const int a_rows = ta ? K : M, a_cols = ta ? M : K;
  const int b_rows = tb ? N : K, b_cols = tb ? K : N;
  const int lda = a_cols + 3, ldb = b_cols + 1, ldc = N + 2;
  const std::size_t a_off = 5, b_off = 2, c_off = 1;
  auto round_all = [](HVec v) {
    for (double& x : v) x = double(float(bf16(float(x))));
    return v;
  };
  const HVec A = round_all(random_vec(a_off + std::size_t(a_rows) * lda, 11));
  const HVec B = round_all(random_vec(b_off + std::size_t(b_rows) * ldb, 12));
  const HVec C0 = round_all(random_vec(c_off + std::size_t(M) * ldc, 13));
  const float alpha = 0.75f, beta = 0.5f;
  auto Cv = dev<Out>(C0);
  gemm<bf16, Out>(ta, tb, M, N, K, alpha, dev<bf16>(A), a_off, lda, dev<bf16>(B), b_off, ldb, beta,
                  Cv, c_off, ldc);
  const HVec got = host(Cv);
  const double u = std::ldexp(1.0, -24), rounding = std::is_same_v<Out, bf16> ? 0x1p-8 : 0.0;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double s = 0, mag = 0;
      for (int k = 0; k < K; ++k) {
        const double a =
            ta ? A[a_off + std::size_t(k) * lda + i] : A[a_off + std::size_t(i) * lda + k];
        const double b =
            tb ? B[b_off + std::size_t(j) * ldb + k] : B[b_off + std::size_t(k) * ldb + j];
        s += a * b;
        mag += std::fabs(a * b);
      }
      const std::size_t at = c_off + std::size_t(i) * ldc + std::size_t(j);
      const double expect = alpha * s + beta * C0[at];
      const double bound =
          (K + 2) * u * (alpha * mag + beta * std::fabs(C0[at])) + rounding * std::fabs(expect);
      ASSERT_LE(std::fabs(got[at] - expect), bound * (1 + 1e-12))
          << "(" << i << ", " << j << ") trans_a " << ta << " trans_b " << tb;
    }
  for (int i = 0; i < M; ++i)  // the padding between rows is untouched
    for (int j = N; j < ldc && c_off + std::size_t(i) * ldc + j < got.size(); ++j)
      ASSERT_EQ(got[c_off + std::size_t(i) * ldc + j], C0[c_off + std::size_t(i) * ldc + j]);
}

TEST(KernelsGemm, Bf16InputsAccumulateInFp32AcrossBlocks) {
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      check_bf16_gemm<float>(ta, tb, 530, 517, 1030);
      check_bf16_gemm<bf16>(ta, tb, 7, 600, 3);
    }
  check_bf16_gemm<bf16>(false, true, 520, 513, 1100);
}

TEST(KernelsGemm, Bf16BetaZeroOverwritesEvenNaNAndKZeroScales) {
  auto C = dev<bf16>({std::nan(""), std::nan(""), 4, 8});
  gemm<bf16>(false, false, 1, 2, 1, 1.0f, dev<bf16>({2}), dev<bf16>({1, 3}), 0.0f, C);
  EXPECT_EQ(host(C), (HVec{2, 6, 4, 8}));
  auto D = dev<float>({2, 6});
  gemm<bf16, float>(false, false, 1, 2, 0, 1.0f, dev<bf16>({}), dev<bf16>({}), 0.5f, D);
  EXPECT_EQ(host(D), (HVec{1, 3}));
}

TEST(KernelsGemm, BetaZeroOverwritesEvenNaN) {
  auto C = dev<double>(HVec(6, std::numeric_limits<double>::quiet_NaN()));
  gemm<double>(false, false, 2, 3, 1, 1.0, dev<double>({1, 2}), dev<double>({1, 2, 3}), 0.0, C);
  EXPECT_EQ(host(C), (HVec{1, 2, 3, 2, 4, 6}));
}

TEST(KernelsGemm, RejectsMatricesOutsideTheirViews) {
  auto A = dev<double>(HVec(6)), B = dev<double>(HVec(6)), C = dev<double>(HVec(4));
  EXPECT_THROW(gemm<double>(false, false, 2, 2, 3, 1.0, A, 1, 3, B, 0, 2, 0.0, C, 0, 2), Error);
  EXPECT_THROW(gemm<double>(false, false, 2, 2, 3, 1.0, A, 0, 2, B, 0, 2, 0.0, C, 0, 2), Error);
  EXPECT_THROW(gemm<double>(false, false, 2, 2, 3, 1.0, A, 0, 3, B, 0, 2, 0.0, C, 0, 3), Error);
  EXPECT_NO_THROW(gemm<double>(false, false, 2, 2, 3, 1.0, A, 0, 3, B, 0, 2, 0.0, C, 0, 2));
}

TEST(KernelsGemm, PeakProbeAndThreadControl) {
  const int before = blas_threads();
  EXPECT_GE(before, 0);
  if (set_blas_threads(1)) {
    EXPECT_EQ(blas_threads(), 1);
  }
  EXPECT_GT(measure_gemm_peak_gflops(0.02), 0.5);
  if (before > 0) set_blas_threads(before);
}

// ---- helpers, residual, GELU ----------------------------------------------------------------

template <class T>
void check_helpers() {
  const std::size_t n = 10007;  // several reduction chunks and a ragged tail
  const HVec x = random_vec(n, 4), y = random_vec(n, 5);
  auto xv = dev<T>(x), yv = dev<T>(y);
  double ss = 0;
  for (double v : x) ss += double(T(v)) * double(T(v));
  EXPECT_NEAR(sum_of_squares<T>(xv), ss, 1e-12 * ss);
  axpy(yv, T(0.5), xv);
  HVec expect(n);
  for (std::size_t i = 0; i < n; ++i) expect[i] = double(T(y[i]) + T(0.5) * T(x[i]));
  EXPECT_LT(rel_err(host(yv), expect), 1e-15);
  copy(yv, xv);
  EXPECT_LT(rel_err(host(yv), host(xv)), 1e-15);
  fill(yv, T(3));
  EXPECT_EQ(host(yv), HVec(n, 3.0));
  auto out = dev<T>(HVec(n));
  residual_forward(out, xv, yv, n);
  for (std::size_t i = 0; i < n; ++i) expect[i] = double(T(x[i]) + T(3));
  EXPECT_LT(rel_err(host(out), expect), 1e-15);
  EXPECT_THROW(axpy(yv, T(1), dev<T>(HVec(n - 1))), Error);
}

TEST(KernelsHelpers, FillCopyScaleAxpySumOfSquaresResidual) {
  check_helpers<double>();
  check_helpers<float>();
}

// The replica checks' checksum: the host formula of util/checksum.hpp (the checkpoints'),
// the same for any cut of a tensor into views with their first indices, changed by one flipped
// bit and restored by flipping it back.
template <class T>
void check_checksum() {
  const std::size_t n = 10007, cut = 4001;
  const HVec x = random_vec(n, 6);
  auto xv = dev<T>(x);
  std::uint64_t expect = 0;
  for (std::size_t i = 0; i < n; ++i) expect += element_hash(std::int64_t(i), bits_of(T(x[i])));
  const std::uint64_t whole = checksum<T>(xv, 0);
  EXPECT_EQ(whole, expect);
  const auto part = [&](std::size_t a, std::size_t b) {
    return checksum<T>(Kokkos::subview(xv, Kokkos::make_pair(a, b)), std::int64_t(a));
  };
  EXPECT_EQ(part(0, cut) + part(cut, n), whole);
  flip_bit<T>(xv, 5, 0);
  EXPECT_NE(checksum<T>(xv, 0), whole);
  EXPECT_NE(get(xv, 5), double(T(x[5])));
  flip_bit<T>(xv, 5, 0);
  EXPECT_EQ(checksum<T>(xv, 0), whole);
}

TEST(KernelsHelpers, ChecksumOfAnyCutAndFlippedBits) {
  check_checksum<double>();
  check_checksum<float>();
  check_checksum<bf16>();
}

double gelu_ref(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / std::acos(-1.0)) * (x + 0.044715 * x * x * x)));
}

TEST(KernelsGelu, ForwardMatchesFormulaInBothPrecisions) {
  const std::size_t n = 2001;
  HVec x(n), expect(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = -12.0 + 24.0 * double(i) / double(n - 1);
  for (std::size_t i = 0; i < n; ++i) expect[i] = gelu_ref(x[i]);
  auto outd = dev<double>(HVec(n));
  gelu_forward<double>(outd, dev<double>(x), n);
  EXPECT_LT(rel_err(host(outd), expect), 1e-14);
  auto outf = dev<float>(HVec(n));
  gelu_forward<float>(outf, dev<float>(x), n);
  const HVec got = host(outf);
  for (std::size_t i = 0; i < n; ++i)
    EXPECT_NEAR(got[i], expect[i], 3e-7 * std::max(1.0, std::fabs(x[i]))) << "x = " << x[i];
}

TEST(KernelsGelu, BackwardMatchesFiniteDifferencesAndOverwrites) {
  const std::size_t n = 37;
  const HVec x = random_vec(n, 6, -4, 4), R = random_vec(n, 7), d0 = random_vec(n, 8);
  auto loss = [&](const HVec& xx) {
    auto out = dev<double>(HVec(n));
    gelu_forward<double>(out, dev<double>(xx), n);
    return dot(host(out), R);
  };
  auto dx = dev<double>(d0);  // what dx held before is overwritten, not added to
  gelu_backward<double>(dx, dev<double>(x), dev<double>(R), n);
  EXPECT_LT(rel_err(host(dx), fd_grad(x, loss)), kFdTol);
  // fp32 backward agrees with fp64
  auto dxf = dev<float>(d0);
  gelu_backward<float>(dxf, dev<float>(x), dev<float>(R), n);
  EXPECT_LT(rel_err(host(dxf), host(dx)), 2e-6);
}

// ---- linear layer --------------------------------------------------------------------------

void check_matmul(bool with_bias, bool accumulate_dinp) {
  const int N = 5, C = 4, OC = 3;
  const HVec inp = random_vec(N * C, 10), W = random_vec(OC * C, 11), bias = random_vec(OC, 12);
  const HVec R = random_vec(N * OC, 13);
  auto forward = [&](const HVec& i, const HVec& w, const HVec& b) {
    auto out = dev<double>(HVec(N * OC, 99.0));  // overwritten
    matmul_forward<double>(out, dev<double>(i), dev<double>(w),
                           with_bias ? dev<double>(b) : Kokkos::View<double*>(), N, C, OC);
    return host(out);
  };
  // forward vs naive
  const HVec out = forward(inp, W, bias);
  HVec expect(N * OC);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) {
      double s = with_bias ? bias[o] : 0;
      for (int c = 0; c < C; ++c) s += inp[n * C + c] * W[o * C + c];
      expect[n * OC + o] = s;
    }
  EXPECT_LT(rel_err(out, expect), 1e-15);
  // backward vs finite differences; gradients start nonzero to check that dweight and dbias
  // accumulate, and dinp too with accumulate_dinp (else it is overwritten)
  const HVec di0 = random_vec(N * C, 14), dw0 = random_vec(OC * C, 15), db0 = random_vec(OC, 16);
  auto di = dev<double>(di0), dw = dev<double>(dw0), db = dev<double>(db0);
  matmul_backward<double>(di, dw, with_bias ? db : Kokkos::View<double*>(), dev<double>(R),
                          dev<double>(inp), dev<double>(W), N, C, OC, accumulate_dinp);
  EXPECT_LT(rel_err(accumulate_dinp ? minus(host(di), di0) : host(di),
                    fd_grad(inp, [&](const HVec& x) { return dot(forward(x, W, bias), R); })),
            kFdTol);
  EXPECT_LT(rel_err(minus(host(dw), dw0),
                    fd_grad(W, [&](const HVec& x) { return dot(forward(inp, x, bias), R); })),
            kFdTol);
  if (with_bias) {
    EXPECT_LT(rel_err(minus(host(db), db0),
                      fd_grad(bias, [&](const HVec& x) { return dot(forward(inp, W, x), R); })),
              kFdTol);
  } else {
    EXPECT_EQ(host(db), db0);
  }
}

TEST(KernelsMatmul, BackwardMatchesFiniteDifferencesAndOverwritesOrAddsToDinp) {
  for (bool accumulate_dinp : {false, true}) {
    check_matmul(true, accumulate_dinp);
    check_matmul(false, accumulate_dinp);
  }
}

TEST(KernelsMatmul, BiasGradientOverManyColumnsAndRows) {
  // more columns than one reduction chunk (256), ragged
  const int N = 7, C = 3, OC = 300;
  const HVec dout = random_vec(N * OC, 17);
  auto db = dev<double>(HVec(OC, 1.0));
  auto dw = dev<double>(HVec(OC * C));
  matmul_backward<double>(Kokkos::View<double*>(), dw, db, dev<double>(dout),
                          dev<double>(random_vec(N * C, 18)), dev<double>(random_vec(OC * C, 19)),
                          N, C, OC);
  HVec expect(OC, 1.0);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) expect[o] += dout[n * OC + o];
  EXPECT_LT(rel_err(host(db), expect), 1e-15);
}

// ---- layer norm -------------------------------------------------------------------------------

TEST(KernelsLayernorm, ForwardStatsAndBackwardFiniteDifferences) {
  const int N = 3, C = 37;  // C: two vector chunks and a tail
  const HVec x = random_vec(N * C, 20, -2, 3), w = random_vec(C, 21), b = random_vec(C, 22);
  const HVec R = random_vec(N * C, 23);
  Kokkos::View<double*> mean("mean", N), rstd("rstd", N);
  auto forward = [&](const HVec& xx, const HVec& ww, const HVec& bb) {
    auto out = dev<double>(HVec(N * C));
    layernorm_forward<double>(out, mean, rstd, dev<double>(xx), dev<double>(ww), dev<double>(bb), N,
                              C);
    return host(out);
  };
  const HVec out = forward(x, w, b);
  for (int n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int c = 0; c < C; ++c) m += x[n * C + c] / C;
    for (int c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m) / C;
    const double s = 1 / std::sqrt(v + 1e-5);
    EXPECT_NEAR(host(mean)[n], m, 1e-14);
    EXPECT_NEAR(host(rstd)[n], s, 1e-13 * s);
    for (int c = 0; c < C; ++c)
      EXPECT_NEAR(out[n * C + c], (x[n * C + c] - m) * s * w[c] + b[c], 1e-13);
  }
  const HVec dx0 = random_vec(N * C, 24), dw0 = random_vec(C, 25), db0 = random_vec(C, 26);
  auto dx = dev<double>(dx0), dw = dev<double>(dw0), db = dev<double>(db0);
  forward(x, w, b);  // mean, rstd of the unperturbed input
  layernorm_backward<double>(dx, dw, db, dev<double>(R), dev<double>(x), dev<double>(w), mean, rstd,
                             N, C);
  EXPECT_LT(rel_err(minus(host(dx), dx0),
                    fd_grad(x, [&](const HVec& v) { return dot(forward(v, w, b), R); })),
            kFdTol);
  EXPECT_LT(rel_err(minus(host(dw), dw0),
                    fd_grad(w, [&](const HVec& v) { return dot(forward(x, v, b), R); })),
            kFdTol);
  EXPECT_LT(rel_err(minus(host(db), db0),
                    fd_grad(b, [&](const HVec& v) { return dot(forward(x, w, v), R); })),
            kFdTol);
}

// ---- embeddings ----------------------------------------------------------------------------

TEST(KernelsEncoder, VocabShardAndPositionsForwardAndBackward) {
  const int B = 2, T = 3, C = 5, V = 9, v_begin = 3, v_local = 4, max_pos = 6;
  const std::vector<int> tokens = {3, 0, 6, 8, 4, 3};  // 0 and 8 are outside [3, 7)
  const std::vector<int> positions = {4, 5, 2};        // e.g. a context-parallel chunk
  const HVec wte_full = random_vec(V * C, 30), wpe = random_vec(max_pos * C, 31);
  const HVec wte(wte_full.begin() + v_begin * C, wte_full.begin() + (v_begin + v_local) * C);
  const HVec R = random_vec(B * T * C, 32);
  auto tok = dev_ints(tokens), pos = dev_ints(positions);
  auto forward = [&](const HVec& te, const HVec& pe) {
    auto out = dev<double>(HVec(B * T * C, 7.0));
    encoder_forward<double>(out, tok, pos, dev<double>(te), dev<double>(pe), B, T, C, v_begin,
                            v_local);
    return host(out);
  };
  const HVec out = forward(wte, wpe);
  for (int n = 0; n < B * T; ++n) {
    const bool mine = tokens[n] >= v_begin && tokens[n] < v_begin + v_local;
    for (int c = 0; c < C; ++c)
      EXPECT_EQ(out[n * C + c],
                (mine ? wte_full[tokens[n] * C + c] : 0.0) + wpe[positions[n % T] * C + c]);
  }
  // without wpe: token part only; without positions: position = t
  auto out2 = dev<double>(HVec(B * T * C));
  encoder_forward<double>(out2, tok, Kokkos::View<int*>(), dev<double>(wte),
                          Kokkos::View<double*>(), B, T, C, v_begin, v_local);
  auto out3 = dev<double>(HVec(B * T * C));
  encoder_forward<double>(out3, tok, Kokkos::View<int*>(), dev<double>(HVec(v_local * C)),
                          dev<double>(wpe), B, T, C, v_begin, v_local);
  for (int n = 0; n < B * T; ++n) {
    const bool mine = tokens[n] >= v_begin && tokens[n] < v_begin + v_local;
    for (int c = 0; c < C; ++c) {
      EXPECT_EQ(host(out2)[n * C + c], mine ? wte_full[tokens[n] * C + c] : 0.0);
      EXPECT_EQ(host(out3)[n * C + c], wpe[(n % T) * C + c]);
    }
  }
  const HVec dte0 = random_vec(wte.size(), 33), dpe0 = random_vec(wpe.size(), 34);
  auto dte = dev<double>(dte0), dpe = dev<double>(dpe0);
  encoder_backward<double>(dte, dpe, dev<double>(R), tok, pos, B, T, C, v_begin, v_local);
  EXPECT_LT(rel_err(minus(host(dte), dte0),
                    fd_grad(wte, [&](const HVec& v) { return dot(forward(v, wpe), R); })),
            kFdTol);
  EXPECT_LT(rel_err(minus(host(dpe), dpe0),
                    fd_grad(wpe, [&](const HVec& v) { return dot(forward(wte, v), R); })),
            kFdTol);
  // the shard rows of tokens outside the shard got nothing: row of token 5 (never used)
  for (int c = 0; c < C; ++c)
    EXPECT_EQ(host(dte)[(5 - v_begin) * C + c], dte0[(5 - v_begin) * C + c]);
  // positions beyond wpe are refused
  EXPECT_THROW(
      encoder_forward<double>(dev<double>(HVec(B * T * C)), tok, dev_ints({0, 1, 6}),
                              dev<double>(wte), dev<double>(wpe), B, T, C, v_begin, v_local),
      Error);
}

// ---- cross-entropy ----------------------------------------------------------------------------

struct CeRef {
  HVec losses, dlogits;
};
// Naive softmax cross-entropy over the first v_real of v_pad columns; dlogits for dloss.
CeRef naive_ce(const HVec& logits, const std::vector<int>& targets, int N, int v_pad, int v_real,
               double dloss) {
  CeRef r{HVec(N), HVec(std::size_t(N) * v_pad, 0.0)};
  for (int n = 0; n < N; ++n) {
    const double* x = &logits[std::size_t(n) * v_pad];
    double m = -1e300, s = 0;
    for (int v = 0; v < v_real; ++v) m = std::max(m, x[v]);
    for (int v = 0; v < v_real; ++v) s += std::exp(x[v] - m);
    r.losses[n] = -(x[targets[n]] - m - std::log(s));
    for (int v = 0; v < v_real; ++v)
      r.dlogits[std::size_t(n) * v_pad + v] =
          (std::exp(x[v] - m) / s - (v == targets[n] ? 1.0 : 0.0)) * dloss;
  }
  return r;
}

struct CeOut {
  HVec losses, dlogits;
};
// (a)-(d) on one shard holding all columns.
template <class T>
CeOut run_ce(const HVec& logits, const std::vector<int>& targets, int N, int v_pad, int v_real,
             double dloss) {
  const VocabShard shard{0, v_pad, v_real};
  auto lg = dev<T>(logits);
  auto tg = dev_ints(targets);
  Kokkos::View<accumulate_t<T>*> mx("mx", N), se("se", N), tl("tl", N), loss("loss", N);
  crossentropy_row_max<T>(mx, lg, N, shard);
  crossentropy_row_sumexp<T>(se, tl, lg, mx, tg, N, shard);
  crossentropy_loss<T>(loss, mx, se, tl, N);
  crossentropy_backward<T>(lg, mx, se, tg, N, shard, accumulate_t<T>(dloss));
  return {host(loss), host(lg)};
}

TEST(KernelsCrossEntropy, MatchesNaiveSoftmaxWithPadding) {
  const int N = 4, v_pad = 40, v_real = 37;
  HVec logits = random_vec(N * v_pad, 40, -3, 3);
  for (int n = 0; n < N; ++n)  // padding logits large: must not win or matter
    for (int v = v_real; v < v_pad; ++v) logits[n * v_pad + v] = 50.0;
  const std::vector<int> targets = {0, 36, 17, 5};
  const CeRef ref = naive_ce(logits, targets, N, v_pad, v_real, 0.25);
  const CeOut d = run_ce<double>(logits, targets, N, v_pad, v_real, 0.25);
  EXPECT_LT(rel_err(d.losses, ref.losses), 1e-14);
  EXPECT_LT(rel_err(d.dlogits, ref.dlogits), 1e-14);
  const CeOut f = run_ce<float>(logits, targets, N, v_pad, v_real, 0.25);
  EXPECT_LT(rel_err(f.losses, ref.losses), 1e-6);
  EXPECT_LT(rel_err(f.dlogits, ref.dlogits), 1e-6);
  for (int n = 0; n < N; ++n)
    for (int v = v_real; v < v_pad; ++v) {
      EXPECT_EQ(d.dlogits[n * v_pad + v], 0.0);
      EXPECT_EQ(f.dlogits[n * v_pad + v], 0.0);
    }
}

TEST(KernelsCrossEntropy, BackwardMatchesFiniteDifferences) {
  const int N = 3, v_pad = 12, v_real = 10;
  const HVec logits = random_vec(N * v_pad, 41, -2, 2);
  const std::vector<int> targets = {9, 0, 4};
  const double dloss = 1.0 / 3;
  auto loss = [&](const HVec& x) {
    const CeOut o = run_ce<double>(x, targets, N, v_pad, v_real, dloss);
    double s = 0;
    for (double l : o.losses) s += l * dloss;
    return s;
  };
  const CeOut o = run_ce<double>(logits, targets, N, v_pad, v_real, dloss);
  EXPECT_LT(rel_err(o.dlogits, fd_grad(logits, loss)), kFdTol);
}

// Two tensor-parallel shards of the padded vocabulary, the reductions done by hand.
template <class T>
void check_two_shard_split(double tol) {
  const int N = 5, v_pad = 24, v_real = 21, split = 12;  // shard 1 holds columns 12..23
  const HVec logits = random_vec(N * v_pad, 42, -4, 4);
  const std::vector<int> targets = {0, 11, 12, 20, 3};
  const double dloss = 0.2;
  const CeOut whole = run_ce<T>(logits, targets, N, v_pad, v_real, dloss);
  const VocabShard shards[2] = {{0, split, v_real}, {split, v_pad - split, v_real}};
  auto tg = dev_ints(targets);
  Kokkos::View<T*> lg[2], mx[2], se[2], tl[2];
  for (int s = 0; s < 2; ++s) {
    HVec part;
    for (int n = 0; n < N; ++n)
      for (int v = 0; v < shards[s].v_local; ++v)
        part.push_back(logits[n * v_pad + shards[s].v_begin + v]);
    lg[s] = dev<T>(part);
    mx[s] = Kokkos::View<T*>("mx", N);
    se[s] = Kokkos::View<T*>("se", N);
    tl[s] = Kokkos::View<T*>("tl", N);
    crossentropy_row_max<T>(mx[s], lg[s], N, shards[s]);
  }
  // all-reduce MAX
  HVec gmax(N);
  for (int n = 0; n < N; ++n) gmax[n] = std::max(host(mx[0])[n], host(mx[1])[n]);
  for (int s = 0; s < 2; ++s)
    crossentropy_row_sumexp<T>(se[s], tl[s], lg[s], dev<T>(gmax), tg, N, shards[s]);
  // all-reduce SUM
  HVec gse(N), gtl(N);
  for (int n = 0; n < N; ++n) {
    gse[n] = host(se[0])[n] + host(se[1])[n];
    gtl[n] = host(tl[0])[n] + host(tl[1])[n];
  }
  Kokkos::View<T*> loss("loss", N);
  crossentropy_loss<T>(loss, dev<T>(gmax), dev<T>(gse), dev<T>(gtl), N);
  EXPECT_LT(rel_err(host(loss), whole.losses), tol);
  HVec dl(N * v_pad);
  for (int s = 0; s < 2; ++s) {
    crossentropy_backward<T>(lg[s], dev<T>(gmax), dev<T>(gse), tg, N, shards[s], T(dloss));
    const HVec part = host(lg[s]);
    for (int n = 0; n < N; ++n)
      for (int v = 0; v < shards[s].v_local; ++v)
        dl[n * v_pad + shards[s].v_begin + v] = part[n * shards[s].v_local + v];
  }
  EXPECT_LT(rel_err(dl, whole.dlogits), tol);
  for (int n = 0; n < N; ++n)
    for (int v = v_real; v < v_pad; ++v) EXPECT_EQ(dl[n * v_pad + v], 0.0);
}

TEST(KernelsCrossEntropy, TwoShardSplitMatchesUnsharded) {
  check_two_shard_split<double>(1e-14);
  check_two_shard_split<float>(1e-6);
}

TEST(KernelsCrossEntropy, ShardOfOnlyPaddingContributesNothing) {
  const int N = 2;
  const VocabShard pad_only{8, 4, 8};  // columns 8..11 of a vocab with 8 real tokens
  auto lg = dev<double>(random_vec(N * 4, 43));
  Kokkos::View<double*> mx("mx", N), se("se", N), tl("tl", N);
  crossentropy_row_max<double>(mx, lg, N, pad_only);
  EXPECT_EQ(host(mx)[0], -std::numeric_limits<double>::infinity());
  crossentropy_row_sumexp<double>(se, tl, lg, dev<double>({1.0, 2.0}), dev_ints({3, 7}), N,
                                  pad_only);
  EXPECT_EQ(host(se), HVec(N, 0.0));
  EXPECT_EQ(host(tl), HVec(N, 0.0));
  crossentropy_backward<double>(lg, dev<double>({1.0, 2.0}), dev<double>({3.0, 4.0}),
                                dev_ints({3, 7}), N, pad_only, 1.0);
  EXPECT_EQ(host(lg), HVec(N * 4, 0.0));
}

// ---- float math ---------------------------------------------------------------------------

// ---- bf16 storage, fp32 arithmetic --------------------------------------------------------
// Each kernel in bf16 against its fp64 run on the same inputs (rounded to bf16 first, so both
// see the same numbers). A bf16 output is rounded once: |got - ref| <= u |ref| with u = 2^-8
// (bf16 keeps an 8-bit significand), plus the fp32 arithmetic before it, which is
// 2^-24-relative per operation: with sums of at most a few hundred terms it stays below 2^-16
// of the output's largest magnitude, the absolute slack allowed. An fp32 output (statistics,
// fp32 gradients) has no final rounding: only that slack. Accumulating in bf16 would break
// these bounds by orders of magnitude.
constexpr double kU = 0x1p-8;

HVec bf16_rounded(HVec v) {
  for (double& x : v) x = double(float(bf16(float(x))));
  return v;
}
double max_abs(const HVec& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}
// Elementwise |got - ref| <= rel |ref| + 2^-16 max|ref|.
void expect_within(const HVec& got, const HVec& ref, double rel, const char* what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const double slack = 0x1p-16 * max_abs(ref);
  for (std::size_t i = 0; i < ref.size(); ++i)
    ASSERT_LE(std::fabs(got[i] - ref[i]), rel * std::fabs(ref[i]) + slack)
        << what << "[" << i << "]: " << got[i] << " vs " << ref[i];
}

TEST(KernelsBf16, ElementwiseRoundOnce) {
  const std::size_t n = 3001;
  const HVec x = bf16_rounded(random_vec(n, 60, -6, 6)), y = bf16_rounded(random_vec(n, 61, -2, 2));
  auto run = [&](auto t) {
    using T = decltype(t);
    auto g = dev<T>(HVec(n)), dg = dev<T>(HVec(n)), r = dev<T>(HVec(n)), ax = dev<T>(y);
    gelu_forward<T>(g, dev<T>(x), n);
    gelu_backward<T>(dg, dev<T>(x), dev<T>(y), n);
    residual_forward<T>(r, dev<T>(x), dev<T>(y), n);
    axpy<T>(ax, accumulate_t<T>(0.5), dev<T>(x));
    return std::vector<HVec>{host(g), host(dg), host(r), host(ax)};
  };
  const auto d = run(0.0), b = run(bf16(0.0f));
  const char* names[] = {"gelu_forward", "gelu_backward", "residual_forward", "axpy"};
  for (int k = 0; k < 4; ++k) expect_within(b[k], d[k], kU, names[k]);
  EXPECT_EQ(count_nonfinite<bf16>(dev<bf16>({1.0, std::nan(""), INFINITY, -2.0})), 2);
  EXPECT_DOUBLE_EQ(sum_of_squares<bf16>(dev<bf16>({1.5, -2.0})), 6.25);
}

// The receiving side of the bf16 wire: D blocks summed in fp32, block by block, then added.
TEST(KernelsBf16, BlockSumAddsInFp32InBlockOrder) {
  const int D = 5, n = 301;
  const HVec blocks = bf16_rounded(random_vec(std::size_t(D) * n, 96, -3, 3));
  const HVec dst0 = random_vec(n, 97);
  auto dst = dev<float>(dst0);
  add_block_sum(dst, dev<bf16>(blocks), D);
  const HVec got = host(dst);
  for (int i = 0; i < n; ++i) {
    float s = 0;
    for (int q = 0; q < D; ++q) s += float(blocks[std::size_t(q) * n + std::size_t(i)]);
    ASSERT_EQ(got[std::size_t(i)], double(float(dst0[std::size_t(i)]) + s)) << i;
  }
}

TEST(KernelsBf16, LinearGradientsInFp32OrBf16) {
  const int N = 67, C = 40, OC = 24;
  const HVec inp = bf16_rounded(random_vec(N * C, 62)), w = bf16_rounded(random_vec(OC * C, 63));
  const HVec bias = bf16_rounded(random_vec(OC, 64)), dout = bf16_rounded(random_vec(N * OC, 65));
  const HVec dw0 = bf16_rounded(random_vec(OC * C, 66)), db0 = bf16_rounded(random_vec(OC, 67));
  auto run = [&](auto t, auto gt) {
    using T = decltype(t);
    using G = decltype(gt);
    auto out = dev<T>(HVec(N * OC)), dinp = dev<T>(HVec(N * C));
    auto dw = dev<G>(dw0), db = dev<G>(db0);
    matmul_forward<T>(out, dev<T>(inp), dev<T>(w), dev<T>(bias), N, C, OC);
    matmul_backward<T, G>(dinp, dw, db, dev<T>(dout), dev<T>(inp), dev<T>(w), N, C, OC);
    return std::vector<HVec>{host(out), host(dinp), host(dw), host(db)};
  };
  const auto d = run(0.0, 0.0), f = run(bf16(0.0f), 0.0f), b = run(bf16(0.0f), bf16(0.0f));
  expect_within(f[0], d[0], kU, "out");
  expect_within(f[1], d[1], kU, "dinp");
  expect_within(f[2], d[2], 0, "dweight (fp32)");
  expect_within(f[3], d[3], 0, "dbias (fp32)");
  expect_within(b[2], d[2], kU, "dweight (bf16)");
  expect_within(b[3], d[3], kU, "dbias (bf16, summed in fp32, added once)");
}

TEST(KernelsBf16, LayerNormStatisticsInFp32) {
  const int N = 9, C = 77;
  const HVec x = bf16_rounded(random_vec(N * C, 70, -2, 3)), w = bf16_rounded(random_vec(C, 71));
  const HVec b = bf16_rounded(random_vec(C, 72)), g = bf16_rounded(random_vec(N * C, 73));
  const HVec dx0 = bf16_rounded(random_vec(N * C, 74));
  auto run = [&](auto t) {
    using T = decltype(t);
    using A = accumulate_t<T>;
    auto out = dev<T>(HVec(N * C)), dx = dev<T>(dx0);
    Kokkos::View<A*> mean("mean", N), rstd("rstd", N);
    auto dw = dev<A>(HVec(C)), db = dev<A>(HVec(C));
    layernorm_forward<T>(out, mean, rstd, dev<T>(x), dev<T>(w), dev<T>(b), N, C);
    layernorm_backward<T, A>(dx, dw, db, dev<T>(g), dev<T>(x), dev<T>(w), mean, rstd, N, C);
    return std::vector<HVec>{host(out), host(mean), host(rstd), host(dx), host(dw), host(db)};
  };
  const auto d = run(0.0), f = run(bf16(0.0f));
  const char* names[] = {"out", "mean (fp32)", "rstd (fp32)", "dinp", "dweight", "dbias"};
  const double rel[] = {kU, 0, 0, kU, 0, 0};
  for (int k = 0; k < 6; ++k) expect_within(f[k], d[k], rel[k], names[k]);
}

TEST(KernelsBf16, EmbeddingForwardAndFp32Gradients) {
  const int B = 2, Tn = 5, C = 12, V = 7;
  const HVec wte = bf16_rounded(random_vec(V * C, 80)), wpe = bf16_rounded(random_vec(Tn * C, 81));
  const HVec dout = bf16_rounded(random_vec(B * Tn * C, 82));
  const std::vector<int> tokens = {1, 3, 3, 0, 6, 2, 3, 5, 1, 1};
  auto run = [&](auto t) {
    using T = decltype(t);
    using A = accumulate_t<T>;
    auto out = dev<T>(HVec(B * Tn * C));
    auto dwte = dev<A>(HVec(V * C)), dwpe = dev<A>(HVec(Tn * C));
    const Kokkos::View<int*> no_pos;
    encoder_forward<T>(out, dev_ints(tokens), no_pos, dev<T>(wte), dev<T>(wpe), B, Tn, C, 0, V);
    encoder_backward<T, A>(dwte, dwpe, dev<T>(dout), dev_ints(tokens), no_pos, B, Tn, C, 0, V);
    return std::vector<HVec>{host(out), host(dwte), host(dwpe)};
  };
  const auto d = run(0.0), f = run(bf16(0.0f));
  expect_within(f[0], d[0], kU, "out");
  expect_within(f[1], d[1], 0, "dwte (fp32)");
  expect_within(f[2], d[2], 0, "dwpe (fp32)");
}

TEST(KernelsBf16, CrossEntropyLossInFp32) {
  const int N = 6, v_pad = 300, v_real = 290;
  const HVec logits = bf16_rounded(random_vec(N * v_pad, 90, -4, 4));
  const std::vector<int> targets = {0, 289, 17, 5, 100, 200};
  const CeOut d = run_ce<double>(logits, targets, N, v_pad, v_real, 0.25);
  const CeOut b = run_ce<bf16>(logits, targets, N, v_pad, v_real, 0.25);
  expect_within(b.losses, d.losses, 0, "losses (fp32)");
  expect_within(b.dlogits, d.dlogits, kU, "dlogits");
}

TEST(KernelsBf16, RouterSoftmaxAndRowCombines) {
  const int N = 11, E = 8, k = 2, C = 33;
  const HVec logits = bf16_rounded(random_vec(N * E, 91, -3, 3));
  const HVec dprobs = bf16_rounded(random_vec(N * E, 92));
  const HVec src = bf16_rounded(random_vec(N * C, 93)), wk = bf16_rounded(random_vec(N * k, 94));
  const HVec dst0 = bf16_rounded(random_vec(N * C, 95));
  std::vector<int> rows(std::size_t(N) * k);
  for (int i = 0; i < N * k; ++i) rows[std::size_t(i)] = i % 5 == 3 ? -1 : (i * 7) % N;
  auto run = [&](auto t) {
    using T = decltype(t);
    auto probs = dev<T>(HVec(N * E)), dl = dev<T>(HVec(N * E)), dst = dev<T>(dst0);
    auto dots = dev<T>(HVec(N * k));
    softmax_rows_forward<T>(probs, dev<T>(logits), N, E);
    softmax_rows_backward<T>(dl, probs, dev<T>(dprobs), N, E);
    combine_rows<T>(dst, dev<T>(src), dev_ints(rows), dev<T>(wk), N, k, C, true);
    row_dots<T>(dots, dev<T>(dst0), dev<T>(src), dev_ints(rows), N, k, C);
    return std::vector<HVec>{host(probs), host(dl), host(dst), host(dots)};
  };
  const auto d = run(0.0), b = run(bf16(0.0f));
  expect_within(b[0], d[0], kU, "probs");
  expect_within(b[2], d[2], kU, "combine_rows");
  expect_within(b[3], d[3], kU, "row_dots");
  // dlogits = p (dp - p.dp) reads the stored (rounded) probabilities, and dp - p.dp cancels,
  // so elementwise it can lose more than u: norm-wise it is within a few u.
  EXPECT_LT(rel_err(b[1], d[1]), 3 * kU);
}

TEST(KernelsMath, FloatExpAndTanhAccuracy) {
  double max_exp = 0, max_tanh = 0;
  for (double x = -87; x <= 88; x += 1e-3) {
    const float xf = float(x);
    max_exp = std::max(max_exp,
                       std::fabs(detail::exp_(xf) - std::exp(double(xf))) / std::exp(double(xf)));
    max_tanh = std::max(max_tanh, std::fabs(detail::tanh_(xf) - std::tanh(double(xf))));
  }
  EXPECT_LT(max_exp, 2e-7);
  EXPECT_LT(max_tanh, 2e-7);
  EXPECT_LT(detail::exp_(-1e30f), 1e-37f);
  EXPECT_EQ(detail::tanh_(1e30f), 1.0f);
  EXPECT_EQ(detail::tanh_(-1e30f), -1.0f);
  EXPECT_EQ(detail::tanh_(0.0f), 0.0f);
}

// ---- a tiny GPT: every kernel composed ----------------------------------------------------------

struct Tiny {
  static constexpr int B = 2, T = 5, C = 8, NH = 2, HS = 4, V_real = 11, V_pad = 12, N = B * T;
  // flat parameter layout, as the model keeps it
  enum { wte, wpe, ln1w, ln1b, wqkv, bqkv, wo, bo, ln2w, ln2b, wfc, bfc, wp, bp, count };
  static std::size_t size(int p) {
    const std::size_t s[count] = {V_pad * C, T * C, C, C,         3 * C * C, 3 * C,     C * C,
                                  C,         C,     C, 4 * C * C, 4 * C,     4 * C * C, C};
    return s[p];
  }
  static std::size_t offset(int p) {
    std::size_t o = 0;
    for (int i = 0; i < p; ++i) o += size(i);
    return o;
  }
  static std::size_t total() { return offset(count); }
  static HVec init() {
    HVec p = random_vec(total(), 50, -0.5, 0.5);
    for (int c = 0; c < C; ++c)
      p[offset(ln1w) + c] = p[offset(ln2w) + c] = 1 + 0.3 * p[offset(ln1w) + c];
    return p;
  }
  static std::vector<int> tokens() { return {1, 4, 10, 3, 3, 0, 7, 2, 9, 5}; }
  static std::vector<int> targets() { return {4, 10, 3, 3, 0, 7, 2, 9, 5, 8}; }
};

// Mean loss of the tiny GPT for `params`; fills `grads` when given. T is the storage type of
// weights and activations, Gr the gradients'; statistics are in T's accumulate type.
template <class T, class Gr = T>
double tiny_gpt(const HVec& params, HVec* grads) {
  using V = Kokkos::View<T*>;
  using A = accumulate_t<T>;
  using SV = Kokkos::View<A*>;
  using GV = Kokkos::View<Gr*>;
  constexpr int B = Tiny::B, Tn = Tiny::T, C = Tiny::C, NH = Tiny::NH, HS = Tiny::HS, N = Tiny::N;
  constexpr int Vp = Tiny::V_pad;
  const V P = dev<T>(params);
  const GV G("grads", Tiny::total());
  auto p = [&](int i) -> V {
    return Kokkos::subview(P, std::make_pair(Tiny::offset(i), Tiny::offset(i) + Tiny::size(i)));
  };
  auto g = [&](int i) -> GV {
    return Kokkos::subview(G, std::make_pair(Tiny::offset(i), Tiny::offset(i) + Tiny::size(i)));
  };
  auto act = [](std::size_t n) { return V("act", n); };
  auto stat = [](std::size_t n) { return SV("stat", n); };
  auto tok = dev_ints(Tiny::tokens()), tgt = dev_ints(Tiny::targets());
  const Kokkos::View<int*> no_pos;
  const V none;
  const GV no_grad;
  AttentionConfig attn;
  attn.q_block = 2;
  attn.k_block = 3;

  V x0 = act(N * C), ln1 = act(N * C), qkv = act(N * 3 * C);
  V att = act(N * C), proj = act(N * C), x1 = act(N * C);
  V ln2 = act(N * C), h = act(N * 4 * C), gl = act(N * 4 * C);
  V mlp = act(N * C), x2 = act(N * C), logits = act(N * Vp);
  SV m1 = stat(N), r1 = stat(N), m2 = stat(N), r2 = stat(N), lse = stat(B * NH * Tn);
  SV mx = stat(N), se = stat(N), tl = stat(N), losses = stat(N);
  encoder_forward<T>(x0, tok, no_pos, p(Tiny::wte), p(Tiny::wpe), B, Tn, C, 0, Vp);
  layernorm_forward<T>(ln1, m1, r1, x0, p(Tiny::ln1w), p(Tiny::ln1b), N, C);
  matmul_forward<T>(qkv, ln1, p(Tiny::wqkv), p(Tiny::bqkv), N, C, 3 * C);
  attention_forward<T>(att, lse, qkv, B, Tn, NH, HS, attn);
  matmul_forward<T>(proj, att, p(Tiny::wo), p(Tiny::bo), N, C, C);
  residual_forward<T>(x1, x0, proj, N * C);
  layernorm_forward<T>(ln2, m2, r2, x1, p(Tiny::ln2w), p(Tiny::ln2b), N, C);
  matmul_forward<T>(h, ln2, p(Tiny::wfc), p(Tiny::bfc), N, C, 4 * C);
  gelu_forward<T>(gl, h, N * 4 * C);
  matmul_forward<T>(mlp, gl, p(Tiny::wp), p(Tiny::bp), N, 4 * C, C);
  residual_forward<T>(x2, x1, mlp, N * C);
  matmul_forward<T>(logits, x2, p(Tiny::wte), none, N, C, Vp);  // tied LM head
  const VocabShard shard{0, Vp, Tiny::V_real};
  crossentropy_row_max<T>(mx, logits, N, shard);
  crossentropy_row_sumexp<T>(se, tl, logits, mx, tgt, N, shard);
  crossentropy_loss<T>(losses, mx, se, tl, N);
  double mean_loss = 0;
  for (double l : host(losses)) mean_loss += l / N;
  if (!grads) return mean_loss;

  crossentropy_backward<T>(logits, mx, se, tgt, N, shard, A(1.0 / N));
  V dx2 = act(N * C), dx1 = act(N * C), dx0 = act(N * C), dgl = act(N * 4 * C);
  V dh = act(N * 4 * C), dln2 = act(N * C), datt = act(N * C), dqkv = act(N * 3 * C);
  V dln1 = act(N * C);
  matmul_backward<T, Gr>(dx2, g(Tiny::wte), no_grad, logits, x2, p(Tiny::wte), N, C, Vp);
  axpy<T>(dx1, A(1), dx2);  // x2 = x1 + mlp
  matmul_backward<T, Gr>(dgl, g(Tiny::wp), g(Tiny::bp), dx2, gl, p(Tiny::wp), N, 4 * C, C);
  gelu_backward<T>(dh, h, dgl, N * 4 * C);
  matmul_backward<T, Gr>(dln2, g(Tiny::wfc), g(Tiny::bfc), dh, ln2, p(Tiny::wfc), N, C, 4 * C);
  layernorm_backward<T, Gr>(dx1, g(Tiny::ln2w), g(Tiny::ln2b), dln2, x1, p(Tiny::ln2w), m2, r2, N,
                            C);
  axpy<T>(dx0, A(1), dx1);  // x1 = x0 + proj
  matmul_backward<T, Gr>(datt, g(Tiny::wo), g(Tiny::bo), dx1, att, p(Tiny::wo), N, C, C);
  attention_backward<T>(dqkv, datt, att, lse, qkv, B, Tn, NH, HS, attn);
  matmul_backward<T, Gr>(dln1, g(Tiny::wqkv), g(Tiny::bqkv), dqkv, ln1, p(Tiny::wqkv), N, C, 3 * C);
  layernorm_backward<T, Gr>(dx0, g(Tiny::ln1w), g(Tiny::ln1b), dln1, x0, p(Tiny::ln1w), m1, r1, N,
                            C);
  encoder_backward<T, Gr>(g(Tiny::wte), g(Tiny::wpe), dx0, tok, no_pos, B, Tn, C, 0, Vp);
  *grads = host(G);
  return mean_loss;
}

TEST(KernelsComposition, TinyGptFp64MatchesFiniteDifferences) {
  const HVec params = Tiny::init();
  HVec grads;
  tiny_gpt<double>(params, &grads);
  const HVec fd = fd_grad(params, [](const HVec& x) { return tiny_gpt<double>(x, nullptr); });
  EXPECT_LT(rel_err(grads, fd), kFdTol);
  // and tensor by tensor
  for (int p = 0; p < Tiny::count; ++p) {
    const HVec gp(grads.begin() + Tiny::offset(p), grads.begin() + Tiny::offset(p) + Tiny::size(p));
    const HVec fp(fd.begin() + Tiny::offset(p), fd.begin() + Tiny::offset(p) + Tiny::size(p));
    EXPECT_LT(rel_err(gp, fp), kFdTol) << "tensor " << p;
  }
}

TEST(KernelsComposition, TinyGptFp32AgreesWithFp64) {
  const HVec params = Tiny::init();
  HVec gd, gf;
  const double ld = tiny_gpt<double>(params, &gd);
  const double lf = tiny_gpt<float>(params, &gf);
  EXPECT_NEAR(lf, ld, 1e-6 * ld);
  EXPECT_LT(rel_err(gf, gd), 1e-5);
}

// bf16 weights and activations against fp64 on the same (bf16-rounded) weights. Each stored
// activation carries one bf16 rounding (relative 2^-8, an 8-bit significand) and the dozen
// layers compound a few of them, so the loss agrees to about 10 u = 0.04 relative and the
// gradients (norm-wise) to about 30 u = 0.12; fp32 gradient buffers and bf16 ones give the
// same within that. Accumulating in bf16 instead of fp32 would miss both by far at C = 16.
TEST(KernelsComposition, TinyGptBf16TracksFp64) {
  HVec params = Tiny::init();
  for (double& x : params) x = double(float(bf16(float(x))));
  HVec gd, gf, gb;
  const double ld = tiny_gpt<double>(params, &gd);
  const double lf = tiny_gpt<bf16, float>(params, &gf);
  const double lb = tiny_gpt<bf16, bf16>(params, &gb);
  const double u = 0x1p-8;
  std::printf(
      "tiny GPT loss fp64 %.6f, bf16 %.6f (rel %.2g); grads rel err: fp32 grads %.3g, "
      "bf16 grads %.3g (u = %.3g)\n",
      ld, lf, std::fabs(lf - ld) / ld, rel_err(gf, gd), rel_err(gb, gd), u);
  EXPECT_NEAR(lf, ld, 10 * u * ld);
  EXPECT_EQ(lf, lb);  // the forward does not depend on the gradient type
  EXPECT_LT(rel_err(gf, gd), 30 * u);
  EXPECT_LT(rel_err(gb, gd), 30 * u);
  EXPECT_GT(rel_err(gf, gd), 0.0);  // really computed in bf16
}

// LayerNorm's and GELU's results do not depend on the host thread count (each row or element
// is one thread's): on a Serial Kokkos the threads are ptrain's own, set here, at sizes large
// enough to be split (kernels/parallel.hpp's kForkElements).
TEST(KernelsThreads, LayerNormAndGeluDoNotDependOnThreadCount) {
  if (!PTRAIN_OWN_HOST_THREADS) GTEST_SKIP() << "Kokkos' host backend fixes its threads at start";
  const int N = 1000, C = 64;
  const std::size_t n = std::size_t(N) * C;
  const HVec x = random_vec(n, 71), g = random_vec(n, 72), w = random_vec(C, 73),
             b = random_vec(C, 74);
  std::vector<HVec> first;
  for (int threads : {1, 2, 3}) {
    set_host_threads(threads);
    Kokkos::View<float*> y("y", n), mean("mean", N), rstd("rstd", N), dx("dx", n), dw("dw", C),
        db("db", C), ge("ge", n), dge("dge", n);
    layernorm_forward<float>(y, mean, rstd, dev<float>(x), dev<float>(w), dev<float>(b), N, C);
    layernorm_backward<float>(dx, dw, db, dev<float>(g), dev<float>(x), dev<float>(w), mean, rstd,
                              N, C);
    gelu_forward<float>(ge, dev<float>(x), n);
    gelu_backward<float>(dge, dev<float>(x), dev<float>(g), n);
    const std::vector<HVec> got{host(y), host(dx), host(dw), host(db), host(ge), host(dge)};
    if (threads == 1) {
      first = got;
      continue;
    }
    for (std::size_t k = 0; k < got.size(); ++k)
      EXPECT_EQ(differing(got[k], first[k]), 0u) << "output " << k << ", " << threads << " threads";
  }
  set_host_threads(1);
}

}  // namespace
