// kernels/gemm.cpp — CBLAS behind the gemm entry point.
#include "kernels/gemm.hpp"

#include <cblas.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "util/device_guard.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"
#include "util/timer.hpp"

namespace ptrain::kernels {
namespace {

// CBLAS needs the matrices in host-accessible memory.
constexpr bool kViewsOnHost =
    Kokkos::SpaceAccessibility<Kokkos::HostSpace, Kokkos::View<float*>::memory_space>::accessible;

// Checks that a stored (rows, cols) matrix with leading dimension ld at `offset` fits
// in a view of `extent` elements.
void check_matrix(const char* name, std::size_t extent, std::size_t offset, int rows, int cols,
                  int ld) {
  PTRAIN_REQUIRE(ld >= std::max(1, cols), "gemm: ", name, " has leading dimension ", ld, " < its ",
                 cols, " columns");
  if (rows == 0 || cols == 0) return;
  const std::size_t last = offset + std::size_t(rows - 1) * std::size_t(ld) + std::size_t(cols);
  PTRAIN_REQUIRE(last <= extent, "gemm: ", name, " (", rows, " x ", cols, ", ld ", ld, ", offset ",
                 offset, ") runs past its view of ", extent, " elements");
}

void call_cblas(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, float alpha,
                const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void call_cblas(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, double alpha,
                const double* A, int lda, const double* B, int ldb, double beta, double* C,
                int ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// bf16 operands: no BLAS here has a bf16 gemm (Debian's OpenBLAS 0.3.21 exports no sbgemm),
// so C is computed in blocks of at most kPanel x kPanel, each summed in fp32 over panels of
// kPanel along K: the A and B panels are widened to fp32 (exact) and multiplied by sgemm. The
// widening costs about MNK / kPanel element copies per operand against 2 MNK flops (a 1/256
// overhead at kPanel = 512), and the workspace stays at 3 kPanel^2 floats whatever the shape;
// the K order of the sum is fixed, so results do not depend on the thread count. C is read
// (beta != 0) and written once per block, rounded once when it is bf16.
constexpr int kPanel = 512;

template <class Out>
void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const bf16* A, int lda,
               const bf16* B, int ldb, float beta, Out* C, int ldc) {
  const std::size_t p = kPanel;
  TrackedView<float> work(MemCategory::workspace, "gemm_bf16_panels", 3 * p * p);
  float* a = work.data();  // (mb, kb): op(A) rows i0.., columns k0..
  float* b = a + p * p;    // (kb, nb): op(B) rows k0.., columns j0..
  float* c = b + p * p;    // (mb, nb)
  for (int i0 = 0; i0 < M; i0 += kPanel)
    for (int j0 = 0; j0 < N; j0 += kPanel) {
      const int mb = std::min(kPanel, M - i0), nb = std::min(kPanel, N - j0);
      for (int i = 0; i < mb; ++i)
        for (int j = 0; j < nb; ++j)
          c[std::size_t(i) * p + std::size_t(j)] =
              beta == 0.0f
                  ? 0.0f
                  : beta * float(C[std::size_t(i0 + i) * std::size_t(ldc) + std::size_t(j0 + j)]);
      for (int k0 = 0; k0 < K; k0 += kPanel) {
        const int kb = std::min(kPanel, K - k0);
        for (int i = 0; i < mb; ++i)  // op(A)(i, k) = A(i, k) or A(k, i)
          for (int k = 0; k < kb; ++k)
            a[std::size_t(i) * p + std::size_t(k)] =
                trans_a ? A[std::size_t(k0 + k) * std::size_t(lda) + std::size_t(i0 + i)]
                        : A[std::size_t(i0 + i) * std::size_t(lda) + std::size_t(k0 + k)];
        for (int k = 0; k < kb; ++k)  // op(B)(k, j) = B(k, j) or B(j, k)
          for (int j = 0; j < nb; ++j)
            b[std::size_t(k) * p + std::size_t(j)] =
                trans_b ? B[std::size_t(j0 + j) * std::size_t(ldb) + std::size_t(k0 + k)]
                        : B[std::size_t(k0 + k) * std::size_t(ldb) + std::size_t(j0 + j)];
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, mb, nb, kb, alpha, a, kPanel, b,
                    kPanel, 1.0f, c, kPanel);
      }
      for (int i = 0; i < mb; ++i)
        for (int j = 0; j < nb; ++j)
          C[std::size_t(i0 + i) * std::size_t(ldc) + std::size_t(j0 + j)] =
              Out(c[std::size_t(i) * p + std::size_t(j)]);
    }
}

void call_cblas(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, float alpha,
                const bf16* A, int lda, const bf16* B, int ldb, float beta, bf16* C, int ldc) {
  gemm_bf16(ta == CblasTrans, tb == CblasTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void call_cblas(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, float alpha,
                const bf16* A, int lda, const bf16* B, int ldb, float beta, float* C, int ldc) {
  gemm_bf16(ta == CblasTrans, tb == CblasTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace

template <class T, class Out>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, accumulate_t<T> alpha, CVec<T> A,
          std::size_t a_offset, int lda, CVec<T> B, std::size_t b_offset, int ldb,
          accumulate_t<T> beta, OutVec<Out> C, std::size_t c_offset, int ldc) {
  if constexpr (!kViewsOnHost) {
    throw Error("gemm: views in device memory need the cuBLAS backend, which this build lacks");
  }
  PTRAIN_REQUIRE(M >= 0 && N >= 0 && K >= 0, "gemm: negative size M=", M, " N=", N, " K=", K);
  check_matrix("C", C.extent(0), c_offset, M, N, ldc);
  if (M == 0 || N == 0) return;
  if (K > 0) {
    check_matrix("A", A.extent(0), a_offset, trans_a ? K : M, trans_a ? M : K, lda);
    check_matrix("B", B.extent(0), b_offset, trans_b ? N : K, trans_b ? K : N, ldb);
  } else {  // C = beta C; BLAS still validates the leading dimensions
    lda = std::max({1, lda, trans_a ? M : K});
    ldb = std::max({1, ldb, trans_b ? K : N});
  }
  // Kokkos kernels may still be running on an asynchronous backend.
  Kokkos::fence();
  device_guard::HostAccess host("gemm");  // CBLAS reads and writes the views from the host
  call_cblas(trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
             alpha, K > 0 ? A.data() + a_offset : nullptr, lda,
             K > 0 ? B.data() + b_offset : nullptr, ldb, beta, C.data() + c_offset, ldc);
}

template <class T, class Out>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, accumulate_t<T> alpha, CVec<T> A,
          CVec<T> B, accumulate_t<T> beta, OutVec<Out> C) {
  gemm<T, Out>(trans_a, trans_b, M, N, K, alpha, A, 0, trans_a ? M : K, B, 0, trans_b ? K : N, beta,
               C, 0, N);
}

bool set_blas_threads(int n) {
  PTRAIN_REQUIRE(n >= 1, "set_blas_threads: thread count ", n, " < 1");
#if PTRAIN_HAVE_OPENBLAS
  openblas_set_num_threads(n);
  return true;
#else
  return false;
#endif
}

int blas_threads() {
#if PTRAIN_HAVE_OPENBLAS
  return openblas_get_num_threads();
#else
  return 0;
#endif
}

std::string blas_name() {
#if PTRAIN_HAVE_OPENBLAS
  switch (openblas_get_parallel()) {  // 0 sequential, 1 pthreads, 2 OpenMP
    case 0:
      return "OpenBLAS, sequential";
    case 1:
      return "OpenBLAS, pthreads";
    default:
      return "OpenBLAS, OpenMP";
  }
#else
  return "CBLAS";
#endif
}

std::string blas_spin_warning(int kernel_threads, int blas_threads) {
#if PTRAIN_HAVE_OPENBLAS
  if (openblas_get_parallel() != 1 || kernel_threads < 2 || blas_threads < 2) return "";
  // Both are read when the libraries load: what the environment says now is what they saw.
  std::string missing;
  if (!std::getenv("OPENBLAS_THREAD_TIMEOUT") && !std::getenv("GOTO_THREAD_TIMEOUT"))
    missing += " OPENBLAS_THREAD_TIMEOUT=4";
  const char* wait = std::getenv("OMP_WAIT_POLICY");
  if (!wait || (std::string_view(wait) != "PASSIVE" && std::string_view(wait) != "passive"))
    missing += " OMP_WAIT_POLICY=PASSIVE";
  if (!missing.empty())
    return "BLAS (OpenBLAS, pthreads) and the OpenMP kernels take turns on the rank's cores, "
           "and idle threads of each spin while the other works (1.2-1.5x slower steps): "
           "export" +
           missing +
           " before mpirun (the job scripts do), or link OpenBLAS's "
           "OpenMP build";
#endif
  (void)kernel_threads, (void)blas_threads;
  return "";
}

namespace {
template <class T>
double probe(double seconds) {
  constexpr int M = 1024, K = 768, N = 3072;
  TrackedView<T> a(MemCategory::workspace, "gemm_probe_a", std::size_t(M) * K);
  TrackedView<T> b(MemCategory::workspace, "gemm_probe_b", std::size_t(N) * K);
  TrackedView<T> c(MemCategory::workspace, "gemm_probe_c", std::size_t(M) * N);
  Vec<T> av = a.view(), bv = b.view();
  Kokkos::parallel_for(
      "ptrain::gemm_probe_init", a.size(),
      KOKKOS_LAMBDA(std::size_t i) { av(i) = T(float(int(i % 7) - 3) * 0.01f); });
  Kokkos::parallel_for(
      "ptrain::gemm_probe_init", b.size(),
      KOKKOS_LAMBDA(std::size_t i) { bv(i) = T(float(int(i % 5) - 2) * 0.01f); });
  auto once = [&] { gemm<T>(false, true, M, N, K, 1.0f, av, bv, 0.0f, c.view()); };
  once();  // warm-up: thread start-up, page faults
  int calls = 0;
  const double t0 = wall_seconds();
  double elapsed = 0;
  do {
    once();
    ++calls;
    elapsed = wall_seconds() - t0;
  } while (elapsed < seconds);
  return 2.0 * M * N * K * calls / elapsed * 1e-9;
}
}  // namespace

double measure_gemm_peak_gflops(double seconds, Precision operands) {
  return operands == Precision::bf16 ? probe<bf16>(seconds) : probe<float>(seconds);
}

std::size_t gemm_workspace_bytes(Precision operands) {
  return operands == Precision::bf16 ? 3 * std::size_t(kPanel) * kPanel * sizeof(float) : 0;
}

#define PTRAIN_INSTANTIATE_GEMM(T, Out)                                                        \
  template void gemm<T, Out>(bool, bool, int, int, int, accumulate_t<T>, CVec<T>, std::size_t, \
                             int, CVec<T>, std::size_t, int, accumulate_t<T>, OutVec<Out>,     \
                             std::size_t, int);                                                \
  template void gemm<T, Out>(bool, bool, int, int, int, accumulate_t<T>, CVec<T>, CVec<T>,     \
                             accumulate_t<T>, OutVec<Out>);
PTRAIN_INSTANTIATE_GEMM(float, float)
PTRAIN_INSTANTIATE_GEMM(double, double)
PTRAIN_INSTANTIATE_GEMM(bf16, bf16)
PTRAIN_INSTANTIATE_GEMM(bf16, float)
#undef PTRAIN_INSTANTIATE_GEMM

}  // namespace ptrain::kernels
