#include "comm/comm.hpp"

#include <Kokkos_Core.hpp>
#include <climits>
#include <deque>
#include <numeric>

#include "comm/buffer_pool.hpp"
#include "comm/watchdog.hpp"
#include "grid/layout.hpp"
#include "util/device_guard.hpp"
#include "util/error.hpp"
#include "util/mpi.hpp"
#include "util/timer.hpp"
#include "util/trace.hpp"

namespace ptrain {

// --- the process-wide table -----------------------------------------------------------------

namespace {

// A deque, so that the rows Comms point to stay put when a new kind is added. Comms are
// used from the main thread only, so the table needs no lock.
std::deque<GroupTraffic>& table() {
  static std::deque<GroupTraffic> rows = [] {
    std::deque<GroupTraffic> r;
    for (int g = 0; g < kNumGroupKinds; ++g) r.push_back({group_name(GroupKind(g)), false, {}});
    return r;
  }();
  return rows;
}

int row_for(const std::string& group) {
  auto& rows = table();
  for (std::size_t i = 0; i < rows.size(); ++i)
    if (rows[i].group == group) return int(i);
  rows.push_back(GroupTraffic{group, false, {}});
  return int(rows.size()) - 1;
}

// Collectives entered so far, per kind of group (the watchdog's sequence numbers).
std::int64_t& entered_count(int row) {
  static std::deque<std::int64_t> counts;
  while (int(counts.size()) <= row) counts.push_back(0);
  return counts[std::size_t(row)];
}

double& exposed_total() {
  static double seconds = 0;
  return seconds;
}

}  // namespace

double exposed_seconds() { return exposed_total(); }

std::vector<GroupTraffic> traffic_by_group() { return {table().begin(), table().end()}; }

std::vector<GroupTraffic> traffic_since(const std::vector<GroupTraffic>& before) {
  std::vector<GroupTraffic> now = traffic_by_group();
  // Rows are only ever appended, so row i of `before` is row i of now.
  for (std::size_t i = 0; i < before.size(); ++i) {
    now[i].stats.bytes -= before[i].stats.bytes;
    now[i].stats.exposed_s -= before[i].stats.exposed_s;
    now[i].stats.calls -= before[i].stats.calls;
  }
  return now;
}

// --- Comm: the counting half ----------------------------------------------------------------

Comm::Comm(std::string name, int size, int rank)
    : name_(std::move(name)), size_(size), rank_(rank), row_index_(row_for(name_)) {
  row_ = &table()[std::size_t(row_index_)];
  row_->used = row_->used || size_ > 1;
}

void Comm::enter(const char* op) {
  op_ = op;
  seq_ = ++entered_count(row_index_);
  peer_ = -1;
  watchdog::entered(row_index_, seq_);
}

void Comm::point_to_point(const char* op, int peer) {
  op_ = op;
  seq_ = 0;
  peer_ = peer;
}

void Comm::report_hang(const char* op, std::int64_t seq, double waited) {
  on_hang();
  std::string who;
  if (seq == 0) {
    who = cat("; the peer is rank ",
              peer_ >= 0 && peer_ < int(members_.size()) ? members_[std::size_t(peer_)] : peer_);
  } else {
    std::string missing, unseen;
    for (int r : members_) {
      const std::int64_t at = watchdog::progress(r, row_index_);
      if (at < 0)
        unseen += cat(unseen.empty() ? "" : " ", r);
      else if (at < seq)
        missing += cat(missing.empty() ? "" : ", ", "rank ", r, " (at #", at, ")");
    }
    who = cat("; not arrived: ", missing.empty() ? "none of the ranks on this node" : missing,
              unseen.empty() ? "" : cat("; on other nodes, not visible from here: ranks ", unseen));
  }
  mpi::abort_job(cat("hang: waited ", waited, " s (run%hang_timeout) for ", op, " #", seq,
                     " on group '", name_, "'", who, "; aborting the job"),
                 kExitRuntime);
}

void Comm::count(double bytes) {
  for (CommStats* s : {&stats_, &row_->stats}) {
    s->bytes += bytes;
    ++s->calls;
  }
}

void Comm::blocked(const char* what, double t0, double t1) {
  stats_.exposed_s += t1 - t0;
  row_->stats.exposed_s += t1 - t0;
  exposed_total() += t1 - t0;
  if (size_ > 1 && trace::enabled()) trace::record(what, "comm:" + name_, t0, t1);
}

std::size_t Comm::total(const std::vector<int>& counts, const char* op) const {
  PTRAIN_REQUIRE(int(counts.size()) == size_, "comm: ", op, " on '", name_, "' needs ", size_,
                 " counts (one per rank), got ", counts.size());
  std::size_t sum = 0;
  for (int c : counts) {
    PTRAIN_REQUIRE(c >= 0, "comm: ", op, " on '", name_, "' got a negative count");
    sum += std::size_t(c);
  }
  return sum;
}

void Comm::check_peer(int peer) const {
  PTRAIN_REQUIRE(peer >= 0 && peer < size_, "comm: peer ", peer, " is not a rank of '", name_,
                 "' (", size_, " ranks)");
}

void Comm::all_reduce_sum_now(double* data, int n) {
  all_reduce_sum(data, std::size_t(n), Space::host).wait();
}

void Comm::lend(Space where, std::initializer_list<Request::Loan> buffers) {
  if (where != Space::tensor) return;
  // The kernels that wrote them may still run on an asynchronous backend.
  Kokkos::DefaultExecutionSpace().fence();
  if constexpr (device_guard::kEnabled)
    for (const Request::Loan& l : buffers) {
      if (l.bytes == 0) continue;
      device_guard::lend(l.data, l.bytes, op_, !l.comm_writes);
      loans_.push_back(l);
    }
}

Request Comm::started(Started pending) {
  Request r;
  r.pending_ = std::move(pending);
  r.comm_ = this;
  r.op_ = op_;
  r.seq_ = seq_;
  r.loans_ = std::move(loans_);
  loans_.clear();
  return r;
}

const char* to_string(Transport t) { return t == Transport::mpi ? "mpi" : "staged-mpi"; }

std::size_t size_of(DType t) {
  switch (t) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::bf16:
      return 2;
  }
  throw Error("comm: unknown element type");
}

