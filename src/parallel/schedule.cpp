// parallel/schedule.cpp — the schedules, their checker, their simulated timeline.
#include "parallel/schedule.hpp"

#include <algorithm>
#include <cstddef>

#include "util/error.hpp"

namespace ptrain::parallel {

namespace {

constexpr int kOpKinds = 6;

// The pipeline's shape and its chunk arithmetic (global chunk g = chunk * P + rank).
struct Shape {
  int P, m, v;
  int stages() const { return v * P; }
  int global(int rank, int chunk) const { return chunk * P + rank; }
  int rank_of(int g) const { return g % P; }
  int chunk_of(int g) const { return g / P; }
  bool has(int g) const { return g >= 0 && g < stages(); }
};

const char* kind_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::gpipe:
      return "gpipe";
    case ScheduleKind::one_f_one_b:
      return "1f1b";
    case ScheduleKind::interleaved:
      return "interleaved";
  }
  return "?";
}

const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::recv_act:
      return "recv_act";
    case OpKind::forward:
      return "forward";
    case OpKind::send_act:
      return "send_act";
    case OpKind::recv_grad:
      return "recv_grad";
    case OpKind::backward:
      return "backward";
    case OpKind::send_grad:
      return "send_grad";
  }
  return "?";
}

bool is_compute(OpKind k) { return k == OpKind::forward || k == OpKind::backward; }
bool is_send(OpKind k) { return k == OpKind::send_act || k == OpKind::send_grad; }
bool is_recv(OpKind k) { return k == OpKind::recv_act || k == OpKind::recv_grad; }
bool is_grad(OpKind k) {
  return k == OpKind::recv_grad || k == OpKind::backward || k == OpKind::send_grad;
}
OpKind compute_of(OpKind k) { return is_grad(k) ? OpKind::backward : OpKind::forward; }
OpKind recv_of(OpKind k) { return is_grad(k) ? OpKind::recv_grad : OpKind::recv_act; }
OpKind send_of(OpKind k) { return is_grad(k) ? OpKind::send_grad : OpKind::send_act; }
// The other end of a message: a send_act matches a recv_act, a send_grad a recv_grad.
OpKind counterpart(OpKind k) { return is_send(k) ? recv_of(k) : send_of(k); }

// Activations flow to g+1 and gradients to g-1: the stage a compute reads its input from
// and the one its output goes to (possibly outside 0..vP-1, i.e. none).
int input_stage(OpKind compute, int g) { return compute == OpKind::forward ? g - 1 : g + 1; }
int output_stage(OpKind compute, int g) { return compute == OpKind::forward ? g + 1 : g - 1; }
// The stage at the other end of a message op at stage g.
int neighbour_stage(OpKind message, int g) {
  return is_send(message) ? output_stage(compute_of(message), g)
                          : input_stage(compute_of(message), g);
}

// A message is known by its kind, micro-batch and receiving stage.
int message_key(const Shape& s, bool grad, int mb, int to_stage) {
  return ((grad ? 1 : 0) * s.m + mb) * s.stages() + to_stage;
}

// "forward mb 3 chunk 0", "send_grad mb 2 chunk 0 to rank 1".
std::string describe(const Op& op) {
  std::string d = cat(op_name(op.kind), " mb ", op.mb, " chunk ", op.chunk);
  if (is_send(op.kind)) d += cat(" to rank ", op.peer);
  if (is_recv(op.kind)) d += cat(" from rank ", op.peer);
  return d;
}

// ---- building ------------------------------------------------------------------------

struct Compute {
  OpKind kind;
  int mb, chunk;
};
using ComputeOrder = std::vector<Compute>;

ComputeOrder gpipe_order(int m) {
  ComputeOrder order;
  order.reserve(std::size_t(2 * m));
  for (int mb = 0; mb < m; ++mb) order.push_back({OpKind::forward, mb, 0});
  for (int mb = 0; mb < m; ++mb) order.push_back({OpKind::backward, mb, 0});
  return order;
}

// The k-th forward (or backward) of a rank in Megatron's interleaved order: micro-batches
// in groups of P go through chunk 0, the same group through chunk 1, ..., then the next
// group; backwards visit the chunks in reverse. With v = 1 it is simply micro-batch k.
Compute interleaved_step(OpKind kind, int k, int P, int v) {
  const int chunk = (k / P) % v;
  const int mb = (k / (P * v)) * P + k % P;
  return {kind, mb, kind == OpKind::forward ? chunk : v - 1 - chunk};
}

