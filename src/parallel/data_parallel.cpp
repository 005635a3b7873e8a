#include "parallel/data_parallel.hpp"

#include <algorithm>
#include <limits>

#include "deck/deck.hpp"
#include "kernels/kernels.hpp"
#include "util/error.hpp"
#include "util/staging.hpp"

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

// Room a run part's blocks take in a bf16-wire receive buffer: D blocks of the largest rank's
// part (the same on every rank, so sizes agree across ranks and with the plan).
std::int64_t wire_block_stride(const ShardMap::Cut& c) {
  return std::int64_t(c.counts.size()) * *std::max_element(c.counts.begin(), c.counts.end());
}

// The bf16 wire's receive buffer for unit u: its run parts' blocks one after the other.
std::int64_t wire_recv_size(const ShardMap& map, const Unit& u) {
  std::int64_t n = 0;
  map.for_each_run(u.lo, u.hi, [&](const ShardMap::Run& run, std::int64_t a, std::int64_t b) {
    n += wire_block_stride(map.cut(run, a, b));
  });
  return n;
}
std::int64_t max_wire_recv(const ShardMap& map, const std::vector<Unit>& units, bool embedding) {
  std::int64_t m = 0;
  for (const auto& u : units)
    if ((u.kind == Unit::embedding) == embedding) m = std::max(m, wire_recv_size(map, u));
  return m;
}

}  // namespace

ShardMap::ShardMap(const model::ChunkLayout& layout, int D, int r, int Dx, int rx) {
  const bool split = Dx > 0;
  spaces.resize(split ? 2 : 1);
  spaces[0].D = D;
  spaces[0].r = r;
  if (split) {
    spaces[1].D = Dx;
    spaces[1].r = rx;
  }
  for (const auto& t : layout.tensors) {
    const int s = split && t.expert ? 1 : 0;
    if (!runs.empty() && runs.back().space == s && runs.back().hi == t.offset) {
      runs.back().hi += t.numel;
    } else {
      runs.push_back({t.offset, t.offset + t.numel, spaces[std::size_t(s)].numel, s});
    }
    spaces[std::size_t(s)].numel += t.numel;
  }
  for (auto& sp : spaces) {
    sp.shard = (sp.numel + sp.D - 1) / sp.D;
    sp.at = storage;
    storage += sp.shard;
  }
  for (const Run& run : runs) {
    const Cut c = cut(run, run.lo, run.hi);
    if (c.mine > 0) owned.push_back({c.mine_lo, c.mine_lo + c.mine, c.at});
  }
  std::sort(owned.begin(), owned.end(), [](const Piece& x, const Piece& y) { return x.at < y.at; });
  for (const Piece& p : owned) owned_end = std::max(owned_end, p.at + p.hi - p.lo);
}

ShardMap::Cut ShardMap::cut(const Run& run, std::int64_t a, std::int64_t b) const {
  const Space& sp = spaces[std::size_t(run.space)];
  const std::int64_t sa = run.space_lo + (a - run.lo), sb = sa + (b - a), S = sp.shard;
  Cut c;
  c.counts.resize(std::size_t(sp.D));
  for (int q = 0; q < sp.D; ++q)
    c.counts[std::size_t(q)] =
        int(std::max<std::int64_t>(0, std::min(sb, (q + 1) * S) - std::max(sa, q * S)));
  const std::int64_t first = std::min(std::max(sa, sp.r * S), (sp.r + 1) * S);  // in the space
  c.mine = c.counts[std::size_t(sp.r)];
  c.mine_lo = a + (first - sa);
  c.at = sp.at + (first - sp.r * S);
  return c;
}

