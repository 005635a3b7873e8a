// parallel/schedule.hpp — pipeline schedules as pure data: every pipeline rank's ordered list
// of operations for one step, a checker that replays the lists as the executor
// (parallel/pipeline.hpp) would run them, a timing simulator and a text picture for --plan.
//
// Conventions.
//  * P pipeline ranks, m micro-batches, v chunks (virtual stages) per rank. Local chunk c of
//    rank r is global chunk g = c * P + r (Megatron interleaving): g = 0 holds the embedding,
//    g = v*P - 1 the head. forward(mb, g) consumes forward(mb, g-1)'s output, sent by rank
//    (g-1) mod P; backward(mb, g) consumes backward(mb, g+1)'s input-gradient.
//  * Sends and receives are non-blocking: they never wait. A send comes after the compute
//    that produces its data; a compute that consumes a message waits for it, and needs its
//    receive posted earlier in the same list. Only computes block, so a set of lists is
//    deadlock-free when its computes, ordered by the lists and by the data, form no cycle.
//  * P == 1 has no messages: a chunk's input is the previous chunk's output on the same rank.
//  * Every schedule runs each chunk's backwards in micro-batch order 0..m-1, so gradients
//    accumulate in the same order, and sum to the same bits, whichever schedule runs.
//  * Op indices in messages ("waits at op 7") count from 0 in that rank's list.
#pragma once
#include <string>
#include <vector>

namespace ptrain::parallel {

enum class ScheduleKind { gpipe, one_f_one_b, interleaved };
// 'gpipe' | '1f1b' | 'interleaved'; throws ptrain::Error (code kExitInput) otherwise.
ScheduleKind schedule_kind(const std::string& name);

enum class OpKind { recv_act, forward, send_act, recv_grad, backward, send_grad };
struct Op {
  OpKind kind;
  int mb = 0;     // micro-batch 0..m-1
  int chunk = 0;  // local chunk (virtual stage) on this rank, 0..v-1
  int peer = -1;  // pipeline rank sent to / received from (send/recv ops only)
  bool operator==(const Op& o) const {
    return kind == o.kind && mb == o.mb && chunk == o.chunk && peer == o.peer;
  }
  bool operator!=(const Op& o) const { return !(*this == o); }
};
using OpList = std::vector<Op>;  // one rank's ordered operations for one step

// Every rank's list for P pipeline ranks, m micro-batches, v chunks per rank.
// gpipe: all forwards, then all backwards. 1f1b: PipeDream-flush (Megatron's
// non-interleaved schedule). interleaved: Megatron's interleaved 1F1B (Narayanan et al.
// 2021). Requires P >= 1, m >= 1, v >= 1; gpipe and 1f1b need v == 1; interleaved needs
// m % P == 0. Throws ptrain::Error(kExitInput) naming the rule otherwise.
std::vector<OpList> make_schedule(ScheduleKind kind, int P, int m, int v);
// Rank `rank`'s list of make_schedule(kind, P, m, v) alone (each list depends only on its rank):
// what a planner of thousands of stages needs one rank at a time.
OpList make_rank_schedule(ScheduleKind kind, int P, int m, int v, int rank);
// The most micro-batches whose forward is done and backward not yet done at any point of one
// rank's list, per local chunk (ScheduleCheck::in_flight of that rank).
std::vector<int> list_in_flight(const OpList& list, int v);
// The message "" or why (kind, P, m, v) is not schedulable (the rules make_schedule enforces).
std::string schedule_error(ScheduleKind kind, int P, int m, int v);

// What a checked set of lists does.
struct ScheduleCheck {
  std::string error;  // "" when the lists are complete, matched and deadlock-free
  // in_flight[rank][chunk]: the most micro-batches whose forward is done and backward not
  // yet done at any point of that rank's list (= activation slots the executor needs).
  std::vector<std::vector<int>> in_flight;
};
// Checks, in this order, and reports the first violation found: the ops' fields (range,
// peer, no messages on one rank, no op twice), completeness (every forward and backward
// once), matching (every send has its receive and vice versa), each list's order (sends
// after their compute, computes after their receive is posted) and a replay for deadlock.
ScheduleCheck check_schedule(const std::vector<OpList>& lists, int P, int m, int v);

// Simulated timeline with forward taking t_forward and backward t_backward time units and
// messages free. A rank's idle time is the makespan minus its compute time (waits before
// its first op, between ops and after its last op until the step ends); idle_fraction[r] is
// that over the makespan and bubble is the largest. Throws ptrain::Error when the lists do
// not pass check_schedule.
struct ScheduleTiming {
  double makespan = 0;
  std::vector<double> idle_fraction;
  double bubble = 0;
  // Per rank, the time it waits for messages before its own last op ends (idle time less
  // the tail after it): what a rank measures as waits on the pipeline group.
  std::vector<double> waiting;
};
ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, int P, int m, int v,
                                 double t_forward = 1, double t_backward = 2);
// The same with each rank's own times (t_forward[r], t_backward[r]): real stages are never
// quite equal.
ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, int P, int m, int v,
                                 const std::vector<double>& t_forward,
                                 const std::vector<double>& t_backward);
// The same with every compute's own time: compute_seconds[r][k] for the k-th forward or
// backward along rank r's list (2*m*v of them). The run log compares its measured bubble
// with this one at the step's measured times, so that uneven ops (noise, a slow first
// micro-batch) are in the model and what is left is the executor's own waiting.
ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, int P, int m, int v,
                                 const std::vector<std::vector<double>>& compute_seconds);

// Text picture for `ptrain --plan`: one row per rank in simulated time (forward 1 cell,
// backward 2), e.g. "rank 0 | F0 F1 F2 F3 .. .. B0 B0 ..": forward "F<mb>", backward
// "B<mb>" in both its cells, idle "..", the chunk appended for v > 1 ("F3.1"). With `ops`,
// each rank's list follows, one token per op: F3 B3, sa3>2 (send_act of mb 3 to rank 2),
// ra3<0 (recv_act from rank 0), sg/rg likewise for gradients. Throws as simulate_schedule.
std::string format_schedule(const std::vector<OpList>& lists, int P, int m, int v,
                            bool ops = false);

}  // namespace ptrain::parallel
