#include "parallel/data_parallel.hpp"

#include <algorithm>
#include <limits>

#include "kernels/kernels.hpp"
#include "util/error.hpp"

namespace ptrain::parallel {

namespace K = kernels;
using model::Unit;

namespace {

template <class T>
K::Vec<T> slice(const K::Vec<T>& v, std::int64_t lo, std::int64_t hi) {
  return Kokkos::subview(v, Kokkos::make_pair(lo, std::max(lo, hi)));
}

std::int64_t max_unit(const std::vector<Unit>& units, bool embedding) {
  std::int64_t m = 0;
  for (const auto& u : units)
    if ((u.kind == Unit::embedding) == embedding) m = std::max(m, u.hi - u.lo);
  return m;
}

}  // namespace

DataParallelSizes data_parallel_sizes(const model::ChunkLayout& layout, int D, int zero,
                                      double bucket_mb, std::size_t element_bytes) {
  DataParallelSizes s;
  s.numel = layout.numel;
  s.shard = (layout.numel + D - 1) / D;
  const std::int64_t padded = s.shard * D;
  const auto units = model::units_of(layout);
  const std::int64_t emb = max_unit(units, true), other = max_unit(units, false);
  const std::int64_t windows = emb + 2 * other;  // the embedding's and two rotating ones
  s.params = zero >= 3 ? s.shard : padded;
  s.grads = zero >= 2 ? s.shard : padded;
  s.optimizer_range = zero >= 1 ? s.shard : s.numel;
  s.bucket =
      std::max<std::int64_t>(1, std::int64_t(bucket_mb * 1024 * 1024 / double(element_bytes)));
  // ZeRO 2: gradient windows and their receive buffers; ZeRO 3: parameter windows too.
  s.comm = zero == 2 ? 2 * windows : zero == 3 ? 3 * windows : 0;
  return s;
}

// ---------------------------------------------------------------------------------------
// The ParamStore the model uses, for every stage.

template <class T>
class DataParallel<T>::Store : public model::ParamStore<T> {
 public:
  Store(DataParallel& dp, const model::ChunkLayout& layout)
      : dp_(dp), units_(model::units_of(layout)) {
    const auto& z = dp.sizes_;
    const std::int64_t padded = z.shard * dp.D_;
    if (dp.zero_ <= 2)
      params_ = TrackedView<T>(MemCategory::params, "ptrain::params", std::size_t(padded));
    else
      params_ = TrackedView<T>(MemCategory::params, "ptrain::params.shard", std::size_t(z.shard));
    if (dp.zero_ <= 1)
      grads_ = TrackedView<T>(MemCategory::grads, "ptrain::grads", std::size_t(padded));
    else
      grads_ = TrackedView<T>(MemCategory::grads, "ptrain::grads.shard", std::size_t(z.shard));
    if (dp.zero_ <= 1) {
      // Buckets from the end of the buffer (the head) towards wte, as the backward goes.
      for (std::int64_t hi = padded; hi > 0; hi -= z.bucket) {
        Bucket b;
        b.lo = std::max<std::int64_t>(0, hi - z.bucket);
        b.hi = hi;
        b.segments = segments(layout, b.lo, b.hi);
        buckets_.push_back(std::move(b));
      }
    } else {
      const std::int64_t emb = max_unit(units_, true), other = max_unit(units_, false);
      auto window = [](const char* label, std::int64_t n) {
        Window w;
        w.buf = TrackedView<T>(MemCategory::comm, label, std::size_t(std::max<std::int64_t>(n, 1)));
        w.recv =
            TrackedView<T>(MemCategory::comm, label, std::size_t(std::max<std::int64_t>(n, 1)));
        return w;
      };
      grad_emb_ = window("ptrain::grad_window.embedding", emb);
      for (auto& w : grad_slots_) w = window("ptrain::grad_window", other);
      if (dp.zero_ == 3) {
        param_emb_.buf = TrackedView<T>(MemCategory::comm, "ptrain::param_window.embedding",
                                        std::size_t(std::max<std::int64_t>(emb, 1)));
        for (auto& w : param_slots_)
          w.buf = TrackedView<T>(MemCategory::comm, "ptrain::param_window",
                                 std::size_t(std::max<std::int64_t>(other, 1)));
      }
    }
  }

