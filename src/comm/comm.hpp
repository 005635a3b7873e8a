// comm/comm.hpp — collectives and messages on one group of the grid (docs/ARCHITECTURE.md,
// "Communication"). `Comm` is the interface callers see; `MpiComm` implements it with MPI,
// `HierarchicalComm` with MPI in two levels for a group that spans nodes, and in CUDA builds
// make_nccl_comm with NCCL for a group inside one node. Every call but all_reduce_sum_now is
// non-blocking and returns a Request the caller waits on, so overlap is explicit.
//
// Counting, the same for every implementation: each call adds the bytes this rank sends by
// the algorithmic (ring) volume — all-reduce 2(D-1)/D*n, reduce-scatter and all-gather
// (D-1)/D*n, all-to-all the elements for the other ranks, send n — and waits add the time
// the caller was blocked (exposed communication). The counts go to the Comm's own stats()
// and to a process-wide table with one row per kind of group (the Comm's name), which the
// run log differences step by step.
#pragma once
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "grid/grid.hpp"
#include "util/bf16.hpp"

namespace ptrain {

class Comm;

// Element types a Comm moves; the templates below map C++ types to them. bf16 sums and maxima
// are computed in fp32 and rounded once per pairwise combination (MPI has no bf16: a 2-byte
// type with user-defined operations).
enum class DType { f32, f64, i32, i64, bf16 };
enum class ReduceOp { sum, max };
std::size_t size_of(DType t);  // bytes of one element

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>)
    return DType::f32;
  else if constexpr (std::is_same_v<T, double>)
    return DType::f64;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return DType::i32;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return DType::i64;
  else if constexpr (std::is_same_v<T, bf16>)
    return DType::bf16;
  else
    static_assert(sizeof(T) == 0, "unsupported element type");
}

// Where a buffer lives. Tensor memory is Kokkos' default memory space (the GPU's in a CUDA
// build): every start is ordered after the kernels that wrote it, and where MPI cannot reach
// that memory (staged transport) it travels through pinned host buffers. Host memory (routing
// counts, scalars, statistics) is passed to MPI as it is.
enum class Space { tensor, host };

// How a Comm reaches its buffers (make_comm): MPI on them directly, or MPI on host copies
// (the buffers staged in before the start and out after completion).
enum class Transport { mpi, staged_mpi };
const char* to_string(Transport t);

// A pending operation. Move-only; wait() blocks (timed as exposed time of its Comm). What
// the implementation holds for it (an MPI request, staged copies) sits behind Pending.
class Request {
 public:
  // One operation in flight, as an implementation keeps it.
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual bool test() = 0;  // complete now? (drives the library's progress)
    virtual void wait() = 0;  // blocks until complete
    virtual void finish() {}  // after completion: staged results copied into place
  };

  Request() = default;
  Request(Request&& o) noexcept = default;
  Request& operator=(Request&& o) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request();  // waits if still pending: an operation is never abandoned

  // Blocks; with the watchdog on (comm/watchdog.hpp), a wait longer than run%hang_timeout
  // reports who has not arrived and aborts the job.
  void wait();
  bool test();  // true when complete; drives progress of the MPI library
  bool pending() const { return pending_ != nullptr; }

 private:
  friend class Comm;
  struct Loan {  // tensor memory lent to the operation (the device guard's record)
    const void* data;
    std::size_t bytes;
    bool comm_writes;  // its result lands there: kernels may not even read it meanwhile
  };
  void finish_pending();  // waits if pending, then completes
  void complete();        // finish, give the loans back, release
  std::unique_ptr<Pending> pending_;
  Comm* comm_ = nullptr;
  const char* op_ = "";   // what it is ("all-reduce"), for the watchdog's report
  std::int64_t seq_ = 0;  // its number among the group kind's collectives (0: point-to-point)
  std::vector<Loan> loans_;
};

struct CommStats {
  double bytes = 0;      // sent by this rank (the formulas above)
  double exposed_s = 0;  // time blocked in waits
  std::int64_t calls = 0;
};

