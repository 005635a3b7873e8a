#include <cmath>

#include "data/rng.hpp"
#include "kernels/kernels.hpp"
#include "model/stage.hpp"

namespace ptrain::model {

namespace K = kernels;

namespace {

// FNV-1a: a tensor's name -> its random stream.
std::uint64_t name_stream(const std::string& name) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

using kernels::slice;

}  // namespace

template <class T>
void init_range(const ChunkLayout& layout, const Dims& dims, std::uint64_t seed, K::Vec<T> out,
                std::int64_t lo) {
  const std::int64_t hi = lo + std::int64_t(out.extent(0));
  const double std_matrix = 0.02, std_residual = 0.02 / std::sqrt(2.0 * double(dims.L));
  K::fill(out, T(0));  // padding (vocabulary rows, flat-buffer tail) stays zero
  for (const auto& t : layout.tensors) {
    // The part of this tensor inside [lo, hi), as local element indices [k0, k1).
    const std::int64_t k0 = std::max<std::int64_t>(0, lo - t.offset);
    const std::int64_t k1 = std::min<std::int64_t>(t.numel, hi - t.offset);
    if (k0 >= k1) continue;
    const std::int64_t shift = t.offset - lo;  // out index of local element k: k + shift
    auto p = slice(out, k0 + shift, k1 - k0);
    if (t.kind == TensorKind::bias || t.kind == TensorKind::norm) {
      const bool is_gain = t.kind == TensorKind::norm && t.name.size() > 7 &&
                           t.name.compare(t.name.size() - 7, 7, ".weight") == 0;
      K::fill(p, T(is_gain ? 1 : 0));
      continue;
    }
    const bool residual = t.name.find("attn.proj.weight") != std::string::npos ||
                          t.name.find("mlp.proj.weight") != std::string::npos;
    const double stddev = residual ? std_residual : std_matrix;
    const std::uint64_t stream = name_stream(t.name);
    // Each slab: local element k -> multi-index in the slab -> global flat index.
    std::int64_t base = 0;
    for (const auto& s : t.slabs) {
      const int rank = int(t.global_shape.size());
      std::int64_t start[3] = {0, 0, 0}, count[3] = {1, 1, 1}, gshape[3] = {1, 1, 1};
      for (int d = 0; d < rank; ++d) {
        start[3 - rank + d] = s.start[d];
        count[3 - rank + d] = s.count[d];
        gshape[3 - rank + d] = t.global_shape[d];
      }
      const std::int64_t b0 = std::max(base, k0), b1 = std::min(base + s.numel(), k1);
      if (b0 < b1) {
        const std::int64_t slab0 = base;
        K::Vec<T> dst = out;
        Kokkos::parallel_for(
            "ptrain::init_normal", Kokkos::RangePolicy<>(b0, b1),
            KOKKOS_LAMBDA(const std::int64_t k) {
              const std::int64_t j = k - slab0;  // index within the slab
              const std::int64_t i2 = j % count[2], i1 = (j / count[2]) % count[1],
                                 i0 = j / (count[2] * count[1]);
              const std::int64_t g =
                  ((start[0] + i0) * gshape[1] + (start[1] + i1)) * gshape[2] + (start[2] + i2);
              dst(k + shift) = T(stddev * rng::normal(seed, stream, std::uint64_t(g)));
            });
      }
      base += s.numel();
    }
  }
  Kokkos::fence();
}

template void init_range<float>(const ChunkLayout&, const Dims&, std::uint64_t, K::Vec<float>,
                                std::int64_t);
template void init_range<double>(const ChunkLayout&, const Dims&, std::uint64_t, K::Vec<double>,
                                 std::int64_t);
// bf16(double -> float): the rounding of the fp32 value, so a bf16 copy of fp32 masters
// initialised here equals the bf16 initialisation.
template void init_range<bf16>(const ChunkLayout&, const Dims&, std::uint64_t, K::Vec<bf16>,
                               std::int64_t);

}  // namespace ptrain::model
