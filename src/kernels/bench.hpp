// kernels/bench.hpp — per-kernel timings at a GPT shape, for `ptrain --bench`.
#pragma once
#include <string>
#include <vector>

namespace ptrain::kernels {

struct BenchShape {
  int B = 4, T = 256, C = 768, NH = 12, V = 50304;  // GPT-2 124M, micro-batch 4 x 256
};

struct KernelTiming {
  std::string name;  // e.g. "matmul_forward fc (1024x768 -> 3072)"
  double seconds;    // per call (mean over the repeats)
  double gflop;      // floating-point work per call (0 where not counted: elementwise)
};

// Times every layer kernel (forward and backward) of one transformer block, the embedding
// and the LM head / cross-entropy, in precision T (float or double), each repeated for at
// least `seconds_per_kernel`. Inputs are random; the timings, not the values, matter.
template <class T>
std::vector<KernelTiming> benchmark_kernels(const BenchShape& shape,
                                            double seconds_per_kernel = 0.2);

}  // namespace ptrain::kernels
