// parallel/schedule.cpp — the schedules, their checker, their simulated timeline.
#include "parallel/schedule.hpp"

#include <algorithm>
#include <cstddef>
#include <deque>
#include <tuple>

#include "util/error.hpp"

namespace ptrain::parallel {

namespace {

constexpr int kOpKinds = 8;

// The pipeline's shape and its chunk arithmetic (model::global_chunk's placement).
struct Shape {
  int P, m, v;
  bool v_shape = false;
  int stages() const { return v * P; }
  int global(int rank, int chunk) const { return model::global_chunk(P, v_shape, rank, chunk); }
  int rank_of(int g) const { return model::chunk_place(P, v_shape, g).rank; }
  int chunk_of(int g) const { return model::chunk_place(P, v_shape, g).chunk; }
  bool has(int g) const { return g >= 0 && g < stages(); }
};
Shape shape_of(const Pipeline& p) { return {p.P, p.m, p.v, p.v_shape}; }

const char* kind_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::gpipe:
      return "gpipe";
    case ScheduleKind::one_f_one_b:
      return "1f1b";
    case ScheduleKind::interleaved:
      return "interleaved";
    case ScheduleKind::zb_h1:
      return "zb-h1";
    case ScheduleKind::zb_v:
      return "zb-v";
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
    case OpKind::backward_input:
      return "backward_input";
    case OpKind::backward_weight:
      return "backward_weight";
  }
  return "?";
}

bool is_send(OpKind k) { return k == OpKind::send_act || k == OpKind::send_grad; }
bool is_recv(OpKind k) { return k == OpKind::recv_act || k == OpKind::recv_grad; }
// Computes that take a gradient message and send one back: a whole backward or its B.
bool input_gradient(OpKind k) { return k == OpKind::backward || k == OpKind::backward_input; }
// Computes that end a micro-batch's hold on its activations: a whole backward or its W.
bool weight_gradient(OpKind k) { return k == OpKind::backward || k == OpKind::backward_weight; }
bool is_grad(OpKind k) {
  return k == OpKind::recv_grad || k == OpKind::send_grad || input_gradient(k);
}
OpKind recv_of(OpKind k) { return is_grad(k) ? OpKind::recv_grad : OpKind::recv_act; }
OpKind send_of(OpKind k) { return is_grad(k) ? OpKind::send_grad : OpKind::send_act; }
// The other end of a message: a send_act matches a recv_act, a send_grad a recv_grad.
OpKind counterpart(OpKind k) { return is_send(k) ? recv_of(k) : send_of(k); }