  // --- parameters -----------------------------------------------------------------------
  K::Vec<T> params(int unit, model::Phase phase) override {
    const Unit& u = units_[std::size_t(unit)];
    if (dp_.zero_ <= 2) return slice(params_.view(), u.lo, u.hi);
    if (u.kind == Unit::embedding) {
      if (param_emb_.unit != unit) {
        gather(param_emb_, unit);
        param_emb_.req.wait();
      }
      return slice(param_emb_.buf.view(), 0, u.hi - u.lo);
    }
    Window* w = find_param_slot(unit);
    if (!w) {
      w = free_param_slot();
      gather(*w, unit);
    }
    w->req.wait();
    current_ = unit;
    // Prefetch the unit this pass needs next: up the chunk in a forward, down in a backward.
    const int next = unit + (phase == model::Phase::forward ? 1 : -1);
    if (next >= 0 && next < int(units_.size()) &&
        units_[std::size_t(next)].kind != Unit::embedding && !find_param_slot(next))
      gather(*free_param_slot(), next);
    return slice(w->buf.view(), 0, u.hi - u.lo);
  }

  // A released unit's window is freed for reuse: it is gathered again when needed, so each
  // block and the head are gathered exactly twice per micro-batch (forward and backward).
  void release_params(int unit) override {
    if (unit != current_) return;
    current_ = -1;
    for (auto& w : param_slots_)
      if (w.unit == unit) w.unit = -1;
  }

  // --- gradients ------------------------------------------------------------------------
  K::Vec<T> grads(int unit) override {
    const Unit& u = units_[std::size_t(unit)];
    if (dp_.zero_ <= 1) return slice(grads_.view(), u.lo, u.hi);
    Window* w = nullptr;
    if (u.kind == Unit::embedding) {
      w = &grad_emb_;
    } else {
      for (auto& s : grad_slots_)
        if (s.unit == unit && s.open) w = &s;
      if (!w) {
        w = &grad_slots_[std::size_t(next_grad_slot_)];
        next_grad_slot_ = 1 - next_grad_slot_;
      }
    }
    if (!(w->unit == unit && w->open)) {
      fold(*w);  // the previous reduction from this window, if any, lands in the shard
      K::fill(slice(w->buf.view(), 0, u.hi - u.lo), T(0));
      w->unit = unit;
      w->open = true;
    }
    return slice(w->buf.view(), 0, u.hi - u.lo);
  }

  void grads_done(int unit) override {
    const Unit& u = units_[std::size_t(unit)];
    if (dp_.zero_ <= 1) {
      if (!last_micro_) return;
      ready_lo_ = std::min(ready_lo_, u.lo);
      for (auto& b : buckets_)
        if (!b.launched && b.lo >= ready_lo_) launch(b);
      progress();
      return;
    }
    Window* w = &grad_emb_;
    for (auto& s : grad_slots_)
      if (s.unit == unit && s.open) w = &s;
    // Reduce-scatter the unit's range onto the shards it overlaps.
    w->req = dp_.group_.reduce_scatter_sum(w->buf.data(), w->recv.data(), shard_counts(u));
    w->pending_fold = true;
    w->open = false;
    progress();
  }

  // --- step control ---------------------------------------------------------------------
  void begin_step() {
    K::fill(grads_.view(), T(0));
    done_early_bytes_ = total_bytes_ = 0;
  }

  // The parameters changed (an update, loaded weights): every gathered copy is stale.
  void invalidate_params() {
    if (dp_.zero_ != 3) return;
    param_emb_.req.wait();
    param_emb_.unit = -1;
    for (auto& w : param_slots_) {
      w.req.wait();
      w.unit = -1;
    }
    current_ = -1;
  }

  void begin_micro_batch(bool last) {
    last_micro_ = last;
    ready_lo_ = std::numeric_limits<std::int64_t>::max();  // nothing final yet
  }

  void finish_gradients() {
    if (dp_.zero_ <= 1) {
      for (auto& b : buckets_) {
        if (!b.launched) launch(b);
        const double bytes = double(b.hi - b.lo) * sizeof(T);
        total_bytes_ += bytes;
        if (b.finished_early || test(b)) done_early_bytes_ += bytes;
        for (auto& r : b.reqs) r.wait();
        b.reqs.clear();
        b.launched = b.finished_early = false;
      }
    } else {
      fold(grad_emb_);
      for (auto& w : grad_slots_) fold(w);
    }
    dp_.overlap_ = total_bytes_ > 0 ? done_early_bytes_ / total_bytes_ : 1.0;
  }

  TrackedView<T> params_, grads_;

