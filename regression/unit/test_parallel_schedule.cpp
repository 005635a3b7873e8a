// ptrain-test: np=1 labels=quick timeout=60
// Pipeline schedules as data: every kind passes the checker over a grid of shapes, the
// simulated bubbles match the textbook formulas, broken lists are refused with the first
// violation named, and the --plan picture shows the staircase.
#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <sstream>
#include <string>

#include "parallel/schedule.hpp"
#include "util/error.hpp"

namespace ptrain::parallel {
// Ops print readably in gtest failures.
void PrintTo(const Op& op, std::ostream* os) {
  *os << "{kind " << int(op.kind) << ", mb " << op.mb << ", chunk " << op.chunk << ", peer "
      << op.peer << "}";
}
}  // namespace ptrain::parallel

using namespace ptrain;
using namespace ptrain::parallel;

namespace {

constexpr ScheduleKind kGpipe = ScheduleKind::gpipe, k1f1b = ScheduleKind::one_f_one_b,
                       kInterleaved = ScheduleKind::interleaved, kZbH1 = ScheduleKind::zb_h1,
                       kZbV = ScheduleKind::zb_v;
using ComputeSeconds = std::vector<std::vector<double>>;

// The activation slots (forward to weight gradient) of each chunk of one rank.
std::vector<int> acts(const std::vector<model::SlotCounts>& counts) {
  std::vector<int> out;
  for (const auto& c : counts) out.push_back(c.acts);
  return out;
}

// "text contains part", printing both when it does not.
testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "'" << text << "' lacks '" << part << "'";
}

double ideal_bubble(int P, int m, int v) { return double(P - 1) / double(v * m + P - 1); }

// A rank's computes as "F0 F1 B0 ..." ("F0.1" with chunks), messages left out.
std::string computes(const OpList& ops, int v) {
  std::string s;
  for (const Op& op : ops) {
    if (op.kind != OpKind::forward && op.kind != OpKind::backward) continue;
    s += cat(s.empty() ? "" : " ", op.kind == OpKind::forward ? "F" : "B", op.mb,
             v > 1 ? cat(".", op.chunk) : "");
  }
  return s;
}

// Index of the first op equal to `op` in `ops` (the test fails when there is none).
std::size_t index_of(const OpList& ops, const Op& op) {
  const auto it = std::find(ops.begin(), ops.end(), op);
  EXPECT_NE(it, ops.end());
  return std::size_t(it - ops.begin());
}

}  // namespace

TEST(Schedule, NamesParseAndUnknownOnesAreInputErrors) {
  EXPECT_EQ(schedule_kind("gpipe"), kGpipe);
  EXPECT_EQ(schedule_kind("1f1b"), k1f1b);
  EXPECT_EQ(schedule_kind("interleaved"), kInterleaved);
  try {
    schedule_kind("1F1B");
    FAIL() << "accepted '1F1B'";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), kExitInput);
    EXPECT_TRUE(contains(e.what(), "'1F1B'"));
  }
}

TEST(Schedule, UnschedulableShapesNameTheirRule) {
  EXPECT_EQ(schedule_error(k1f1b, 4, 8, 1), "");
  EXPECT_TRUE(contains(schedule_error(k1f1b, 4, 8, 2), "one chunk per rank, not v = 2"));
  EXPECT_TRUE(contains(schedule_error(kGpipe, 0, 8, 1), "P = 0"));
  EXPECT_TRUE(contains(schedule_error(kGpipe, 2, 0, 1), "m = 0"));
  EXPECT_TRUE(contains(schedule_error(kInterleaved, 2, 4, 0), "v = 0"));
  EXPECT_TRUE(contains(schedule_error(kInterleaved, 4, 6, 2),
                       "micro-batches (m = 6) must be a multiple of the pipeline ranks (P = 4)"));
  try {
    make_schedule(kInterleaved, 4, 6, 2);
    FAIL() << "made an interleaved schedule with m % P != 0";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), kExitInput);
    EXPECT_EQ(std::string(e.what()), schedule_error(kInterleaved, 4, 6, 2));
  }
}

