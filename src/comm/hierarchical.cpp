// comm/hierarchical.cpp — HierarchicalComm: sums over a group that spans nodes, in two levels
// (inside the node, then across the nodes), as comm/comm.hpp describes.
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <functional>
#include <numeric>

#include "comm/buffer_pool.hpp"
#include "comm/comm.hpp"
#include "util/error.hpp"
#include "util/mpi.hpp"

namespace ptrain {

namespace {

// Every rank's node id, gathered over the group.
std::vector<int> gather_nodes(MPI_Comm comm, int node) {
  std::vector<int> ids(std::size_t(mpi::size(comm)));
  mpi::check(MPI_Allgather(&node, 1, MPI_INT, ids.data(), 1, MPI_INT, comm),
             "MPI Allgather (node ids)");
  return ids;
}

// Each node's index in order of first appearance among the group's node ids.
struct NodeMap {
  std::vector<int> index;  // per group rank, its node's index 0..N-1
  std::vector<int> ranks;  // per node index, the group's ranks there
};

NodeMap node_map(const std::vector<int>& ids) {
  NodeMap m;
  std::vector<int> seen;  // node ids by index
  for (int id : ids) {
    const std::size_t k = std::size_t(std::find(seen.begin(), seen.end(), id) - seen.begin());
    if (k == seen.size()) {
      seen.push_back(id);
      m.ranks.push_back(0);
    }
    m.index.push_back(int(k));
    ++m.ranks[k];
  }
  return m;
}

bool uniform(const NodeMap& m) {
  return std::all_of(m.ranks.begin(), m.ranks.end(), [&](int r) { return r == m.ranks[0]; });
}

// n elements in L pieces as even as they go, the first n % L one longer.
std::vector<int> even_pieces(std::size_t n, int L) {
  std::vector<int> c(static_cast<std::size_t>(L));
  for (int j = 0; j < L; ++j)
    c[std::size_t(j)] = int(n / std::size_t(L) + (std::size_t(j) < n % std::size_t(L)));
  return c;
}

std::size_t sum(const std::vector<int>& counts) {
  return std::size_t(std::accumulate(counts.begin(), counts.end(), std::int64_t(0)));
}

// A reduce-scatter's or all-gather's per-rank counts seen by local index l of L on each of
// N nodes, ranks numbered local-major (rank j*N + k is local index j of node k).
struct LocalMajor {
  std::vector<int> chunks;  // per local index j, the counts of its N ranks together
  std::vector<int> mine;    // per node k, the count of local index l's rank there
  std::size_t base = 0;     // where local index l's chunk starts (elements)
};

LocalMajor local_major(const std::vector<int>& counts, int L, int N, int l) {
  LocalMajor p;
  p.chunks.assign(std::size_t(L), 0);
  for (int j = 0; j < L; ++j)
    for (int k = 0; k < N; ++k) {
      const int c = counts[std::size_t(j * N + k)];
      p.chunks[std::size_t(j)] += c;
      if (j < l) p.base += std::size_t(c);
      if (j == l) p.mine.push_back(c);
    }
  return p;
}

}  // namespace

// --- the engine: lanes, tickets, operations in flight ---------------------------------------

// A level's collectives must start in the same order on all of its ranks. Operations advance
// from phase to phase as the caller tests or waits, in whatever order it does, so each phase
// takes a ticket when the operation is made (the group's calls come in the same order
// everywhere) and starts only when every earlier ticket has started. Tickets are per lane: a
// level's communicator for the phases at one position of their calls (an all-reduce's first
// reduce-scatter and its last all-gather are on two lanes of the node level). A phase then
// waits only for the same position of earlier calls, which wait only for earlier calls: the
// oldest call can always go on, and call k+1's reduce-scatter runs while call k's all-reduce
// crosses the nodes.
class HierarchicalComm::Engine {
 public:
  struct Lane {
    Communicator comm;                     // a duplicate of the level's communicator, owned
    std::unique_ptr<MpiComm> ops;          // on it (the level's row of the table)
    std::int64_t issued = 0, started = 0;  // tickets handed out, phases started
  };
  class Operation;