// --- MPI ------------------------------------------------------------------------------------

namespace {

// bf16 on the wire: a committed 2-byte type of its own (not MPI_UINT16_T, so that MPI's
// integer MPI_SUM can never be applied to it by mistake), with user operations that add or
// compare in fp32 and round the result once. Created on first use, after MPI_Init, and kept
// for the life of the process (MPI_Finalize frees them).
template <bool Max>
void bf16_combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const bf16* a = static_cast<const bf16*>(in);
  bf16* b = static_cast<bf16*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = a[i], y = b[i];
    b[i] = bf16(Max ? (x > y || x != x ? x : y) : x + y);
  }
}

struct Bf16Mpi {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op sum = MPI_OP_NULL, max = MPI_OP_NULL;
};

const Bf16Mpi& bf16_mpi() {
  static const Bf16Mpi b = [] {
    Bf16Mpi m;
    mpi::check(MPI_Type_contiguous(2, MPI_BYTE, &m.type), "MPI Type_contiguous (bf16)");
    mpi::check(MPI_Type_commit(&m.type), "MPI Type_commit (bf16)");
    mpi::check(MPI_Op_create(&bf16_combine<false>, 1, &m.sum), "MPI Op_create (bf16 sum)");
    mpi::check(MPI_Op_create(&bf16_combine<true>, 1, &m.max), "MPI Op_create (bf16 max)");
    return m;
  }();
  return b;
}

MPI_Op mpi_op(DType t, ReduceOp op) {
  if (t == DType::bf16) return op == ReduceOp::sum ? bf16_mpi().sum : bf16_mpi().max;
  return op == ReduceOp::sum ? MPI_SUM : MPI_MAX;
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::bf16:
      return bf16_mpi().type;
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
  }
  throw Error("comm: unknown element type");
}

// MPI counts are int.
int mpi_count(std::size_t n) {
  PTRAIN_REQUIRE(n <= std::size_t(INT_MAX), "comm: ", n, " elements exceed an MPI count");
  return int(n);
}

void check(int rc, const char* what) { mpi::check(rc, cat("MPI ", what)); }

// The group's size or this rank's place in it, refusing a rank outside the group.
int query(MPI_Comm comm, const std::string& name, int (*f)(MPI_Comm, int*)) {
  PTRAIN_REQUIRE(comm != MPI_COMM_NULL, "comm: group '", name, "' has no communicator here");
  int v = 0;
  check(f(comm, &v), "Comm_size/rank");
  return v;
}