// Activations flow to g+1 and gradients to g-1: the stage a compute (or a message's compute)
// reads its input from and the one its output goes to; -1 (none) for a W, which reads and
// sends nothing.
int input_stage(OpKind k, int g) {
  if (k == OpKind::backward_weight) return -1;
  return is_grad(k) ? g + 1 : g - 1;
}
int output_stage(OpKind k, int g) {
  if (k == OpKind::backward_weight) return -1;
  return is_grad(k) ? g - 1 : g + 1;
}
// The stage at the other end of a message op at stage g.
int neighbour_stage(OpKind message, int g) {
  return is_send(message) ? output_stage(message, g) : input_stage(message, g);
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

// ZB-H1 (Qi et al. 2023, Fig. 3): 1F1B's forwards and input gradients; rank r keeps up to r
// weight gradients pending (each B is followed by the oldest pending W once r are waiting),
// so its W fill the cooldown bubble. A rank holds min(P, m) micro-batches, as 1F1B's first.
ComputeOrder zb_h1_order(int P, int m, int rank) {
  const int warmup = std::min(P - rank - 1, m), delay = rank;
  ComputeOrder order;
  std::deque<int> pending;
  const auto input = [&](int mb) {
    order.push_back({OpKind::backward_input, mb, 0});
    pending.push_back(mb);
  };
  const auto weight = [&] {
    order.push_back({OpKind::backward_weight, pending.front(), 0});
    pending.pop_front();
  };
  for (int k = 0; k < warmup; ++k) order.push_back({OpKind::forward, k, 0});
  for (int k = 0; k < m - warmup; ++k) {
    order.push_back({OpKind::forward, warmup + k, 0});
    input(k);
    if (int(pending.size()) > delay) weight();
  }
  for (int k = m - warmup; k < m; ++k) {  // cooldown: a B, then a W while it waits
    input(k);
    weight();
  }
  while (!pending.empty()) weight();
  return order;
}

// ZB-V (Qi et al. 2023, section 6; the order of PyTorch's ScheduleZBVZeroBubble): chunk 0
// (global r) and chunk 1 (global 2P-1-r). Warmup forwards down the V, the turn's B and W at
// once, then F0 B0 W0 F1 B1 W1 rounds, then the input gradients drained with the W filling
// in. Built for max(m, 2P-1) micro-batches; the ops of those past m dropped.
ComputeOrder zb_v_order(int P, int m, int rank) {
  const int n = std::max(m, 2 * P - 1);
  ComputeOrder order;
  int f[2] = {0, 0}, b[2] = {0, 0}, w[2] = {0, 0};
  const auto F = [&](int c) { order.push_back({OpKind::forward, f[c]++, c}); };
  const auto B = [&](int c) { order.push_back({OpKind::backward_input, b[c]++, c}); };
  const auto W = [&](int c) { order.push_back({OpKind::backward_weight, w[c]++, c}); };
  for (int k = 0; k < 2 * (P - rank) - 1; ++k) F(0);
  for (int k = 0; k < rank; ++k) F(1), F(0);
  for (int k = 0; k < P - rank; ++k) F(1), B(1), W(1);
  while (f[1] < f[0] || f[0] < n) {
    if (f[0] < n) F(0);
    B(0), W(0), F(1), B(1), W(1);
  }
  for (int k = 0; k < rank; ++k) B(0), B(1);
  for (int k = 0; k < P - rank; ++k) B(0), W(0);
  while (w[1] < b[1]) W(1);
  while (w[0] < b[0]) W(0);
  order.erase(
      std::remove_if(order.begin(), order.end(), [m](const Compute& c) { return c.mb >= m; }),
      order.end());
  return order;
}

// A B directly followed by its own W on the pipeline's first chunk (whose input gradient
// nobody receives, so W delays no one) is one whole backward: no W record, the same bits.
ComputeOrder fuse_first_chunk(ComputeOrder order, const Shape& s, int rank) {
  ComputeOrder out;
  out.reserve(order.size());
  for (std::size_t i = 0; i < order.size(); ++i) {
    const Compute& c = order[i];
    if (c.kind == OpKind::backward_input && i + 1 < order.size() &&
        order[i + 1].kind == OpKind::backward_weight && order[i + 1].mb == c.mb &&
        order[i + 1].chunk == c.chunk && s.global(rank, c.chunk) == 0) {
      out.push_back({OpKind::backward, c.mb, c.chunk});
      ++i;
      continue;
    }
    out.push_back(c);
  }
  return out;
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
    case ScheduleKind::zb_h1:
      return fuse_first_chunk(zb_h1_order(s.P, s.m, rank), s, rank);
    case ScheduleKind::zb_v:
      return fuse_first_chunk(zb_v_order(s.P, s.m, rank), s, rank);
  }
  return {};
}

