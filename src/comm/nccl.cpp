// comm/nccl.cpp — NcclComm: a group inside one node, one GPU per rank, through NCCL (CUDA
// builds only; comm/comm.hpp, make_nccl_comm). Compiled and linked in every CUDA build; run on
// one rank of one GPU so far (regression/gpu/check.sh): two ranks cannot share a GPU in NCCL.
#include "comm/comm.hpp"
#include "util/error.hpp"

#if defined(PTRAIN_ENABLE_CUDA)
#include <cuda_runtime.h>
#include <nccl.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <functional>
#include <numeric>

#include "comm/watchdog.hpp"
#include "util/mpi.hpp"
#include "util/timer.hpp"
#endif

namespace ptrain {

#if defined(PTRAIN_ENABLE_CUDA)

namespace {

// ncclInProgress is not a failure: a non-blocking communicator is still working on the call.
void check(ncclResult_t r, const std::string& what) {
  if (r != ncclSuccess && r != ncclInProgress)
    throw Error(
        cat("NCCL ", what, ": ", ncclGetErrorString(r), " (", ncclGetLastError(nullptr), ")"));
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(cat("CUDA ", what, ": ", cudaGetErrorString(e)));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::bf16:
      return ncclBfloat16;  // summed in fp32 and rounded, as MpiComm's bf16 sum
  }
  throw Error("comm: unknown element type");
}

cudaStream_t stream() { return Kokkos::DefaultExecutionSpace().cuda_stream(); }

// One start: complete when an event recorded on Kokkos' stream after it has passed. The
// communicator's asynchronous error is checked on every test, so a failed peer is an Error,
// not a hang.
class NcclPending final : public Request::Pending {
 public:
  NcclPending(ncclComm_t comm, const std::string& group) : comm_(comm), group_(group) {
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "EventCreate");
    check_cuda(cudaEventRecord(event_, stream()), "EventRecord");
  }
  ~NcclPending() override { cudaEventDestroy(event_); }
  bool test() override {
    ncclResult_t state = ncclSuccess;
    check(ncclCommGetAsyncError(comm_, &state), cat("CommGetAsyncError on '", group_, "'"));
    check(state, cat("operation on group '", group_, "'"));
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    check_cuda(e, "EventQuery");
    return true;
  }
  void wait() override {
    while (!test()) {
    }
  }

 private:
  ncclComm_t comm_;
  std::string group_;
  cudaEvent_t event_ = nullptr;
};

std::size_t offset_of(const std::vector<int>& counts, int r) {
  return std::size_t(std::accumulate(counts.begin(), counts.begin() + r, std::int64_t(0)));
}

bool all_equal(const std::vector<int>& counts) {
  return std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; });
}

}  // namespace

// NCCL needs device memory: host-space buffers (counts, scalars) go to an MpiComm over the same
// group, which also broadcasts the communicator's unique id.
class NcclComm final : public Comm {
 public:
  NcclComm(MPI_Comm comm, std::string name);
  ~NcclComm() override;
  std::string describe() const override { return "nccl"; }

 private:
  // The calls of one start, between ncclGroupStart and ncclGroupEnd (so that the grouped
  // reduces, broadcasts, sends and receives of one operation cannot deadlock), then waits
  // until the communicator has enqueued them (a non-blocking communicator returns before).
  Started enqueue(const char* what, const std::function<void()>& calls);
  void settle(const char* what);  // until the communicator is no longer in progress
  void on_hang() override {
    ncclCommAbort(comm_);
    aborted_ = true;
  }

  Started do_all_reduce(void* data, std::size_t n, DType t, ReduceOp op, Space where) override;
  Started do_reduce_scatter_sum(const void* send, void* recv, const std::vector<int>& counts,
                                DType t, Space where) override;
  Started do_all_gather(const void* send, void* recv, const std::vector<int>& counts, DType t,
                        Space where) override;
  Started do_send(const void* data, std::size_t n, DType t, int peer, int tag,
                  Space where) override;
  Started do_recv(void* data, std::size_t n, DType t, int peer, int tag, Space where) override;
  Started do_all_to_all(const void* send, void* recv, std::size_t n_per_rank, DType t,
                        Space where) override;
  Started do_all_to_allv(const void* send, const std::vector<int>& send_counts, void* recv,
                         const std::vector<int>& recv_counts, DType t, Space where) override;

