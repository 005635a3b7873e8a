#include "grid/layout.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <sstream>

#include "deck/config.hpp"
#include "util/error.hpp"
#include "util/log.hpp"

namespace ptrain {

const char* axis_name(Axis a) {
  static const char* const names[kNumAxes] = {"t", "c", "e", "d", "p"};
  return names[static_cast<int>(a)];
}

Axis parse_axis(const std::string& letter) {
  for (int i = 0; i < kNumAxes; ++i)
    if (letter == axis_name(static_cast<Axis>(i))) return static_cast<Axis>(i);
  throw Error(cat("unknown grid axis '", letter, "' (expected one of t, c, e, d, p)"), kExitInput);
}

const char* group_name(GroupKind g) {
  static const char* const names[kNumGroupKinds] = {
      "tp", "cp", "ep", "dp", "pp", "dense-grad", "expert-grad", "batch", "embed"};
  return names[static_cast<int>(g)];
}

std::string group_axes_text(GroupKind g) {
  std::string text;
  for (Axis a : group_axes(g)) text += (text.empty() ? "" : ",") + std::string(axis_name(a));
  return g == GroupKind::embed ? text + " (first+last stage)" : text;
}

std::vector<Axis> group_axes(GroupKind g) {
  switch (g) {
    case GroupKind::tp:
      return {Axis::t};
    case GroupKind::cp:
      return {Axis::c};
    case GroupKind::ep:
      return {Axis::e};
    case GroupKind::dp:
      return {Axis::d};
    case GroupKind::pp:
      return {Axis::p};
    case GroupKind::dense_grad:
      return {Axis::d, Axis::e, Axis::c};
    case GroupKind::expert_grad:
      return {Axis::d, Axis::c};
    case GroupKind::batch:
      return {Axis::d, Axis::e};
    case GroupKind::embed:  // the dense-grad groups of the first and the last stage
      return {Axis::d, Axis::e, Axis::c, Axis::p};
  }
  throw Error(cat("unknown group kind ", static_cast<int>(g)));
}

// ---- GridShape ------------------------------------------------------------------------------

GridShape GridShape::from_config(const Config& config) {
  const auto& par = config.parallel;
  GridShape shape;
  const std::pair<Axis, std::int64_t> sizes[] = {{Axis::t, par.tp},
                                                 {Axis::c, par.cp},
                                                 {Axis::e, par.ep},
                                                 {Axis::d, par.dp},
                                                 {Axis::p, par.pp}};
  for (const auto& [axis, n] : sizes) {
    if (n < 1 || n > std::numeric_limits<int>::max())
      throw Error(
          cat("parallel%", axis_name(axis), "p = ", n, ": a grid axis needs a size of at least 1",
              axis == Axis::d ? " (dp = -1 must be resolved against the world size first)" : ""),
          kExitInput);
    shape.size[static_cast<int>(axis)] = static_cast<int>(n);
  }
  if (par.order.size() != static_cast<std::size_t>(kNumAxes))
    throw Error(cat("parallel%order has ", par.order.size(),
                    " entries; it needs all five axes t, c, e, d, p"),
                kExitInput);
  for (int i = 0; i < kNumAxes; ++i) shape.order[i] = parse_axis(par.order[i]);
  shape.validate(shape.world());
  return shape;
}

int GridShape::world() const {
  std::int64_t n = 1;
  for (int s : size) {
    n *= s;
    if (n > std::numeric_limits<int>::max() || n < 1)
      throw Error(cat("grid ", str(), " has more ranks than MPI can number"), kExitInput);
  }
  return static_cast<int>(n);
}

void GridShape::validate(int world_size) const {
  for (int i = 0; i < kNumAxes; ++i)
    if (size[i] < 1)
      throw Error(cat("grid ", str(), ": axis ", axis_name(static_cast<Axis>(i)), " has size ",
                      size[i], " (must be >= 1)"),
                  kExitInput);
  std::array<int, kNumAxes> seen{};
  for (Axis a : order) {
    const int i = static_cast<int>(a);
    if (i < 0 || i >= kNumAxes || seen[i]++)
      throw Error(
          cat("grid order ", str(), " is not a permutation of t, c, e, d, p (parallel%order)"),
          kExitInput);
  }
  if (world() != world_size)
    throw Error(cat("grid ", str(), " needs ", world(), " ranks but the world has ", world_size,
                    " (tp*cp*ep*dp*pp must equal the number of MPI ranks)"),
                kExitInput);
}

std::string GridShape::str() const {
  std::ostringstream os;
  for (int i = 0; i < kNumAxes; ++i)
    os << (i ? " " : "") << axis_name(static_cast<Axis>(i)) << size[i];
  os << ", order ";
  for (int i = 0; i < kNumAxes; ++i) {
    const int a = static_cast<int>(order[i]);
    os << (i ? "," : "") << (a >= 0 && a < kNumAxes ? axis_name(order[i]) : "?");
  }
  return os.str();
}

// ---- Layout ---------------------------------------------------------------------------------

namespace {
std::vector<int> block_node_map(int world, int ranks_per_node) {
  if (world < 1) throw Error(cat("world size ", world, " must be at least 1"), kExitInput);
  if (ranks_per_node < 1)
    throw Error(cat("ranks per node ", ranks_per_node, " must be at least 1"), kExitInput);
  std::vector<int> node(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) node[static_cast<std::size_t>(r)] = r / ranks_per_node;
  return node;
}
}  // namespace

Layout::Layout(const GridShape& shape, int world_size, int ranks_per_node)
    : Layout(shape, block_node_map(world_size, ranks_per_node)) {}

Layout::Layout(const GridShape& shape, std::vector<int> node_of_rank)
    : shape_(shape), node_of_rank_(std::move(node_of_rank)) {
  shape_.validate(static_cast<int>(node_of_rank_.size()));
  // Nodes must be numbered 0, 1, ... in order of their lowest rank.
  for (int n : node_of_rank_) {
    if (n < 0 || n > num_nodes_)
      throw Error(
          cat("node map: nodes must be numbered 0, 1, ... in order of their lowest rank (got ", n,
              " after ", num_nodes_, " nodes)"));
    if (n == num_nodes_) ++num_nodes_;
  }
  int stride = 1;
  for (Axis a : shape_.order) {
    stride_[static_cast<int>(a)] = stride;
    stride *= shape_.size[static_cast<int>(a)];
  }
}

Coords Layout::coords(int r) const {
  PTRAIN_REQUIRE(r >= 0 && r < world(), "rank ", r, " is outside the grid of ", world(), " ranks");
  Coords c{};
  for (int i = 0; i < kNumAxes; ++i) c[i] = (r / stride_[i]) % shape_.size[i];
  return c;
}

int Layout::rank(const Coords& c) const {
  int r = 0;
  for (int i = 0; i < kNumAxes; ++i) {
    PTRAIN_REQUIRE(c[i] >= 0 && c[i] < shape_.size[i], "coordinate ",
                   axis_name(static_cast<Axis>(i)), " = ", c[i], " is outside the grid ",
                   shape_.str());
    r += c[i] * stride_[i];
  }
  return r;
}

namespace {
int axis_size(const GridShape& s, Axis a) { return s.size[static_cast<int>(a)]; }
}  // namespace

bool Layout::in_group(GroupKind g, int r) const {
  if (g != GroupKind::embed) return r >= 0 && r < world();
  const int p = coords(r)[static_cast<int>(Axis::p)];
  return p == 0 || p == axis_size(shape_, Axis::p) - 1;
}

int Layout::group_size(GroupKind g) const {
  int n = 1;
  for (Axis a : group_axes(g)) n *= group_axis_size(g, a);
  return n;
}

// The values axis a takes in group g: its size, but 2 (or 1) along p for the embed group,
// which holds only the first and the last stage.
int Layout::group_axis_size(GroupKind g, Axis a) const {
  const int n = axis_size(shape_, a);
  return g == GroupKind::embed && a == Axis::p ? std::min(n, 2) : n;
}

int Layout::group_rank(GroupKind g, int r) const {
  const Coords c = coords(r);
  if (!in_group(g, r)) return -1;
  // Row-major over the group's axes in grid order, fastest first: the order of world ranks
  // (the embed group's last stage counts as p index 1).
  const std::vector<Axis> axes = group_axes(g);
  int gr = 0, stride = 1;
  for (Axis a : shape_.order) {
    if (std::find(axes.begin(), axes.end(), a) == axes.end()) continue;
    const int x = c[static_cast<int>(a)];
    gr += (g == GroupKind::embed && a == Axis::p ? (x == 0 ? 0 : 1) : x) * stride;
    stride *= group_axis_size(g, a);
  }
  return gr;
}

std::vector<int> Layout::members(GroupKind g, int r) const {
  if (!in_group(g, r)) return {};
  Coords c = coords(r);
  // Odometer over the group's axes (the embed group skips the stages between the ends).
  const std::vector<Axis> axes = group_axes(g);
  for (Axis a : axes) c[static_cast<int>(a)] = 0;
  std::vector<int> m;
  m.reserve(static_cast<std::size_t>(group_size(g)));
  while (true) {
    const int q = rank(c);
    if (in_group(g, q)) m.push_back(q);
    std::size_t k = 0;
    for (; k < axes.size(); ++k) {
      int& x = c[static_cast<int>(axes[k])];
      if (++x < axis_size(shape_, axes[k])) break;
      x = 0;
    }
    if (k == axes.size()) break;
  }
  std::sort(m.begin(), m.end());
  return m;
}

int Layout::max_ranks_per_node() const {
  std::vector<int> count(static_cast<std::size_t>(num_nodes_), 0);
  for (int n : node_of_rank_) ++count[static_cast<std::size_t>(n)];
  return *std::max_element(count.begin(), count.end());
}

std::vector<GroupReport> Layout::reports() const {
  std::vector<GroupReport> out;
  for (int k = 0; k < kNumGroupKinds; ++k) {
    const GroupKind g = static_cast<GroupKind>(k);
    // Every instance is named by its lowest member (group rank 0); collect each instance's
    // nodes. Ranks come in increasing order, so a rank's lowest member has been seen first.
    std::vector<std::vector<int>> nodes_of_instance(static_cast<std::size_t>(world()));
    int count = 0;
    for (int r = 0; r < world(); ++r) {
      if (!in_group(g, r)) continue;
      Coords c = coords(r);
      for (Axis a : group_axes(g)) c[static_cast<int>(a)] = 0;
      const int leader = rank(c);
      if (leader == r) ++count;
      nodes_of_instance[static_cast<std::size_t>(leader)].push_back(node(r));
    }
    int spanned = 0;
    for (auto& nodes : nodes_of_instance) {
      std::sort(nodes.begin(), nodes.end());
      spanned = std::max(spanned,
                         static_cast<int>(std::unique(nodes.begin(), nodes.end()) - nodes.begin()));
    }
    out.push_back({g, group_size(g), count, spanned});
  }
  return out;
}

void Layout::check_topology(bool strict) const {
  const int rpn = max_ranks_per_node();
  for (const GroupReport& rep : reports()) {
    if (rep.intra_node() || (rep.kind != GroupKind::tp && rep.kind != GroupKind::ep)) continue;
    const Axis a = rep.kind == GroupKind::tp ? Axis::t : Axis::e;
    const std::string key = rep.kind == GroupKind::tp ? "parallel%tp" : "parallel%ep";
    std::string fix;
    if (rep.size > rpn)
      fix = cat("lower ", key, " to at most ", rpn, " (the ranks per node)");
    else
      fix = cat("put ", axis_name(a), " first in parallel%order");
    const std::string msg = cat(group_name(rep.kind), " groups of ", rep.size, " ranks span ",
                                rep.nodes_spanned, " nodes (", rpn, " ranks per node, grid ",
                                shape_.str(), "): their traffic crosses the network; ", fix);
    if (strict) throw Error(msg + " (parallel%strict_topology = .true.)", kExitInput);
    log::warn(msg);
  }
}

std::string Layout::describe() const {
  std::ostringstream os;
  const int rpn = max_ranks_per_node();
  os << "grid: " << world() << " ranks = " << shape_.str() << " (fastest-varying first); "
     << num_nodes_ << (num_nodes_ == 1 ? " node" : " nodes") << ", up to " << rpn
     << " ranks per node\n";
  char line[160];
  std::snprintf(line, sizeof line, "  %-12s %-15s %6s %7s %6s  %s\n", "group", "axes", "size",
                "groups", "nodes", "intra-node");
  os << line;
  for (const GroupReport& rep : reports()) {
    std::snprintf(line, sizeof line, "  %-12s %-15s %6d %7d %6d  %s\n", group_name(rep.kind),
                  group_axes_text(rep.kind).c_str(), rep.size, rep.count, rep.nodes_spanned,
                  rep.intra_node() ? "yes" : "no");
    os << line;
  }
  if (world() <= 64) {
    os << "  rank map:  rank  node   t  c  e  d  p\n";
    for (int r = 0; r < world(); ++r) {
      const Coords c = coords(r);
      std::snprintf(line, sizeof line, "            %4d  %4d  %2d %2d %2d %2d %2d\n", r, node(r),
                    c[0], c[1], c[2], c[3], c[4]);
      os << line;
    }
  }
  std::string text = os.str();
  if (!text.empty() && text.back() == '\n') text.pop_back();
  return text;
}

}  // namespace ptrain