// One row of the process-wide table: every Comm of one kind on this rank, summed.
struct GroupTraffic {
  std::string group;  // the kind, as grid/layout.hpp's group_name(): "dense-grad"
  bool used = false;  // some Comm of this kind has more than one rank
  CommStats stats;
};
// The table now. Rows [0, kNumGroupKinds) are the grid's groups in GroupKind order (so
// rows[int(GroupKind::tp)] is tp, used or not), then other names in order of first use.
std::vector<GroupTraffic> traffic_by_group();
// The traffic since `before` (an earlier traffic_by_group()): counters differenced, `used` now.
std::vector<GroupTraffic> traffic_since(const std::vector<GroupTraffic>& before);
// Seconds this process has been blocked in waits on any Comm so far (the table's exposed
// times summed, without building it): a phase's wall time less the growth of this is the
// time it computed.
double exposed_seconds();

class Comm {
 public:
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  virtual ~Comm() = default;

  int size() const { return size_; }
  int rank() const { return rank_; }
  const std::string& name() const { return name_; }
  // How it moves data, for the run log: "mpi", "staged-mpi", "hierarchical (...)".
  virtual std::string describe() const = 0;

  // Every operation takes its buffers' Space last (tensor memory unless said otherwise).

  // data[0..n) summed (or maxed) over the group, in place.
  template <class T>
  Request all_reduce_sum(T* data, std::size_t n, Space where = Space::tensor) {
    count(2.0 * (size_ - 1) / size_ * double(n * sizeof(T)));
    enter("all-reduce");
    lend(where, {{data, n * sizeof(T), true}});
    return started(do_all_reduce(data, n, dtype_of<T>(), ReduceOp::sum, where));
  }
  template <class T>
  Request all_reduce_max(T* data, std::size_t n, Space where = Space::tensor) {
    count(2.0 * (size_ - 1) / size_ * double(n * sizeof(T)));
    enter("all-reduce max");
    lend(where, {{data, n * sizeof(T), true}});
    return started(do_all_reduce(data, n, dtype_of<T>(), ReduceOp::max, where));
  }
  // send (sum of counts elements) summed over the group; rank r receives elements
  // [sum(counts[<r]), +counts[r]) of the sum into recv. Counts may be zero.
  template <class T>
  Request reduce_scatter_sum(const T* send, T* recv, const std::vector<int>& counts,
                             Space where = Space::tensor) {
    const std::size_t n = total(counts, "reduce_scatter");
    count(double(size_ - 1) / size_ * double(n * sizeof(T)));
    enter("reduce-scatter");
    lend(where, {{send, n * sizeof(T), false},
                 {recv, std::size_t(counts[std::size_t(rank_)]) * sizeof(T), true}});
    return started(do_reduce_scatter_sum(send, recv, counts, dtype_of<T>(), where));
  }
  // Rank r contributes counts[r] elements from send; every rank receives the concatenation
  // into recv (ranks in order). send may be this rank's own place inside recv.
  template <class T>
  Request all_gather(const T* send, T* recv, const std::vector<int>& counts,
                     Space where = Space::tensor) {
    const std::size_t n = total(counts, "all_gather");
    count(double(size_ - 1) / size_ * double(n * sizeof(T)));
    enter("all-gather");
    lend(where, {{send, std::size_t(counts[std::size_t(rank_)]) * sizeof(T), false},
                 {recv, n * sizeof(T), true}});
    return started(do_all_gather(send, recv, counts, dtype_of<T>(), where));
  }
  // n elements to (from) group rank `peer`, matched by `tag`. A send counts n elements.
  template <class T>
  Request send(const T* data, std::size_t n, int peer, int tag, Space where = Space::tensor) {
    check_peer(peer);
    count(double(n * sizeof(T)));
    point_to_point("send", peer);
    lend(where, {{data, n * sizeof(T), false}});
    return started(do_send(data, n, dtype_of<T>(), peer, tag, where));
  }
  template <class T>
  Request recv(T* data, std::size_t n, int peer, int tag, Space where = Space::tensor) {
    check_peer(peer);
    count(0);
    point_to_point("recv", peer);
    lend(where, {{data, n * sizeof(T), true}});
    return started(do_recv(data, n, dtype_of<T>(), peer, tag, where));
  }
  // Block r of n_per_rank elements of send goes to rank r; block r of recv comes from
  // rank r. send and recv do not overlap. Counts the blocks for the other ranks.
  template <class T>
  Request all_to_all(const T* send, T* recv, std::size_t n_per_rank, Space where = Space::tensor) {
    count(double(size_ - 1) * double(n_per_rank * sizeof(T)));
    enter("all-to-all");
    const std::size_t bytes = std::size_t(size_) * n_per_rank * sizeof(T);
    lend(where, {{send, bytes, false}, {recv, bytes, true}});
    return started(do_all_to_all(send, recv, n_per_rank, dtype_of<T>(), where));
  }
  // As all_to_all with send_counts[r] elements to rank r and recv_counts[r] from it, each
  // side packed in rank order (displacements are the prefix sums). Counts may be zero.
  template <class T>
  Request all_to_allv(const T* send, const std::vector<int>& send_counts, T* recv,
                      const std::vector<int>& recv_counts, Space where = Space::tensor) {
    const std::size_t received = total(recv_counts, "all_to_allv");
    const std::size_t sent = total(send_counts, "all_to_allv");
    count(double((sent - std::size_t(send_counts[std::size_t(rank_)])) * sizeof(T)));
    enter("all-to-allv");
    lend(where, {{send, sent * sizeof(T), false}, {recv, received * sizeof(T), true}});
    return started(do_all_to_allv(send, send_counts, recv, recv_counts, dtype_of<T>(), where));
  }
  // Blocking sum of a few host doubles (losses, norms): counted, and timed as exposed.
  void all_reduce_sum_now(double* data, int n);

  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = CommStats{}; }  // this Comm's own; the table keeps counting

 protected:
  // `name` is the kind of group ("dense-grad"): the table row, the log columns, the trace.
  Comm(std::string name, int size, int rank);

  // The implementation's half: start the operation (element type t, buffers in `where`),
  // nothing counted. Tensor buffers were written by kernels that have completed (started()'s
  // caller fenced them).
  using Started = std::unique_ptr<Request::Pending>;
  virtual Started do_all_reduce(void* data, std::size_t n, DType t, ReduceOp op, Space where) = 0;
  virtual Started do_reduce_scatter_sum(const void* send, void* recv,
                                        const std::vector<int>& counts, DType t, Space where) = 0;
  virtual Started do_all_gather(const void* send, void* recv, const std::vector<int>& counts,
                                DType t, Space where) = 0;
  virtual Started do_send(const void* data, std::size_t n, DType t, int peer, int tag,
                          Space where) = 0;
  virtual Started do_recv(void* data, std::size_t n, DType t, int peer, int tag, Space where) = 0;
  virtual Started do_all_to_all(const void* send, void* recv, std::size_t n_per_rank, DType t,
                                Space where) = 0;
  virtual Started do_all_to_allv(const void* send, const std::vector<int>& send_counts, void* recv,
                                 const std::vector<int>& recv_counts, DType t, Space where) = 0;
  // The world ranks of the members, in group order (the watchdog's report names them).
  std::vector<int> members_;
  // A start that waited past run%hang_timeout for the group (an implementation whose starts
  // can block): the watchdog's report on the operation being started, then the job ends.
  [[noreturn]] void report_start_hang(double waited) { report_hang(op_, seq_, waited); }
  // Called before the hang report ends the job: an implementation lets go of its transport.
  virtual void on_hang() {}

 private:
  friend class Request;
  friend class HierarchicalComm;  // starts and counts its levels' operations
  friend class NcclComm;          // hands host-space buffers to an MpiComm (comm/nccl.cpp)
  void count(double bytes);       // one call sending `bytes`
  void blocked(const char* what, double t0, double t1);  // caller waited [t0, t1]
  std::size_t total(const std::vector<int>& counts, const char* op) const;  // one per rank
  void check_peer(int peer) const;
  void enter(const char* op);                     // a collective: next sequence number
  void point_to_point(const char* op, int peer);  // a message: no sequence number
  // Before a start on tensor memory: the kernels that wrote the buffers have completed (one
  // fence), and, in the device guard build, the buffers are lent to the operation.
  void lend(Space where, std::initializer_list<Request::Loan> buffers);
  Request started(Started pending);  // the Request of the operation just started
  [[noreturn]] void report_hang(const char* op, std::int64_t seq, double waited);

  std::string name_;
  int size_ = 1, rank_ = 0;
  CommStats stats_;
  GroupTraffic* row_;    // in the process-wide table (rows are never moved)
  int row_index_ = 0;    // its index there
  const char* op_ = "";  // the operation being started (copied into its Request)
  std::int64_t seq_ = 0;
  int peer_ = -1;
  std::vector<Request::Loan> loans_;  // this start's loans, handed to its Request
};

