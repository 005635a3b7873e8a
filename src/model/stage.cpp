#include "model/stage.hpp"

#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/kernels.hpp"
#include "model/activations.hpp"
#include "util/error.hpp"
#include "util/profile.hpp"
#include "util/staging.hpp"

namespace ptrain::model {

namespace K = kernels;

namespace {

using kernels::slice;

// Carves the tensors of one description (model/activations.hpp) out of its buffers, in
// order: fields of the compute type from `values`, statistics from `stats`, gradient scratch
// from `grads` (each role has its own buffer, whatever the types).
template <class P>
struct Carver {
  PTRAIN_POLICY_TYPES(P);
  K::Vec<T> values;
  K::Vec<A> stats = {};
  K::Vec<G> grads = {};
  std::int64_t at = 0, at_stats = 0, at_grads = 0;
  template <class Acts>
  Acts take(const ActShape& s) {
    Acts a;
    describe(a, s, [&](auto& field, std::int64_t n, Role role = Role::value) {
      using F = std::decay_t<decltype(field)>;
      if constexpr (std::is_same_v<F, K::Vec<T>>)
        if (role == Role::value) {
          field = slice(values, at, n);
          at += n;
          return;
        }
      if constexpr (std::is_same_v<F, K::Vec<A>>)
        if (role == Role::stat) {
          field = slice(stats, at_stats, n);
          at_stats += n;
          return;
        }
      if constexpr (std::is_same_v<F, K::Vec<G>>)
        if (role == Role::grad) {
          field = slice(grads, at_grads, n);
          at_grads += n;
          return;
        }
      throw Error("model: an activation field of the wrong element type (internal)");
    });
    return a;
  }
};

// The fields of `a` that its shape left empty, taken from `b` (carved with the
// complementary part: describe visits both in the same order).
template <class Acts>
void take_missing(Acts& a, const ActShape& sa, Acts& b, const ActShape& sb) {
  std::vector<void*> from;
  describe(b, sb, [&](auto& field, std::int64_t, Role = Role::value) { from.push_back(&field); });
  std::size_t i = 0;
  describe(a, sa, [&](auto& field, std::int64_t n, Role = Role::value) {
    if (n == 0) field = *static_cast<std::decay_t<decltype(field)>*>(from[i]);
    ++i;
  });
}

}  // namespace

// ---- stores ----------------------------------------------------------------------------

template <class P>
ResidentStore<P>::ResidentStore(const ChunkLayout& layout, std::int64_t numel)
    : units_(units_of(layout)),
      params_(MemCategory::params, "ptrain::params", std::size_t(numel)),
      grads_(MemCategory::grads, "ptrain::grads", std::size_t(numel)) {
  PTRAIN_REQUIRE(numel >= layout.numel, "model: resident buffers of ", numel,
                 " elements cannot hold the chunk's ", layout.numel);
}

template <class P>
auto ResidentStore<P>::params(int unit, Phase) -> K::Vec<T> {
  const Unit& u = units_.at(std::size_t(unit));
  return slice(params_.view(), u.lo, u.hi - u.lo);
}

template <class P>
auto ResidentStore<P>::grads(int unit) -> K::Vec<G> {
  const Unit& u = units_.at(std::size_t(unit));
  return slice(grads_.view(), u.lo, u.hi - u.lo);
}

// ---- the stage ---------------------------------------------------------------------------

template <class P>
struct Stage<P>::Acts {
  InputActs<K::Vec<T>> in;
  std::vector<typename Block<P>::Acts> blocks;
  typename Head<P>::Acts head;  // while the slot holds a head slot
  K::IntVec tokens, targets;
};

template <class P>
struct Stage<P>::WeightGrads {
  std::vector<typename Block<P>::WeightGrads> blocks;
  InputWeightGrads<K::Vec<T>> in;
};

template <class P>
Stage<P>::Stage(const Config& config, const ShardCoord& coord, const ChunkLayout& layout,
                int micro_batch, SlotCounts slots, ParamStore<P>* store, Comm* tp, Comm* cp,
                Comm* ep)
    : dims_(dims_of(config)),
      coord_(coord),
      layout_(layout),
      units_(units_of(layout)),
      micro_batch_(micro_batch),
      tp_(tp, config.parallel.sequence_parallel),
      cp_(cp, dims_.S, coord.cp_zigzag),
      S_(int(dims_.S / coord.cp)),
      ep_(ep && ep->size() > 1 ? ep : nullptr),
      aux_scale_(double(config.train.micro_batch) / double(config.train.global_batch)),
      recompute_(recompute_mode(config.train.recompute)),
      moe_stats_(std::size_t(layout.n_layers)) {
  PTRAIN_REQUIRE(coord.ep == 1 || (ep && ep->size() == coord.ep), "model: expert parallelism over ",
                 coord.ep, " ranks needs their ep group");
  PTRAIN_REQUIRE(coord.tp == 1 || (tp && tp->size() == coord.tp), "model: tensor parallelism over ",
                 coord.tp, " ranks needs their tp group");
  PTRAIN_REQUIRE(coord.cp == 1 || (cp && cp->size() == coord.cp && cp->rank() == coord.c),
                 "model: context parallelism over ", coord.cp, " ranks needs their cp group");
  PTRAIN_REQUIRE(slots.acts >= 1 && slots.head >= 1 && slots.weight >= 0,
                 "model: a stage needs at least one activation slot");
  for (std::size_t i = 0; i < units_.size(); ++i) {
    if (units_[i].kind == Unit::embedding) u_emb_ = int(i);
    if (units_[i].kind == Unit::block && u_block0_ < 0) u_block0_ = int(i);
    if (units_[i].kind == Unit::head) u_head_ = int(i);
  }
  if (store) {
    store_ = store;
  } else {
    own_store_ = std::make_unique<ResidentStore<P>>(layout_, layout_.numel);
    store_ = own_store_.get();
  }
  sizes_ = activation_sizes(dims_, coord, micro_batch, S_, layout_.has_head, tp_.sp(), recompute_,
                            layout_.has_embedding);
  bool dense = true;
  for (int l = 0; l < layout_.n_layers; ++l) dense = dense && !is_moe(l);
  can_split_ = slots.weight > 0 && dense && !(layout_.has_embedding && layout_.has_head);
  if (sizes_.recompute > 0)
    recomputed_ = TrackedView<T>(MemCategory::activations, "ptrain::recomputed_activations",
                                 std::size_t(sizes_.recompute));
  if (sizes_.recompute_stats > 0)
    recomputed_stats_ = TrackedView<A>(MemCategory::activations, "ptrain::recomputed_statistics",
                                       std::size_t(sizes_.recompute_stats));
  const std::int64_t kept = sizes_.kept(layout_.n_layers),
                     kept_stats = sizes_.kept_stats(layout_.n_layers);
  acts_ = TrackedView<T>(MemCategory::activations, "ptrain::activations",
                         std::size_t(kept * slots.acts));
  stats_ = TrackedView<A>(MemCategory::activations, "ptrain::activation_statistics",
                          std::size_t(kept_stats * slots.acts));
  if (layout_.has_head) {
    head_acts_ = TrackedView<T>(MemCategory::activations, "ptrain::head_activations",
                                std::size_t(sizes_.head * slots.head));
    head_stats_ = TrackedView<A>(MemCategory::activations, "ptrain::head_statistics",
                                 std::size_t(sizes_.head_stats * slots.head));
    for (int k = slots.head - 1; k >= 0; --k) free_heads_.push_back(k);
  }
  if (can_split_) {
    const std::int64_t L = layout_.n_layers;
    if (sizes_.weight(L) > 0)
      weight_acts_ = TrackedView<T>(MemCategory::activations, "ptrain::weight_gradient_inputs",
                                    std::size_t(sizes_.weight(L) * slots.weight));
    weight_sums_ = TrackedView<G>(MemCategory::activations, "ptrain::weight_gradient_sums",
                                  std::size_t(sizes_.weight_grads(L) * slots.weight));
    for (int k = slots.weight - 1; k >= 0; --k) free_weights_.push_back(k);
  }
  scratch_ = TrackedView<T>(MemCategory::workspace, "ptrain::backward_scratch",
                            std::size_t(sizes_.scratch));
  if (sizes_.scratch_grads > 0)
    scratch_grads_ = TrackedView<G>(MemCategory::workspace, "ptrain::backward_scratch_grads",
                                    std::size_t(sizes_.scratch_grads));
  const std::size_t ids = std::size_t(micro_batch) * std::size_t(S_);
  for (int k = 0; k < slots.acts; ++k) {
    Slot s;
    s.offset = kept * k;
    s.stats_offset = kept_stats * k;
    if (layout_.has_embedding) s.tokens = Kokkos::View<int*>("ptrain::tokens", ids);
    if (layout_.has_head) s.targets = Kokkos::View<int*>("ptrain::targets", ids);
    s.routing.resize(std::size_t(layout_.n_layers));
    slots_.push_back(std::move(s));
  }
}

// Block l of a slot at offset l * per_layer, then the input and the head; each carved for
// the slot's micro-batch inside room for `micro_batch` samples.
template <class P>
auto Stage<P>::carve(int slot, const Ctx& c) const -> Acts {
  using BlockA = typename Block<P>::Acts;
  const Slot& s = slots_.at(std::size_t(slot));
  const ActShape shape = act_shape(dims_, coord_, c.B, c.S, tp_.sp());
  const K::Vec<T> all = slice(acts_.view(), s.offset, sizes_.kept(layout_.n_layers));
  const K::Vec<A> all_stats =
      slice(stats_.view(), s.stats_offset, sizes_.kept_stats(layout_.n_layers));
  const std::int64_t L = layout_.n_layers, n = sizes_.per_layer, ns = sizes_.per_layer_stats;
  Acts a;
  for (int l = 0; l < L; ++l) {
    ActShape block_shape = act_shape(dims_, coord_, c.B, c.S, tp_.sp(), is_moe(l));
    block_shape.recompute = recompute_;
    const ActShape kept = with_part(block_shape, ActShape::kept),
                   redone = with_part(block_shape, ActShape::recomputed);
    a.blocks.push_back(
        Carver<P>{slice(all, n * l, n), slice(all_stats, ns * l, ns)}.template take<BlockA>(kept));
    if (recompute_ == Recompute::none) continue;
    // Every block's recomputed tensors share one workspace: used by one block at a time.
    auto work =
        Carver<P>{recomputed_.view(), recomputed_stats_.view()}.template take<BlockA>(redone);
    take_missing(a.blocks.back(), kept, work, redone);
  }
  a.in = Carver<P>{slice(all, n * L, sizes_.input)}.template take<InputActs<K::Vec<T>>>(shape);
  if (s.head >= 0)
    a.head = Carver<P>{slice(head_acts_.view(), sizes_.head * s.head, sizes_.head),
                       slice(head_stats_.view(), sizes_.head_stats * s.head, sizes_.head_stats)}
                 .template take<typename Head<P>::Acts>(shape);
  if (layout_.has_embedding) a.tokens = slice<int>(s.tokens, 0, c.BT);
  if (layout_.has_head) a.targets = slice<int>(s.targets, 0, c.BT);
  return a;
}

// The slot's W record: without recomputation the output gradients take the places of what
// only B reads (model/activations.hpp), the LayerNorm sums always come from the record.
template <class P>
auto Stage<P>::carve_weight(int slot, const Ctx& c, const Acts& a) const -> WeightGrads {
  const Slot& s = slots_.at(std::size_t(slot));
  PTRAIN_REQUIRE(s.weight >= 0, "model: slot ", slot, " holds no W record (internal)");
  const std::int64_t L = layout_.n_layers, n = sizes_.weight_per_layer,
                     ng = sizes_.weight_per_layer_grads;
  const K::Vec<T> values =
      slice(weight_acts_.view(), sizes_.weight(L) * s.weight, sizes_.weight(L));
  const K::Vec<G> sums = slice(weight_sums_.view(), sizes_.weight_grads(L) * s.weight, ng * L);
  ActShape shape = act_shape(dims_, coord_, c.B, c.S, tp_.sp());
  shape.recompute = recompute_;
  WeightGrads w;
  for (std::int64_t l = 0; l < L; ++l) {
    using BW = typename Block<P>::WeightGrads;
    BW b = Carver<P>{slice(values, n * l, n), {}, slice(sums, ng * l, ng)}.template take<BW>(shape);
    if (recompute_ == Recompute::none) {
      const auto& k = a.blocks[std::size_t(l)];
      b.dqkv = k.qkv, b.dfch = k.mlp.fch, b.dres2 = k.res2, b.dres3 = k.res3;
    }
    w.blocks.push_back(b);
  }
  if (layout_.has_embedding)
    w.in = recompute_ == Recompute::none ? InputWeightGrads<K::Vec<T>>{a.in.x}
                                         : Carver<P>{slice(values, n * L, sizes_.weight_input)}
                                               .template take<InputWeightGrads<K::Vec<T>>>(shape);
  return w;
}

// The scratch of a dense or a MoE block: two carvings of one buffer, which agree on dres
// (first), the only part a block hands to the next.
template <class P>
auto Stage<P>::carve_scratch(const Ctx& c, bool moe) const -> typename Block<P>::Grads {
  auto g =
      Carver<P>{scratch_.view(), {}, scratch_grads_.view()}.template take<typename Block<P>::Grads>(
          act_shape(dims_, coord_, c.B, c.S, tp_.sp(), moe));
  g.dres = slice(g.dres, 0, c.R * dims_.C);
  return g;
}

template <class P>
template <class V>
K::Vec<V> Stage<P>::tensor(const K::Vec<V>& unit_view, int unit, const std::string& name) const {
  const auto& t = layout_.find(name);
  return slice(unit_view, t.offset - units_[std::size_t(unit)].lo, t.numel);
}

// Views of a unit's parameters w and gradients g (empty g: forward only) as layers.
template <class P>
Block<P> Stage<P>::block(int unit, const K::Vec<T>& w, const K::Vec<G>& g) const {
  const std::string h = cat("h.", units_[std::size_t(unit)].layer, ".");
  // Empty w: a weight-gradient pass without recomputation, which reads no parameter.
  auto p = [&](const char* n) { return w.data() ? tensor(w, unit, h + n) : K::Vec<T>(); };
  auto d = [&](const char* n) { return g.data() ? tensor(g, unit, h + n) : K::Vec<G>(); };
  const int C = int(dims_.C), Cl = int(dims_.C / coord_.tp), Fl = int(dims_.F / coord_.tp);
  Block<P> b;
  b.ln1 = {p("ln_1.weight"), p("ln_1.bias"), d("ln_1.weight"), d("ln_1.bias"), C};
  b.qkv = {p("attn.qkv.weight"),
           p("attn.qkv.bias"),
           d("attn.qkv.weight"),
           d("attn.qkv.bias"),
           C,
           3 * Cl};
  b.attn = {int(dims_.NH / coord_.tp), int(dims_.HS)};
  b.proj = {p("attn.proj.weight"),
            p("attn.proj.bias"),
            d("attn.proj.weight"),
            d("attn.proj.bias"),
            Cl,
            C};
  b.ln2 = {p("ln_2.weight"), p("ln_2.bias"), d("ln_2.weight"), d("ln_2.bias"), C};
  if (is_moe(units_[std::size_t(unit)].layer - int(layout_.first_layer))) {
    set_moe(b, unit, w, g);
  } else {
    b.mlp.fc = {p("mlp.fc.weight"), p("mlp.fc.bias"), d("mlp.fc.weight"), d("mlp.fc.bias"), C, Fl};
    b.mlp.proj = {
        p("mlp.proj.weight"), p("mlp.proj.bias"), d("mlp.proj.weight"), d("mlp.proj.bias"), Fl, C};
  }
  return b;
}

template <class P>
void Stage<P>::set_moe(Block<P>& b, int unit, const K::Vec<T>& w, const K::Vec<G>& g) const {
  const std::string h = cat("h.", units_[std::size_t(unit)].layer, ".moe.");
  auto p = [&](const char* n) { return tensor(w, unit, h + n); };
  auto d = [&](const char* n) { return g.data() ? tensor(g, unit, h + n) : K::Vec<G>(); };
  MoE<P>& m = b.moe;
  m.router = p("router.weight"), m.drouter = d("router.weight");
  m.fc_w = p("fc.weight"), m.fc_b = p("fc.bias"), m.proj_w = p("proj.weight"),
  m.proj_b = p("proj.bias");
  m.dfc_w = d("fc.weight"), m.dfc_b = d("fc.bias"), m.dproj_w = d("proj.weight"),
  m.dproj_b = d("proj.bias");
  m.C = int(dims_.C), m.Fl = int(dims_.F / coord_.tp), m.E = int(dims_.n_expert);
  m.El = int(dims_.n_expert / coord_.ep), m.k = int(dims_.top_k);
  m.capacity_factor = dims_.capacity_factor, m.aux_coef = dims_.aux_loss_coef;
  m.aux_scale = aux_scale_;
  m.ep = ep_;
}

template <class P>
Embedding<P> Stage<P>::embedding(const K::Vec<T>& w, const K::Vec<G>& g) const {
  const int Vl = int(dims_.Vpad / coord_.tp);
  auto d = [&](const char* n) { return g.data() ? tensor(g, u_emb_, n) : K::Vec<G>(); };
  auto p = [&](const char* n) { return w.data() ? tensor(w, u_emb_, n) : K::Vec<T>(); };
  return {p("wte.weight"),
          p("wpe.weight"),
          d("wte.weight"),
          d("wpe.weight"),
          int(dims_.C),
          coord_.t * Vl,
          Vl};
}

template <class P>
Head<P> Stage<P>::head(const K::Vec<T>& w, const K::Vec<G>& g, const K::Vec<T>& wte,
                       const K::Vec<G>& dwte) const {
  auto d = [&](const char* n) { return g.data() ? tensor(g, u_head_, n) : K::Vec<G>(); };
  Head<P> h;
  h.lnf = {tensor(w, u_head_, "ln_f.weight"), tensor(w, u_head_, "ln_f.bias"), d("ln_f.weight"),
           d("ln_f.bias"), int(dims_.C)};
  h.lm = {wte, K::Vec<T>(), dwte, K::Vec<G>(), int(dims_.C), int(dims_.Vpad / coord_.tp)};
  h.v_real = int(dims_.V);
  return h;
}

template <class P>
double Stage<P>::forward(int slot, const MicroBatch& mb, bool for_backward) {
  PTRAIN_REQUIRE(mb.B >= 1 && mb.B <= micro_batch_, "model: micro-batch of ", mb.B,
                 " samples exceeds the allocated ", micro_batch_);
  Slot& s = slots_.at(std::size_t(slot));
  s.B = mb.B;
  if (layout_.has_head && s.head < 0) s.head = take(free_heads_, "head slot");
  const Ctx c(tp_, mb.B, S_, &cp_);
  static_assert(sizeof(int) == sizeof(std::int32_t));
  if (layout_.has_embedding)
    staging::from_host(slice<int>(s.tokens, 0, c.BT), mb.inputs, std::size_t(c.BT));
  if (layout_.has_head)
    staging::from_host(slice<int>(s.targets, 0, c.BT), mb.targets, std::size_t(c.BT));
  const Acts a = carve(slot, c);
  // tp partial sums before their reduction: the backward's scratch is free in a forward.
  const K::Vec<T> partial = slice(scratch_.view(), 0, c.BT * dims_.C);

  // The embedding unit stays available to the tied LM head and, when training, to the
  // backward; every other unit is released as soon as it is used.
  K::Vec<T> emb;
  if (layout_.has_embedding) {
    emb = store_->params(u_emb_, Phase::forward);
    embedding(emb, {}).forward(c, a.tokens, partial, a.in.x);
  }
  K::Vec<T> x = a.in.x;
  for (int l = 0; l < layout_.n_layers; ++l) {
    const int unit = u_block0_ + l;
    Block<P> b = block(unit, store_->params(unit, Phase::forward), {});
    if (is_moe(l)) b.routing = &s.routing[std::size_t(l)];
    // Evaluation routes dropless: a token's loss must not depend on how validation samples
    // are grouped into micro-batches, which differs between grids.
    if (!for_backward) b.moe.capacity_factor = 0;
    b.forward(c, x, a.blocks[std::size_t(l)], partial);
    x = a.blocks[std::size_t(l)].res3;
    store_->release_params(unit);
    if (b.routing && for_backward) count_moe(l, *b.routing);
  }
  if (!layout_.has_head) return 0;
  const K::Vec<T> w = store_->params(u_head_, Phase::forward);
  const K::Vec<T> wte = tensor(emb.data() ? emb : w, wte_unit(), "wte.weight");
  const double loss = head(w, {}, wte, {}).forward(c, x, a.head, a.targets);
  store_->release_params(u_head_);
  if (!for_backward && layout_.has_embedding) store_->release_params(u_emb_);
  if (!for_backward) free_heads_.push_back(std::exchange(s.head, -1));
  return loss;
}

template <class P>
int Stage<P>::take(std::vector<int>& free, const char* what) {
  PTRAIN_REQUIRE(!free.empty(), "model: no free ", what,
                 " (the schedule keeps more micro-batches than checked)");
  const int k = free.back();
  free.pop_back();
  return k;
}

// The head's whole backward (its weight gradients too): dloss in, d(input) in g.dres.
template <class P>
void Stage<P>::head_backward(const Ctx& c, const Acts& a, const typename Block<P>::Grads& g,
                             A dloss, const K::Vec<T>& emb, const K::Vec<G>& demb) {
  const K::Vec<T> w = store_->params(u_head_, Phase::backward);
  const K::Vec<G> dw = store_->grads(u_head_);
  const K::Vec<T> wte = tensor(emb.data() ? emb : w, wte_unit(), "wte.weight");
  const K::Vec<G> dwte = tensor(demb.data() ? demb : dw, wte_unit(), "wte.weight");
  const K::Vec<T> rows = tp_.sp() ? slice(g.dfull, 0, c.R * dims_.C) : g.dln;
  const K::Vec<T> x =
      layout_.n_layers > 0 ? a.blocks[std::size_t(layout_.n_layers - 1)].res3 : a.in.x;
  head(w, dw, wte, dwte).backward(c, x, a.head, a.targets, dloss, g.dres, g.dln, rows, g.dnorm);
  store_->release_params(u_head_);
  store_->grads_done(u_head_);
}

template <class P>
void Stage<P>::backward(int slot, A dloss, K::CVec<T> dout) {
  const Slot& s = slots_.at(std::size_t(slot));
  const Ctx c(tp_, s.B, S_, &cp_);
  last_B_ = s.B;
  const Acts a = carve(slot, c);
  const auto g = carve_scratch(c), g_moe = carve_scratch(c, true);
  const auto block_input = [&](std::int64_t l) {
    return l == 0 ? a.in.x : a.blocks[std::size_t(l - 1)].res3;
  };
  // The embedding unit is still held from the forward; its gradients complete only after
  // the embedding backward, at the very end.
  K::Vec<T> emb;
  K::Vec<G> demb;
  if (layout_.has_embedding) {
    emb = store_->params(u_emb_, Phase::backward);
    demb = store_->grads(u_emb_);
  }
  if (layout_.has_head) {
    head_backward(c, a, g, dloss, emb, demb);
    free_heads_.push_back(std::exchange(slots_[std::size_t(slot)].head, -1));
  } else {
    K::copy<T>(g.dres, dout);
  }
  for (int l = int(layout_.n_layers) - 1; l >= 0; --l) {
    const int unit = u_block0_ + l;
    Block<P> b = block(unit, store_->params(unit, Phase::backward), store_->grads(unit));
    if (is_moe(l)) b.routing = &slots_[std::size_t(slot)].routing[std::size_t(l)];
    b.recompute(c, block_input(l), a.blocks[std::size_t(l)], recompute_, rerun_partial(c));
    b.backward(c, block_input(l), a.blocks[std::size_t(l)], b.routing ? g_moe : g);
    store_->release_params(unit);
    store_->grads_done(unit);
  }
  if (!layout_.has_embedding) return;
  embedding(emb, demb).backward(c, a.tokens, g.dres, g.dfull);
  store_->release_params(u_emb_);
  store_->grads_done(u_emb_);
}

template <class P>
void Stage<P>::backward_input(int slot, A dloss, K::CVec<T> dout) {
  PTRAIN_REQUIRE(can_split_, "model: this stage does not split its backward (internal)");
  Slot& s = slots_.at(std::size_t(slot));
  const Ctx c(tp_, s.B, S_, &cp_);
  last_B_ = s.B;
  s.weight = take(free_weights_, "W record");
  const Acts a = carve(slot, c);
  const WeightGrads w = carve_weight(slot, c, a);
  const auto g = carve_scratch(c);
  const auto block_input = [&](std::int64_t l) {
    return l == 0 ? a.in.x : a.blocks[std::size_t(l - 1)].res3;
  };
  if (layout_.has_head) {
    head_backward(c, a, g, dloss, {}, {});
    free_heads_.push_back(std::exchange(s.head, -1));
  } else {
    K::copy<T>(g.dres, dout);
  }
  // No gradient is touched: each block's parameters only (ZeRO 3 gathers them).
  for (int l = int(layout_.n_layers) - 1; l >= 0; --l) {
    const int unit = u_block0_ + l;
    Block<P> b = block(unit, store_->params(unit, Phase::backward), {});
    b.recompute(c, block_input(l), a.blocks[std::size_t(l)], recompute_, rerun_partial(c));
    b.backward_input(c, block_input(l), a.blocks[std::size_t(l)], g, w.blocks[std::size_t(l)]);
    store_->release_params(unit);
  }
  // d(input) for the embedding's W: in its place without recomputation (block 0 read it last).
  if (layout_.has_embedding) K::copy<T>(w.in.dx, g.dres);
}

template <class P>
void Stage<P>::backward_weight(int slot) {
  Slot& s = slots_.at(std::size_t(slot));
  const Ctx c(tp_, s.B, S_, &cp_);
  const Acts a = carve(slot, c);
  const WeightGrads w = carve_weight(slot, c, a);
  const auto g = carve_scratch(c);
  for (int l = int(layout_.n_layers) - 1; l >= 0; --l) {
    const int unit = u_block0_ + l;
    // With recomputation W reruns it (B's workspace is gone): that reads the parameters.
    const bool rerun = recompute_ != Recompute::none;
    Block<P> b = block(unit, rerun ? store_->params(unit, Phase::backward) : K::Vec<T>(),
                       store_->grads(unit));
    if (rerun) {
      b.recompute(c, l == 0 ? a.in.x : a.blocks[std::size_t(l - 1)].res3, a.blocks[std::size_t(l)],
                  recompute_, rerun_partial(c));
      store_->release_params(unit);
    }
    b.backward_weight(c, a.blocks[std::size_t(l)], g, w.blocks[std::size_t(l)]);
    store_->grads_done(unit);
  }
  if (layout_.has_embedding) {
    embedding({}, store_->grads(u_emb_)).backward(c, a.tokens, w.in.dx, g.dfull);
    store_->grads_done(u_emb_);
  }
  free_weights_.push_back(std::exchange(s.weight, -1));
}

// The tp partial sums of a forward rerun in the backward (full recomputation): the end of
// the recompute workspace, past the block's tensors (the backward's scratch is in use).
template <class P>
auto Stage<P>::rerun_partial(const Ctx& c) const -> K::Vec<T> {
  if (recompute_ != Recompute::full) return K::Vec<T>();
  const std::int64_t n = c.BT * dims_.C;
  return slice(recomputed_.view(), sizes_.recompute - n, n);
}

template <class P>
void Stage<P>::count_moe(int l, const Routing& r) {
  MoeStats& m = moe_stats_[std::size_t(l)];
  m.aux += r.aux;
  m.load.resize(r.load.size(), 0);
  for (std::size_t e = 0; e < r.load.size(); ++e) m.load[e] += r.load[e];
  m.dropped += r.dropped;
  m.choices += r.choices;
}

template <class P>
auto Stage<P>::take_moe_stats() -> std::vector<MoeStats> {
  std::vector<MoeStats> out(moe_stats_.size());
  std::swap(out, moe_stats_);
  return out;
}

template <class P>
auto Stage<P>::input(int slot, int B) const -> K::Vec<T> {
  return carve(slot, Ctx(tp_, B, S_, &cp_)).in.x;
}

template <class P>
auto Stage<P>::output(int slot) const -> K::Vec<T> {
  const Slot& s = slots_.at(std::size_t(slot));
  return carve(slot, Ctx(tp_, s.B, S_, &cp_)).blocks.back().res3;
}

template <class P>
auto Stage<P>::input_grad() const -> K::Vec<T> {
  return carve_scratch(Ctx(tp_, last_B_, S_, &cp_)).dres;
}

// ---- the resident store's whole buffers ------------------------------------------------

template <class P>
ResidentStore<P>& Stage<P>::resident() const {
  auto* r = dynamic_cast<ResidentStore<P>*>(store_);
  PTRAIN_REQUIRE(r, "model: the parameters are sharded (ZeRO 2/3); no whole buffer on this rank");
  return *r;
}

template <class P>
auto Stage<P>::params() const -> K::Vec<T> {
  return slice(resident().all_params(), 0, layout_.numel);
}
template <class P>
auto Stage<P>::grads() const -> K::Vec<G> {
  return slice(resident().all_grads(), 0, layout_.numel);
}
template <class P>
auto Stage<P>::param(const std::string& name) const -> K::Vec<T> {
  const auto& t = layout_.find(name);
  return slice(resident().all_params(), t.offset, t.numel);
}
template <class P>
auto Stage<P>::grad(const std::string& name) const -> K::Vec<G> {
  const auto& t = layout_.find(name);
  return slice(resident().all_grads(), t.offset, t.numel);
}

template <class P>
void Stage<P>::init_weights(std::uint64_t seed) {
  init_range(layout_, dims_, seed, params(), 0);
}

template <class P>
void Stage<P>::zero_grads() {
  profile::region("zero-fill", [&] { K::fill(resident().all_grads(), G(0)); });
}

#define PTRAIN_STAGE_INSTANTIATE(P) \
  template class ResidentStore<P>;  \
  template class Stage<P>;
PTRAIN_STAGE_INSTANTIATE(Fp32)
PTRAIN_STAGE_INSTANTIATE(Fp64)
PTRAIN_STAGE_INSTANTIATE(Bf16)
PTRAIN_STAGE_INSTANTIATE(Bf16Grads)
#undef PTRAIN_STAGE_INSTANTIATE

}  // namespace ptrain::model
