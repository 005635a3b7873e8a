// util/precision.hpp — the precision policy and the element types it names.
//
// One policy, chosen once from the deck (deck::precision_policy), says which type each kind
// of buffer has:
//   master   the optimizer's weights and AdamW moments (fp32; fp64 for the reference)
//   compute  weights as the kernels read them, and activations (bf16, fp32 or fp64)
//   grad     the gradient buffers (fp32 by default; bf16 with parallel%grad_dtype = 'bf16')
//   wire     what the data-parallel reduction sends (the grad type; bf16 accumulates in fp32
//            on the receiving side)
// fp32 and fp64 decks are the policy with every field equal. Kernels read and write a
// storage type and compute in its accumulate type: bf16 in, fp32 arithmetic.
#pragma once
#include <cstddef>
#include <string>
#include <type_traits>

#include "util/bf16.hpp"

namespace ptrain {

enum class Precision { fp64, fp32, bf16 };

// "fp64", "fp32", "bf16": the deck's spelling.
inline const char* to_string(Precision p) {
  switch (p) {
    case Precision::fp64:
      return "fp64";
    case Precision::fp32:
      return "fp32";
    case Precision::bf16:
      return "bf16";
  }
  return "?";
}
inline std::size_t bytes_of(Precision p) {
  return p == Precision::fp64 ? 8 : p == Precision::fp32 ? 4 : 2;
}

struct PrecisionPolicy {
  Precision master = Precision::fp32, compute = Precision::fp32, grad = Precision::fp32,
            wire = Precision::fp32;
  // Every field the same: the single-type runs (fp32, fp64) whose results must not change.
  bool uniform() const { return master == compute && compute == grad && grad == wire; }
};

// The type arithmetic on a storage type T is done in: T itself, fp32 for bf16.
template <class T>
struct accumulate {
  using type = T;
};
template <>
struct accumulate<bf16> {
  using type = float;
};
template <class T>
using accumulate_t = typename accumulate<T>::type;

// The element types of one policy, as the code is instantiated: compute (weights as kernels
// read them, activations), grad (gradient buffers), master (optimizer weights and moments).
// The wire type is chosen at run time (PrecisionPolicy::wire).
template <class Compute, class Grad, class Master>
struct Types {
  using compute = Compute;
  using grad = Grad;
  using master = Master;
  // The policy's master weights are the compute weights themselves (fp32, fp64 runs).
  static constexpr bool uniform = std::is_same_v<Compute, Grad> && std::is_same_v<Grad, Master>;
};
template <class T>
using Uniform = Types<T, T, T>;  // every buffer in T
using Fp64 = Uniform<double>;    // the reference
using Fp32 = Uniform<float>;
using Bf16 = Types<bf16, float, float>;      // bf16 compute, fp32 gradients and masters
using Bf16Grads = Types<bf16, bf16, float>;  // parallel%grad_dtype = 'bf16'

// The names a class templated on a policy P uses: T (compute), G (grad), M (master) and A,
// the accumulate type of T.
#define PTRAIN_POLICY_TYPES(P)   \
  using T = typename P::compute; \
  using G = typename P::grad;    \
  using M = typename P::master;  \
  using A = ::ptrain::accumulate_t<typename P::compute>

// The Precision of an element type.
template <class T>
constexpr Precision precision_of() {
  if constexpr (std::is_same_v<T, double>)
    return Precision::fp64;
  else if constexpr (std::is_same_v<T, float>)
    return Precision::fp32;
  else if constexpr (std::is_same_v<T, bf16>)
    return Precision::bf16;
  else
    static_assert(sizeof(T) == 0, "not a floating-point storage type");
}

}  // namespace ptrain
