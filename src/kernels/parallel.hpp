// kernels/parallel.hpp — how the kernels' loops use the rank's host threads, whatever Kokkos'
// host backend. A Kokkos OpenMP (or Threads) build runs them as Kokkos kernels on its threads.
// Debian's Kokkos is Serial only: there a build with OpenMP runs each loop inside a
// one-iteration Serial kernel (so Kokkos Tools, fences and the device guard see a kernel as
// before) that spreads the items over ptrain's own OpenMP threads, set_host_threads of them.
// BLAS and these threads take turns on the same cores, as with a Kokkos OpenMP build.
// Every item is computed by one thread alone, in the same order as on one thread: the results
// do not depend on the thread count. Device builds take the Kokkos path (parallel_items only).
#pragma once
#include <Kokkos_Core.hpp>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/view.hpp"

#if !PTRAIN_DEVICE_BUILD && defined(_OPENMP) && !defined(KOKKOS_ENABLE_OPENMP) && \
    !defined(KOKKOS_ENABLE_THREADS)
#define PTRAIN_OWN_HOST_THREADS 1
#include <omp.h>
#else
#define PTRAIN_OWN_HOST_THREADS 0
#endif

namespace ptrain::kernels {

// The host kernels' threads per rank: on a Serial Kokkos with OpenMP, ptrain's own (n, at
// least 1; 1 until set); otherwise Kokkos' host concurrency, and n is ignored.
void set_host_threads(int n);
int host_threads();
// Who runs the host kernels, for the log: Kokkos' host space's name ("OpenMP", "Serial"), or
// "OpenMP" for ptrain's own threads.
std::string host_threads_name();

namespace detail {
#if PTRAIN_OWN_HOST_THREADS
// `bytes` of scratch for each of `threads` threads, 64-byte aligned, `stride` bytes apart:
// the same buffer call after call (grown as needed; the caller is the rank's main thread).
char* thread_scratch(int threads, std::size_t bytes, std::size_t& stride);
#endif
}  // namespace detail

// Elements of a flat loop worth a fork: waking sleeping threads (OMP_WAIT_POLICY=PASSIVE)
// costs some microseconds, what a core takes for a few thousand elements.
constexpr std::int64_t kForkElements = 8192;

// The min_items of a loop over rows of `cols` elements.
inline std::int64_t rows_per_fork(std::int64_t cols) {
  return cols >= kForkElements ? 1 : kForkElements / (cols > 0 ? cols : 1);
}

// f(i) for i in [0, n) on the host threads (the device's on a device build). Items must be
// independent. On ptrain's own threads each gets a contiguous range; fewer than
// 2 * min_items items run on one thread (kForkElements for a flat loop, or fewer for rows).
template <class F>
void parallel_items(const char* label, std::int64_t n, const F& f, std::int64_t min_items = 1) {
#if PTRAIN_OWN_HOST_THREADS
  const int threads = host_threads();
  if (threads > 1 && n >= 2 * min_items) {
    Kokkos::parallel_for(label, Kokkos::RangePolicy<Kokkos::Serial>(0, 1), [&](std::int64_t) {
#pragma omp parallel for schedule(static) num_threads(threads)
      for (std::int64_t i = 0; i < n; ++i) f(i);
    });
    return;
  }
#endif
  (void)min_items;
  Kokkos::parallel_for(label, Kokkos::RangePolicy<>(0, n), f);
}

#if !PTRAIN_DEVICE_BUILD
// f(block, scratch) for block in [0, n) on the host threads, the blocks handed out one at a
// time as threads come free (their costs differ: causal attention), each with `bytes` of
// scratch of its thread's (64-byte aligned; contents undefined). Host builds only.
template <class F>
void parallel_blocks(const char* label, int n, std::size_t bytes, const F& f) {
#if PTRAIN_OWN_HOST_THREADS
  if (n <= 0) return;
  const int threads = host_threads() < n ? host_threads() : n;
  std::size_t stride = 0;
  char* const scratch = detail::thread_scratch(threads, bytes, stride);
  Kokkos::parallel_for(label, Kokkos::RangePolicy<Kokkos::Serial>(0, 1), [&](std::int64_t) {
#pragma omp parallel num_threads(threads)
    {
      char* const mine = scratch + std::size_t(omp_get_thread_num()) * stride;
#pragma omp for schedule(dynamic, 1)
      for (int b = 0; b < n; ++b) f(b, mine);
    }
  });
#else
  using Policy =
      Kokkos::TeamPolicy<Kokkos::DefaultHostExecutionSpace, Kokkos::Schedule<Kokkos::Dynamic> >;
  const int level = bytes <= std::size_t(Policy::scratch_size_max(0)) ? 0 : 1;
  Kokkos::parallel_for(label, Policy(n, 1).set_scratch_size(level, Kokkos::PerTeam(bytes + 64)),
                       [&](const typename Policy::member_type& team) {
                         void* p = team.team_scratch(level).get_shmem(bytes + 64);
                         const std::uintptr_t a =
                             (reinterpret_cast<std::uintptr_t>(p) + 63) & ~std::uintptr_t(63);
                         f(team.league_rank(), reinterpret_cast<char*>(a));
                       });
#endif
}
#endif

}  // namespace ptrain::kernels