// One forward one backward: `warmup` forwards fill the pipeline below this rank, then each
// forward is followed by the oldest backward, then the remaining backwards drain it.
ComputeOrder one_forward_one_backward(int P, int v, int total, int warmup) {
  ComputeOrder order;
  order.reserve(std::size_t(2 * total));
  for (int k = 0; k < warmup; ++k) order.push_back(interleaved_step(OpKind::forward, k, P, v));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(interleaved_step(OpKind::forward, warmup + k, P, v));
    order.push_back(interleaved_step(OpKind::backward, k, P, v));
  }
  for (int k = total - warmup; k < total; ++k)
    order.push_back(interleaved_step(OpKind::backward, k, P, v));
  return order;
}

ComputeOrder compute_order(ScheduleKind kind, const Shape& s, int rank) {
  switch (kind) {
    case ScheduleKind::gpipe:
      return gpipe_order(s.m);
    case ScheduleKind::one_f_one_b:
      return one_forward_one_backward(s.P, 1, s.m, std::min(s.P - rank - 1, s.m));
    case ScheduleKind::interleaved: {
      // Megatron's warmup: the first backward is of the last chunk, so every other chunk
      // first takes a group of P micro-batches ((v-1)*P); each rank below this one adds a
      // forward-and-backward round trip (2 per rank) before that gradient comes back.
      const int total = s.m * s.v;
      return one_forward_one_backward(s.P, s.v, total,
                                      std::min((s.P - rank - 1) * 2 + (s.v - 1) * s.P, total));
    }
  }
  return {};
}

// Each send right after the compute that produces it; each receive right after the
// previous compute (and its send), so it is posted as early as this rank's order allows.
OpList place_messages(const ComputeOrder& order, const Shape& s, int rank) {
  OpList ops;
  ops.reserve(order.size() * (s.P > 1 ? 3 : 1));  // a compute, its receive and its send
  for (const Compute& c : order) {
    const int g = s.global(rank, c.chunk);
    const int from = input_stage(c.kind, g), to = output_stage(c.kind, g);
    if (s.P > 1 && s.has(from)) ops.push_back({recv_of(c.kind), c.mb, c.chunk, s.rank_of(from)});
    ops.push_back({c.kind, c.mb, c.chunk, -1});
    if (s.P > 1 && s.has(to)) ops.push_back({send_of(c.kind), c.mb, c.chunk, s.rank_of(to)});
  }
  return ops;
}

// ---- checking ------------------------------------------------------------------------

// Where each op sits in each rank's list: at[rank][slot(op)], -1 where absent.
struct Positions {
  Shape s;
  std::vector<std::vector<int>> at;
  explicit Positions(const Shape& shape)
      : s(shape),
        at(std::size_t(shape.P), std::vector<int>(std::size_t(kOpKinds * shape.m * shape.v), -1)) {}
  int& of(int rank, OpKind k, int mb, int chunk) {
    return at[std::size_t(rank)][std::size_t((int(k) * s.m + mb) * s.v + chunk)];
  }
};

// The fields of one op alone: "" or what is wrong with them.
std::string field_error(const Op& op, const Shape& s, int rank) {
  if (int(op.kind) < 0 || int(op.kind) >= kOpKinds)
    return cat("kind ", int(op.kind), " is no OpKind");
  if (op.mb < 0 || op.mb >= s.m) return cat(describe(op), ": mb outside 0..", s.m - 1);
  if (op.chunk < 0 || op.chunk >= s.v) return cat(describe(op), ": chunk outside 0..", s.v - 1);
  if (is_compute(op.kind))
    return op.peer == -1 ? "" : cat(describe(op), " has peer ", op.peer, "; computes have none");
  if (s.P == 1) return cat(describe(op), " on a single pipeline rank, which has no messages");
  const int g = s.global(rank, op.chunk), other = neighbour_stage(op.kind, g);
  if (!s.has(other))
    return cat(describe(op), ": global chunk ", g, " has no ", other < 0 ? "previous" : "next",
               " stage");
  if (op.peer != s.rank_of(other))
    return cat(describe(op), ": global chunk ", other, " is on rank ", s.rank_of(other));
  return "";
}