// The elements of a buffer packed by `counts` (one count per rank; Comm has checked them).
std::size_t packed_elements(const std::vector<int>& counts) {
  return std::size_t(std::accumulate(counts.begin(), counts.end(), std::int64_t(0)));
}

// counts followed by their prefix sums (the displacements), as one array for a Request.
std::vector<int> with_displacements(const std::vector<int>& counts) {
  std::vector<int> a(counts);
  a.resize(2 * counts.size(), 0);
  for (std::size_t i = 1; i < counts.size(); ++i)
    a[counts.size() + i] = a[counts.size() + i - 1] + counts[i - 1];
  return a;
}

}  // namespace

void Request::complete() {
  pending_->finish();
  for (const Loan& l : loans_) device_guard::give_back(l.data, l.bytes);
  loans_.clear();
  pending_.reset();
}

void Request::finish_pending() {
  if (!pending()) return;
  pending_->wait();
  complete();
}

Request& Request::operator=(Request&& o) noexcept {
  if (this != &o) {
    finish_pending();
    pending_ = std::move(o.pending_);
    comm_ = o.comm_;
    op_ = o.op_;
    seq_ = o.seq_;
    loans_ = std::move(o.loans_);
  }
  return *this;
}

Request::~Request() { finish_pending(); }

void Request::wait() {
  if (!pending()) return;
  const double t0 = wall_seconds(), limit = watchdog::timeout_s();
  if (limit <= 0) {
    pending_->wait();
  } else {
    // A blocking wait would spin the same way; this spin also looks at the clock now and then.
    for (std::int64_t k = 0; !pending_->test(); ++k)
      if ((k & 1023) == 1023 && wall_seconds() - t0 > limit)
        comm_->report_hang(op_, seq_, wall_seconds() - t0);
  }
  complete();
  if (comm_) comm_->blocked("wait", t0, wall_seconds());
}

bool Request::test() {
  if (!pending()) return true;
  if (!pending_->test()) return false;
  complete();
  return true;
}

// Host buffers for staged transfers, reused. In a CUDA build they are pinned (page-locked),
// so the copies run at the link's speed.
#if defined(KOKKOS_ENABLE_CUDA)
class MpiComm::Staging : public comm_detail::BufferPool<Kokkos::CudaHostPinnedSpace> {};
#else
class MpiComm::Staging : public comm_detail::BufferPool<Kokkos::HostSpace> {};
#endif

namespace {

using HostBytes = Kokkos::View<char*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
using TensorBytes = Kokkos::View<char*, Kokkos::DefaultExecutionSpace::memory_space,
                                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

// Moves a buffer's contents between tensor memory and a host staging buffer.
// The buffers are lent to the operation copying them: the guard lets Comm through.
void copy_to_host(char* host, const void* tensor, std::size_t bytes) {
  device_guard::CommAccess comm_copy;
  Kokkos::deep_copy(HostBytes(host, bytes),
                    TensorBytes(static_cast<char*>(const_cast<void*>(tensor)), bytes));
}
void copy_from_host(void* tensor, const char* host, std::size_t bytes) {
  device_guard::CommAccess comm_copy;
  Kokkos::deep_copy(TensorBytes(static_cast<char*>(tensor), bytes),
                    HostBytes(const_cast<char*>(host), bytes));
}

// One MPI request, and what must outlive it: the counts and displacements of a v-collective
// (MPI may read them until completion, so they live here rather than in the caller's often
// temporary vectors) and, on the staged transport, the host copies MPI works on.
class MpiPending final : public Request::Pending {
 public:
  // `staging`: where tensor buffers go through host copies (nullptr: MPI takes them as they are).
  explicit MpiPending(MpiComm::Staging* staging) : staging_(staging) {}

  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<int> args;

  // The pointer MPI gets for [data, data + bytes): with staging, a host copy, filled from the
  // buffer first when `in` and copied back into it after completion when `out`.
  template <class Ptr>
  Ptr stage(Ptr data, std::size_t bytes, bool in, bool out) {
    if (!staging_ || bytes == 0) return data;
    const int slot = staging_->take(bytes);
    char* host = staging_->data(slot);
    if (in) copy_to_host(host, data, bytes);
    staged_.push_back(
        Staged{slot, out ? const_cast<void*>(static_cast<const void*>(data)) : nullptr, bytes});
    return reinterpret_cast<Ptr>(host);
  }

