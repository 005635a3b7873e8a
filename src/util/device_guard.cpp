// util/device_guard.cpp — see device_guard.hpp. Built only with PTRAIN_DEVICE_GUARD.
#ifdef PTRAIN_DEVICE_GUARD
#include "util/device_guard.hpp"

#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

namespace ptrain::device_guard {
namespace {

struct Region {
  char* base;
  std::size_t mapped;  // whole pages
  std::size_t bytes;   // what the TrackedView holds
  std::string label;
  bool opened;  // made accessible by a fault inside the current scope
};
struct Lent {
  const char* begin;
  const char* end;
  const char* op;
  bool read_only;  // a send: kernels may still read it
};

// Regions are opened lazily: everything is PROT_NONE until touched inside a scope, when the
// fault handler opens the region touched; the outermost scope's end closes what was opened.
// So a kernel costs a few mprotect calls for the tensors it touches, not two for every tensor.
std::vector<Region> g_regions;
std::vector<Lent> g_lent;
int g_depth = 0;               // open scopes (kernels, copies, gemm, staging)
int g_comm_depth = 0;          // Comm's own accesses (MPI calls, staged copies): lent ranges too
const char* g_what = nullptr;  // the innermost scope, for the fault report
std::uintptr_t g_page = 4096;
struct sigaction g_previous {};

std::uintptr_t down(const void* p) { return reinterpret_cast<std::uintptr_t>(p) & ~(g_page - 1); }
std::uintptr_t up(const void* p) {
  return (reinterpret_cast<std::uintptr_t>(p) + g_page - 1) & ~(g_page - 1);
}
std::uintptr_t begin_of(const Region& r) { return reinterpret_cast<std::uintptr_t>(r.base); }
std::uintptr_t end_of(const Region& r) { return begin_of(r) + r.mapped; }

void protect(std::uintptr_t begin, std::uintptr_t end, int prot) {
  if (begin >= end) return;
  // Async-signal-safe (the fault handler calls it); a failure is the guard's own bug.
  if (mprotect(reinterpret_cast<void*>(begin), end - begin, prot) != 0) abort();
}

// A region's protection as the current scope wants it: closed unless opened; opened, all of it
// but, outside Comm's own accesses, the pages wholly inside lent ranges (a read-only loan
// leaves them readable; a send buffer inside a receive buffer stays closed).
void sync(const Region& r) {
  if (!r.opened) {
    protect(begin_of(r), end_of(r), PROT_NONE);
    return;
  }
  protect(begin_of(r), end_of(r), PROT_READ | PROT_WRITE);
  if (g_comm_depth > 0) return;
  for (int pass = 0; pass < 2; ++pass)
    for (const Lent& l : g_lent)
      if (l.read_only == (pass == 0))
        protect(std::max(up(l.begin), begin_of(r)), std::min(down(l.end), end_of(r)),
                l.read_only ? PROT_READ : PROT_NONE);
}

void enter(const char* what) {
  g_what = what;
  ++g_depth;
}
void close_all() {
  for (Region& r : g_regions)
    if (r.opened) {
      r.opened = false;
      protect(begin_of(r), end_of(r), PROT_NONE);
    }
}
void leave() {
  if (--g_depth == 0) g_what = nullptr;
  if (g_depth == 0 && g_comm_depth == 0) close_all();
}

const Region* region_of(const char* p) {
  for (const Region& r : g_regions)
    if (p >= r.base && p < r.base + r.mapped) return &r;
  return nullptr;
}

// Kokkos Tools callbacks (the same signatures in Kokkos 3.4 and 4.x).
void begin_kernel(const char* name, const std::uint32_t, std::uint64_t*) { enter(name); }
void end_kernel(std::uint64_t) { leave(); }
void begin_copy(Kokkos::Tools::SpaceHandle, const char*, const void*, Kokkos::Tools::SpaceHandle,
                const char*, const void*, std::uint64_t) {
  enter("Kokkos::deep_copy");
}
void end_copy() { leave(); }

void write_all(const char* text) {
  for (std::size_t n = std::strlen(text); n > 0;) {
    const ssize_t w = write(STDERR_FILENO, text, n);
    if (w <= 0) return;
    text += w, n -= std::size_t(w);
  }
}

bool in_lent_inner(const char* address, const Lent** which) {
  for (const Lent& l : g_lent)
    if (reinterpret_cast<std::uintptr_t>(address) >= up(l.begin) &&
        reinterpret_cast<std::uintptr_t>(address) < down(l.end)) {
      *which = &l;
      return true;
    }
  return false;
}

void on_fault(int sig, siginfo_t* info, void* context) {
  const char* address = static_cast<const char*>(info->si_addr);
  Region* r = const_cast<Region*>(region_of(address));
  const Lent* lent = nullptr;
  if (r && (g_comm_depth > 0 || (g_depth > 0 && !(r->opened && in_lent_inner(address, &lent))))) {
    r->opened = true;  // inside a scope: open the region touched, and retry
    sync(*r);
    return;
  }
  if (r) {
    const std::size_t offset = std::size_t(address - r->base);
    static char message[1024];
    if (lent)
      std::snprintf(message, sizeof message,
                    "ptrain device guard: '%s' touched tensor '%s' at byte %zu of %zu while it "
                    "is lent to a Comm %s (not complete yet)\n",
                    g_what ? g_what : "?", r->label.c_str(), offset, r->bytes, lent->op);
    else
      std::snprintf(message, sizeof message,
                    "ptrain device guard: host code touched tensor '%s' at byte %zu of %zu "
                    "outside a kernel, a deep copy, gemm or a staging scope (util/staging.hpp)\n",
                    r->label.c_str(), offset, r->bytes);
    write_all(message);
    write_all("ptrain device guard: the code, innermost first:\n");
    void* frames[48];
    backtrace_symbols_fd(frames, backtrace(frames, 48), STDERR_FILENO);
  }
  // Not ours, or reported: the previous disposition takes the signal when it recurs.
  sigaction(SIGSEGV, &g_previous, nullptr);
  if (!r && (g_previous.sa_flags & SA_SIGINFO) && g_previous.sa_sigaction)
    g_previous.sa_sigaction(sig, info, context);
}

}  // namespace

void prepare_mpi() { setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 0); }

