// grid/layout.hpp — the five-axis process grid as pure arithmetic (no MPI): rank <-> coordinates,
// the members of every group, and the node mapping. `ptrain --plan` uses it on a login node;
// the MPI Grid (grid/grid.hpp) holds one and reports through it, so both print the same table.
#pragma once
#include <array>
#include <string>
#include <vector>

namespace ptrain {

struct Config;

enum class Axis : int { t, c, e, d, p };  // tensor, context, expert, data, pipeline
constexpr int kNumAxes = 5;
const char* axis_name(Axis a);               // "t"
Axis parse_axis(const std::string& letter);  // "t" -> Axis::t; Error(kExitInput) otherwise

// Coordinates (or sizes) indexed by Axis.
using Coords = std::array<int, kNumAxes>;

enum class GroupKind : int { tp, cp, ep, dp, pp, dense_grad, expert_grad, batch, embed };
constexpr int kNumGroupKinds = 9;
const char* group_name(GroupKind g);  // "tp", "dense-grad", ...
// The axes its members differ in. embed: d, e, c and p, but only the first and the last
// pipeline stage: the dense-grad groups of both ends with one tp rank, which sum the tied
// wte gradient.
std::vector<Axis> group_axes(GroupKind g);
std::string group_axes_text(GroupKind g);  // "t", "d,e,c", "d,e,c,p (first+last stage)"

struct GridShape {
  Coords size{1, 1, 1, 1, 1};                                                     // indexed by Axis
  std::array<Axis, kNumAxes> order{Axis::t, Axis::c, Axis::e, Axis::d, Axis::p};  // fastest first

  // From config.parallel.{tp,cp,ep,dp,pp,order}; dp must already be resolved (> 0).
  static GridShape from_config(const Config& config);
  int world() const;  // product of the sizes
  // Sizes >= 1, order a permutation of the five axes, product == world; Error(kExitInput) if not.
  void validate(int world) const;
  std::string str() const;  // "t2 c1 e1 d4 p1, order t,c,e,d,p"
};

struct GroupReport {
  GroupKind kind;
  int size;           // ranks in one instance
  int count;          // instances in the world
  int nodes_spanned;  // most nodes one instance touches
  bool intra_node() const { return nodes_spanned <= 1; }
};

class Layout {
 public:
  // Planning: rank r lives on node r / ranks_per_node.
  Layout(const GridShape& shape, int world, int ranks_per_node);
  // Any node map: node_of_rank[r] is rank r's node (0, 1, ... in order of lowest rank).
  Layout(const GridShape& shape, std::vector<int> node_of_rank);

  const GridShape& shape() const { return shape_; }
  int world() const { return static_cast<int>(node_of_rank_.size()); }
  Coords coords(int rank) const;
  int rank(const Coords& coords) const;

  // Group membership of `rank`: members are sorted by world rank, which is also their order
  // (group rank) in the group's communicator. Embed: empty when rank is not on the first or
  // last pipeline stage; group_rank is then -1.
  bool in_group(GroupKind g, int rank) const;
  std::vector<int> members(GroupKind g, int rank) const;
  int group_rank(GroupKind g, int rank) const;
  int group_size(GroupKind g) const;

  int node(int rank) const { return node_of_rank_.at(static_cast<std::size_t>(rank)); }
  int num_nodes() const { return num_nodes_; }
  int max_ranks_per_node() const;

  std::vector<GroupReport> reports() const;  // one per GroupKind, in enum order
  // A tp or ep group that spans nodes: log::warn, or Error(kExitInput) when strict.
  void check_topology(bool strict) const;
  // Shape, order, group table and, for at most 64 ranks, the rank map.
  std::string describe() const;

 private:
  GridShape shape_;
  std::vector<int> node_of_rank_;
  int num_nodes_ = 0;
  Coords stride_{};  // world-rank stride of each axis
  int group_axis_size(GroupKind g, Axis a) const;
};

}  // namespace ptrain