DataParallelSizes data_parallel_sizes(const model::ChunkLayout& layout, int D, int zero,
                                      double bucket_mb, std::size_t grad_bytes, int expert_group,
                                      bool bf16_wire) {
  DataParallelSizes s;
  const ShardMap map(layout, D, 0, expert_group, 0);
  s.numel = layout.numel;
  s.shard = map.storage;
  // The whole buffers: padded to D equal shards (one in-place all-gather) without split
  // experts; with them the shards live apart, packed beside the whole buffers under ZeRO 1/2.
  s.whole = map.split() ? s.numel : s.shard * D;
  const std::int64_t whole = s.whole, packed = map.split() ? s.shard : 0;
  const auto units = model::units_of(layout);
  const std::int64_t emb = max_unit(units, true), other = max_unit(units, false);
  const std::int64_t windows = emb + 2 * other;  // the embedding's and two rotating ones
  s.params = zero >= 3 ? s.shard : whole + (zero >= 1 ? packed : 0);
  s.grads = zero >= 2 ? s.shard : whole + (zero == 1 ? packed : 0);
  s.optimizer_range = zero >= 1 ? s.shard : s.numel;
  s.bucket = std::max<std::int64_t>(1, std::int64_t(bucket_mb * 1024 * 1024 / double(grad_bytes)));
  // ZeRO 2: gradient windows and their receive buffers; ZeRO 3: parameter windows too. The
  // bf16 wire replaces each receive buffer by a bf16 copy of the window and a bf16 receive
  // buffer of every rank's blocks.
  const bool wire = bf16_wire && zero >= 2;
  s.comm_grads = zero >= 2 ? (wire ? 1 : 2) * windows : 0;
  s.comm_params = zero == 3 ? windows : 0;
  if (wire)
    s.comm_wire = windows + max_wire_recv(map, units, true) + 2 * max_wire_recv(map, units, false);
  return s;
}

// ---------------------------------------------------------------------------------------
// The ParamStore the model uses, for every stage.

namespace {

void wait_all(std::vector<Request>& reqs) {
  for (auto& r : reqs) r.wait();
  reqs.clear();
}
bool test_all(std::vector<Request>& reqs) {
  bool done = true;
  for (auto& r : reqs) done = r.test() && done;
  return done;
}

}  // namespace