TEST(Schedule, OneFOneBListsAreTheTextbookOnes) {
  // P = 2, m = 3: rank 0 warms up with one forward; receives sit right after the previous
  // compute and its send.
  const std::vector<OpList> l = make_schedule(k1f1b, 2, 3, 1);
  const OpKind F = OpKind::forward, B = OpKind::backward, sa = OpKind::send_act,
               ra = OpKind::recv_act, sg = OpKind::send_grad, rg = OpKind::recv_grad;
  const OpList rank0 = {{F, 0, 0, -1}, {sa, 0, 0, 1}, {F, 1, 0, -1}, {sa, 1, 0, 1},
                        {rg, 0, 0, 1}, {B, 0, 0, -1}, {F, 2, 0, -1}, {sa, 2, 0, 1},
                        {rg, 1, 0, 1}, {B, 1, 0, -1}, {rg, 2, 0, 1}, {B, 2, 0, -1}};
  const OpList rank1 = {{ra, 0, 0, 0}, {F, 0, 0, -1}, {B, 0, 0, -1}, {sg, 0, 0, 0},
                        {ra, 1, 0, 0}, {F, 1, 0, -1}, {B, 1, 0, -1}, {sg, 1, 0, 0},
                        {ra, 2, 0, 0}, {F, 2, 0, -1}, {B, 2, 0, -1}, {sg, 2, 0, 0}};
  EXPECT_EQ(l[0], rank0);
  EXPECT_EQ(l[1], rank1);
}

TEST(Schedule, InterleavedFollowsMegatronsOrder) {
  // P = 2, m = 4, v = 2, rank 0: warmup (2-0-1)*2 + (2-1)*2 = 4 forwards of micro-batches
  // 0,1 through chunk 0 then chunk 1; backwards visit chunk 1 first.
  const std::vector<OpList> l = make_schedule(kInterleaved, 2, 4, 2);
  EXPECT_EQ(computes(l[0], 2),
            "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0");
  // Rank 1: warmup (v-1)*P = 2.
  EXPECT_EQ(computes(l[1], 2),
            "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0");
}

TEST(Schedule, OnePipelineRankHasNoMessages) {
  for (auto [kind, v] : {std::pair{kGpipe, 1}, {k1f1b, 1}, {kInterleaved, 3}}) {
    const std::vector<OpList> l = make_schedule(kind, 1, 4, v);
    ASSERT_EQ(l.size(), 1u);
    EXPECT_EQ(l[0].size(), std::size_t(2 * 4 * v));
    EXPECT_EQ(check_schedule(l, {1, 4, v}).error, "");
  }
}

TEST(Schedule, GpipeAndOneFOneBPassWithTheirActivationCounts) {
  for (int P = 1; P <= 8; ++P)
    for (int m = 1; m <= 16; ++m) {
      const ScheduleCheck g =
          check_schedule(make_schedule(kGpipe, P, m, 1), {P, m, 1}, memory_bound(kGpipe, P, m, 1));
      const ScheduleCheck o =
          check_schedule(make_schedule(k1f1b, P, m, 1), {P, m, 1}, memory_bound(k1f1b, P, m, 1));
      ASSERT_EQ(g.error, "") << "gpipe P=" << P << " m=" << m;
      ASSERT_EQ(o.error, "") << "1f1b P=" << P << " m=" << m;
      ASSERT_EQ(g.in_flight.size(), std::size_t(P));
      for (int r = 0; r < P; ++r) {
        EXPECT_EQ(acts(g.in_flight[r]), std::vector<int>{m}) << "gpipe P=" << P << " m=" << m;
        EXPECT_EQ(acts(o.in_flight[r]), std::vector<int>{std::min(P - r, m)})
            << "1f1b P=" << P << " m=" << m << " rank " << r;
      }
    }
}

TEST(Schedule, InterleavedPasses) {
  for (int P = 1; P <= 8; ++P)
    for (int v = 2; v <= 4; ++v)
      for (int m = P; m <= 16; m += P) {
        const ScheduleCheck c = check_schedule(make_schedule(kInterleaved, P, m, v), {P, m, v},
                                               memory_bound(kInterleaved, P, m, v));
        ASSERT_EQ(c.error, "") << "P=" << P << " m=" << m << " v=" << v;
        ASSERT_EQ(c.in_flight.size(), std::size_t(P));
        for (int r = 0; r < P; ++r) {
          ASSERT_EQ(c.in_flight[r].size(), std::size_t(v));
          // Never more than the warmup plus the one forward of the steady state.
          int slots = 0;
          for (int n : acts(c.in_flight[r])) slots += n;
          EXPECT_LE(slots, std::min((P - r - 1) * 2 + (v - 1) * P + 1, m * v) * v);
          for (int n : acts(c.in_flight[r])) EXPECT_GE(n, 1);
        }
      }
}

