// model/stage.hpp — one model chunk on one rank (a pipeline stage, or one virtual stage of
// it): its layers (the embedding and/or the head when the chunk has them), parameters and
// gradients reached unit by unit through a ParamStore, and activation caches for the
// micro-batches in flight. Runs without a pipeline are one stage with one slot; a pipeline
// schedule keeps as many slots as it has micro-batches in flight (model::SlotCounts).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "deck/config.hpp"
#include "kernels/view.hpp"
#include "model/layers.hpp"
#include "model/layout.hpp"
#include "util/element_types.hpp"
#include "util/memory.hpp"

namespace ptrain::model {

// Which pass asks for a unit's parameters: ZeRO 3 prefetches the next unit of that pass
// (up the chunk in a forward, down in a backward), whatever the schedule interleaves.
enum class Phase { forward, backward };

// Where a stage finds its parameters and gradients, one unit at a time (units_of(): the
// embedding, each block, the head), as views of the unit's flat range: parameters in the
// policy's compute type, gradients in its grad type. The resident store keeps both whole on
// this rank; the data-parallel engine (parallel/) supplies sharded ones for ZeRO 2 and 3,
// which gather and reduce unit by unit, and is the cast boundary to the fp32 masters.
template <class P>
class ParamStore {
 public:
  PTRAIN_POLICY_TYPES(P);
  virtual ~ParamStore() = default;
  virtual kernels::Vec<T> params(int unit, Phase phase) = 0;  // ready to read
  virtual void release_params(int unit) {}      // not needed again until the next params()
  virtual kernels::Vec<G> grads(int unit) = 0;  // where the unit's gradients accumulate
  virtual void grads_done(int unit) {}          // this micro-batch's unit gradients are final
};

// Both buffers whole: parameters (MemCategory::params) and gradients (grads), each `numel`
// long (the chunk's flat size, padded up when ZeRO wants equal shards).
template <class P>
class ResidentStore : public ParamStore<P> {
 public:
  PTRAIN_POLICY_TYPES(P);
  ResidentStore(const ChunkLayout& layout, std::int64_t numel);
  kernels::Vec<T> params(int unit, Phase) override;
  kernels::Vec<G> grads(int unit) override;
  kernels::Vec<T> all_params() const { return params_.view(); }
  kernels::Vec<G> all_grads() const { return grads_.view(); }

 protected:
  std::vector<Unit> units_;
  TrackedView<T> params_;
  TrackedView<G> grads_;
};

// GPT-2 init of flat elements [lo, lo + out.extent(0)) of a chunk: N(0, 0.02) for matrices
// and embeddings, residual projections scaled by 1/sqrt(2*n_layer), zero biases, unit
// LayerNorm gains. Element i of a tensor draws normal(seed, hash(name), global flat index i),
// so every grid starts from the same model. Padding stays zero.
template <class T>
void init_range(const ChunkLayout& layout, const Dims& dims, std::uint64_t seed,
                kernels::Vec<T> out, std::int64_t lo);

// One micro-batch of B samples (host arrays (B, seq_len / cp)): the first stage reads the
// inputs, the last stage the targets; other stages only need B.
struct MicroBatch {
  const std::int32_t* inputs = nullptr;
  const std::int32_t* targets = nullptr;
  int B = 0;
};

template <class P>
class Stage {
 public:
  PTRAIN_POLICY_TYPES(P);
  // Parameters and gradients live in `store` (not owned; it must outlive the stage), or,
  // when null, in a resident store the stage owns. With coord.tp > 1 the stage is this
  // rank's tensor-parallel shard and `tp` the group it reduces over. With coord.cp > 1 it
  // holds coord.c's share of each sequence (inputs, targets and activations are of
  // seq_len / C positions) and `cp` is the ring its attention runs on. `slots`: the activation
  // slots (one per micro-batch from its forward to its weight gradient), the head's (to its
  // input gradient) and the W records of split backwards (from B to W).
  Stage(const Config& config, const ShardCoord& coord, const ChunkLayout& layout, int micro_batch,
        SlotCounts slots = 1, ParamStore<P>* store = nullptr, Comm* tp = nullptr,
        Comm* cp = nullptr, Comm* ep = nullptr);

  const Dims& dims() const { return dims_; }
  const ChunkLayout& layout() const { return layout_; }
  const std::vector<Unit>& units() const { return units_; }
  int slots() const { return int(slots_.size()); }
  // Whether backward_input/backward_weight can run here: W records, dense blocks only, and
  // not the chunk with both ends (the tied head's wte gradient is the embedding unit's).
  bool splits() const { return can_split_; }
  const ContextParallel& context_parallel() const { return cp_; }
  // The whole buffers and one tensor's view in them; only with the resident store.
  kernels::Vec<T> params() const;
  kernels::Vec<G> grads() const;
  kernels::Vec<T> param(const std::string& name) const;
  kernels::Vec<G> grad(const std::string& name) const;
  void init_weights(std::uint64_t seed);  // the resident store
  void zero_grads();                      // the resident store