template <class P>
class DataParallel<P>::Store : public model::ParamStore<P> {
 public:
  PTRAIN_POLICY_TYPES(P);
  Store(DataParallel& dp, const model::ChunkLayout& layout)
      : dp_(dp), map_(dp.map_), units_(model::units_of(layout)) {
    const auto& z = dp.sizes_;
    const int zero = dp.zero_;
    const std::int64_t whole = z.whole;
    // Whole up to ZeRO stage `whole_up_to`, else only the shard; with split experts under
    // ZeRO >= 1 the owned elements are also kept packed beside the whole buffer.
    auto allocate = [&](MemCategory c, const std::string& name, int whole_up_to, auto& all,
                        auto& owned) {
      using V = std::decay_t<decltype(all)>;
      if (zero <= whole_up_to) all = V(c, name, std::size_t(whole));
      if (zero > whole_up_to || (zero >= 1 && map_.split()))
        owned = V(c, name + (zero > whole_up_to ? ".shard" : ".owned"), std::size_t(z.shard));
    };
    allocate(MemCategory::params, "ptrain::params", 2, params_, owned_params_);
    allocate(MemCategory::grads, "ptrain::grads", 1, grads_, owned_grads_);
    if (zero <= 1) {
      // Buckets from the end of the buffer (the head) towards wte, as the backward goes.
      for (std::int64_t hi = whole; hi > 0; hi -= z.bucket) {
        Bucket b;
        b.lo = std::max<std::int64_t>(0, hi - z.bucket);
        b.hi = hi;
        buckets_.push_back(std::move(b));
      }
    } else {
      const std::int64_t emb = max_unit(units_, true), other = max_unit(units_, false);
      const bool wire = dp.bf16_wire_;
      auto window = [wire](const char* label, std::int64_t n, std::int64_t wire_n) {
        auto at_least_1 = [](std::int64_t k) { return std::size_t(std::max<std::int64_t>(k, 1)); };
        Window<G> w;
        w.buf = TrackedView<G>(MemCategory::comm, label, at_least_1(n));
        if (wire) {
          w.wire_send = TrackedView<bf16>(MemCategory::comm, label, at_least_1(n));
          w.wire_recv = TrackedView<bf16>(MemCategory::comm, label, at_least_1(wire_n));
        } else {
          w.recv = TrackedView<G>(MemCategory::comm, label, at_least_1(n));
        }
        return w;
      };
      grad_emb_ = window("ptrain::grad_window.embedding", emb, max_wire_recv(map_, units_, true));
      for (auto& w : grad_slots_)
        w = window("ptrain::grad_window", other, max_wire_recv(map_, units_, false));
      if (zero == 3) {
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
        wait_all(param_emb_.reqs);
      }
      return slice(param_emb_.buf.view(), 0, u.hi - u.lo);
    }
    Window<T>* w = find_param_slot(unit);
    if (!w) {
      w = free_param_slot();
      gather(*w, unit);
    }
    wait_all(w->reqs);
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
  K::Vec<G> grads(int unit) override {
    const Unit& u = units_[std::size_t(unit)];
    if (dp_.zero_ <= 1) return slice(grads_.view(), u.lo, u.hi);
    Window<G>* w = nullptr;
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
      K::fill(slice(w->buf.view(), 0, u.hi - u.lo), G(0));
      w->unit = unit;
      w->open = true;
      w->last = last_micro_;
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
    Window<G>* w = &grad_emb_;
    for (auto& s : grad_slots_)
      if (s.unit == unit && s.open) w = &s;
    if constexpr (std::is_same_v<G, float>) {
      if (dp_.bf16_wire_) {
        // The bf16 wire: the window rounded once, each run's parts sent to their owners; this
        // rank's D blocks of each run land one after the other (summed in fold).
        K::cast<bf16, float>(slice(w->wire_send.view(), 0, u.hi - u.lo),
                             slice(w->buf.view(), 0, u.hi - u.lo));
        std::int64_t at = 0;
        map_.for_each_run(
            u.lo, u.hi, [&](const ShardMap::Run& run, std::int64_t a, std::int64_t b) {
              const ShardMap::Cut c = map_.cut(run, a, b);
              const std::vector<int> from(c.counts.size(), int(c.mine));
              w->reqs.push_back(group(run).all_to_allv(w->wire_send.data() + (a - u.lo), c.counts,
                                                       w->wire_recv.data() + at, from));
              at += wire_block_stride(c);
            });
        w->pending_fold = true;
        w->open = false;
        progress();
        return;
      }
    }
    // Reduce-scatter each run of the unit onto the shards of its space; this rank's part
    // of the run lands at the run's place in the receive window.
    map_.for_each_run(u.lo, u.hi, [&](const ShardMap::Run& run, std::int64_t a, std::int64_t b) {
      (void)b;
      w->reqs.push_back(group(run).reduce_scatter_sum(
          w->buf.data() + (a - u.lo), w->recv.data() + (a - u.lo), map_.cut(run, a, b).counts));
    });
    w->pending_fold = true;
    w->open = false;
    progress();
  }

  // --- step control ---------------------------------------------------------------------
  void begin_step() {
    PTRAIN_REQUIRE(across_reqs_.empty(), "data parallel: cross-node reductions left in flight");
    K::fill((dp_.zero_ <= 1 ? grads_ : owned_grads_).view(), G(0));
    done_early_bytes_ = total_bytes_ = 0;
  }

  // The parameters changed (an update, loaded weights): every gathered copy is stale.
  void invalidate_params() {
    if (dp_.zero_ != 3) return;
    wait_all(param_emb_.reqs);
    param_emb_.unit = -1;
    for (auto& w : param_slots_) {
      wait_all(w.reqs);
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
        const double bytes = double(b.hi - b.lo) * sizeof(G);
        total_bytes_ += bytes;
        if (b.finished_early || test_all(b.reqs)) done_early_bytes_ += bytes;
        wait_all(b.reqs);
        b.launched = b.finished_early = false;
      }
      // ZeRO 1 with split experts: the owned elements, packed for the optimizer.
      if (owned_grads_.size() > 0)
        for (const auto& p : map_.owned)
          K::copy<G>(slice(owned_grads_.view(), p.at, p.at + p.hi - p.lo),
                     slice(grads_.view(), p.lo, p.hi));
    } else {
      fold(grad_emb_);
      for (auto& w : grad_slots_) fold(w);
      if (across_bytes_ > 0 && test_all(across_reqs_)) done_early_bytes_ += across_bytes_;
      total_bytes_ += across_bytes_;
      wait_all(across_reqs_);
      across_bytes_ = 0;
    }
    dp_.overlap_ = total_bytes_ > 0 ? done_early_bytes_ / total_bytes_ : 1.0;
  }