// The planner builds one rank's list at a time (4,000 stages): the same list, the same counts.
TEST(Schedule, OneRanksListIsItsListInTheWholeSet) {
  for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, kInterleaved})
    for (int P : {1, 2, 3, 5})
      for (int v : {1, 3}) {
        if (kind != kInterleaved && v > 1) continue;
        const int m = 2 * P;
        const auto lists = make_schedule(kind, P, m, v);
        const ScheduleCheck c = check_schedule(lists, {P, m, v});
        for (int r = 0; r < P; ++r) {
          const OpList one = make_rank_schedule(kind, P, m, v, r);
          EXPECT_TRUE(one == lists[std::size_t(r)]) << "P=" << P << " v=" << v << " rank " << r;
          EXPECT_EQ(acts(list_in_flight(one, v)), acts(c.in_flight[std::size_t(r)]));
        }
      }
  EXPECT_THROW(make_rank_schedule(ScheduleKind::gpipe, 2, 4, 1, 2), Error);
}

TEST(Schedule, GpipeAndOneFOneBBubbleIsExactlyTheFormula) {
  // Messages free, every rank computes m forwards and m backwards, so a rank's idle time
  // is the makespan minus m*(tf+tb); both schedules finish in (m+P-1)*(tf+tb), i.e. the
  // bubble is (P-1)/(m+P-1) on every rank.
  for (int P = 1; P <= 8; ++P)
    for (int m = 1; m <= 16; ++m)
      for (ScheduleKind kind : {kGpipe, k1f1b}) {
        const ScheduleTiming t = simulate_schedule(make_schedule(kind, P, m, 1), {P, m, 1});
        EXPECT_DOUBLE_EQ(t.makespan, 3.0 * (m + P - 1));
        EXPECT_NEAR(t.bubble, ideal_bubble(P, m, 1), 1e-12) << "P=" << P << " m=" << m;
        ASSERT_EQ(t.idle_fraction.size(), std::size_t(P));
        for (double f : t.idle_fraction) EXPECT_NEAR(f, t.bubble, 1e-12);
      }
}

TEST(Schedule, InterleavedBubbleIsSmallerAndMatchesTheFormula) {
  // (P-1)/(v*m+P-1) is the idealised bubble: the fill and drain cost (P-1) chunk forwards
  // and backwards. With free messages our interleaved lists reach it: the makespan is
  // (v*m+P-1)*(tf+tb). The tolerance, 1e-9, is floating-point rounding only, so a schedule
  // change that adds idle time shows here.
  for (int P = 2; P <= 8; ++P)
    for (int v = 2; v <= 4; ++v)
      for (int m = P; m <= 16; m += P) {
        const ScheduleTiming t = simulate_schedule(make_schedule(kInterleaved, P, m, v), {P, m, v});
        const ScheduleTiming base = simulate_schedule(make_schedule(k1f1b, P, m, 1), {P, m, 1});
        EXPECT_LT(t.bubble, base.bubble) << "P=" << P << " m=" << m << " v=" << v;
        EXPECT_NEAR(t.bubble, ideal_bubble(P, m, v), 1e-9) << "P=" << P << " m=" << m << " v=" << v;
      }
}

TEST(Schedule, UnequalStagesAndWaitsBeforeTheLastOp) {
  // GPipe, P = 2, m = 4, tb = 2 tf. Rank 1's forwards take 1.5: rank 0 waits for the first
  // gradient from t = 4 (its forwards) until rank 1 has done its forwards (from 1 to 7) and
  // B0 (7 to 9), so 5; rank 1 waits 1 at the start, and its idle tail after its last op (while
  // rank 0 does B3) is not a wait for a message.
  const auto lists = make_schedule(kGpipe, 2, 4, 1);
  const ScheduleTiming t =
      simulate_schedule(lists, {2, 4, 1}, std::vector<OpTimes>{{1.0, 2.0}, {1.5, 2.0}});
  ASSERT_EQ(t.waiting.size(), 2u);
  EXPECT_DOUBLE_EQ(t.waiting[0], 5.0);
  EXPECT_DOUBLE_EQ(t.waiting[1], 1.0);
  EXPECT_DOUBLE_EQ(t.makespan, 4.0 + 5.0 + 4 * 2.0);  // rank 0: forwards, wait, backwards
  // With equal stages rank 0's waits are the whole bubble, (P-1)*(tf+tb).
  const ScheduleTiming even = simulate_schedule(lists, {2, 4, 1});
  EXPECT_DOUBLE_EQ(even.waiting[0], 3.0);
  EXPECT_DOUBLE_EQ(even.waiting[1], 1.0);
}

