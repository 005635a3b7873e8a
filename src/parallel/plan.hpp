// parallel/plan.hpp — what a run will cost before it runs (`ptrain --plan`): per-rank
// parameters, memory by category under the ZeRO stage, communication per step per group,
// pipeline bubble and model FLOPs. Memory comes from the model's own layout and
// activation sizes, the same arithmetic that sizes the real buffers.
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
MemoryEstimate estimate_memory(const Config& config, const model::ShardCoord& coord);

struct CommEstimate {
  GroupKind group;
  double bytes_per_step;  // sent by one rank of the group
  std::string formula;
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

// Micro-batches per step on one rank: global_batch / (micro_batch * dp * ep).
std::int64_t micro_batches_per_step(const Config& config);
// Micro-batches each chunk of pipeline stage `stage` holds at most (its activation slots),
// from the deck's checked schedule; 1 per chunk without a pipeline.
std::vector<int> schedule_in_flight(const Config& config, int stage);
// Idle fraction of the pipeline schedule: (p-1)/(v*m + p-1).
double pipeline_bubble(const Config& config);
std::int64_t dtype_bytes(const Config& config);

// The whole report, for a validated config on `layout`'s world.
std::string plan_report(const Config& config, const Layout& layout);

}  // namespace ptrain::parallel