 private:
  // A range of the flat buffer reduced over one group: expert tensors over the
  // expert-grad group (d, c) when experts are split over ep, everything else over dense-grad.
  struct Segment {
    std::int64_t lo = 0, hi = 0;
    bool expert = false;
  };
  struct Bucket {
    std::int64_t lo = 0, hi = 0;
    std::vector<Segment> segments;
    std::vector<Request> reqs;
    bool launched = false, finished_early = false;
  };

  // [lo, hi) cut where the reduction group changes (one segment without expert parallelism).
  std::vector<Segment> segments(const model::ChunkLayout& layout, std::int64_t lo,
                                std::int64_t hi) const {
    std::vector<Segment> out;
    auto add = [&](std::int64_t a, std::int64_t b, bool expert) {
      if (a >= b) return;
      if (!out.empty() && out.back().expert == expert && out.back().hi == a)
        out.back().hi = b;
      else
        out.push_back({a, b, expert});
    };
    if (!dp_.split_experts()) {
      add(lo, hi, false);
      return out;
    }
    std::int64_t at = lo;
    for (const auto& t : layout.tensors) {
      const std::int64_t a = std::max(at, t.offset), b = std::min(hi, t.offset + t.numel);
      if (a >= b) continue;
      add(at, a, false);  // a gap (none in a layout; kept general)
      add(a, b, t.expert);
      at = b;
    }
    add(at, hi, false);  // padding
    return out;
  }
  void launch(Bucket& b) {
    for (const Segment& s : b.segments)
      b.reqs.push_back((s.expert ? *dp_.experts_ : dp_.group_)
                           .all_reduce_sum(grads_.data() + s.lo, std::size_t(s.hi - s.lo)));
    b.launched = true;
  }
  static bool test(Bucket& b) {
    bool done = true;
    for (auto& r : b.reqs) done = r.test() && done;
    return done;
  }
  struct Window {
    TrackedView<T> buf, recv;
    int unit = -1;
    bool open = false, pending_fold = false;
    Request req;
  };

  // Part of [lo, hi) owned by shard r, as a flat range.
  std::pair<std::int64_t, std::int64_t> overlap(std::int64_t lo, std::int64_t hi, int r) const {
    const std::int64_t S = dp_.sizes_.shard;
    const std::int64_t a = std::max(lo, r * S), b = std::min(hi, (r + 1) * S);
    return {a, std::max(a, b)};
  }

  // How many elements of unit u each shard holds (the reduce-scatter and all-gather counts).
  std::vector<int> shard_counts(const Unit& u) const {
    std::vector<int> counts(std::size_t(dp_.D_));
    for (int r = 0; r < dp_.D_; ++r) {
      const auto [a, b] = overlap(u.lo, u.hi, r);
      counts[std::size_t(r)] = int(b - a);
    }
    return counts;
  }

  // All-gather unit `unit` from the shards into window w (not waited).
  void gather(Window& w, int unit) {
    w.req.wait();
    const Unit& u = units_[std::size_t(unit)];
    const std::int64_t mine = overlap(u.lo, u.hi, dp_.r_).first - dp_.r_ * dp_.sizes_.shard;
    w.req = dp_.group_.all_gather(params_.data() + mine, w.buf.data(), shard_counts(u));
    w.unit = unit;
  }

  Window* find_param_slot(int unit) {
    for (auto& w : param_slots_)
      if (w.unit == unit) return &w;
    return nullptr;
  }
  Window* free_param_slot() {
    for (auto& w : param_slots_)
      if (current_ < 0 || w.unit != current_) return &w;
    throw Error(cat("data parallel: no free parameter window (internal): current ", current_,
                    ", windows hold ", param_slots_[0].unit, " and ", param_slots_[1].unit));
  }

  // Waits for window w's reduce-scatter and adds the received piece into the shard.
  void fold(Window& w) {
    if (!w.pending_fold) return;
    const double bytes =
        double(units_[std::size_t(w.unit)].hi - units_[std::size_t(w.unit)].lo) * sizeof(T);
    total_bytes_ += bytes;
    if (w.req.test()) done_early_bytes_ += bytes;
    w.req.wait();
    const Unit& u = units_[std::size_t(w.unit)];
    const auto [a, b] = overlap(u.lo, u.hi, dp_.r_);
    if (b > a) {
      auto dst = slice(grads_.view(), a - dp_.r_ * dp_.sizes_.shard, b - dp_.r_ * dp_.sizes_.shard);
      K::axpy<T>(dst, T(1), slice(w.recv.view(), 0, b - a));
    }
    w.pending_fold = false;
  }

