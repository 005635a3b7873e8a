// parallel/data_parallel.hpp — data parallelism and ZeRO over the dense-grad group
// (docs/ARCHITECTURE.md, "Where each parallel axis lives"). The flat buffer of N elements is split
// in D equal shards, rank r owning [r*S, (r+1)*S); with experts split over ep, the expert tensors
// are sharded separately over the expert-grad group (ShardMap) and "shard" means both parts.
//
//   ZeRO 0  whole params and grads; buckets of the gradient buffer (bucket_mb, in reverse
//           layer order) are all-reduced as soon as the backward of the last micro-batch
//           has completed them, overlapping the rest of the backward; every rank updates all.
//   ZeRO 1  as 0, but each rank updates only its shard (optimizer state 1/D), then the
//           parameters are all-gathered. With split experts the shard is not one flat
//           range: its parameters and gradients are kept packed beside the whole buffers.
//   ZeRO 2  whole params; gradients only as this rank's shard: each unit's gradients go to
//           a transient window that is reduce-scattered into the shard after every
//           micro-batch; update the shard; all-gather the parameters. With the bf16 wire
//           (parallel%wire_dtype) the window is rounded to bf16 once, exchanged all-to-all,
//           and each rank sums the arriving blocks of its shard in fp32 (Megatron's
//           reduce-scatter with fp32 accumulation).
//   ZeRO 3  params sharded too: each unit is all-gathered into a window just before its
//           forward and again before its backward (the next unit prefetched), then freed.
// The embedding unit (wte, wpe) serves the tied LM head as well, so under ZeRO 3 its
// gathered copy is kept for the whole step (gathered once per step, not per micro-batch).
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "deck/config.hpp"
#include "kernels/view.hpp"
#include "model/layout.hpp"
#include "model/stage.hpp"
#include "util/memory.hpp"

namespace ptrain::parallel {

// How a chunk's flat buffer is reduced and sharded. It divides into index spaces, each over
// its own group: the dense tensors over the dense-grad group and, when experts are split over
// ep, the expert tensors over the expert-grad group (d, c), which is smaller. A space numbers
// its elements in flat order and is cut in D equal shards of S = ceil(N / D); a rank's owned
// storage holds its shard of every space back to back (dense first). Without split experts
// there is one space and one run, and the owned storage is the classic flat shard.
struct ShardMap {
  struct Space {
    int D = 1, r = 0;                   // group size, this rank's index in it
    std::int64_t numel = 0, shard = 0;  // N and S
    std::int64_t at = 0;                // where its shard starts in the owned storage
  };
  // Flat [lo, hi) is elements [space_lo, space_lo + hi - lo) of one space.
  struct Run {
    std::int64_t lo = 0, hi = 0, space_lo = 0;
    int space = 0;
  };
  // Flat [lo, hi) that this rank owns, at `at` in its owned storage.
  struct Piece {
    std::int64_t lo = 0, hi = 0, at = 0;
  };
  // The shards of part [a, b) of a run: counts per rank of its space (the reduce-scatter and
  // all-gather counts) and this rank's own part, flat [mine_lo, + mine) at `at`.
  struct Cut {
    std::vector<int> counts;
    std::int64_t mine_lo = 0, mine = 0, at = 0;
  };
  std::vector<Space> spaces;
  std::vector<Run> runs;
  std::vector<Piece> owned;    // in owned-storage order
  std::int64_t storage = 0;    // elements of the owned storage (sum of the shards)
  std::int64_t owned_end = 0;  // one past the last owned element in it

