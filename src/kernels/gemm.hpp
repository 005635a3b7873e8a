// kernels/gemm.hpp — the one matrix-product entry point, and the BLAS controls.
#pragma once
#include <cstddef>
#include <string>

#include "kernels/view.hpp"
#include "util/element_types.hpp"

namespace ptrain::kernels {

// Row-major C = alpha * op(A) @ op(B) + beta * C, with op(A): (M, K), op(B): (K, N), C: (M, N).
// Each matrix lives inside a 1-D view: element (i, j) of the stored matrix is at
// view[offset + i * ld + j], so a matrix may be a strided block of a larger buffer
// (e.g. the Q third of a (B, T, 3C) qkv buffer: offset 0, ld 3C). Stored A is (M, K),
// or (K, M) when trans_a; stored B is (K, N), or (N, K) when trans_b. Bounds are checked;
// beta == 0 overwrites C (its old contents, even NaN, are ignored).
//
// T is the operands' storage type and Out C's (T unless named): float and double as BLAS has
// them; bf16 operands with fp32 accumulation and a bf16 or fp32 C (gemm<bf16, float> writes
// parameter gradients kept in fp32). alpha and beta are in T's accumulate type.
template <class T, class Out = T>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, accumulate_t<T> alpha,  //
          CVec<T> A, std::size_t a_offset, int lda,                                //
          CVec<T> B, std::size_t b_offset, int ldb,                                //
          accumulate_t<T> beta, OutVec<Out> C, std::size_t c_offset, int ldc);

// The same for matrices that start at offset 0 with natural leading dimensions.
template <class T, class Out = T>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, accumulate_t<T> alpha, CVec<T> A,
          CVec<T> B, accumulate_t<T> beta, OutVec<Out> C);

// One checked gemm as a back end executes it: the entry point above fills it, row-major, after
// its bounds checks. A, B and C point at each matrix's first element (A and B are null when
// K == 0, and lda, ldb are then raised to what BLAS validates). alpha and beta are in the
// accumulate type of `operands`, held as double (exact for float).
struct GemmCall {
  bool trans_a = false, trans_b = false;
  int M = 0, N = 0, K = 0;
  double alpha = 1, beta = 0;
  const void* A = nullptr;
  int lda = 1;
  const void* B = nullptr;
  int ldb = 1;
  void* C = nullptr;
  int ldc = 1;
  Precision operands = Precision::fp32, output = Precision::fp32;
};

// The description gemm() above executes, after the same checks (and the same errors).
template <class T, class Out = T>
GemmCall gemm_call(bool trans_a, bool trans_b, int M, int N, int K, accumulate_t<T> alpha,
                   CVec<T> A, std::size_t a_offset, int lda, CVec<T> B, std::size_t b_offset,
                   int ldb, accumulate_t<T> beta, OutVec<Out> C, std::size_t c_offset, int ldc);

// The same product as a column-major BLAS (cuBLAS) is asked for it. A row-major matrix with
// leading dimension ld is, read column-major with the same ld, its transpose; so the row-major
// C = op(A) op(B) is the column-major C^T = op(B)^T op(A)^T: M and N swap, and the call's A
// and B (with their transposes and leading dimensions) are the row-major B and A.
// The mapping the cuBLAS back end calls with (one definition; the unit tests run its result
// through CBLAS in column-major order on the CPU).
GemmCall column_major(const GemmCall& row_major);

// Whether fp32 gemms may round their operands to TF32 on the GPU's tensor cores (cuBLAS's
// CUBLAS_COMPUTE_32F_FAST_TF32; about 2^-11 relative error per product instead of fp32's
// 2^-24). Off by default. On CPUs it does nothing: CBLAS sgemm is fp32 throughout.
void set_gemm_tf32(bool allow);

// BLAS thread count. set_blas_threads returns false where this BLAS cannot change it at
// run time (not OpenBLAS); blas_threads returns 0 where it cannot be asked.
bool set_blas_threads(int n);
int blas_threads();

// The BLAS library and how it threads, for the log (e.g. "OpenBLAS, pthreads").
std::string blas_name();
// A warning (empty: none) when idle threads would spin on the cores the other side works on:
// OpenBLAS's pthreads busy-wait about 2^28 cycles after each call (OPENBLAS_THREAD_TIMEOUT=4
// stops that) and OpenMP's threads between kernels (OMP_WAIT_POLICY=PASSIVE). Both are read
// when the libraries load, so they belong in the job's environment. At GPT-2 124M shapes on
// 2 threads (regression/bench/threads.sh) a step took 2.5-2.6 s with both set, 3.0-3.2 s
// without OMP_WAIT_POLICY and 3.4-3.7 s without either.
std::string blas_spin_warning(int kernel_threads, int blas_threads);

// Achieved gemm rate (GFLOP/s) on this rank at gemm_probe_shape(): on CPUs the GPT-2 MLP
// shape M=1024, K=768, N=3072, on a GPU 8192^3 (C = A B^T as the linear layers call it),
// with operands of type `operands`
// (sgemm for fp32; fp64 runs use it too; bf16 operands as gemm<bf16> computes them): mean
// over repeated calls filling about `seconds` after one warm-up call. The model's MFU is
// measured against the probe of its compute type.
double measure_gemm_peak_gflops(double seconds = 0.5, Precision operands = Precision::fp32);
std::string gemm_probe_shape();  // "MxKxN"

// Bytes of workspace a gemm with bf16 operands allocates while it runs (its fp32 panels);
// 0 for the other types, and in a CUDA build (cuBLAS takes bf16 operands as they are).
std::size_t gemm_workspace_bytes(Precision operands);

}  // namespace ptrain::kernels