  // Lets MPI advance the collectives in flight (no progress thread in Open MPI).
  void progress() {
    for (auto& b : buckets_)
      if (b.launched && !b.finished_early && test(b)) b.finished_early = true;
    if (grad_emb_.pending_fold) grad_emb_.req.test();
    for (auto& w : grad_slots_)
      if (w.pending_fold) w.req.test();
  }

  DataParallel& dp_;
  std::vector<Unit> units_;
  std::vector<Bucket> buckets_;
  bool last_micro_ = true;
  std::int64_t ready_lo_ = 0;
  Window grad_emb_, grad_slots_[2], param_emb_, param_slots_[2];
  int next_grad_slot_ = 0, current_ = -1;
  double done_early_bytes_ = 0, total_bytes_ = 0;
};

// ---------------------------------------------------------------------------------------

template <class T>
DataParallel<T>::DataParallel(const Config& config, Comm& group, const model::ChunkLayout& layout,
                              Comm* tp, Comm* experts)
    : group_(group),
      tp_(tp),
      experts_(experts && experts->size() != group.size() ? experts : nullptr),
      layout_(layout),
      dims_(model::dims_of(config)),
      zero_(int(config.parallel.zero)),
      D_(group.size()),
      r_(group.rank()) {
  sizes_ = data_parallel_sizes(layout, D_, zero_, config.parallel.bucket_mb, sizeof(T));
  PTRAIN_REQUIRE(!experts_ || zero_ == 0, "data parallel: experts split over ep need ZeRO 0");
  if (zero_ == 0) {
    update_lo_ = 0;
    update_hi_ = sizes_.numel;
  } else {
    update_lo_ = std::min(sizes_.numel, r_ * sizes_.shard);
    update_hi_ = std::min(sizes_.numel, (r_ + 1) * sizes_.shard);
  }
  store_ = std::make_unique<Store>(*this, layout);
}

template <class T>
DataParallel<T>::~DataParallel() = default;

template <class T>
model::ParamStore<T>* DataParallel<T>::store() {
  return store_.get();
}

template <class T>
K::Vec<T> DataParallel<T>::update_params() {
  if (zero_ <= 2) return slice(store_->params_.view(), update_lo_, update_hi_);
  return slice(store_->params_.view(), 0, update_hi_ - update_lo_);
}

template <class T>
K::Vec<T> DataParallel<T>::update_grads() {
  if (zero_ <= 1) return slice(store_->grads_.view(), update_lo_, update_hi_);
  return slice(store_->grads_.view(), 0, update_hi_ - update_lo_);
}

template <class T>
void DataParallel<T>::init_weights(std::uint64_t seed) {
  const std::int64_t lo = zero_ <= 2 ? 0 : r_ * sizes_.shard;
  model::init_range(layout_, dims_, seed, store_->params_.view(), lo);
  store_->invalidate_params();
}

template <class T>
void DataParallel<T>::set_weights(const T* whole) {
  const std::int64_t lo = zero_ <= 2 ? 0 : r_ * sizes_.shard;
  const std::int64_t n = std::int64_t(store_->params_.size());
  auto host = Kokkos::create_mirror_view(store_->params_.view());
  for (std::int64_t i = 0; i < n; ++i) host(i) = lo + i < sizes_.numel ? whole[lo + i] : T(0);
  Kokkos::deep_copy(store_->params_.view(), host);
  store_->invalidate_params();
}

template <class T>
std::vector<T> DataParallel<T>::gather_weights() {
  std::vector<T> whole(std::size_t(sizes_.shard * D_));
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), store_->params_.view());
  if (zero_ <= 2) {
    std::copy(host.data(), host.data() + whole.size(), whole.begin());
  } else {
    std::vector<int> counts(std::size_t(D_), int(sizes_.shard));
    group_.all_gather(host.data(), whole.data(), counts).wait();
  }
  whole.resize(std::size_t(sizes_.numel));
  return whole;
}

template <class T>
void DataParallel<T>::begin_step() {
  store_->begin_step();
}

template <class T>
void DataParallel<T>::begin_micro_batch(bool last) {
  store_->begin_micro_batch(last);
}

template <class T>
void DataParallel<T>::finish_gradients() {
  store_->finish_gradients();
}