  std::unique_ptr<MpiComm> host_;  // host-space buffers, and the unique id's broadcast
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
};

NcclComm::NcclComm(MPI_Comm comm, std::string name)
    : Comm(name, mpi::size(comm), mpi::rank(comm)),
      host_(std::make_unique<MpiComm>(comm, name, Transport::mpi)) {
  members_ = static_cast<Comm&>(*host_).members_;
  ncclUniqueId id;
  if (rank() == 0) check(ncclGetUniqueId(&id), "GetUniqueId");
  mpi::check(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, comm), "MPI Bcast (NCCL unique id)");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // calls return at once; settle() polls, watched by run%hang_timeout
  check(ncclCommInitRankConfig(&comm_, size(), id, rank(), &config),
        cat("CommInitRank on group '", this->name(), "'"));
  settle("communicator setup");
}

NcclComm::~NcclComm() {
  if (!comm_ || aborted_) return;
  // Flush what was issued, then free; errors here cannot be reported any more.
  if (ncclCommFinalize(comm_) == ncclInProgress) {
    ncclResult_t state = ncclInProgress;
    while (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress) {
    }
  }
  ncclCommDestroy(comm_);
}

void NcclComm::settle(const char* what) {
  const double t0 = wall_seconds(), limit = watchdog::timeout_s();
  for (std::int64_t k = 0;; ++k) {
    ncclResult_t state = ncclSuccess;
    check(ncclCommGetAsyncError(comm_, &state), cat("CommGetAsyncError on '", name(), "'"));
    if (state == ncclSuccess) return;
    check(state, cat(what, " on group '", name(), "'"));
    if (limit > 0 && (k & 1023) == 1023 && wall_seconds() - t0 > limit)
      report_start_hang(wall_seconds() - t0);
  }
}

Comm::Started NcclComm::enqueue(const char* what, const std::function<void()>& calls) {
  check(ncclGroupStart(), "GroupStart");
  calls();
  check(ncclGroupEnd(), cat(what, " on group '", name(), "'"));
  settle(what);
  return std::make_unique<NcclPending>(comm_, name());
}

Comm::Started NcclComm::do_all_reduce(void* data, std::size_t n, DType t, ReduceOp op,
                                      Space where) {
  if (where == Space::host) return static_cast<Comm&>(*host_).do_all_reduce(data, n, t, op, where);
  return enqueue("all-reduce", [&] {
    check(ncclAllReduce(data, data, n, nccl_type(t), op == ReduceOp::sum ? ncclSum : ncclMax, comm_,
                        stream()),
          "AllReduce");
  });
}

// NCCL's reduce-scatter takes one count for every rank; uneven counts are a reduce to each
// rank of its piece, grouped.
Comm::Started NcclComm::do_reduce_scatter_sum(const void* send, void* recv,
                                              const std::vector<int>& counts, DType t,
                                              Space where) {
  if (where == Space::host)
    return static_cast<Comm&>(*host_).do_reduce_scatter_sum(send, recv, counts, t, where);
  const std::size_t w = size_of(t);
  return enqueue("reduce-scatter", [&] {
    if (all_equal(counts)) {
      check(ncclReduceScatter(send, recv, std::size_t(counts[0]), nccl_type(t), ncclSum, comm_,
                              stream()),
            "ReduceScatter");
      return;
    }
    for (int r = 0; r < size(); ++r)
      if (counts[std::size_t(r)] > 0)
        check(ncclReduce(static_cast<const char*>(send) + offset_of(counts, r) * w, recv,
                         std::size_t(counts[std::size_t(r)]), nccl_type(t), ncclSum, r, comm_,
                         stream()),
              "Reduce");
  });
}

