// util/kmath.hpp — the one spelling of Kokkos' math functions for code inside kernels:
// Kokkos 3.4-3.6 have them as Kokkos::Experimental::exp, 3.7+ and 4.x as Kokkos::exp.
// Use ptrain::kmath::exp (sqrt, log, cos, tanh, ...) in KOKKOS_LAMBDA bodies.
#pragma once
#include <Kokkos_Core.hpp>

namespace ptrain {
#if KOKKOS_VERSION >= 30700
namespace kmath = ::Kokkos;
#else
namespace kmath = ::Kokkos::Experimental;
#endif
}  // namespace ptrain
