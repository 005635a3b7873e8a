// parallel/cost.hpp — what a training step costs on a machine: the cost model behind --plan's
// step time, --plan --search's ranking, parallel%pp_layers = -1 and the run's line that puts
// the measured step beside the predicted one.
//
// The machine is the deck's &machine group (`ptrain --calibrate` measures it; `--machine FILE`
// reads it), every rate left at 0 taken from its node class's stated defaults. From it:
//  * compute: each chunk's forward and backward per micro-batch as the sum of its kernels, the
//    gemms at rate(d) = peak * d / (d + half_dim) for d their smallest dimension (plus a fixed
//    cost per call), attention by its causal (query, key) pairs, LayerNorm, GELU, residual,
//    bias, embedding and cross-entropy by the bytes they move; recomputation reruns what
//    train%recompute says in the backward; scaled by the calibrated deck's measured/modelled
//    factors;
//  * communication: each group's bytes from estimate_comm (the same formulas as --plan's
//    table) at the machine's bandwidth of that operation, inside a node or across (the group's
//    rank-0 instance on the layout's node map), plus its latency per ring step and call;
//    exposed as the code runs it: tp, ep and the tied embedding's sum in full; cp's ring
//    behind each attention; a pipeline's messages added to the op that waits for them;
//    DDP / ZeRO 1 buckets behind the last micro-batch's backward; ZeRO 2 reduce-scatters
//    behind each micro-batch's backward; ZeRO 3 gathers behind the compute they prefetch for;
//    the ZeRO 1/2 parameter gather after the update in full;
//  * the pipeline: the deck's schedule simulated with every rank's op times
//    (parallel/schedule.hpp), or for very deep pipelines its closed form;
//  * the optimizer: its state's bytes at the optimizer bandwidth;
//  * a node with fewer cores than ranks (machine%cores_per_node): the ranks computing at once
//    share them. Each stage's compute is slowed by the ranks of its node busy meanwhile: its
//    own stage's (they run in step) plus every other stage's share of the step it computes,
//    found by re-simulating the schedule until the shares settle.
// Model FLOPs are model/layout.hpp's (6N + 12LCS per token); executed FLOPs add what
// recomputation reruns (MFU and HFU, against the compute type's gemm peak).
#pragma once
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "deck/config.hpp"
#include "grid/layout.hpp"
#include "util/precision.hpp"

namespace ptrain::parallel {

// The machine file's four operations, in the order of its comm_* arrays.
enum class CommOp { all_reduce = 0, all_gather = 1, all_to_all = 2, send_recv = 3 };

struct Machine {
  std::string node_class, name;
  double gemm_fp32 = 0, gemm_bf16 = 0, gemm_fp64 = 0;  // FLOP/s
  double gemm_half_dim = 0, gemm_overhead_s = 0;
  double attention = 0, attention_backward = 0;  // FLOP/s
  double elementwise = 0, optimizer = 0;         // bytes/s
  std::array<double, 4> intra_latency{}, intra_bandwidth{}, inter_latency{}, inter_bandwidth{};
  double overlap = 0;  // share of overlappable communication that hides behind compute
  // Ranks of a node that compute at full rate at once (0: each rank has its own cores). A
  // node running more shares them: its ranks computing at one time run at cores / busy.
  double cores = 0;
  double wait_load = 0;  // with cores: the share of a core a rank waiting in MPI still takes
  double forward_factor = 1, backward_factor = 1, optimizer_factor = 1;
  std::vector<std::string> defaulted;  // the keys taken from the node class

