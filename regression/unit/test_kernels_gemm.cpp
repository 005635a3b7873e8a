// ptrain-test: np=1 labels=quick timeout=120
// The gemm call description and what a GPU back end must compute from it. The column-major
// form (kernels::column_major, what cuBLAS is given) run through CBLAS in column-major order on
// host buffers reproduces the row-major gemm bit for bit in fp32 and fp64; and the bf16 gemm
// matches the reference the cuBLAS call is held to: bf16 inputs, products and sums in fp32 in K
// order. The cases are those of test_kernels.cpp's gemm tests: every transpose, offsets,
// leading dimensions wider than the rows, K = 0, beta 0 (over NaN) and nonzero. Built for a
// GPU, the same tests compare the device's gemm within the fp32 error bound instead.
#include <cblas.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/gemm.hpp"
#include "test_support.hpp"

using namespace ptrain;
using namespace ptrain::kernels;
using namespace ptrain::test;

namespace {

// gemm runs on the host (CBLAS) exactly when its views are host memory.
constexpr bool kGemmOnHost =
    Kokkos::SpaceAccessibility<Kokkos::HostSpace, Kokkos::View<float*>::memory_space>::accessible;

struct Case {
  bool ta, tb;
  int M, N, K;
  int lda_pad, ldb_pad, ldc_pad;  // leading dimension minus the stored row's width
  std::size_t a_off, b_off, c_off;
  double alpha, beta;
  bool nan_c;  // C starts as NaN (beta 0 must ignore it)

  int lda() const { return (ta ? M : K) + lda_pad; }
  int ldb() const { return (tb ? K : N) + ldb_pad; }
  int ldc() const { return N + ldc_pad; }
  std::size_t a_size() const { return a_off + std::size_t(ta ? K : M) * std::size_t(lda()); }
  std::size_t b_size() const { return b_off + std::size_t(tb ? N : K) * std::size_t(ldb()); }
  std::size_t c_size() const { return c_off + std::size_t(M) * std::size_t(ldc()); }
  std::size_t c_at(int i, int j) const {
    return c_off + std::size_t(i) * std::size_t(ldc()) + std::size_t(j);
  }
  // op(A)(i, k) and op(B)(k, j) in their buffers
  std::size_t a_at(int i, int k) const {
    return a_off + (ta ? std::size_t(k) * std::size_t(lda()) + std::size_t(i)
                       : std::size_t(i) * std::size_t(lda()) + std::size_t(k));
  }
  std::size_t b_at(int k, int j) const {
    return b_off + (tb ? std::size_t(j) * std::size_t(ldb()) + std::size_t(k)
                       : std::size_t(k) * std::size_t(ldb()) + std::size_t(j));
  }
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  return os << "M=" << c.M << " N=" << c.N << " K=" << c.K << " trans_a " << c.ta << " trans_b "
            << c.tb << " alpha " << c.alpha << " beta " << c.beta << (c.nan_c ? " (NaN C)" : "");
}

// test_kernels.cpp's gemm cases, and K = 0 and beta = 0 at every transpose.
std::vector<Case> gemm_cases() {
  std::vector<Case> cases;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      cases.push_back({bool(ta), bool(tb), 5, 4, 3, 2, 1, 3, 3, 1, 2, 0.7, 0.3, false});
      cases.push_back({bool(ta), bool(tb), 5, 4, 3, 2, 1, 3, 3, 1, 2, 0.7, 0.0, true});
      cases.push_back({bool(ta), bool(tb), 5, 4, 0, 2, 1, 3, 3, 1, 2, 0.7, 0.3, false});
      cases.push_back({bool(ta), bool(tb), 530, 517, 1030, 3, 1, 2, 5, 2, 1, 0.75, 0.5, false});
      cases.push_back({bool(ta), bool(tb), 7, 600, 3, 3, 1, 2, 5, 2, 1, 0.75, 0.5, false});
    }
  cases.push_back({false, true, 520, 513, 1100, 3, 1, 2, 5, 2, 1, 0.75, 0.5, false});
  cases.push_back({false, false, 1, 2, 1, 0, 0, 0, 0, 0, 0, 1.0, 0.0, true});
  cases.push_back({false, false, 1, 2, 0, 0, 0, 0, 0, 0, 0, 1.0, 0.5, false});
  cases.push_back({false, false, 2, 3, 1, 0, 0, 0, 0, 0, 0, 1.0, 0.0, true});
  cases.push_back({true, false, 300, 200, 700, 1, 2, 3, 0, 4, 7, 1.25, 0.0, true});
  return cases;
}

