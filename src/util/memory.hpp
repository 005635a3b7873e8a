// util/memory.hpp — the one tracked allocator. Every long-lived buffer is a
// TrackedView: a Kokkos::View whose bytes are counted under a category while it
// lives, so the log can report each rank's current and peak use by category.
#pragma once
#include <Kokkos_Core.hpp>
#include <array>
#include <cstddef>
#include <string>
#include <utility>

namespace ptrain {

enum class MemCategory : int { params, grads, optimizer, activations, comm, workspace, count };
const char* to_string(MemCategory c);

struct MemoryStats {
  std::array<std::size_t, static_cast<int>(MemCategory::count)> current{}, peak{};
  std::size_t total_current = 0, total_peak = 0;
};

namespace memory {
void add(MemCategory c, std::size_t bytes);
void sub(MemCategory c, std::size_t bytes);
const MemoryStats& stats();
void reset_peaks();  // peaks restart from the current use
}  // namespace memory

// A 1-D view of T whose bytes are charged to a category. Move-only.
template <class T>
class TrackedView {
 public:
  using view_type = Kokkos::View<T*>;
  TrackedView() = default;
  TrackedView(MemCategory cat, const std::string& label, std::size_t n)
      : view_(label, n), cat_(cat), bytes_(n * sizeof(T)) {
    memory::add(cat_, bytes_);
  }
  TrackedView(const TrackedView&) = delete;
  TrackedView& operator=(const TrackedView&) = delete;
  TrackedView(TrackedView&& o) noexcept { swap(o); }
  TrackedView& operator=(TrackedView&& o) noexcept {
    TrackedView tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  ~TrackedView() {
    if (bytes_) memory::sub(cat_, bytes_);
  }

  const view_type& view() const { return view_; }
  T* data() const { return view_.data(); }
  std::size_t size() const { return view_.extent(0); }
  T& operator[](std::size_t i) const { return view_(i); }

 private:
  void swap(TrackedView& o) noexcept {
    std::swap(view_, o.view_);
    std::swap(cat_, o.cat_);
    std::swap(bytes_, o.bytes_);
  }
  view_type view_;
  MemCategory cat_ = MemCategory::workspace;
  std::size_t bytes_ = 0;
};

// "1.23 GiB"
std::string format_bytes(double bytes);

}  // namespace ptrain