// The MPI implementation: MPI on the buffers themselves, or (Transport::staged_mpi) on host
// copies of tensor buffers, for an MPI that cannot reach device memory. Staging buffers
// (pinned host memory in a CUDA build) are kept for reuse and counted under "comm".
class MpiComm final : public Comm {
 public:
  // Does not own `comm` (the grid does).
  MpiComm(MPI_Comm comm, std::string name, Transport transport = Transport::mpi);
  ~MpiComm() override;
  Transport transport() const { return transport_; }
  std::string describe() const override { return to_string(transport_); }
  class Staging;  // its host buffers (comm.cpp)

 private:
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

  MPI_Comm comm_;
  Transport transport_;
  std::unique_ptr<Staging> staging_;  // staged_mpi only
  // The staging buffers for buffers in `where`: none for host memory or the direct transport.
  Staging* staging_for(Space where) const {
    return where == Space::tensor ? staging_.get() : nullptr;
  }
};

// A group whose ranks sit on several nodes, the same number L on each (N nodes): sums go in
// two levels, as NCCL and Megatron arrange data-parallel reductions. An all-reduce of n
// elements is a reduce-scatter inside the node, an all-reduce of this rank's 1/L shard across
// the nodes (N ranks, one per node: the slow links carry 2(N-1)/N * n/L per rank instead of
// the flat ring's share of 2(D-1)/D * n) and an all-gather inside the node. Reduce-scatter
// and all-gather take the same two levels, and the group's ranks are numbered local-major
// (rank() = l*N + node index, for the l-th rank of a node) so that the pieces of one local
// index are contiguous: a rank's shard of a reduce-scatter is still one range. Max, messages
// and all-to-all run on the whole group in that numbering. The group's row counts what every
// Comm counts (the algorithmic volume); each level also counts what it carries on rows
// "<name>-intra" and "<name>-inter". A level's operations start in the order of the group's
// calls on every rank, however the caller waits for them; the phases at one position of
// their calls (the first reduce-scatters inside the nodes, the all-reduces across) have a
// communicator of their own, so that one call's inter-node phase overlaps the next call's
// intra-node one.
class HierarchicalComm final : public Comm {
 public:
  // Collective over `comm` (not owned). `node`: this rank's node (any ids, the same on the
  // ranks of one node). Throws Error when the nodes hold different numbers of the ranks.
  HierarchicalComm(MPI_Comm comm, std::string name, int node, Transport transport = Transport::mpi);
  ~HierarchicalComm() override;
  int nodes() const;           // N
  int ranks_per_node() const;  // L
  std::string describe() const override;
  class Engine;  // the levels and the operations in flight on them (hierarchical.cpp)