  // The MPI library moves lent buffers inside these calls (the device guard lets it).
  bool test() override {
    device_guard::CommAccess mpi;
    int done = 0;
    check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "test");
    return done != 0;
  }
  void wait() override {
    device_guard::CommAccess mpi;
    check(MPI_Wait(&request, MPI_STATUS_IGNORE), "wait");
  }
  void finish() override {
    for (const Staged& s : staged_) {
      if (s.out) copy_from_host(s.out, staging_->data(s.slot), s.bytes);
      staging_->give_back(s.slot);
    }
  }

 private:
  struct Staged {
    int slot;
    void* out;  // where the result goes back to (nullptr: an input only)
    std::size_t bytes;
  };
  MpiComm::Staging* staging_;
  std::vector<Staged> staged_;
};

}  // namespace

MpiComm::MpiComm(MPI_Comm comm, std::string name, Transport transport)
    : Comm(name, query(comm, name, MPI_Comm_size), query(comm, name, MPI_Comm_rank)),
      comm_(comm),
      transport_(transport),
      staging_(transport == Transport::staged_mpi ? std::make_unique<Staging>() : nullptr) {
  MPI_Group mine, world;
  MPI_Comm_group(comm_, &mine);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> ranks(static_cast<std::size_t>(size()));
  for (int i = 0; i < size(); ++i) ranks[std::size_t(i)] = i;
  members_.resize(ranks.size());
  MPI_Group_translate_ranks(mine, size(), ranks.data(), world, members_.data());
  MPI_Group_free(&mine);
  MPI_Group_free(&world);
}

MpiComm::~MpiComm() = default;

Comm::Started MpiComm::do_all_reduce(void* data, std::size_t n, DType t, ReduceOp op, Space where) {
  device_guard::CommAccess mpi;  // the start may move lent buffers
  auto pending = std::make_unique<MpiPending>(staging_for(where));
  void* buf = pending->stage(data, n * size_of(t), true, true);
  check(MPI_Iallreduce(MPI_IN_PLACE, buf, mpi_count(n), mpi_type(t), mpi_op(t, op), comm_,
                       &pending->request),
        "Iallreduce");
  return pending;
}

Comm::Started MpiComm::do_reduce_scatter_sum(const void* send, void* recv,
                                             const std::vector<int>& counts, DType t, Space where) {
  device_guard::CommAccess mpi;  // the start may move lent buffers
  auto pending = std::make_unique<MpiPending>(staging_for(where));
  pending->args = counts;
  const void* s = pending->stage(send, packed_elements(counts) * size_of(t), true, false);
  void* out =
      pending->stage(recv, std::size_t(counts[std::size_t(rank())]) * size_of(t), false, true);
  check(MPI_Ireduce_scatter(s, out, pending->args.data(), mpi_type(t), mpi_op(t, ReduceOp::sum),
                            comm_, &pending->request),
        "Ireduce_scatter");
  return pending;
}

Comm::Started MpiComm::do_all_gather(const void* send, void* recv, const std::vector<int>& counts,
                                     DType t, Space where) {
  device_guard::CommAccess mpi;  // the start may move lent buffers
  auto pending = std::make_unique<MpiPending>(staging_for(where));
  pending->args = with_displacements(counts);
  const int* displs = pending->args.data() + counts.size();
  const std::size_t me = std::size_t(rank()), size = size_of(t);
  // The caller's own piece may already sit in place inside recv.
  const char* place = static_cast<const char*>(recv) + std::size_t(displs[me]) * size;
  const bool in_place = send == place;
  const std::size_t n = packed_elements(counts);
  // Staged in place: the whole of recv goes to the host, so this rank's piece is there too.
  void* all = pending->stage(recv, n * size, in_place, true);
  const void* mine =
      in_place ? MPI_IN_PLACE : pending->stage(send, std::size_t(counts[me]) * size, true, false);
  check(MPI_Iallgatherv(mine, counts[me], mpi_type(t), all, pending->args.data(), displs,
                        mpi_type(t), comm_, &pending->request),
        "Iallgatherv");
  return pending;
}

