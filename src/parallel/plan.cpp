#include "parallel/plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "comm/comm.hpp"
#include "deck/deck.hpp"
#include "kernels/attention.hpp"
#include "kernels/gemm.hpp"
#include "model/activations.hpp"
#include "parallel/cost.hpp"
#include "parallel/data_parallel.hpp"
#include "parallel/report.hpp"
#include "parallel/schedule.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"

namespace ptrain::parallel {

namespace {

constexpr int idx(MemCategory c) { return static_cast<int>(c); }

int dense_grad_size(const Config& c) { return int(c.parallel.dp * c.parallel.ep * c.parallel.cp); }
int expert_grad_size(const Config& c) { return int(c.parallel.dp * c.parallel.cp); }

// parallel%zero_scope = 'node': the dense-grad group's ranks on one node, as the grid places
// rank 0's group with `ranks_per_node` (0: unknown, the whole group); 0 for 'global'.
int node_zero_shards(const Config& config, int ranks_per_node) {
  if (config.parallel.zero_scope != "node" || ranks_per_node <= 0) return 0;
  const GridShape shape = GridShape::from_config(config);
  const Layout layout(shape, shape.world(), ranks_per_node);
  const std::vector<int> m = layout.members(GroupKind::dense_grad, 0);
  return int(
      std::count_if(m.begin(), m.end(), [&](int r) { return layout.node(r) == layout.node(0); }));
}

// Ranks a ZeRO shard is cut over (parallel/data_parallel.hpp): the dense-grad group, or its
// ranks on one node.
int zero_group_size(const Config& config, const model::ShardCoord& coord) {
  return coord.zero_shards > 0 ? coord.zero_shards : dense_grad_size(config);
}

// The shard of the rank at (t, p, e) on the grid's tp, pp and ep axes (cp rank 0), with
// `ranks_per_node` on each node (0: unknown).
model::ShardCoord shard_of(const Config& config, int t, int p, int e, int ranks_per_node = 0) {
  const auto& par = config.parallel;
  model::ShardCoord sc;
  sc.zero_shards = node_zero_shards(config, ranks_per_node);
  sc.t = t, sc.tp = int(par.tp), sc.p = p, sc.pp = int(par.pp), sc.e = e, sc.ep = int(par.ep);
  sc.cp = int(par.cp), sc.cp_zigzag = par.cp_layout == "zigzag";
  sc.virtual_stages = int(par.virtual_stages);
  sc.v_shape = sc.pp > 1 && v_shaped(schedule_kind(par.pp_schedule));
  return sc;
}

// What the deck's schedule asks of each pipeline stage: the activation slots, head slots and
// W records of each chunk (the checker's in-flight counts) and the executor's message
// buffers (parallel/pipeline.cpp),
// taken from a pool that only grows: one per receive from when it is posted until its compute
// is done with it (a forward copies its input out first, a backward reads its d(output) in
// place), and one per send until the executor finds it complete. A send needs its peer in
// MPI too, so it counts as complete at the end of this rank's next compute, when the executor
// tests it (the messages are large: rendezvous). Validation's forward-only pass runs one
// micro-batch through the chunks at a time.
struct StageNeeds {
  std::vector<model::SlotCounts> in_flight;
  int buffers = 0;
};

int message_buffers(const OpList& ops) {
  // Receives posted and not yet used: (gradient, micro-batch, chunk). A few at a time.
  std::vector<std::tuple<bool, int, int>> pending;
  int in_use = 0, pool = 0, sending = 0;
  auto take = [&] { pool = std::max(pool, ++in_use); };
  auto release = [&](bool grad, const Op& op) {
    const auto it = std::find(pending.begin(), pending.end(), std::tuple{grad, op.mb, op.chunk});
    if (it == pending.end()) return;
    pending.erase(it);
    --in_use;
  };
  for (const Op& op : ops) {
    switch (op.kind) {
      case OpKind::recv_act:
      case OpKind::recv_grad:
        take();
        pending.emplace_back(op.kind == OpKind::recv_grad, op.mb, op.chunk);
        break;
      case OpKind::send_act:
      case OpKind::send_grad:
        take();
        ++sending;
        break;
      case OpKind::forward:
      case OpKind::backward:
      case OpKind::backward_input:
      case OpKind::backward_weight:
        release(op.kind == OpKind::backward || op.kind == OpKind::backward_input, op);
        in_use -= sending;
        sending = 0;
        break;
    }
  }
  return pool;
}

// Schedules of up to this many computes per rank times ranks are checked whole by the planner.
constexpr std::int64_t kCheckedComputes = std::int64_t(1) << 20;

std::vector<StageNeeds> compute_stage_needs(const std::string& schedule, int P, int m, int v) {
  std::vector<StageNeeds> out(static_cast<std::size_t>(P));
  if (P == 1) {
    out[0].in_flight.assign(std::size_t(v), model::SlotCounts(1));
    return out;
  }
  // Each rank's list on its own (a plan of 4,000 stages holds one list, not 4,000); the whole
  // set is checked too where that is cheap (the trainer checks the set it runs).
  const ScheduleKind kind = schedule_kind(schedule);
  const Pipeline pipe = pipeline_of(kind, P, m, v);
  if (std::int64_t(P) * m * v <= kCheckedComputes) {
    const auto check =
        check_schedule(make_schedule(kind, P, m, v), pipe, memory_bound(kind, P, m, v));
    PTRAIN_REQUIRE(check.error.empty(), "pipeline schedule: ", check.error);
  }
  for (int r = 0; r < P; ++r) {
    const OpList list = make_rank_schedule(kind, P, m, v, r);
    for (model::SlotCounts n : list_in_flight(list, v))  // the trainer's slots
      out[std::size_t(r)].in_flight.emplace_back(std::max(1, n.acts), std::max(1, n.head),
                                                 n.weight);
    OpList validation;  // PipelineExecutor::forward_only, two micro-batches of it
    const auto rank_of = [&](int g) { return model::chunk_place(P, pipe.v_shape, g).rank; };
    for (int mb = 0; mb < std::min(m, 2); ++mb)
      for (int c = 0; c < v; ++c) {
        const int g = model::global_chunk(P, pipe.v_shape, r, c);
        if (g > 0) validation.push_back({OpKind::recv_act, mb, c, rank_of(g - 1)});
        validation.push_back({OpKind::forward, mb, c, -1});
        if (g < v * P - 1) validation.push_back({OpKind::send_act, mb, c, rank_of(g + 1)});
      }
    out[std::size_t(r)].buffers = std::max(message_buffers(list), message_buffers(validation));
  }
  return out;
}

// The schedule's needs depend on (schedule, p, m, v) only, and the planner asks for them for
// every shard and every knob setting it weighs: each is worked out once (a schedule of
// 4,000 stages takes seconds).
std::vector<StageNeeds> stage_needs(const Config& config) {
  using Key = std::tuple<std::string, int, int, int>;
  static std::map<Key, std::vector<StageNeeds>> known;
  const Key key{config.parallel.pp_schedule, int(config.parallel.pp),
                int(micro_batches_per_step(config)), int(config.parallel.virtual_stages)};
  auto it = known.find(key);
  if (it == known.end()) {
    if (known.size() >= 64) known.clear();
    it = known
             .emplace(key, compute_stage_needs(std::get<0>(key), std::get<1>(key), std::get<2>(key),
                                               std::get<3>(key)))
             .first;
  }
  return it->second;
}

std::string with_commas(std::int64_t n) {
  std::string s = std::to_string(n);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(std::size_t(i), ",");
  return s;
}

}  // namespace

model::ShardCoord plan_shard(const Config& config, int t, int p, int e, int ranks_per_node) {
  return shard_of(config, t, p, e, ranks_per_node);
}

double MemoryEstimate::total() const {
  double t = 0;
  for (double b : bytes) t += b;
  return t;
}

std::int64_t dtype_bytes(const Config& config) {
  return std::int64_t(bytes_of(deck::precision_policy(config).compute));
}

std::int64_t micro_batches_per_step(const Config& config) {
  const auto& t = config.train;
  return t.global_batch / (t.micro_batch * config.parallel.dp * config.parallel.ep);
}

double pipeline_bubble(const Config& config) {
  const double p = double(config.parallel.pp), v = double(config.parallel.virtual_stages);
  const double m = double(micro_batches_per_step(config));
  // The fill and drain in units of a forward (T_F = T_B = T_W, a whole backward 2): of
  // 1F1B's 3m per stage; zb-h1 leaves (p-1)(T_F + T_B - T_W) (Qi et al. 2023, section 2.1);
  // zb-v's V only the forwards' ramp of p-1 chunk forwards against 6m chunk ops.
  switch (schedule_kind(config.parallel.pp_schedule)) {
    case ScheduleKind::zb_h1:
      return (p - 1) / (3 * m + p - 1);
    case ScheduleKind::zb_v:
      return (p - 1) / (6 * m + p - 1);
    default:
      return (p - 1) / (v * m + p - 1);
  }
}

std::string pipeline_bubble_formula(const Config& config) {
  switch (schedule_kind(config.parallel.pp_schedule)) {
    case ScheduleKind::zb_h1:
      return "(p-1)/(3m+p-1)";
    case ScheduleKind::zb_v:
      return "(p-1)/(6m+p-1)";
    default:
      return "(p-1)/(v*m+p-1)";
  }
}

RingEstimate estimate_ring(const Config& config) {
  RingEstimate r;
  const auto& par = config.parallel;
  if (par.cp <= 1) return r;
  const model::Dims d = model::dims_of(config);
  const double w = double(dtype_bytes(config)), C = double(par.cp);
  const double w_stat = w == 2 ? 4.0 : w;  // the log-sum-exp: fp32 in a bf16 run
  const double rows = double(config.train.micro_batch) * double(d.S / par.cp);  // B*(S/C)
  const double width = double(d.C / par.tp), heads = double(d.NH / par.tp);     // this tp rank's
  r.block = 2.0 * rows * width * w;
  r.forward = (C - 1) * r.block;
  r.backward = (C - 1) * r.block + C * r.block;
  r.workspace = 5.0 * r.block + 2.0 * rows * width * w + rows * heads * w_stat;
  return r;
}

ExpertEstimate estimate_experts(const Config& config) {
  ExpertEstimate x;
  const auto& par = config.parallel;
  const model::Dims d = model::dims_of(config);
  if (d.n_expert == 0) return x;
  // As model/moe.cpp sizes it: capacity_factor * k * N / E, rounded up.
  x.tokens = config.train.micro_batch * d.S;
  const double cf = config.model.capacity_factor;
  if (cf > 0)
    x.capacity = std::int64_t(
        std::ceil(cf * double(d.top_k) * double(x.tokens) / double(d.n_expert) - 1e-9));
  if (par.ep <= 1) return x;
  const double ep = double(par.ep), w = double(dtype_bytes(config));
  x.counts = (ep - 1) * double(d.n_expert / par.ep) * double(sizeof(std::int32_t));
  x.rows = double(d.top_k) * double(config.train.micro_batch) * double(d.S / par.cp) * double(d.C) *
           w * (ep - 1) / ep;
  x.forward = x.counts + 2 * x.rows;
  x.backward = 2 * x.rows;
  return x;
}

namespace {

// Bytes per element of each kind of buffer, in the types of the precision policy: compute
// weights (w), gradients (wg), masters and moments (state_w; the masters are kept apart from
// the compute weights only when the two types differ), and statistics of the activations
// (w_stat, the compute type's accumulate type).
struct ElementBytes {
  PrecisionPolicy policy;
  double w, wg, state_w, w_stat;
  double state_copies;  // optimizer-state elements per updated element (moments, masters)
};

ElementBytes element_bytes(const Config& config) {
  ElementBytes b;
  b.policy = deck::precision_policy(config);
  b.w = double(bytes_of(b.policy.compute));
  b.wg = double(bytes_of(b.policy.grad));
  b.state_w = double(bytes_of(b.policy.master));
  b.w_stat = b.policy.compute == Precision::bf16 ? 4.0 : b.w;
  const bool mixed = b.policy.master != b.policy.compute;  // masters apart from compute weights
  b.state_copies = (config.train.optimizer == "adamw" ? 2.0 : 0.0) + (mixed ? 1.0 : 0.0);
  return b;
}

// Parameters, gradients, optimizer state and ZeRO windows: the sizes the data-parallel
// engine allocates (parallel/data_parallel.hpp), chunk by chunk; and the experts' part of it.
void add_training_state(MemoryEstimate& est, const Config& config, const model::ShardCoord& coord,
                        const std::vector<model::ChunkLayout>& chunks, const ElementBytes& b) {
  // With experts split over ep, ZeRO shards them over the expert-grad group.
  for (const auto& ch : chunks) {
    const auto z = data_parallel_sizes(
        ch, zero_group_size(config, coord), int(config.parallel.zero), config.parallel.bucket_mb,
        std::size_t(b.wg), config.parallel.ep > 1 ? expert_grad_size(config) : 0,
        b.policy.wire != b.policy.grad);
    est.bytes[idx(MemCategory::params)] += double(z.params) * b.w;
    est.bytes[idx(MemCategory::grads)] += double(z.grads) * b.wg;
    est.bytes[idx(MemCategory::optimizer)] +=
        double(z.optimizer_range) * b.state_w * b.state_copies;
    // checkpoint%async: the host snapshot of the owned masters and moments while a write is in
    // flight (ckpt/training.hpp). On a GPU it is host memory, not the device's counted here.
    if (config.checkpoint.async && config.backend.device != "cuda")
      est.bytes[idx(MemCategory::workspace)] +=
          double(z.optimizer_range) * b.state_w *
          (1.0 + (config.train.optimizer == "adamw" ? 2.0 : 0.0));
    est.bytes[idx(MemCategory::comm)] += double(z.comm_grads) * b.wg + double(z.comm_params) * b.w +
                                         double(z.comm_wire) * double(sizeof(bf16));
  }
  // Every expert element has its parameter, gradient and optimizer state here, or (ZeRO) its
  // share of the shards of the group it is reduced over (the expert-grad group when experts
  // are split over ep).
  const int zero = int(config.parallel.zero);
  const double D = double(config.parallel.ep > 1 ? expert_grad_size(config)
                                                 : zero_group_size(config, coord)),
               experts = double(est.expert_params);
  est.expert_param_bytes = experts * b.w / (zero >= 3 ? D : 1.0);
  est.expert_grad_bytes = experts * b.wg / (zero >= 2 ? D : 1.0);
  est.expert_optimizer_bytes = experts * b.state_w * b.state_copies / (zero >= 1 ? D : 1.0);
}

// Each chunk's activation slots and scratch, ring attention's buffers and a bf16 gemm's panels.
void add_activations(MemoryEstimate& est, const Config& config, const model::ShardCoord& coord,
                     const std::vector<model::ChunkLayout>& chunks, const StageNeeds& needs,
                     const ElementBytes& b) {
  const model::Dims d = model::dims_of(config);
  const std::int64_t T = d.S / config.parallel.cp;
  // Each chunk keeps as many micro-batches as its rank's schedule has in flight (GPipe all
  // m, 1F1B p - rank, ...): the slots the trainer allocates, from the same checker.
  // train%recompute: blocks keep less, and one block's recomputed tensors share a workspace
  // the stage charges to activations (model/stage.cpp).
  const model::Recompute recompute = model::recompute_mode(config.train.recompute);
  for (const auto& ch : chunks) {  // each stage carves its slots and its own scratch
    const auto act = model::activation_sizes(d, coord, config.train.micro_batch, T, ch.has_head,
                                             config.parallel.sequence_parallel && coord.tp > 1,
                                             recompute, ch.has_embedding);
    model::SlotCounts slots = needs.in_flight[std::size_t(ch.chunk)];
    if (ch.has_embedding && ch.has_head) slots.weight = 0;  // such a stage does not split
    est.bytes[idx(MemCategory::activations)] +=
        model::activation_bytes(act, ch.n_layers, slots, b.w, b.w_stat, b.wg);
    est.bytes[idx(MemCategory::workspace)] +=
        double(act.scratch) * b.w + double(act.scratch_grads) * b.wg;
  }
  // Ring attention's backward buffers, held during one block's attention at a time. (The
  // attention kernel's blocks live in Kokkos team scratch, a few (64, 64) blocks per thread:
  // not a tracked allocation, and on a GPU in on-chip shared memory.)
  // A bf16 gemm's fp32 panels (kernels/gemm.hpp) are held while it runs, never during the
  // ring's attention: the larger of the two.
  est.bytes[idx(MemCategory::workspace)] += std::max(
      estimate_ring(config).workspace, double(kernels::gemm_workspace_bytes(b.policy.compute)));
}

// A pipeline's message buffers, each one stage input (R rows of d_model), and on a chunk with
// wte but not both ends, the whole-tensor buffer its gradient is summed in.
void add_pipeline_buffers(MemoryEstimate& est, const Config& config, const model::ShardCoord& coord,
                          const std::vector<model::ChunkLayout>& chunks, const StageNeeds& needs,
                          const ElementBytes& b) {
  if (config.parallel.pp <= 1) return;
  const model::Dims d = model::dims_of(config);
  const auto shape = model::act_shape(d, coord, config.train.micro_batch, d.S / config.parallel.cp,
                                      config.parallel.sequence_parallel && coord.tp > 1);
  est.bytes[idx(MemCategory::comm)] += double(needs.buffers) * double(shape.R * d.C) * b.w;
  // One buffer per rank, also where both ends are its chunks (zb-v).
  for (const auto& ch : chunks)
    for (const auto& t : ch.tensors)
      if (t.name == "wte.weight" && !(ch.has_embedding && ch.has_head)) {
        est.bytes[idx(MemCategory::comm)] += double(t.numel) * b.wg;
        return;
      }
}

MemoryEstimate estimate_shard(const Config& config, const model::ShardCoord& coord,
                              const StageNeeds& needs) {
  MemoryEstimate est;
  const auto chunks = model::build_layout(config, coord);
  for (const auto& ch : chunks)
    for (const auto& t : ch.tensors) (t.expert ? est.expert_params : est.dense_params) += t.numel;
  est.local_params = est.dense_params + est.expert_params;
  const ElementBytes b = element_bytes(config);
  add_training_state(est, config, coord, chunks, b);
  add_activations(est, config, coord, chunks, needs, b);
  add_pipeline_buffers(est, config, coord, chunks, needs, b);
  return est;
}

}  // namespace

MemoryEstimate estimate_memory(const Config& config, const model::ShardCoord& coord) {
  return estimate_shard(config, coord, stage_needs(config).at(std::size_t(coord.p)));
}

namespace {

double ring(double n) { return (n - 1) / n; }

// What the estimates need of the chunks a rank holds: their layer counts, and from one pass
// over their units and the rank's schedule:
struct ShardFacts : model::LayerCounts {
  double embedding_bytes = 0;  // of the embedding unit
  // Split backwards (zero-bubble schedules) per step: blocks whose W ran apart from their B,
  // and the bytes of those blocks' parameters (W gathers them again under ZeRO 3 when it
  // reruns a recomputation).
  double split_blocks = 0, split_block_bytes = 0;
};

ShardFacts shard_facts(const Config& config, const model::ShardCoord& coord, double w) {
  const auto chunks = model::build_layout(config, coord);
  ShardFacts f{model::layer_counts(config, chunks)};
  for (const auto& ch : chunks)
    for (const auto& u : model::units_of(ch))
      if (u.kind == model::Unit::embedding) f.embedding_bytes += double(u.hi - u.lo) * w;
  if (coord.pp > 1) {  // this rank's list: its Ws per chunk
    const auto& par = config.parallel;
    const OpList list =
        make_rank_schedule(schedule_kind(par.pp_schedule), coord.pp,
                           int(micro_batches_per_step(config)), int(par.virtual_stages), coord.p);
    for (const Op& op : list) {
      if (op.kind != OpKind::backward_weight) continue;
      const auto& ch = chunks[std::size_t(op.chunk)];
      f.split_blocks += double(ch.n_layers);
      for (const auto& u : model::units_of(ch))
        if (u.kind == model::Unit::block) f.split_block_bytes += double(u.hi - u.lo) * w;
    }
  }
  return f;
}

// Data parallel: gradients of the dense parameters over d,e,c; with ep > 1 experts over d,c
// (at ep = 1 the two groups are the same ranks, and one reduction takes both). As
// parallel/data_parallel.hpp does it: ZeRO 2/3 reduce-scatter after every micro-batch,
// ZeRO 3 gathers every unit for its forward and its backward (the embedding, which the
// tied head shares, once per step).
// Gradients move in the wire type (ww bytes: the grad type, or bf16 for ZeRO 2/3 with the
// bf16 wire), parameter gathers in the compute type (w).
// Hybrid sharding (parallel%zero_scope = 'node', shards over L ranks of a node, N = D/L
// nodes): ZeRO 1 all-reduces over D and gathers inside the node; ZeRO 2/3 reduce-scatter and
// gather inside the node and all-reduce the shard across the nodes once a step.
// A split backward whose W reruns a recomputation gathers its blocks' parameters once more
// (ZeRO 3): `regather` bytes a step.
void add_data_parallel(std::vector<CommEstimate>& out, const Config& config,
                       const MemoryEstimate& mem, const ShardFacts& f, double m, double w,
                       double ww, int zero_shards) {
  const int zero = int(config.parallel.zero);
  const double emb = f.embedding_bytes;  // compute type
  const double regather =
      zero == 3 && model::recompute_mode(config.train.recompute) != model::Recompute::none
          ? f.split_block_bytes
          : 0.0;
  auto dp_volume = [&](double N, double D) {  // N elements
    const double G = N * ww, S = N * w;
    switch (zero) {
      case 0:
        return 2 * ring(D) * G;
      case 1:
        return 2 * ring(D) * G + ring(D) * S;
      case 2:
        return m * ring(D) * G + ring(D) * S;
      default:
        return m * ring(D) * G + ring(D) * (m * 2 * (S - emb) + emb + regather);
    }
  };
  const char* dp_formula[] = {"2(D-1)/D*S all-reduce", "2(D-1)/D*S + (D-1)/D*S all-gather",
                              "m*(D-1)/D*S reduce-scatter + (D-1)/D*S all-gather",
                              "m*(D-1)/D*S reduce-scatter + (D-1)/D*(2m(S-E)+E) all-gathers"};
  const bool split = config.parallel.ep > 1;
  const double dense = double(split ? mem.dense_params : mem.local_params);
  const double D = double(dense_grad_size(config)), L = double(zero_shards);
  if (zero >= 1 && L < D) {
    const double G = dense * ww, S = dense * w, nodes = D / L;
    CommEstimate c{GroupKind::dense_grad, 0, ""};
    if (zero == 1) {
      c.intra_only = ring(L) * S;
      c.bytes_per_step = 2 * ring(D) * G + c.intra_only;
      c.formula = "2(D-1)/D*S all-reduce + (L-1)/L*S all-gather in the node";
    } else {
      c.intra_only =
          m * ring(L) * G + ring(L) * (zero == 2 ? S : m * 2 * (S - emb) + emb + regather);
      c.inter_only = 2 * ring(nodes) * G / L;
      c.bytes_per_step = c.intra_only + c.inter_only;
      c.formula = zero == 2 ? "m*(L-1)/L*S reduce-scatter + (L-1)/L*S all-gather in the node, "
                              "2(N-1)/N*S/L all-reduce across"
                            : "m*(L-1)/L*S reduce-scatter + (L-1)/L*(2m(S-E)+E) all-gathers in "
                              "the node, 2(N-1)/N*S/L all-reduce across";
    }
    out.push_back(c);
    return;
  }
  out.push_back({GroupKind::dense_grad, dp_volume(dense, D), dp_formula[zero]});
  if (split && mem.expert_params > 0)
    out.push_back({GroupKind::expert_grad,
                   dp_volume(double(mem.expert_params), double(expert_grad_size(config))),
                   dp_formula[zero]});
}

// The per-micro-batch sizes the group formulas share, for one rank's chunks.
struct StepFacts {
  ShardFacts f;
  double m = 0, B = 0, Tl = 0, w = 0;  // micro-batches per step, samples, local positions, bytes
  double wg = 0, ww = 0;               // bytes of a gradient element, and on the data-parallel wire
  double act = 0;                      // one (B, T, C) activation, bytes
  double k = 0;                        // experts per token
  model::Recompute recompute = model::Recompute::none;
  bool full() const { return recompute == model::Recompute::full; }
  bool selective() const { return recompute == model::Recompute::selective; }
};

// Tensor parallel, per micro-batch, as the layers do it (model/layers.hpp): 2 all-reduces of
// (b, s, h) per block each way, one for the embedding (forward) and one for the head
// (backward); the loss's row max and (sum-exp, target logit); with sequence parallelism each
// all-reduce is a reduce-scatter + all-gather of the same volume, and every LayerNorm's
// parameter gradients (2h) are summed over tp. A MoE layer has the dense MLP's collectives
// and sums its gates' gradient (b*s*k) over tp. Recomputation reruns forward collectives in
// the backward: full, each block's two; selective under SP, its LayerNorm outputs' two
// all-gathers.
CommEstimate tensor_parallel(const Config& config, const StepFacts& s) {
  const auto& par = config.parallel;
  const double T = double(par.tp), L = double(s.f.layers),
               d_model = double(model::dims_of(config).C);
  const double n_ar = 4.0 * L + (s.f.first ? 1.0 : 0.0) + (s.f.last ? 1.0 : 0.0);
  double tp = s.m * n_ar * 2 * ring(T) * s.act;
  if (s.f.last) tp += s.m * 3.0 * 2 * ring(T) * s.B * s.Tl * s.w;
  if (par.sequence_parallel)
    tp += s.m * (2.0 * L + (s.f.last ? 1.0 : 0.0)) * 2 * ring(T) * 2.0 * d_model * s.w;
  tp += s.m * double(s.f.moe_layers) * 2 * ring(T) * s.B * s.Tl * s.k * s.w;
  if (s.full()) tp += s.m * L * 2 * 2 * ring(T) * s.act;
  if (s.selective() && par.sequence_parallel) tp += s.m * L * 2 * ring(T) * s.act;
  // A split backward's W: under SP each block gathers the rows of d(res2) and d(res3) again,
  // and reruns a recomputation's collectives.
  const double split = s.f.split_blocks;
  if (par.sequence_parallel) tp += split * 2 * ring(T) * s.act;
  if (s.full()) tp += split * 2 * 2 * ring(T) * s.act;
  if (s.selective() && par.sequence_parallel) tp += split * 2 * ring(T) * s.act;
  return {GroupKind::tp, tp,
          cat("m*(4L+2)*2(T-1)/T*b*s*h + loss 3*b*s (+ SP: LayerNorm grads 2h each)",
              s.f.moe_layers > 0 ? " + MoE gate grads m*L_moe*2(T-1)/T*b*s*k" : "",
              s.full()                                 ? " + recompute: m*L*2*2(T-1)/T*b*s*h"
              : s.selective() && par.sequence_parallel ? " + recompute: m*L*2*(T-1)/T*b*s*h"
                                                       : "",
              split > 0 ? " + split backwards' W: again per block" : "")};
}

// Context parallel: every block's attention is a ring over cp (estimate_ring); a MoE layer's
// forward gathers the group's expert choices (int32, b*(s/C)*k per rank) and sums the
// router's mean probabilities (E doubles). Recomputation (selective and full) reruns each
// attention's forward ring, and full also the routing.
CommEstimate context_parallel(const Config& config, const StepFacts& s) {
  const auto& par = config.parallel;
  const RingEstimate r = estimate_ring(config);
  const double C = double(par.cp), E = double(model::dims_of(config).n_expert);
  const double L = double(s.f.layers), L_moe = double(s.f.moe_layers);
  const double moe = par.cp > 1 ? (C - 1) * s.B * s.Tl * s.k * 4.0 + 2 * ring(C) * E * 8.0 : 0.0;
  double cp = s.m * (L * r.per_layer() + L_moe * moe);
  if (s.recompute != model::Recompute::none) cp += (s.m * L + s.f.split_blocks) * r.forward;
  if (s.full()) cp += s.m * L_moe * moe;
  return {GroupKind::cp, cp,
          cat("m*L*(3C-2)*2*b*(s/C)*h/T: (C-1) K/V fwd, (C-1) K/V + C dK/dV bwd",
              L_moe > 0 ? " + MoE routing m*L_moe*((C-1)*b*(s/C)*k*4 + 2(C-1)/C*E*8)" : "",
              s.recompute == model::Recompute::none ? ""
              : s.full()                            ? " + recompute: forward again"
                                                    : " + recompute: ring forward again")};
}

// Expert parallel (estimate_experts): token rows out and back, forward and backward, and the
// forward's row counts, under uniform routing without drops; full recomputation routes again.
CommEstimate expert_parallel(const Config& config, const StepFacts& s) {
  const ExpertEstimate x = estimate_experts(config);
  const double per_layer = x.per_layer() + (s.full() ? x.forward : 0.0);
  return {GroupKind::ep, s.m * double(s.f.moe_layers) * per_layer,
          cat("m*L_moe*(4*k*b*s*h*(ep-1)/ep + (ep-1)*(E/ep)*4): rows out+back fwd+bwd, counts",
              s.full() ? " + recompute: forward again" : "")};
}

}  // namespace

std::vector<CommEstimate> estimate_comm(const Config& config, const model::ShardCoord& coord) {
  const auto& par = config.parallel;
  const model::Dims d = model::dims_of(config);
  StepFacts s;
  s.w = double(dtype_bytes(config));
  s.wg = double(bytes_of(deck::precision_policy(config).grad));
  s.ww = double(bytes_of(deck::precision_policy(config).wire));
  s.m = double(micro_batches_per_step(config));
  s.B = double(config.train.micro_batch), s.Tl = double(d.S / par.cp);
  s.act = s.B * s.Tl * double(d.C) * s.w;
  s.k = double(d.top_k);
  s.f = shard_facts(config, coord, s.w);
  s.recompute = model::recompute_mode(config.train.recompute);
  const bool first = s.f.first, last = s.f.last;
  std::vector<CommEstimate> out;
  add_data_parallel(out, config, estimate_memory(config, coord), s.f, s.m, s.w, s.ww,
                    zero_group_size(config, coord));
  out.push_back(tensor_parallel(config, s));
  out.push_back(context_parallel(config, s));
  out.push_back(expert_parallel(config, s));

  // Pipeline: activations forward, their gradients backward, per micro-batch and chunk (the
  // V's turn on the last rank is sent to itself, counted alike).
  double pp = 0;
  if (par.pp > 1)
    for (const auto& ch : model::build_layout(config, coord))
      pp += s.m * s.act * ((ch.has_head ? 0.0 : 1.0) + (ch.has_embedding ? 0.0 : 1.0));
  out.push_back({GroupKind::pp, pp, "m*b*s*h per chunk and direction"});

  // Tied embedding: both ends' dense-grad groups (2*D ranks with this tp rank) all-reduce
  // the wte gradient, each rank contributing its shard of it (parallel/trainer.cpp); in a V
  // both ends are the first stage's, its D ranks.
  double embed = 0;
  const bool v_shape = coord.v_shape;
  const double ends = (v_shape ? 1.0 : 2.0) * double(dense_grad_size(config));
  if (par.pp > 1 && (first || last))
    embed = ring(ends) * 2.0 * double(d.Vpad / par.tp) * double(d.C) * s.wg;
  out.push_back({GroupKind::embed, embed,
                 v_shape ? "2(n-1)/n*V/T*h all-reduce, n = D ranks (both ends on stage 0)"
                         : "2(n-1)/n*V/T*h all-reduce, n = 2*D ranks"});
  return out;
}

// ---- Will it fit? ---------------------------------------------------------------------------

MemoryBudget memory_budget(const Config& config, const FitOptions& fit, int ranks_per_node) {
  MemoryBudget b;
  if (fit.memory > 0) {
    b.bytes = fit.memory;
    b.source = "--memory";
    return b;
  }
  if (config.backend.device == "cuda") {
    b.source = "backend%device = 'cuda': pass the GPU's memory as --memory, e.g. --memory 80GiB";
    return b;
  }
  const NodeMemory node = node_memory();
  const int n = std::max(1, ranks_per_node);
  b.bytes = node.bytes / n;
  b.source = cat("this node's ", format_bytes(node.bytes), " (", node.source, ") / ", n,
                 n == 1 ? " rank" : " ranks", " per node; --memory sets it");
  return b;
}

namespace {

// The largest shard, the schedule's needs worked out once for every stage.
LargestShard largest_of(const Config& config, int ranks_per_node) {
  const auto needs = stage_needs(config);
  LargestShard l{0, -1.0};
  for (int p = 0; p < int(config.parallel.pp); ++p) {
    const double b =
        estimate_shard(config, shard_of(config, 0, p, 0, ranks_per_node), needs[std::size_t(p)])
            .total();
    if (b > l.bytes) l = {p, b};
  }
  return l;
}

}  // namespace

// The FLOPs per token recomputation adds, as model FLOPs count them (6*N + 12*L*h*s, causal
// masking not discounted): full reruns every block's forward, a third of the blocks' share
// (all but the LM head's 6*V*h); selective reruns the attention (4*h*s per layer: scores and
// the weighted sum), two LayerNorms (about 8 FLOPs an element, h wide) and a dense block's
// GELU (about 20 an element, 4h wide).
double recompute_flops_per_token(const Config& config) {
  const model::Dims d = model::dims_of(config);
  switch (model::recompute_mode(config.train.recompute)) {
    case model::Recompute::none:
      return 0;
    case model::Recompute::full:
      return (model::flops_per_token(config) - 6.0 * double(d.V) * double(d.C)) / 3.0;
    case model::Recompute::selective:
      break;
  }
  double dense = 0;
  for (std::int64_t i = 0; i < d.L; ++i) dense += d.is_moe_layer(i) ? 0.0 : 1.0;
  return double(d.L) * (4.0 * double(d.C) * double(d.S) + 2 * 8.0 * double(d.C)) +
         dense * 20.0 * double(d.F);
}

namespace {

// A step on one rank as the plan sees it: model FLOPs (with recomputation's) over the world at
// the peak, stretched by the pipeline bubble, plus every group's bytes (rank 0's shard) at the
// bandwidth, nothing overlapped.
struct StepCost {
  double flops = 0, bytes = 0, bubble = 0, seconds = 0;
};
StepCost step_cost(const Config& config, int world, int ranks_per_node, const StepRates& rates) {
  StepCost s;
  const double tokens = double(config.train.global_batch) * double(model::dims_of(config).S);
  s.flops = (model::flops_per_token(config) + recompute_flops_per_token(config)) * tokens / world;
  s.bubble = config.parallel.pp > 1 ? pipeline_bubble(config) : 0.0;
  for (const auto& c : estimate_comm(config, shard_of(config, 0, 0, 0, ranks_per_node)))
    s.bytes += c.bytes_per_step;
  s.seconds = s.flops / (rates.gflops * 1e9) / (1 - s.bubble) + s.bytes / rates.bandwidth;
  return s;
}

const char* const kLevels[] = {"none", "selective", "full"};

// One point of the search: how far each knob moved from the deck's setting. recompute and zero
// are the level and stage themselves; tp, pp the factors they grow by (dp shrinks by both);
// micro the divisor of the micro-batch.
struct Knobs {
  int recompute = 0, zero = 0, tp = 1, pp = 1, micro = 1;
  auto key() const { return std::make_tuple(recompute, zero, tp, pp, micro); }
  bool operator<(const Knobs& o) const { return key() < o.key(); }
  bool operator==(const Knobs& o) const { return key() == o.key(); }
  bool within(const Knobs& o) const {  // no knob moved further than in o
    return recompute <= o.recompute && zero <= o.zero && tp <= o.tp && pp <= o.pp &&
           micro <= o.micro;
  }
};

struct Point {
  Config config;
  LargestShard largest;
};

class FitSearch {
 public:
  FitSearch(const Config& base, int world, int ranks_per_node)
      : base_(base), world_(world), ranks_per_node_(ranks_per_node) {}

