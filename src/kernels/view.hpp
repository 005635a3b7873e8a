// kernels/view.hpp — the tensor types every kernel takes.
// A tensor is a 1-D contiguous Kokkos::View of the default execution space (often a
// subview of a flat parameter, gradient or activation buffer) plus explicit dims,
// stored row-major as in llm.c. Views may be longer than a kernel needs; each kernel
// checks they are long enough.
#pragma once
#include <Kokkos_Core.hpp>
#include <cstdint>

namespace ptrain::kernels {

namespace detail {
template <class V>
struct NonDeduced {
  using type = V;
};
}  // namespace detail

// A tensor the kernel writes (or accumulates into). Kernels deduce T from these when given
// exactly this type; Kokkos::subview returns another View type, so calls passing subviews
// name T (kernels::gelu_forward<T>(...)) and the arguments convert.
template <class T>
using Vec = Kokkos::View<T*>;

// A tensor the kernel only reads. Deliberately not deduced: a Vec<float> converts to it,
// and calls that pass only read-only tensors (or subview types) name T: f<float>(...).
template <class T>
using CVec = typename detail::NonDeduced<Kokkos::View<const T*>>::type;

// A tensor the kernel writes whose element type is named by the call, not deduced: parameter
// gradients in the grad type beside compute-typed activations (kernels::matmul_backward<T, G>).
template <class T>
using OutVec = typename detail::NonDeduced<Kokkos::View<T*>>::type;

// Token ids / targets / positions.
using IntVec = Kokkos::View<const int*>;

// A device build (CUDA, HIP, SYCL): tensors live in device memory and the kernels take their
// GPU shapes; a CPU build takes the host shapes by default and can run the device ones.
#if defined(KOKKOS_ENABLE_CUDA) || defined(KOKKOS_ENABLE_HIP) || defined(KOKKOS_ENABLE_SYCL)
#define PTRAIN_DEVICE_BUILD 1
#else
#define PTRAIN_DEVICE_BUILD 0
#endif

// How the kernels with two shapes (attention, LayerNorm, cross-entropy) parallelise.
// - host: a thread per row (or per block), its loop over columns vectorised;
// - device: a team of threads per row (or per tile), its threads splitting the columns.
// LayerNorm's and cross-entropy's two shapes sum in the same order (their row sums agree bit
// for bit; elementwise results to the last place, as the compiler fuses multiply-adds);
// attention's two kernels sum in different orders. A device build has only the device
// shapes. Process-wide: backend%kernels sets it.
enum class KernelShape { host, device };
KernelShape kernel_shape();
void set_kernel_shape(KernelShape shape);  // device builds refuse host (Error)

// Elements [offset, offset + n) of v: a tensor inside a flat buffer.
template <class T>
Kokkos::View<T*> slice(const Kokkos::View<T*>& v, std::int64_t offset, std::int64_t n) {
  return Kokkos::subview(v, Kokkos::make_pair(offset, offset + n));
}

}  // namespace ptrain::kernels
