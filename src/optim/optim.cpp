// optim/optim.cpp — schedule, segments, AdamW / SGD kernels, clipping helpers.
#include "optim/optim.hpp"

#include <algorithm>
#include <cmath>

#include "kernels/parallel.hpp"
#include "util/error.hpp"
#include "util/kmath.hpp"

namespace ptrain::optim {

// ---------------------------------------------------------------- schedule

double LrSchedule::at(std::int64_t step) const {
  PTRAIN_REQUIRE(step >= 1, "optim: learning rate asked for step ", step, " (steps count from 1)");
  if (step <= warmup) return lr * double(step) / double(warmup);
  if (decay == constant) return lr;
  const double r =
      steps <= warmup ? 1.0 : std::min(1.0, double(step - warmup) / double(steps - warmup));
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(3.14159265358979323846 * r));
}

LrSchedule schedule_from_config(const Config& config) {
  LrSchedule s;
  s.lr = config.train.lr;
  s.min_lr = config.train.min_lr;
  s.warmup = config.train.warmup;
  s.steps = config.run.steps;
  PTRAIN_REQUIRE(config.train.decay == "cosine" || config.train.decay == "constant",
                 "optim: unknown train%decay '", config.train.decay, "' (cosine or constant)");
  s.decay = config.train.decay == "cosine" ? LrSchedule::cosine : LrSchedule::constant;
  return s;
}

Hyper hyper_from_config(const Config& config) {
  Hyper h;
  h.beta1 = config.train.beta1;
  h.beta2 = config.train.beta2;
  h.eps = config.train.eps;
  h.weight_decay = config.train.weight_decay;
  return h;
}

// ---------------------------------------------------------------- segments

std::vector<Segment> shard_segments(const std::vector<Segment>& segments, std::size_t lo,
                                    std::size_t hi) {
  PTRAIN_REQUIRE(lo <= hi, "optim: shard range [", lo, ", ", hi, ") is reversed");
  std::vector<Segment> out;
  std::size_t covered = lo;  // everything in [lo, covered) is assigned
  for (std::size_t k = 0; k < segments.size(); ++k) {
    const Segment& s = segments[k];
    PTRAIN_REQUIRE(s.begin <= s.end && (k == 0 || s.begin == segments[k - 1].end),
                   "optim: decay segments must be sorted and contiguous; segment ", k, " is [",
                   s.begin, ", ", s.end, ")");
    const std::size_t b = std::max(s.begin, lo), e = std::min(s.end, hi);
    if (b >= e) continue;
    PTRAIN_REQUIRE(b == covered, "optim: decay segments leave [", covered, ", ", b,
                   ") of the shard uncovered");
    covered = e;
    if (!out.empty() && out.back().decay == s.decay)
      out.back().end = e - lo;
    else
      out.push_back(Segment{b - lo, e - lo, s.decay});
  }
  PTRAIN_REQUIRE(covered == hi, "optim: decay segments leave [", covered, ", ", hi,
                 ") of the shard uncovered");
  return out;
}

// ---------------------------------------------------------------- kernels

namespace detail {

template <class T>
struct AdamWCoeffs {
  T keep;        // 1 - lr*wd on decayed elements
  T b1, one_b1;  // beta1, 1 - beta1
  T b2, one_b2;  // beta2, 1 - beta2
  T step_size;   // lr / (1 - beta1^t)
  T sqrt_bc2;    // sqrt(1 - beta2^t)
  T eps;
  T grad_scale;  // clipping: the gradient used is grad_scale * g
};

// p, g, m, v: (n,) — the shard; elements [begin, end) of it, all decayed by `keep` (1: none).
// Operation order as torch.optim.AdamW (single tensor).
template <class T, class G>
void adamw_update(const Kokkos::View<T*>& p, const Kokkos::View<const G*>& g,
                  const Kokkos::View<T*>& m, const Kokkos::View<T*>& v, std::size_t begin,
                  std::size_t end, const T keep, const AdamWCoeffs<T> c) {
  kernels::parallel_items(
      "ptrain::optim::adamw", std::int64_t(end - begin),
      KOKKOS_LAMBDA(const std::int64_t k) {
        const std::int64_t i = std::int64_t(begin) + k;
        const T x = p(i) * keep;
        const T gi = T(g(i)) * c.grad_scale;
        const T mi = m(i) * c.b1 + c.one_b1 * gi;
        const T vi = v(i) * c.b2 + c.one_b2 * gi * gi;
        m(i) = mi;
        v(i) = vi;
        const T denom = kmath::sqrt(vi) / c.sqrt_bc2 + c.eps;
        p(i) = x + (-c.step_size * mi) / denom;
      },
      kernels::kForkElements);
}

// p, g: (n,); elements [begin, end): p *= keep (1: not decayed), then p -= lr*(scale*g).
template <class T, class G>
void sgd_update(const Kokkos::View<T*>& p, const Kokkos::View<const G*>& g, std::size_t begin,
                std::size_t end, const T keep, const T lr, const T scale) {
  kernels::parallel_items(
      "ptrain::optim::sgd", std::int64_t(end - begin),
      KOKKOS_LAMBDA(const std::int64_t k) {
        const std::int64_t i = std::int64_t(begin) + k;
        p(i) = p(i) * keep - lr * (T(g(i)) * scale);
      },
      kernels::kForkElements);
}

}  // namespace detail

// ---------------------------------------------------------------- optimizers

template <class T>
Optimizer<T>::Optimizer(const std::vector<Segment>& segments, std::size_t lo, std::size_t hi,
                        const Hyper& hyper)
    : n_(hi - lo), hyper_(hyper), segments_(shard_segments(segments, lo, hi)) {}