  // All-gathers flat [lo, hi) of the parameters from the owned shards into dst (which
  // stands for flat lo): one all-gather per run, over the run's space group (not waited).
  void gather_range(T* dst, std::int64_t lo, std::int64_t hi, std::vector<Request>& reqs) {
    const T* owned = owned_params().data();
    map_.for_each_run(lo, hi, [&](const ShardMap::Run& run, std::int64_t a, std::int64_t b) {
      const ShardMap::Cut c = map_.cut(run, a, b);
      reqs.push_back(group(run).all_gather(owned + c.at, dst + (a - lo), c.counts));
    });
  }

  // The owned storage: kept apart under ZeRO 3 (parameters), ZeRO 2 (gradients) and with
  // split experts, else the whole buffer's own shard (where its in-place all-gather reads).
  K::Vec<T> owned_params() const { return owned_(params_, owned_params_); }
  K::Vec<G> owned_grads() const { return owned_(grads_, owned_grads_); }

  // ZeRO 1/2: the updated shards into the whole parameters.
  void gather_whole_params() {
    std::vector<Request> reqs;
    if (owned_params_.size() == 0) {  // one space: the padded buffer, gathered in place
      const auto& sp = map_.spaces[0];
      std::vector<int> counts(std::size_t(sp.D), int(sp.shard));
      T* full = params_.data();
      reqs.push_back(dp_.shards_.all_gather(full + sp.r * sp.shard, full, counts));
    } else {
      gather_range(params_.data(), 0, map_.runs.empty() ? 0 : map_.runs.back().hi, reqs);
    }
    wait_all(reqs);
  }

  // ZeRO 1/2 with split experts: the owned parameters from the whole ones.
  void pack_params() {
    if (dp_.zero_ >= 3 || owned_params_.size() == 0) return;
    for (const auto& p : map_.owned)
      K::copy<T>(slice(owned_params_.view(), p.at, p.at + p.hi - p.lo),
                 slice(params_.view(), p.lo, p.hi));
  }

  TrackedView<T> params_, owned_params_;  // whole (ZeRO <= 2); the owned storage, kept apart
  TrackedView<G> grads_, owned_grads_;    // whole (ZeRO <= 1); the owned storage, kept apart

 private:
  struct Bucket {
    std::int64_t lo = 0, hi = 0;
    std::vector<Request> reqs;
    bool launched = false, finished_early = false;
  };
  template <class V>
  struct Window {
    TrackedView<V> buf, recv;
    TrackedView<bf16> wire_send, wire_recv;  // the bf16 wire (gradient windows only)
    int unit = -1;
    bool open = false, pending_fold = false;
    bool last = false;  // opened in the step's last micro-batch
    std::vector<Request> reqs;
  };

  template <class V>
  K::Vec<V> owned_(const TrackedView<V>& whole, const TrackedView<V>& apart) const {
    if (apart.size() > 0) return apart.view();
    const auto& sp = map_.spaces[0];
    return slice(whole.view(), sp.r * sp.shard, (sp.r + 1) * sp.shard);
  }

  // What a run's shards are cut over (reduce-scatters, all-gathers): the dense space's
  // shard group, or the expert-grad group.
  Comm& group(const ShardMap::Run& run) const {
    return run.space == 0 ? dp_.shards_ : *dp_.experts_;
  }

  // A bucket is all-reduced run by run over the whole of its space's group: expert runs over
  // the expert-grad group.
  void launch(Bucket& b) {
    map_.for_each_run(b.lo, b.hi, [&](const ShardMap::Run& run, std::int64_t a, std::int64_t e) {
      Comm& all = run.space == 0 ? dp_.group_ : *dp_.experts_;
      b.reqs.push_back(all.all_reduce_sum(grads_.data() + a, std::size_t(e - a)));
    });
    b.launched = true;
  }