TEST(Schedule, EveryComputeItsOwnTime) {
  // 1F1B, P = 2, m = 4, tf = 1, tb = 2. Each rank's list: rank 0 F0 F1 B0 F2 B1 F3 B2 B3,
  // rank 1 F0 B0 F1 B1 F2 B2 F3 B3. With every op at its rank's time the replay is the one
  // of per-rank times: rank 0 waits 2 before B0 and 1 before B3, (P-1)*(tf+tb) in all.
  const auto lists = make_schedule(k1f1b, 2, 4, 1);
  const std::vector<double> rank0 = {1, 1, 2, 1, 2, 1, 2, 2}, rank1 = {1, 2, 1, 2, 1, 2, 1, 2};
  const ScheduleTiming same = simulate_schedule(lists, {2, 4, 1}, ComputeSeconds{rank0, rank1});
  const ScheduleTiming even = simulate_schedule(lists, {2, 4, 1});
  EXPECT_DOUBLE_EQ(same.makespan, even.makespan);
  EXPECT_DOUBLE_EQ(same.waiting[0], 3.0);
  EXPECT_DOUBLE_EQ(same.waiting[1], 1.0);
  // Rank 1's B1 (its fourth compute) takes 5: rank 0's B1 starts at 10, not 7, and the
  // steady state after it shifts by 3 (B2 at 13 finds its gradient there; B3 waits 1).
  std::vector<double> slow = rank1;
  slow[3] = 5;
  const ScheduleTiming t = simulate_schedule(lists, {2, 4, 1}, ComputeSeconds{rank0, slow});
  EXPECT_DOUBLE_EQ(t.waiting[0], 2.0 + 3.0 + 1.0);
  EXPECT_DOUBLE_EQ(t.waiting[1], 1.0);
  EXPECT_DOUBLE_EQ(t.makespan, 18.0);
  EXPECT_DOUBLE_EQ(t.idle_fraction[0], (18.0 - 12.0) / 18.0);
  // One time per compute of every rank's list, none negative.
  EXPECT_THROW(simulate_schedule(lists, {2, 4, 1}, ComputeSeconds{rank0, {1, 2}}), Error);
  EXPECT_THROW(simulate_schedule(lists, {2, 4, 1}, ComputeSeconds{rank0}), Error);
  slow[0] = -1;
  EXPECT_THROW(simulate_schedule(lists, {2, 4, 1}, ComputeSeconds{rank0, slow}), Error);
}

TEST(Schedule, SwappingTwoNonBlockingOpsIsAllowed) {
  // Sends and receives never block, so their order among themselves is free: rank 1's
  // send_act of mb 0 after the recv_act of mb 1 is still a valid list.
  std::vector<OpList> l = make_schedule(kGpipe, 3, 2, 1);
  const std::size_t send = index_of(l[1], {OpKind::send_act, 0, 0, 2});
  ASSERT_EQ(l[1][send + 1], (Op{OpKind::recv_act, 1, 0, 0}));
  std::swap(l[1][send], l[1][send + 1]);
  EXPECT_EQ(check_schedule(l, {3, 2, 1}).error, "");
}

TEST(Schedule, SendBeforeItsComputeIsRefused) {
  // (a) rank 1's recv_act and send_act of mb 0 exchanged: the send now precedes its forward.
  std::vector<OpList> l = make_schedule(kGpipe, 3, 2, 1);
  ASSERT_EQ(l[1][0], (Op{OpKind::recv_act, 0, 0, 0}));
  ASSERT_EQ(l[1][2], (Op{OpKind::send_act, 0, 0, 2}));
  std::swap(l[1][0], l[1][2]);
  EXPECT_EQ(check_schedule(l, {3, 2, 1}).error,
            "rank 1: send_act mb 0 chunk 0 to rank 2 before its forward (op 1)");
}

TEST(Schedule, ReceiveTurnedIntoASendIsRefused) {
  // (a) rank 1's recv_act of mb 0 (from rank 0) made a send_act to rank 0: activations go
  // to the next stage, on rank 2.
  std::vector<OpList> l = make_schedule(kGpipe, 3, 2, 1);
  l[1][0].kind = OpKind::send_act;
  EXPECT_EQ(check_schedule(l, {3, 2, 1}).error,
            "rank 1: op 0: send_act mb 0 chunk 0 to rank 0: global chunk 2 is on rank 2");
  // The last stage sends no activation at all.
  l = make_schedule(kGpipe, 2, 2, 1);
  l[1][0].kind = OpKind::send_act;
  EXPECT_EQ(check_schedule(l, {2, 2, 1}).error,
            "rank 1: op 0: send_act mb 0 chunk 0 to rank 0: global chunk 1 has no next stage");
}