// Fields in range, peers right, no op twice in a list (an op's stage fixes its rank, so
// that makes every op unique across ranks too). Fills `pos`.
std::string check_fields(const std::vector<OpList>& lists, Positions& pos) {
  for (int r = 0; r < pos.s.P; ++r) {
    const OpList& ops = lists[std::size_t(r)];
    for (int i = 0; i < int(ops.size()); ++i) {
      const Op& op = ops[std::size_t(i)];
      if (std::string e = field_error(op, pos.s, r); !e.empty())
        return cat("rank ", r, ": op ", i, ": ", e);
      int& at = pos.of(r, op.kind, op.mb, op.chunk);
      if (at >= 0) return cat("rank ", r, ": op ", i, " (", describe(op), ") repeats op ", at);
      at = i;
    }
  }
  return "";
}

// Every (mb, global chunk) has its forward and its backward.
std::string check_complete(Positions& pos) {
  for (int r = 0; r < pos.s.P; ++r)
    for (OpKind k : {OpKind::forward, OpKind::backward})
      for (int c = 0; c < pos.s.v; ++c)
        for (int mb = 0; mb < pos.s.m; ++mb)
          if (pos.of(r, k, mb, c) < 0)
            return cat("rank ", r, ": ", describe({k, mb, c, -1}), " is missing");
  return "";
}

// Every send has its receive on the peer and vice versa.
std::string check_matching(const std::vector<OpList>& lists, Positions& pos) {
  const Shape& s = pos.s;
  for (int r = 0; r < s.P; ++r)
    for (const Op& op : lists[std::size_t(r)]) {
      if (is_compute(op.kind)) continue;
      const int other = neighbour_stage(op.kind, s.global(r, op.chunk));
      const Op match{counterpart(op.kind), op.mb, s.chunk_of(other), r};
      if (pos.of(op.peer, match.kind, match.mb, match.chunk) < 0)
        return cat("rank ", r, ": ", describe(op), " has no matching ",
                   is_send(op.kind) ? "recv" : "send", " (", describe(match), " on rank ", op.peer,
                   ")");
    }
  return "";
}

// Within one list, what a compute needs must come earlier: its forward (for a backward),
// its posted receive, or on one rank the previous chunk's compute.
std::string compute_order_error(const Op& op, int i, int rank, Positions& pos) {
  const Shape& s = pos.s;
  if (op.kind == OpKind::backward) {
    const int f = pos.of(rank, OpKind::forward, op.mb, op.chunk);
    if (f > i) return cat(describe(op), " before its forward (op ", f, ")");
  }
  const int from = input_stage(op.kind, s.global(rank, op.chunk));
  if (!s.has(from)) return "";
  if (s.P == 1) {
    const Op producer{op.kind, op.mb, s.chunk_of(from), -1};
    const int p = pos.of(rank, producer.kind, producer.mb, producer.chunk);
    return p < i ? ""
                 : cat(describe(op), " before ", describe(producer), " (op ", p,
                       "), whose output it consumes");
  }
  const int recv = pos.of(rank, recv_of(op.kind), op.mb, op.chunk);
  if (recv < 0) return cat(describe(op), " has no ", op_name(recv_of(op.kind)));
  if (recv > i)
    return cat(describe(op), " before its ", op_name(recv_of(op.kind)), " is posted (op ", recv,
               ")");
  return "";
}

std::string check_order(const std::vector<OpList>& lists, Positions& pos) {
  for (int r = 0; r < pos.s.P; ++r) {
    const OpList& ops = lists[std::size_t(r)];
    for (int i = 0; i < int(ops.size()); ++i) {
      const Op& op = ops[std::size_t(i)];
      std::string e;
      if (is_compute(op.kind)) {
        e = compute_order_error(op, i, r, pos);
      } else if (is_send(op.kind)) {
        const int c = pos.of(r, compute_of(op.kind), op.mb, op.chunk);
        if (c > i)
          e = cat(describe(op), " before its ", op_name(compute_of(op.kind)), " (op ", c, ")");
      }
      if (!e.empty()) return cat("rank ", r, ": ", e);
    }
  }
  return "";
}

