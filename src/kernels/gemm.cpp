// kernels/gemm.cpp — the gemm entry point: its checks fill one call description, which CBLAS
// (views in host memory) or cuBLAS (a CUDA build) executes.
#include "kernels/gemm.hpp"

#include <cblas.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#if PTRAIN_ENABLE_CUDA
#include <cublas_v2.h>

#include <atomic>
#endif

#include "util/device_guard.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"
#include "util/timer.hpp"

namespace ptrain::kernels {
namespace {

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

#if !PTRAIN_ENABLE_CUDA
// CBLAS needs the matrices in host-accessible memory.
constexpr bool kViewsOnHost =
    Kokkos::SpaceAccessibility<Kokkos::HostSpace, Kokkos::View<float*>::memory_space>::accessible;

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

// The CBLAS back end: row-major as the call is, on host memory.
void run_cblas(const GemmCall& c) {
  const CBLAS_TRANSPOSE ta = c.trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = c.trans_b ? CblasTrans : CblasNoTrans;
  switch (c.operands) {
    case Precision::fp64:
      cblas_dgemm(CblasRowMajor, ta, tb, c.M, c.N, c.K, c.alpha, static_cast<const double*>(c.A),
                  c.lda, static_cast<const double*>(c.B), c.ldb, c.beta, static_cast<double*>(c.C),
                  c.ldc);
      return;
    case Precision::fp32:
      cblas_sgemm(CblasRowMajor, ta, tb, c.M, c.N, c.K, float(c.alpha),
                  static_cast<const float*>(c.A), c.lda, static_cast<const float*>(c.B), c.ldb,
                  float(c.beta), static_cast<float*>(c.C), c.ldc);
      return;
    case Precision::bf16: {
      const auto* A = static_cast<const bf16*>(c.A);
      const auto* B = static_cast<const bf16*>(c.B);
      if (c.output == Precision::bf16)
        gemm_bf16(c.trans_a, c.trans_b, c.M, c.N, c.K, float(c.alpha), A, c.lda, B, c.ldb,
                  float(c.beta), static_cast<bf16*>(c.C), c.ldc);
      else
        gemm_bf16(c.trans_a, c.trans_b, c.M, c.N, c.K, float(c.alpha), A, c.lda, B, c.ldb,
                  float(c.beta), static_cast<float*>(c.C), c.ldc);
      return;
    }
  }
}
#else   // PTRAIN_ENABLE_CUDA
std::atomic<bool> g_allow_tf32{false};

// Throws naming the cuBLAS function, its status and, for a gemm, the call.
void check_cublas(cublasStatus_t status, const char* what, const GemmCall* call = nullptr) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  std::string message = cat("gemm: ", what, " failed: ", cublasGetStatusString(status));
  if (call)
    message += cat(" (row-major M=", call->M, " N=", call->N, " K=", call->K, ", trans_a ",
                   int(call->trans_a), " trans_b ", int(call->trans_b), ", lda ", call->lda,
                   " ldb ", call->ldb, " ldc ", call->ldc, ", ", to_string(call->operands),
                   " operands, ", to_string(call->output), " C)");
  throw Error(message);
}

// One handle per process, bound to the stream of Kokkos's default instance, so each gemm is
// ordered after the kernels that produced its operands and before those that read C, with no
// fence. Reductions stay in the compute type even for a bf16 C (cuBLAS may otherwise reduce
// split-K partial sums in bf16), so a bf16 C is rounded once, as on the CPU. The handle is
// destroyed in Kokkos::finalize, while the CUDA context it belongs to still exists.
cublasHandle_t cublas_handle() {
  static const cublasHandle_t handle = [] {
    cublasHandle_t h = nullptr;
    check_cublas(cublasCreate(&h), "cublasCreate");
    try {
      check_cublas(cublasSetStream(h, Kokkos::DefaultExecutionSpace().cuda_stream()),
                   "cublasSetStream");
      check_cublas(
          cublasSetMathMode(h, cublasMath_t(CUBLAS_DEFAULT_MATH |
                                            CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
          "cublasSetMathMode");
    } catch (...) {
      cublasDestroy(h);
      throw;
    }
    // At finalize a failure can only be ignored: the process is ending.
    Kokkos::push_finalize_hook([h] { cublasDestroy(h); });
    return h;
  }();
  return handle;
}

cudaDataType_t cuda_type(Precision p) {
  switch (p) {
    case Precision::fp64:
      return CUDA_R_64F;
    case Precision::fp32:
      return CUDA_R_32F;
    case Precision::bf16:
      return CUDA_R_16BF;
  }
  throw Error("gemm: unknown element type");
}

// The cuBLAS back end: the column-major form of the call on the default instance's stream.
// beta == 0 ignores C's old contents (even NaN) by cuBLAS's definition of gemm.
void run_cublas(const GemmCall& call) {
  const GemmCall c = column_major(call);
  const cudaDataType_t ab_type = cuda_type(c.operands), c_type = cuda_type(c.output);
  const double alpha64 = c.alpha, beta64 = c.beta;
  const float alpha32 = float(c.alpha), beta32 = float(c.beta);
  const bool fp64 = c.operands == Precision::fp64;
  const cublasComputeType_t compute =
      fp64 ? CUBLAS_COMPUTE_64F
      : c.operands == Precision::fp32 && g_allow_tf32.load(std::memory_order_relaxed)
          ? CUBLAS_COMPUTE_32F_FAST_TF32
          : CUBLAS_COMPUTE_32F;  // bf16 operands accumulate in fp32, alpha and beta in fp32
  const void* alpha = fp64 ? static_cast<const void*>(&alpha64) : &alpha32;
  const void* beta = fp64 ? static_cast<const void*>(&beta64) : &beta32;
  const cublasStatus_t status =
      cublasGemmEx(cublas_handle(), c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                   c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, c.M, c.N, c.K, alpha, c.A, ab_type, c.lda,
                   c.B, ab_type, c.ldb, beta, c.C, c_type, c.ldc, compute, CUBLAS_GEMM_DEFAULT);
  check_cublas(status, "cublasGemmEx", &call);
}
#endif  // PTRAIN_ENABLE_CUDA

}  // namespace

GemmCall column_major(const GemmCall& r) {
  GemmCall c;
  c.trans_a = r.trans_b;
  c.trans_b = r.trans_a;
  c.M = r.N;
  c.N = r.M;
  c.K = r.K;
  c.alpha = r.alpha;
  c.beta = r.beta;
  c.A = r.B;
  c.lda = r.ldb;
  c.B = r.A;
  c.ldb = r.lda;
  c.C = r.C;
  c.ldc = r.ldc;
  c.operands = r.operands;
  c.output = r.output;
  return c;
}

void set_gemm_tf32(bool allow) {
#if PTRAIN_ENABLE_CUDA
  g_allow_tf32.store(allow, std::memory_order_relaxed);
#else
  (void)allow;  // CBLAS sgemm has no reduced-precision mode
#endif
}

template <class T, class Out>
GemmCall gemm_call(bool trans_a, bool trans_b, int M, int N, int K, accumulate_t<T> alpha,
                   CVec<T> A, std::size_t a_offset, int lda, CVec<T> B, std::size_t b_offset,
                   int ldb, accumulate_t<T> beta, OutVec<Out> C, std::size_t c_offset, int ldc) {
  PTRAIN_REQUIRE(M >= 0 && N >= 0 && K >= 0, "gemm: negative size M=", M, " N=", N, " K=", K);
  check_matrix("C", C.extent(0), c_offset, M, N, ldc);
  if (M == 0 || N == 0) return GemmCall{trans_a, trans_b, M, N, K};
  if (K > 0) {
    check_matrix("A", A.extent(0), a_offset, trans_a ? K : M, trans_a ? M : K, lda);
    check_matrix("B", B.extent(0), b_offset, trans_b ? N : K, trans_b ? K : N, ldb);
  } else {  // C = beta C; BLAS still validates the leading dimensions
    lda = std::max({1, lda, trans_a ? M : K});
    ldb = std::max({1, ldb, trans_b ? K : N});
  }
  return GemmCall{trans_a,
                  trans_b,
                  M,
                  N,
                  K,
                  double(alpha),
                  double(beta),
                  K > 0 ? A.data() + a_offset : nullptr,
                  lda,
                  K > 0 ? B.data() + b_offset : nullptr,
                  ldb,
                  C.data() + c_offset,
                  ldc,
                  precision_of<T>(),
                  precision_of<Out>()};
}

template <class T, class Out>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, accumulate_t<T> alpha, CVec<T> A,
          std::size_t a_offset, int lda, CVec<T> B, std::size_t b_offset, int ldb,
          accumulate_t<T> beta, OutVec<Out> C, std::size_t c_offset, int ldc) {
#if !PTRAIN_ENABLE_CUDA
  if constexpr (!kViewsOnHost) {
    throw Error("gemm: views in device memory need a GPU BLAS backend, which this build lacks");
  }
#endif
  const GemmCall call = gemm_call<T, Out>(trans_a, trans_b, M, N, K, alpha, A, a_offset, lda, B,
                                          b_offset, ldb, beta, C, c_offset, ldc);
  if (call.M == 0 || call.N == 0) return;
#if PTRAIN_ENABLE_CUDA
  run_cublas(call);  // on the stream the Kokkos kernels run on: ordered without a fence
#else
  // Kokkos kernels may still be running on an asynchronous backend.
  Kokkos::fence();
  device_guard::HostAccess host("gemm");  // CBLAS reads and writes the views from the host
  run_cblas(call);
#endif
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
// The probe's product: on a GPU a large one (cuBLAS at 8192^3 runs near the tensor cores'
// rate; at GPT-2's shapes the calls are too short to say what the device can do), on CPUs
// GPT-2 124M's MLP shape.
#if PTRAIN_ENABLE_CUDA
constexpr int kProbeM = 8192, kProbeK = 8192, kProbeN = 8192;
constexpr bool kDeviceGemm = true;  // calls only queue: fence each, so the clock sees them run
#else
constexpr int kProbeM = 1024, kProbeK = 768, kProbeN = 3072;
constexpr bool kDeviceGemm = false;
#endif

template <class T>
double probe(double seconds) {
  constexpr int M = kProbeM, K = kProbeK, N = kProbeN;
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
  once();  // warm-up: thread start-up, page faults, the cuBLAS handle
  // On a GPU the calls only queue: the clock is read after the device has finished them.
  Kokkos::fence();
  int calls = 0;
  const double t0 = wall_seconds();
  do {
    once();
    ++calls;
    if (kDeviceGemm) Kokkos::fence();
  } while (wall_seconds() - t0 < seconds);
  Kokkos::fence();
  const double elapsed = wall_seconds() - t0;
  return 2.0 * M * N * K * calls / elapsed * 1e-9;
}
}  // namespace

std::string gemm_probe_shape() { return cat(kProbeM, "x", kProbeK, "x", kProbeN); }

double measure_gemm_peak_gflops(double seconds, Precision operands) {
  return operands == Precision::bf16 ? probe<bf16>(seconds) : probe<float>(seconds);
}

std::size_t gemm_workspace_bytes(Precision operands) {
#if PTRAIN_ENABLE_CUDA
  (void)operands;  // cuBLAS takes bf16 operands as they are: no panels
  return 0;
#else
  return operands == Precision::bf16 ? 3 * std::size_t(kPanel) * kPanel * sizeof(float) : 0;
#endif
}

#define PTRAIN_INSTANTIATE_GEMM(T, Out)                                                        \
  template GemmCall gemm_call<T, Out>(bool, bool, int, int, int, accumulate_t<T>, CVec<T>,     \
                                      std::size_t, int, CVec<T>, std::size_t, int,             \
                                      accumulate_t<T>, OutVec<Out>, std::size_t, int);         \
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