  // All-gather unit `unit` from the shards into window w (not waited).
  void gather(Window<T>& w, int unit) {
    wait_all(w.reqs);
    const Unit& u = units_[std::size_t(unit)];
    gather_range(w.buf.data(), u.lo, u.hi, w.reqs);
    w.unit = unit;
  }

  Window<T>* find_param_slot(int unit) {
    for (auto& w : param_slots_)
      if (w.unit == unit) return &w;
    return nullptr;
  }
  Window<T>* free_param_slot() {
    for (auto& w : param_slots_)
      if (current_ < 0 || w.unit != current_) return &w;
    throw Error(cat("data parallel: no free parameter window (internal): current ", current_,
                    ", windows hold ", param_slots_[0].unit, " and ", param_slots_[1].unit));
  }

  // Waits for window w's reduce-scatters and adds the received parts into the shard.

  void fold(Window<G>& w) {
    if (!w.pending_fold) return;
    const Unit& u = units_[std::size_t(w.unit)];
    const double bytes = double(u.hi - u.lo) * (dp_.bf16_wire_ ? sizeof(bf16) : sizeof(G));
    total_bytes_ += bytes;
    if (test_all(w.reqs)) done_early_bytes_ += bytes;
    wait_all(w.reqs);
    if constexpr (std::is_same_v<G, float>) {
      if (dp_.bf16_wire_) {  // this rank's D blocks of each run, summed in fp32 into the shard
        std::int64_t at = 0;
        map_.for_each_run(u.lo, u.hi,
                          [&](const ShardMap::Run& run, std::int64_t a, std::int64_t b) {
                            const ShardMap::Cut c = map_.cut(run, a, b);
                            const int D = int(c.counts.size());
                            if (c.mine > 0)
                              K::add_block_sum(slice(owned_grads_.view(), c.at, c.at + c.mine),
                                               slice(w.wire_recv.view(), at, at + D * c.mine), D);
                            at += wire_block_stride(c);
                          });
        w.pending_fold = false;
        reduce_across(w);
        return;
      }
    }
    map_.for_each_run(u.lo, u.hi, [&](const ShardMap::Run& run, std::int64_t a, std::int64_t b) {
      const ShardMap::Cut c = map_.cut(run, a, b);
      if (c.mine > 0)
        K::axpy<G>(slice(owned_grads_.view(), c.at, c.at + c.mine), 1,
                   slice(w.recv.view(), a - u.lo, a - u.lo + c.mine));
    });
    w.pending_fold = false;
    reduce_across(w);
  }

  // zero_scope = 'node': after the last micro-batch's fold of a unit its part of the shard
  // holds this node's sum; the replicas add theirs (started in fold order, the same on every
  // rank: the backward's order).
  void reduce_across(const Window<G>& w) {
    if (!dp_.replicas_ || !w.last) return;
    const Unit& u = units_[std::size_t(w.unit)];
    map_.for_each_run(u.lo, u.hi, [&](const ShardMap::Run& run, std::int64_t a, std::int64_t b) {
      const ShardMap::Cut c = map_.cut(run, a, b);
      if (c.mine == 0) return;
      across_reqs_.push_back(
          dp_.replicas_->all_reduce_sum(owned_grads_.data() + c.at, std::size_t(c.mine)));
      across_bytes_ += double(c.mine) * sizeof(G);
    });
  }

  // Lets MPI advance the collectives in flight (no progress thread in Open MPI).
  void progress() {
    for (auto& b : buckets_)
      if (b.launched && !b.finished_early && test_all(b.reqs)) b.finished_early = true;
    if (grad_emb_.pending_fold) test_all(grad_emb_.reqs);
    for (auto& w : grad_slots_)
      if (w.pending_fold) test_all(w.reqs);
    test_all(across_reqs_);
  }

  DataParallel& dp_;
  const ShardMap& map_;
  std::vector<Unit> units_;
  std::vector<Bucket> buckets_;
  bool last_micro_ = true;
  std::int64_t ready_lo_ = 0;
  Window<G> grad_emb_, grad_slots_[2];
  Window<T> param_emb_, param_slots_[2];
  int next_grad_slot_ = 0, current_ = -1;
  std::vector<Request> across_reqs_;  // zero_scope = 'node': the shard's sums across nodes
  double across_bytes_ = 0;
  double done_early_bytes_ = 0, total_bytes_ = 0;
};

