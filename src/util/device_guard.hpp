// util/device_guard.hpp — the device guard: a CPU build (PTRAIN_DEVICE_GUARD=ON) in which
// tracked tensor memory behaves as device memory does to the host. Every TrackedView is its
// own page-aligned mapping, kept PROT_NONE except while the host may touch it: inside Kokkos
// kernels and deep copies (Kokkos Tools callbacks mark their boundaries), gemm, and the
// staging scopes (util/staging.hpp). A buffer lent to a Comm operation (start to completion)
// is off-limits to kernels until its operation completes: on a GPU that is the overlap race. A
// fault names the tensor (label, byte offset), the kernel running if any, and the code (a
// backtrace), then the process dies with SIGSEGV.
//
// Regions open lazily: the first touch inside a scope faults and the handler opens that
// region; the outermost scope's end closes them all again. A buffer lent to Comm is reachable
// only inside Comm's own calls (its MPI calls and staged copies, CommAccess), where the MPI
// library moves it; with Open MPI's single-copy transfer off, nothing else touches it.
// Page granularity: a lent range closes to kernels only the pages wholly inside it (a kernel
// may still write the neighbours that share its edge pages). The guard cannot model
// asynchrony: ordering is Comm's and staging's job.
//
// Without PTRAIN_DEVICE_GUARD everything here is an inline no-op.
#pragma once
#include <cstddef>
#include <string>

namespace ptrain::device_guard {

#ifdef PTRAIN_DEVICE_GUARD
inline constexpr bool kEnabled = true;

// Before MPI_Init: Open MPI's single-copy shared memory (CMA) has the peer process read a
// lent buffer whenever it likes, which a closed page turns into EFAULT; it is turned off
// (unless the environment chose otherwise).
void prepare_mpi();
// After Kokkos::initialize: registers the Kokkos Tools callbacks and the SIGSEGV handler.
void install();
// A zeroed, guarded region of `bytes` for a TrackedView, and its release.
void* allocate(std::size_t bytes, const std::string& label);
void deallocate(void* p);
// The host may touch tracked memory (except lent ranges) while one of these lives. Nests.
class HostAccess {
 public:
  explicit HostAccess(const char* what);
  ~HostAccess();
  HostAccess(const HostAccess&) = delete;
  HostAccess& operator=(const HostAccess&) = delete;

 private:
  const char* previous_;
};
// Comm's own accesses (its MPI calls, the staged transport's copies): everything it touches
// opens, lent ranges too. Nests with HostAccess.
class CommAccess {
 public:
  CommAccess();
  ~CommAccess();
  CommAccess(const CommAccess&) = delete;
  CommAccess& operator=(const CommAccess&) = delete;
};
// [p, p + bytes) is lent to a Comm operation `op` until give_back with the same arguments;
// kernels may read it meanwhile when `read_only` (what a send lends).
void lend(const void* p, std::size_t bytes, const char* op, bool read_only);
void give_back(const void* p, std::size_t bytes);
#else
inline constexpr bool kEnabled = false;

inline void prepare_mpi() {}
inline void install() {}
inline void* allocate(std::size_t, const std::string&) { return nullptr; }
inline void deallocate(void*) {}
class HostAccess {
 public:
  explicit HostAccess(const char*) {}
  HostAccess(const HostAccess&) = delete;
  HostAccess& operator=(const HostAccess&) = delete;
};
class CommAccess {
 public:
  CommAccess() {}
  CommAccess(const CommAccess&) = delete;
  CommAccess& operator=(const CommAccess&) = delete;
};
inline void lend(const void*, std::size_t, const char*, bool) {}
inline void give_back(const void*, std::size_t) {}
#endif

}  // namespace ptrain::device_guard