TEST(Schedule, MissingReceiveIsRefused) {
  // (b) rank 0 drops its recv_grad of mb 2: rank 1's send_grad has nothing to match.
  std::vector<OpList> l = make_schedule(k1f1b, 2, 4, 1);
  l[0].erase(l[0].begin() + std::ptrdiff_t(index_of(l[0], {OpKind::recv_grad, 2, 0, 1})));
  EXPECT_EQ(check_schedule(l, {2, 4, 1}).error,
            "rank 1: send_grad mb 2 chunk 0 to rank 0 has no matching recv (recv_grad mb 2 "
            "chunk 0 from rank 1 on rank 0)");
  // Without the send either, the backward is the one left without its message.
  l[1].erase(l[1].begin() + std::ptrdiff_t(index_of(l[1], {OpKind::send_grad, 2, 0, 0})));
  EXPECT_EQ(check_schedule(l, {2, 4, 1}).error, "rank 0: backward mb 2 chunk 0 has no recv_grad");
}

TEST(Schedule, CrossedOrdersDeadlock) {
  // (c) rank 0 runs B0 before F1; rank 1 runs F1 before B0. Rank 0 waits for the grad of
  // mb 0, which rank 1 sends after B0, which it runs after F1, whose activation rank 0
  // sends only after its B0.
  const OpKind F = OpKind::forward, B = OpKind::backward, sa = OpKind::send_act,
               ra = OpKind::recv_act, sg = OpKind::send_grad, rg = OpKind::recv_grad;
  const std::vector<OpList> l = {{{F, 0, 0, -1},
                                  {sa, 0, 0, 1},
                                  {rg, 0, 0, 1},
                                  {rg, 1, 0, 1},
                                  {B, 0, 0, -1},
                                  {F, 1, 0, -1},
                                  {sa, 1, 0, 1},
                                  {B, 1, 0, -1}},
                                 {{ra, 0, 0, 0},
                                  {ra, 1, 0, 0},
                                  {F, 0, 0, -1},
                                  {F, 1, 0, -1},
                                  {B, 0, 0, -1},
                                  {sg, 0, 0, 0},
                                  {B, 1, 0, -1},
                                  {sg, 1, 0, 0}}};
  EXPECT_EQ(check_schedule(l, {2, 2, 1}).error,
            "deadlock: rank 0 waits at op 4 (backward mb 0 chunk 0) for rank 1, rank 1 waits "
            "at op 3 (forward mb 1 chunk 0) for rank 0");
  EXPECT_THROW(simulate_schedule(l, {2, 2, 1}), Error);
}

TEST(Schedule, ForwardBeforeItsReceiveIsPostedIsRefused) {
  // (d) rank 1 posts the recv_act of mb 1 after the forward that needs it.
  std::vector<OpList> l = make_schedule(k1f1b, 2, 4, 1);
  const std::size_t recv = index_of(l[1], {OpKind::recv_act, 1, 0, 0});
  ASSERT_EQ(l[1][recv + 1], (Op{OpKind::forward, 1, 0, -1}));
  std::swap(l[1][recv], l[1][recv + 1]);
  EXPECT_EQ(check_schedule(l, {2, 4, 1}).error,
            cat("rank 1: forward mb 1 chunk 0 before its recv_act is posted (op ", recv + 1, ")"));
}

TEST(Schedule, OneRankChunksRunInOrder) {
  // P = 1, v = 2: chunk 1's forward consumes chunk 0's on the same rank.
  std::vector<OpList> l = make_schedule(kInterleaved, 1, 2, 2);
  ASSERT_EQ(l[0][0], (Op{OpKind::forward, 0, 0, -1}));
  ASSERT_EQ(l[0][1], (Op{OpKind::forward, 0, 1, -1}));
  std::swap(l[0][0], l[0][1]);
  EXPECT_EQ(check_schedule(l, {1, 2, 2}).error,
            "rank 0: forward mb 0 chunk 1 before forward mb 0 chunk 0 (op 1), whose output it "
            "consumes");
}

TEST(Schedule, MissingComputesAndRepeatsAreRefused) {
  std::vector<OpList> l = make_schedule(kGpipe, 1, 3, 1);
  l[0].pop_back();  // backward mb 2
  EXPECT_EQ(check_schedule(l, {1, 3, 1}).error, "rank 0: backward mb 2 chunk 0 is missing");
  l[0].push_back({OpKind::backward, 1, 0, -1});
  EXPECT_EQ(check_schedule(l, {1, 3, 1}).error,
            "rank 0: op 5 (backward mb 1 chunk 0) repeats op 4");
  EXPECT_EQ(check_schedule(l, {2, 3, 1}).error,
            "expected one list per pipeline rank (P = 2), got 1");
}

