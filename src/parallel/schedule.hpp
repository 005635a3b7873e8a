// parallel/schedule.hpp — pipeline schedules as pure data: every pipeline rank's ordered list
// of operations for one step, a checker that replays the lists as the executor
// (parallel/pipeline.hpp) would run them, a timing simulator and a text picture for --plan.
//
// Conventions.
//  * P pipeline ranks, m micro-batches, v chunks (virtual stages) per rank. Global chunk g
//    (model order: g = 0 holds the embedding, g = v*P - 1 the head) is local chunk c of rank
//    r as model::global_chunk places it: interleaved (Megatron) g = c * P + r, or V-shaped
//    (zb-v, v = 2) g = r and 2P-1-r, so rank 0 holds both ends. forward(mb, g) consumes
//    forward(mb, g-1)'s output; the backward of (mb, g) consumes that of (mb, g+1)'s
//    input-gradient. Where g-1 is on the same rank (P > 1) the message is sent to itself.
//  * A backward is one op (backward: the input and the weight gradients at once) or two
//    (zero-bubble schedules): backward_input (B, what the previous stage waits for) and,
//    later in the same list, backward_weight (W, which nobody waits for). A micro-batch keeps
//    its activations from its forward until its weight gradient.
//  * Sends and receives are non-blocking: they never wait. A send comes after the compute
//    that produces its data; a compute that consumes a message waits for it, and needs its
//    receive posted earlier in the same list. Only computes block, so a set of lists is
//    deadlock-free when its computes, ordered by the lists and by the data, form no cycle.
//  * P == 1 has no messages: a chunk's input is the previous chunk's output on the same rank.
//  * Every schedule runs each chunk's input gradients and its weight gradients in
//    micro-batch order 0..m-1 (the checker enforces it), so gradients accumulate in the same
//    order, and sum to the same bits, whichever schedule runs.
//  * Op indices in messages ("waits at op 7") count from 0 in that rank's list.
#pragma once
#include <string>
#include <vector>

#include "model/layout.hpp"