// in_flight[rank][chunk]: the most forwards done whose backward is not, along each list.
std::vector<std::vector<int>> count_in_flight(const std::vector<OpList>& lists, const Shape& s) {
  std::vector<std::vector<int>> most;
  for (const OpList& list : lists) most.push_back(list_in_flight(list, s.v));
  return most;
}

// ---- replay --------------------------------------------------------------------------

// The lists run as the executor runs them: each rank goes on while its next op can run;
// a compute whose input comes from another rank waits until that rank has sent it.
// Computes take their seconds[rank][k] (k counts computes along the list), messages
// nothing. Assumes the static checks pass.
struct Replay {
  std::vector<std::vector<double>> start;  // [rank][op]
  std::vector<std::size_t> next;           // per rank, the first op not run
  std::vector<double> finish;              // per rank, when its last op ends
  double makespan = 0;
};

// The message a compute at stage g waits for, or -1 when its input is local or absent.
int awaited_message(const Op& op, int g, const Shape& s) {
  if (!is_compute(op.kind) || s.P == 1 || !s.has(input_stage(op.kind, g))) return -1;
  return message_key(s, op.kind == OpKind::backward, op.mb, g);
}

using ComputeSeconds = std::vector<std::vector<double>>;  // [rank][k-th compute of its list]

// Every forward of rank r taking t_forward[r] and every backward t_backward[r].
ComputeSeconds per_rank_seconds(const std::vector<OpList>& lists,
                                const std::vector<double>& t_forward,
                                const std::vector<double>& t_backward) {
  // The ranks with times (a list count that differs from P is the checker's to report).
  ComputeSeconds out(std::min(lists.size(), std::min(t_forward.size(), t_backward.size())));
  for (std::size_t r = 0; r < out.size(); ++r)
    for (const Op& op : lists[r])
      if (is_compute(op.kind))
        out[r].push_back((op.kind == OpKind::forward ? t_forward : t_backward)[r]);
  return out;
}

Replay replay(const std::vector<OpList>& lists, const Shape& s, const ComputeSeconds& seconds) {
  Replay rp;
  rp.next.assign(std::size_t(s.P), 0);
  for (const OpList& ops : lists) rp.start.emplace_back(ops.size(), 0.0);
  std::vector<double> clock(std::size_t(s.P), 0.0),
      sent_at(std::size_t(2 * s.m * s.stages()), -1.0);
  std::vector<std::size_t> computes(std::size_t(s.P), 0);  // per rank, computes run
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.P; ++r) {
      const OpList& ops = lists[std::size_t(r)];
      for (std::size_t& i = rp.next[std::size_t(r)]; i < ops.size(); ++i) {
        const Op& op = ops[i];
        const int g = s.global(r, op.chunk);
        double& now = clock[std::size_t(r)];
        if (const int key = awaited_message(op, g, s); key >= 0) {
          if (sent_at[std::size_t(key)] < 0) break;
          now = std::max(now, sent_at[std::size_t(key)]);
        }
        rp.start[std::size_t(r)][i] = now;
        if (is_compute(op.kind)) now += seconds[std::size_t(r)][computes[std::size_t(r)]++];
        if (is_send(op.kind))
          sent_at[std::size_t(
              message_key(s, is_grad(op.kind), op.mb, neighbour_stage(op.kind, g)))] = now;
        progress = true;
      }
      rp.makespan = std::max(rp.makespan, clock[std::size_t(r)]);
    }
  }
  rp.finish = clock;
  return rp;
}

std::string check_deadlock(const std::vector<OpList>& lists, const Shape& s) {
  const std::vector<double> unit(std::size_t(s.P), 1.0);
  const Replay rp = replay(lists, s, per_rank_seconds(lists, unit, unit));
  std::string stuck;
  for (int r = 0; r < s.P; ++r) {
    const std::size_t i = rp.next[std::size_t(r)];
    if (i == lists[std::size_t(r)].size()) continue;
    const Op& op = lists[std::size_t(r)][i];
    stuck +=
        cat(stuck.empty() ? "deadlock: " : ", ", "rank ", r, " waits at op ", i, " (", describe(op),
            ") for rank ", s.rank_of(input_stage(op.kind, s.global(r, op.chunk))));
  }
  return stuck;
}