namespace {
void check_extents(const char* who, std::size_t n, std::size_t params, std::size_t grads, double lr,
                   double grad_scale) {
  PTRAIN_REQUIRE(params == n && grads == n, "optim: ", who, " shard has ", n,
                 " elements but got params of ", params, " and grads of ", grads);
  PTRAIN_REQUIRE(std::isfinite(lr), "optim: ", who, " learning rate is ", lr);
  PTRAIN_REQUIRE(std::isfinite(grad_scale), "optim: ", who, " gradient scale is ", grad_scale);
}
}  // namespace

template <class T>
AdamW<T>::AdamW(const std::vector<Segment>& segments, std::size_t lo, std::size_t hi,
                const Hyper& hyper)
    : Optimizer<T>(segments, lo, hi, hyper),
      m_(MemCategory::optimizer, "optim.adamw.m", hi - lo),
      v_(MemCategory::optimizer, "optim.adamw.v", hi - lo) {}  // Views start zeroed

template <class T>
template <class G>
void AdamW<T>::step_with(const typename Optimizer<T>::View& params,
                         const Kokkos::View<const G*>& grads, double lr, double grad_scale) {
  check_extents("AdamW", this->n_, params.extent(0), grads.extent(0), lr, grad_scale);
  const Hyper& h = this->hyper_;
  const std::int64_t t = ++this->t_;
  detail::AdamWCoeffs<T> c;
  c.keep = T(1.0 - lr * h.weight_decay);
  c.b1 = T(h.beta1);
  c.one_b1 = T(1.0 - h.beta1);
  c.b2 = T(h.beta2);
  c.one_b2 = T(1.0 - h.beta2);
  c.step_size = T(lr / (1.0 - std::pow(h.beta1, double(t))));
  c.sqrt_bc2 = T(std::sqrt(1.0 - std::pow(h.beta2, double(t))));
  c.eps = T(h.eps);
  c.grad_scale = T(grad_scale);
  // One launch per run of equally decayed elements (merged segments: few and long).
  for (const auto& seg : this->segments_)
    detail::adamw_update<T, G>(params, grads, m_.view(), v_.view(), seg.begin, seg.end,
                               seg.decay ? c.keep : T(1), c);
}

template <class T>
std::vector<std::pair<std::string, typename Optimizer<T>::View>> AdamW<T>::state() const {
  return {{"m", m_.view()}, {"v", v_.view()}};
}

template <class T>
SGD<T>::SGD(const std::vector<Segment>& segments, std::size_t lo, std::size_t hi,
            const Hyper& hyper)
    : Optimizer<T>(segments, lo, hi, hyper) {}

template <class T>
template <class G>
void SGD<T>::step_with(const typename Optimizer<T>::View& params,
                       const Kokkos::View<const G*>& grads, double lr, double grad_scale) {
  check_extents("SGD", this->n_, params.extent(0), grads.extent(0), lr, grad_scale);
  ++this->t_;
  const T keep = T(1.0 - lr * this->hyper_.weight_decay);
  for (const auto& seg : this->segments_)
    detail::sgd_update<T, G>(params, grads, seg.begin, seg.end, seg.decay ? keep : T(1), T(lr),
                             T(grad_scale));
}

template <class T>
void AdamW<T>::step(const typename Optimizer<T>::View& params,
                    const typename Optimizer<T>::ConstView& grads, double lr, double grad_scale) {
  step_with(params, grads, lr, grad_scale);
}
template <class T>
void AdamW<T>::step(const typename Optimizer<T>::View& params,
                    const Kokkos::View<const bf16*>& grads, double lr, double grad_scale) {
  step_with(params, grads, lr, grad_scale);
}
template <class T>
void SGD<T>::step(const typename Optimizer<T>::View& params,
                  const typename Optimizer<T>::ConstView& grads, double lr, double grad_scale) {
  step_with(params, grads, lr, grad_scale);
}
template <class T>
void SGD<T>::step(const typename Optimizer<T>::View& params, const Kokkos::View<const bf16*>& grads,
                  double lr, double grad_scale) {
  step_with(params, grads, lr, grad_scale);
}

template <class T>
std::unique_ptr<Optimizer<T>> make_optimizer(const std::string& name,
                                             const std::vector<Segment>& segments, std::size_t lo,
                                             std::size_t hi, const Hyper& hyper) {
  if (name == "adamw") return std::make_unique<AdamW<T>>(segments, lo, hi, hyper);
  if (name == "sgd") return std::make_unique<SGD<T>>(segments, lo, hi, hyper);
  throw Error(cat("optim: unknown train%optimizer '", name, "' (adamw or sgd)"));
}

// ---------------------------------------------------------------- clipping

double clip_factor(double global_norm, double max_norm) {
  if (max_norm <= 0 || global_norm <= max_norm) return 1.0;
  return max_norm / (global_norm + 1e-6);
}

#define PTRAIN_OPTIM_INSTANTIATE(T)                         \
  template class Optimizer<T>;                              \
  template class AdamW<T>;                                  \
  template class SGD<T>;                                    \
  template std::unique_ptr<Optimizer<T>> make_optimizer<T>( \
      const std::string&, const std::vector<Segment>&, std::size_t, std::size_t, const Hyper&);
PTRAIN_OPTIM_INSTANTIATE(float)
PTRAIN_OPTIM_INSTANTIATE(double)
#undef PTRAIN_OPTIM_INSTANTIATE

}  // namespace ptrain::optim