namespace ptrain::parallel {

enum class ScheduleKind { gpipe, one_f_one_b, interleaved, zb_h1, zb_v };
// 'gpipe' | '1f1b' | 'interleaved' | 'zb-h1' | 'zb-v'; throws ptrain::Error (code kExitInput)
// otherwise.
ScheduleKind schedule_kind(const std::string& name);
// Whether the kind places chunks in a V (model::global_chunk): zb-v.
bool v_shaped(ScheduleKind kind);

enum class OpKind {
  recv_act,
  forward,
  send_act,
  recv_grad,
  backward,  // input and weight gradients at once
  send_grad,
  backward_input,   // B: the input gradient (sent back), keeping what W needs
  backward_weight,  // W: the weight gradients
};
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
// A forward, backward, B or W (not a message).
bool is_compute(OpKind kind);

// What a set of lists is for: P ranks, m micro-batches, v chunks each, and their placement.
struct Pipeline {
  int P = 1, m = 1, v = 1;
  bool v_shape = false;  // model::global_chunk's V placement (zb-v)
};
Pipeline pipeline_of(ScheduleKind kind, int P, int m, int v);

// Every rank's list for P pipeline ranks, m micro-batches, v chunks per rank.
// gpipe: all forwards, then all backwards. 1f1b: PipeDream-flush (Megatron's
// non-interleaved schedule). interleaved: Megatron's interleaved 1F1B (Narayanan et al.
// 2021). zb-h1: Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", ZB-H1): 1F1B's forwards
// and input gradients, rank r delaying its weight gradients by r micro-batches into the
// cooldown, so every rank holds min(P, m) micro-batches as 1F1B's first does. zb-v: the same
// paper's V schedule (two chunks per rank placed in a V; PyTorch's ScheduleZBVZeroBubble
// order). Where a weight gradient directly follows its input gradient on the first chunk
// (which sends nothing back) the two are one backward. Requires P >= 1, m >= 1, v >= 1;
// gpipe, 1f1b and zb-h1 need v == 1, zb-v v == 2; interleaved needs m % P == 0. Throws
// ptrain::Error(kExitInput) naming the rule otherwise.
std::vector<OpList> make_schedule(ScheduleKind kind, int P, int m, int v);
// Rank `rank`'s list of make_schedule(kind, P, m, v) alone (each list depends only on its rank):
// what a planner of thousands of stages needs one rank at a time.
OpList make_rank_schedule(ScheduleKind kind, int P, int m, int v, int rank);
// Per local chunk of one rank's list, the most micro-batches at any point whose forward is
// done and weight gradient is not (acts: the activation slots), whose forward is done and
// input gradient is not (head: the head's slots), and whose split backward has its B done
// and its W not (weight: the W records).
std::vector<model::SlotCounts> list_in_flight(const OpList& list, int v);
// The message "" or why (kind, P, m, v) is not schedulable (the rules make_schedule enforces).
std::string schedule_error(ScheduleKind kind, int P, int m, int v);
// The most micro-batches a rank of the kind's lists holds activations for at once, summed over
// its chunks (each counted from its forward to its weight gradient): what the schedule
// promises and check_schedule holds it to. gpipe m; 1f1b and zb-h1 min(P, m); interleaved
// Megatron's warmup + 1, at most v*m; zb-v 2*min(P, m) chunks of half a stage (1F1B's).
int memory_bound(ScheduleKind kind, int P, int m, int v);

// What a checked set of lists does.
struct ScheduleCheck {
  std::string error;  // "" when the lists are complete, matched and deadlock-free
  // in_flight[rank][chunk]: list_in_flight of that rank's list (the slots the executor needs).
  std::vector<std::vector<model::SlotCounts>> in_flight;
};
// Checks, in this order, and reports the first violation found: the ops' fields (range,
// peer, no messages on one rank, no op twice), completeness (every forward once, every
// backward once: whole, or B and W), matching (every send has its receive and vice versa),
// each list's order (sends after their compute, computes after their receive is posted, a B
// and a W after their forward, a W after its B, each chunk's input and weight gradients in
// micro-batch order), the memory (with `bound` > 0: no rank ever holds more than `bound`
// micro-batches' activations, memory_bound's count) and a replay for deadlock.
ScheduleCheck check_schedule(const std::vector<OpList>& lists, const Pipeline& pipe, int bound = 0);

// Seconds of one rank's computes: a forward, a whole backward, and the weight-gradient part
// of it (a split backward's W takes `weight`, its B backward - weight).
struct OpTimes {
  double forward = 1, backward = 2, weight = 1;
};
// Simulated timeline with messages free. A rank's idle time is the makespan minus its
// compute time (waits before its first op, between ops and after its last op until the step
// ends); idle_fraction[r] is that over the makespan and bubble is the largest. Throws
// ptrain::Error when the lists do not pass check_schedule.
struct ScheduleTiming {
  double makespan = 0;
  std::vector<double> idle_fraction;
  double bubble = 0;
  // Per rank, the time it waits for messages before its own last op ends (idle time less
  // the tail after it): what a rank measures as waits on the pipeline group.
  std::vector<double> waiting;
  // Per rank, when each of its computes starts (in list order).
  std::vector<std::vector<double>> compute_start;
};
ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, const Pipeline& pipe,
                                 const OpTimes& times = {});
// The same with each rank's own times: real stages are never quite equal.
ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, const Pipeline& pipe,
                                 const std::vector<OpTimes>& times);
// The same with every compute's own time: compute_seconds[r][k] for the k-th compute along
// rank r's list (forward, backward, B or W). The run log compares its measured bubble with
// this one at the step's measured times, so that uneven ops (noise, a slow first
// micro-batch) are in the model and what is left is the executor's own waiting.
ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, const Pipeline& pipe,
                                 const std::vector<std::vector<double>>& compute_seconds);

// Text picture for `ptrain --plan`: one row per rank in simulated time (forward 1 cell,
// backward 2, a split backward's B and W 1 each), e.g. "rank 0 | F0 F1 F2 F3 .. .. B0 B0 ..":
// forward "F<mb>", backward "B<mb>" in both its cells, B "B<mb>" in one, W "W<mb>", idle
// "..", the chunk appended for v > 1 ("F3.1"). With `ops`, each rank's list follows, one
// token per op: F3 B3 Bi3 (B) W3, sa3>2 (send_act of mb 3 to rank 2), ra3<0 (recv_act from
// rank 0), sg/rg likewise for gradients. Throws as simulate_schedule.
std::string format_schedule(const std::vector<OpList>& lists, const Pipeline& pipe,
                            bool ops = false);

}  // namespace ptrain::parallel
