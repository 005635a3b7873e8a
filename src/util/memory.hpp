// util/memory.hpp — the one tracked allocator. Every long-lived buffer is a
// TrackedView: a Kokkos::View whose bytes are counted under a category while it
// lives, so the log can report each rank's current and peak use by category. An
// allocation that fails throws ptrain::Error naming the rank, the category, the label and
// the size. Also the byte sizes users write (`--memory 80GiB`) and the memory of this node.
#pragma once
#include <Kokkos_Core.hpp>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "util/device_guard.hpp"

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
MemoryStats stats();  // a copy: the counters may change on another thread
void reset_peaks();   // peaks restart from the current use
// Throws Error (a fault of this rank, kExitRuntime): "out of memory on rank R: <size> for
// <category> ('<label>') with <tracked> already tracked here (...); <allocator's words>".
[[noreturn]] void allocation_failed(MemCategory c, const std::string& label, std::size_t bytes,
                                    const char* why);
// A transparent huge page. Host buffers of at least this size start on one (see TrackedView).
inline constexpr std::size_t kHugePage = std::size_t(2) << 20;
// Asks the kernel to back [p, p + bytes) with transparent huge pages (madvise MADV_HUGEPAGE),
// before its first touch. Where the system's THP setting is "madvise" (Debian's default) this
// is what turns them on; where it is "never", or on a system without them, it does nothing.
void advise_huge_pages(void* p, std::size_t bytes);
}  // namespace memory

// A 1-D view of T whose bytes are charged to a category. Move-only.
template <class T>
class TrackedView {
 public:
  using view_type = Kokkos::View<T*>;
  TrackedView() = default;
  TrackedView(MemCategory cat, const std::string& label, std::size_t n)
      : view_(allocate(cat, label, n)), cat_(cat), bytes_(n * sizeof(T)) {
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
    if constexpr (device_guard::kEnabled) device_guard::deallocate(view_.data());
  }

  const view_type& view() const { return view_; }
  T* data() const { return view_.data(); }
  std::size_t size() const { return view_.extent(0); }

 private:
  // Kokkos throws std::bad_alloc (3.x) or std::runtime_error (4.x) when it cannot allocate.
  static view_type allocate(MemCategory cat, const std::string& label, std::size_t n) {
    try {
      if constexpr (device_guard::kEnabled)  // unmanaged: the guard's mapping, freed above
        return view_type(static_cast<T*>(device_guard::allocate(n * sizeof(T), label)), n);
      if constexpr (Kokkos::SpaceAccessibility<Kokkos::HostSpace,
                                               typename view_type::memory_space>::accessible)
        if (n * sizeof(T) >= memory::kHugePage) return allocate_on_huge_pages(label, n);
      return view_type(label, n);
    } catch (const std::exception& e) {
      memory::allocation_failed(cat, label, n * sizeof(T), e.what());
    }
  }
  // A large host buffer on transparent huge pages: a GEMM's operands, the optimizer's
  // streams and the activations then miss the TLB far less (at GPT-2 124M shapes on one
  // rank, a step takes about 5% less time). The view is over-allocated by one huge page so it
  // can start on a huge-page boundary, advised, then zeroed: that fill is its first touch.
  // The pad before the boundary is never touched, so it takes address space, not memory;
  // the shared allocation keeps the whole block alive as long as any copy of the view.
  static view_type allocate_on_huge_pages(const std::string& label, std::size_t n) {
    static_assert(memory::kHugePage % sizeof(T) == 0);
    const std::size_t pad = memory::kHugePage / sizeof(T);
    view_type whole(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), n + pad);
    const auto address = reinterpret_cast<std::uintptr_t>(whole.data());
    const std::size_t skip = (pad - address % memory::kHugePage / sizeof(T)) % pad;
    view_type v = Kokkos::subview(whole, std::make_pair(skip, skip + n));
    memory::advise_huge_pages(v.data(), n * sizeof(T));
    Kokkos::deep_copy(v, T{});
    return v;
  }
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

// A size as users write it: "80GiB", "80 GiB", "512M", "1.5TB", "1048576" (bytes). Binary
// units B, KiB, MiB, GiB, TiB, PiB, EiB and their one-letter forms K, M, G, T, P, E (as
// Slurm's --mem); decimal kB, MB, GB, TB, PB, EB; any case; a trailing "/s" is allowed (a
// bandwidth). Empty when the text is not such a size, or is below 1 byte or above 9.2e18.
std::optional<double> parse_bytes(const std::string& text);

// The memory of this node a process may use: the smallest of /proc/meminfo's MemTotal and a
// cgroup limit (v2 memory.max, v1 memory.limit_in_bytes: a container's or a Slurm job's),
// else sysconf's physical pages. `source` says which ("MemTotal", "cgroup memory.max", ...).
struct NodeMemory {
  double bytes = 0;
  std::string source;
};
NodeMemory node_memory();

}  // namespace ptrain