TEST(Schedule, FormatShowsTheStaircase) {
  const std::vector<OpList> l = make_schedule(kGpipe, 4, 8, 1);
  const std::string text = format_schedule(l, {4, 8, 1});
  std::vector<std::string> rows;
  for (std::size_t at = 0, end; (end = text.find('\n', at)) != std::string::npos; at = end + 1)
    rows.push_back(text.substr(at, end - at));
  ASSERT_EQ(rows.size(), 4u) << text;
  EXPECT_EQ(rows[0].rfind("rank 0 | F0 F1 F2 F3 F4 F5 F6 F7 .. ", 0), 0u) << text;
  EXPECT_EQ(rows[3].rfind("rank 3 | .. .. .. F0 F1", 0), 0u) << text;
  // Every row spans the makespan, (m+P-1)*3 = 33 cells; a backward fills two of them.
  for (const std::string& row : rows) {
    std::istringstream cells(row.substr(row.find('|') + 1));
    int n = 0;
    for (std::string cell; cells >> cell;) ++n;
    EXPECT_EQ(n, 33) << row;
  }
  EXPECT_TRUE(contains(rows[3], "F7 B0 B0 B1 B1"));
  const std::string with_ops = format_schedule(l, {4, 8, 1}, true);
  EXPECT_TRUE(contains(with_ops, "rank 1 ops: ra0<0 F0 sa0>2 ra1<0 F1"));
  EXPECT_TRUE(contains(format_schedule(make_schedule(kInterleaved, 2, 2, 2), {2, 2, 2}),
                       "rank 0 | F0.0 F1.0 F0.1"));
}

// ---- zero-bubble schedules: the backward split into B (input gradient) and W (weight) ----

namespace {
// A rank's computes with B and W apart: "F0 B0 Bi1 W0 ..." (Bi: a split backward's B).
std::string zb_computes(const OpList& ops, int v) {
  std::string s;
  for (const Op& op : ops) {
    const char* k = op.kind == OpKind::forward           ? "F"
                    : op.kind == OpKind::backward        ? "B"
                    : op.kind == OpKind::backward_input  ? "Bi"
                    : op.kind == OpKind::backward_weight ? "W"
                                                         : nullptr;
    if (k) s += cat(s.empty() ? "" : " ", k, op.mb, v > 1 ? cat(".", op.chunk) : "");
  }
  return s;
}
}  // namespace

TEST(ZeroBubble, NamesAndShapes) {
  EXPECT_EQ(schedule_kind("zb-h1"), kZbH1);
  EXPECT_EQ(schedule_kind("zb-v"), kZbV);
  EXPECT_TRUE(v_shaped(kZbV));
  EXPECT_FALSE(v_shaped(kZbH1) || v_shaped(kInterleaved));
  EXPECT_TRUE(contains(schedule_error(kZbV, 4, 8, 1), "two chunks per rank in a V, not v = 1"));
  EXPECT_TRUE(contains(schedule_error(kZbH1, 4, 8, 2), "one chunk per rank, not v = 2"));
  EXPECT_EQ(schedule_error(kZbV, 4, 6, 2), "");  // no multiple of P needed
  // The V: rank r holds global chunks r and 2P-1-r; rank 0 both ends.
  EXPECT_EQ(model::global_chunk(4, true, 0, 1), 7);
  EXPECT_EQ(model::global_chunk(4, true, 3, 1), 4);
  EXPECT_EQ(model::chunk_place(4, true, 5).rank, 2);
  EXPECT_EQ(model::chunk_place(4, true, 5).chunk, 1);
}