// Each send right after the compute that produces it; each receive right after the previous
// compute that is not a W (and its send), so it is posted as early as this rank's order
// allows: a W never delays the posting of the next message.
OpList place_messages(const ComputeOrder& order, const Shape& s, int rank) {
  OpList ops;
  ops.reserve(order.size() * (s.P > 1 ? 3 : 1));  // a compute, its receive and its send
  std::size_t post_at = 0;                        // where the next receive goes
  for (const Compute& c : order) {
    const int g = s.global(rank, c.chunk);
    const int from = input_stage(c.kind, g), to = output_stage(c.kind, g);
    if (s.P > 1 && s.has(from))
      ops.insert(ops.begin() + std::ptrdiff_t(post_at),
                 Op{recv_of(c.kind), c.mb, c.chunk, s.rank_of(from)});
    ops.push_back({c.kind, c.mb, c.chunk, -1});
    if (s.P > 1 && s.has(to)) ops.push_back({send_of(c.kind), c.mb, c.chunk, s.rank_of(to)});
    if (c.kind != OpKind::backward_weight) post_at = ops.size();
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

// Every (mb, global chunk) has its forward and its backward: whole, or its B and its W
// (each exactly once: repeats are check_fields').
std::string check_complete(Positions& pos) {
  for (int r = 0; r < pos.s.P; ++r)
    for (int c = 0; c < pos.s.v; ++c)
      for (int mb = 0; mb < pos.s.m; ++mb) {
        const auto has = [&](OpKind k) { return pos.of(r, k, mb, c) >= 0; };
        const auto op = [&](OpKind k) { return describe({k, mb, c, -1}); };
        std::string e;
        if (!has(OpKind::forward)) {
          e = cat(op(OpKind::forward), " is missing");
        } else if (has(OpKind::backward)) {
          if (has(OpKind::backward_input) || has(OpKind::backward_weight))
            e = cat(op(OpKind::backward),
                    " is also split into a backward_input and a "
                    "backward_weight");
        } else if (!has(OpKind::backward_input) && !has(OpKind::backward_weight)) {
          e = cat(op(OpKind::backward), " is missing");
        } else if (!has(OpKind::backward_input)) {
          e = cat(op(OpKind::backward_weight), " has no backward_input");
        } else if (!has(OpKind::backward_weight)) {
          e = cat(op(OpKind::backward_input), " has no backward_weight");
        }
        if (!e.empty()) return cat("rank ", r, ": ", e);
      }
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

// Within one list, what a compute needs must come earlier: its forward (for a backward or
// its B), its B (for a W), its posted receive, or on one rank the neighbouring chunk's
// compute.
std::string compute_order_error(const Op& op, int i, int rank, Positions& pos) {
  const Shape& s = pos.s;
  if (op.kind == OpKind::backward_weight) {
    const int b = pos.of(rank, OpKind::backward_input, op.mb, op.chunk);
    return b < i ? "" : cat(describe(op), " before its backward_input (op ", b, ")");
  }
  if (input_gradient(op.kind)) {
    const int f = pos.of(rank, OpKind::forward, op.mb, op.chunk);
    if (f > i) return cat(describe(op), " before its forward (op ", f, ")");
  }
  const int from = input_stage(op.kind, s.global(rank, op.chunk));
  if (!s.has(from)) return "";
  if (s.P == 1) {
    Op producer{OpKind::forward, op.mb, s.chunk_of(from), -1};
    if (op.kind != OpKind::forward && pos.of(rank, OpKind::backward, op.mb, producer.chunk) < 0)
      producer.kind = OpKind::backward_input;
    else if (op.kind != OpKind::forward)
      producer.kind = OpKind::backward;
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
    // Per chunk, the micro-batch of the last input gradient and of the last weight gradient.
    std::vector<int> last_input(std::size_t(pos.s.v), -1), last_weight(std::size_t(pos.s.v), -1);
    for (int i = 0; i < int(ops.size()); ++i) {
      const Op& op = ops[std::size_t(i)];
      std::string e;
      if (is_compute(op.kind)) {
        e = compute_order_error(op, i, r, pos);
        for (auto [is, last, what] :
             {std::tuple{input_gradient(op.kind), &last_input, "input"},
              std::tuple{weight_gradient(op.kind), &last_weight, "weight"}}) {
          int& prev = (*last)[std::size_t(op.chunk)];
          if (!is || !e.empty()) continue;
          if (op.mb < prev)
            e = cat(describe(op), ": chunk ", op.chunk, "'s ", what,
                    " gradients leave micro-batch order (mb ", prev,
                    " came first), so its gradients would add up in another order");
          prev = op.mb;
        }
      } else if (is_send(op.kind)) {
        OpKind k = OpKind::forward;
        if (op.kind == OpKind::send_grad)
          k = pos.of(r, OpKind::backward, op.mb, op.chunk) >= 0 ? OpKind::backward
                                                                : OpKind::backward_input;
        const int c = pos.of(r, k, op.mb, op.chunk);
        if (c > i) e = cat(describe(op), " before its ", op_name(k), " (op ", c, ")");
      }
      if (!e.empty()) return cat("rank ", r, ": ", e);
    }
  }
  return "";
}

// Every rank within `bound` micro-batches' activations (from a forward to its weight
// gradient, summed over its chunks); bound 0: none.
std::string check_memory(const std::vector<OpList>& lists, const Shape& s, int bound) {
  if (bound <= 0) return "";
  for (int r = 0; r < s.P; ++r) {
    int live = 0;
    const OpList& ops = lists[std::size_t(r)];
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind == OpKind::forward && ++live > bound)
        return cat("rank ", r, " holds ", live, " micro-batches' activations at op ", i, " (",
                   describe(ops[i]), "), over the schedule's bound of ", bound);
      if (weight_gradient(ops[i].kind)) --live;
    }
  }
  return "";
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
  return message_key(s, input_gradient(op.kind), op.mb, g);
}

using ComputeSeconds = std::vector<std::vector<double>>;  // [rank][k-th compute of its list]

double seconds_of(OpKind k, const OpTimes& t) {
  switch (k) {
    case OpKind::forward:
      return t.forward;
    case OpKind::backward:
      return t.backward;
    case OpKind::backward_input:
      return t.backward - t.weight;
    default:
      return t.weight;
  }
}

// Every compute of rank r taking its kind's time in times[r].
ComputeSeconds per_rank_seconds(const std::vector<OpList>& lists,
                                const std::vector<OpTimes>& times) {
  // The ranks with times (a list count that differs from P is the checker's to report).
  ComputeSeconds out(std::min(lists.size(), times.size()));
  for (std::size_t r = 0; r < out.size(); ++r)
    for (const Op& op : lists[r])
      if (is_compute(op.kind)) out[r].push_back(seconds_of(op.kind, times[r]));
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
  const Replay rp =
      replay(lists, s, per_rank_seconds(lists, std::vector<OpTimes>(std::size_t(s.P))));
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

std::string checked_error(const std::vector<OpList>& lists, const Shape& s, int bound) {
  if (s.P < 1 || s.m < 1 || s.v < 1)
    return cat("P = ", s.P, ", m = ", s.m, ", v = ", s.v, ": each must be at least 1");
  if (s.v_shape && s.v != 2) return cat("a V placement holds 2 chunks per rank, not v = ", s.v);
  if (int(lists.size()) != s.P)
    return cat("expected one list per pipeline rank (P = ", s.P, "), got ", lists.size());
  Positions pos(s);
  std::string e = check_fields(lists, pos);
  if (e.empty()) e = check_complete(pos);
  if (e.empty()) e = check_matching(lists, pos);
  if (e.empty()) e = check_order(lists, pos);
  if (e.empty()) e = check_memory(lists, s, bound);
  if (e.empty()) e = check_deadlock(lists, s);
  return e;
}

// The replay of lists that must pass the checker (simulate_schedule, format_schedule).
Replay replay_checked(const char* who, const std::vector<OpList>& lists, const Shape& s,
                      const ComputeSeconds& seconds) {
  const std::string e = checked_error(lists, s, 0);
  if (!e.empty()) throw Error(cat(who, ": ", e));
  PTRAIN_REQUIRE(int(seconds.size()) == s.P, who, ": compute times for ", seconds.size(),
                 " ranks, not ", s.P);
  for (int r = 0; r < s.P; ++r) {
    const auto& list = lists[std::size_t(r)];
    const auto computes = std::size_t(
        std::count_if(list.begin(), list.end(), [](const Op& op) { return is_compute(op.kind); }));
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
  return cat(op.kind == OpKind::forward           ? "F"
             : op.kind == OpKind::backward_weight ? "W"
                                                  : "B",
             op.mb, v > 1 ? cat(".", op.chunk) : "");
}

// "F3", "B3", "Bi3" (B), "W3", "sa3>2" (send_act to rank 2), "ra3<0", "sg3>1", "rg3<2"; chunk
// as ".c" for v > 1.
std::string op_token(const Op& op, int v) {
  if (op.kind == OpKind::backward_input) return cat("Bi", op.mb, v > 1 ? cat(".", op.chunk) : "");
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
    const int length = int(seconds_of(ops[i].kind, OpTimes{}));
    for (int t = int(start[i]); t < int(start[i]) + length; ++t)
      row[std::size_t(t)] = cell_label(ops[i], v);
  }
  return row;
}

}  // namespace

// ---- public --------------------------------------------------------------------------

ScheduleKind schedule_kind(const std::string& name) {
  for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                         ScheduleKind::zb_h1, ScheduleKind::zb_v})
    if (name == kind_name(k)) return k;
  throw Error(
      cat("unknown pipeline schedule '", name, "' (gpipe, 1f1b, interleaved, zb-h1 or zb-v)"),
      kExitInput);
}

