// util/bf16.hpp — ptrain's bfloat16 storage type: 2 bytes, the upper half of an IEEE float
// (1 sign, 8 exponent, 7 mantissa bits). Kokkos 3.4 has no bf16, and Kokkos 4's host
// bhalf_t is a 4-byte float, so neither can be the storage of a bf16 tensor.
//
// A storage type, not an arithmetic one: it converts implicitly to float and only explicitly
// from float (round to nearest, ties to even; NaN stays NaN with its sign, infinities stay
// infinite, subnormals round like any other value). So `bf16 + bf16` is float arithmetic, and
// `bf16 acc = 0; acc += x` does not compile: kernels accumulate in their accumulate type
// (util/element_types.hpp's accumulate_t) and round once, where they store. The conversion is the
// same bit arithmetic on the host and on the device, so both round alike; under CUDA it also
// converts to and from __nv_bfloat16 (bit for bit) for cuBLAS and device intrinsics.
#pragma once
#include <Kokkos_Core.hpp>
#include <cstdint>
#include <cstring>
#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif

namespace ptrain {

struct bf16 {
  std::uint16_t bits;

  bf16() = default;
  KOKKOS_INLINE_FUNCTION explicit bf16(float f) : bits(round_bits(f)) {}
  KOKKOS_INLINE_FUNCTION operator float() const {
    const std::uint32_t u = std::uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  KOKKOS_INLINE_FUNCTION static bf16 from_bits(std::uint16_t b) {
    bf16 h;
    h.bits = b;
    return h;
  }
#if defined(__CUDACC__)
  KOKKOS_INLINE_FUNCTION explicit bf16(__nv_bfloat16 h) {
    static_assert(sizeof(__nv_bfloat16) == 2, "__nv_bfloat16 is 2 bytes");
    bits = __nv_bfloat16_raw(h).x;
  }
  KOKKOS_INLINE_FUNCTION explicit operator __nv_bfloat16() const {
    __nv_bfloat16_raw r;
    r.x = bits;
    return __nv_bfloat16(r);
  }
#endif

  // Round to nearest even on the bit pattern: adding 0x7FFF plus the lowest kept bit carries
  // into the kept half exactly when the dropped half is above one half (or equal, with the
  // kept half odd). A carry out of the largest finite value gives infinity, as IEEE rounding
  // does. NaN is handled first so a carry cannot turn it into infinity; it is kept quiet.
  KOKKOS_INLINE_FUNCTION static std::uint16_t round_bits(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return std::uint16_t((u >> 16) | 0x0040u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return std::uint16_t(u >> 16);
  }
};
static_assert(sizeof(bf16) == 2, "bf16 is 2 bytes");

}  // namespace ptrain