template <class T>
template <class F>
void DataParallel<T>::for_each_owned_grad(F&& f) {
  const std::int64_t S = sizes_.shard;
  const std::int64_t lo = std::min(sizes_.numel, r_ * S), hi = std::min(sizes_.numel, (r_ + 1) * S);
  const std::int64_t base = zero_ <= 1 ? 0 : r_ * S;  // flat index of grads_[0]
  // Split experts (ZeRO 0): each is whole on its expert-grad group, which owns it in shards.
  const std::int64_t Sx = experts_ ? (sizes_.numel + experts_->size() - 1) / experts_->size() : 0,
                     rx = experts_ ? experts_->rank() : 0;
  for (std::size_t i = 0; i < layout_.tensors.size(); ++i) {
    const auto& t = layout_.tensors[i];
    const bool x = experts_ && t.expert;
    const std::int64_t a = std::max(x ? rx * Sx : lo, t.offset),
                       b = std::min(x ? (rx + 1) * Sx : hi, t.offset + t.numel);
    if (a < b) f(int(i), t, slice(store_->grads_.view(), a - base, b - base));
  }
}

template <class T>
double DataParallel<T>::owned_grad_sum_of_squares() {
  // Each rank sums its own shard of the (reduced) gradients. Under tensor parallelism a
  // tensor every tp rank holds whole (LayerNorm, row-parallel biases, wpe) counts once,
  // from tp rank 0; the tied LM-head copy of wte counts on the embedding's stage.
  const bool skip_replicated = tp_ && tp_->size() > 1 && tp_->rank() != 0;
  double sq = 0;
  for_each_owned_grad([&](int, const model::TensorSpec& t, const K::Vec<T>& g) {
    if (!(skip_replicated && t.tp_replicated()) && !t.tied_copy) sq += K::sum_of_squares<T>(g);
  });
  return sq;
}

template <class T>
double DataParallel<T>::grad_norm_squared() {
  double sq = owned_grad_sum_of_squares();
  group_.all_reduce_sum_now(&sq, 1);
  if (tp_ && tp_->size() > 1) tp_->all_reduce_sum_now(&sq, 1);
  return sq;
}

template <class T>
void DataParallel<T>::sum_tied_embedding(Comm& ends) {
  const model::TensorSpec* wte = nullptr;
  for (const auto& t : layout_.tensors)
    if (t.name == "wte.weight") wte = &t;
  if (!wte || (layout_.has_embedding && layout_.has_head)) return;
  // The whole tensor, zero but for this rank's shard of it; summed over both ends' shards.
  // Allocated at the first step and kept: it is needed every step.
  if (tied_sum_.size() != std::size_t(wte->numel))
    tied_sum_ = TrackedView<T>(MemCategory::comm, "ptrain::tied_wte", std::size_t(wte->numel));
  TrackedView<T>& whole = tied_sum_;
  K::fill(whole.view(), T(0));
  const std::int64_t S = sizes_.shard, base = zero_ <= 1 ? 0 : r_ * S;  // flat index of grads_[0]
  const std::int64_t lo = std::max(wte->offset, r_ * S),
                     hi = std::min(wte->offset + wte->numel, (r_ + 1) * S);
  auto grads = store_->grads_.view();
  if (lo < hi)
    K::copy<T>(slice(whole.view(), lo - wte->offset, hi - wte->offset), slice(grads, lo - base, hi - base));
  ends.all_reduce_sum(whole.data(), std::size_t(wte->numel)).wait();
  // What this rank updates: all of wte under ZeRO 0, its shard otherwise.
  const std::int64_t a = std::max(wte->offset, update_lo_),
                     b = std::min(wte->offset + wte->numel, update_hi_);
  if (a < b)
    K::copy<T>(slice(grads, a - base, b - base), slice(whole.view(), a - wte->offset, b - wte->offset));
}

template <class T>
int DataParallel<T>::first_nonfinite_grad() {
  int first = -1;
  for_each_owned_grad([&](int i, const model::TensorSpec&, const K::Vec<T>& g) {
    if (first < 0 && K::count_nonfinite<T>(g) > 0) first = i;
  });
  return first;
}

template <class T>
void DataParallel<T>::finish_step() {
  store_->invalidate_params();
  if (zero_ == 1 || zero_ == 2) {
    std::vector<int> counts(std::size_t(D_), int(sizes_.shard));
    T* full = store_->params_.data();
    group_.all_gather(full + r_ * sizes_.shard, full, counts).wait();
  }
}

template class DataParallel<float>;
template class DataParallel<double>;

}  // namespace ptrain::parallel