// ---------------------------------------------------------------------------------------

template <class P>
DataParallel<P>::DataParallel(const Config& config, Comm& group, const model::ChunkLayout& layout,
                              Comm* tp, Comm* experts, NodeScope node_scope)
    : group_(group),
      shards_(node_scope.shards ? *node_scope.shards : group),
      replicas_(node_scope.replicas && node_scope.replicas->size() > 1 ? node_scope.replicas
                                                                       : nullptr),
      tp_(tp),
      experts_(experts && experts->size() != group.size() ? experts : nullptr),
      bf16_wire_(deck::precision_policy(config).wire == Precision::bf16 &&
                 std::is_same_v<G, float> && config.parallel.zero >= 2),
      layout_(layout),
      dims_(model::dims_of(config)),
      zero_(int(config.parallel.zero)),
      map_(layout, shards_.size(), shards_.rank(), experts_ ? experts_->size() : 0,
           experts_ ? experts_->rank() : 0) {
  PTRAIN_REQUIRE(!replicas_ || (zero_ >= 1 && !experts_ &&
                                shards_.size() * replicas_->size() == group_.size()),
                 "data parallel: node scope needs ZeRO >= 1, no split experts and ", group_.size(),
                 " = ", shards_.size(), " shards x ", replicas_->size(), " replicas (internal)");
  sizes_ = data_parallel_sizes(layout, shards_.size(), zero_, config.parallel.bucket_mb, sizeof(G),
                               experts_ ? experts_->size() : 0, bf16_wire_);
  if (zero_ == 0) {
    update_pieces_ = {{0, sizes_.numel, 0}};
    update_size_ = sizes_.numel;
  } else {
    update_pieces_ = map_.owned;
    update_size_ = map_.owned_end;
  }
  store_ = std::make_unique<Store>(*this, layout);
  if constexpr (!P::uniform)
    masters_ =
        TrackedView<M>(MemCategory::optimizer, "ptrain::master_weights", std::size_t(update_size_));
}

template <class P>
DataParallel<P>::~DataParallel() = default;

template <class P>
model::ParamStore<P>* DataParallel<P>::store() {
  return store_.get();
}

template <class P>
auto DataParallel<P>::update_compute() -> K::Vec<T> {
  return slice(zero_ == 0 ? store_->params_.view() : store_->owned_params(), 0, update_size_);
}

template <class P>
auto DataParallel<P>::update_params() -> K::Vec<M> {
  if constexpr (P::uniform)
    return update_compute();
  else
    return masters_.view();
}

template <class P>
auto DataParallel<P>::update_grads() -> K::Vec<G> {
  return slice(zero_ == 0 ? store_->grads_.view() : store_->owned_grads(), 0, update_size_);
}

template <class P>
void DataParallel<P>::init_weights(std::uint64_t seed) {
  if (zero_ <= 2) {
    model::init_range(layout_, dims_, seed, store_->params_.view(), 0);
    store_->pack_params();
  } else {
    for (const auto& p : map_.owned)
      model::init_range(layout_, dims_, seed,
                        slice(store_->owned_params_.view(), p.at, p.at + p.hi - p.lo), p.lo);
  }
  // The masters draw the same numbers; rounded to the compute type they are the weights
  // above (model::init_range rounds through fp32).
  if constexpr (!P::uniform)
    for (const auto& p : update_pieces_)
      model::init_range(layout_, dims_, seed, slice(masters_.view(), p.at, p.at + p.hi - p.lo),
                        p.lo);
  store_->invalidate_params();
}