void install() {
  g_page = std::uintptr_t(sysconf(_SC_PAGESIZE));
  namespace tools = Kokkos::Tools::Experimental;
  tools::set_begin_parallel_for_callback(begin_kernel);
  tools::set_end_parallel_for_callback(end_kernel);
  tools::set_begin_parallel_reduce_callback(begin_kernel);
  tools::set_end_parallel_reduce_callback(end_kernel);
  tools::set_begin_parallel_scan_callback(begin_kernel);
  tools::set_end_parallel_scan_callback(end_kernel);
  tools::set_begin_deep_copy_callback(begin_copy);
  tools::set_end_deep_copy_callback(end_copy);
  struct sigaction action {};
  action.sa_sigaction = on_fault;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &g_previous);
}

void* allocate(std::size_t bytes, const std::string& label) {
  if (bytes == 0) return nullptr;
  const std::size_t mapped = (bytes + g_page - 1) & ~(g_page - 1);
  // Zeroed, as a Kokkos allocation is, and closed until a scope touches it.
  void* p = mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  g_regions.push_back(Region{static_cast<char*>(p), mapped, bytes, label, false});
  return p;
}

void deallocate(void* p) {
  for (std::size_t i = 0; i < g_regions.size(); ++i)
    if (g_regions[i].base == p) {
      munmap(p, g_regions[i].mapped);
      g_regions.erase(g_regions.begin() + std::ptrdiff_t(i));
      return;
    }
}

HostAccess::HostAccess(const char* what) : previous_(g_what) { enter(what); }
HostAccess::~HostAccess() {
  leave();
  if (g_depth > 0) g_what = previous_;
}

CommAccess::CommAccess() { ++g_comm_depth; }
CommAccess::~CommAccess() {
  if (--g_comm_depth > 0) return;
  if (g_depth == 0) {
    close_all();
  } else {  // back inside a kernel or a staging scope: lent ranges close to it again
    for (const Region& r : g_regions)
      if (r.opened) sync(r);
  }
}

// A loan or its return changes the regions it lies in, if they are open now.
void resync(const char* begin, const char* end) {
  for (const Region& r : g_regions)
    if (r.opened && begin < r.base + r.mapped && end > r.base) sync(r);
}

void lend(const void* p, std::size_t bytes, const char* op, bool read_only) {
  const char* begin = static_cast<const char*>(p);
  if (bytes == 0 || !region_of(begin)) return;  // not tracked memory: nothing to guard
  g_lent.push_back(Lent{begin, begin + bytes, op, read_only});
  resync(begin, begin + bytes);
}

void give_back(const void* p, std::size_t bytes) {
  const char* begin = static_cast<const char*>(p);
  for (std::size_t i = g_lent.size(); i-- > 0;)
    if (g_lent[i].begin == begin && g_lent[i].end == begin + bytes) {
      g_lent.erase(g_lent.begin() + std::ptrdiff_t(i));
      resync(begin, begin + bytes);
      return;
    }
}

}  // namespace ptrain::device_guard
#endif  // PTRAIN_DEVICE_GUARD