struct Inputs {
  HVec A, B, C0;
};

// Random operands and C in (-1, 1), already rounded to T, so the host buffers and the views
// made from them (dev<T>) hold the same values.
template <class T>
HVec rounded_to(HVec v) {
  for (double& x : v) x = double(T(x));
  return v;
}

template <class T, class Out>
Inputs inputs(const Case& c, unsigned seed) {
  Inputs in{rounded_to<T>(random_vec(c.a_size(), seed)),
            rounded_to<T>(random_vec(c.b_size(), seed + 1)),
            rounded_to<Out>(random_vec(c.c_size(), seed + 2))};
  if (c.nan_c) std::fill(in.C0.begin(), in.C0.end(), std::numeric_limits<double>::quiet_NaN());
  return in;
}

template <class T>
std::vector<T> host_buffer(const HVec& h) {
  std::vector<T> v(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) v[i] = T(h[i]);
  return v;
}

// The description gemm's entry point makes of this case over these host buffers (its own
// gemm_call, over views of them: only the pointers are taken).
template <class T, class Out>
GemmCall row_major_call(const Case& c, const std::vector<T>& A, const std::vector<T>& B,
                        std::vector<Out>& C) {
  const Kokkos::View<T*> a(const_cast<T*>(A.data()), A.size());
  const Kokkos::View<T*> b(const_cast<T*>(B.data()), B.size());
  const Kokkos::View<Out*> out(C.data(), C.size());
  return gemm_call<T, Out>(c.ta, c.tb, c.M, c.N, c.K, accumulate_t<T>(c.alpha), a, c.a_off, c.lda(),
                           b, c.b_off, c.ldb(), accumulate_t<T>(c.beta), out, c.c_off, c.ldc());
}

// The column-major call as cuBLAS is given it, executed by CBLAS instead.
void run_column_major_cblas(const GemmCall& c) {
  const CBLAS_TRANSPOSE ta = c.trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = c.trans_b ? CblasTrans : CblasNoTrans;
  ASSERT_EQ(c.operands, c.output);
  if (c.operands == Precision::fp64)
    cblas_dgemm(CblasColMajor, ta, tb, c.M, c.N, c.K, c.alpha, static_cast<const double*>(c.A),
                c.lda, static_cast<const double*>(c.B), c.ldb, c.beta, static_cast<double*>(c.C),
                c.ldc);
  else
    cblas_sgemm(CblasColMajor, ta, tb, c.M, c.N, c.K, float(c.alpha),
                static_cast<const float*>(c.A), c.lda, static_cast<const float*>(c.B), c.ldb,
                float(c.beta), static_cast<float*>(c.C), c.ldc);
}

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// The magnitude the error bounds scale with at C(i, j): |alpha| sum_k |a b| + |beta c|
// (C's old value does not count when beta is 0: it is ignored, even NaN).
double magnitude(const Case& c, const Inputs& in, int i, int j) {
  double s = 0;
  for (int k = 0; k < c.K; ++k) s += std::fabs(in.A[c.a_at(i, k)] * in.B[c.b_at(k, j)]);
  return std::fabs(c.alpha) * s + (c.beta == 0 ? 0.0 : std::fabs(c.beta * in.C0[c.c_at(i, j)]));
}

// Roundings on one product's way into C(i, j) in a gemm summing in any order: K - 1 additions,
// alpha's product, beta c and their sum, and one more per K block a blocked gemm adds into C
// (OpenBLAS's and cuBLAS's split-K blocks, and the bf16 path's 512-panels, hold at least 128).
int roundings(int K) { return K + 2 + (K + 127) / 128; }