template <class P>
void DataParallel<P>::set_weights(const M* whole) {
  if (zero_ <= 2) {
    {
      staging::HostView<T> host(store_->params_.view(), staging::Access::write);
      for (std::size_t i = 0; i < host.size(); ++i)
        host[i] = T(std::int64_t(i) < sizes_.numel ? whole[i] : M(0));
    }  // written back before the pack reads it
    store_->pack_params();
  } else {
    staging::HostView<T> host(store_->owned_params_.view(), staging::Access::write);
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = T(0);
    for (const auto& p : map_.owned)
      for (std::int64_t i = p.lo; i < p.hi; ++i) host[std::size_t(p.at + i - p.lo)] = T(whole[i]);
  }
  if constexpr (!P::uniform) {
    staging::HostView<M> host(masters_.view(), staging::Access::read_write);
    for (const auto& p : update_pieces_)
      for (std::int64_t i = p.lo; i < p.hi; ++i) host[std::size_t(p.at + i - p.lo)] = whole[i];
  }
  store_->invalidate_params();
}

template <class P>
void DataParallel<P>::begin_step() {
  store_->begin_step();
}

template <class P>
void DataParallel<P>::begin_micro_batch(bool last) {
  store_->begin_micro_batch(last);
}

template <class P>
void DataParallel<P>::finish_gradients() {
  store_->finish_gradients();
}

template <class P>
template <class F>
void DataParallel<P>::for_each_owned_grad(F&& f) {
  // The shards this rank owns (under ZeRO 0 too: the norm is summed shard by shard), read
  // from the whole gradients under ZeRO 0 and from the owned storage otherwise.
  for (const auto& p : map_.owned) {
    const K::Vec<G> g = grads_of(p, p.lo, p.hi);
    for (std::size_t i = 0; i < layout_.tensors.size(); ++i) {
      const auto& t = layout_.tensors[i];
      const std::int64_t a = std::max(p.lo, t.offset), b = std::min(p.hi, t.offset + t.numel);
      if (a < b) f(int(i), t, slice(g, a - p.lo, b - p.lo));
    }
  }
}

template <class P>
double DataParallel<P>::owned_grad_sum_of_squares() {
  // Each rank sums its own shard of the (reduced) gradients. Under tensor parallelism a
  // tensor every tp rank holds whole (LayerNorm, row-parallel biases, wpe) counts once,
  // from tp rank 0; the tied LM-head copy of wte counts on the embedding's stage.
  const bool skip_replicated = tp_ && tp_->size() > 1 && tp_->rank() != 0;
  if (replica() != 0) return 0;  // zero_scope = 'node': the first replica counts the shard
  // Adjacent counted tensors are summed as one run: one kernel, not one per tensor (about
  // 150 at GPT-2 124M, whose launches took a third of the pass).
  double sq = 0;
  K::Vec<G> run;
  for_each_owned_grad([&](int, const model::TensorSpec& t, const K::Vec<G>& g) {
    if ((skip_replicated && t.tp_replicated()) || t.tied_copy) return;
    if (run.extent(0) > 0 && run.data() + run.extent(0) == g.data()) {
      run = K::Vec<G>(run.data(), run.extent(0) + g.extent(0));  // g's buffer holds both
      return;
    }
    if (run.extent(0) > 0) sq += K::sum_of_squares<G>(run);
    run = g;
  });
  if (run.extent(0) > 0) sq += K::sum_of_squares<G>(run);
  return sq;
}

template <class P>
void DataParallel<P>::sum_tied_embedding(Comm& ends, DataParallel* other) {
  const model::TensorSpec* wte = tied_wte();
  if (!wte) return;
  // The whole tensor, zero but for this rank's shard of it; summed over both ends' shards.
  // Allocated at the first step and kept: it is needed every step.
  if (tied_sum_.size() != std::size_t(wte->numel))
    tied_sum_ = TrackedView<G>(MemCategory::comm, "ptrain::tied_wte", std::size_t(wte->numel));
  auto whole = tied_sum_.view();
  K::fill(whole, G(0));
  add_owned_wte(whole, false);
  if (other) other->add_owned_wte(whole, true);
  ends.all_reduce_sum(whole.data(), std::size_t(wte->numel)).wait();
  take_tied_wte(whole);
  if (other) other->take_tied_wte(whole);
}

template <class P>
const model::TensorSpec* DataParallel<P>::tied_wte() const {
  if (layout_.has_embedding && layout_.has_head) return nullptr;
  for (const auto& t : layout_.tensors)
    if (t.name == "wte.weight") return &t;
  return nullptr;
}

