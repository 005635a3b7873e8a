// ptrain-test: np=1,2,4,8 labels=quick timeout=300
// The process grid. Oracles: an odometer that walks coordinates fastest-axis first (rank ->
// coordinates), brute-force membership by comparing coordinates, MPI_Cart_coords of the
// Cartesian communicator, what every group communicator actually gathers, and processor names
// for the node map.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "deck/config.hpp"
#include "grid/grid.hpp"
#include "test_support.hpp"
#include "util/error.hpp"

using namespace ptrain;

using ptrain::test::world_rank;
using ptrain::test::world_size;

namespace {

constexpr Axis kAllAxes[kNumAxes] = {Axis::t, Axis::c, Axis::e, Axis::d, Axis::p};
constexpr GroupKind kAllGroups[kNumGroupKinds] = {
    GroupKind::tp,         GroupKind::cp,          GroupKind::ep,    GroupKind::dp,   GroupKind::pp,
    GroupKind::dense_grad, GroupKind::expert_grad, GroupKind::batch, GroupKind::embed};

int ix(Axis a) { return static_cast<int>(a); }

// Every 5-tuple of sizes >= 1 whose product is `world`.
std::vector<Coords> shapes_of(int world) {
  std::vector<Coords> out;
  Coords s{};
  auto rec = [&](auto&& self, int axis, int left) -> void {
    if (axis == kNumAxes - 1) {
      s[axis] = left;
      out.push_back(s);
      return;
    }
    for (int f = 1; f <= left; ++f)
      if (left % f == 0) {
        s[axis] = f;
        self(self, axis + 1, left / f);
      }
  };
  rec(rec, 0, world);
  return out;
}

std::vector<std::array<Axis, kNumAxes>> all_orders() {
  std::array<Axis, kNumAxes> o{Axis::t, Axis::c, Axis::e, Axis::d, Axis::p};
  std::vector<std::array<Axis, kNumAxes>> out;
  do out.push_back(o);
  while (std::next_permutation(o.begin(), o.end()));
  return out;
}

std::array<Axis, kNumAxes> order_of(const std::string& letters) {  // "dtpce"
  std::array<Axis, kNumAxes> o{};
  for (int i = 0; i < kNumAxes; ++i)
    o[i] = parse_axis(std::string(1, letters[static_cast<std::size_t>(i)]));
  return o;
}

GridShape make_shape(const Coords& size, const std::array<Axis, kNumAxes>& order) {
  GridShape s;
  s.size = size;
  s.order = order;
  return s;
}

// Coordinates of ranks 0, 1, 2, ... by counting: bump order[0], carry into order[1], ...
std::vector<Coords> odometer(const GridShape& s) {
  std::vector<Coords> out;
  Coords c{};
  const int n = s.world();
  for (int r = 0; r < n; ++r) {
    out.push_back(c);
    for (Axis a : s.order) {
      if (++c[ix(a)] < s.size[ix(a)]) break;
      c[ix(a)] = 0;
    }
  }
  return out;
}

// Which axes a group's members may differ in (independent of the module's table).
std::set<Axis> free_axes(GroupKind g) {
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
  return {};
}

bool on_end_stage(const GridShape& s, const Coords& c) {
  return c[ix(Axis::p)] == 0 || c[ix(Axis::p)] == s.size[ix(Axis::p)] - 1;
}

// Brute force: every rank whose coordinates equal r's outside the group's axes.
std::vector<int> brute_members(const GridShape& s, const std::vector<Coords>& coords, GroupKind g,
                               int r) {
  const std::set<Axis> axes = free_axes(g);
  if (g == GroupKind::embed && !on_end_stage(s, coords[static_cast<std::size_t>(r)])) return {};
  std::vector<int> out;
  for (std::size_t q = 0; q < coords.size(); ++q) {
    bool same = true;
    for (Axis a : kAllAxes)
      if (!axes.count(a) && coords[q][ix(a)] != coords[static_cast<std::size_t>(r)][ix(a)])
        same = false;
    if (same && (g != GroupKind::embed || on_end_stage(s, coords[q])))
      out.push_back(static_cast<int>(q));
  }
  return out;
}

int expected_group_size(const GridShape& s, GroupKind g) {
  int n = 1;
  for (Axis a : free_axes(g))
    n *= g == GroupKind::embed && a == Axis::p ? std::min(2, s.size[ix(a)]) : s.size[ix(a)];
  return n;
}

// Open MPI hands out the lowest free Fortran handle index, so a leaked communicator shows up
// as a higher index for the next new one.
int next_comm_index() {
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  const int index = MPI_Comm_c2f(dup);
  MPI_Comm_free(&dup);
  return index;
}

template <class F>
void expect_error(F&& f, int code, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "no ptrain::Error thrown (expected one containing '" << fragment << "')";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

// Everything the MPI grid claims, checked against MPI itself and against the pure Layout.
void check_grid(const GridShape& s) {
  SCOPED_TRACE(s.str());
  const int me = world_rank(), n = world_size();
  Grid grid(MPI_COMM_WORLD, s, false);
  ASSERT_EQ(grid.world_size(), n);
  ASSERT_EQ(grid.world_rank(), me);
  int product = 1;
  for (Axis a : kAllAxes) product *= grid.size(a);
  EXPECT_EQ(product, n);

  // Coordinates: MPI's Cartesian view (dims passed slowest first) and the odometer.
  const std::vector<Coords> oracle = odometer(s);
  int cart_rank = -1, cc[kNumAxes], dims[kNumAxes], periods[kNumAxes], cart_coords[kNumAxes];
  MPI_Comm_rank(grid.cart(), &cart_rank);
  EXPECT_EQ(cart_rank, me);
  MPI_Cart_coords(grid.cart(), me, kNumAxes, cc);
  MPI_Cart_get(grid.cart(), kNumAxes, dims, periods, cart_coords);
  for (int k = 0; k < kNumAxes; ++k) {
    const Axis a = s.order[kNumAxes - 1 - k];
    EXPECT_EQ(cc[k], grid.coord(a)) << "axis " << axis_name(a);
    EXPECT_EQ(dims[k], s.size[ix(a)]) << "axis " << axis_name(a);
  }
  EXPECT_EQ(grid.coords(), oracle[static_cast<std::size_t>(me)]);

  std::vector<int> all(static_cast<std::size_t>(n) * kNumAxes);
  MPI_Allgather(grid.coords().data(), kNumAxes, MPI_INT, all.data(), kNumAxes, MPI_INT,
                MPI_COMM_WORLD);
  for (int r = 0; r < n; ++r) {
    const Coords c = grid.layout().coords(r);
    for (int i = 0; i < kNumAxes; ++i)
      EXPECT_EQ(all[static_cast<std::size_t>(r * kNumAxes + i)], c[i]);
    EXPECT_EQ(c, oracle[static_cast<std::size_t>(r)]);
    EXPECT_EQ(grid.layout().rank(c), r);
  }

  // Groups: gather (world rank, coordinates) over each communicator.
  for (GroupKind g : kAllGroups) {
    SCOPED_TRACE(group_name(g));
    const std::vector<int> expect = brute_members(s, oracle, g, me);
    EXPECT_EQ(grid.layout().members(g, me), expect);
    if (expect.empty()) {
      EXPECT_EQ(grid.comm(g), MPI_COMM_NULL);
      EXPECT_FALSE(grid.in_group(g));
      EXPECT_EQ(grid.group_rank(g), -1);
      EXPECT_EQ(grid.layout().group_rank(g, me), -1);
      continue;
    }
    ASSERT_NE(grid.comm(g), MPI_COMM_NULL);
    int size = 0, rank = -1;
    MPI_Comm_size(grid.comm(g), &size);
    MPI_Comm_rank(grid.comm(g), &rank);
    EXPECT_EQ(size, expected_group_size(s, g));
    EXPECT_EQ(grid.group_size(g), size);
    EXPECT_EQ(grid.layout().group_size(g), size);
    EXPECT_EQ(grid.group_rank(g), rank);
    EXPECT_EQ(grid.layout().group_rank(g, me), rank);
    ASSERT_EQ(static_cast<int>(expect.size()), size);
    EXPECT_EQ(expect[static_cast<std::size_t>(rank)], me);

    int mine[1 + kNumAxes] = {me};
    std::copy(grid.coords().begin(), grid.coords().end(), mine + 1);
    std::vector<int> got(static_cast<std::size_t>(size) * (1 + kNumAxes));
    MPI_Allgather(mine, 1 + kNumAxes, MPI_INT, got.data(), 1 + kNumAxes, MPI_INT, grid.comm(g));
    std::set<Coords> distinct;
    const std::set<Axis> axes = free_axes(g);
    for (int q = 0; q < size; ++q) {
      const int* row = &got[static_cast<std::size_t>(q) * (1 + kNumAxes)];
      EXPECT_EQ(row[0], expect[static_cast<std::size_t>(q)]) << "group rank " << q;
      Coords c{};
      std::copy(row + 1, row + 1 + kNumAxes, c.begin());
      distinct.insert(c);
      for (Axis a : kAllAxes) {
        if (!axes.count(a)) {
          EXPECT_EQ(c[ix(a)], grid.coord(a)) << "member differs in " << axis_name(a);
        }
      }
      if (g == GroupKind::embed) {
        EXPECT_TRUE(on_end_stage(s, c));
      }
    }
    EXPECT_EQ(static_cast<int>(distinct.size()), size);
  }
}

}  // namespace

// ---- pure layout -------------------------------------------------------------------------------

TEST(Layout, AxisAndGroupNames) {
  for (Axis a : kAllAxes) EXPECT_EQ(parse_axis(axis_name(a)), a);
  expect_error([] { parse_axis("x"); }, kExitInput, "'x'");
  EXPECT_STREQ(group_name(GroupKind::dense_grad), "dense-grad");
  EXPECT_EQ(group_axes_text(GroupKind::dense_grad), "d,e,c");
  EXPECT_EQ(group_axes_text(GroupKind::expert_grad), "d,c");
  EXPECT_EQ(group_axes_text(GroupKind::batch), "d,e");
}

TEST(Layout, MatchesOdometerAndBruteForceForEveryShapeAndOrder) {
  for (int world : {1, 2, 4, 6, 8}) {
    for (const Coords& size : shapes_of(world)) {
      for (const auto& order : all_orders()) {
        const GridShape s = make_shape(size, order);
        SCOPED_TRACE(s.str());
        const Layout layout(s, world, 2);
        const std::vector<Coords> oracle = odometer(s);
        for (int r = 0; r < world; ++r) {
          ASSERT_EQ(layout.coords(r), oracle[static_cast<std::size_t>(r)]);
          ASSERT_EQ(layout.rank(oracle[static_cast<std::size_t>(r)]), r);
          for (GroupKind g : kAllGroups) {
            const std::vector<int> expect = brute_members(s, oracle, g, r);
            ASSERT_EQ(layout.members(g, r), expect) << group_name(g) << " rank " << r;
            ASSERT_EQ(layout.in_group(g, r), !expect.empty());
            const auto at = std::find(expect.begin(), expect.end(), r);
            ASSERT_EQ(layout.group_rank(g, r), at == expect.end() ? -1 : int(at - expect.begin()));
            if (!expect.empty()) {
              ASSERT_EQ(layout.group_size(g), static_cast<int>(expect.size()));
            }
            ASSERT_EQ(layout.group_size(g), expected_group_size(s, g));
          }
        }
      }
    }
  }
}

TEST(Layout, NodeMappingAtScale) {
  // 512 ranks, 4 per node, default order t,c,e,d,p: t4 d16 p8.
  GridShape s = make_shape({4, 1, 1, 16, 8}, order_of("tcedp"));
  const Layout layout(s, 512, 4);
  EXPECT_EQ(layout.num_nodes(), 128);
  EXPECT_EQ(layout.max_ranks_per_node(), 4);
  struct Want {
    GroupKind g;
    int size, count, nodes;
  };
  const Want want[] = {{GroupKind::tp, 4, 128, 1},
                       {GroupKind::cp, 1, 512, 1},
                       {GroupKind::ep, 1, 512, 1},
                       {GroupKind::dp, 16, 32, 16},
                       {GroupKind::pp, 8, 64, 8},
                       {GroupKind::dense_grad, 16, 32, 16},
                       {GroupKind::expert_grad, 16, 32, 16},
                       {GroupKind::batch, 16, 32, 16},
                       {GroupKind::embed, 32, 4, 32}};
  const std::vector<GroupReport> reps = layout.reports();
  ASSERT_EQ(reps.size(), std::size(want));
  for (std::size_t i = 0; i < reps.size(); ++i) {
    SCOPED_TRACE(group_name(want[i].g));
    EXPECT_EQ(reps[i].kind, want[i].g);
    EXPECT_EQ(reps[i].size, want[i].size);
    EXPECT_EQ(reps[i].count, want[i].count);
    EXPECT_EQ(reps[i].nodes_spanned, want[i].nodes);
    EXPECT_EQ(reps[i].intra_node(), want[i].nodes == 1);
  }
  EXPECT_NO_THROW(layout.check_topology(true));  // only tp and ep matter: pp may cross nodes

  // t8 on 4-rank nodes: tp spans 2 nodes, a warning, an error when strict.
  s = make_shape({8, 1, 1, 8, 8}, order_of("tcedp"));
  const Layout wide(s, 512, 4);
  EXPECT_EQ(wide.reports()[ix(Axis::t)].nodes_spanned, 2);
  EXPECT_NO_THROW(wide.check_topology(false));
  expect_error([&] { wide.check_topology(true); }, kExitInput,
               "lower parallel%tp to at most 4 (the ranks per node)");

  // t4 but t not fastest: each tp group strides across 4 nodes; the fix is the order.
  s = make_shape({4, 1, 1, 16, 8}, order_of("dtpce"));
  const Layout strided(s, 512, 4);
  EXPECT_EQ(strided.reports()[ix(Axis::t)].nodes_spanned, 4);
  EXPECT_TRUE(strided.reports()[ix(Axis::d)].intra_node() == false);
  expect_error([&] { strided.check_topology(true); }, kExitInput, "put t first in parallel%order");

  // ep groups crossing nodes are checked too.
  s = make_shape({1, 1, 8, 64, 1}, order_of("tcedp"));
  const Layout experts(s, 512, 4);
  EXPECT_EQ(experts.reports()[static_cast<int>(GroupKind::ep)].nodes_spanned, 2);
  expect_error([&] { experts.check_topology(true); }, kExitInput, "ep groups");
}

TEST(Layout, UnevenNodesAndExplicitNodeMap) {
  const GridShape s = make_shape({2, 1, 1, 3, 1}, order_of("tcedp"));
  const Layout blocks(s, 6, 4);  // nodes {0,1,2,3} {4,5}
  EXPECT_EQ(blocks.num_nodes(), 2);
  EXPECT_EQ(blocks.node(3), 0);
  EXPECT_EQ(blocks.node(4), 1);
  EXPECT_EQ(blocks.max_ranks_per_node(), 4);
  EXPECT_EQ(blocks.reports()[static_cast<int>(GroupKind::dp)].nodes_spanned, 2);
  EXPECT_TRUE(blocks.reports()[static_cast<int>(GroupKind::tp)].intra_node());

  // Round-robin placement: node = rank % 2 = t, so tp crosses nodes and each dp group stays on one.
  const Layout explicit_map(s, std::vector<int>{0, 1, 0, 1, 0, 1});
  EXPECT_EQ(explicit_map.reports()[static_cast<int>(GroupKind::tp)].nodes_spanned, 2);
  EXPECT_EQ(explicit_map.reports()[static_cast<int>(GroupKind::dp)].nodes_spanned, 1);
  expect_error([&] { Layout(s, std::vector<int>{1, 0, 0, 0, 0, 0}); }, kExitRuntime, "lowest rank");
}

TEST(Layout, MalformedShapesAreInputErrors) {
  const GridShape s = make_shape({2, 1, 1, 4, 1}, order_of("tcedp"));
  expect_error([&] { Layout(s, 16, 4); }, kExitInput, "needs 8 ranks but the world has 16");
  expect_error([&] { s.validate(4); }, kExitInput, "needs 8 ranks");
  EXPECT_NO_THROW(s.validate(8));
  GridShape zero = s;
  zero.size[ix(Axis::c)] = 0;
  expect_error([&] { zero.validate(0); }, kExitInput, "axis c has size 0");
  GridShape twice = s;
  twice.order = {Axis::t, Axis::t, Axis::e, Axis::d, Axis::p};
  expect_error([&] { twice.validate(8); }, kExitInput, "not a permutation");
  expect_error([&] { Layout(s, 8, 0); }, kExitInput, "ranks per node");
}

TEST(Layout, FromConfig) {
  Config config;
  config.parallel.tp = 2;
  config.parallel.cp = 1;
  config.parallel.ep = 1;
  config.parallel.dp = 4;
  config.parallel.pp = 3;
  config.parallel.order = {"d", "t", "p", "c", "e"};
  const GridShape s = GridShape::from_config(config);
  EXPECT_EQ(s.size, (Coords{2, 1, 1, 4, 3}));
  EXPECT_EQ(s.order, order_of("dtpce"));
  EXPECT_EQ(s.world(), 24);
  EXPECT_EQ(s.str(), "t2 c1 e1 d4 p3, order d,t,p,c,e");

  Config bad = config;
  bad.parallel.dp = -1;
  expect_error([&] { GridShape::from_config(bad); }, kExitInput, "parallel%dp = -1");
  bad = config;
  bad.parallel.order = {"d", "t", "p", "c"};
  expect_error([&] { GridShape::from_config(bad); }, kExitInput, "parallel%order has 4 entries");
  bad = config;
  bad.parallel.order = {"d", "t", "p", "c", "c"};
  expect_error([&] { GridShape::from_config(bad); }, kExitInput, "not a permutation");
  bad.parallel.order = {"d", "t", "p", "c", "q"};
  expect_error([&] { GridShape::from_config(bad); }, kExitInput, "unknown grid axis 'q'");
}

TEST(Layout, DescribeTable) {
  const Layout small(make_shape({2, 1, 1, 2, 2}, order_of("tcedp")), 8, 4);
  const std::string text = small.describe();
  EXPECT_NE(text.find("grid: 8 ranks = t2 c1 e1 d2 p2, order t,c,e,d,p"), std::string::npos)
      << text;
  EXPECT_NE(text.find("dense-grad"), std::string::npos) << text;
  EXPECT_NE(text.find("rank map"), std::string::npos) << text;
  // rank 7 = t1 d1 p1 on node 1.
  EXPECT_NE(text.find("   7     1   1  0  0  1  1"), std::string::npos) << text;
  const Layout big(make_shape({8, 1, 1, 8, 8}, order_of("tcedp")), 512, 4);
  const std::string big_text = big.describe();
  EXPECT_EQ(big_text.find("rank map"), std::string::npos);
  EXPECT_NE(big_text.find("tp           t                    8      64      2  no"),
            std::string::npos)
      << big_text;
}

// ---- MPI grid
// ------------------------------------------------------------------------------------

TEST(Grid, NamedShapesAndOrders) {
  const int n = world_size();
  std::vector<Coords> named;
  if (n == 8)
    named = {{2, 1, 1, 4, 1}, {2, 1, 1, 2, 2}, {2, 2, 2, 1, 1}, {1, 1, 1, 1, 8}, {1, 1, 1, 8, 1}};
  else
    named = {{n, 1, 1, 1, 1}, {1, 1, 1, n, 1}, {1, 1, 1, 1, n}};
  for (const Coords& size : named)
    for (const char* order : {"tcedp", "dtpce", "pdtec"})
      check_grid(make_shape(size, order_of(order)));
}

TEST(Grid, EveryShapeWithThreeOrders) {
  for (const Coords& size : shapes_of(world_size()))
    for (const char* order : {"tcedp", "dtpce", "pdtec"})
      check_grid(make_shape(size, order_of(order)));
}

TEST(Grid, EveryOrderOfOneShape) {
  const int n = world_size();
  // Spread the world over as many axes as it allows: 8 -> t2 c2 e2 (+ p1 d1), 4 -> t2 p2.
  Coords size = {1, 1, 1, 1, 1};
  if (n == 8)
    size = {2, 2, 1, 1, 2};
  else if (n == 4)
    size = {2, 1, 1, 1, 2};
  else
    size = {1, 1, 1, 1, n};
  for (const auto& order : all_orders()) check_grid(make_shape(size, order));
}

TEST(Grid, NodeMapMatchesProcessorNames) {
  const int n = world_size();
  Grid grid(MPI_COMM_WORLD, make_shape({1, 1, 1, n, 1}, order_of("tcedp")), true);
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  std::vector<char> names(static_cast<std::size_t>(n) * MPI_MAX_PROCESSOR_NAME);
  MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(), MPI_MAX_PROCESSOR_NAME,
                MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> seen;
  for (int r = 0; r < n; ++r) {
    const std::string host(&names[static_cast<std::size_t>(r) * MPI_MAX_PROCESSOR_NAME]);
    auto it = std::find(seen.begin(), seen.end(), host);
    if (it == seen.end()) it = seen.insert(seen.end(), host);
    EXPECT_EQ(grid.node_of(r), int(it - seen.begin())) << "rank " << r << " on " << host;
  }
  EXPECT_EQ(grid.num_nodes(), static_cast<int>(seen.size()));
  int node_size = 0;
  MPI_Comm_size(grid.node_comm(), &node_size);
  int same = 0;
  for (int r = 0; r < n; ++r) same += grid.node_of(r) == grid.node();
  EXPECT_EQ(node_size, same);
}

TEST(Grid, SimulatedNodesWarnOrFailTogether) {
  const int n = world_size();
  if (n < 4) GTEST_SKIP() << "needs at least 4 ranks";
  // 2 ranks per simulated node, tp over 4: every tp group crosses 2 nodes.
  const GridShape s = make_shape({4, 1, 1, n / 4, 1}, order_of("tcedp"));
  {
    Grid grid(MPI_COMM_WORLD, s, false, 2);
    EXPECT_EQ(grid.num_nodes(), n / 2);
    EXPECT_EQ(grid.ranks_per_node(), 2);
    for (int r = 0; r < n; ++r) EXPECT_EQ(grid.node_of(r), r / 2);
    int node_size = 0;
    MPI_Comm_size(grid.node_comm(), &node_size);
    EXPECT_EQ(node_size, 2);
    EXPECT_EQ(grid.layout().reports()[static_cast<int>(GroupKind::tp)].nodes_spanned, 2);
  }
  expect_error([&] { Grid(MPI_COMM_WORLD, s, true, 2); }, kExitInput,
               "tp groups of 4 ranks span 2 nodes");
  // Every rank threw: the world still works.
  int one = 1, sum = 0;
  MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(sum, n);
}

TEST(Grid, WrongWorldSizeIsAnInputError) {
  const int n = world_size();
  expect_error(
      [&] {
        Grid(MPI_COMM_WORLD, make_shape({2, 1, 1, n, 1}, order_of("tcedp")), false);
      },
      kExitInput, cat("needs ", 2 * n, " ranks but the world has ", n));
}

TEST(Grid, CommunicatorsAreFreed) {
  const int before = next_comm_index();
  for (int round = 0; round < 3; ++round)
    for (const Coords& size : shapes_of(world_size())) {
      Grid grid(MPI_COMM_WORLD, make_shape(size, order_of("pdtec")), false);
      Grid moved = std::move(grid);
      EXPECT_NE(moved.comm(GroupKind::tp), MPI_COMM_NULL);
    }
#ifdef OPEN_MPI
  EXPECT_EQ(next_comm_index(), before);
#else
  (void)before;
#endif
  // The handle itself: moving transfers ownership, reset frees, WORLD is never freed.
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  Communicator a(dup);
  Communicator b = std::move(a);
  EXPECT_TRUE(a.is_null());
  EXPECT_EQ(b.get(), dup);
  EXPECT_EQ(b.size(), world_size());
  b = Communicator(MPI_COMM_WORLD);
  { Communicator world(MPI_COMM_WORLD); }
  EXPECT_EQ(b.rank(), world_rank());
  b.reset();
  EXPECT_EQ(b.rank(), -1);
  EXPECT_EQ(b.size(), 0);
#ifdef OPEN_MPI
  EXPECT_EQ(next_comm_index(), before);  // dup was freed by the move-assignment above
#endif
}