bool v_shaped(ScheduleKind kind) { return kind == ScheduleKind::zb_v; }

bool is_compute(OpKind k) {
  return k == OpKind::forward || k == OpKind::backward || k == OpKind::backward_input ||
         k == OpKind::backward_weight;
}

Pipeline pipeline_of(ScheduleKind kind, int P, int m, int v) { return {P, m, v, v_shaped(kind)}; }

std::string schedule_error(ScheduleKind kind, int P, int m, int v) {
  const std::string what = cat("pipeline schedule ", kind_name(kind), ": ");
  if (P < 1) return cat(what, "P = ", P, " pipeline ranks; needs at least 1");
  if (m < 1) return cat(what, "m = ", m, " micro-batches; needs at least 1");
  if (v < 1) return cat(what, "v = ", v, " chunks per rank; needs at least 1");
  if (kind == ScheduleKind::zb_v && v != 2)
    return cat(what, "runs two chunks per rank in a V, not v = ", v);
  if (kind != ScheduleKind::interleaved && kind != ScheduleKind::zb_v && v != 1)
    return cat(what, "runs one chunk per rank, not v = ", v, " (interleaved runs several)");
  if (kind == ScheduleKind::interleaved && m % P != 0)
    return cat(what, "the micro-batches (m = ", m,
               ") must be a multiple of the pipeline ranks (P = ", P, "), as in Megatron");
  return "";
}

