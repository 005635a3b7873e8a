// kernels/parallel.cpp — the host kernels' thread count and ptrain's per-thread scratch.
#include "kernels/parallel.hpp"

#include <cstdlib>
#include <memory>

namespace ptrain::kernels {

#if PTRAIN_OWN_HOST_THREADS
namespace {
int g_threads = 1;

struct FreeAligned {
  void operator()(char* p) const { std::free(p); }
};
std::unique_ptr<char, FreeAligned> g_scratch;
std::size_t g_scratch_bytes = 0;
}  // namespace

void set_host_threads(int n) { g_threads = n > 1 ? n : 1; }
int host_threads() { return g_threads; }
std::string host_threads_name() { return "OpenMP"; }  // ptrain's own beside a Serial Kokkos

namespace detail {
char* thread_scratch(int threads, std::size_t bytes, std::size_t& stride) {
  // Each thread's part a whole number of cache lines, so no two threads share one.
  stride = bytes > 0 ? (bytes + 63) / 64 * 64 : 64;
  const std::size_t total = stride * std::size_t(threads);
  if (total > g_scratch_bytes) {
    void* p = std::aligned_alloc(64, total);
    if (!p) throw std::bad_alloc();
    g_scratch.reset(static_cast<char*>(p));
    g_scratch_bytes = total;
  }
  return g_scratch.get();
}
}  // namespace detail
#else
void set_host_threads(int) {}
int host_threads() { return Kokkos::DefaultHostExecutionSpace().concurrency(); }
std::string host_threads_name() { return Kokkos::DefaultHostExecutionSpace::name(); }
#endif

}  // namespace ptrain::kernels