// Uneven counts: each rank's piece broadcast from it into its place, grouped.
Comm::Started NcclComm::do_all_gather(const void* send, void* recv, const std::vector<int>& counts,
                                      DType t, Space where) {
  if (where == Space::host)
    return static_cast<Comm&>(*host_).do_all_gather(send, recv, counts, t, where);
  const std::size_t w = size_of(t);
  return enqueue("all-gather", [&] {
    if (all_equal(counts)) {
      check(ncclAllGather(send, recv, std::size_t(counts[0]), nccl_type(t), comm_, stream()),
            "AllGather");
      return;
    }
    for (int r = 0; r < size(); ++r) {
      char* place = static_cast<char*>(recv) + offset_of(counts, r) * w;
      if (counts[std::size_t(r)] > 0)
        check(ncclBroadcast(r == rank() ? send : place, place, std::size_t(counts[std::size_t(r)]),
                            nccl_type(t), r, comm_, stream()),
              "Broadcast");
    }
  });
}

// A single message on tensor memory is refused: NCCL runs a send or receive as a kernel on
// the stream, so two ranks each posting a receive before their send (a ring) would wait on
// each other forever, and messages have no tags. make_comm keeps the groups that exchange
// messages (pp, cp) on MPI; all-to-all(v) here groups its sends and receives in one call.
Comm::Started NcclComm::do_send(const void* data, std::size_t n, DType t, int peer, int tag,
                                Space where) {
  PTRAIN_REQUIRE(where == Space::host, "comm: group '", name(),
                 "' is on NCCL, which takes no single messages on tensor memory (use MPI)");
  return static_cast<Comm&>(*host_).do_send(data, n, t, peer, tag, where);
}

Comm::Started NcclComm::do_recv(void* data, std::size_t n, DType t, int peer, int tag,
                                Space where) {
  PTRAIN_REQUIRE(where == Space::host, "comm: group '", name(),
                 "' is on NCCL, which takes no single messages on tensor memory (use MPI)");
  return static_cast<Comm&>(*host_).do_recv(data, n, t, peer, tag, where);
}

Comm::Started NcclComm::do_all_to_all(const void* send, void* recv, std::size_t n_per_rank, DType t,
                                      Space where) {
  if (where == Space::host)
    return static_cast<Comm&>(*host_).do_all_to_all(send, recv, n_per_rank, t, where);
  const std::size_t bytes = n_per_rank * size_of(t);
  return enqueue("all-to-all", [&] {
    for (int r = 0; r < size(); ++r) {
      check(ncclSend(static_cast<const char*>(send) + std::size_t(r) * bytes, n_per_rank,
                     nccl_type(t), r, comm_, stream()),
            "Send");
      check(ncclRecv(static_cast<char*>(recv) + std::size_t(r) * bytes, n_per_rank, nccl_type(t), r,
                     comm_, stream()),
            "Recv");
    }
  });
}

Comm::Started NcclComm::do_all_to_allv(const void* send, const std::vector<int>& send_counts,
                                       void* recv, const std::vector<int>& recv_counts, DType t,
                                       Space where) {
  if (where == Space::host)
    return static_cast<Comm&>(*host_).do_all_to_allv(send, send_counts, recv, recv_counts, t,
                                                     where);
  const std::size_t w = size_of(t);
  return enqueue("all-to-allv", [&] {
    for (int r = 0; r < size(); ++r) {
      if (send_counts[std::size_t(r)] > 0)
        check(ncclSend(static_cast<const char*>(send) + offset_of(send_counts, r) * w,
                       std::size_t(send_counts[std::size_t(r)]), nccl_type(t), r, comm_, stream()),
              "Send");
      if (recv_counts[std::size_t(r)] > 0)
        check(ncclRecv(static_cast<char*>(recv) + offset_of(recv_counts, r) * w,
                       std::size_t(recv_counts[std::size_t(r)]), nccl_type(t), r, comm_, stream()),
              "Recv");
    }
  });
}

bool nccl_available() { return true; }

std::unique_ptr<Comm> make_nccl_comm(MPI_Comm comm, std::string name) {
  return std::make_unique<NcclComm>(comm, std::move(name));
}

#else

bool nccl_available() { return false; }

std::unique_ptr<Comm> make_nccl_comm(MPI_Comm, std::string name) {
  throw Error(cat("comm: group '", name, "': NCCL needs a CUDA build (-DPTRAIN_ENABLE_CUDA=ON)"));
}

#endif

}  // namespace ptrain