 private:
  struct Levels;  // the communicators, made before Comm knows this rank's number
  static Levels split(MPI_Comm comm, const std::string& name, int node);
  HierarchicalComm(Levels levels, std::string name, Transport transport);
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

  Communicator whole_;                  // owned; freed after whole_ops_
  std::unique_ptr<MpiComm> whole_ops_;  // the whole group, in this Comm's numbering
  std::unique_ptr<Engine> engine_;
};

// The transport for tensor memory in this build: MPI directly where it can reach it (host
// memory, or a CUDA-aware MPI), else staged through host buffers.
Transport default_transport();

// NCCL (CUDA builds): a group inside one node, one GPU per rank. Collectives and messages go
// on Kokkos' stream (after the kernels that wrote the buffers, with no fence needed) in one
// ncclGroupStart/End per operation, so the grouped pieces of one call cannot deadlock; a
// start is complete when an event recorded after it has passed. Per-rank counts are grouped
// reduces (reduce-scatter) and broadcasts (all-gather): NCCL has no v-collectives. The
// communicator is non-blocking, so a start that waits for a peer is watched by
// run%hang_timeout and an asynchronous error is an Error, not a hang; host-space buffers go
// to MPI. Single messages on tensor memory are refused (posted one by one on a stream, a ring
// of them could deadlock, and NCCL has no tags): make_comm gives NCCL only to groups without
// them. Collective over `comm`. Throws Error in a CPU build.
std::unique_ptr<Comm> make_nccl_comm(MPI_Comm comm, std::string name);
bool nccl_available();  // a CUDA build