  // The forward of one micro-batch, its activations kept in `slot` for the backward. A
  // stage without the embedding reads its input from input(slot, B), filled by the caller; a
  // stage without the head leaves its output in output(slot). Returns the sum of the B*S
  // token losses on the last stage (the caller divides by the global count), else 0.
  // for_backward = false (evaluation) releases every unit at the end.
  double forward(int slot, const MicroBatch& mb, bool for_backward = true);
  // The backward of the micro-batch in `slot`, accumulating into the gradients: of
  // dloss * (sum of token losses) on the last stage, else of dout (R, C) on its output.
  // A stage without the embedding leaves d(input) in input_grad().
  void backward(int slot, A dloss, kernels::CVec<T> dout = {});
  // The same backward in two steps (zero-bubble schedules). backward_input: the input
  // gradient (B), leaving input_grad() as backward does, and the head's gradients (its
  // logits are too large to keep for W); it keeps in a W record what the weight gradient
  // needs. backward_weight: the blocks' parameter gradients (W) and the embedding's, each
  // unit's grads() opened and grads_done() here, in backward order. A slot's W follows its B;
  // a chunk runs its Ws in micro-batch order, as its Bs.
  void backward_input(int slot, A dloss, kernels::CVec<T> dout = {});
  void backward_weight(int slot);

  kernels::Vec<T> input(int slot, int B) const;  // (R, C) for a micro-batch of B samples
  kernels::Vec<T> output(int slot) const;        // (R, C) of the slot's micro-batch
  kernels::Vec<T> input_grad() const;            // (R, C) of the last backward

  // Mixture of experts, summed over the training forwards since the last call, per block
  // of the chunk (dense blocks stay empty): the load-balancing losses (aux_loss_coef
  // included) and each expert's kept choices among this rank's tokens.
  struct MoeStats {
    double aux = 0;
    std::vector<std::int64_t> load;  // (n_expert)
    std::int64_t dropped = 0, choices = 0;
  };
  std::vector<MoeStats> take_moe_stats();

 private:
  struct Acts;         // one slot's activations, carved for its micro-batch
  struct WeightGrads;  // one W record, carved for it
  struct Slot {
    std::int64_t offset = 0;             // of its activations in acts_
    std::int64_t stats_offset = 0;       // of their statistics in stats_
    Kokkos::View<int*> tokens, targets;  // (micro_batch, S), on the first / last stage
    int B = 0;                           // samples of the micro-batch now in the slot
    int head = -1, weight = -1;          // its head slot and W record while it holds them
    std::vector<Routing> routing;        // per block: its MoE routing (MoE blocks only)
  };
  Acts carve(int slot, const Ctx& c) const;
  WeightGrads carve_weight(int slot, const Ctx& c, const Acts& a) const;
  typename Block<P>::Grads carve_scratch(const Ctx& c, bool moe = false) const;
  template <class V>
  kernels::Vec<V> tensor(const kernels::Vec<V>& unit_view, int unit, const std::string& name) const;
  bool is_moe(int l) const { return dims_.is_moe_layer(layout_.first_layer + l); }
  Block<P> block(int unit, const kernels::Vec<T>& w, const kernels::Vec<G>& g) const;
  void set_moe(Block<P>& b, int unit, const kernels::Vec<T>& w, const kernels::Vec<G>& g) const;
  void count_moe(int l, const Routing& r);
  kernels::Vec<T> rerun_partial(const Ctx& c) const;
  Embedding<P> embedding(const kernels::Vec<T>& w, const kernels::Vec<G>& g) const;
  void head_backward(const Ctx& c, const Acts& a, const typename Block<P>::Grads& g, A dloss,
                     const kernels::Vec<T>& emb, const kernels::Vec<G>& demb);
  static int take(std::vector<int>& free, const char* what);
  Head<P> head(const kernels::Vec<T>& w, const kernels::Vec<G>& g, const kernels::Vec<T>& wte,
               const kernels::Vec<G>& dwte) const;
  ResidentStore<P>& resident() const;
  int wte_unit() const { return layout_.has_embedding ? u_emb_ : u_head_; }

  Dims dims_;
  ShardCoord coord_;
  ChunkLayout layout_;
  std::vector<Unit> units_;
  int u_emb_ = -1, u_block0_ = -1, u_head_ = -1;  // unit indices (-1: not in this chunk)
  int micro_batch_ = 0, last_B_ = 0;              // capacity; B of the last backward
  ActivationSizes sizes_;                         // per slot, at capacity
  TensorParallel tp_;
  ContextParallel cp_;    // this rank's share of each sequence
  int S_ = 0;             // positions per sample here: seq_len / C
  Comm* ep_ = nullptr;    // expert parallelism (MoE blocks)
  double aux_scale_ = 1;  // d(objective)/d(a micro-batch's aux loss)
  Recompute recompute_ = Recompute::none;
  std::vector<MoeStats> moe_stats_;
  std::unique_ptr<ResidentStore<P>> own_store_;
  ParamStore<P>* store_ = nullptr;
  std::vector<Slot> slots_;
  std::vector<int> free_heads_, free_weights_;
  bool can_split_ = false;
  TrackedView<T> acts_, scratch_;            // every slot's activations; the backward's scratch
  TrackedView<T> head_acts_, weight_acts_;   // the head slots; the W records
  TrackedView<A> head_stats_;                // the head slots' statistics
  TrackedView<G> weight_sums_;               // the W records' LayerNorm parameter sums
  TrackedView<T> recomputed_;                // one block's recomputed activations (train%recompute)
  TrackedView<A> stats_, recomputed_stats_;  // their statistics, in the accumulate type
  TrackedView<G> scratch_grads_;             // the backward's LayerNorm gradient scratch
};

}  // namespace ptrain::model
