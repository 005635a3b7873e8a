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
