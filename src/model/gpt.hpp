// model/gpt.hpp — the GPT-2 model on one rank's shard: flat parameter and gradient
// buffers (every tensor a view at an offset, model/layout.hpp), hand-written forward and
// backward layer by layer (llm.c), activations kept for the backward.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "deck/config.hpp"
#include "kernels/view.hpp"
#include "model/layout.hpp"
#include "util/memory.hpp"

namespace ptrain::model {

// Where the model finds its parameters and gradients, one unit at a time (units_of():
// the embedding, each block, the head), as views of the unit's flat range. The resident
// store keeps both whole on this rank; the data-parallel engine (parallel/) supplies
// sharded ones for ZeRO 2 and 3, which gather and reduce unit by unit.
template <class T>
class ParamStore {
 public:
  virtual ~ParamStore() = default;
  virtual kernels::Vec<T> params(int unit) = 0;  // the unit's parameters, ready to read
  virtual void release_params(int unit) {}       // not needed again until the next params()
  virtual kernels::Vec<T> grads(int unit) = 0;   // where the unit's gradients accumulate
  virtual void grads_done(int unit) {}           // this micro-batch's unit gradients are final
};

// Both buffers whole: parameters (MemCategory::params) and gradients (grads), each
// `numel` long (the chunk's flat size, padded up when ZeRO wants equal shards).
template <class T>
class ResidentStore : public ParamStore<T> {
 public:
  ResidentStore(const ChunkLayout& layout, std::int64_t numel);
  kernels::Vec<T> params(int unit) override;
  kernels::Vec<T> grads(int unit) override;
  kernels::Vec<T> all_params() const { return params_.view(); }
  kernels::Vec<T> all_grads() const { return grads_.view(); }

 protected:
  std::vector<Unit> units_;
  TrackedView<T> params_, grads_;
};

template <class T>
class GPT {
 public:
  // Builds this rank's chunk and allocates the activations of one micro-batch of
  // `micro_batch` samples. Parameters and gradients live in `store` (not owned; it must
  // outlive the model), or, when null, in a resident store the model owns. With
  // coord.T > 1 the model is this rank's tensor-parallel shard (ARCHITECTURE.md section 4)
  // and `tp` is the group it reduces over: heads and MLP columns split, row-parallel
  // outputs all-reduced (their biases added by tp rank 0), the embedding and the loss
  // vocab-parallel.
  GPT(const Config& config, const ShardCoord& coord, int micro_batch,
      ParamStore<T>* store = nullptr, Comm* tp = nullptr);

  const Dims& dims() const { return dims_; }
  const ChunkLayout& layout() const { return layout_; }
  const std::vector<Unit>& units() const { return units_; }
  // The whole buffers and one tensor's view in them; only with the resident store.
  kernels::Vec<T> params() const;
  kernels::Vec<T> grads() const;
  kernels::Vec<T> param(const std::string& name) const;
  kernels::Vec<T> grad(const std::string& name) const;

  // GPT-2 init: N(0, 0.02) for matrices and embeddings, residual projections scaled by
  // 1/sqrt(2*n_layer), zero biases, unit LayerNorm gains. Element i of a tensor draws
  // normal(seed, hash(name), global flat index i): the same model on every grid.
  void init_weights(std::uint64_t seed);  // the resident store
  // The initial values of flat elements [lo, lo + out.extent(0)) into out (a ZeRO shard).
  void init_range(std::uint64_t seed, kernels::Vec<T> out, std::int64_t lo) const;
  void zero_grads();  // the resident store

  // One micro-batch of B <= micro_batch samples: inputs, targets (B, S) on the host.
  // Returns the sum of the B*S token losses (the caller divides by the global count).
  // for_backward = false (evaluation) releases every unit at the end.
  double forward(const std::int32_t* inputs, const std::int32_t* targets, int B,
                 bool for_backward = true);
  // After forward: accumulates into grads() the gradient of dloss * (sum of token losses),
  // e.g. dloss = 1 / (tokens in the global batch) for the mean loss.
  void backward(T dloss);

 private:
  struct Block;  // views of one block's parameters (or gradients)
  Block block_views(const kernels::Vec<T>& unit_view, int unit) const;
  // A tensor inside its unit's view.
  kernels::Vec<T> tensor(const kernels::Vec<T>& unit_view, int unit, const std::string& name) const;
  ResidentStore<T>& resident() const;

  Config config_;
  Dims dims_;
  ShardCoord coord_;
  ChunkLayout layout_;
  std::vector<Unit> units_;
  int u_emb_ = -1, u_block0_ = -1, u_head_ = -1;  // unit indices
  int micro_batch_ = 0, B_ = 0;                   // capacity and the current micro-batch
  std::unique_ptr<ResidentStore<T>> own_store_;
  ParamStore<T>* store_ = nullptr;
  Comm* tp_ = nullptr;  // null or size 1: no tensor parallelism
  void tp_sum(const kernels::Vec<T>& x);  // all-reduce over tp (a no-op without it)
  bool sequence_parallel() const;         // parallel%sequence_parallel with tp > 1
  void tp_sum_to_rows(const kernels::Vec<T>& full, const kernels::Vec<T>& rows);
  void tp_gather_rows(const kernels::Vec<T>& full);
  TrackedView<T> acts_, scratch_;        // activations kept for backward; backward scratch
  Kokkos::View<int*> tokens_, targets_;  // (micro_batch, S)
  double last_loss_sum_ = 0;
};

}  // namespace ptrain::model
