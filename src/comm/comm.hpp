// comm/comm.hpp — collectives on one group of the grid (ARCHITECTURE.md section 6). Every
// call is non-blocking and returns a Request the caller waits on, so overlap is explicit.
// The group counts what it sends (algorithmic ring volume per rank: all-reduce 2(D-1)/D*n,
// reduce-scatter and all-gather (D-1)/D*n bytes) and the time the caller spent blocked in
// waits (exposed communication). MPI implementation; NCCL comes with the GPU backend.
#pragma once
#include <mpi.h>

#include <cstddef>
#include <string>
#include <vector>

namespace ptrain {

class Comm;

// A pending collective. Move-only; wait() blocks (timed as exposed time of its Comm).
class Request {
 public:
  Request() = default;
  Request(Request&& o) noexcept : req_(o.req_), comm_(o.comm_) { o.req_ = MPI_REQUEST_NULL; }
  Request& operator=(Request&& o) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request();  // waits if still pending: a collective is never abandoned

  void wait();
  bool test();  // true when complete; drives progress of the MPI library
  bool pending() const { return req_ != MPI_REQUEST_NULL; }

 private:
  friend class Comm;
  Request(MPI_Request r, Comm* c) : req_(r), comm_(c) {}
  MPI_Request req_ = MPI_REQUEST_NULL;
  Comm* comm_ = nullptr;
};

struct CommStats {
  double bytes = 0;      // sent per rank by the ring formulas
  double exposed_s = 0;  // time blocked in waits
  std::int64_t calls = 0;
};

class Comm {
 public:
  // Does not own `comm` (the grid does). `name` labels the log columns ("dense-grad").
  Comm(MPI_Comm comm, std::string name);

  int size() const { return size_; }
  int rank() const { return rank_; }
  MPI_Comm mpi() const { return comm_; }
  const std::string& name() const { return name_; }

  // data[0..n) summed (or maxed) over the group, in place.
  template <class T>
  Request all_reduce_sum(T* data, std::size_t n);
  template <class T>
  Request all_reduce_max(T* data, std::size_t n);
  // send (sum of counts elements) summed over the group; rank r receives elements
  // [sum(counts[<r]), +counts[r]) of the sum into recv. Counts may be zero.
  template <class T>
  Request reduce_scatter_sum(const T* send, T* recv, const std::vector<int>& counts);
  // Rank r contributes counts[r] elements from send; every rank receives the
  // concatenation into recv (ranks in order).
  template <class T>
  Request all_gather(const T* send, T* recv, const std::vector<int>& counts);
  // Blocking sum of a few doubles (losses, norms): counted, and timed as exposed.
  void all_reduce_sum_now(double* data, int n);

  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = CommStats{}; }

 private:
  friend class Request;
  template <class T>
  Request all_reduce(T* data, std::size_t n, MPI_Op op);
  MPI_Comm comm_;
  std::string name_;
  int size_ = 1, rank_ = 0;
  CommStats stats_;
  std::vector<int> displs_;  // scratch for the v-variants
};

}  // namespace ptrain