  Knobs deck() const {
    Knobs k;
    k.recompute = int(model::recompute_mode(base_.train.recompute));
    k.zero = int(base_.parallel.zero);
    return k;
  }
  // ZeRO stages change anything only over more than one rank.
  bool zero_helps() const { return dense_grad_size(base_) > 1; }

  // The deck with k, validated for the world, and its largest shard; null when the deck's
  // rules refuse the combination.
  const Point* at(const Knobs& k) {
    auto it = cache_.find(k);
    if (it == cache_.end()) it = cache_.emplace(k, evaluate(k)).first;
    return it->second ? &*it->second : nullptr;
  }

  std::vector<std::string> sets(const Knobs& k) const {
    std::vector<std::string> s;
    const Knobs d = deck();
    const auto& par = base_.parallel;
    if (k.recompute != d.recompute)
      s.push_back(cat("train%recompute='", kLevels[k.recompute], "'"));
    if (k.zero != d.zero) s.push_back(cat("parallel%zero=", k.zero));
    if (k.tp > 1) s.push_back(cat("parallel%tp=", par.tp * k.tp));
    if (k.pp > 1) s.push_back(cat("parallel%pp=", par.pp * k.pp));
    if (k.tp * k.pp > 1) s.push_back(cat("parallel%dp=", par.dp / (k.tp * k.pp)));
    if (k.micro > 1) s.push_back(cat("train%micro_batch=", base_.train.micro_batch / k.micro));
    return s;
  }