  double gemm_peak(Precision p) const;
  // Seconds of one (M, N, K) gemm on `p` operands: 2MNK / (peak * d / (d + half_dim)) plus the
  // fixed cost, d = min(M, N, K).
  double gemm_seconds(Precision p, double M, double N, double K) const;
  // What is left exposed of `comm` seconds started before `compute` seconds of work.
  double exposed(double comm, double compute) const {
    return comm - overlap * std::min(comm, compute);
  }
  // Seconds of an operation of `steps` ring steps (latencies) moving `bytes` from a rank.
  double comm_seconds(CommOp op, bool across_nodes, double steps, double bytes) const;
};

// The deck's &machine group with every 0 from its node class (and the class's CPU rates
// times backend%threads when that is set).
Machine machine_of(const Config& config);
// The node class's own figures (the stated defaults; README "The cost model").
Machine node_class_defaults(const std::string& node_class);
// "machine: &machine of calibrated.nml (...)" or "machine: node class 'cpu' defaults (no
// machine file: ptrain --calibrate measures one)", for the reports.
std::string describe_machine(const Machine& m);

// One pipeline chunk's compute per micro-batch, seconds, by the kernel model (factors applied).
struct ChunkCompute {
  double forward = 0, backward = 0, recompute = 0;  // recompute: run inside the backward
  double attention_forward = 0;                     // of forward: what cp's ring hides behind
  double weight = 0;      // of backward: the weight gradients (a zero-bubble schedule's W)
  double gemm_flops = 0;  // forward gemm FLOPs, for reports
};

struct GroupCost {
  GroupKind group = GroupKind::dense_grad;
  double bytes = 0;    // per step, sent by one rank (estimate_comm)
  double seconds = 0;  // if nothing were overlapped
  double exposed = 0;  // on the step's critical path, as the code overlaps it
  bool across_nodes = false;
};

struct StepPrediction {
  double step = 0;                                  // seconds
  double forward = 0, backward = 0, recompute = 0;  // compute of the slowest stage's step
  double pipeline = 0;  // the schedule's makespan: computes, in-op comm, waiting
  double bubble = 0;    // fraction of the step the slowest rank waits in the schedule
  // Per pipeline stage, how much slower its compute runs than a rank's alone: the ranks of
  // its node computing at the same time over the node's cores (Machine::cores), at least 1.
  std::vector<double> share;
  // The same for what every rank of a node runs at once (the optimizer): the most ranks on a
  // node over its cores, at least 1.
  double all_busy = 1;
  double optimizer = 0;       // the update (and the gradient norm) on the owned range
  double after_backward = 0;  // exposed data-parallel and tied-embedding communication
  std::vector<GroupCost> comm;
  double tokens_per_s = 0;
  double model_flops = 0, executed_flops = 0;  // per step, every rank together
  double mfu = 0, hfu = 0;                     // against the compute type's gemm peak
  std::string bound;  // "compute", "the bubble", "tp communication", "the optimizer", ...
};

// The step of a validated deck on `layout`'s world and node map, on machine `m`.
StepPrediction predict_step(const Config& config, const Layout& layout, const Machine& m);
// The same for a world of `world` ranks, `ranks_per_node` to a node.
StepPrediction predict_step(const Config& config, int world, int ranks_per_node, const Machine& m);

// Per-chunk compute of stage p's chunk c (global chunk c * pp + p) per micro-batch.
ChunkCompute chunk_compute(const Config& config, const Machine& m, int p, int chunk);

// The optimizer's seconds per step on stage p's rank (0, p, 0): the update over its owned range
// and the gradient norm (factor applied).
double optimizer_seconds(const Config& config, const Machine& m, int p, int ranks_per_node = 0);

// parallel%pp_layers = -1: the layer counts of the pp * virtual_stages chunks (chunk c of stage
// s is number c*pp + s) whose slowest chunk, forward and backward with recomputation, is the
// fastest the machine's model finds, the embedding on the first chunk and the LM head and loss
// on the last counted; at least one layer each. A deck without -1 is returned unchanged.
Config balanced_split(const Config& config, const Machine& m);

// "step 0.412 s: forward 0.120, backward 0.240, recompute 0, bubble 8.1%, optimizer 0.012,
// exposed tp 0.020, dense-grad 0.010 | 2485 tok/s, MFU 41.2%, HFU 41.2% | bound: compute"
std::string describe_prediction(const StepPrediction& p);

}  // namespace ptrain::parallel
