#include "comm/comm.hpp"

#include <climits>
#include <deque>

#include "comm/watchdog.hpp"
#include "grid/layout.hpp"
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

}  // namespace

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

void Comm::report_hang(const char* op, std::int64_t seq, double waited) const {
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

void Comm::all_reduce_sum_now(double* data, int n) { all_reduce_sum(data, std::size_t(n)).wait(); }

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

std::size_t type_size(DType t) {
  int s = 0;
  MPI_Type_size(mpi_type(t), &s);
  return std::size_t(s);
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

// counts followed by their prefix sums (the displacements), as one array for a Request.
std::vector<int> with_displacements(const std::vector<int>& counts) {
  std::vector<int> a(counts);
  a.resize(2 * counts.size(), 0);
  for (std::size_t i = 1; i < counts.size(); ++i)
    a[counts.size() + i] = a[counts.size() + i - 1] + counts[i - 1];
  return a;
}

}  // namespace

Request& Request::operator=(Request&& o) noexcept {
  if (this != &o) {
    if (pending()) MPI_Wait(&req_, MPI_STATUS_IGNORE);
    req_ = o.req_;
    comm_ = o.comm_;
    op_ = o.op_;
    seq_ = o.seq_;
    args_ = std::move(o.args_);
    o.req_ = MPI_REQUEST_NULL;
  }
  return *this;
}

Request::~Request() {
  if (pending()) MPI_Wait(&req_, MPI_STATUS_IGNORE);
}

Request::Request(MPI_Request r, Comm* c, std::vector<int> args)
    : req_(r), comm_(c), op_(c->op_), seq_(c->seq_), args_(std::move(args)) {}

void Request::wait() {
  if (!pending()) return;
  const double t0 = wall_seconds(), limit = watchdog::timeout_s();
  if (limit <= 0) {
    check(MPI_Wait(&req_, MPI_STATUS_IGNORE), "wait");
  } else {
    // MPI_Wait would spin the same way; this spin also looks at the clock now and then.
    int done = 0;
    for (std::int64_t k = 0; !done; ++k) {
      check(MPI_Test(&req_, &done, MPI_STATUS_IGNORE), "test");
      if (!done && (k & 1023) == 1023 && wall_seconds() - t0 > limit)
        comm_->report_hang(op_, seq_, wall_seconds() - t0);
    }
  }
  if (comm_) comm_->blocked("wait", t0, wall_seconds());
}

bool Request::test() {
  if (!pending()) return true;
  int done = 0;
  check(MPI_Test(&req_, &done, MPI_STATUS_IGNORE), "test");
  return done != 0;
}

MpiComm::MpiComm(MPI_Comm comm, std::string name)
    : Comm(name, query(comm, name, MPI_Comm_size), query(comm, name, MPI_Comm_rank)), comm_(comm) {
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

Request MpiComm::do_all_reduce(void* data, std::size_t n, DType t, ReduceOp op) {
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Iallreduce(MPI_IN_PLACE, data, mpi_count(n), mpi_type(t), mpi_op(t, op), comm_, &r),
        "Iallreduce");
  return Request(r, this, {});
}

Request MpiComm::do_reduce_scatter_sum(const void* send, void* recv, const std::vector<int>& counts,
                                       DType t) {
  std::vector<int> args(counts);
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Ireduce_scatter(send, recv, args.data(), mpi_type(t), mpi_op(t, ReduceOp::sum), comm_,
                            &r),
        "Ireduce_scatter");
  return Request(r, this, std::move(args));
}

Request MpiComm::do_all_gather(const void* send, void* recv, const std::vector<int>& counts,
                               DType t) {
  std::vector<int> args = with_displacements(counts);
  const int* displs = args.data() + counts.size();
  const std::size_t me = std::size_t(rank());
  // The caller's own piece may already sit in place inside recv.
  const char* place = static_cast<const char*>(recv) + std::size_t(displs[me]) * type_size(t);
  const void* mine = send == place ? MPI_IN_PLACE : send;
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Iallgatherv(mine, counts[me], mpi_type(t), recv, args.data(), displs, mpi_type(t),
                        comm_, &r),
        "Iallgatherv");
  return Request(r, this, std::move(args));
}

Request MpiComm::do_send(const void* data, std::size_t n, DType t, int peer, int tag) {
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Isend(data, mpi_count(n), mpi_type(t), peer, tag, comm_, &r), "Isend");
  return Request(r, this, {});
}

Request MpiComm::do_recv(void* data, std::size_t n, DType t, int peer, int tag) {
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Irecv(data, mpi_count(n), mpi_type(t), peer, tag, comm_, &r), "Irecv");
  return Request(r, this, {});
}

Request MpiComm::do_all_to_all(const void* send, void* recv, std::size_t n_per_rank, DType t) {
  MPI_Request r = MPI_REQUEST_NULL;
  const int n = mpi_count(n_per_rank);
  check(MPI_Ialltoall(send, n, mpi_type(t), recv, n, mpi_type(t), comm_, &r), "Ialltoall");
  return Request(r, this, {});
}

Request MpiComm::do_all_to_allv(const void* send, const std::vector<int>& send_counts, void* recv,
                                const std::vector<int>& recv_counts, DType t) {
  std::vector<int> args = with_displacements(send_counts);
  const std::vector<int> recv_args = with_displacements(recv_counts);
  args.insert(args.end(), recv_args.begin(), recv_args.end());
  const int* a = args.data();  // send counts, send displs, recv counts, recv displs
  const std::size_t D = send_counts.size();
  MPI_Request r = MPI_REQUEST_NULL;
  check(MPI_Ialltoallv(send, a, a + D, mpi_type(t), recv, a + 2 * D, a + 3 * D, mpi_type(t), comm_,
                       &r),
        "Ialltoallv");
  return Request(r, this, std::move(args));
}

}  // namespace ptrain
