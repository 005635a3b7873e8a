#include "util/mpi.hpp"

#if defined(OPEN_MPI)
#include <mpi-ext.h>  // MPIX_Query_cuda_support
#endif

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <thread>

#include "util/cleanup.hpp"
#include "util/log.hpp"

namespace ptrain::mpi {

bool cuda_aware() {
#if defined(OPEN_MPI) && defined(MPIX_CUDA_AWARE_SUPPORT)
  return MPIX_Query_cuda_support() == 1;
#elif defined(MPIX_GPU_SUPPORT_CUDA)
  int supported = 0;
  return MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported) == MPI_SUCCESS && supported;
#else
  return false;
#endif
}

void abort_job(const std::string& line, int exit_code) {
  log::error_any_rank(line);
  cleanup::remove_now();  // this rank's folder locks (ckpt/lock.hpp): the job ends here
  // MPICH's Hydra can act on the abort before it has forwarded this rank's stderr, and the
  // message naming the failing rank is then lost (seen once in CI). A moment's pause lets the
  // launcher drain the pipe first; it costs nothing on a job that is ending anyway.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::abort();  // MPI_Abort does not return; this tells the compiler so
}

void check(int rc, const std::string& what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(cat(what, " failed: ", std::string(text, static_cast<std::size_t>(len))));
}

std::string host_name() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) return "unknown host";
  return host;
}

int rank(MPI_Comm comm) {
  int r = 0;
  check(MPI_Comm_rank(comm, &r), "MPI_Comm_rank");
  return r;
}

int size(MPI_Comm comm) {
  int n = 1;
  check(MPI_Comm_size(comm, &n), "MPI_Comm_size");
  return n;
}

std::string broadcast(MPI_Comm comm, int root, std::string s) {
  long long n = static_cast<long long>(s.size());
  check(MPI_Bcast(&n, 1, MPI_LONG_LONG, root, comm), "MPI_Bcast");
  s.resize(static_cast<std::size_t>(n));
  // MPI counts are int: longer strings go in pieces.
  for (long long at = 0; at < n; at += INT_MAX) {
    const int piece = static_cast<int>(std::min<long long>(n - at, INT_MAX));
    check(MPI_Bcast(s.data() + at, piece, MPI_CHAR, root, comm), "MPI_Bcast");
  }
  return s;
}

std::vector<std::string> all_gather(MPI_Comm comm, const std::string& mine) {
  const int n = size(comm);
  // Every rank computes the same total, so a refusal is the same on every rank.
  std::vector<long long> lengths(static_cast<std::size_t>(n));
  long long my_length = static_cast<long long>(mine.size());
  check(MPI_Allgather(&my_length, 1, MPI_LONG_LONG, lengths.data(), 1, MPI_LONG_LONG, comm),
        "MPI_Allgather");
  long long total = 0;
  for (auto l : lengths) total += l;
  if (total >= INT_MAX)
    throw Error(cat("MPI: an all-gather of ", total, " bytes exceeds MPI's 2 GiB count"));
  std::vector<int> counts(lengths.begin(), lengths.end()), displs(counts.size(), 0);
  for (std::size_t r = 1; r < counts.size(); ++r) displs[r] = displs[r - 1] + counts[r - 1];
  std::string all(static_cast<std::size_t>(total), '\0');
  check(MPI_Allgatherv(mine.data(), static_cast<int>(mine.size()), MPI_CHAR, all.data(),
                       counts.data(), displs.data(), MPI_CHAR, comm),
        "MPI_Allgatherv");
  std::vector<std::string> out;
  for (std::size_t r = 0; r < counts.size(); ++r)
    out.push_back(
        all.substr(static_cast<std::size_t>(displs[r]), static_cast<std::size_t>(counts[r])));
  return out;
}

void agree(MPI_Comm comm, const std::string& local_error, int exit_code) {
  const int n = size(comm);
  int first = local_error.empty() ? n : rank(comm);
  check(MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, comm), "MPI_Allreduce");
  if (first == n) return;
  check(MPI_Bcast(&exit_code, 1, MPI_INT, first, comm), "MPI_Bcast");
  throw Error(broadcast(comm, first, local_error), exit_code, ErrorScope::all_ranks);
}

namespace {
template <class V>
void all_reduce(MPI_Comm comm, std::vector<V>& v, MPI_Datatype type, MPI_Op op) {
  if (!v.empty())
    check(MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), type, op, comm),
          "MPI_Allreduce");
}
}  // namespace

void sum(MPI_Comm comm, std::vector<std::uint64_t>& v) {
  all_reduce(comm, v, MPI_UINT64_T, MPI_SUM);
}
void sum(MPI_Comm comm, std::vector<std::int64_t>& v) { all_reduce(comm, v, MPI_INT64_T, MPI_SUM); }
void max(MPI_Comm comm, std::vector<std::int64_t>& v) { all_reduce(comm, v, MPI_INT64_T, MPI_MAX); }

std::int64_t max(MPI_Comm comm, std::int64_t x) {
  std::vector<std::int64_t> v{x};
  max(comm, v);
  return v[0];
}

}  // namespace ptrain::mpi