  // Phase positions each level is used at: the node level at 0, 1 and 2 (an all-reduce's
  // reduce-scatter and all-gather, an all-gather's second phase), across at 0 and 1.
  static constexpr int kNodePositions = 3, kAcrossPositions = 2;
  // Lanes over `node` (the group's ranks on this node) and `across` (one per node), taken.
  Engine(Communicator node, Communicator across, const std::string& name, Transport transport) {
    const auto make = [&](Lane* lanes, int positions, const Communicator& level,
                          const char* suffix) {
      for (int p = 0; p < positions; ++p) {
        MPI_Comm dup = MPI_COMM_NULL;
        mpi::check(MPI_Comm_dup(level.get(), &dup), "MPI Comm_dup (hierarchical lane)");
        lanes[p].comm = Communicator(dup);
        lanes[p].ops = std::make_unique<MpiComm>(dup, name + suffix, transport);
      }
    };
    make(node_lanes_, kNodePositions, node, "-intra");
    make(across_lanes_, kAcrossPositions, across, "-inter");
  }
  Lane& node(int position) { return node_lanes_[position]; }
  Lane& across(int position) { return across_lanes_[position]; }

  // Starts what can start, oldest operation first.
  void progress();
  // A shard buffer in the memory of `where` (tensor memory: the GPU's in a CUDA build).
  int take(Space where, std::size_t bytes) {
    return where == Space::tensor ? tensor_shards_.take(bytes) : host_shards_.take(bytes);
  }
  char* data(Space where, int slot) {
    return where == Space::tensor ? tensor_shards_.data(slot) : host_shards_.data(slot);
  }
  void give_back(Space where, int slot) {
    if (where == Space::tensor)
      tensor_shards_.give_back(slot);
    else
      host_shards_.give_back(slot);
  }

  std::vector<Operation*> in_flight;  // in the order of the group's calls

 private:
  Lane node_lanes_[kNodePositions], across_lanes_[kAcrossPositions];
  comm_detail::BufferPool<Kokkos::DefaultExecutionSpace::memory_space> tensor_shards_;
  comm_detail::BufferPool<Kokkos::HostSpace> host_shards_;
};

// One call of the group: its phases in order, each an operation on one level.
class HierarchicalComm::Engine::Operation final : public Request::Pending {
 public:
  // With a shard of `shard_bytes` in the buffers' space, for the phases to pass between them.
  Operation(Engine& engine, Space where, std::size_t shard_bytes) : engine_(engine), where_(where) {
    if (shard_bytes == 0) return;
    slot_ = engine_.take(where_, shard_bytes);
    shard_ = engine_.data(where_, slot_);
  }
  ~Operation() override {
    auto& f = engine_.in_flight;
    f.erase(std::remove(f.begin(), f.end(), this), f.end());
    if (slot_ >= 0) engine_.give_back(where_, slot_);
  }
  char* shard() const { return shard_; }

  // The next phase: `start` on `lane`, once the lane's earlier tickets have started.
  void add(Lane& lane, std::function<Started(Comm&)> start) {
    phases_.push_back(Phase{&lane, lane.issued++, std::move(start)});
  }
  // After the phases: joins the operations in flight and starts what it can.
  void begin() {
    engine_.in_flight.push_back(this);
    engine_.progress();
  }
  // Runs phases while they can run; true when the last one has completed.
  bool advance() {
    for (;;) {
      if (current_) {
        if (!current_->test()) return false;
        current_->finish();
        current_.reset();
      }
      if (next_ == phases_.size()) return done_ = true;
      Phase& p = phases_[next_];
      if (p.lane->started != p.ticket) return false;  // an earlier call's phase goes first
      current_ = p.start(*p.lane->ops);
      ++p.lane->started;
      ++next_;
    }
  }

  bool test() override {
    if (!done_) engine_.progress();
    return done_;
  }
  void wait() override {
    while (!test()) {
    }
  }

