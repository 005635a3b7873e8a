// optim/optim.hpp — AdamW, SGD, the learning-rate schedule, gradient-norm clipping.
//
// Optimizers update a contiguous range [lo, hi) of a flat parameter buffer (a ZeRO shard
// may cut tensors anywhere); which elements get weight decay is given as Segments over
// the whole buffer. The update of an element depends only on that element, t and lr, so
// updating a buffer whole or in shards gives bit-identical results.
// Moments are stored in the parameters' type T: the master type of the precision policy
// (fp32 / fp64; a bf16 run keeps fp32 masters and moments, this same code with T = float).
// Gradients come in T, or in bf16 (parallel%grad_dtype = 'bf16'), widened element by element.
#pragma once
#include <Kokkos_Core.hpp>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "deck/config.hpp"
#include "util/bf16.hpp"
#include "util/memory.hpp"

namespace ptrain::optim {

// Learning rate at step t, counted from 1 (W = warmup, N = steps):
//   t <= W:            lr * t / W                                          (linear warmup)
//   t > W, constant:   lr
//   t > W, cosine:     min_lr + (lr - min_lr) * (1 + cos(pi * r)) / 2,
//                      r = min(1, (t - W) / (N - W))   (r = 1 when N <= W)
// so the cosine reaches min_lr at t = N and stays there.
struct LrSchedule {
  enum Decay { cosine, constant };
  double lr = 3e-4, min_lr = 0;
  std::int64_t warmup = 0, steps = 1;
  Decay decay = cosine;
  double at(std::int64_t step) const;
};
// From train%lr, min_lr, warmup, decay and run%steps.
LrSchedule schedule_from_config(const Config& config);

// Elements [begin, end) of the flat buffer, decayed or not (matrices and embeddings decay;
// biases and norms do not).
struct Segment {
  std::size_t begin = 0, end = 0;
  bool decay = false;
};

// The parts of `segments` (sorted and contiguous) inside [lo, hi), shifted by -lo so they
// index the shard, with neighbours of equal flag merged. Throws unless they cover [lo, hi).
std::vector<Segment> shard_segments(const std::vector<Segment>& segments, std::size_t lo,
                                    std::size_t hi);

struct Hyper {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;  // AdamW only
  double weight_decay = 0.0;                     // decoupled, on decayed segments only
};
Hyper hyper_from_config(const Config& config);  // train%beta1, beta2, eps, weight_decay

template <class T>
class Optimizer {
 public:
  using View = Kokkos::View<T*>;
  using ConstView = Kokkos::View<const T*>;
  virtual ~Optimizer() = default;
  // One update of the shard; params and grads have extent size(). Increments t(). The
  // update uses grad_scale * g (clipping, clip_factor): the same rounded product a scaling
  // pass over the gradients would store, without that pass; grads are left as they are.
  virtual void step(const View& params, const ConstView& grads, double lr, double grad_scale) = 0;
  virtual void step(const View& params, const Kokkos::View<const bf16*>& grads, double lr,
                    double grad_scale) = 0;
  // The state over the shard by name (AdamW: "m", "v"; SGD: none), for checkpoints.
  virtual std::vector<std::pair<std::string, View>> state() const = 0;
  std::size_t size() const { return n_; }
  std::int64_t t() const { return t_; }   // updates done (AdamW's bias-correction step)
  void set_t(std::int64_t t) { t_ = t; }  // after loading a checkpoint

 protected:
  Optimizer(const std::vector<Segment>& segments, std::size_t lo, std::size_t hi,
            const Hyper& hyper);
  std::size_t n_ = 0;
  std::int64_t t_ = 0;
  Hyper hyper_;
  std::vector<Segment> segments_;  // the shard's merged segments (host: one launch each)
};

// PyTorch's AdamW (decoupled decay), per element with step t, wd on decayed elements and
// g = grad_scale * grad:
//   p *= 1 - lr*wd;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
//   p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
template <class T>
class AdamW final : public Optimizer<T> {
 public:
  AdamW(const std::vector<Segment>& segments, std::size_t lo, std::size_t hi, const Hyper& hyper);
  void step(const typename Optimizer<T>::View& params,
            const typename Optimizer<T>::ConstView& grads, double lr, double grad_scale) override;
  void step(const typename Optimizer<T>::View& params, const Kokkos::View<const bf16*>& grads,
            double lr, double grad_scale) override;
  std::vector<std::pair<std::string, typename Optimizer<T>::View>> state() const override;

 private:
  template <class G>
  void step_with(const typename Optimizer<T>::View& params, const Kokkos::View<const G*>& grads,
                 double lr, double grad_scale);
  TrackedView<T> m_, v_;  // MemCategory::optimizer, shard-sized, zero at start
};

// Plain SGD without momentum: p *= 1 - lr*wd (decayed elements); p -= lr*g, g = grad_scale * grad.
template <class T>
class SGD final : public Optimizer<T> {
 public:
  SGD(const std::vector<Segment>& segments, std::size_t lo, std::size_t hi, const Hyper& hyper);
  void step(const typename Optimizer<T>::View& params,
            const typename Optimizer<T>::ConstView& grads, double lr, double grad_scale) override;
  void step(const typename Optimizer<T>::View& params, const Kokkos::View<const bf16*>& grads,
            double lr, double grad_scale) override;
  std::vector<std::pair<std::string, typename Optimizer<T>::View>> state() const override {
    return {};
  }

 private:
  template <class G>
  void step_with(const typename Optimizer<T>::View& params, const Kokkos::View<const G*>& grads,
                 double lr, double grad_scale);
};

// name: "adamw" | "sgd" (train%optimizer).
template <class T>
std::unique_ptr<Optimizer<T>> make_optimizer(const std::string& name,
                                             const std::vector<Segment>& segments, std::size_t lo,
                                             std::size_t hi, const Hyper& hyper);

// Clipping by the global norm (kernels::sum_of_squares over each rank's range, reduced by
// the caller): 1 when max_norm <= 0 or global_norm <= max_norm, else
// max_norm / (global_norm + 1e-6), the optimizer's grad_scale.
double clip_factor(double global_norm, double max_norm);

}  // namespace ptrain::optim