std::string checked_error(const std::vector<OpList>& lists, const Shape& s) {
  if (s.P < 1 || s.m < 1 || s.v < 1)
    return cat("P = ", s.P, ", m = ", s.m, ", v = ", s.v, ": each must be at least 1");
  if (int(lists.size()) != s.P)
    return cat("expected one list per pipeline rank (P = ", s.P, "), got ", lists.size());
  Positions pos(s);
  std::string e = check_fields(lists, pos);
  if (e.empty()) e = check_complete(pos);
  if (e.empty()) e = check_matching(lists, pos);
  if (e.empty()) e = check_order(lists, pos);
  if (e.empty()) e = check_deadlock(lists, s);
  return e;
}

// The replay of lists that must pass the checker (simulate_schedule, format_schedule).
Replay replay_checked(const char* who, const std::vector<OpList>& lists, const Shape& s,
                      const ComputeSeconds& seconds) {
  const std::string e = checked_error(lists, s);
  if (!e.empty()) throw Error(cat(who, ": ", e));
  PTRAIN_REQUIRE(int(seconds.size()) == s.P, who, ": compute times for ", seconds.size(),
                 " ranks, not ", s.P);
  for (int r = 0; r < s.P; ++r) {
    const std::size_t computes = std::size_t(2 * s.m * s.v);  // after the check
    PTRAIN_REQUIRE(seconds[std::size_t(r)].size() == computes, who, ": ",
                   seconds[std::size_t(r)].size(), " compute times on rank ", r, ", not ",
                   computes);
    for (double t : seconds[std::size_t(r)])
      PTRAIN_REQUIRE(t >= 0, who, ": negative compute time on rank ", r);
  }
  return replay(lists, s, seconds);
}

// ---- the picture ---------------------------------------------------------------------

std::string cell_label(const Op& op, int v) {
  return cat(op.kind == OpKind::forward ? "F" : "B", op.mb, v > 1 ? cat(".", op.chunk) : "");
}

// "F3", "B3", "sa3>2" (send_act to rank 2), "ra3<0", "sg3>1", "rg3<2"; chunk as ".c" for v > 1.
std::string op_token(const Op& op, int v) {
  if (is_compute(op.kind)) return cell_label(op, v);
  return cat(is_send(op.kind) ? "s" : "r", is_grad(op.kind) ? "g" : "a", op.mb,
             v > 1 ? cat(".", op.chunk) : "", is_send(op.kind) ? ">" : "<", op.peer);
}

std::string padded(const std::string& text, std::size_t width, bool left) {
  const std::string fill(width > text.size() ? width - text.size() : 0, ' ');
  return left ? fill + text : text + fill;
}

// One rank's cells: each compute's label in every time unit it runs, ".." where idle.
std::vector<std::string> timeline_cells(const OpList& ops, const std::vector<double>& start,
                                        int cells, int v) {
  std::vector<std::string> row(std::size_t(cells), "..");
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (!is_compute(ops[i].kind)) continue;
    const int length = ops[i].kind == OpKind::forward ? 1 : 2;
    for (int t = int(start[i]); t < int(start[i]) + length; ++t)
      row[std::size_t(t)] = cell_label(ops[i], v);
  }
  return row;
}

}  // namespace

// ---- public --------------------------------------------------------------------------

ScheduleKind schedule_kind(const std::string& name) {
  for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved})
    if (name == kind_name(k)) return k;
  throw Error(cat("unknown pipeline schedule '", name, "' (gpipe, 1f1b or interleaved)"),
              kExitInput);
}

std::string schedule_error(ScheduleKind kind, int P, int m, int v) {
  const std::string what = cat("pipeline schedule ", kind_name(kind), ": ");
  if (P < 1) return cat(what, "P = ", P, " pipeline ranks; needs at least 1");
  if (m < 1) return cat(what, "m = ", m, " micro-batches; needs at least 1");
  if (v < 1) return cat(what, "v = ", v, " chunks per rank; needs at least 1");
  if (kind != ScheduleKind::interleaved && v != 1)
    return cat(what, "runs one chunk per rank, not v = ", v, " (interleaved runs several)");
  if (kind == ScheduleKind::interleaved && m % P != 0)
    return cat(what, "the micro-batches (m = ", m,
               ") must be a multiple of the pipeline ranks (P = ", P, "), as in Megatron");
  return "";
}