  ShardMap() = default;
  // D, r: the dense-grad group; Dx, rx: the expert-grad group (Dx = 0: experts not split).
  ShardMap(const model::ChunkLayout& layout, int D, int r, int Dx, int rx);
  Cut cut(const Run& run, std::int64_t a, std::int64_t b) const;
  // f(run, a, b) for the part [a, b) of every run inside flat [lo, hi), in flat order.
  template <class F>
  void for_each_run(std::int64_t lo, std::int64_t hi, F&& f) const {
    for (const Run& run : runs) {
      const std::int64_t a = std::max(lo, run.lo), b = std::min(hi, run.hi);
      if (a < b) f(run, a, b);
    }
  }
  bool split() const { return spaces.size() > 1; }
};

// Elements each rank allocates per category for a chunk under a ZeRO stage: the one
// source of both the real buffers and `ptrain --plan`. `expert_group` is the expert-grad
// group's size when experts are split over ep (0 otherwise).
struct DataParallelSizes {
  std::int64_t numel = 0;  // N, the chunk's flat size
  std::int64_t shard = 0;  // owned storage (S without ep)
  std::int64_t whole = 0;  // a whole buffer: padded to D*S without ep (in-place all-gather)
  std::int64_t params = 0, grads = 0, optimizer_range = 0;  // elements
  std::int64_t comm_grads = 0;   // gradient windows and their receive buffers (grad type)
  std::int64_t comm_params = 0;  // parameter windows (compute type)
  std::int64_t comm_wire = 0;    // bf16 wire: the windows' send and receive buffers (bf16)
  std::int64_t bucket = 0;       // ZeRO 0/1 all-reduce bucket, elements
};
// `grad_bytes` sizes the buckets (bucket_mb of gradients); `bf16_wire`: ZeRO 2/3 send their
// fp32 gradients as bf16 (PrecisionPolicy::wire).
DataParallelSizes data_parallel_sizes(const model::ChunkLayout& layout, int D, int zero,
                                      double bucket_mb, std::size_t grad_bytes,
                                      int expert_group = 0, bool bf16_wire = false);

// parallel%zero_scope = 'node' (hybrid sharding): ZeRO shards over `shards`, the dense-grad
// group's ranks on this rank's node, each shard replicated over `replicas`, the group's ranks
// of this local index on every node. ZeRO 1 all-reduces over the whole group as before and
// gathers parameters inside the node; ZeRO 2/3 reduce-scatter each window inside the node,
// accumulate the shard over the micro-batches, and after the last one's fold all-reduce each
// unit's part of it across the nodes; ZeRO 3 gathers parameters inside the node. Both null:
// shards over the whole group.
struct NodeScope {
  Comm* shards = nullptr;
  Comm* replicas = nullptr;
};

// The cast boundary of the precision policy P: the model sees weights in P::compute and
// writes gradients in P::grad; the optimizer updates P::master weights. With a uniform
// policy (fp32, fp64) masters are the compute weights themselves. Otherwise this engine
// keeps fp32 masters over the range it updates (in MemCategory::optimizer, beside the
// moments) and, after each update, casts them into the compute weights of that range in one
// kernel, so the ZeRO 1/2 all-gather and the ZeRO 3 unit gathers move compute-type bytes.
template <class P>
class DataParallel {
 public:
  PTRAIN_POLICY_TYPES(P);
  // `tp` (may be null) is the tensor-parallel group: the gradient norm adds the shards of
  // tp-split tensors over it and counts tp-replicated ones once. `experts` (may be null) is
  // the expert-grad group (d, c): when it is smaller than `group` (experts split over ep),
  // expert tensors are reduced and sharded over it instead (see ShardMap).
  DataParallel(const Config& config, Comm& group, const model::ChunkLayout& layout,
               Comm* tp = nullptr, Comm* experts = nullptr, NodeScope node_scope = {});
  ~DataParallel();

  model::ParamStore<P>* store();
  const DataParallelSizes& sizes() const { return sizes_; }
  const model::ChunkLayout& layout() const { return layout_; }
  int zero() const { return zero_; }
  // This rank's index among the replicas of its shard (0 unless zero_scope = 'node'): one
  // replica counts the shard in the norm and writes it to checkpoints.
  int replica() const { return replicas_ ? replicas_->rank() : 0; }

  // What the optimizer updates: the whole chunk under ZeRO 0, this rank's owned storage
  // otherwise; update_params() (the masters) and update_grads() are update_size() long, and
  // each piece says which flat elements lie where in them (ZeRO 0: one piece, [0, N) at 0).
  using Piece = ShardMap::Piece;
  const std::vector<Piece>& update_pieces() const { return update_pieces_; }
  std::int64_t update_size() const { return update_size_; }
  kernels::Vec<M> update_params();
  kernels::Vec<G> update_grads();

