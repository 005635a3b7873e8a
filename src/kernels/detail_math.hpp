// kernels/detail_math.hpp — math used inside kernels (private to src/kernels/*.cpp).
// - kmath:: is util/kmath.hpp's spelling of the Kokkos math functions.
// - exp_ / tanh_ on float use a polynomial exp on the host that compilers vectorize (the
//   libm call does not vectorize and dominated the softmax, cross-entropy and GELU
//   kernels); double and device code use the library functions.
// - Row reductions (sum, max, dot) keep 16 independent partial results so the compiler
//   vectorizes them without reassociating floating point (-ffast-math is not used). They read
//   a storage type T and return its accumulate type (util/element_types.hpp: fp32 for bf16).
#pragma once
#include <Kokkos_Core.hpp>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/view.hpp"
#include "util/element_types.hpp"
#include "util/kmath.hpp"

namespace ptrain::kernels::detail {

#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__) || defined(__SYCL_DEVICE_ONLY__)
#define PTRAIN_KERNELS_DEVICE_PASS 1
#else
#define PTRAIN_KERNELS_DEVICE_PASS 0
#endif

// True when T is a storage type whose arithmetic is done in a wider type (bf16): kernels then
// widen their operands and round their results once, where they store. (Namespace scope:
// nvcc takes no function-local constant inside a device lambda's `if constexpr`.)
template <class T>
constexpr bool kWidened = !std::is_same_v<T, accumulate_t<T>>;

KOKKOS_INLINE_FUNCTION double exp_(double x) { return kmath::exp(x); }

// exp(x) in float: about 1 ulp (max relative error 8e-8) for x in [-87, 88]; inputs
// below -87 give 1.6e-38 (not 0), above 88 give exp(88). Callers that need exact zeros
// (masked scores) write them explicitly.
KOKKOS_INLINE_FUNCTION float exp_(float x) {
#if PTRAIN_KERNELS_DEVICE_PASS
  return kmath::exp(x);
#else
  // Clamp with integer min on the bit pattern: a float compare would stop GCC from
  // if-converting (and so vectorizing) the loop under the default -ftrapping-math.
  std::int32_t si;
  std::memcpy(&si, &x, sizeof si);
  si = si < 0x42B00000 ? si : 0x42B00000;  // x > 88 -> 88 (signed bits order positives)
  std::uint32_t u = static_cast<std::uint32_t>(si);
  u = u < 0xC2AE0000u ? u : 0xC2AE0000u;  // x < -87 -> -87 (unsigned bits order negatives)
  std::memcpy(&x, &u, sizeof x);
  // x = n ln2 + r, |r| <= ln2/2; n by the 1.5*2^23 rounding trick (its low bits hold n).
  const float big = x * 1.44269504088896341f + 12582912.f;
  const float n = big - 12582912.f;
  std::int32_t nbits;
  std::memcpy(&nbits, &big, sizeof nbits);
  float r = x - n * 0.693359375f;
  r = r - n * (-2.12194440e-4f);
  float p = 1.9875691500e-4f;  // Cephes expf polynomial
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const std::int32_t sbits = (nbits - 0x4B400000 + 127) * (1 << 23);  // 2^n
  float s;
  std::memcpy(&s, &sbits, sizeof s);
  return p * s;
#endif
}

KOKKOS_INLINE_FUNCTION double tanh_(double x) { return kmath::tanh(x); }

// tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|): absolute error ~1e-7.
KOKKOS_INLINE_FUNCTION float tanh_(float x) {
#if PTRAIN_KERNELS_DEVICE_PASS
  return kmath::tanh(x);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const std::uint32_t sign = bits & 0x80000000u;
  const std::uint32_t abs_bits = bits & 0x7FFFFFFFu;
  float ax;
  std::memcpy(&ax, &abs_bits, sizeof ax);
  const float e = exp_(-2.0f * ax);
  float t = (1.0f - e) / (1.0f + e);
  std::uint32_t tbits;
  std::memcpy(&tbits, &t, sizeof tbits);
  tbits |= sign;
  std::memcpy(&t, &tbits, sizeof t);
  return t;
#endif
}

template <class T>
KOKKOS_INLINE_FUNCTION T log_(T x) {
  return kmath::log(x);
}
template <class T>
KOKKOS_INLINE_FUNCTION T sqrt_(T x) {
  return kmath::sqrt(x);
}

constexpr int kLanes = 16;

// sum_i x[i]
template <class T, class A = accumulate_t<T>>
KOKKOS_INLINE_FUNCTION A row_sum(const T* x, int n) {
  A acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += A(x[i + l]);
  A s = 0;
  for (; i < n; ++i) s += A(x[i]);
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// sum_i x[i] y[i]
template <class T, class A = accumulate_t<T>>
KOKKOS_INLINE_FUNCTION A row_dot(const T* x, const T* y, int n) {
  A acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += A(x[i + l]) * A(y[i + l]);
  A s = 0;
  for (; i < n; ++i) s += A(x[i]) * A(y[i]);
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// max_i x[i]; `init` for n == 0 (and as a lower bound).
template <class T, class A = accumulate_t<T>>
KOKKOS_INLINE_FUNCTION A row_max(const T* x, int n, accumulate_t<T> init) {
  A acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = init;
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = A(x[i + l]) > acc[l] ? A(x[i + l]) : acc[l];
  A m = init;
  for (; i < n; ++i) m = A(x[i]) > m ? A(x[i]) : m;
  for (int l = 0; l < kLanes; ++l) m = acc[l] > m ? acc[l] : m;
  return m;
}

// sum_i exp(x[i] * scale - shift)
template <class T, class A = accumulate_t<T>>
KOKKOS_INLINE_FUNCTION A row_sum_exp(const T* x, int n, accumulate_t<T> scale,
                                     accumulate_t<T> shift) {
  A acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += exp_(A(x[i + l]) * scale - shift);
  A s = 0;
  for (; i < n; ++i) s += exp_(A(x[i]) * scale - shift);
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// sum_i term(i), i < n, in row_sum's order (kLanes lanes over the whole blocks, the tail, then
// the lanes): bit for bit row_sum when term(i) = A(x[i]).
template <class A, class Term>
KOKKOS_INLINE_FUNCTION A row_sum_of(int n, const Term& term) {
  A acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += term(i + l);
  A s = 0;
  for (; i < n; ++i) s += term(i);
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// The lane reductions above by a team (the device shape of a row kernel): each lane's partial,
// and the tail's, on a thread of its own in the serial order, then combined in the serial
// order by every thread: bit for bit the serial result, whatever the team size. `lanes` is
// team scratch of kLanes + 1 values; combine is `a + b`, or max as row_max writes it.
template <class A, class Member, class Term, class Combine>
KOKKOS_INLINE_FUNCTION A team_lanes(const Member& team, A* lanes, int n, A init, const Term& term,
                                    const Combine& combine) {
  const int full = n / kLanes * kLanes;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, kLanes + 1), [&](int l) {
    A acc = init;
    if (l < kLanes)
      for (int i = l; i < full; i += kLanes) acc = combine(acc, term(i));
    else
      for (int i = full; i < n; ++i) acc = combine(acc, term(i));
    lanes[l] = acc;
  });
  team.team_barrier();
  A s = lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) s = combine(s, lanes[l]);
  team.team_barrier();  // the lanes may be reused at once
  return s;
}
// A league of one team per row with room for team_lanes' lanes: on a device as many threads
// as Kokkos picks, on CPU threads (tests of the device shape) up to 4 of the pool.
template <class A>
Kokkos::TeamPolicy<> row_teams(int rows) {
#if PTRAIN_DEVICE_BUILD
  Kokkos::TeamPolicy<> policy(rows, Kokkos::AUTO);
#else
  const int pool = Kokkos::DefaultExecutionSpace().concurrency();
  Kokkos::TeamPolicy<> policy(rows, pool < 4 ? pool : 4);
#endif
  return policy.set_scratch_size(0, Kokkos::PerTeam((kLanes + 1) * sizeof(A)));
}
template <class A, class Member>
KOKKOS_INLINE_FUNCTION A* lanes_of(const Member& team) {
  return static_cast<A*>(team.team_scratch(0).get_shmem((kLanes + 1) * sizeof(A)));
}

struct Plus {
  template <class A>
  KOKKOS_INLINE_FUNCTION A operator()(A a, A b) const {
    return a + b;
  }
};
struct Max {  // row_max's: max(acc, v) = v > acc ? v : acc
  template <class A>
  KOKKOS_INLINE_FUNCTION A operator()(A acc, A v) const {
    return v > acc ? v : acc;
  }
};

// dst = dst + v in the accumulate type, rounded once to dst's type: `dst += v` for float
// and double, a widening add for bf16.
template <class G, class A>
KOKKOS_INLINE_FUNCTION void add_to(G& dst, A v) {
  dst = G(accumulate_t<G>(dst) + v);
}

}  // namespace ptrain::kernels::detail
