// util/element_types.hpp — the element types of the precision policy (util/precision.hpp) as
// the code is instantiated: a policy type per precision, and the accumulate type kernels
// compute in. Kernels read and write a storage type and compute in its accumulate type: bf16
// in, fp32 arithmetic.
#pragma once
#include <type_traits>

#include "util/bf16.hpp"
#include "util/precision.hpp"

namespace ptrain {

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