  // Every combination of knob settings past the deck's, fewest steps first.
  std::vector<Knobs> candidates(int ranks_per_node) const {
    const Knobs d = deck();
    const auto& par = base_.parallel;
    std::vector<int> levels, stages, micros;
    for (int r = d.recompute; r <= 2; ++r) levels.push_back(r);
    for (int z = d.zero; z <= (zero_helps() ? 3 : d.zero); ++z) stages.push_back(z);
    for (std::int64_t k = 1; k <= base_.train.micro_batch; ++k)
      if (base_.train.micro_batch % k == 0) micros.push_back(int(k));
    // tp and pp grow by powers of two up to 8 while dp divides; tp groups stay within a node;
    // pp only with the even split (no parallel%pp_layers).
    bool even = true;
    for (auto n : par.pp_layers) even = even && n == 0;
    std::vector<std::pair<int, int>> grids;
    for (int a = 1; a <= 8; a *= 2)
      for (int b = 1; b <= 8; b *= 2) {
        if (par.dp % (a * b) != 0) continue;
        if (a > 1 && par.tp * a > std::max<std::int64_t>(ranks_per_node, par.tp)) continue;
        if (b > 1 && !even) continue;
        grids.push_back({a, b});
      }
    std::vector<std::pair<int, Knobs>> out;
    for (std::size_t i = 0; i < levels.size(); ++i)
      for (std::size_t j = 0; j < stages.size(); ++j)
        for (std::size_t g = 0; g < grids.size(); ++g)
          for (std::size_t u = 0; u < micros.size(); ++u) {
            if (i + j + g + u == 0) continue;  // the deck itself
            Knobs k{levels[i], stages[j], grids[g].first, grids[g].second, micros[u]};
            const int steps = int(i + j + u) + int(std::log2(double(k.tp * k.pp)) + 0.5);
            out.push_back({steps, k});
          }
    std::stable_sort(out.begin(), out.end(),
                     [](const auto& x, const auto& y) { return x.first < y.first; });
    std::vector<Knobs> knobs;
    for (const auto& [steps, k] : out) knobs.push_back(k);
    return knobs;
  }

