// model/gpt.hpp — the GPT-2 model on one rank's shard: flat parameter and gradient
// buffers (every tensor a view at an offset, model/layout.hpp), hand-written forward and
// backward layer by layer (llm.c), activations kept for the backward.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "deck/config.hpp"
#include "kernels/view.hpp"
#include "model/layout.hpp"
#include "util/memory.hpp"

namespace ptrain::model {

template <class T>
class GPT {
 public:
  // Builds this rank's chunk and allocates parameters, gradients (zero) and the
  // activations of one micro-batch of `micro_batch` samples.
  GPT(const Config& config, const ShardCoord& coord, int micro_batch);

  const Dims& dims() const { return dims_; }
  const ChunkLayout& layout() const { return layout_; }
  kernels::Vec<T> params() const { return params_.view(); }
  kernels::Vec<T> grads() const { return grads_.view(); }
  kernels::Vec<T> param(const std::string& name) const;  // one tensor's view
  kernels::Vec<T> grad(const std::string& name) const;

  // GPT-2 init: N(0, 0.02) for matrices and embeddings, residual projections scaled by
  // 1/sqrt(2*n_layer), zero biases, unit LayerNorm gains. Element i of a tensor draws
  // normal(seed, hash(name), global flat index i): the same model on every grid.
  void init_weights(std::uint64_t seed);
  void zero_grads();

  // One micro-batch of B <= micro_batch samples: inputs, targets (B, S) on the host.
  // Returns the sum of the B*S token losses (the caller divides by the global count).
  double forward(const std::int32_t* inputs, const std::int32_t* targets, int B);
  // After forward: accumulates into grads() the gradient of dloss * (sum of token losses),
  // e.g. dloss = 1 / (tokens in the global batch) for the mean loss.
  void backward(T dloss);

 private:
  struct Block;  // views of one block's parameters (or gradients)
  Block block_views(const TrackedView<T>& buffer, int layer) const;
  kernels::Vec<T> view_of(const TrackedView<T>& buffer, const std::string& name) const;

  Config config_;
  Dims dims_;
  ShardCoord coord_;
  ChunkLayout layout_;
  int micro_batch_ = 0, B_ = 0;  // capacity and the current micro-batch
  TrackedView<T> params_, grads_;
  TrackedView<T> acts_, scratch_;        // activations kept for backward; backward scratch
  Kokkos::View<int*> tokens_, targets_;  // (micro_batch, S)
  double last_loss_sum_ = 0;
};

}  // namespace ptrain::model
