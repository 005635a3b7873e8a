// util/checksum.hpp — the order-free checksum of tensor elements, callable on host and device:
//   checksum = sum_i element_hash(i, bits(x_i))   (mod 2^64)
// with i the element's index (in the global tensor for checkpoints, ckpt/weights.hpp; in the
// local one for replica checks, parallel/trainer.hpp) and bits its stored bit pattern,
// zero-extended. Addition mod 2^64 is exact and order-free, so any decomposition (shards,
// threads, ranks) sums to the same value, and a swap of two elements changes it.
#pragma once
#include <Kokkos_Core.hpp>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace ptrain {

// splitmix64's finaliser: a bijective 64-bit mix.
KOKKOS_INLINE_FUNCTION std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

KOKKOS_INLINE_FUNCTION std::uint64_t element_hash(std::int64_t index, std::uint64_t bits) {
  return mix64(mix64(static_cast<std::uint64_t>(index) + 0x9e3779b97f4a7c15ULL) ^ bits);
}

// The stored bit pattern of a 2-, 4- or 8-byte value (bf16, float, double, integers),
// zero-extended to 64 bits.
template <class U>
KOKKOS_INLINE_FUNCTION std::uint64_t bits_of(U x) {
  static_assert(std::is_trivially_copyable_v<U> &&
                (sizeof(U) == 2 || sizeof(U) == 4 || sizeof(U) == 8));
  if constexpr (sizeof(U) == 2) {
    std::uint16_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  } else if constexpr (sizeof(U) == 4) {
    std::uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  } else {
    std::uint64_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  }
}

// FNV-1a over n bytes, continuing from h: a hash of what ranks or runs compare (attributes,
// a data fingerprint), not of tensors.
inline std::uint64_t fnv1a(const void* data, std::size_t n,
                           std::uint64_t h = 0xcbf29ce484222325ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}
inline std::uint64_t fnv1a(const std::string& bytes) { return fnv1a(bytes.data(), bytes.size()); }

// x with bit `bit` (0: the lowest) of its stored pattern flipped: a testing fault.
template <class U>
KOKKOS_INLINE_FUNCTION U with_bit_flipped(U x, int bit) {
  const std::uint64_t b = bits_of(x) ^ (std::uint64_t(1) << bit);
  U y;
  if constexpr (sizeof(U) == 2) {
    const std::uint16_t v = std::uint16_t(b);
    std::memcpy(&y, &v, sizeof y);
  } else if constexpr (sizeof(U) == 4) {
    const std::uint32_t v = std::uint32_t(b);
    std::memcpy(&y, &v, sizeof y);
  } else {
    std::memcpy(&y, &b, sizeof y);
  }
  return y;
}

}  // namespace ptrain
