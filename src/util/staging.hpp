// util/staging.hpp — the only way host code touches tensor memory (Kokkos' default memory
// space: the GPU's in a CUDA build). Three forms:
//   HostView   a scope in which the host reads and/or writes a tensor: on a host space the
//              tensor itself (no copy), on a device a host mirror, filled on entry when read
//              and copied back on exit when written;
//   to_host    a copy out into host memory;
//   from_host  a copy in from host memory.
// Each is ordered after the kernels before it (deep copies fence; a host-space HostView fences
// on entry) and opens the device guard (util/device_guard.hpp) for exactly its extent.
#pragma once
#include <Kokkos_Core.hpp>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "util/device_guard.hpp"

namespace ptrain::staging {

enum class Access { read, write, read_write };

template <class T>
class HostView {
 public:
  using Tensor = Kokkos::View<T*>;
  HostView(const Tensor& tensor, Access access)
      : guard_("staging::HostView"),
        tensor_(tensor),
        host_(Kokkos::create_mirror_view(tensor)),
        access_(access) {
    Kokkos::fence();  // kernels writing the tensor are done before the host looks
    if constexpr (!aliases())
      if (access != Access::write) Kokkos::deep_copy(host_, tensor_);
  }
  ~HostView() {
    if constexpr (!std::is_const_v<T> && !aliases())
      if (access_ != Access::read) Kokkos::deep_copy(tensor_, host_);
  }
  HostView(const HostView&) = delete;
  HostView& operator=(const HostView&) = delete;

  T* data() const { return host_.data(); }
  std::size_t size() const { return host_.extent(0); }
  T& operator[](std::size_t i) const { return host_(i); }

 private:
  // A host-space tensor is its own mirror.
  static constexpr bool aliases() {
    return std::is_same_v<typename Tensor::memory_space, typename Tensor::HostMirror::memory_space>;
  }
  device_guard::HostAccess guard_;  // first: open before the mirror is read
  Tensor tensor_;
  typename Tensor::HostMirror host_;
  Access access_;
};

// Elements [0, n) of `tensor` into host memory at `host`.
template <class T>
void copy_out(const Kokkos::View<const T*>& tensor, T* host, std::size_t n) {
  Kokkos::deep_copy(
      Kokkos::View<T*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(host, n),
      Kokkos::subview(tensor, Kokkos::make_pair(std::size_t(0), n)));
}
// The whole tensor as a host vector.
template <class T>
std::vector<std::remove_const_t<T>> to_host(const Kokkos::View<T*>& tensor) {
  std::vector<std::remove_const_t<T>> v(tensor.extent(0));
  copy_out<std::remove_const_t<T>>(tensor, v.data(), v.size());
  return v;
}
// n elements from host memory into elements [0, n) of `tensor`.
template <class T>
void from_host(const Kokkos::View<T*>& tensor, const T* host, std::size_t n) {
  Kokkos::deep_copy(
      Kokkos::subview(tensor, Kokkos::make_pair(std::size_t(0), n)),
      Kokkos::View<const T*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(host, n));
}

}  // namespace ptrain::staging