TEST(ZeroBubble, H1ListsAndTheirMemory) {
  // P = 3, m = 4: rank 0 is 1F1B's first rank itself (each B directly followed by its W, on
  // the first chunk: one backward); rank r delays its Ws by r micro-batches.
  const auto l = make_schedule(kZbH1, 3, 4, 1);
  EXPECT_EQ(l[0], make_schedule(k1f1b, 3, 4, 1)[0]);
  EXPECT_EQ(zb_computes(l[1], 1), "F0 F1 Bi0 F2 Bi1 W0 F3 Bi2 W1 Bi3 W2 W3");
  EXPECT_EQ(zb_computes(l[2], 1), "F0 Bi0 F1 Bi1 F2 Bi2 W0 F3 Bi3 W1 W2 W3");
  // A W posts no message and delays none: the next forward's receive comes before it.
  EXPECT_LT(index_of(l[1], {OpKind::recv_act, 3, 0, 0}),
            index_of(l[1], {OpKind::backward_weight, 1, 0, -1}));
  for (int P = 1; P <= 8; ++P)
    for (int m = 1; m <= 16; ++m) {
      const auto lists = make_schedule(kZbH1, P, m, 1);
      const ScheduleCheck c = check_schedule(lists, {P, m, 1}, memory_bound(kZbH1, P, m, 1));
      ASSERT_EQ(c.error, "") << "P=" << P << " m=" << m;
      for (int r = 0; r < P; ++r) {
        // Every rank holds min(P, m) micro-batches, as 1F1B's first: 1F1B's peak memory.
        EXPECT_EQ(c.in_flight[r][0].acts, std::min(P, m)) << "P=" << P << " m=" << m << " r=" << r;
        EXPECT_EQ(c.in_flight[r][0].head, std::min(P - r, m));  // 1F1B's forward-to-B count
        // W records: B to W, r + 1 at most (none on rank 0: whole backwards).
        EXPECT_LE(c.in_flight[r][0].weight, r == 0 ? 0 : r + 1);
        if (m >= P) {
          EXPECT_EQ(c.in_flight[r][0].weight, r == 0 ? 0 : r + 1);
        }
        EXPECT_TRUE(make_rank_schedule(kZbH1, P, m, 1, r) == lists[std::size_t(r)]);
      }
    }
}

TEST(ZeroBubble, H1BubbleIsAThirdOfOneFOneBs) {
  // T_F = T_B = T_W = 1: (P-1)(T_F + T_B - T_W) idle per rank against 3m of work (Qi et al.
  // 2023, section 2.1), where 1F1B idles (P-1)(T_F + T_B + T_W).
  for (int P = 2; P <= 8; ++P)
    for (int m = P; m <= 16; ++m) {
      const ScheduleTiming zb = simulate_schedule(make_schedule(kZbH1, P, m, 1), {P, m, 1});
      const ScheduleTiming base = simulate_schedule(make_schedule(k1f1b, P, m, 1), {P, m, 1});
      EXPECT_DOUBLE_EQ(zb.makespan, 3.0 * m + (P - 1)) << "P=" << P << " m=" << m;
      EXPECT_NEAR(zb.bubble, double(P - 1) / (3.0 * m + P - 1), 1e-12);
      EXPECT_DOUBLE_EQ(base.makespan - 3.0 * m, 3 * (zb.makespan - 3.0 * m));
    }
}

TEST(ZeroBubble, VListsPassWithinOneFOneBsMemory) {
  for (int P = 1; P <= 8; ++P)
    for (int m = 1; m <= 16; ++m) {
      const auto lists = make_schedule(kZbV, P, m, 2);
      const Pipeline pipe = pipeline_of(kZbV, P, m, 2);
      ASSERT_TRUE(pipe.v_shape);
      const ScheduleCheck c = check_schedule(lists, pipe, memory_bound(kZbV, P, m, 2));
      ASSERT_EQ(c.error, "") << "P=" << P << " m=" << m;
      for (int r = 0; r < P; ++r)
        EXPECT_TRUE(make_rank_schedule(kZbV, P, m, 2, r) == lists[std::size_t(r)]);
      if (m < 2 * P) continue;
      // Only the forwards' ramp idles: P-1 chunk forwards against 6m chunk ops.
      const ScheduleTiming t = simulate_schedule(lists, pipe);
      EXPECT_DOUBLE_EQ(t.makespan, 6.0 * m + (P - 1)) << "P=" << P << " m=" << m;
    }
  // P = 4, m = 8: rank 0 runs the V's both ends; its chunk 0 (the first) has whole
  // backwards, its chunk 1 (the head) one W record; 8 + 1 chunk slots.
  const ScheduleCheck c = check_schedule(make_schedule(kZbV, 4, 8, 2), pipeline_of(kZbV, 4, 8, 2));
  EXPECT_EQ(c.in_flight[0][0].acts, 8);
  EXPECT_EQ(c.in_flight[0][0].weight, 0);
  EXPECT_EQ(c.in_flight[0][1].acts, 1);
  EXPECT_EQ(c.in_flight[0][1].weight, 1);
  // The turn at the last rank is a message to itself.
  const auto l = make_schedule(kZbV, 2, 4, 2);
  EXPECT_LT(index_of(l[1], {OpKind::send_act, 0, 0, 1}),
            index_of(l[1], {OpKind::forward, 0, 1, -1}));
  EXPECT_TRUE(contains(format_schedule(l, pipeline_of(kZbV, 2, 4, 2)), "W0.1"));
}