// Allowed |got - reference| where both compute C in the accumulate type with unit roundoff u:
// the reference (K-order sum) within (K + 2) u mag of the exact value, the tested gemm within
// roundings(K) 2u mag, 2u allowing accumulators that truncate (GPU tensor cores) as well as
// those that round to nearest.
double accumulation_bound(int K, double u, double mag) {
  return ((K + 2) * u + roundings(K) * 2 * u) * mag;
}

// ---- the column-major mapping ---------------------------------------------------------------

TEST(KernelsGemmCall, ColumnMajorSwapsTheOperandsAndTheSizes) {
  const float a = 0, b = 0;
  float c = 0;
  GemmCall r;
  r.trans_a = true;
  r.trans_b = false;
  r.M = 5;
  r.N = 4;
  r.K = 3;
  r.alpha = 0.5;
  r.beta = 2;
  r.A = &a;
  r.lda = 7;
  r.B = &b;
  r.ldb = 9;
  r.C = &c;
  r.ldc = 11;
  r.operands = Precision::bf16;
  r.output = Precision::fp32;
  const GemmCall m = column_major(r);
  EXPECT_FALSE(m.trans_a);  // the row-major B's
  EXPECT_TRUE(m.trans_b);   // the row-major A's
  EXPECT_EQ(m.M, 4);
  EXPECT_EQ(m.N, 5);
  EXPECT_EQ(m.K, 3);
  EXPECT_EQ(m.A, &b);
  EXPECT_EQ(m.lda, 9);
  EXPECT_EQ(m.B, &a);
  EXPECT_EQ(m.ldb, 7);
  EXPECT_EQ(m.C, &c);
  EXPECT_EQ(m.ldc, 11);
  EXPECT_EQ(m.alpha, 0.5);
  EXPECT_EQ(m.beta, 2);
  EXPECT_EQ(m.operands, Precision::bf16);
  EXPECT_EQ(m.output, Precision::fp32);
}

// The column-major form through CBLAS against the production row-major gemm. OpenBLAS's
// row-major cblas_?gemm is this very swap onto its column-major kernels, so on the host the
// two agree bit for bit, padding (untouched) and all. On a GPU the production gemm is cuBLAS,
// whose sums run in another order: it is held to the accumulation bound instead.
template <class T>
void check_column_major_matches_row_major() {
  const double u = std::is_same_v<T, double> ? 0x1p-53 : 0x1p-24;
  unsigned seed = 100;
  for (const Case& c : gemm_cases()) {
    SCOPED_TRACE(testing::Message() << c);
    const Inputs in = inputs<T, T>(c, seed += 3);
    auto Cv = dev<T>(in.C0);
    gemm<T>(c.ta, c.tb, c.M, c.N, c.K, T(c.alpha), dev<T>(in.A), c.a_off, c.lda(), dev<T>(in.B),
            c.b_off, c.ldb(), T(c.beta), Cv, c.c_off, c.ldc());
    const auto got = staging::to_host(Cv);

    const std::vector<T> A = host_buffer<T>(in.A), B = host_buffer<T>(in.B);
    std::vector<T> C = host_buffer<T>(in.C0);
    run_column_major_cblas(column_major(row_major_call<T, T>(c, A, B, C)));

    ASSERT_EQ(got.size(), C.size());
    for (int i = 0; i < c.M; ++i)
      for (int j = 0; j < c.ldc() && c.c_at(i, j) < C.size(); ++j) {
        const std::size_t at = c.c_at(i, j);
        if (kGemmOnHost || j >= c.N) {
          ASSERT_TRUE(same_bits(got[at], C[at]))
              << "(" << i << ", " << j << "): " << got[at] << " vs " << C[at];
        } else {
          ASSERT_LE(std::fabs(double(got[at]) - double(C[at])),
                    accumulation_bound(c.K, u, magnitude(c, in, i, j)))
              << "(" << i << ", " << j << "): " << got[at] << " vs " << C[at];
        }
      }
  }
}