int memory_bound(ScheduleKind kind, int P, int m, int v) {
  switch (kind) {
    case ScheduleKind::gpipe:
      return m;
    case ScheduleKind::one_f_one_b:
    case ScheduleKind::zb_h1:
      return std::min(P, m);
    case ScheduleKind::interleaved:
      return std::min((P - 1) * 2 + (v - 1) * P + 1, m * v);
    case ScheduleKind::zb_v:
      return 2 * std::min(P, m);
  }
  return 0;
}

std::vector<OpList> make_schedule(ScheduleKind kind, int P, int m, int v) {
  if (std::string e = schedule_error(kind, P, m, v); !e.empty()) throw Error(e, kExitInput);
  const Shape s = shape_of(pipeline_of(kind, P, m, v));
  std::vector<OpList> lists;
  for (int r = 0; r < P; ++r) lists.push_back(place_messages(compute_order(kind, s, r), s, r));
  return lists;
}

OpList make_rank_schedule(ScheduleKind kind, int P, int m, int v, int rank) {
  if (std::string e = schedule_error(kind, P, m, v); !e.empty()) throw Error(e, kExitInput);
  PTRAIN_REQUIRE(rank >= 0 && rank < P, "make_rank_schedule: rank ", rank, " of ", P);
  const Shape s = shape_of(pipeline_of(kind, P, m, v));
  return place_messages(compute_order(kind, s, rank), s, rank);
}