std::vector<OpList> make_schedule(ScheduleKind kind, int P, int m, int v) {
  if (std::string e = schedule_error(kind, P, m, v); !e.empty()) throw Error(e, kExitInput);
  const Shape s{P, m, v};
  std::vector<OpList> lists;
  for (int r = 0; r < P; ++r) lists.push_back(place_messages(compute_order(kind, s, r), s, r));
  return lists;
}

OpList make_rank_schedule(ScheduleKind kind, int P, int m, int v, int rank) {
  if (std::string e = schedule_error(kind, P, m, v); !e.empty()) throw Error(e, kExitInput);
  PTRAIN_REQUIRE(rank >= 0 && rank < P, "make_rank_schedule: rank ", rank, " of ", P);
  const Shape s{P, m, v};
  return place_messages(compute_order(kind, s, rank), s, rank);
}

std::vector<int> list_in_flight(const OpList& list, int v) {
  std::vector<int> most(std::size_t(v), 0), live(std::size_t(v), 0);
  for (const Op& op : list) {
    const std::size_t c = std::size_t(op.chunk);
    if (op.kind == OpKind::forward) most[c] = std::max(most[c], ++live[c]);
    if (op.kind == OpKind::backward) --live[c];
  }
  return most;
}

ScheduleCheck check_schedule(const std::vector<OpList>& lists, int P, int m, int v) {
  const Shape s{P, m, v};
  ScheduleCheck out;
  out.error = checked_error(lists, s);
  if (out.error.empty()) out.in_flight = count_in_flight(lists, s);
  return out;
}

ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, int P, int m, int v,
                                 const std::vector<std::vector<double>>& compute_seconds) {
  const Shape s{P, m, v};
  const Replay rp = replay_checked("simulate_schedule", lists, s, compute_seconds);
  ScheduleTiming timing;
  timing.makespan = rp.makespan;
  for (int r = 0; r < P; ++r) {
    double busy = 0;
    for (double t : compute_seconds[std::size_t(r)]) busy += t;
    const double idle = rp.makespan > 0 ? (rp.makespan - busy) / rp.makespan : 0;
    timing.idle_fraction.push_back(idle);
    timing.waiting.push_back(rp.finish[std::size_t(r)] - busy);
    timing.bubble = std::max(timing.bubble, idle);
  }
  return timing;
}

ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, int P, int m, int v,
                                 const std::vector<double>& t_forward,
                                 const std::vector<double>& t_backward) {
  PTRAIN_REQUIRE(int(t_forward.size()) == P && int(t_backward.size()) == P,
                 "simulate_schedule: one forward and one backward time per rank are needed");
  return simulate_schedule(lists, P, m, v, per_rank_seconds(lists, t_forward, t_backward));
}

ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, int P, int m, int v,
                                 double t_forward, double t_backward) {
  return simulate_schedule(lists, P, m, v,
                           std::vector<double>(std::size_t(std::max(P, 0)), t_forward),
                           std::vector<double>(std::size_t(std::max(P, 0)), t_backward));
}

std::string format_schedule(const std::vector<OpList>& lists, int P, int m, int v, bool ops) {
  const Shape s{P, m, v};
  const Replay rp = replay_checked("format_schedule", lists, s,
                                   per_rank_seconds(lists, std::vector<double>(lists.size(), 1.0),
                                                    std::vector<double>(lists.size(), 2.0)));
  const std::size_t width = cat(m - 1, v > 1 ? cat(".", v - 1) : "").size() + 1;
  const std::size_t rank_width = std::to_string(P - 1).size();
  std::string out;
  for (int r = 0; r < P; ++r) {
    std::string line = cat("rank ", padded(std::to_string(r), rank_width, true), " |");
    for (const std::string& cell :
         timeline_cells(lists[std::size_t(r)], rp.start[std::size_t(r)], int(rp.makespan), v))
      line += " " + padded(cell, width, false);
    line.erase(line.find_last_not_of(' ') + 1);
    out += line + "\n";
  }
  if (!ops) return out;
  for (int r = 0; r < P; ++r) {
    std::string line = cat("rank ", padded(std::to_string(r), rank_width, true), " ops:");
    for (const Op& op : lists[std::size_t(r)]) line += " " + op_token(op, v);
    out += line + "\n";
  }
  return out;
}

}  // namespace ptrain::parallel
