// util/mpi.hpp — the few MPI helpers every module needs: MPI return codes as Errors, strings
// sent to every rank, and agreement on errors, so that a failure found on one rank becomes the
// same one-line Error (message and exit code) on every rank instead of a hang or an abort.
// Every function taking a communicator is collective over it.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "util/error.hpp"

namespace ptrain::mpi {

// Throws Error("<what> failed: <MPI's reason>") unless rc is MPI_SUCCESS. Not collective.
void check(int rc, const std::string& what);

// One rank's fault: prints "[rank N] error: <line>" on stderr, removes the files registered
// with cleanup::remove_on_abort and aborts the whole job with `exit_code`. Not collective;
// never returns.
[[noreturn]] void abort_job(const std::string& line, int exit_code);

// Whether this MPI library can move CUDA device memory itself (Open MPI's
// MPIX_Query_cuda_support, MPICH's MPIX_GPU_query_support), asked at run time: the library
// a job loads may differ from the one built against. Not collective.
bool cuda_aware();

// The host this process runs on (gethostname), for messages that name a rank's host.
std::string host_name();

int rank(MPI_Comm comm);  // not collective
int size(MPI_Comm comm);  // not collective

// `s` of rank `root`, on every rank (any length).
std::string broadcast(MPI_Comm comm, int root, std::string s);

// Every rank's string, in rank order, on every rank (together below 2 GiB).
std::vector<std::string> all_gather(MPI_Comm comm, const std::string& mine);

// When some rank passes a non-empty `local_error`, every rank throws the same Error: the
// message and exit code of the lowest such rank. Otherwise returns on every rank.
void agree(MPI_Comm comm, const std::string& local_error, int exit_code = kExitRuntime);

// Runs `fn` and agrees on how it ended: an Error (or other exception) thrown by it on any rank
// is thrown on every rank. `fn` must not leave a collective call unfinished on its way out.
template <class Fn>
void agree_on(MPI_Comm comm, Fn&& fn) {
  std::string error;
  int code = kExitRuntime;
  try {
    fn();
  } catch (const Error& e) {
    error = e.what();
    code = e.exit_code();
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree(comm, error, code);
}

// Element-wise sums and maxima over the ranks, in place.
void sum(MPI_Comm comm, std::vector<std::uint64_t>& v);
void sum(MPI_Comm comm, std::vector<std::int64_t>& v);
void max(MPI_Comm comm, std::vector<std::int64_t>& v);
std::int64_t max(MPI_Comm comm, std::int64_t x);

}  // namespace ptrain::mpi