  // Initial weights of what this rank holds (all of it, or its ZeRO 3 shard).
  void init_weights(std::uint64_t seed);
  // Weights of the whole chunk from `whole` (N elements on the host) into what this rank holds.
  void set_weights(const M* whole);

  void begin_step();                  // zero gradients
  void begin_micro_batch(bool last);  // ZeRO 0/1 reduce only after the last one
  void finish_gradients();            // every reduction done: update_grads() is final
  // This rank's share of the squared global norm (no communication): the gradients of its
  // owned range, without tied copies (counted on the stage with the embedding) and, on tp
  // ranks other than 0, without tp-replicated tensors. Summed over every rank of the
  // world it is the squared norm of the whole model's gradient.
  double owned_grad_sum_of_squares();
  // Pipeline with a tied LM head: adds the other end's gradient of wte (after
  // finish_gradients). `ends` holds the dense-grad groups of the first and the last stage
  // with this tp rank; each rank contributes its shard of wte, every rank takes back what it
  // updates. No-op for a chunk without wte. With both ends on this rank (zb-v's V placement),
  // `other` is the chunk with the head: both chunks' shards are summed over `ends` (the
  // dense-grad group) at once and both take back what they update.
  void sum_tied_embedding(Comm& ends, DataParallel* other = nullptr);
  // Index in layout().tensors of the first tensor with a NaN or infinite gradient in the
  // range this rank owns, or -1 (local: no communication).
  int first_nonfinite_grad();
  // The masters changed (an update, a restart): the compute weights follow (one cast), and
  // under ZeRO 1/2 the updated shards are all-gathered into the whole compute weights.
  void finish_step();

  // Per tensor of layout(), the checksum (util/checksum.hpp, by index in the local tensor)
  // of the compute weights this rank holds of it: all of it under ZeRO 0-2, its shard's part
  // under ZeRO 3 (0 where it holds none), so that summed over the shards it is the whole
  // tensor's. Local: no communication.
  std::vector<std::uint64_t> weight_checksums();
  // Testing (run%debug_flip_rank): flips the top stored mantissa bit of the first element this
  // rank holds of the last tensor it holds any of, in the compute weights (a kernel). Returns
  // the tensor's name ("" when the rank holds nothing).
  std::string flip_weight_bit();

  // Fraction of the gradient bytes whose reduction completed before finish_gradients
  // had to wait (1 = fully overlapped with the backward); for the step just done.
  double overlap_fraction() const { return overlap_; }

 private:
  class Store;
  // f(index in layout_.tensors, spec, gradients of its part in this rank's owned range).
  template <class F>
  void for_each_owned_grad(F&& f);
  // Gradients of flat [a, b) inside piece p (of the owned shards or of the update): the
  // whole buffer under ZeRO 0, the owned storage otherwise.
  kernels::Vec<G> grads_of(const Piece& p, std::int64_t a, std::int64_t b);
  // The compute weights of the update range (the masters themselves when uniform).
  kernels::Vec<T> update_compute();
  // sum_tied_embedding's parts: wte of a chunk with one end of the tied pair (null
  // otherwise); its owned gradient into the whole-tensor sum (copied, or added); its update
  // range's gradient back from it.
  const model::TensorSpec* tied_wte() const;
  void add_owned_wte(const kernels::Vec<G>& whole, bool add);
  void take_tied_wte(const kernels::Vec<G>& whole);
  Comm& group_;
  Comm& shards_;              // what ZeRO shards over: group_, or its ranks on this node
  Comm* replicas_ = nullptr;  // zero_scope = 'node' across more than one node
  Comm* tp_ = nullptr;
  Comm* experts_ = nullptr;
  bool bf16_wire_ = false;  // ZeRO 2/3 gradients travel as bf16, summed in fp32 on arrival
  model::ChunkLayout layout_;
  model::Dims dims_;
  int zero_ = 0;
  ShardMap map_;
  DataParallelSizes sizes_;
  std::vector<Piece> update_pieces_;
  std::int64_t update_size_ = 0;
  std::unique_ptr<Store> store_;
  TrackedView<M> masters_;   // the update range's masters (a non-uniform policy only)
  TrackedView<G> tied_sum_;  // sum_tied_embedding's buffer (only on a chunk with tied wte)
  double overlap_ = 1.0;
};

}  // namespace ptrain::parallel
