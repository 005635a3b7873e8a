// grid/grid.hpp — the MPI process grid: a Cartesian communicator over the five axes
// (grid/layout.hpp has the arithmetic), one communicator per group, and the node map.
#pragma once
#include <mpi.h>

#include <array>
#include <string>

#include "grid/layout.hpp"

namespace ptrain {

// Owns an MPI communicator: MPI_Comm_free on destruction (never for WORLD, SELF or NULL).
class Communicator {
 public:
  Communicator() = default;
  explicit Communicator(MPI_Comm comm) : comm_(comm) {}
  Communicator(Communicator&& other) noexcept : comm_(other.release()) {}
  Communicator& operator=(Communicator&& other) noexcept;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  ~Communicator() { reset(); }

  MPI_Comm get() const { return comm_; }
  bool is_null() const { return comm_ == MPI_COMM_NULL; }
  int rank() const;  // -1 when null
  int size() const;  // 0 when null
  MPI_Comm release();
  void reset();

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

class Grid {
 public:
  // Collective over `world`. tp*cp*ep*dp*pp must equal its size. A tp or ep group that
  // spans nodes is a warning, or Error(kExitInput) with strict_topology (on every rank).
  // simulated_ranks_per_node > 0 replaces node discovery by "rank r is on node r / n",
  // to study or test a multi-node mapping on one machine.
  Grid(MPI_Comm world, const GridShape& shape, bool strict_topology,
       int simulated_ranks_per_node = 0);

  const Layout& layout() const { return layout_; }
  const GridShape& shape() const { return layout_.shape(); }
  int coord(Axis a) const { return coords_[static_cast<int>(a)]; }
  int size(Axis a) const { return shape().size[static_cast<int>(a)]; }
  const Coords& coords() const { return coords_; }

  MPI_Comm cart() const { return cart_.get(); }
  MPI_Comm comm(GroupKind g) const {
    return groups_[static_cast<int>(g)].get();
  }  // NULL: not a member
  bool in_group(GroupKind g) const { return !groups_[static_cast<int>(g)].is_null(); }
  int group_rank(GroupKind g) const {
    return groups_[static_cast<int>(g)].rank();
  }  // -1: not a member
  int group_size(GroupKind g) const {
    return groups_[static_cast<int>(g)].size();
  }  // 0: not a member

  int world_rank() const { return world_rank_; }
  int world_size() const { return layout_.world(); }
  int node() const { return layout_.node(world_rank_); }
  int node_of(int rank) const { return layout_.node(rank); }
  int num_nodes() const { return layout_.num_nodes(); }
  int ranks_per_node() const { return layout_.max_ranks_per_node(); }
  MPI_Comm node_comm() const { return node_comm_.get(); }  // ranks on this rank's node

  std::string describe() const { return layout_.describe(); }

 private:
  int world_rank_ = 0;
  Communicator node_comm_;  // before layout_: the node map is read from it
  Layout layout_;
  Coords coords_{};
  Communicator cart_;
  std::array<Communicator, kNumGroupKinds> groups_;
};

}  // namespace ptrain
