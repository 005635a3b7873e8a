#include "parallel/cost.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <tuple>

#include "deck/deck.hpp"
#include "model/layout.hpp"
#include "parallel/plan.hpp"
#include "parallel/report.hpp"
#include "parallel/schedule.hpp"
#include "util/error.hpp"

namespace ptrain::parallel {

namespace {

constexpr double kGiga = 1e9;

// ---- the machine ---------------------------------------------------------------------------

// The stated defaults of each node class, per rank (README, "The cost model"). cpu: one core
// of a current AVX2 server CPU per rank thread; GPUs: one per rank, the H200's gemm figures
// measured on the project's device kit (cuBLAS 8192^3: bf16 807, fp32 51 TFLOP/s), the others
// from their vendors' datasheets scaled alike; links: shared memory or NVLink inside a node,
// 25 Gbit/s Ethernet (cpu) or a 400 Gbit/s InfiniBand port per GPU across nodes.
struct ClassFigures {
  const char* name;
  double fp32, bf16, fp64, half_dim, overhead_us, attention, attention_backward, elementwise,
      optimizer;                                    // GFLOP/s, -, us, GFLOP/s, GB/s
  double intra_us, intra_gbs, inter_us, inter_gbs;  // every operation alike
  double overlap;
};
constexpr ClassFigures kClasses[] = {
    {"cpu", 60, 50, 30, 48, 2, 8, 6, 8, 6, 2, 4, 20, 2.5, 0.25},
    {"a100", 19000, 250000, 19000, 512, 8, 60000, 40000, 1400, 1000, 10, 100, 15, 25, 0.8},
    {"h100", 50000, 700000, 50000, 768, 6, 150000, 100000, 2800, 2000, 8, 150, 12, 50, 0.8},
    {"h200", 51000, 800000, 51000, 768, 6, 160000, 110000, 3600, 2500, 8, 150, 12, 50, 0.8},
};

const ClassFigures& class_figures(const std::string& name) {
  for (const auto& c : kClasses)
    if (name == c.name) return c;
  throw Error(cat("machine%node_class = '", name, "': not one of cpu, a100, h100, h200"),
              kExitInput);
}

// ---- compute of one chunk ------------------------------------------------------------------

struct Shapes {
  double B, T, S, R, Rln, C, Cl, Fl, Vl, H, hs, w, pairs;  // pairs: causal (q, k) per (b, h)
  Precision p;
};

Shapes shapes_of(const Config& config) {
  const model::Dims d = model::dims_of(config);
  const auto& par = config.parallel;
  Shapes s{};
  s.p = deck::precision_policy(config).compute;
  s.w = double(bytes_of(s.p));
  s.B = double(config.train.micro_batch);
  s.S = double(d.S);
  s.T = double(d.S / par.cp);
  s.R = s.B * s.T;
  s.Rln = par.sequence_parallel && par.tp > 1 ? s.R / double(par.tp) : s.R;
  s.C = double(d.C);
  s.Cl = double(d.C / par.tp);
  s.Fl = double(d.F / par.tp);
  s.Vl = double(d.Vpad / par.tp);
  s.H = double(d.NH / par.tp);
  s.hs = double(d.HS);
  // Every rank of a zigzag cp group has the same causal work: S(S+1)/2 over cp.
  s.pairs = s.S * (s.S + 1) / 2 / double(par.cp);
  return s;
}

// Forward, backward and recompute seconds of one block, and its attention forward.
struct BlockSeconds {
  double forward = 0, backward = 0, selective = 0, attention = 0, flops = 0;
  double weight = 0;  // of backward: the weight gradients (a zero-bubble schedule's W)
};

BlockSeconds block_seconds(const Config& config, const Machine& m, const Shapes& s, bool moe) {
  const model::Dims d = model::dims_of(config);
  BlockSeconds b;
  auto gemm = [&](double M, double N, double K) { return m.gemm_seconds(s.p, M, N, K); };
  // A linear layer (rows, out, in): forward, and backward's two gemms and its bias sum.
  auto linear = [&](double rows, double out, double in, double& fwd, double& bwd) {
    fwd += gemm(rows, out, in) + 2 * rows * out * s.w / m.elementwise;        // + bias
    const double w = gemm(out, in, rows) + rows * out * s.w / m.elementwise;  // dW, bias
    bwd += gemm(rows, in, out) + w;
    b.weight += w;
    b.flops += 2 * rows * out * in;
  };
  const double bytes = s.w / m.elementwise;
  const double ln_fwd = 3 * s.Rln * s.C * bytes, ln_bwd = 5 * s.Rln * s.C * bytes;
  const double residual = 3 * s.Rln * s.C * bytes;
  double f = 0, bw = 0;
  f += ln_fwd, bw += ln_bwd;  // ln_1
  linear(s.R, 3 * s.Cl, s.C, f, bw);
  b.attention = 4 * s.hs * s.pairs * s.B * s.H / m.attention;
  f += b.attention;
  bw += 8 * s.hs * s.pairs * s.B * s.H / m.attention_backward;
  linear(s.R, s.C, s.Cl, f, bw);
  f += residual, bw += 2 * s.Rln * s.C * bytes;
  f += ln_fwd, bw += ln_bwd;  // ln_2
  double gelu = 0;
  if (!moe) {
    linear(s.R, s.Fl, s.C, f, bw);
    gelu = 2 * s.R * s.Fl * bytes;
    f += gelu, bw += 3 * s.R * s.Fl * bytes;
    linear(s.R, s.C, s.Fl, f, bw);
  } else {
    // Router, then each of this rank's experts on its capacity of rows.
    const double E = double(d.n_expert), El = E / double(config.parallel.ep);
    linear(s.R, E, s.C, f, bw);
    const double cf = d.capacity_factor > 0 ? d.capacity_factor : 1.0;
    const double rows = std::ceil(cf * double(d.top_k) * s.B * s.S / E);  // per expert
    for (int e = 0; e < int(El); ++e) {
      linear(rows, s.Fl, s.C, f, bw);
      linear(rows, s.C, s.Fl, f, bw);
    }
    gelu = 2 * El * rows * s.Fl * bytes;
    f += gelu, bw += 1.5 * gelu;
  }
  f += residual, bw += 2 * s.Rln * s.C * bytes;
  b.forward = f, b.backward = bw;
  b.selective = b.attention + 2 * ln_fwd + gelu;  // what selective recomputation reruns
  return b;
}

// ---- communication ---------------------------------------------------------------------------

CommOp op_of(const Config& config, GroupKind g) {
  switch (g) {
    case GroupKind::pp:
    case GroupKind::cp:
      return CommOp::send_recv;
    case GroupKind::ep:
      return CommOp::all_to_all;
    case GroupKind::dense_grad:
    case GroupKind::expert_grad:
      return config.parallel.zero >= 2 ? CommOp::all_gather : CommOp::all_reduce;
    case GroupKind::tp:
      return config.parallel.sequence_parallel ? CommOp::all_gather : CommOp::all_reduce;
    default:
      return CommOp::all_reduce;
  }
}

int group_size(const Config& config, GroupKind g) {
  const auto& par = config.parallel;
  switch (g) {
    case GroupKind::tp:
      return int(par.tp);
    case GroupKind::pp:
      return int(par.pp);
    case GroupKind::cp:
      return int(par.cp);
    case GroupKind::ep:
      return int(par.ep);
    case GroupKind::dense_grad:
      return int(par.dp * par.ep * par.cp);
    case GroupKind::expert_grad:
      return int(par.dp * par.cp);
    case GroupKind::embed:
      return int(2 * par.dp * par.ep * par.cp);
    default:
      return 1;
  }
}

// Ring steps (latencies) a group's step makes, from its calls as the code issues them.
double ring_steps(const Config& config, GroupKind g, double bytes, double m, double layers,
                  double moe_layers, bool first, bool last) {
  const auto& par = config.parallel;
  const double n = double(group_size(config, g));
  if (n <= 1 || bytes <= 0) return 0;
  switch (g) {
    case GroupKind::tp:
      return m * (4 * layers + (first ? 1 : 0) + (last ? 4 : 0)) * 2 * (n - 1);
    case GroupKind::cp:
      return m * layers * (3 * n - 2);
    case GroupKind::ep:
      return m * moe_layers * 5 * (n - 1);
    case GroupKind::pp:
      return m * double(par.virtual_stages) * 2;
    case GroupKind::dense_grad:
    case GroupKind::expert_grad: {
      const double bucket = std::max(1.0, double(par.bucket_mb)) * 1024 * 1024;
      if (par.zero <= 1) return std::ceil(bytes / bucket) * 2 * (n - 1);
      return (m + 1) * (layers + 2) * (n - 1);  // a window per unit and micro-batch, gathers
    }
    default:
      return 2 * (n - 1);
  }
}

// ---- the pipeline --------------------------------------------------------------------------

// Per-rank op times of every compute along each rank's list: a forward tf, a backward tb, a
// split backward's W tw and its B the rest.
std::vector<std::vector<double>> op_seconds(const std::vector<OpList>& lists,
                                            const std::vector<std::vector<double>>& tf,
                                            const std::vector<std::vector<double>>& tb,
                                            const std::vector<std::vector<double>>& tw) {
  std::vector<std::vector<double>> out(lists.size());
  for (std::size_t r = 0; r < lists.size(); ++r)
    for (const Op& op : lists[r]) {
      const auto c = std::size_t(op.chunk);
      switch (op.kind) {
        case OpKind::forward:
          out[r].push_back(tf[r][c]);
          break;
        case OpKind::backward:
          out[r].push_back(tb[r][c]);
          break;
        case OpKind::backward_input:
          out[r].push_back(tb[r][c] - tw[r][c]);
          break;
        case OpKind::backward_weight:
          out[r].push_back(tw[r][c]);
          break;
        default:
          break;
      }
    }
  return out;
}

// Schedules of more computes than this over all ranks are priced by their closed form.
constexpr double kSimulatedComputes = 1 << 20;

}  // namespace

// ---- Machine ---------------------------------------------------------------------------------

double Machine::gemm_peak(Precision p) const {
  return p == Precision::bf16 ? gemm_bf16 : p == Precision::fp64 ? gemm_fp64 : gemm_fp32;
}

double Machine::gemm_seconds(Precision p, double M, double N, double K) const {
  if (M <= 0 || N <= 0 || K <= 0) return 0;
  const double d = std::min({M, N, K});
  return 2 * M * N * K / (gemm_peak(p) * d / (d + gemm_half_dim)) + gemm_overhead_s;
}

double Machine::comm_seconds(CommOp op, bool across_nodes, double steps, double bytes) const {
  const std::size_t i = std::size_t(op);
  return steps * (across_nodes ? inter_latency : intra_latency)[i] +
         bytes / (across_nodes ? inter_bandwidth : intra_bandwidth)[i];
}

Machine node_class_defaults(const std::string& node_class) {
  const ClassFigures& c = class_figures(node_class);
  Machine m;
  m.node_class = node_class;
  m.gemm_fp32 = c.fp32 * kGiga, m.gemm_bf16 = c.bf16 * kGiga, m.gemm_fp64 = c.fp64 * kGiga;
  m.gemm_half_dim = c.half_dim, m.gemm_overhead_s = c.overhead_us * 1e-6;
  m.attention = c.attention * kGiga, m.attention_backward = c.attention_backward * kGiga;
  m.elementwise = c.elementwise * kGiga, m.optimizer = c.optimizer * kGiga;
  m.intra_latency.fill(c.intra_us * 1e-6), m.intra_bandwidth.fill(c.intra_gbs * kGiga);
  m.inter_latency.fill(c.inter_us * 1e-6), m.inter_bandwidth.fill(c.inter_gbs * kGiga);
  m.overlap = c.overlap;
  return m;
}

Machine machine_of(const Config& config) {
  const auto& x = config.machine;
  Machine m = node_class_defaults(x.node_class);
  m.name = x.name;
  // The cpu class is per core: a rank of backend%threads threads has that many.
  const double cores =
      x.node_class == "cpu" && config.backend.threads > 0 ? double(config.backend.threads) : 1.0;
  auto take = [&](const char* key, double given, double& into, double scale, double per_core) {
    if (given > 0)
      into = given * scale;
    else {
      into *= per_core;
      m.defaulted.push_back(key);
    }
  };
  take("gemm_gflops_fp32", x.gemm_gflops_fp32, m.gemm_fp32, kGiga, cores);
  take("gemm_gflops_bf16", x.gemm_gflops_bf16, m.gemm_bf16, kGiga, cores);
  take("gemm_gflops_fp64", x.gemm_gflops_fp64, m.gemm_fp64, kGiga, cores);
  take("gemm_half_dim", x.gemm_half_dim, m.gemm_half_dim, 1, 1);
  take("gemm_overhead_us", x.gemm_overhead_us, m.gemm_overhead_s, 1e-6, 1);
  take("attention_gflops", x.attention_gflops, m.attention, kGiga, cores);
  take("attention_backward_gflops", x.attention_backward_gflops, m.attention_backward, kGiga,
       cores);
  take("elementwise_gbs", x.elementwise_gbs, m.elementwise, kGiga, cores);
  take("optimizer_gbs", x.optimizer_gbs, m.optimizer, kGiga, cores);
  for (std::size_t i = 0; i < 4; ++i) {
    take("comm_intra_latency_us", x.comm_intra_latency_us[i], m.intra_latency[i], 1e-6, 1);
    take("comm_intra_gbs", x.comm_intra_gbs[i], m.intra_bandwidth[i], kGiga, 1);
    take("comm_inter_latency_us", x.comm_inter_latency_us[i], m.inter_latency[i], 1e-6, 1);
    take("comm_inter_gbs", x.comm_inter_gbs[i], m.inter_bandwidth[i], kGiga, 1);
  }
  take("comm_overlap", x.comm_overlap, m.overlap, 1, 1);
  std::sort(m.defaulted.begin(), m.defaulted.end());
  m.defaulted.erase(std::unique(m.defaulted.begin(), m.defaulted.end()), m.defaulted.end());
  m.cores = double(x.cores_per_node);
  m.wait_load = x.wait_load;
  m.forward_factor = x.forward_factor, m.backward_factor = x.backward_factor;
  m.optimizer_factor = x.optimizer_factor;
  return m;
}

std::string describe_machine(const Machine& m) {
  if (m.defaulted.size() >= 14)  // every rate
    return cat("machine: node class '", m.node_class,
               "' stated defaults (no &machine rates; ptrain --calibrate measures them)");
  std::string r = cat("machine: ", m.name.empty() ? std::string("&machine") : m.name);
  if (!m.defaulted.empty()) {
    r += cat("; from node class '", m.node_class, "': ");
    for (std::size_t i = 0; i < m.defaulted.size(); ++i) r += cat(i ? ", " : "", m.defaulted[i]);
  }
  if (m.cores > 0)
    r += cat("; ", fixed("%g", m.cores), " rank(s) of a node compute at full rate at once");
  return r;
}

// ---- compute ---------------------------------------------------------------------------------

ChunkCompute chunk_compute(const Config& config, const Machine& m, int p, int chunk) {
  const model::Dims d = model::dims_of(config);
  const Shapes s = shapes_of(config);
  const auto layouts = model::build_layout(config, plan_shard(config, 0, p, 0));
  const model::ChunkLayout& ch = layouts.at(std::size_t(chunk));
  const model::Recompute recompute = model::recompute_mode(config.train.recompute);
  ChunkCompute c;
  const double bytes = s.w / m.elementwise;
  for (std::int64_t l = ch.first_layer; l < ch.first_layer + ch.n_layers; ++l) {
    const BlockSeconds b = block_seconds(config, m, s, d.is_moe_layer(l));
    c.forward += b.forward, c.backward += b.backward, c.attention_forward += b.attention;
    c.weight += b.weight;
    c.gemm_flops += b.flops;
    c.recompute += recompute == model::Recompute::full        ? b.forward
                   : recompute == model::Recompute::selective ? b.selective
                                                              : 0.0;
  }
  if (ch.has_embedding) {  // rows gathered from wte, wpe added; the backward scatters them back
    c.forward += 4 * s.Rln * s.C * bytes;
    c.backward += 3 * s.R * s.C * bytes;
  }
  if (ch.has_head) {  // ln_f, the tied LM head, cross-entropy over the vocabulary shard
    c.forward +=
        3 * s.Rln * s.C * bytes + m.gemm_seconds(s.p, s.R, s.Vl, s.C) + 3 * s.R * s.Vl * bytes;
    c.backward += 5 * s.Rln * s.C * bytes + m.gemm_seconds(s.p, s.R, s.C, s.Vl) +
                  m.gemm_seconds(s.p, s.Vl, s.C, s.R) + 2 * s.R * s.Vl * bytes;
    c.gemm_flops += 2 * s.R * s.Vl * s.C;
  }
  c.forward *= m.forward_factor;
  c.attention_forward *= m.forward_factor;
  c.recompute *= m.forward_factor;
  c.backward *= m.backward_factor;
  c.weight *= m.backward_factor;
  return c;
}

double optimizer_seconds(const Config& config, const Machine& m, int p, int ranks_per_node) {
  // The owned range: AdamW reads the gradient and reads and writes the master weight and both
  // moments (a bf16 run writes the compute weights too); SGD the gradient and the weight. The
  // gradient norm reads the gradients once more.
  const auto& par = config.parallel;
  const PrecisionPolicy policy = deck::precision_policy(config);
  const MemoryEstimate mem = estimate_memory(config, plan_shard(config, 0, p, 0, ranks_per_node));
  const double owned = double(mem.local_params) /
                       (par.zero >= 1 ? double(group_size(config, GroupKind::dense_grad)) : 1.0);
  const double sw = double(bytes_of(policy.master)), gw = double(bytes_of(policy.grad));
  const double per = config.train.optimizer == "adamw" ? gw + 6 * sw : gw + 2 * sw;
  const double mixed = policy.master != policy.compute ? double(bytes_of(policy.compute)) : 0.0;
  return m.optimizer_factor * (owned * (per + mixed) / m.optimizer + owned * gw / m.elementwise);
}

// ---- the step --------------------------------------------------------------------------------

StepPrediction predict_step(const Config& config, int world, int ranks_per_node, const Machine& m) {
  const Layout layout(GridShape::from_config(config), world, std::max(1, ranks_per_node));
  return predict_step(config, layout, m);
}

namespace {

// One pipeline stage's part of the step: its chunks' compute per micro-batch, the
// communication that runs inside their ops (not slowed by shared cores), and what follows.
struct StageCost {
  std::vector<ChunkCompute> chunks;
  double in_op = 0, pp_message = 0, dp_in_op = 0, optimizer = 0, after = 0;
  double compute = 0;           // per step: every chunk's forward, backward and recompute
  std::vector<GroupCost> comm;  // each group of rank (0, p, 0)
};

// Data parallel's `dp_seconds` of communication a step: what is exposed, and the part inside
// each micro-batch's ops (in_op). ZeRO 0/1: buckets reduced behind the last micro-batch's
// backward; ZeRO 1/2 gather the updated parameters after the step (exposed); ZeRO 2
// reduce-scatters behind every micro-batch's backward, ZeRO 3 gathers behind the compute they
// prefetch for. fwd, bwd, rec: one chunk's compute per micro-batch.
struct DataParallelExposure {
  double exposed = 0, in_op = 0;
};
DataParallelExposure data_parallel_exposure(const Config& config, const model::ShardCoord& coord,
                                            const Machine& m, double dp_seconds, double mb,
                                            double fwd, double bwd, double rec) {
  const auto& par = config.parallel;
  const PrecisionPolicy policy = deck::precision_policy(config);
  const MemoryEstimate mem = estimate_memory(config, coord);
  const double S = double(mem.local_params) * double(bytes_of(policy.compute));
  const double G = double(mem.local_params) * double(bytes_of(policy.wire));
  const int zero = int(par.zero);
  const double gather =
      zero == 1 || zero == 2 ? dp_seconds * S / (S + (zero == 1 ? 2 : mb) * G) : 0.0;
  const double reduce = dp_seconds - gather;
  DataParallelExposure x;
  if (zero <= 1) {
    const double buckets = std::ceil(G / (std::max(1.0, double(par.bucket_mb)) * 1024 * 1024));
    x.exposed = std::max(m.exposed(reduce, bwd), reduce / std::max(1.0, buckets)) + gather;
  } else if (zero == 2) {
    x.in_op = m.exposed(reduce / mb, bwd);
    x.exposed = x.in_op * mb + gather;
  } else {
    x.in_op = m.exposed(dp_seconds / mb, fwd + bwd + rec);
    x.exposed = x.in_op * mb;
  }
  return x;
}

StageCost stage_cost(const Config& config, const Layout& layout, const Machine& m, int p) {
  const auto& par = config.parallel;
  const int v = int(par.virtual_stages), rpn = layout.max_ranks_per_node();
  const double mb = double(micro_batches_per_step(config));
  StageCost st;
  const model::ShardCoord coord = plan_shard(config, 0, p, 0, rpn);
  const model::LayerCounts counts = model::layer_counts(config, model::build_layout(config, coord));
  double fwd = 0, bwd = 0, rec = 0, attention = 0;
  for (int c = 0; c < v; ++c) {
    st.chunks.push_back(chunk_compute(config, m, p, c));
    fwd += st.chunks.back().forward, bwd += st.chunks.back().backward;
    rec += st.chunks.back().recompute, attention += st.chunks.back().attention_forward;
  }
  st.compute = mb * (fwd + bwd + rec);
  // In-op communication per micro-batch (summed over the rank's chunks), split evenly
  // between each forward and backward.
  double dp_seconds = 0, embed_seconds = 0;
  for (const auto& e : estimate_comm(config, coord)) {
    GroupCost g;
    g.group = e.group;
    g.bytes = e.bytes_per_step;
    g.across_nodes = node_split(config, layout, e.group).inter_share > 0;
    const double steps = ring_steps(config, e.group, e.bytes_per_step, mb, double(counts.layers),
                                    double(counts.moe_layers), counts.first, counts.last);
    g.seconds =
        g.bytes > 0 ? m.comm_seconds(op_of(config, e.group), g.across_nodes, steps, g.bytes) : 0.0;
    switch (e.group) {
      case GroupKind::tp:
      case GroupKind::ep:
        g.exposed = g.seconds;
        st.in_op += g.seconds / mb;
        break;
      case GroupKind::cp:  // the ring behind each attention, forward and backward
        g.exposed = m.exposed(g.seconds, mb * 3 * attention);
        st.in_op += g.exposed / mb;
        break;
      case GroupKind::pp:
        g.exposed = g.seconds;
        st.pp_message = g.seconds / std::max(1.0, mb * double(v) * 2);
        break;
      case GroupKind::embed:
        g.exposed = g.seconds;
        embed_seconds += g.seconds;
        break;
      default:
        dp_seconds += g.seconds;
        break;
    }
    st.comm.push_back(g);
  }
  const DataParallelExposure dpx =
      dp_seconds > 0 ? data_parallel_exposure(config, coord, m, dp_seconds, mb, fwd / double(v),
                                              bwd / double(v), rec / double(v))
                     : DataParallelExposure{};
  st.dp_in_op = dpx.in_op;
  for (auto& g : st.comm)
    if (g.group == GroupKind::dense_grad || g.group == GroupKind::expert_grad)
      g.exposed = dp_seconds > 0 ? dpx.exposed * g.seconds / dp_seconds : 0.0;
  st.optimizer = optimizer_seconds(config, m, p, rpn);
  st.after = (par.zero <= 2 ? dpx.exposed - st.dp_in_op * mb : 0.0) + embed_seconds;
  return st;
}

// Shared cores: for each stage p, the ranks of every stage q on the node of p's first rank
// (together[p][q]); all_busy: every rank of the fullest node computing at once, over its cores
// (what the optimizer and a P = 1 step see), at least 1.
struct NodeShare {
  std::vector<std::vector<double>> together;
  double all_busy = 1;
};

NodeShare node_share(const Layout& layout, std::size_t stages, const Machine& m) {
  NodeShare out;
  out.together.assign(stages, std::vector<double>(stages, 0.0));
  if (m.cores <= 0) return out;
  std::vector<std::vector<double>> per_node(std::size_t(layout.num_nodes()),
                                            std::vector<double>(stages, 0.0));
  std::vector<int> first_node(stages, -1);
  for (int r = 0; r < layout.world(); ++r) {
    const auto q = std::size_t(layout.coords(r)[int(Axis::p)]);
    per_node[std::size_t(layout.node(r))][q] += 1;
    if (first_node[q] < 0) first_node[q] = layout.node(r);
  }
  double node_ranks = 0;
  for (std::size_t p = 0; p < stages; ++p) out.together[p] = per_node[std::size_t(first_node[p])];
  for (const auto& n : per_node)
    node_ranks = std::max(node_ranks, std::accumulate(n.begin(), n.end(), 0.0));
  out.all_busy = std::max(1.0, node_ranks / m.cores);
  return out;
}

// Per stage and local chunk, a forward's, backward's and split backward's W seconds.
struct OpParts {
  std::vector<std::vector<double>> tf, tb, tw;
};

// The ops' compute (`work`, which shared cores slow) and the communication inside them
// (`fixed`, which they do not). A split backward's W is part of its backward: the weight
// gradients and the reduction that follows them.
std::pair<OpParts, OpParts> op_parts(const Config& config, const std::vector<StageCost>& stage) {
  const auto& par = config.parallel;
  const std::size_t stages = stage.size();
  const double part = par.virtual_stages > 1 ? 1.0 / double(par.virtual_stages) : 1.0;
  OpParts work, fixed;
  for (auto* o : {&work, &fixed}) o->tf.resize(stages), o->tb.resize(stages), o->tw.resize(stages);
  for (std::size_t p = 0; p < stages; ++p) {
    const StageCost& st = stage[p];
    const double dp_in_backward = part * st.dp_in_op * (par.zero == 3 ? 0.5 : 1.0);
    for (const ChunkCompute& k : st.chunks) {
      work.tf[p].push_back(k.forward);
      work.tb[p].push_back(k.backward + k.recompute);
      work.tw[p].push_back(k.weight);
      fixed.tf[p].push_back(part * st.in_op / 2 + st.pp_message +
                            (par.zero == 3 ? part * st.dp_in_op / 2 : 0.0));
      fixed.tb[p].push_back(part * st.in_op / 2 + st.pp_message + dp_in_backward);
      fixed.tw[p].push_back(dp_in_backward);
    }
  }
  return {work, fixed};
}

// The schedule's makespan, the most a rank waits in it, and each stage's mean slowdown on
// shared cores.
struct ScheduleRun {
  double makespan = 0, waiting = 0;
  std::vector<double> share;
};

// The deck's schedule simulated with every compute's time (`work` slowed by shared cores,
// plus `wait`), sharing iterated to a fixed point: a compute of stage p is slowed by its own
// stage's ranks of the node (they run in step) and, over its interval, by each other stage's
// ranks there while they compute (or wait_load of a core while they wait).
ScheduleRun simulate_shared(const Config& config, const std::vector<std::vector<double>>& work,
                            const std::vector<std::vector<double>>& wait, const NodeShare& node,
                            const Machine& m) {
  const auto& par = config.parallel;
  const int P = int(par.pp), v = int(par.virtual_stages);
  const int mb = int(micro_batches_per_step(config));
  const std::size_t stages = work.size();
  const ScheduleKind kind = schedule_kind(par.pp_schedule);
  const auto lists = make_schedule(kind, P, mb, v);
  const Pipeline pipe = pipeline_of(kind, P, mb, v);
  std::vector<std::vector<double>> slow(stages);
  for (std::size_t p = 0; p < stages; ++p) slow[p].assign(work[p].size(), node.all_busy);
  std::vector<std::vector<double>> seconds(stages);
  auto simulate = [&] {
    for (std::size_t p = 0; p < stages; ++p) {
      seconds[p].clear();
      for (std::size_t k = 0; k < work[p].size(); ++k)
        seconds[p].push_back(slow[p][k] * work[p][k] + wait[p][k]);
    }
    return simulate_schedule(lists, pipe, seconds);
  };
  // Of stage q's computing, the share of [s0, s1) it covers.
  auto computing = [&](const ScheduleTiming& t, std::size_t q, double s0, double s1) {
    double overlap = 0;
    for (std::size_t j = 0; j < work[q].size(); ++j) {
      const double a = t.compute_start[q][j], b = a + seconds[q][j];
      if (b <= s0 || a >= s1 || seconds[q][j] <= 0) continue;
      overlap += (std::min(b, s1) - std::max(a, s0)) * slow[q][j] * work[q][j] / seconds[q][j];
    }
    return std::min(1.0, overlap / (s1 - s0));
  };
  ScheduleTiming timing = simulate();
  for (int iteration = 0; node.all_busy > 1 && iteration < 40; ++iteration) {
    double change = 0;
    for (std::size_t p = 0; p < stages; ++p) {
      for (std::size_t k = 0; k < work[p].size(); ++k) {
        const double s0 = timing.compute_start[p][k], s1 = s0 + seconds[p][k];
        double busy = node.together[p][p];
        for (std::size_t q = 0; q < stages; ++q) {
          if (q == p || node.together[p][q] <= 0 || s1 <= s0) continue;
          const double f = computing(timing, q, s0, s1);
          busy += node.together[p][q] * (f + m.wait_load * (1 - f));
        }
        const double next = std::max(1.0, busy / m.cores);
        change = std::max(change, std::abs(next - slow[p][k]));
        slow[p][k] = (slow[p][k] + next) / 2;  // damped
      }
    }
    timing = simulate();
    if (change < 1e-4) break;
  }
  ScheduleRun out;
  out.makespan = timing.makespan;
  for (double w : timing.waiting) out.waiting = std::max(out.waiting, w);
  for (std::size_t p = 0; p < stages; ++p) {  // each stage's mean slowdown, by its work
    double num = 0, den = 0;
    for (std::size_t k = 0; k < work[p].size(); ++k)
      num += slow[p][k] * work[p][k], den += work[p][k];
    out.share.push_back(den > 0 ? num / den : node.all_busy);
  }
  return out;
}

// The step's pipeline part: one stage, the simulated schedule, or for very deep pipelines its
// closed form (the slowest rank's work plus the fill and drain at the mean op time: the
// equal-stage bubble (p-1)/(v*m+p-1) when stages are equal).
ScheduleRun run_pipeline(const Config& config, const std::vector<StageCost>& stage,
                         const NodeShare& node, const Machine& m) {
  const int P = int(config.parallel.pp), v = int(config.parallel.virtual_stages);
  const double mb = double(micro_batches_per_step(config));
  const auto [work, fixed] = op_parts(config, stage);
  if (P > 1 && double(P) * mb * double(v) * 2 <= kSimulatedComputes) {
    const auto lists = make_schedule(schedule_kind(config.parallel.pp_schedule), P, int(mb), v);
    return simulate_shared(config, op_seconds(lists, work.tf, work.tb, work.tw),
                           op_seconds(lists, fixed.tf, fixed.tb, fixed.tw), node, m);
  }
  ScheduleRun out;
  out.share.assign(stage.size(), node.all_busy);
  double most = 0, sum = 0;
  for (std::size_t p = 0; p < stage.size(); ++p) {
    double r = 0;  // one micro-batch through every chunk of the stage
    for (std::size_t c = 0; c < std::size_t(v); ++c)
      r += node.all_busy * (work.tf[p][c] + work.tb[p][c]) + fixed.tf[p][c] + fixed.tb[p][c];
    most = std::max(most, mb * r), sum += r / double(v);
  }
  out.makespan = most + double(P - 1) * sum / double(P);
  out.waiting = out.makespan - most;
  return out;
}

}  // namespace

StepPrediction predict_step(const Config& config, const Layout& layout, const Machine& m) {
  const int P = int(config.parallel.pp);
  const double mb = double(micro_batches_per_step(config));
  std::vector<StageCost> stage;
  for (int p = 0; p < P; ++p) stage.push_back(stage_cost(config, layout, m, p));
  const NodeShare node = node_share(layout, stage.size(), m);
  const ScheduleRun run = run_pipeline(config, stage, node, m);

  StepPrediction out;
  double slowest_compute = -1;
  for (std::size_t p = 0; p < stage.size(); ++p) {
    const StageCost& st = stage[p];
    out.after_backward = std::max(out.after_backward, st.after);
    out.optimizer = std::max(out.optimizer, node.all_busy * st.optimizer);
    const double x = run.share[p];
    if (x * st.compute > slowest_compute) {
      slowest_compute = x * st.compute;
      out.forward = out.backward = out.recompute = 0;
      for (const ChunkCompute& k : st.chunks)
        out.forward += x * mb * k.forward, out.backward += x * mb * k.backward,
            out.recompute += x * mb * k.recompute;
    }
  }
  out.share = run.share;
  out.all_busy = node.all_busy;
  out.pipeline = run.makespan;
  out.comm = stage[0].comm;
  out.step = run.makespan + out.after_backward + out.optimizer +
             4 * m.comm_seconds(CommOp::all_reduce, layout.num_nodes() > 1, 1, 0);
  out.bubble = out.step > 0 ? run.waiting / out.step : 0;

  const double tokens = double(config.train.global_batch) * double(model::dims_of(config).S);
  out.tokens_per_s = out.step > 0 ? tokens / out.step : 0;
  out.model_flops = model::flops_per_token(config) * tokens;
  out.executed_flops = out.model_flops + recompute_flops_per_token(config) * tokens;
  // Against what the ranks can compute at once: a node of shared cores has `cores` ranks' worth.
  const double computing =
      m.cores > 0 ? std::min(double(layout.world()), double(layout.num_nodes()) * m.cores)
                  : double(layout.world());
  const double peak = m.gemm_peak(deck::precision_policy(config).compute) * computing;
  out.mfu = out.step > 0 ? out.model_flops / out.step / peak : 0;
  out.hfu = out.step > 0 ? out.executed_flops / out.step / peak : 0;

  // What bounds it: the largest part of the step.
  std::vector<std::pair<double, std::string>> parts = {
      {out.forward + out.backward + out.recompute, "compute"},
      {run.waiting, "the pipeline bubble"},
      {out.optimizer, "the optimizer"}};
  for (const auto& g : out.comm)
    if (g.exposed > 0) parts.push_back({g.exposed, cat(group_name(g.group), " communication")});
  out.bound = std::max_element(parts.begin(), parts.end())->second;
  return out;
}

std::string describe_prediction(const StepPrediction& p) {
  std::string comm;
  for (const auto& g : p.comm)
    if (g.exposed > 0)
      comm += cat(", ", group_name(g.group), " ", fixed("%.3g", g.exposed),
                  g.across_nodes ? " (across nodes)" : "");
  return cat("step ", fixed("%.4g", p.step), " s: forward ", fixed("%.3g", p.forward),
             ", backward ", fixed("%.3g", p.backward), ", recompute ", fixed("%.3g", p.recompute),
             ", bubble ", fixed("%.1f%%", 100 * p.bubble), ", optimizer ",
             fixed("%.3g", p.optimizer), comm.empty() ? "" : ", exposed" + comm.substr(1), " | ",
             fixed("%.0f", p.tokens_per_s), " tok/s, MFU ", fixed("%.1f%%", 100 * p.mfu), ", HFU ",
             fixed("%.1f%%", 100 * p.hfu), " | bound: ", p.bound);
}

// ---- balanced stages -------------------------------------------------------------------------

Config balanced_split(const Config& config, const Machine& m) {
  const auto& par = config.parallel;
  if (par.pp_layers.empty() || par.pp_layers[0] != -1) return config;
  const model::Dims d = model::dims_of(config);
  const int chunks = int(par.pp * par.virtual_stages), L = int(d.L);
  // The cost of every layer and of the two ends, from the even split's chunk model: a
  // chunk's time is linear in its layers of each kind.
  Config probe = config;
  std::fill(probe.parallel.pp_layers.begin(), probe.parallel.pp_layers.end(), 0);
  probe.parallel.pp_layers[0] = L - (chunks - 1);
  for (int c = 1; c < chunks; ++c) probe.parallel.pp_layers[std::size_t(c)] = 1;
  const Shapes s = shapes_of(probe);
  const model::Recompute recompute = model::recompute_mode(config.train.recompute);
  const auto n_layers = static_cast<std::size_t>(L);
  std::vector<double> layer(n_layers);
  for (int l = 0; l < L; ++l) {
    const BlockSeconds b = block_seconds(probe, m, s, d.is_moe_layer(l));
    layer[std::size_t(l)] =
        b.forward * m.forward_factor + b.backward * m.backward_factor +
        m.forward_factor * (recompute == model::Recompute::full        ? b.forward
                            : recompute == model::Recompute::selective ? b.selective
                                                                       : 0.0);
  }
  // The ends: the first and last chunks of a one-layer-each split, less their layer.
  const auto whole = [&](int p, int c) {
    const ChunkCompute k = chunk_compute(probe, m, p, c);
    return k.forward + k.backward + k.recompute;
  };
  const int P = int(par.pp);
  const bool v_shape = v_shaped(schedule_kind(par.pp_schedule));
  const model::ChunkPlace head = model::chunk_place(P, v_shape, chunks - 1);
  const double first = whole(0, 0) - layer[0] * double(L - (chunks - 1));
  const double last_chunk = whole(head.rank, head.chunk) - layer[std::size_t(L - 1)];
  // Chunk k's cost with layers [a, b): its layers, plus the ends it holds.
  std::vector<double> prefix(std::size_t(L) + 1, 0.0);
  for (int l = 0; l < L; ++l)
    prefix[std::size_t(l) + 1] = prefix[std::size_t(l)] + layer[std::size_t(l)];
  auto cost = [&](int k, int a, int b) {
    return prefix[std::size_t(b)] - prefix[std::size_t(a)] + (k == 0 ? first : 0.0) +
           (k == chunks - 1 ? std::max(0.0, last_chunk) : 0.0);
  };
  // The least bound on the slowest chunk a greedy cut meets (binary search over the bound).
  auto cut = [&](double bound, std::vector<int>* counts) {
    int a = 0;
    for (int k = 0; k < chunks; ++k) {
      const int left = chunks - k - 1;  // chunks after this one, one layer each at least
      int b = a + 1;
      while (b < L - left && cost(k, a, b + 1) <= bound) ++b;
      if (k == chunks - 1) b = L;
      if (cost(k, a, b) > bound * (1 + 1e-12) || b - a < 1) return false;
      if (counts) counts->push_back(b - a);
      a = b;
    }
    return true;
  };
  double lo = 0, hi = cost(0, 0, 0) + prefix[std::size_t(L)] + std::max(0.0, last_chunk) + first;
  for (int i = 0; i < 100; ++i) {
    const double mid = (lo + hi) / 2;
    (cut(mid, nullptr) ? hi : lo) = mid;
  }
  std::vector<int> counts;
  PTRAIN_REQUIRE(cut(hi, &counts) && int(counts.size()) == chunks, "balanced_split: no split of ",
                 L, " layers over ", chunks, " chunks");
  Config out = config;
  std::fill(out.parallel.pp_layers.begin(), out.parallel.pp_layers.end(), 0);
  for (int k = 0; k < chunks; ++k) out.parallel.pp_layers[std::size_t(k)] = counts[std::size_t(k)];
  return out;
}

}  // namespace ptrain::parallel