Comm::Started MpiComm::do_send(const void* data, std::size_t n, DType t, int peer, int tag,
                               Space where) {
  device_guard::CommAccess mpi;  // the start may move lent buffers
  auto pending = std::make_unique<MpiPending>(staging_for(where));
  const void* buf = pending->stage(data, n * size_of(t), true, false);
  check(MPI_Isend(buf, mpi_count(n), mpi_type(t), peer, tag, comm_, &pending->request), "Isend");
  return pending;
}

Comm::Started MpiComm::do_recv(void* data, std::size_t n, DType t, int peer, int tag, Space where) {
  device_guard::CommAccess mpi;  // the start may move lent buffers
  auto pending = std::make_unique<MpiPending>(staging_for(where));
  void* buf = pending->stage(data, n * size_of(t), false, true);
  check(MPI_Irecv(buf, mpi_count(n), mpi_type(t), peer, tag, comm_, &pending->request), "Irecv");
  return pending;
}

Comm::Started MpiComm::do_all_to_all(const void* send, void* recv, std::size_t n_per_rank, DType t,
                                     Space where) {
  device_guard::CommAccess mpi;  // the start may move lent buffers
  auto pending = std::make_unique<MpiPending>(staging_for(where));
  const int n = mpi_count(n_per_rank);
  const std::size_t bytes = std::size_t(size()) * n_per_rank * size_of(t);
  const void* s = pending->stage(send, bytes, true, false);
  void* out = pending->stage(recv, bytes, false, true);
  check(MPI_Ialltoall(s, n, mpi_type(t), out, n, mpi_type(t), comm_, &pending->request),
        "Ialltoall");
  return pending;
}

Comm::Started MpiComm::do_all_to_allv(const void* send, const std::vector<int>& send_counts,
                                      void* recv, const std::vector<int>& recv_counts, DType t,
                                      Space where) {
  device_guard::CommAccess mpi;  // the start may move lent buffers
  auto pending = std::make_unique<MpiPending>(staging_for(where));
  pending->args = with_displacements(send_counts);
  const std::vector<int> recv_args = with_displacements(recv_counts);
  pending->args.insert(pending->args.end(), recv_args.begin(), recv_args.end());
  const int* a = pending->args.data();  // send counts, send displs, recv counts, recv displs
  const std::size_t D = send_counts.size(), size = size_of(t);
  const void* s = pending->stage(send, packed_elements(send_counts) * size, true, false);
  void* out = pending->stage(recv, packed_elements(recv_counts) * size, false, true);
  check(MPI_Ialltoallv(s, a, a + D, mpi_type(t), out, a + 2 * D, a + 3 * D, mpi_type(t), comm_,
                       &pending->request),
        "Ialltoallv");
  return pending;
}

Transport default_transport() {
  if constexpr (Kokkos::SpaceAccessibility<Kokkos::HostSpace,
                                           Kokkos::DefaultExecutionSpace::memory_space>::accessible)
    return Transport::mpi;
  return mpi::cuda_aware() ? Transport::mpi : Transport::staged_mpi;
}

std::unique_ptr<Comm> make_comm(MPI_Comm comm, std::string name, CommChoice choice) {
  // Where neither is allowed (or possible) the node map is not even gathered.
  const bool nccl = choice.nccl && nccl_available();
  if (choice.node >= 0 && (choice.two_level || nccl) && comm != MPI_COMM_NULL &&
      mpi::size(comm) > 1) {
    switch (node_span(comm, choice.node)) {
      case NodeSpan::one_node:
        if (nccl) return make_nccl_comm(comm, std::move(name));
        break;
      case NodeSpan::two_level:
        if (choice.two_level)
          return std::make_unique<HierarchicalComm>(comm, std::move(name), choice.node,
                                                    default_transport());
        break;
      case NodeSpan::flat:
        break;
    }
  }
  return std::make_unique<MpiComm>(comm, std::move(name), default_transport());
}

Communicator split_group(MPI_Comm comm, int color, int key, const std::string& name) {
  MPI_Comm group = MPI_COMM_NULL;
  mpi::check(MPI_Comm_split(comm, color, key, &group), "MPI Comm_split (" + name + ")");
  return Communicator(group);
}

SplitComm split_comm(MPI_Comm comm, int color, int key, std::string name) {
  SplitComm s{split_group(comm, color, key, name), nullptr};
  s.comm = make_comm(s.group.get(), std::move(name));
  return s;
}

}  // namespace ptrain
