#include "model/stage.hpp"

#include <vector>

#include "kernels/kernels.hpp"
#include "model/activations.hpp"
#include "util/error.hpp"
#include "util/profile.hpp"

namespace ptrain::model {

namespace K = kernels;

namespace {

using kernels::slice;

// Carves the tensors of one description (model/activations.hpp) out of a buffer, in order.
template <class T>
struct Carver {
  K::Vec<T> buffer;
  std::int64_t at = 0;
  template <template <class> class Acts>
  Acts<K::Vec<T>> take(const ActShape& s) {
    Acts<K::Vec<T>> a;
    describe(a, s, [&](K::Vec<T>& field, std::int64_t n) {
      field = slice(buffer, at, n);
      at += n;
    });
    return a;
  }
};

// The fields of `a` that its shape left empty, taken from `b` (carved with the
// complementary part: describe visits both in the same order).
template <template <class> class Acts, class V>
void take_missing(Acts<V>& a, const ActShape& sa, Acts<V>& b, const ActShape& sb) {
  std::vector<V*> from;
  describe(b, sb, [&](V& field, std::int64_t) { from.push_back(&field); });
  std::size_t i = 0;
  describe(a, sa, [&](V& field, std::int64_t n) {
    if (n == 0) field = *from[i];
    ++i;
  });
}

}  // namespace

// ---- stores ----------------------------------------------------------------------------

template <class T>
ResidentStore<T>::ResidentStore(const ChunkLayout& layout, std::int64_t numel)
    : units_(units_of(layout)),
      params_(MemCategory::params, "ptrain::params", std::size_t(numel)),
      grads_(MemCategory::grads, "ptrain::grads", std::size_t(numel)) {
  PTRAIN_REQUIRE(numel >= layout.numel, "model: resident buffers of ", numel,
                 " elements cannot hold the chunk's ", layout.numel);
}

template <class T>
K::Vec<T> ResidentStore<T>::params(int unit, Phase) {
  const Unit& u = units_.at(std::size_t(unit));
  return slice(params_.view(), u.lo, u.hi - u.lo);
}

template <class T>
K::Vec<T> ResidentStore<T>::grads(int unit) {
  const Unit& u = units_.at(std::size_t(unit));
  return slice(grads_.view(), u.lo, u.hi - u.lo);
}

// ---- the stage ---------------------------------------------------------------------------

template <class T>
struct Stage<T>::Acts {
  InputActs<K::Vec<T>> in;
  std::vector<BlockActs<K::Vec<T>>> blocks;
  HeadActs<K::Vec<T>> head;
  K::IntVec tokens, targets;
};

template <class T>
Stage<T>::Stage(const Config& config, const ShardCoord& coord, const ChunkLayout& layout,
                int micro_batch, int slots, ParamStore<T>* store, Comm* tp, Comm* cp, Comm* ep)
    : dims_(dims_of(config)),
      coord_(coord),
      layout_(layout),
      units_(units_of(layout)),
      micro_batch_(micro_batch),
      tp_(tp, config.parallel.sequence_parallel),
      cp_(cp, dims_.S, coord.cp_zigzag),
      S_(int(dims_.S / coord.C)),
      ep_(ep && ep->size() > 1 ? ep : nullptr),
      aux_scale_(double(config.train.micro_batch) / double(config.train.global_batch)),
      recompute_(recompute_mode(config.train.recompute)),
      moe_stats_(std::size_t(layout.n_layers)) {
  PTRAIN_REQUIRE(coord.E == 1 || (ep && ep->size() == coord.E), "model: expert parallelism over ",
                 coord.E, " ranks needs their ep group");
  PTRAIN_REQUIRE(coord.T == 1 || (tp && tp->size() == coord.T), "model: tensor parallelism over ",
                 coord.T, " ranks needs their tp group");
  PTRAIN_REQUIRE(coord.C == 1 || (cp && cp->size() == coord.C && cp->rank() == coord.c),
                 "model: context parallelism over ", coord.C, " ranks needs their cp group");
  PTRAIN_REQUIRE(slots >= 1, "model: a stage needs at least one activation slot");
  for (std::size_t i = 0; i < units_.size(); ++i) {
    if (units_[i].kind == Unit::embedding) u_emb_ = int(i);
    if (units_[i].kind == Unit::block && u_block0_ < 0) u_block0_ = int(i);
    if (units_[i].kind == Unit::head) u_head_ = int(i);
  }
  if (store) {
    store_ = store;
  } else {
    own_store_ = std::make_unique<ResidentStore<T>>(layout_, layout_.numel);
    store_ = own_store_.get();
  }
  sizes_ = activation_sizes(dims_, coord, micro_batch, S_, layout_.has_head, tp_.sp(), recompute_);
  if (sizes_.recompute > 0)
    recomputed_ = TrackedView<T>(MemCategory::activations, "ptrain::recomputed_activations",
                                 std::size_t(sizes_.recompute));
  const std::int64_t kept = sizes_.kept(layout_.n_layers);
  acts_ = TrackedView<T>(MemCategory::activations, "ptrain::activations",
                         std::size_t(kept * slots));
  scratch_ = TrackedView<T>(MemCategory::workspace, "ptrain::backward_scratch",
                            std::size_t(sizes_.scratch));
  const std::size_t ids = std::size_t(micro_batch) * std::size_t(S_);
  for (int k = 0; k < slots; ++k) {
    Slot s;
    s.offset = kept * k;
    if (layout_.has_embedding) s.tokens = Kokkos::View<int*>("ptrain::tokens", ids);
    if (layout_.has_head) s.targets = Kokkos::View<int*>("ptrain::targets", ids);
    s.routing.resize(std::size_t(layout_.n_layers));
    slots_.push_back(std::move(s));
  }
}

// Block l of a slot at offset l * per_layer, then the input and the head; each carved for
// the slot's micro-batch inside room for `micro_batch` samples.
template <class T>
typename Stage<T>::Acts Stage<T>::carve(int slot, const Ctx& c) const {
  const Slot& s = slots_.at(std::size_t(slot));
  const ActShape shape = act_shape(dims_, coord_, c.B, c.S, tp_.sp());
  const K::Vec<T> all = slice(acts_.view(), s.offset, sizes_.kept(layout_.n_layers));
  Acts a;
  for (int l = 0; l < layout_.n_layers; ++l) {
    ActShape block_shape = act_shape(dims_, coord_, c.B, c.S, tp_.sp(), is_moe(l));
    block_shape.recompute = recompute_;
    const ActShape kept = with_part(block_shape, ActShape::kept),
                   redone = with_part(block_shape, ActShape::recomputed);
    a.blocks.push_back(Carver<T>{slice(all, sizes_.per_layer * l, sizes_.per_layer)}
                           .template take<BlockActs>(kept));
    if (recompute_ == Recompute::none) continue;
    // Every block's recomputed tensors share one workspace: used by one block at a time.
    auto work = Carver<T>{recomputed_.view()}.template take<BlockActs>(redone);
    take_missing(a.blocks.back(), kept, work, redone);
  }
  Carver<T> outside{slice(all, sizes_.per_layer * layout_.n_layers, sizes_.outside)};
  a.in = outside.template take<InputActs>(shape);
  if (layout_.has_head) a.head = outside.template take<HeadActs>(shape);
  if (layout_.has_embedding) a.tokens = slice<int>(s.tokens, 0, c.BT);
  if (layout_.has_head) a.targets = slice<int>(s.targets, 0, c.BT);
  return a;
}

// The scratch of a dense or a MoE block: two carvings of one buffer, which agree on dres
// (first), the only part a block hands to the next.
template <class T>
typename Block<T>::Grads Stage<T>::carve_scratch(const Ctx& c, bool moe) const {
  auto g = Carver<T>{scratch_.view()}.template take<Scratch>(
      act_shape(dims_, coord_, c.B, c.S, tp_.sp(), moe));
  g.dres = slice(g.dres, 0, c.R * dims_.C);
  return g;
}

template <class T>
K::Vec<T> Stage<T>::tensor(const K::Vec<T>& unit_view, int unit, const std::string& name) const {
  const auto& t = layout_.find(name);
  return slice(unit_view, t.offset - units_[std::size_t(unit)].lo, t.numel);
}

// Views of a unit's parameters w and gradients g (empty g: forward only) as layers.
template <class T>
Block<T> Stage<T>::block(int unit, const K::Vec<T>& w, const K::Vec<T>& g) const {
  const std::string h = cat("h.", units_[std::size_t(unit)].layer, ".");
  auto p = [&](const char* n) { return tensor(w, unit, h + n); };
  auto d = [&](const char* n) { return g.data() ? tensor(g, unit, h + n) : K::Vec<T>(); };
  const int C = int(dims_.C), Cl = int(dims_.C / coord_.T), Fl = int(dims_.F / coord_.T);
  Block<T> b;
  b.ln1 = {p("ln_1.weight"), p("ln_1.bias"), d("ln_1.weight"), d("ln_1.bias"), C};
  b.qkv = {p("attn.qkv.weight"), p("attn.qkv.bias"), d("attn.qkv.weight"), d("attn.qkv.bias"),
           C, 3 * Cl};
  b.attn = {int(dims_.NH / coord_.T), int(dims_.HS)};
  b.proj = {p("attn.proj.weight"), p("attn.proj.bias"), d("attn.proj.weight"), d("attn.proj.bias"),
            Cl, C};
  b.ln2 = {p("ln_2.weight"), p("ln_2.bias"), d("ln_2.weight"), d("ln_2.bias"), C};
  if (is_moe(units_[std::size_t(unit)].layer - int(layout_.first_layer))) {
    set_moe(b, unit, w, g);
  } else {
    b.mlp.fc = {p("mlp.fc.weight"), p("mlp.fc.bias"), d("mlp.fc.weight"), d("mlp.fc.bias"), C, Fl};
    b.mlp.proj = {p("mlp.proj.weight"), p("mlp.proj.bias"), d("mlp.proj.weight"),
                  d("mlp.proj.bias"), Fl, C};
  }
  return b;
}

template <class T>
void Stage<T>::set_moe(Block<T>& b, int unit, const K::Vec<T>& w, const K::Vec<T>& g) const {
  const std::string h = cat("h.", units_[std::size_t(unit)].layer, ".moe.");
  auto p = [&](const char* n) { return tensor(w, unit, h + n); };
  auto d = [&](const char* n) { return g.data() ? tensor(g, unit, h + n) : K::Vec<T>(); };
  MoE<T>& m = b.moe;
  m.router = p("router.weight"), m.drouter = d("router.weight");
  m.fc_w = p("fc.weight"), m.fc_b = p("fc.bias"), m.proj_w = p("proj.weight"), m.proj_b = p("proj.bias");
  m.dfc_w = d("fc.weight"), m.dfc_b = d("fc.bias"), m.dproj_w = d("proj.weight"), m.dproj_b = d("proj.bias");
  m.C = int(dims_.C), m.Fl = int(dims_.F / coord_.T), m.E = int(dims_.n_expert);
  m.El = int(dims_.n_expert / coord_.E), m.k = int(dims_.top_k);
  m.capacity_factor = dims_.capacity_factor, m.aux_coef = dims_.aux_loss_coef;
  m.aux_scale = aux_scale_;
  m.ep = ep_;
}

template <class T>
Embedding<T> Stage<T>::embedding(const K::Vec<T>& w, const K::Vec<T>& g) const {
  const int Vl = int(dims_.Vpad / coord_.T);
  auto d = [&](const char* n) { return g.data() ? tensor(g, u_emb_, n) : K::Vec<T>(); };
  return {tensor(w, u_emb_, "wte.weight"), tensor(w, u_emb_, "wpe.weight"), d("wte.weight"),
          d("wpe.weight"), int(dims_.C), coord_.t * Vl, Vl};
}

template <class T>
Head<T> Stage<T>::head(const K::Vec<T>& w, const K::Vec<T>& g, const K::Vec<T>& wte,
                       const K::Vec<T>& dwte) const {
  auto d = [&](const char* n) { return g.data() ? tensor(g, u_head_, n) : K::Vec<T>(); };
  Head<T> h;
  h.lnf = {tensor(w, u_head_, "ln_f.weight"), tensor(w, u_head_, "ln_f.bias"), d("ln_f.weight"),
           d("ln_f.bias"), int(dims_.C)};
  h.lm = {wte, K::Vec<T>(), dwte, K::Vec<T>(), int(dims_.C), int(dims_.Vpad / coord_.T)};
  h.v_real = int(dims_.V);
  return h;
}

template <class T>
double Stage<T>::forward(int slot, const MicroBatch& mb, bool for_backward) {
  PTRAIN_REQUIRE(mb.B >= 1 && mb.B <= micro_batch_, "model: micro-batch of ", mb.B,
                 " samples exceeds the allocated ", micro_batch_);
  Slot& s = slots_.at(std::size_t(slot));
  s.B = mb.B;
  const Ctx c(tp_, mb.B, S_, &cp_);
  using Host = Kokkos::View<const int*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>;
  static_assert(sizeof(int) == sizeof(std::int32_t));
  if (layout_.has_embedding) Kokkos::deep_copy(slice<int>(s.tokens, 0, c.BT), Host(mb.inputs, c.BT));
  if (layout_.has_head) Kokkos::deep_copy(slice<int>(s.targets, 0, c.BT), Host(mb.targets, c.BT));
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
    Block<T> b = block(unit, store_->params(unit, Phase::forward), {});
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
  return loss;
}

template <class T>
void Stage<T>::backward(int slot, T dloss, K::CVec<T> dout) {
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
  K::Vec<T> emb, demb;
  if (layout_.has_embedding) {
    emb = store_->params(u_emb_, Phase::backward);
    demb = store_->grads(u_emb_);
  }
  if (layout_.has_head) {
    const K::Vec<T> w = store_->params(u_head_, Phase::backward), dw = store_->grads(u_head_);
    const K::Vec<T> wte = tensor(emb.data() ? emb : w, wte_unit(), "wte.weight");
    const K::Vec<T> dwte = tensor(demb.data() ? demb : dw, wte_unit(), "wte.weight");
    const K::Vec<T> rows = tp_.sp() ? slice(g.dfull, 0, c.R * dims_.C) : g.dln;
    head(w, dw, wte, dwte)
        .backward(c, block_input(layout_.n_layers), a.head, a.targets, dloss, g.dres, g.dln, rows,
                  g.dnorm);
    store_->release_params(u_head_);
    store_->grads_done(u_head_);
  } else {
    K::copy<T>(g.dres, dout);
  }
  for (int l = int(layout_.n_layers) - 1; l >= 0; --l) {
    const int unit = u_block0_ + l;
    Block<T> b = block(unit, store_->params(unit, Phase::backward), store_->grads(unit));
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

// The tp partial sums of a forward rerun in the backward (full recomputation): the end of
// the recompute workspace, past the block's tensors (the backward's scratch is in use).
template <class T>
K::Vec<T> Stage<T>::rerun_partial(const Ctx& c) const {
  if (recompute_ != Recompute::full) return K::Vec<T>();
  const std::int64_t n = c.BT * dims_.C;
  return slice(recomputed_.view(), sizes_.recompute - n, n);
}

template <class T>
void Stage<T>::count_moe(int l, const Routing& r) {
  MoeStats& m = moe_stats_[std::size_t(l)];
  m.aux += r.aux;
  m.load.resize(r.load.size(), 0);
  for (std::size_t e = 0; e < r.load.size(); ++e) m.load[e] += r.load[e];
  m.dropped += r.dropped;
  m.choices += r.choices;
}

template <class T>
std::vector<typename Stage<T>::MoeStats> Stage<T>::take_moe_stats() {
  std::vector<MoeStats> out(moe_stats_.size());
  std::swap(out, moe_stats_);
  return out;
}

template <class T>
K::Vec<T> Stage<T>::input(int slot, int B) const {
  return carve(slot, Ctx(tp_, B, S_, &cp_)).in.x;
}

template <class T>
K::Vec<T> Stage<T>::output(int slot) const {
  const Slot& s = slots_.at(std::size_t(slot));
  return carve(slot, Ctx(tp_, s.B, S_, &cp_)).blocks.back().res3;
}

template <class T>
K::Vec<T> Stage<T>::input_grad() const {
  return carve_scratch(Ctx(tp_, last_B_, S_, &cp_)).dres;
}

// ---- the resident store's whole buffers ------------------------------------------------

template <class T>
ResidentStore<T>& Stage<T>::resident() const {
  auto* r = dynamic_cast<ResidentStore<T>*>(store_);
  PTRAIN_REQUIRE(r, "model: the parameters are sharded (ZeRO 2/3); no whole buffer on this rank");
  return *r;
}

template <class T>
K::Vec<T> Stage<T>::params() const {
  return slice(resident().all_params(), 0, layout_.numel);
}
template <class T>
K::Vec<T> Stage<T>::grads() const {
  return slice(resident().all_grads(), 0, layout_.numel);
}
template <class T>
K::Vec<T> Stage<T>::param(const std::string& name) const {
  const auto& t = layout_.find(name);
  return slice(resident().all_params(), t.offset, t.numel);
}
template <class T>
K::Vec<T> Stage<T>::grad(const std::string& name) const {
  const auto& t = layout_.find(name);
  return slice(resident().all_grads(), t.offset, t.numel);
}

template <class T>
void Stage<T>::init_weights(std::uint64_t seed) {
  init_range(layout_, dims_, seed, params(), 0);
}

template <class T>
void Stage<T>::zero_grads() {
  profile::region("zero-fill", [&] { K::fill(resident().all_grads(), T(0)); });
}

template class ResidentStore<float>;
template class ResidentStore<double>;
template class Stage<float>;
template class Stage<double>;

}  // namespace ptrain::model