 private:
  std::optional<Point> evaluate(const Knobs& k) const {
    Config c = base_;
    c.train.recompute = kLevels[k.recompute];
    c.parallel.zero = k.zero;
    c.parallel.tp *= k.tp, c.parallel.pp *= k.pp;
    c.parallel.dp /= k.tp * k.pp;
    c.train.micro_batch /= k.micro;
    try {
      deck::validate(c, world_);
      return Point{c, largest_of(c, ranks_per_node_)};
    } catch (const Error&) {
      return std::nullopt;
    }
  }

  const Config& base_;
  int world_, ranks_per_node_;
  std::map<Knobs, std::optional<Point>> cache_;
};

constexpr int kMaxCandidates = 600;

std::vector<FitChange> search_changes(FitSearch& search, const Config& config, int world,
                                      int ranks_per_node, double budget, const StepRates& rates,
                                      FitChange* least) {
  std::vector<Knobs> fitting;
  FitChange best;
  best.largest = -1;
  int evaluated = 0;  // a bound on the work for very large grids: the fewest steps come first
  for (const Knobs& k : search.candidates(ranks_per_node)) {
    bool dominated = false;
    for (const Knobs& f : fitting) dominated = dominated || f.within(k);
    if (dominated) continue;
    if (++evaluated > kMaxCandidates) break;
    const Point* p = search.at(k);
    if (!p) continue;
    if (best.largest < 0 || p->largest.bytes < best.largest) {
      best.sets = search.sets(k);
      best.largest = p->largest.bytes, best.largest_p = p->largest.p;
    }
    if (p->largest.bytes <= budget) fitting.push_back(k);
  }
  if (least) *least = best;
  const StepCost before = step_cost(config, world, ranks_per_node, rates);
  std::vector<FitChange> out;
  for (const Knobs& k : fitting) {
    const Point* p = search.at(k);
    const StepCost after = step_cost(p->config, world, ranks_per_node, rates);
    FitChange c;
    c.sets = search.sets(k);
    c.largest = p->largest.bytes, c.largest_p = p->largest.p;
    c.extra_flops = after.flops - before.flops;
    c.extra_bytes = after.bytes - before.bytes;
    c.bubble_before = before.bubble, c.bubble = after.bubble;
    c.extra_seconds = after.seconds - before.seconds;
    c.fraction = before.seconds > 0 ? c.extra_seconds / before.seconds : 0.0;
    out.push_back(std::move(c));
  }
  std::stable_sort(out.begin(), out.end(), [](const FitChange& a, const FitChange& b) {
    return a.extra_seconds != b.extra_seconds ? a.extra_seconds < b.extra_seconds
                                              : a.largest < b.largest;
  });
  return out;
}

std::string join_sets(const std::vector<std::string>& sets) {
  std::string s;
  for (const auto& v : sets) s += cat(s.empty() ? "" : " ", "--set ", v);
  return s;
}

std::string signed_percent(double f) { return fixed(f >= 0 ? "+%.1f%%" : "%.1f%%", 100 * f); }

// "+2.1% step time (+0.028 s): recomputation +2.9e+13 FLOPs per rank, +1.20 GiB sent per rank,
// bubble 3.0% -> 5.9%"
std::string cost_words(const FitChange& c) {
  std::string why;
  auto add = [&](const std::string& s) { why += (why.empty() ? "" : ", ") + s; };
  if (c.extra_flops != 0)
    add(cat("recomputation ", fixed("%+.3g", c.extra_flops), " FLOPs per rank"));
  if (std::abs(c.extra_bytes) >= 1)
    add(cat(c.extra_bytes > 0 ? "+" : "-", format_bytes(std::abs(c.extra_bytes)),
            " sent per rank"));
  if (std::abs(c.bubble - c.bubble_before) > 1e-12)
    add(cat("bubble ", fixed("%.1f%%", 100 * c.bubble_before), " -> ",
            fixed("%.1f%%", 100 * c.bubble)));
  return cat(signed_percent(c.fraction), " step time (", fixed("%+.3g s", c.extra_seconds), ")",
             why.empty() ? "" : ": " + why);
}

std::string rates_words(const StepRates& r) {
  return cat("compute at ", fixed("%.6g", r.gflops), " GFLOP/s per rank",
             r.gflops_assumed ? " (assumed: set backend%peak_gflops)" : " (backend%peak_gflops)",
             ", communication at ", fixed("%.4g", r.bandwidth / 1e9), " GB/s per rank",
             r.bandwidth_assumed ? " (assumed: set --bandwidth)" : " (--bandwidth)");
}

int rank_at(const Layout& layout, int t, int p, int e) {
  Coords c{};
  c[int(Axis::t)] = t;
  c[int(Axis::p)] = p;
  c[int(Axis::e)] = e;
  return layout.rank(c);
}

}  // namespace

LargestShard largest_shard(const Config& config, int ranks_per_node) {
  return largest_of(config, ranks_per_node);
}

StepRates step_rates(const Config& config, double bandwidth) {
  const bool gpu = config.backend.device == "cuda";
  StepRates r;
  r.gflops = config.backend.peak_gflops;
  if (r.gflops <= 0) r.gflops = gpu ? 1e5 : 100.0, r.gflops_assumed = true;
  r.bandwidth = bandwidth;
  if (r.bandwidth <= 0) r.bandwidth = gpu ? 100e9 : 10e9, r.bandwidth_assumed = true;
  return r;
}

std::vector<FitChange> fit_changes(const Config& config, int world, int ranks_per_node,
                                   double budget, const StepRates& rates, FitChange* least) {
  if (largest_of(config, ranks_per_node).bytes <= budget) return {};
  FitSearch search(config, world, ranks_per_node);
  return search_changes(search, config, world, ranks_per_node, budget, rates, least);
}

std::string fit_refusal(const Config& config, const Layout& layout, const MemoryBudget& budget,
                        double bandwidth) {
  if (budget.bytes <= 0) return "";
  const LargestShard big = largest_of(config, layout.max_ranks_per_node());
  if (big.bytes <= budget.bytes) return "";
  FitChange least;
  const auto changes = fit_changes(config, layout.world(), layout.max_ranks_per_node(),
                                   budget.bytes, step_rates(config, bandwidth), &least);
  std::string r = cat("ptrain: will not fit: the plan puts ", format_bytes(big.bytes), " on rank ",
                      rank_at(layout, 0, big.p, 0), "'s shard, more than the ",
                      format_bytes(budget.bytes), " a rank has (", budget.source, "); ");
  if (changes.empty()) {
    r += "no change of train%recompute, parallel%zero, parallel%tp/pp or train%micro_batch fits";
    if (!least.sets.empty())
      r += cat(" (the least is ", format_bytes(least.largest), ", with ", join_sets(least.sets),
               ")");
    r += ": more ranks, more memory per rank or a smaller model";
  } else {
    r += "changes that fit, cheapest first: ";
    for (std::size_t i = 0; i < changes.size() && i < 3; ++i)
      r += cat(i ? "; " : "", join_sets(changes[i].sets), " (", format_bytes(changes[i].largest),
               ", ", signed_percent(changes[i].fraction), " step time)");
  }
  return r + "; `ptrain --plan` with the same options gives the figures";
}

// The deck's pipeline schedule in simulated time (forward 1 cell, backward 2), or, when
// that is too wide to read, the same schedule with m = 2p micro-batches.
std::string schedule_picture(const Config& config) {
  const int P = int(config.parallel.pp), v = int(config.parallel.virtual_stages);
  const int deck_m = int(micro_batches_per_step(config));
  constexpr int kMostRows = 32;  // a picture of more stages is not read, and grows as p^2
  if (P > kMostRows)
    return cat("pipeline schedule '", config.parallel.pp_schedule, "', p = ", P, ", v = ", v,
               ", m = ", deck_m, ": not drawn for more than ", kMostRows,
               " stages; equal-stage bubble ", pipeline_bubble_formula(config), " = ",
               fixed("%.1f%%", 100 * pipeline_bubble(config)), "\n");
  const int m = 3 * v * deck_m + P <= 60 ? deck_m : 2 * P;
  const ScheduleKind kind = schedule_kind(config.parallel.pp_schedule);
  const auto lists = make_schedule(kind, P, m, v);
  const Pipeline pipe = pipeline_of(kind, P, m, v);
  const auto timing = simulate_schedule(lists, pipe);
  std::string r =
      cat("pipeline schedule '", config.parallel.pp_schedule, "', p = ", P, ", v = ", v,
          ", m = ", m, m == deck_m ? "" : cat(" (an example: this deck has m = ", deck_m, ")"),
          "; F<mb> forward, B<mb> backward (two cells",
          kind == ScheduleKind::zb_h1 || kind == ScheduleKind::zb_v
              ? "; split: its input gradient B<mb> one cell, its weight gradient W<mb> one"
              : "",
          "), .. waiting; simulated bubble ", fixed("%.1f%%", 100 * timing.bubble), ":\n");
  std::string picture = format_schedule(lists, pipe);
  while (!picture.empty() && picture.back() == '\n') picture.pop_back();
  std::size_t at = 0;
  while (at < picture.size()) {  // indented like the rest of the report
    const std::size_t end = picture.find('\n', at);
    r += "  " + picture.substr(at, end == std::string::npos ? std::string::npos : end - at + 1);
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return r;
}

namespace {

// How cp cuts a sequence, the ring's traffic and the activation memory it saves (rank 0's
// shard, as the communication section).
std::string context_parallel_line(const Config& config) {
  const auto& par = config.parallel;
  const model::Dims d = model::dims_of(config);
  const bool zigzag = par.cp_layout == "zigzag";
  const RingEstimate ring = estimate_ring(config);
  const model::ShardCoord sc = shard_of(config, 0, 0, 0);
  double per_step = 0;
  for (const auto& c : estimate_comm(config, sc))
    if (c.group == GroupKind::cp) per_step = c.bytes_per_step;
  std::int64_t layers = 0;
  for (const auto& ch : model::build_layout(config, sc)) layers += ch.n_layers;
  Config whole = config;  // the same grid with every rank holding whole sequences
  whole.parallel.cp = 1;
  model::ShardCoord sc1 = sc;
  sc1.cp = 1;
  const int act = idx(MemCategory::activations);
  const double here = estimate_memory(config, sc).bytes[act];
  const double at1 = estimate_memory(whole, sc1).bytes[act];
  return cat("context parallel: ", par.cp_layout, " over ", par.cp, " ranks, ", d.S / par.cp,
             " of ", d.S, " positions each (",
             zigzag ? cat("chunks c and ", 2 * par.cp - 1, "-c of ", 2 * par.cp)
                    : cat("chunk c of ", par.cp),
             "); ring per layer and micro-batch ", format_bytes(ring.per_layer()),
             " sent (forward ", format_bytes(ring.forward), ", backward ",
             format_bytes(ring.backward), "), ", format_bytes(per_step), " per step (",
             micro_batches_per_step(config), " micro-batches x ", layers,
             " layers on rank 0); activations ", format_bytes(here),
             par.pp > 1 ? " on rank 0 (" : " per rank (", format_bytes(at1), " at cp = 1, ",
             format_bytes(at1 - here), " saved)");
}

// The MoE layers: experts per ep rank, routing and capacity, the experts' memory on a rank
// and the all-to-all traffic (rank 0's shard, as the communication section).
std::string moe_line(const Config& config) {
  const auto& par = config.parallel;
  const model::Dims d = model::dims_of(config);
  const ExpertEstimate x = estimate_experts(config);
  const model::ShardCoord sc = shard_of(config, 0, 0, 0);
  const MemoryEstimate mem = estimate_memory(config, sc);
  const ShardFacts f = shard_facts(config, sc, double(dtype_bytes(config)));
  std::int64_t moe_layers = 0;
  for (std::int64_t i = 0; i < d.L; ++i) moe_layers += d.is_moe_layer(i) ? 1 : 0;
  double per_step = 0;
  for (const auto& c : estimate_comm(config, sc))
    if (c.group == GroupKind::ep) per_step = c.bytes_per_step;
  const double cf = config.model.capacity_factor;
  const std::string here = par.pp > 1 ? " on rank 0" : " per rank";
  const std::string capacity =
      cf > 0 ? cat("capacity ", cf, " (ceil(", cf, "*", d.top_k, "*N/", d.n_expert,
                   ") slots per expert for a micro-batch of N tokens: ", x.capacity,
                   " at N = ", x.tokens, ")")
             : std::string("dropless (capacity_factor = 0)");
  const std::string traffic =
      par.ep > 1
          ? cat("all-to-all per MoE layer and micro-batch ", format_bytes(x.per_layer()),
                " (forward ", format_bytes(x.forward), ": counts ", format_bytes(x.counts),
                " + rows out and back 2 x ", format_bytes(x.rows), "; backward ",
                format_bytes(x.backward), "), ", format_bytes(per_step), " per step (",
                micro_batches_per_step(config), " micro-batch(es) x ", f.moe_layers,
                " MoE layers on rank 0",
                config.train.recompute == "full" ? "; full recompute sends the forward's twice"
                                                 : "",
                "), under uniform routing without drops")
          : std::string("no all-to-all (ep = 1: every expert on every rank)");
  return cat("mixture of experts: ", d.n_expert, " experts (", d.n_expert / par.ep,
             " per ep rank), top ", d.top_k, ", ", capacity, ", ", moe_layers, " of ", d.L,
             " blocks (moe_every = ", d.moe_every, "); expert parameters ",
             with_commas(mem.expert_params), here, ": ", format_bytes(mem.expert_param_bytes),
             ", grads ", format_bytes(mem.expert_grad_bytes), ", optimizer ",
             format_bytes(mem.expert_optimizer_bytes), par.zero > 0 ? " (their ZeRO share)" : "",
             "; ", traffic);
}

// The model, the step and its FLOPs, the pipeline and the predicted step time.
std::string model_section(const Config& config, const Layout& layout) {
  std::string r;
  auto line = [&](const std::string& s) { r += s + "\n"; };
  const model::Dims d = model::dims_of(config);
  const auto& par = config.parallel;
  const std::int64_t n_global = model::global_parameter_count(config);
  line(cat("model: ", d.L, " layers, d_model ", d.C, ", ", d.NH, " heads, vocab ", d.V,
           d.Vpad != d.V ? cat(" (padded to ", d.Vpad, ", a multiple of tp)") : std::string(),
           ", seq_len ", d.S, ", dtype ", config.model.dtype));
  const PrecisionPolicy policy = deck::precision_policy(config);
  if (!policy.uniform())
    line(cat("precision: compute ", to_string(policy.compute), " (fp32 arithmetic), gradients ",
             to_string(policy.grad), ", master weights and moments ", to_string(policy.master),
             ", data-parallel wire ", to_string(policy.wire)));
  line(cat("parameters: ", with_commas(n_global),
           " (tied embeddings, learned positions, biases; "
           "before padding)"));
  const double fpt = model::flops_per_token(config);
  line(cat("model FLOPs per token: ", fixed("%.4g", fpt),
           "  (6*N + 12*L*d_model*seq_len, N = parameters less wpe; fwd + bwd)"));
  const std::int64_t m = micro_batches_per_step(config);
  const double tokens = double(config.train.global_batch) * double(d.S);
  line(cat("step: ", config.train.global_batch, " samples = ", fixed("%.0f", tokens), " tokens, ",
           m, " micro-batch(es) of ", config.train.micro_batch, " per rank, ",
           fixed("%.4g", fpt * tokens), " FLOPs"));
  if (par.pp > 1) {
    line(cat("pipeline bubble: ", fixed("%.1f%%", 100 * pipeline_bubble(config)), " (",
             pipeline_bubble_formula(config), ", ", par.pp_schedule, ")"));
    line(schedule_picture(config));
  }
  if (par.cp > 1) line(context_parallel_line(config));
  if (d.n_expert > 0) line(moe_line(config));
  const Machine machine = machine_of(config);
  line(describe_machine(machine));
  const StepPrediction p = predict_step(config, layout, machine);
  line(cat("predicted ", describe_prediction(p)));
  line(cat("FLOPs per step: model ", fixed("%.4g", p.model_flops), ", executed ",
           fixed("%.4g", p.executed_flops), " (recomputation included; MFU and HFU are these over ",
           "the step time and the ", to_string(policy.compute), " gemm peak of every rank)"));
  line("");

  return r;
}

// "fits: 37.25 GiB of 80.00 GiB" / "DOES NOT FIT: 95.10 GiB > 80.00 GiB"; "" without a budget.
std::string fit_words(double bytes, double budget) {
  if (budget <= 0) return "";
  return bytes <= budget ? cat("fits: ", format_bytes(bytes), " of ", format_bytes(budget))
                         : cat("DOES NOT FIT: ", format_bytes(bytes), " > ", format_bytes(budget));
}

// Memory per rank by category, one row per distinct shard, each with its fit.
std::string memory_section(const Config& config, const Layout& layout, double budget) {
  std::string r;
  auto line = [&](const std::string& s) { r += s + "\n"; };
  const auto& par = config.parallel;
  // One row per distinct shard (rank 0 and the ranks that hold other parts of the model).
  line("per-rank memory (shard of the first rank with each (t,p,e) coordinate):");
  char head[256];
  std::snprintf(head, sizeof head, "  %-6s %-8s %14s %11s %11s %11s %11s %11s %11s %11s", "rank",
                "t,p,e", "params", "params", "grads", "optimizer", "activation", "comm",
                "workspace", "total");
  line(head);
  std::vector<Coords> seen;
  const auto rank_of = [&](int t, int p, int e) { return rank_at(layout, t, p, e); };
  int rows = 0;
  const auto needs = stage_needs(config);
  for (int p = 0; p < par.pp; ++p)
    for (int e = 0; e < par.ep; ++e)
      for (int t = 0; t < par.tp; ++t) {
        if (rows >= 16 && !(p == par.pp - 1 && e == par.ep - 1 && t == par.tp - 1)) continue;
        ++rows;
        const auto mem = estimate_shard(
            config, shard_of(config, t, p, e, layout.max_ranks_per_node()), needs[std::size_t(p)]);
        auto b = [&](MemCategory c) { return format_bytes(mem.bytes[idx(c)]); };
        char row[400];
        std::snprintf(row, sizeof row, "  %-6d %-8s %14s %11s %11s %11s %11s %11s %11s %11s",
                      rank_of(t, p, e), cat(t, ",", p, ",", e).c_str(),
                      with_commas(mem.local_params).c_str(), b(MemCategory::params).c_str(),
                      b(MemCategory::grads).c_str(), b(MemCategory::optimizer).c_str(),
                      b(MemCategory::activations).c_str(), b(MemCategory::comm).c_str(),
                      b(MemCategory::workspace).c_str(), format_bytes(mem.total()).c_str());
        const std::string fit = fit_words(mem.total(), budget);
        line(fit.empty() ? std::string(row) : cat(row, "   ", fit));
      }
  line(
      cat("  (ZeRO ", par.zero,
          par.zero_scope == "node" && par.zero >= 1
              ? cat(" over the dense-grad group's ",
                    zero_group_size(config, shard_of(config, 0, 0, 0, layout.max_ranks_per_node())),
                    " ranks on each node, replicated across nodes (parallel%zero_scope = 'node')")
              : cat(" over the dense-grad group of ", dense_grad_size(config), " ranks"),
          par.ep > 1 ? cat(", the experts over the expert-grad group of ", expert_grad_size(config))
                     : std::string(),
          "; activations for ",
          par.pp == 1 ? std::string("1 micro-batch")
                      : cat("the micro-batches in flight under ", par.pp_schedule),
          par.cp > 1 ? cat("; workspace includes ring attention's backward buffers, ",
                           format_bytes(estimate_ring(config).workspace))
                     : std::string(),
          ")"));
  line("");
  return r;
}

// The memory a rank has, whether every shard fits, the largest shard under each recompute
// level and ZeRO stage, and when the deck does not fit, the changes that make it fit.
std::string fit_section(const Config& config, const Layout& layout, const MemoryBudget& budget,
                        double bandwidth) {
  std::string r;
  auto line = [&](const std::string& s) { r += s + "\n"; };
  const LargestShard big = largest_of(config, layout.max_ranks_per_node());
  const bool known = budget.bytes > 0;
  const bool fits = !known || big.bytes <= budget.bytes;
  line(known ? cat("memory per rank: ", format_bytes(budget.bytes), " (", budget.source, "); ",
                   fits ? cat("every shard fits (the largest, rank ", rank_at(layout, 0, big.p, 0),
                              "'s: ", format_bytes(big.bytes), ")")
                        : cat("rank ", rank_at(layout, 0, big.p, 0), "'s shard DOES NOT FIT: ",
                              format_bytes(big.bytes), " > ", format_bytes(budget.bytes)))
             : cat("memory per rank: unknown (", budget.source, ")"));

  // The largest shard under every recompute level and ZeRO stage (stages past the deck's only
  // where they change anything), from the same search the advice uses.
  FitSearch search(config, layout.world(), layout.max_ranks_per_node());
  const Knobs deck = search.deck();
  const int zmax = search.zero_helps() ? 3 : deck.zero, zmin = search.zero_helps() ? 0 : deck.zero;
  line(cat("largest shard by train%recompute x parallel%zero (* the deck's",
           known ? cat("; fits in ", format_bytes(budget.bytes), " per rank?") : std::string(),
           "):"));
  std::string head = "  recompute ";
  for (int z = zmin; z <= zmax; ++z) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%20s", cat("zero ", z).c_str());
    head += buf;
  }
  line(head);
  for (int level = 0; level <= 2; ++level) {
    std::string row =
        cat("  ", kLevels[level], std::string(10 - std::string(kLevels[level]).size(), ' '));
    for (int z = zmin; z <= zmax; ++z) {
      Knobs k = deck;
      k.recompute = level, k.zero = z;
      const Point* p = search.at(k);
      std::string cell =
          !p ? std::string("n/a")
             : cat(k == deck ? "*" : "", format_bytes(p->largest.bytes),
                   known ? (p->largest.bytes <= budget.bytes ? " fits" : " over") : "");
      char buf[64];
      std::snprintf(buf, sizeof buf, "%20s", cell.c_str());
      row += buf;
    }
    line(row);
  }
  if (fits) return r + "\n";

  const StepRates rates = step_rates(config, bandwidth);
  FitChange least;
  const auto changes = search_changes(search, config, layout.world(), layout.max_ranks_per_node(),
                                      budget.bytes, rates, &least);
  if (changes.empty()) {
    line(
        cat("no change of train%recompute, parallel%zero, parallel%tp/pp (this world) or "
            "train%micro_batch makes every shard fit",
            least.sets.empty() ? std::string()
                               : cat("; the least any reaches is ", format_bytes(least.largest),
                                     ", with ", join_sets(least.sets)),
            ": more ranks, more memory per rank or a smaller model"));
    return r + "\n";
  }
  line(cat("changes that make every shard fit, cheapest first (predicted step time: ",
           rates_words(rates), "):"));
  const std::size_t shown = std::min<std::size_t>(changes.size(), 8);
  for (std::size_t i = 0; i < shown; ++i) {
    const FitChange& c = changes[i];
    line(cat("  ", i + 1, ". ", join_sets(c.sets)));
    line(cat("     largest shard ", format_bytes(c.largest), "; ", cost_words(c)));
  }
  if (shown < changes.size()) line(cat("  (", changes.size() - shown, " more)"));
  return r + "\n";
}

}  // namespace

// The share of a group's bytes that crosses nodes, for rank 0's instance of the group: an
// all-to-all (ep) sends to every other member alike, so the share of members on another node;
// the rest run as rings in group-rank order (collectives as MPI rings, the pipeline's and cp's
// neighbours), so the share of ring links whose ends are on different nodes. MPI's own
// algorithm may route differently; this is what a flat ring does.
// A data-parallel group the run reduces in two levels (comm/comm.hpp, HierarchicalComm):
// per rank (L-1)/L of each call's volume inside the node, (N-1)/N of 1/L of it across, the
// same total as the ring's (D-1)/D, of which (N-1)/(D-1) crosses nodes.
NodeSplit node_split(const Config& config, const Layout& layout, GroupKind g) {
  const std::vector<int> m = layout.members(g, 0);
  const int n = int(m.size());
  NodeSplit s;
  if (n <= 1) return s;
  const bool reduction =
      g == GroupKind::dense_grad || (g == GroupKind::expert_grad && config.model.n_expert > 0);
  if (reduction && config.backend.comm != "mpi") {
    std::vector<int> nodes;  // make_comm's rule, on the layout's node map
    for (int r : m) nodes.push_back(layout.node(r));
    if (node_span_of(nodes) == NodeSpan::two_level) {
      const int N = int(std::set<int>(nodes.begin(), nodes.end()).size());
      s.two_level_nodes = N, s.two_level_ranks = n / N;
      s.inter_share = double(N - 1) / double(n - 1);
      return s;
    }
  }
  s.links = g == GroupKind::ep ? n - 1 : n;
  for (int i = 0; i < n; ++i) {
    const int a = g == GroupKind::ep ? m[0] : m[std::size_t(i)];
    const int b = g == GroupKind::ep ? m[std::size_t(i)] : m[std::size_t((i + 1) % n)];
    if (a != b) s.crossing += layout.node(a) != layout.node(b);
  }
  s.inter_share = double(s.crossing) / double(s.links);
  return s;
}

namespace {

// Bytes each group moves per step, from rank 0's shard, and how many of them cross nodes.
std::string comm_section(const Config& config, const Layout& layout) {
  std::string r;
  auto line = [&](const std::string& s) { r += s + "\n"; };
  const model::Dims d = model::dims_of(config);
  const auto& par = config.parallel;
  const bool nodes = layout.num_nodes() > 1;
  line(cat("communication per step, sent by one rank (rank 0's shard)",
           nodes ? "; split into intra- and inter-node bytes as a ring in group-rank order "
                   "sends them, or the two-level reduction where the run uses one, averaged "
                   "over the group's ranks (all-to-all: over rank 0's peers)"
                 : "",
           ":"));
  for (const auto& c :
       estimate_comm(config, shard_of(config, 0, 0, 0, layout.max_ranks_per_node()))) {
    if (layout.group_size(c.group) <= 1 && c.bytes_per_step == 0) continue;
    char row[256];
    std::snprintf(row, sizeof row, "  %-12s %12s   %s", group_name(c.group),
                  format_bytes(c.bytes_per_step).c_str(), c.formula.c_str());
    line(row);
    const NodeSplit split = node_split(config, layout, c.group);
    const bool hybrid = c.intra_only + c.inter_only > 0;
    if (!nodes || (!hybrid && split.two_level_nodes == 0 && split.links == 0)) continue;
    std::string how =
        split.two_level_nodes > 0
            ? cat("two levels: inside ", split.two_level_nodes, " nodes of ", split.two_level_ranks,
                  ", then across them; backend%comm = 'mpi' makes it one ring")
            : cat(split.crossing, " of ", split.links,
                  c.group == GroupKind::ep ? " peers" : " ring links", " on another node");
    const double rest = c.bytes_per_step - c.intra_only - c.inter_only;
    if (hybrid)
      how =
          cat("ZeRO shards inside the node, replicated across nodes (parallel%zero_scope = "
              "'node')",
              rest > 0 ? cat("; the all-reduce: ", how) : std::string());
    line(cat("  ", std::string(12, ' '), " intra-node ",
             format_bytes(rest * (1 - split.inter_share) + c.intra_only), ", inter-node ",
             format_bytes(rest * split.inter_share + c.inter_only), " (", how, ")"));
  }
  if (par.tp > 1) {
    // Per block and micro-batch: two all-reduces of (b, s, h) each way (with sequence
    // parallelism the same bytes as reduce-scatter + all-gather pairs).
    const double T = double(par.tp);
    const double per_block = 4.0 * 2.0 * (T - 1) / T * double(config.train.micro_batch) *
                             double(d.S / par.cp) * double(d.C) * double(dtype_bytes(config));
    line(cat("  tp per block and micro-batch: ", format_bytes(per_block),
             par.sequence_parallel ? " (4 reduce-scatter/all-gather pairs of b*s*h)"
                                   : " (4 all-reduces of b*s*h: 2 forward, 2 backward)"));
  }
  return r;
}

}  // namespace

std::string plan_report(const Config& config, const Layout& layout, const FitOptions& fit) {
  std::string r =
      cat("plan for ", config.deck_path, " on ", layout.world(), " ranks (", layout.num_nodes(),
          " nodes, ", layout.max_ranks_per_node(), " ranks per node)\n\n", layout.describe(), "\n");
  const MemoryBudget budget = memory_budget(config, fit, layout.max_ranks_per_node());
  return r + model_section(config, layout) + memory_section(config, layout, budget.bytes) +
         fit_section(config, layout, budget, fit.bandwidth) + comm_section(config, layout);
}

}  // namespace ptrain::parallel
