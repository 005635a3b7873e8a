// parallel/plan.hpp — what a run will cost before it runs (`ptrain --plan`): per-rank
// parameters, memory by category under the ZeRO stage, communication per step per group,
// pipeline bubble and model FLOPs. Memory comes from the model's own layout and
// activation sizes, the same arithmetic that sizes the real buffers. Against the memory a
// rank has, whether every shard fits, and if not the smallest changes to the deck that make
// it fit, cheapest first (the same answer stops a run that would not fit before step 1).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "deck/config.hpp"
#include "grid/layout.hpp"
#include "model/layout.hpp"

namespace ptrain::parallel {

// Bytes per rank, by util/memory.hpp category (params, grads, optimizer, activations,
// comm, workspace).
struct MemoryEstimate {
  std::int64_t local_params = 0;  // elements of this rank's shard (all chunks)
  std::int64_t dense_params = 0, expert_params = 0;
  std::array<double, 6> bytes{};  // indexed by MemCategory
  // The experts' part of bytes[params], [grads] and [optimizer]: all of it for the experts
  // this rank holds under ZeRO 0 (the only stage with ep > 1); under ZeRO s >= 1 (ep = 1) the
  // sharded ones are the experts' 1/D share of the dense-grad group's shards, on average.
  double expert_param_bytes = 0, expert_grad_bytes = 0, expert_optimizer_bytes = 0;
  double total() const;
};
// Beyond the model's own buffers it counts what the run allocates around them: the attention
// kernel's block workspace (kernels/attention.cpp), ring attention's buffers, and with a
// pipeline the executor's message buffers (parallel/pipeline.cpp) and the tied embedding's
// sum buffer on the two ends (parallel/data_parallel.cpp).
MemoryEstimate estimate_memory(const Config& config, const model::ShardCoord& coord);
// The shard of the rank at (t, p, e) on the tp, pp and ep axes (cp rank 0), as the plan
// prints it; (0, 0, 0) is rank 0's.
// `ranks_per_node`: as the grid places them (0: unknown), for parallel%zero_scope = 'node'.
model::ShardCoord plan_shard(const Config& config, int t, int p, int e, int ranks_per_node = 0);

struct CommEstimate {
  GroupKind group;
  double bytes_per_step;  // sent by one rank of the group
  std::string formula;
  // Of bytes_per_step, what is known to stay inside the node and to cross nodes (hybrid
  // sharding's levels); the rest splits as the group lies on the nodes.
  double intra_only = 0, inter_only = 0;
};
std::vector<CommEstimate> estimate_comm(const Config& config, const model::ShardCoord& coord);

// Context parallelism's ring (model/context_parallel.hpp), per layer and micro-batch, in
// bytes sent by one rank: forward C-1 K/V blocks; backward C-1 K/V blocks and C dK/dV
// blocks (the accumulated dK/dV travels with the ring and takes one last hop home). A block
// is K and V of this rank's n_head/tp heads for its B*(S/C) positions: 2*B*(S/C)*d_model/tp
// elements. workspace: the backward's transient buffers (the peak; the forward's are
// smaller), 5 blocks and per-position copies of out, dout (B*(S/C)*d_model/tp each) and lse
// (B*(n_head/tp)*(S/C)). All zero at cp = 1.
struct RingEstimate {
  double block = 0, forward = 0, backward = 0, workspace = 0;
  double per_layer() const { return forward + backward; }  // (3C-2) blocks
};
RingEstimate estimate_ring(const Config& config);

// Expert parallelism's all-to-alls (model/moe.cpp), per MoE layer and micro-batch, in bytes
// one rank sends when routing is uniform and nothing is dropped. Forward: one all-to-all of
// the row counts (El = n_expert/ep int32 per peer: (ep-1)*El*4), the token rows to the
// experts' ranks and the experts' outputs back (two all-to-allv, each of the k*B*(S/cp)
// rows of d_model the rank sends, less the 1/ep that stay: `rows` = k*B*(S/cp)*d_model*w*
// (ep-1)/ep); backward: d(output) rows out and d(input) rows back, the same two volumes
// (the counts are not sent again). Every tp rank sends whole d_model rows. Traffic is zero
// at ep = 1. Capacity: ceil(capacity_factor*k*N/E) slots per expert for the N = B*seq_len
// tokens of a micro-batch (the cp group's together), 0 when dropless.
struct ExpertEstimate {
  std::int64_t tokens = 0, capacity = 0;  // N; slots per expert and micro-batch (0: dropless)
  double counts = 0, rows = 0;            // bytes of the count all-to-all, of one row all-to-allv
  double forward = 0, backward = 0;       // counts + 2 rows; 2 rows
  double per_layer() const { return forward + backward; }
};
ExpertEstimate estimate_experts(const Config& config);

// The FLOPs per token train%recompute adds to model FLOPs (full: every block's forward again;
// selective: attention, LayerNorms and GELU).
double recompute_flops_per_token(const Config& config);

// How rank 0's instance of group g lies on `layout`'s nodes: the share of its bytes that crosses
// nodes (ring links in group-rank order whose ends are on different nodes; an all-to-all's
// peers on another node; a two-level reduction's (N-1)/(D-1)).
struct NodeSplit {
  double inter_share = 0;
  int crossing = 0, links = 0;                   // ring links that cross nodes, of all
  int two_level_nodes = 0, two_level_ranks = 0;  // N and L when reduced in two levels
};
NodeSplit node_split(const Config& config, const Layout& layout, GroupKind g);

// Micro-batches per step on one rank: global_batch / (micro_batch * dp * ep).
std::int64_t micro_batches_per_step(const Config& config);
// Idle fraction of the pipeline schedule with equal stages and T_F = T_B = T_W:
// (p-1)/(v*m + p-1) (gpipe, 1f1b, interleaved), (p-1)/(3m + p-1) (zb-h1: (p-1)(T_F+T_B-T_W)
// idle, Qi et al. 2023; exact from m = p on), (p-1)/(6m + p-1) (zb-v: the V's ramp of p-1
// chunk forwards; exact from m = 2p on), and that formula as text.
double pipeline_bubble(const Config& config);
std::string pipeline_bubble_formula(const Config& config);
std::int64_t dtype_bytes(const Config& config);

// ---- Will it fit? -------------------------------------------------------------------------

// What the fit is judged against: --memory (bytes per rank) and, for ranking the advice,
// --bandwidth (bytes per second a rank sends at); 0 when not given.
struct FitOptions {
  double memory = 0, bandwidth = 0;
};
// The memory one rank has: --memory when given; else unknown (bytes 0) for backend%device =
// 'cuda'; else this node's memory (util/memory.hpp node_memory) over `ranks_per_node`.
struct MemoryBudget {
  double bytes = 0;
  std::string source;  // "--memory", "node memory 23.54 GiB (/proc/meminfo MemTotal) / 2 ranks"
};
MemoryBudget memory_budget(const Config& config, const FitOptions& fit, int ranks_per_node);

// The largest predicted shard of a validated config: tp, ep and cp ranks hold shards of the
// same size, so one per pipeline stage p, at (t, p, e) = (0, p, 0).
struct LargestShard {
  int p = 0;
  double bytes = 0;
};
LargestShard largest_shard(const Config& config, int ranks_per_node = 0);

// The rates that turn extra FLOPs and bytes into step time: backend%peak_gflops and
// --bandwidth, or assumed figures (said so) when the deck and the command line give none:
// 100 GFLOP/s and 10 GB/s per rank on CPUs, 100 TFLOP/s and 100 GB/s per GPU.
struct StepRates {
  double gflops = 0, bandwidth = 0;  // per rank; bandwidth in bytes/s
  bool gflops_assumed = false, bandwidth_assumed = false;
};
StepRates step_rates(const Config& config, double bandwidth);

// A change to the deck that makes every shard fit. Candidates: a higher train%recompute
// level, a higher ZeRO stage (ep = 1, dense-grad group > 1), tp or pp times k for the same
// world (dp divided by k; tp within a node), a smaller micro-batch (more micro-batches, the
// same global batch), and their combinations. Each is the deck with the change, validated
// for the world and run through estimate_memory and estimate_comm: one memory model.
struct FitChange {
  std::vector<std::string> sets;  // --set values, e.g. "train%recompute='selective'"
  double largest = 0;             // bytes of the largest shard with the change
  int largest_p = 0;              // its pipeline stage
  double extra_flops = 0;         // per rank and step (recomputation)
  double extra_bytes = 0;         // sent per rank and step, every group (rank 0's shard)
  double bubble_before = 0, bubble = 0;
  double extra_seconds = 0;  // predicted step-time increase at the StepRates
  double fraction = 0;       // of the deck's predicted step time
};
// The smallest changes that fit `budget` bytes per rank (none is a superset, knob by knob, of
// another), cheapest first; empty when the deck fits or nothing does. Combinations are tried
// fewest steps first, at most 600 of them. `least` (optional) receives the smallest
// largest-shard any candidate reaches, with its sets.
std::vector<FitChange> fit_changes(const Config& config, int world, int ranks_per_node,
                                   double budget, const StepRates& rates,
                                   FitChange* least = nullptr);

// The run's check: "" when every shard fits `budget`, else one line naming the largest
// shard, the budget and the cheapest changes that fit (their --set options, predicted memory
// and cost). budget.bytes 0 (unknown): "".
std::string fit_refusal(const Config& config, const Layout& layout, const MemoryBudget& budget,
                        double bandwidth);

// The whole report, for a validated config on `layout`'s world; with the fit of every
// shard, the recompute x ZeRO table and, when a shard does not fit, the advice.
std::string plan_report(const Config& config, const Layout& layout, const FitOptions& fit = {});

}  // namespace ptrain::parallel
