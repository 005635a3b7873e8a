#include "comm/comm.hpp"

#include <numeric>
#include <type_traits>

#include "util/error.hpp"
#include "util/timer.hpp"
#include "util/trace.hpp"

namespace ptrain {

namespace {

template <class T>
MPI_Datatype mpi_type() {
  if constexpr (std::is_same_v<T, float>)
    return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>)
    return MPI_DOUBLE;
  else
    static_assert(sizeof(T) == 0, "unsupported element type");
}

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw Error(cat("MPI ", what, " failed: ", std::string(msg, std::size_t(len))));
  }
}

}  // namespace

Request& Request::operator=(Request&& o) noexcept {
  if (this != &o) {
    if (pending()) MPI_Wait(&req_, MPI_STATUS_IGNORE);
    req_ = o.req_;
    comm_ = o.comm_;
    o.req_ = MPI_REQUEST_NULL;
  }
  return *this;
}

Request::~Request() {
  if (pending()) MPI_Wait(&req_, MPI_STATUS_IGNORE);
}

void Request::wait() {
  if (!pending()) return;
  const double t0 = wall_seconds();
  check(MPI_Wait(&req_, MPI_STATUS_IGNORE), "wait");
  const double t1 = wall_seconds();
  if (comm_) {
    comm_->stats_.exposed_s += t1 - t0;
    if (comm_->size_ > 1) trace::record("wait", "comm:" + comm_->name_, t0, t1);
  }
}

bool Request::test() {
  if (!pending()) return true;
  int done = 0;
  check(MPI_Test(&req_, &done, MPI_STATUS_IGNORE), "test");
  return done != 0;
}

Comm::Comm(MPI_Comm comm, std::string name) : comm_(comm), name_(std::move(name)) {
  PTRAIN_REQUIRE(comm != MPI_COMM_NULL, "comm: group '", name_, "' has no communicator here");
  MPI_Comm_size(comm_, &size_);
  MPI_Comm_rank(comm_, &rank_);
}

template <class T>
Request Comm::all_reduce_sum(T* data, std::size_t n) {
  return all_reduce(data, n, MPI_SUM);
}

template <class T>
Request Comm::all_reduce_max(T* data, std::size_t n) {
  return all_reduce(data, n, MPI_MAX);
}

template <class T>
Request Comm::all_reduce(T* data, std::size_t n, MPI_Op op) {
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Iallreduce(MPI_IN_PLACE, data, int(n), mpi_type<T>(), op, comm_, &r), "Iallreduce");
  stats_.bytes += 2.0 * (size_ - 1) / size_ * double(n * sizeof(T));
  ++stats_.calls;
  return Request(r, this);
}

template <class T>
Request Comm::reduce_scatter_sum(const T* send, T* recv, const std::vector<int>& counts) {
  PTRAIN_REQUIRE(int(counts.size()) == size_, "comm: reduce_scatter needs one count per rank");
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Ireduce_scatter(send, recv, counts.data(), mpi_type<T>(), MPI_SUM, comm_, &r),
        "Ireduce_scatter");
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  stats_.bytes += double(size_ - 1) / size_ * total * sizeof(T);
  ++stats_.calls;
  return Request(r, this);
}

template <class T>
Request Comm::all_gather(const T* send, T* recv, const std::vector<int>& counts) {
  PTRAIN_REQUIRE(int(counts.size()) == size_, "comm: all_gather needs one count per rank");
  displs_.assign(counts.size(), 0);
  for (std::size_t i = 1; i < counts.size(); ++i) displs_[i] = displs_[i - 1] + counts[i - 1];
  // The caller's own piece may already sit in place inside recv.
  const void* mine = send == recv + displs_[std::size_t(rank_)] ? MPI_IN_PLACE : send;
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Iallgatherv(mine, counts[std::size_t(rank_)], mpi_type<T>(), recv, counts.data(),
                        displs_.data(), mpi_type<T>(), comm_, &r),
        "Iallgatherv");
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  stats_.bytes += double(size_ - 1) / size_ * total * sizeof(T);
  ++stats_.calls;
  return Request(r, this);
}

void Comm::all_reduce_sum_now(double* data, int n) {
  const double t0 = wall_seconds();
  check(MPI_Allreduce(MPI_IN_PLACE, data, n, MPI_DOUBLE, MPI_SUM, comm_), "Allreduce");
  const double t1 = wall_seconds();
  stats_.exposed_s += t1 - t0;
  if (size_ > 1) trace::record("all-reduce", "comm:" + name_, t0, t1);
  stats_.bytes += 2.0 * (size_ - 1) / size_ * n * sizeof(double);
  ++stats_.calls;
}

#define PTRAIN_COMM_INSTANTIATE(T)                                                     \
  template Request Comm::all_reduce_sum<T>(T*, std::size_t);                           \
  template Request Comm::all_reduce_max<T>(T*, std::size_t);                           \
  template Request Comm::reduce_scatter_sum<T>(const T*, T*, const std::vector<int>&); \
  template Request Comm::all_gather<T>(const T*, T*, const std::vector<int>&);
PTRAIN_COMM_INSTANTIATE(float)
PTRAIN_COMM_INSTANTIATE(double)
#undef PTRAIN_COMM_INSTANTIATE

}  // namespace ptrain
