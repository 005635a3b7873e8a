// data/rng.hpp — counter-based random numbers: every value is a pure function of
// (seed, stream, a, b), with no generator state, so any rank or thread can compute
// any draw directly (layout-invariant data, weight init on any grid).
//
// The core is Philox-4x32-10 (Salmon et al., SC'11; the Random123 / cuRAND generator):
//   key     = stream_key(seed, stream)   (64 bits: seed ^ splitmix64(stream))
//   counter = (lo32(a), hi32(a), lo32(b), hi32(b))
// giving 128 random bits per (seed, stream, a, b). Callable on host and device.
#pragma once
#include <Kokkos_Core.hpp>
#include <cstdint>

#include "util/checksum.hpp"
#include "util/kmath.hpp"

namespace ptrain::rng {

struct Block {
  std::uint32_t w[4];
};

// Philox-4x32-10 on one 128-bit counter with a 64-bit key (Random123's word order).
KOKKOS_INLINE_FUNCTION Block philox4x32_10(std::uint32_t c0, std::uint32_t c1, std::uint32_t c2,
                                           std::uint32_t c3, std::uint32_t k0, std::uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const std::uint64_t p0 = std::uint64_t(0xD2511F53u) * c0;
    const std::uint64_t p1 = std::uint64_t(0xCD9E8D57u) * c2;
    const std::uint32_t n0 = std::uint32_t(p1 >> 32) ^ c1 ^ k0;
    const std::uint32_t n2 = std::uint32_t(p0 >> 32) ^ c3 ^ k1;
    c1 = std::uint32_t(p1);
    c3 = std::uint32_t(p0);
    c0 = n0;
    c2 = n2;
  }
  return Block{{c0, c1, c2, c3}};
}

// splitmix64's output function: a bijective 64-bit mix.
KOKKOS_INLINE_FUNCTION std::uint64_t splitmix64(std::uint64_t x) {
  return mix64(x + 0x9E3779B97F4A7C15ull);
}

// Distinct streams of one seed get distinct keys (splitmix64 is a bijection).
KOKKOS_INLINE_FUNCTION std::uint64_t stream_key(std::uint64_t seed, std::uint64_t stream) {
  return seed ^ splitmix64(stream);
}

// 128 random bits for (seed, stream, a, b).
KOKKOS_INLINE_FUNCTION Block block(std::uint64_t seed, std::uint64_t stream, std::uint64_t a,
                                   std::uint64_t b) {
  const std::uint64_t k = stream_key(seed, stream);
  return philox4x32_10(std::uint32_t(a), std::uint32_t(a >> 32), std::uint32_t(b),
                       std::uint32_t(b >> 32), std::uint32_t(k), std::uint32_t(k >> 32));
}

// 64 random bits (words 0 and 1 of the block).
KOKKOS_INLINE_FUNCTION std::uint64_t draw(std::uint64_t seed, std::uint64_t stream, std::uint64_t a,
                                          std::uint64_t b = 0) {
  const Block r = block(seed, stream, a, b);
  return std::uint64_t(r.w[0]) | (std::uint64_t(r.w[1]) << 32);
}

// An integer in [0, n), n >= 1, by 64-bit modulo: the bias is below n / 2^64 (zero when
// n is a power of two).
KOKKOS_INLINE_FUNCTION std::uint64_t below(std::uint64_t n, std::uint64_t seed,
                                           std::uint64_t stream, std::uint64_t a,
                                           std::uint64_t b = 0) {
  return draw(seed, stream, a, b) % n;
}

// 64 bits -> a double in the open interval (0, 1): (top 52 bits + 1/2) * 2^-52.
KOKKOS_INLINE_FUNCTION double to_open_unit(std::uint64_t bits) {
  return (double(bits >> 12) + 0.5) * (1.0 / 4503599627370496.0);
}

// A uniform double in (0, 1).
KOKKOS_INLINE_FUNCTION double uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t a,
                                      std::uint64_t b = 0) {
  return to_open_unit(draw(seed, stream, a, b));
}

// A standard normal by Box-Muller on the block's two 64-bit halves:
//   z = sqrt(-2 ln u1) cos(2 pi u2),  u1, u2 in (0, 1).
KOKKOS_INLINE_FUNCTION double normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t a,
                                     std::uint64_t b = 0) {
  using kmath::cos;
  using kmath::log;
  using kmath::sqrt;
  const Block r = block(seed, stream, a, b);
  const double u1 = to_open_unit(std::uint64_t(r.w[0]) | (std::uint64_t(r.w[1]) << 32));
  const double u2 = to_open_unit(std::uint64_t(r.w[2]) | (std::uint64_t(r.w[3]) << 32));
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925286766559 * u2);
}

// Position of i in a permutation of [0, n) that is a pure function of (seed, stream, a),
// computed in O(1): a 4-round Feistel network (Luby-Rackoff: a pseudorandom permutation) on
// the smallest even-bit domain 2^(2h) >= n, its round function Philox of (a, round and right
// half), walked along the cycle until it lands below n (cycle walking: the domain is under 4n,
// so fewer than 4 walks on average). n >= 1, i < n. Host only (a loop of data-dependent length).
inline std::uint64_t permute(std::uint64_t i, std::uint64_t n, std::uint64_t seed,
                             std::uint64_t stream, std::uint64_t a) {
  if (n <= 1) return 0;
  int bits = 1;
  while (bits < 64 && (std::uint64_t(1) << bits) < n) ++bits;
  const int h = (bits + 1) / 2;  // each half; 2h <= 64
  const std::uint64_t mask = h >= 32 ? 0xffffffffull : (std::uint64_t(1) << h) - 1;
  std::uint64_t x = i;
  do {
    std::uint64_t left = x >> h, right = x & mask;
    for (std::uint64_t round = 0; round < 4; ++round) {
      const std::uint64_t f = draw(seed, stream, a, (right << 8) | round) & mask;
      const std::uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << h) | right;
  } while (x >= n);
  return x;
}

}  // namespace ptrain::rng
