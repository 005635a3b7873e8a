// ptrain-test: np=1 labels=quick timeout=120
// util/bf16.hpp against a reference that rounds by comparing distances in double (not by
// the bit trick the type uses): every bf16 pattern back and forth, and float patterns of
// every class (zeros, subnormals, normals, the largest finite values, infinities, NaNs) at
// every upper half, with the lower halves that decide rounding (ties, one either side of a
// tie, the ends) plus random ones.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "util/bf16.hpp"

using ptrain::bf16;

namespace {

float float_of_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
std::uint32_t bits_of_float(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// The bf16 nearest to x (ties to the even pattern), x not NaN. Candidates are the pattern
// that truncates x and the next one away from zero; past the largest finite bf16 the next
// one is 2^128 in magnitude (IEEE: what rounds up to it overflows to infinity).
std::uint16_t reference_round(float x) {
  const std::uint32_t u = bits_of_float(x);
  const std::uint16_t lo = std::uint16_t(u >> 16);
  if ((u & 0xFFFFu) == 0) return lo;  // exact, infinities included
  const std::uint16_t hi = std::uint16_t(lo + 1);
  const double v = double(x);
  const double v_lo = double(float_of_bits(std::uint32_t(lo) << 16));
  const bool overflow = (hi & 0x7FFFu) == 0x7F80u;
  const double v_hi = overflow ? std::copysign(std::ldexp(1.0, 128), v)
                               : double(float_of_bits(std::uint32_t(hi) << 16));
  const double d_lo = std::fabs(v - v_lo), d_hi = std::fabs(v_hi - v);
  if (d_lo < d_hi) return lo;
  if (d_hi < d_lo) return hi;
  return (lo & 1u) == 0 ? lo : hi;
}

void expect_rounds_like_reference(std::uint32_t u) {
  const float x = float_of_bits(u);
  const std::uint16_t got = bf16(x).bits;
  if (std::isnan(x)) {
    ASSERT_TRUE(std::isnan(float(bf16::from_bits(got)))) << std::hex << u;
    ASSERT_EQ(got >> 15, u >> 31) << "NaN sign, float bits " << std::hex << u;
    return;
  }
  ASSERT_EQ(got, reference_round(x)) << "float bits 0x" << std::hex << u;
}

}  // namespace

TEST(Bf16, IsTwoBytes) {
  EXPECT_EQ(sizeof(bf16), 2u);
  bf16 a[4];
  EXPECT_EQ(sizeof a, 8u);
}

// bf16 -> float -> bf16 is the identity for all 65,536 patterns but NaNs, which stay NaNs
// of the same sign; the float is the pattern shifted into the upper half.
TEST(Bf16, EveryPatternRoundTrips) {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const bf16 h = bf16::from_bits(std::uint16_t(b));
    const float f = h;
    ASSERT_EQ(bits_of_float(f), b << 16);
    const bf16 back(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(float(back)));
      ASSERT_EQ(back.bits >> 15, b >> 15);
    } else {
      ASSERT_EQ(back.bits, b) << std::hex << b;
    }
  }
}

// Each upper half (so every sign, exponent and mantissa: zeros, subnormals, normals, the
// largest finite values, infinities and NaNs) with the lower halves that decide rounding.
TEST(Bf16, RoundsToNearestEvenAtEveryUpperHalf) {
  const std::uint32_t lows[] = {0x0000, 0x0001, 0x3FFF, 0x7FFE, 0x7FFF, 0x8000,
                                0x8001, 0x8002, 0xBFFF, 0xFFFE, 0xFFFF};
  for (std::uint32_t hi = 0; hi < 65536; ++hi)
    for (std::uint32_t lo : lows) expect_rounds_like_reference((hi << 16) | lo);
}

TEST(Bf16, RoundsRandomFloatsLikeReference) {
  std::mt19937 gen(2026);
  for (int i = 0; i < 4'000'000; ++i) expect_rounds_like_reference(gen());
}

TEST(Bf16, NamedValues) {
  EXPECT_EQ(bf16(0.0f).bits, 0x0000);
  EXPECT_EQ(bf16(-0.0f).bits, 0x8000);
  EXPECT_EQ(bf16(1.0f).bits, 0x3F80);
  EXPECT_EQ(bf16(INFINITY).bits, 0x7F80);
  EXPECT_EQ(bf16(-INFINITY).bits, 0xFF80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1). 1 + 3 * 2^-8 ties up.
  EXPECT_EQ(float(bf16(1.0f + 0x1p-8f)), 1.0f);
  EXPECT_EQ(float(bf16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);
  // FLT_MAX is above the largest finite bf16 plus half its spacing: infinity.
  EXPECT_EQ(bf16(3.4028235e38f).bits, 0x7F80);
  // The largest finite bf16 (0x7F7F) is itself.
  EXPECT_EQ(bf16(float(bf16::from_bits(0x7F7F))).bits, 0x7F7F);
  // The smallest subnormal float rounds to +0; the smallest bf16 subnormal (2^-133) stays.
  EXPECT_EQ(bf16(float_of_bits(1)).bits, 0x0000);
  EXPECT_EQ(bf16(0x1p-133f).bits, 0x0001);
  // A signalling NaN comes back quiet, never as infinity.
  const bf16 nan(float_of_bits(0x7F800001u));
  EXPECT_TRUE(std::isnan(float(nan)));
  EXPECT_EQ(nan.bits & 0x0040, 0x0040);
  // Relative rounding error is at most 2^-8 (the unit roundoff of an 8-bit significand).
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = dist(gen);
    ASSERT_LE(std::fabs(float(bf16(x)) - x), std::fabs(x) * 0x1p-8f) << x;
  }
}