std::vector<model::SlotCounts> list_in_flight(const OpList& list, int v) {
  std::vector<model::SlotCounts> most(std::size_t(v), model::SlotCounts(0, 0, 0)),
      live(std::size_t(v), model::SlotCounts(0, 0, 0));
  const auto up = [](int& n, int& peak) { peak = std::max(peak, ++n); };
  for (const Op& op : list) {
    auto &now = live[std::size_t(op.chunk)], &peak = most[std::size_t(op.chunk)];
    if (op.kind == OpKind::forward) up(now.acts, peak.acts), up(now.head, peak.head);
    if (input_gradient(op.kind)) --now.head;
    if (op.kind == OpKind::backward_input) up(now.weight, peak.weight);
    if (op.kind == OpKind::backward_weight) --now.weight;
    if (weight_gradient(op.kind)) --now.acts;
  }
  return most;
}

ScheduleCheck check_schedule(const std::vector<OpList>& lists, const Pipeline& pipe, int bound) {
  const Shape s = shape_of(pipe);
  ScheduleCheck out;
  out.error = checked_error(lists, s, bound);
  if (out.error.empty())
    for (const OpList& list : lists) out.in_flight.push_back(list_in_flight(list, s.v));
  return out;
}

ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, const Pipeline& pipe,
                                 const std::vector<std::vector<double>>& compute_seconds) {
  const Shape s = shape_of(pipe);
  const Replay rp = replay_checked("simulate_schedule", lists, s, compute_seconds);
  ScheduleTiming timing;
  timing.makespan = rp.makespan;
  for (int r = 0; r < s.P; ++r) {
    double busy = 0;
    for (double t : compute_seconds[std::size_t(r)]) busy += t;
    const double idle = rp.makespan > 0 ? (rp.makespan - busy) / rp.makespan : 0;
    timing.idle_fraction.push_back(idle);
    timing.waiting.push_back(rp.finish[std::size_t(r)] - busy);
    timing.bubble = std::max(timing.bubble, idle);
    auto& starts = timing.compute_start.emplace_back();
    const OpList& ops = lists[std::size_t(r)];
    for (std::size_t i = 0; i < ops.size(); ++i)
      if (is_compute(ops[i].kind)) starts.push_back(rp.start[std::size_t(r)][i]);
  }
  return timing;
}

ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, const Pipeline& pipe,
                                 const std::vector<OpTimes>& times) {
  PTRAIN_REQUIRE(int(times.size()) == pipe.P, "simulate_schedule: op times for ", times.size(),
                 " ranks, not ", pipe.P);
  for (const OpTimes& t : times)
    PTRAIN_REQUIRE(t.weight >= 0 && t.weight <= t.backward,
                   "simulate_schedule: a weight gradient is part of its backward");
  return simulate_schedule(lists, pipe, per_rank_seconds(lists, times));
}

ScheduleTiming simulate_schedule(const std::vector<OpList>& lists, const Pipeline& pipe,
                                 const OpTimes& times) {
  return simulate_schedule(lists, pipe,
                           std::vector<OpTimes>(std::size_t(std::max(pipe.P, 0)), times));
}

std::string format_schedule(const std::vector<OpList>& lists, const Pipeline& pipe, bool ops) {
  const Shape s = shape_of(pipe);
  const int P = s.P, m = s.m, v = s.v;
  const Replay rp = replay_checked("format_schedule", lists, s,
                                   per_rank_seconds(lists, std::vector<OpTimes>(lists.size())));
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
