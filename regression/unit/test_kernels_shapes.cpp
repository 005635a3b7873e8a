// ptrain-test: np=1 labels=quick timeout=120 threads=4
// The kernels with two shapes (kernels/view.hpp's KernelShape): LayerNorm and cross-entropy
// give the same row sums bit for bit as a thread per row (host) and as a team per row
// (device), whose threads split each row's sums by lanes, and elementwise results within 2
// ulps; in fp64, fp32 and bf16, on row lengths with and without a tail of lanes, and on a
// vocabulary shard with padding. ctest runs it on 4 threads, so on Kokkos OpenMP the teams
// have more than one. (Attention's two kernels sum in different orders:
// test_kernels_attention runs every test on both.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/kernels.hpp"
#include "test_support.hpp"
#include "util/bf16.hpp"
#include "util/element_types.hpp"
#include "util/error.hpp"

using namespace ptrain;
using namespace ptrain::kernels;
using namespace ptrain::test;

namespace {

// The process-wide shape for one scope; the host shape again after it.
struct WithShape {
  explicit WithShape(KernelShape s) { set_kernel_shape(s); }
  ~WithShape() { set_kernel_shape(KernelShape::host); }
};

// Every output of LayerNorm's forward and backward: out, mean, rstd, dinp (added to an
// existing value), dweight and dbias.
template <class T>
std::vector<HVec> layernorm_outputs(KernelShape shape, int N, int C) {
  using A = accumulate_t<T>;
  const WithShape with(shape);
  const auto x = dev<T>(random_vec(std::size_t(N) * C, 11 + C, -2, 3));
  const auto w = dev<T>(random_vec(C, 12 + C)), b = dev<T>(random_vec(C, 13 + C));
  const auto g = dev<T>(random_vec(std::size_t(N) * C, 14 + C));
  Kokkos::View<T*> out("out", std::size_t(N) * C);
  Kokkos::View<A*> mean("mean", N), rstd("rstd", N);
  layernorm_forward<T>(out, mean, rstd, x, w, b, N, C);
  auto dx = dev<T>(random_vec(std::size_t(N) * C, 15 + C));
  Kokkos::View<A*> dw("dw", C), db("db", C);
  layernorm_backward<T, A>(dx, dw, db, g, x, w, mean, rstd, N, C);
  return {host(out), host(mean), host(rstd), host(dx), host(dw), host(db)};
}

// Cross-entropy's four steps on a shard of v_local columns whose last ones are padding.
template <class T>
std::vector<HVec> crossentropy_outputs(KernelShape shape, int N, int v_local, int v_real) {
  using A = accumulate_t<T>;
  const WithShape with(shape);
  const VocabShard shard{0, v_local, v_real};
  auto logits = dev<T>(random_vec(std::size_t(N) * v_local, 21 + v_local, -4, 4));
  std::vector<int> t(N);
  for (int n = 0; n < N; ++n) t[n] = (7 * n + 3) % v_real;
  const auto targets = dev_ints(t);
  Kokkos::View<A*> mx("mx", N), se("se", N), tl("tl", N), loss("loss", N);
  crossentropy_row_max<T>(mx, logits, N, shard);
  crossentropy_row_sumexp<T>(se, tl, logits, mx, targets, N, shard);
  crossentropy_loss<T>(loss, mx, se, tl, N);
  crossentropy_backward<T>(logits, mx, se, targets, N, shard, A(0.125));
  return {host(mx), host(se), host(tl), host(loss), host(logits)};
}

// Entries of a and b further apart than `ulps` units in the last place of T at a's largest
// magnitude (eps max |a|: a gradient added to an old value can cancel to small): 0 means bit for
// bit. NaN never agrees.
std::size_t differing(const HVec& a, const HVec& b, double eps, double ulps) {
  double scale = 0;
  for (double x : a) scale = std::max(scale, std::abs(x));
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const bool ok = ulps == 0 ? a[i] == b[i] : std::abs(a[i] - b[i]) <= ulps * eps * scale;
    if (!ok && n < 3) std::printf("  entry %zu: %.17g vs %.17g\n", i, a[i], b[i]);
    n += !ok;
  }
  return n;
}

// The row sums (LayerNorm's mean and rstd, cross-entropy's max, sum of exponentials, target
// logit and loss) agree bit for bit. Elementwise results (normalized rows, gradients) may
// differ in the last place: the compiler fuses multiply-adds in a vectorised loop and a
// scalar one as it likes (seen in fp32 LayerNorm's dinp at C = 768): within 2 ulps of the
// output's largest entry.
template <class T>
void expect_agree(const std::vector<HVec>& h, const std::vector<HVec>& d,
                  const std::vector<bool>& is_sum, const std::string& what) {
  const double eps = std::is_same_v<T, bf16> ? 1.0 / 256 : std::numeric_limits<T>::epsilon();
  for (std::size_t k = 0; k < h.size(); ++k)
    EXPECT_EQ(differing(h[k], d[k], eps, is_sum[k] ? 0 : 2), 0u) << what << ", output " << k;
}

template <class T>
void check_shapes_agree(const char* type) {
  for (int C : {1, 7, 16, 37, 768})
    expect_agree<T>(layernorm_outputs<T>(KernelShape::host, 9, C),
                    layernorm_outputs<T>(KernelShape::device, 9, C),
                    {false, true, true, false, false, false},
                    std::string(type) + " LayerNorm C = " + std::to_string(C));
  for (auto [v_local, v_real] : std::vector<std::pair<int, int>>{{5, 5}, {40, 37}, {1030, 1001}})
    expect_agree<T>(crossentropy_outputs<T>(KernelShape::host, 6, v_local, v_real),
                    crossentropy_outputs<T>(KernelShape::device, 6, v_local, v_real),
                    {true, true, true, true, false},
                    std::string(type) + " cross-entropy V = " + std::to_string(v_local));
}

TEST(KernelShapes, LayerNormAndCrossEntropyAgreeBitForBit) {
  if (PTRAIN_DEVICE_BUILD) GTEST_SKIP() << "a device build has only the device shapes";
  std::printf("device shapes on teams of up to %d threads\n",
              std::min(4, Kokkos::DefaultExecutionSpace().concurrency()));
  check_shapes_agree<double>("fp64");
  check_shapes_agree<float>("fp32");
  check_shapes_agree<bf16>("bf16");
}

TEST(KernelShapes, DeviceBuildsRefuseTheHostShape) {
  if (!PTRAIN_DEVICE_BUILD) {
    set_kernel_shape(KernelShape::device);
    EXPECT_EQ(kernel_shape(), KernelShape::device);
    set_kernel_shape(KernelShape::host);
    EXPECT_EQ(kernel_shape(), KernelShape::host);
  } else {
    EXPECT_THROW(set_kernel_shape(KernelShape::host), Error);
    EXPECT_EQ(kernel_shape(), KernelShape::device);
  }
}

}  // namespace