TEST(KernelsGemmCall, ColumnMajorCblasMatchesTheRowMajorGemmInFp64) {
  check_column_major_matches_row_major<double>();
}

TEST(KernelsGemmCall, ColumnMajorCblasMatchesTheRowMajorGemmInFp32) {
  check_column_major_matches_row_major<float>();
}

// ---- bf16 against its reference -------------------------------------------------------------

// What a gemm with bf16 operands computes (gemm<bf16, Out>, and the cuBLAS call with
// CUBLAS_COMPUTE_32F it is given on a GPU): inputs as stored, each product in fp32 (exact: two
// 8-bit significands fit in fp32's 24, so fusing it into the sum changes nothing), summed in
// fp32 in K order, then alpha acc + beta c in fp32, rounded once to Out. beta 0 ignores C.
template <class Out>
void reference_bf16_gemm(const Case& c, const std::vector<bf16>& A, const std::vector<bf16>& B,
                         std::vector<Out>& C) {
  const float alpha = float(c.alpha), beta = float(c.beta);
  for (int i = 0; i < c.M; ++i)
    for (int j = 0; j < c.N; ++j) {
      float acc = 0;
      for (int k = 0; k < c.K; ++k) acc += float(A[c.a_at(i, k)]) * float(B[c.b_at(k, j)]);
      Out& out = C[c.c_at(i, j)];
      out = Out(beta == 0 ? alpha * acc : alpha * acc + beta * float(out));
    }
}

// gemm<bf16, Out> against the reference. Both compute the same exact value e = alpha sum a b +
// beta c with fp32 accumulation, so they differ by at most the two accumulation errors
// (accumulation_bound with fp32's u = 2^-24: about K 2^-24 relative to |alpha| sum |a b| +
// |beta c|). A bf16 C adds one rounding on each side: round to nearest with an 8-bit
// significand moves a value by at most half an ulp, 2^-8 of its (rounded) magnitude, so
// 2^-8 (|got| + |reference|) more.
template <class Out>
void check_bf16_against_reference() {
  const double bf16_rounding = std::is_same_v<Out, bf16> ? 0x1p-8 : 0.0;
  unsigned seed = 500;
  for (const Case& c : gemm_cases()) {
    SCOPED_TRACE(testing::Message() << c);
    const Inputs in = inputs<bf16, Out>(c, seed += 3);
    auto Cv = dev<Out>(in.C0);
    gemm<bf16, Out>(c.ta, c.tb, c.M, c.N, c.K, float(c.alpha), dev<bf16>(in.A), c.a_off, c.lda(),
                    dev<bf16>(in.B), c.b_off, c.ldb(), float(c.beta), Cv, c.c_off, c.ldc());
    const auto got = staging::to_host(Cv);

    std::vector<Out> expect = host_buffer<Out>(in.C0);
    reference_bf16_gemm(c, host_buffer<bf16>(in.A), host_buffer<bf16>(in.B), expect);

    ASSERT_EQ(got.size(), expect.size());
    for (int i = 0; i < c.M; ++i)
      for (int j = 0; j < c.ldc() && c.c_at(i, j) < expect.size(); ++j) {
        const std::size_t at = c.c_at(i, j);
        if (j >= c.N) {  // the padding between rows is untouched
          ASSERT_TRUE(same_bits(got[at], expect[at])) << "padding (" << i << ", " << j << ")";
          continue;
        }
        const double g = double(float(got[at])), e = double(float(expect[at]));
        const double bound = accumulation_bound(c.K, 0x1p-24, magnitude(c, in, i, j)) +
                             bf16_rounding * (std::fabs(g) + std::fabs(e));
        ASSERT_LE(std::fabs(g - e), bound) << "(" << i << ", " << j << "): " << g << " vs " << e;
      }
  }
}

TEST(KernelsGemmBf16, Fp32OutputMatchesTheFp32AccumulatingReference) {
  check_bf16_against_reference<float>();
}

TEST(KernelsGemmBf16, Bf16OutputMatchesTheFp32AccumulatingReference) {
  check_bf16_against_reference<bf16>();
}

}  // namespace