// How a group lies on the nodes, `node` being this rank's (collective over the group):
// inside one node; over N > 1 nodes with the same L > 1 of its ranks on each (what a
// HierarchicalComm takes); or over nodes otherwise.
enum class NodeSpan { one_node, two_level, flat };
NodeSpan node_span(MPI_Comm comm, int node);
NodeSpan node_span_of(const std::vector<int>& nodes);  // the same from each rank's node id

// A group's ranks on this rank's node (numbered in group order) and its ranks of the same
// local index on every node (in node order), for a group with the same number of ranks on
// each node; Error(kExitInput) "comm: group '<name>' has 1 to 3 ranks per node; <needs> needs
// the same number on each node" otherwise. Collective over `comm`.
struct NodeLevels {
  Communicator node, across;
  int node_index = 0, local = 0;  // this rank's node (0..nodes-1, by first rank) and place in it
  int nodes = 1;
};
NodeLevels node_levels(MPI_Comm comm, const std::string& name, int node, const std::string& needs);

// What make_comm may choose for a group.
struct CommChoice {
  int node = -1;           // this rank's node; -1: one MPI communicator, whatever the group
  bool two_level = false;  // a group spanning nodes may reduce in two levels
  bool nccl = false;       // a group inside one node may use NCCL (CUDA builds)
};

// Every Comm the program uses is made here, over the group's communicator (not owned). With
// choice.node >= 0 the call is collective over the group: a group spanning several nodes with
// the same number of its ranks (more than one) on each becomes a HierarchicalComm where
// choice.two_level allows; a group of more than one rank inside one node an NCCL Comm where
// choice.nccl allows and the build has NCCL; anything else an MpiComm on default_transport().
std::unique_ptr<Comm> make_comm(MPI_Comm comm, std::string name, CommChoice choice = {});

// A group split off `comm` (MPI_Comm_split: the ranks of this rank's color, numbered by key),
// `name` in its error. Collective over comm.
Communicator split_group(MPI_Comm comm, int color, int key, const std::string& name);

// That group and a Comm over it, as make_comm chooses. Collective over comm. The Comm is
// declared last, so it goes before the group it runs on.
struct SplitComm {
  Communicator group;
  std::unique_ptr<Comm> comm;
};
SplitComm split_comm(MPI_Comm comm, int color, int key, std::string name);

}  // namespace ptrain