 private:
  struct Phase {
    Lane* lane;
    std::int64_t ticket;
    std::function<Started(Comm&)> start;
  };
  Engine& engine_;
  Space where_;
  int slot_ = -1;
  char* shard_ = nullptr;
  std::vector<Phase> phases_;
  std::size_t next_ = 0;
  Started current_;
  bool done_ = false;
};

void HierarchicalComm::Engine::progress() {
  // Completed operations leave the list; an operation's advance never touches the list.
  std::vector<Operation*> now = in_flight;
  for (Operation* op : now)
    if (op->advance()) in_flight.erase(std::find(in_flight.begin(), in_flight.end(), op));
}

// --- the Comm --------------------------------------------------------------------------------

struct HierarchicalComm::Levels {
  Communicator whole, node, across;
};

NodeSpan node_span_of(const std::vector<int>& nodes) {
  const NodeMap m = node_map(nodes);
  if (m.ranks.size() <= 1) return NodeSpan::one_node;
  return m.ranks[0] > 1 && uniform(m) ? NodeSpan::two_level : NodeSpan::flat;
}

NodeSpan node_span(MPI_Comm comm, int node) { return node_span_of(gather_nodes(comm, node)); }

NodeLevels node_levels(MPI_Comm comm, const std::string& name, int node, const std::string& needs) {
  PTRAIN_REQUIRE(comm != MPI_COMM_NULL, "comm: group '", name, "' has no communicator here");
  const NodeMap m = node_map(gather_nodes(comm, node));
  if (!uniform(m)) {
    const auto [lo, hi] = std::minmax_element(m.ranks.begin(), m.ranks.end());
    throw Error(cat("comm: group '", name, "' has ", *lo, " to ", *hi, " ranks per node; ", needs,
                    " needs the same number on each node"),
                kExitInput);
  }
  const int me = mpi::rank(comm), N = int(m.ranks.size());
  NodeLevels lv;
  lv.node_index = m.index[std::size_t(me)];
  lv.local = int(std::count(m.index.begin(), m.index.begin() + me, lv.node_index));
  lv.nodes = N;
  lv.node = split_group(comm, lv.node_index, lv.local, "inside the node");
  lv.across = split_group(comm, lv.local, lv.node_index, "across the nodes");
  return lv;
}

HierarchicalComm::Levels HierarchicalComm::split(MPI_Comm comm, const std::string& name, int node) {
  NodeLevels lv = node_levels(comm, name, node, "a hierarchical group");
  Levels out;
  out.whole = split_group(comm, 0, lv.local * lv.nodes + lv.node_index, "hierarchical group");
  out.node = std::move(lv.node);
  out.across = std::move(lv.across);
  return out;
}

HierarchicalComm::HierarchicalComm(MPI_Comm comm, std::string name, int node, Transport transport)
    : HierarchicalComm(split(comm, name, node), name, transport) {}

HierarchicalComm::HierarchicalComm(Levels levels, std::string name, Transport transport)
    : Comm(name, levels.whole.size(), levels.whole.rank()),
      whole_(std::move(levels.whole)),
      whole_ops_(std::make_unique<MpiComm>(whole_.get(), name, transport)),
      engine_(std::make_unique<Engine>(std::move(levels.node), std::move(levels.across), name,
                                       transport)) {
  members_ = static_cast<Comm&>(*whole_ops_).members_;
}

HierarchicalComm::~HierarchicalComm() = default;

int HierarchicalComm::nodes() const { return engine_->across(0).ops->size(); }
int HierarchicalComm::ranks_per_node() const { return engine_->node(0).ops->size(); }

std::string HierarchicalComm::describe() const {
  return cat("hierarchical (", nodes(), " nodes x ", ranks_per_node(), " ranks, ",
             whole_ops_->describe(), ")");
}

// A level's share of a call, counted on its row: what the level's own call carries.
// all-reduce of n: reduce-scatter and all-gather of n inside ((L-1)/L * n each), all-reduce
// of this rank's piece across (2(N-1)/N * piece).
Comm::Started HierarchicalComm::do_all_reduce(void* data, std::size_t n, DType t, ReduceOp op,
                                              Space where) {
  Comm& whole = *whole_ops_;
  if (op != ReduceOp::sum) return whole.do_all_reduce(data, n, t, op, where);
  Engine& e = *engine_;
  Comm &node = *e.node(0).ops, &across = *e.across(0).ops;
  const int L = node.size(), N = across.size();
  const std::size_t w = size_of(t);
  const std::vector<int> pieces = even_pieces(n, L);
  const std::size_t mine = std::size_t(pieces[std::size_t(node.rank())]);
  node.count(2.0 * (L - 1) / L * double(n * w));
  across.count(2.0 * (N - 1) / N * double(mine * w));
  // data: (n) -> the node's sum of this rank's piece: (mine) -> summed across -> gathered.
  auto call = std::make_unique<Engine::Operation>(e, where, mine * w);
  char* shard = call->shard();
  call->add(e.node(0),
            [=](Comm& c) { return c.do_reduce_scatter_sum(data, shard, pieces, t, where); });
  call->add(e.across(1),
            [=](Comm& c) { return c.do_all_reduce(shard, mine, t, ReduceOp::sum, where); });
  call->add(e.node(2), [=](Comm& c) { return c.do_all_gather(shard, data, pieces, t, where); });
  call->begin();
  return call;
}

// Rank l*N + k owns piece l*N + k of counts: local index l's pieces are contiguous, summed
// inside the node into that rank's chunk, whose pieces are then summed across the nodes.
Comm::Started HierarchicalComm::do_reduce_scatter_sum(const void* send, void* recv,
                                                      const std::vector<int>& counts, DType t,
                                                      Space where) {
  Engine& e = *engine_;
  Comm &node = *e.node(0).ops, &across = *e.across(0).ops;
  const int L = node.size(), N = across.size();
  const std::size_t w = size_of(t);
  const LocalMajor p = local_major(counts, L, N, node.rank());
  const std::size_t chunk = std::size_t(p.chunks[std::size_t(node.rank())]);
  node.count(double(L - 1) / L * double(sum(counts) * w));
  across.count(double(N - 1) / N * double(chunk * w));
  auto call = std::make_unique<Engine::Operation>(e, where, chunk * w);
  char* shard = call->shard();
  call->add(e.node(0),
            [=](Comm& c) { return c.do_reduce_scatter_sum(send, shard, p.chunks, t, where); });
  call->add(e.across(1),
            [=](Comm& c) { return c.do_reduce_scatter_sum(shard, recv, p.mine, t, where); });
  call->begin();
  return call;
}

// The inverse: this rank's piece gathered across the nodes into local index l's chunk, in its
// place in recv, then the chunks gathered inside the node, in place.
Comm::Started HierarchicalComm::do_all_gather(const void* send, void* recv,
                                              const std::vector<int>& counts, DType t,
                                              Space where) {
  Engine& e = *engine_;
  Comm &node = *e.node(0).ops, &across = *e.across(0).ops;
  const int L = node.size(), N = across.size();
  const std::size_t w = size_of(t);
  const LocalMajor p = local_major(counts, L, N, node.rank());
  across.count(double(N - 1) / N * double(std::size_t(p.chunks[std::size_t(node.rank())]) * w));
  node.count(double(L - 1) / L * double(sum(counts) * w));
  char* chunk = static_cast<char*>(recv) + p.base * w;
  auto call = std::make_unique<Engine::Operation>(e, where, 0);
  call->add(e.across(0), [=](Comm& c) { return c.do_all_gather(send, chunk, p.mine, t, where); });
  call->add(e.node(1), [=](Comm& c) { return c.do_all_gather(chunk, recv, p.chunks, t, where); });
  call->begin();
  return call;
}

Comm::Started HierarchicalComm::do_send(const void* data, std::size_t n, DType t, int peer, int tag,
                                        Space where) {
  return static_cast<Comm&>(*whole_ops_).do_send(data, n, t, peer, tag, where);
}

Comm::Started HierarchicalComm::do_recv(void* data, std::size_t n, DType t, int peer, int tag,
                                        Space where) {
  return static_cast<Comm&>(*whole_ops_).do_recv(data, n, t, peer, tag, where);
}

Comm::Started HierarchicalComm::do_all_to_all(const void* send, void* recv, std::size_t n_per_rank,
                                              DType t, Space where) {
  return static_cast<Comm&>(*whole_ops_).do_all_to_all(send, recv, n_per_rank, t, where);
}

Comm::Started HierarchicalComm::do_all_to_allv(const void* send,
                                               const std::vector<int>& send_counts, void* recv,
                                               const std::vector<int>& recv_counts, DType t,
                                               Space where) {
  return static_cast<Comm&>(*whole_ops_)
      .do_all_to_allv(send, send_counts, recv, recv_counts, t, where);
}

}  // namespace ptrain
