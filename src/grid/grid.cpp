#include "grid/grid.hpp"

#include <algorithm>
#include <map>
#include <vector>

#include "util/error.hpp"
#include "util/mpi.hpp"

namespace ptrain {

// ---- Communicator ---------------------------------------------------------------------------

Communicator& Communicator::operator=(Communicator&& other) noexcept {
  if (this != &other) {
    reset();
    comm_ = other.release();
  }
  return *this;
}

int Communicator::rank() const {
  if (is_null()) return -1;
  int r = -1;
  MPI_Comm_rank(comm_, &r);
  return r;
}

int Communicator::size() const {
  if (is_null()) return 0;
  int n = 0;
  MPI_Comm_size(comm_, &n);
  return n;
}

MPI_Comm Communicator::release() {
  MPI_Comm c = comm_;
  comm_ = MPI_COMM_NULL;
  return c;
}

void Communicator::reset() {
  if (comm_ != MPI_COMM_NULL && comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_SELF) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  comm_ = MPI_COMM_NULL;
}

// ---- Grid -----------------------------------------------------------------------------------

namespace {

// The ranks sharing this rank's node (shared memory), or the block r / n when simulating.
Communicator split_by_node(MPI_Comm world, const GridShape& shape, int simulated_ranks_per_node) {
  shape.validate(mpi::size(world));  // the same answer on every rank, so every rank throws together
  const int rank = mpi::rank(world);
  MPI_Comm node = MPI_COMM_NULL;
  if (simulated_ranks_per_node > 0)
    mpi::check(MPI_Comm_split(world, rank / simulated_ranks_per_node, rank, &node),
               "grid: MPI_Comm_split (node)");
  else
    mpi::check(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
               "grid: MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)");
  return Communicator(node);
}

// Every rank's node index; nodes are numbered in order of their lowest rank.
std::vector<int> gather_node_map(MPI_Comm world, const Communicator& node) {
  const int rank = mpi::rank(world);
  int leader = rank;  // lowest world rank on this node
  mpi::check(MPI_Allreduce(&rank, &leader, 1, MPI_INT, MPI_MIN, node.get()),
             "grid: MPI_Allreduce (node leader)");
  std::vector<int> leaders(static_cast<std::size_t>(mpi::size(world)));
  mpi::check(MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, world),
             "grid: MPI_Allgather (node map)");
  // A leader first appears at its own rank, so numbering on first appearance follows lowest ranks.
  std::map<int, int> id_of_leader;
  std::vector<int> node_of_rank(leaders.size());
  for (std::size_t r = 0; r < leaders.size(); ++r) {
    auto it = id_of_leader.emplace(leaders[r], static_cast<int>(id_of_leader.size())).first;
    node_of_rank[r] = it->second;
  }
  return node_of_rank;
}

}  // namespace

Grid::Grid(MPI_Comm world, const GridShape& shape, bool strict_topology,
           int simulated_ranks_per_node)
    : world_rank_(mpi::rank(world)),
      node_comm_(split_by_node(world, shape, simulated_ranks_per_node)),
      layout_(shape, gather_node_map(world, node_comm_)),
      coords_(layout_.coords(world_rank_)) {
  // Every rank holds the whole node map, so every rank reaches the same verdict here.
  layout_.check_topology(strict_topology);

  // MPI Cartesian ranks are row-major (last dimension fastest): pass the axes slowest first.
  // With reorder = 0 the cart rank equals the world rank, so Layout's arithmetic holds.
  // The context axis is periodic so MPI_Cart_shift on the cp group walks the attention ring.
  int dims[kNumAxes], periods[kNumAxes];
  for (int k = 0; k < kNumAxes; ++k) {
    const Axis a = shape.order[kNumAxes - 1 - k];
    dims[k] = shape.size[static_cast<int>(a)];
    periods[k] = a == Axis::c ? 1 : 0;
  }
  MPI_Comm cart = MPI_COMM_NULL;
  mpi::check(MPI_Cart_create(world, kNumAxes, dims, periods, 0, &cart), "grid: MPI_Cart_create");
  cart_ = Communicator(cart);
  PTRAIN_REQUIRE(mpi::rank(cart) == world_rank_, "grid: MPI_Cart_create renumbered rank ",
                 world_rank_, " to ", mpi::rank(cart), " despite reorder = 0");

  for (int g = 0; g < kNumGroupKinds; ++g) {
    const GroupKind kind = static_cast<GroupKind>(g);
    MPI_Comm sub = MPI_COMM_NULL;
    if (kind == GroupKind::embed) {
      // The first and the last pipeline stage with the same t, named by their lowest rank,
      // in world-rank order (the layout's group ranks).
      Coords first = coords_;
      for (Axis a : group_axes(kind)) first[static_cast<int>(a)] = 0;
      const int color = layout_.in_group(kind, world_rank_) ? layout_.rank(first) : MPI_UNDEFINED;
      mpi::check(MPI_Comm_split(cart, color, world_rank_, &sub), "grid: MPI_Comm_split (embed)");
    } else {
      const std::vector<Axis> axes = group_axes(kind);
      int remain[kNumAxes];
      for (int k = 0; k < kNumAxes; ++k)
        remain[k] =
            std::find(axes.begin(), axes.end(), shape.order[kNumAxes - 1 - k]) != axes.end();
      mpi::check(MPI_Cart_sub(cart, remain, &sub), "grid: MPI_Cart_sub");
    }
    groups_[static_cast<std::size_t>(g)] = Communicator(sub);
  }
}

}  // namespace ptrain