template <class P>
void DataParallel<P>::add_owned_wte(const K::Vec<G>& whole, bool add) {
  const model::TensorSpec* wte = tied_wte();
  if (!wte || replica() != 0) return;  // zero_scope = 'node': one replica of each shard adds it
  const std::int64_t lo = wte->offset, hi = wte->offset + wte->numel;
  for (const auto& p : map_.owned) {
    const std::int64_t a = std::max(lo, p.lo), b = std::min(hi, p.hi);
    if (a >= b) continue;
    if (add)
      K::axpy<G>(slice(whole, a - lo, b - lo), 1, grads_of(p, a, b));
    else
      K::copy<G>(slice(whole, a - lo, b - lo), grads_of(p, a, b));
  }
}

template <class P>
void DataParallel<P>::take_tied_wte(const K::Vec<G>& whole) {
  const model::TensorSpec* wte = tied_wte();
  // What this rank updates: all of wte under ZeRO 0, its shard otherwise.
  const std::int64_t lo = wte->offset, hi = wte->offset + wte->numel;
  for (const auto& p : update_pieces_) {
    const std::int64_t a = std::max(lo, p.lo), b = std::min(hi, p.hi);
    if (a < b) K::copy<G>(grads_of(p, a, b), slice(whole, a - lo, b - lo));
  }
}

template <class P>
auto DataParallel<P>::grads_of(const Piece& p, std::int64_t a, std::int64_t b) -> K::Vec<G> {
  if (zero_ == 0) return slice(store_->grads_.view(), a, b);
  return slice(store_->owned_grads(), p.at + (a - p.lo), p.at + (b - p.lo));
}

template <class P>
int DataParallel<P>::first_nonfinite_grad() {
  int first = -1;
  for_each_owned_grad([&](int i, const model::TensorSpec&, const K::Vec<G>& g) {
    if (first < 0 && K::count_nonfinite<G>(g) > 0) first = i;
  });
  return first;
}

template <class P>
std::vector<std::uint64_t> DataParallel<P>::weight_checksums() {
  std::vector<std::uint64_t> sums(layout_.tensors.size(), 0);
  for (std::size_t i = 0; i < layout_.tensors.size(); ++i) {
    const auto& t = layout_.tensors[i];
    if (zero_ <= 2) {
      sums[i] = K::checksum<T>(slice(store_->params_.view(), t.offset, t.offset + t.numel), 0);
      continue;
    }
    for (const auto& p : map_.owned) {
      const std::int64_t a = std::max(p.lo, t.offset), b = std::min(p.hi, t.offset + t.numel);
      if (a < b)
        sums[i] += K::checksum<T>(
            slice(store_->owned_params(), p.at + (a - p.lo), p.at + (b - p.lo)), a - t.offset);
    }
  }
  return sums;
}

template <class P>
std::string DataParallel<P>::flip_weight_bit() {
  // The top stored mantissa bit: a change no later update rounds away.
  int bit = 6;  // bf16 stores 7 mantissa bits
  if constexpr (sizeof(T) != 2) bit = std::numeric_limits<T>::digits - 2;
  for (auto t = layout_.tensors.rbegin(); t != layout_.tensors.rend(); ++t) {
    if (t->numel == 0) continue;
    if (zero_ <= 2) {
      K::flip_bit<T>(store_->params_.view(), std::size_t(t->offset), bit);
      return t->name;
    }
    for (const auto& p : map_.owned) {
      const std::int64_t a = std::max(p.lo, t->offset);
      if (a < std::min(p.hi, t->offset + t->numel)) {
        K::flip_bit<T>(store_->owned_params(), std::size_t(p.at + (a - p.lo)), bit);
        return t->name;
      }
    }
  }
  return "";
}

template <class P>
void DataParallel<P>::finish_step() {
  if constexpr (!P::uniform) K::cast<T, M>(update_compute(), masters_.view());
  store_->invalidate_params();
  if (zero_ == 1 || zero_ == 2) store_->gather_whole_params();
}

template class DataParallel<Fp32>;
template class DataParallel<Fp64>;
template class DataParallel<Bf16>;
template class DataParallel<Bf16Grads>;

}  // namespace ptrain::parallel
