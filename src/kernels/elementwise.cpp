// kernels/elementwise.cpp — view helpers, residual, GELU.
#include <cstddef>

#include "kernels/detail_math.hpp"
#include "kernels/kernels.hpp"
#include "kernels/parallel.hpp"
#include "util/checksum.hpp"
#include "util/error.hpp"

namespace ptrain::kernels {

namespace {
KernelShape g_shape = PTRAIN_DEVICE_BUILD ? KernelShape::device : KernelShape::host;
}  // namespace

KernelShape kernel_shape() { return g_shape; }
void set_kernel_shape(KernelShape shape) {
  PTRAIN_REQUIRE(!PTRAIN_DEVICE_BUILD || shape == KernelShape::device,
                 "kernels: a device build has no host kernel shapes");
  g_shape = shape;
}

using detail::tanh_;

namespace {
void require_len(const char* what, std::size_t extent, std::size_t need) {
  PTRAIN_REQUIRE(extent >= need, what, ": view of ", extent, " elements, needs ", need);
}
}  // namespace

template <class T>
void fill(Vec<T> x, T value) {
  parallel_items(
      "ptrain::fill", x.extent(0), KOKKOS_LAMBDA(std::size_t i) { x(i) = value; }, kForkElements);
}

template <class T>
void copy(Vec<T> dst, CVec<T> src) {
  PTRAIN_REQUIRE(dst.extent(0) == src.extent(0), "copy: extents differ (", dst.extent(0), " vs ",
                 src.extent(0), ")");
  parallel_items(
      "ptrain::copy", dst.extent(0), KOKKOS_LAMBDA(std::size_t i) { dst(i) = src(i); },
      kForkElements);
}

template <class T>
void copy_strided(Vec<T> dst, const Strided& d, CVec<T> src, const Strided& s, int n0, int n1,
                  int n2) {
  if (n0 <= 0 || n1 <= 0 || n2 <= 0) return;
  const auto last = [&](const Strided& x) {
    return x.offset + std::size_t(n0 - 1) * x.s0 + std::size_t(n1 - 1) * x.s1 + std::size_t(n2);
  };
  require_len("copy_strided dst", dst.extent(0), last(d));
  require_len("copy_strided src", src.extent(0), last(s));
  T* const out = dst.data();
  const T* const in = src.data();
  const Strided dd = d, ss = s;
  // One (i, j) row of n2 contiguous elements per iteration.
  Kokkos::parallel_for(
      "ptrain::copy_strided", n0 * n1, KOKKOS_LAMBDA(int r) {
        const std::size_t i = std::size_t(r / n1), j = std::size_t(r % n1);
        T* o = out + dd.offset + i * dd.s0 + j * dd.s1;
        const T* x = in + ss.offset + i * ss.s0 + j * ss.s1;
        for (int k = 0; k < n2; ++k) o[k] = x[k];
      });
}

template <class T>
void axpy(Vec<T> y, accumulate_t<T> alpha, CVec<T> x) {
  using A = accumulate_t<T>;
  PTRAIN_REQUIRE(y.extent(0) == x.extent(0), "axpy: extents differ (", y.extent(0), " vs ",
                 x.extent(0), ")");
  parallel_items(
      "ptrain::axpy", y.extent(0),
      KOKKOS_LAMBDA(std::size_t i) { detail::add_to(y(i), alpha * A(x(i))); }, kForkElements);
}

template <class To, class From>
void cast(Vec<To> dst, CVec<From> src) {
  PTRAIN_REQUIRE(dst.extent(0) == src.extent(0), "cast: extents differ (", dst.extent(0), " vs ",
                 src.extent(0), ")");
  parallel_items(
      "ptrain::cast", dst.extent(0), KOKKOS_LAMBDA(std::size_t i) { dst(i) = To(src(i)); },
      kForkElements);
}
template void cast<bf16, float>(Vec<bf16>, CVec<float>);
template void cast<float, bf16>(Vec<float>, CVec<bf16>);

void add_block_sum(Vec<float> dst, CVec<bf16> blocks, int n_blocks) {
  const std::size_t n = dst.extent(0);
  require_len("add_block_sum blocks", blocks.extent(0), n * std::size_t(n_blocks));
  parallel_items(
      "ptrain::add_block_sum", n,
      KOKKOS_LAMBDA(std::size_t i) {
        float s = 0;
        for (int q = 0; q < n_blocks; ++q) s += float(blocks(std::size_t(q) * n + i));
        dst(i) += s;
      },
      kForkElements);
}

template <class T>
double sum_of_squares(CVec<T> x) {
  // Chunks of contiguous elements, each summed with independent lanes (vectorizes).
  constexpr std::size_t kChunk = 4096;
  const std::size_t n = x.extent(0);
  const std::size_t nchunks = (n + kChunk - 1) / kChunk;
  double total = 0;
  Kokkos::parallel_reduce(
      "ptrain::sum_of_squares", nchunks,
      KOKKOS_LAMBDA(std::size_t k, double& acc) {
        const std::size_t i0 = k * kChunk;
        const int len = int(i0 + kChunk <= n ? kChunk : n - i0);
        const T* p = x.data() + i0;
        double lanes[detail::kLanes] = {};
        int i = 0;
        for (; i + detail::kLanes <= len; i += detail::kLanes)
          for (int l = 0; l < detail::kLanes; ++l) lanes[l] += double(p[i + l]) * double(p[i + l]);
        for (; i < len; ++i) acc += double(p[i]) * double(p[i]);
        for (int l = 0; l < detail::kLanes; ++l) acc += lanes[l];
      },
      total);
  return total;
}

template <class T>
std::int64_t count_nonfinite(CVec<T> x) {
  std::int64_t n = 0;
  Kokkos::parallel_reduce(
      "ptrain::count_nonfinite", x.extent(0),
      KOKKOS_LAMBDA(std::size_t i, std::int64_t & acc) {
        acc += kmath::isfinite(accumulate_t<T>(x(i))) ? 0 : 1;
      },
      n);
  return n;
}

template <class T>
std::uint64_t checksum(CVec<T> x, std::int64_t first) {
  // Sums of uint64 wrap mod 2^64 and commute, so any reduction order gives the same value.
  std::uint64_t sum = 0;
  Kokkos::parallel_reduce(
      "ptrain::checksum", x.extent(0),
      KOKKOS_LAMBDA(std::size_t i, std::uint64_t & acc) {
        acc += element_hash(first + std::int64_t(i), bits_of(x(i)));
      },
      sum);
  return sum;
}

template <class T>
void flip_bit(Vec<T> x, std::size_t i, int bit) {
  require_len("flip_bit", x.extent(0), i + 1);
  Kokkos::parallel_for(
      "ptrain::flip_bit", Kokkos::RangePolicy<>(i, i + 1),
      KOKKOS_LAMBDA(std::size_t j) { x(j) = with_bit_flipped(x(j), bit); });
}

template <class T>
void residual_forward(Vec<T> out, CVec<T> a, CVec<T> b, std::size_t n) {
  require_len("residual_forward out", out.extent(0), n);
  require_len("residual_forward a", a.extent(0), n);
  require_len("residual_forward b", b.extent(0), n);
  parallel_items(
      "ptrain::residual_forward", n,
      KOKKOS_LAMBDA(std::size_t i) {
        using A = accumulate_t<T>;
        out(i) = T(A(a(i)) + A(b(i)));
      },
      kForkElements);
}

namespace {
constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluCubic = 0.044715;
}  // namespace

template <class T>
void gelu_forward(Vec<T> out, CVec<T> inp, std::size_t n) {
  require_len("gelu_forward out", out.extent(0), n);
  require_len("gelu_forward inp", inp.extent(0), n);
  parallel_items(
      "ptrain::gelu_forward", n,
      KOKKOS_LAMBDA(std::size_t i) {
        using A = accumulate_t<T>;
        const A x = inp(i);
        const A u = A(kGeluScale) * (x + A(kGeluCubic) * x * x * x);
        out(i) = T(A(0.5) * x * (A(1) + tanh_(u)));
      },
      kForkElements);
}

template <class T>
void gelu_backward(Vec<T> dinp, CVec<T> inp, CVec<T> dout, std::size_t n) {
  require_len("gelu_backward dinp", dinp.extent(0), n);
  require_len("gelu_backward inp", inp.extent(0), n);
  require_len("gelu_backward dout", dout.extent(0), n);
  parallel_items(
      "ptrain::gelu_backward", n,
      KOKKOS_LAMBDA(std::size_t i) {
        using A = accumulate_t<T>;
        const A x = inp(i);
        const A u = A(kGeluScale) * (x + A(kGeluCubic) * x * x * x);
        const A th = tanh_(u);
        const A sech2 = A(1) - th * th;
        const A du = A(kGeluScale) * (A(1) + A(3 * kGeluCubic) * x * x);
        const A grad = A(0.5) * (A(1) + th) + A(0.5) * x * sech2 * du;
        dinp(i) = T(grad * A(dout(i)));
      },
      kForkElements);
}

#define PTRAIN_INSTANTIATE(T)                                                                    \
  template void fill<T>(Vec<T>, T);                                                              \
  template void copy<T>(Vec<T>, CVec<T>);                                                        \
  template void copy_strided<T>(Vec<T>, const Strided&, CVec<T>, const Strided&, int, int, int); \
  template void axpy<T>(Vec<T>, accumulate_t<T>, CVec<T>);                                       \
  template double sum_of_squares<T>(CVec<T>);                                                    \
  template std::int64_t count_nonfinite<T>(CVec<T>);                                             \
  template std::uint64_t checksum<T>(CVec<T>, std::int64_t);                                     \
  template void flip_bit<T>(Vec<T>, std::size_t, int);                                           \
  template void residual_forward<T>(Vec<T>, CVec<T>, CVec<T>, std::size_t);                      \
  template void gelu_forward<T>(Vec<T>, CVec<T>, std::size_t);                                   \
  template void gelu_backward<T>(Vec<T>, CVec<T>, CVec<T>, std::size_t);
PTRAIN_INSTANTIATE(float)
PTRAIN_INSTANTIATE(double)
PTRAIN_INSTANTIATE(bf16)
#undef PTRAIN_INSTANTIATE

}  // namespace ptrain::kernels