TEST(ZeroBubble, WeightBeforeItsInputGradientIsRefused) {
  std::vector<OpList> l = make_schedule(kZbH1, 2, 4, 1);
  const std::size_t b = index_of(l[1], {OpKind::backward_input, 0, 0, -1}),
                    w = index_of(l[1], {OpKind::backward_weight, 0, 0, -1});
  std::swap(l[1][b], l[1][w]);
  EXPECT_EQ(check_schedule(l, {2, 4, 1}).error,
            cat("rank 1: backward_weight mb 0 chunk 0 before its backward_input (op ", w, ")"));
  // Without its B at all (the send_grad of mb 0 then has none to follow either).
  l = make_schedule(kZbH1, 2, 4, 1);
  l[1].erase(l[1].begin() + std::ptrdiff_t(b));
  EXPECT_EQ(check_schedule(l, {2, 4, 1}).error,
            "rank 1: backward_weight mb 0 chunk 0 has no backward_input");
  // Twice, or next to a whole backward of the same micro-batch.
  l = make_schedule(kZbH1, 2, 4, 1);
  l[1].push_back({OpKind::backward_weight, 3, 0, -1});
  EXPECT_TRUE(
      contains(check_schedule(l, {2, 4, 1}).error, "(backward_weight mb 3 chunk 0) repeats"));
  l = make_schedule(kZbH1, 2, 4, 1);
  l[0].push_back({OpKind::backward_weight, 3, 0, -1});
  EXPECT_EQ(check_schedule(l, {2, 4, 1}).error,
            "rank 0: backward mb 3 chunk 0 is also split into a backward_input and a "
            "backward_weight");
}

TEST(ZeroBubble, WeightsOutOfMicroBatchOrderAreRefused) {
  // The gradients must add up in one order whatever the schedule: mb 0, 1, ... per chunk.
  std::vector<OpList> l = make_schedule(kZbH1, 2, 4, 1);
  const std::size_t w0 = index_of(l[1], {OpKind::backward_weight, 0, 0, -1}),
                    w1 = index_of(l[1], {OpKind::backward_weight, 1, 0, -1});
  std::swap(l[1][w0], l[1][w1]);
  EXPECT_EQ(check_schedule(l, {2, 4, 1}).error,
            "rank 1: backward_weight mb 0 chunk 0: chunk 0's weight gradients leave micro-batch "
            "order (mb 1 came first), so its gradients would add up in another order");
}

TEST(ZeroBubble, ScheduleOverItsMemoryIsRefused) {
  // Rank 1's Ws all moved to the end of its list: still complete, ordered and deadlock-free,
  // but it holds all m micro-batches, over zb-h1's bound of min(P, m).
  const int P = 2, m = 4;
  std::vector<OpList> l = make_schedule(kZbH1, P, m, 1);
  OpList moved;
  for (const Op& op : l[1])
    if (op.kind != OpKind::backward_weight) moved.push_back(op);
  for (int mb = 0; mb < m; ++mb) moved.push_back({OpKind::backward_weight, mb, 0, -1});
  l[1] = moved;
  EXPECT_EQ(check_schedule(l, {P, m, 1}).error, "");  // no bound: a valid list
  EXPECT_EQ(check_schedule(l, {P, m, 1}, memory_bound(kZbH1, P, m, 1)).error,
            cat("rank 1 holds 3 micro-batches' activations at op ",
                index_of(l[1], {OpKind::forward, 2, 0, -1}),
                " (forward mb 2 chunk 0), over the schedule's bound of 2"));
  // Every other kind's lists keep within their bounds.
  for (ScheduleKind kind : {kGpipe, k1f1b, kInterleaved})
    for (int P2 : {2, 4})
      for (int v : {1, 2}) {
        if ((kind == kInterleaved) != (v == 2)) continue;
        const int m2 = 2 * P2;
        EXPECT_EQ(check_schedule(make_schedule(kind, P2, m2, v), {P2, m2, v},
                                 memory_bound(kind, P2, m2, v))
                      .error,
                  "");
      }
}

TEST(ZeroBubble, FormatDrawsWeightBoxes) {
  const std::string text = format_schedule(make_schedule(kZbH1, 2, 4, 1), {2, 4, 1}, true);
  // Rank 0: whole backwards (two cells); rank 1: B in one cell, its W later in one.
  EXPECT_TRUE(contains(text, "rank 0 | F0 F1 .. B0 B0")) << text;
  EXPECT_TRUE(contains(text, "rank 1 | .. F0 B0 F1 B1 W0")) << text;
  // The receive of the forward after a W is posted before the W.
  EXPECT_TRUE(contains(text, "rank 1 ops: ra0<0 F0 Bi0 sg0>0 ra1<0 F1 Bi1 sg1>0 ra2<0 W0 F2"))
      << text;
}
