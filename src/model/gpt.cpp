#include "model/gpt.hpp"

#include <cmath>

#include "data/rng.hpp"
#include "kernels/attention.hpp"
#include "kernels/gemm.hpp"
#include "kernels/kernels.hpp"
#include "util/error.hpp"
#include "util/profile.hpp"

namespace ptrain::model {

namespace K = kernels;

namespace {

// FNV-1a: a tensor's name -> its random stream.
std::uint64_t name_stream(const std::string& name) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

template <class T>
K::Vec<T> slice(const K::Vec<T>& v, std::int64_t offset, std::int64_t n) {
  return Kokkos::subview(v, Kokkos::make_pair(offset, offset + n));
}

// Carves consecutive slices out of one buffer.
template <class T>
struct Carver {
  K::Vec<T> buffer;
  std::int64_t at = 0;
  K::Vec<T> take(std::int64_t n) {
    auto s = slice(buffer, at, n);
    at += n;
    return s;
  }
};

// The activations one block keeps for its backward (model/layout.hpp activation_sizes):
// res2 = x + attn(LN1(x)), res3 = res2 + mlp(LN2(res2)). R rows of the residual stream are
// kept here: all BT, or this rank's 1/tp token shard with sequence parallelism.
template <class T>
struct BlockActs {
  K::Vec<T> ln1, qkv, atty, lse;                     // (BT, C), (BT, 3Cl), (BT, Cl), (B, NHl, T)
  K::Vec<T> ln2, fch, fch_gelu;                      // (BT, C), (BT, Fl), (BT, Fl)
  K::Vec<T> ln1_mean, ln1_rstd, ln2_mean, ln2_rstd;  // (R) each
  K::Vec<T> res2, res3;  // (R, C) each; res3 last (the next block's input)
};

template <class T>
BlockActs<T> carve_block(const K::Vec<T>& layer, std::int64_t BT, std::int64_t R, std::int64_t C,
                         std::int64_t Cl, std::int64_t NH, std::int64_t Fl) {
  Carver<T> a{layer};
  BlockActs<T> b;
  b.ln1 = a.take(BT * C), b.qkv = a.take(BT * 3 * Cl), b.atty = a.take(BT * Cl);
  b.lse = a.take(BT * NH);
  b.ln2 = a.take(BT * C), b.fch = a.take(BT * Fl), b.fch_gelu = a.take(BT * Fl);
  b.ln1_mean = a.take(R), b.ln1_rstd = a.take(R), b.ln2_mean = a.take(R), b.ln2_rstd = a.take(R);
  b.res2 = a.take(R * C), b.res3 = a.take(R * C);
  return b;
}

}  // namespace

// One block's tensors (parameters or gradients).
template <class T>
struct GPT<T>::Block {
  K::Vec<T> ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fcproj_w,
      fcproj_b;
};

template <class T>
ResidentStore<T>::ResidentStore(const ChunkLayout& layout, std::int64_t numel)
    : units_(units_of(layout)),
      params_(MemCategory::params, "ptrain::params", std::size_t(numel)),
      grads_(MemCategory::grads, "ptrain::grads", std::size_t(numel)) {
  PTRAIN_REQUIRE(numel >= layout.numel, "model: resident buffers of ", numel,
                 " elements cannot hold the chunk's ", layout.numel);
}

template <class T>
K::Vec<T> ResidentStore<T>::params(int unit) {
  const Unit& u = units_.at(std::size_t(unit));
  return slice(params_.view(), u.lo, u.hi - u.lo);
}

template <class T>
K::Vec<T> ResidentStore<T>::grads(int unit) {
  const Unit& u = units_.at(std::size_t(unit));
  return slice(grads_.view(), u.lo, u.hi - u.lo);
}

template <class T>
GPT<T>::GPT(const Config& config, const ShardCoord& coord, int micro_batch, ParamStore<T>* store,
            Comm* tp)
    : config_(config), dims_(dims_of(config)), coord_(coord), micro_batch_(micro_batch), tp_(tp) {
  // Only the pieces this version implements; everything else says so instead of guessing.
  PTRAIN_REQUIRE(coord.T == 1 || (tp && tp->size() == coord.T), "model: tensor parallelism over ",
                 coord.T, " ranks needs their tp group");
  PTRAIN_REQUIRE(coord.P == 1 && coord.virtual_stages == 1,
                 "model: pipeline parallelism (parallel%pp > 1) is not implemented yet");
  PTRAIN_REQUIRE(dims_.n_expert == 0,
                 "model: mixture-of-experts layers (model%n_expert > 0) are not implemented yet");
  PTRAIN_REQUIRE(config.parallel.cp == 1,
                 "model: context parallelism (parallel%cp > 1) is not implemented yet");
  layout_ = build_layout(config, coord).at(0);
  units_ = units_of(layout_);
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
  const auto act =
      activation_sizes(dims_, coord, micro_batch, dims_.S, layout_.has_head, sequence_parallel());
  acts_ = TrackedView<T>(MemCategory::activations, "ptrain::activations",
                         std::size_t(act.kept(layout_.n_layers)));
  scratch_ =
      TrackedView<T>(MemCategory::workspace, "ptrain::backward_scratch", std::size_t(act.scratch));
  tokens_ = Kokkos::View<int*>("ptrain::tokens", std::size_t(micro_batch) * dims_.S);
  targets_ = Kokkos::View<int*>("ptrain::targets", std::size_t(micro_batch) * dims_.S);
}

template <class T>
void GPT<T>::tp_sum(const K::Vec<T>& x) {
  if (tp_ && tp_->size() > 1) tp_->all_reduce_sum(x.data(), x.extent(0)).wait();
}

template <class T>
ResidentStore<T>& GPT<T>::resident() const {
  auto* r = dynamic_cast<ResidentStore<T>*>(store_);
  PTRAIN_REQUIRE(r, "model: the parameters are sharded (ZeRO 2/3); no whole buffer on this rank");
  return *r;
}

template <class T>
K::Vec<T> GPT<T>::params() const {
  return slice(resident().all_params(), 0, layout_.numel);
}
template <class T>
K::Vec<T> GPT<T>::grads() const {
  return slice(resident().all_grads(), 0, layout_.numel);
}
template <class T>
K::Vec<T> GPT<T>::param(const std::string& name) const {
  const auto& t = layout_.find(name);
  return slice(resident().all_params(), t.offset, t.numel);
}
template <class T>
K::Vec<T> GPT<T>::grad(const std::string& name) const {
  const auto& t = layout_.find(name);
  return slice(resident().all_grads(), t.offset, t.numel);
}

template <class T>
K::Vec<T> GPT<T>::tensor(const K::Vec<T>& unit_view, int unit, const std::string& name) const {
  const auto& t = layout_.find(name);
  return slice(unit_view, t.offset - units_[std::size_t(unit)].lo, t.numel);
}

template <class T>
typename GPT<T>::Block GPT<T>::block_views(const K::Vec<T>& unit_view, int unit) const {
  const std::string h = cat("h.", units_[std::size_t(unit)].layer, ".");
  auto v = [&](const char* n) { return tensor(unit_view, unit, h + n); };
  return Block{v("ln_1.weight"),   v("ln_1.bias"),        v("attn.qkv.weight"),
               v("attn.qkv.bias"), v("attn.proj.weight"), v("attn.proj.bias"),
               v("ln_2.weight"),   v("ln_2.bias"),        v("mlp.fc.weight"),
               v("mlp.fc.bias"),   v("mlp.proj.weight"),  v("mlp.proj.bias")};
}

template <class T>
void GPT<T>::init_weights(std::uint64_t seed) {
  init_range(seed, params(), 0);
}

template <class T>
void GPT<T>::init_range(std::uint64_t seed, K::Vec<T> out, std::int64_t lo) const {
  const std::int64_t hi = lo + std::int64_t(out.extent(0));
  const double std_matrix = 0.02, std_residual = 0.02 / std::sqrt(2.0 * double(dims_.L));
  K::fill(out, T(0));  // padding (vocabulary rows, flat-buffer tail) stays zero
  for (const auto& t : layout_.tensors) {
    // The part of this tensor inside [lo, hi), as local element indices [k0, k1).
    const std::int64_t k0 = std::max<std::int64_t>(0, lo - t.offset);
    const std::int64_t k1 = std::min<std::int64_t>(t.numel, hi - t.offset);
    if (k0 >= k1) continue;
    const std::int64_t shift = t.offset - lo;  // out index of local element k: k + shift
    auto p = slice(out, k0 + shift, k1 - k0);
    if (t.kind == TensorKind::bias || t.kind == TensorKind::norm) {
      const bool is_gain = t.kind == TensorKind::norm && t.name.size() > 7 &&
                           t.name.compare(t.name.size() - 7, 7, ".weight") == 0;
      K::fill(p, T(is_gain ? 1 : 0));
      continue;
    }
    const bool residual = t.name.find("attn.proj.weight") != std::string::npos ||
                          t.name.find("mlp.proj.weight") != std::string::npos;
    const double stddev = residual ? std_residual : std_matrix;
    const std::uint64_t stream = name_stream(t.name);
    // Each slab: local element k -> multi-index in the slab -> global flat index.
    std::int64_t base = 0;
    for (const auto& s : t.slabs) {
      const int rank = int(t.global_shape.size());
      std::int64_t start[3] = {0, 0, 0}, count[3] = {1, 1, 1}, gshape[3] = {1, 1, 1};
      for (int d = 0; d < rank; ++d) {
        start[3 - rank + d] = s.start[d];
        count[3 - rank + d] = s.count[d];
        gshape[3 - rank + d] = t.global_shape[d];
      }
      const std::int64_t b0 = std::max(base, k0), b1 = std::min(base + s.numel(), k1);
      if (b0 < b1) {
        const std::int64_t slab0 = base;
        K::Vec<T> dst = out;
        Kokkos::parallel_for(
            "ptrain::init_normal", Kokkos::RangePolicy<>(b0, b1),
            KOKKOS_LAMBDA(const std::int64_t k) {
              const std::int64_t j = k - slab0;  // index within the slab
              const std::int64_t i2 = j % count[2], i1 = (j / count[2]) % count[1],
                                 i0 = j / (count[2] * count[1]);
              const std::int64_t g =
                  ((start[0] + i0) * gshape[1] + (start[1] + i1)) * gshape[2] + (start[2] + i2);
              dst(k + shift) = T(stddev * rng::normal(seed, stream, std::uint64_t(g)));
            });
      }
      base += s.numel();
    }
  }
  Kokkos::fence();
}

template <class T>
void GPT<T>::zero_grads() {
  profile::region("zero-fill", [&] { K::fill(resident().all_grads(), T(0)); });
}

template <class T>
bool GPT<T>::sequence_parallel() const {
  return config_.parallel.sequence_parallel && coord_.T > 1;
}

// x (R, C) [=] this rank's token rows of the tp sum of full (BT, C) (sequence parallel), or
// full summed in place and x = full.
template <class T>
void GPT<T>::tp_sum_to_rows(const K::Vec<T>& full, const K::Vec<T>& x) {
  if (!tp_ || tp_->size() == 1) return;
  if (!sequence_parallel()) return tp_sum(full);
  const std::vector<int> counts(std::size_t(tp_->size()), int(x.extent(0)));
  tp_->reduce_scatter_sum(full.data(), x.data(), counts).wait();
}

// full (BT, C) [=] the token rows of every tp rank, this rank's already in place.
template <class T>
void GPT<T>::tp_gather_rows(const K::Vec<T>& full) {
  if (!sequence_parallel()) return;
  const int n = int(full.extent(0)) / tp_->size();
  const std::vector<int> counts(std::size_t(tp_->size()), n);
  tp_->all_gather(full.data() + std::size_t(coord_.t) * n, full.data(), counts).wait();
}

template <class T>
double GPT<T>::forward(const std::int32_t* inputs, const std::int32_t* targets, int B,
                       bool for_backward) {
  PTRAIN_REQUIRE(B >= 1 && B <= micro_batch_, "model: micro-batch of ", B,
                 " samples exceeds the allocated ", micro_batch_);
  B_ = B;
  const int S = int(dims_.S), C = int(dims_.C), NH = int(dims_.NH / coord_.T);
  const int HS = int(dims_.HS), Cl = NH * HS, Fl = int(dims_.F / coord_.T);
  const int BT = B * S, Vl = int(dims_.Vpad / coord_.T);
  const bool sp = sequence_parallel();
  const int R = sp ? BT / coord_.T : BT, r0 = sp ? coord_.t * R : 0;  // residual rows kept here
  const auto act = activation_sizes(dims_, coord_, micro_batch_, S, layout_.has_head, sp);
  static_assert(sizeof(int) == sizeof(std::int32_t));
  Kokkos::deep_copy(
      slice<int>(tokens_, 0, BT),
      Kokkos::View<const int*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(inputs, BT));
  Kokkos::deep_copy(
      slice<int>(targets_, 0, BT),
      Kokkos::View<const int*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(targets, BT));
  const K::IntVec tok = slice<int>(tokens_, 0, BT), tgt = slice<int>(targets_, 0, BT);
  const K::IntVec no_positions;
  // A (BT, C) buffer for the tp partial sums before they are reduced (the backward's
  // scratch is free during the forward).
  const K::Vec<T> partial = slice(scratch_.view(), 0, std::int64_t(BT) * C);

  // x: (R, C), the residual stream entering block 0.
  Carver<T> out{slice(acts_.view(), act.per_layer * layout_.n_layers, act.outside)};
  K::Vec<T> x = out.take(std::int64_t(R) * C);
  // The embedding unit stays available to the tied LM head and, when training, to the
  // backward; every other unit is released as soon as it is used.
  const K::Vec<T> emb = store_->params(u_emb_);
  const K::Vec<T> wte = tensor(emb, u_emb_, "wte.weight");
  // Vocab-parallel: each tp rank embeds the tokens of its vocabulary rows, rank 0 adds the
  // positions, the sum over tp is the embedding.
  const bool tp_root = coord_.t == 0;
  const int v_begin = coord_.t * Vl;
  const K::Vec<T> embedded = sp ? partial : x;
  profile::region("embedding", [&] {
    K::encoder_forward(embedded, tok, no_positions, K::CVec<T>(wte),
                       tp_root ? K::CVec<T>(tensor(emb, u_emb_, "wpe.weight")) : K::CVec<T>(), B, S,
                       C, v_begin, Vl);
  });
  profile::region("tp-comm", [&] { tp_sum_to_rows(embedded, x); });

  for (int l = 0; l < layout_.n_layers; ++l) {
    const int unit = u_block0_ + l;
    const Block w = block_views(store_->params(unit), unit);
    const BlockActs<T> a =
        carve_block(slice(acts_.view(), act.per_layer * l, act.per_layer), BT, R, C, Cl, NH, Fl);
    // ln1 = LN(x) on this rank's rows, gathered; qkv = ln1 W_qkv^T + b; atty = attention(qkv)
    const K::Vec<T> ln1_mine = slice(a.ln1, std::int64_t(r0) * C, std::int64_t(R) * C);
    profile::region("layernorm", [&] {
      K::layernorm_forward<T>(ln1_mine, a.ln1_mean, a.ln1_rstd, x, w.ln1_w, w.ln1_b, R, C);
    });
    profile::region("tp-comm", [&] { tp_gather_rows(a.ln1); });
    profile::region("matmul",
                    [&] { K::matmul_forward<T>(a.qkv, a.ln1, w.qkv_w, w.qkv_b, BT, C, 3 * Cl); });
    profile::region("attention",
                    [&] { K::attention_forward<T>(a.atty, a.lse, a.qkv, B, S, NH, HS); });
    // Row-parallel: partial sums over this rank's heads, the bias added once (tp rank 0),
    // reduced over tp (all-reduce, or reduce-scatter to the token shard); res2 = x + that.
    const K::Vec<T> proj = sp ? partial : a.res2;
    profile::region("matmul", [&] {
      K::matmul_forward<T>(proj, a.atty, w.proj_w, tp_root ? w.proj_b : K::Vec<T>(), BT, Cl, C);
    });
    profile::region("tp-comm", [&] { tp_sum_to_rows(proj, a.res2); });
    profile::region("residual", [&] { K::axpy<T>(a.res2, T(1), x); });
    // ln2 = LN(res2), gathered; fch = ln2 W_fc^T + b; res3 = res2 + gelu(fch) W_proj^T + b
    const K::Vec<T> ln2_mine = slice(a.ln2, std::int64_t(r0) * C, std::int64_t(R) * C);
    profile::region("layernorm", [&] {
      K::layernorm_forward<T>(ln2_mine, a.ln2_mean, a.ln2_rstd, a.res2, w.ln2_w, w.ln2_b, R, C);
    });
    profile::region("tp-comm", [&] { tp_gather_rows(a.ln2); });
    profile::region("matmul",
                    [&] { K::matmul_forward<T>(a.fch, a.ln2, w.fc_w, w.fc_b, BT, C, Fl); });
    profile::region("gelu", [&] { K::gelu_forward<T>(a.fch_gelu, a.fch, std::size_t(BT) * Fl); });
    const K::Vec<T> mlp = sp ? partial : a.res3;
    profile::region("matmul", [&] {
      K::matmul_forward<T>(mlp, a.fch_gelu, w.fcproj_w, tp_root ? w.fcproj_b : K::Vec<T>(), BT, Fl,
                           C);
    });
    profile::region("tp-comm", [&] { tp_sum_to_rows(mlp, a.res3); });
    profile::region("residual", [&] { K::axpy<T>(a.res3, T(1), a.res2); });
    x = a.res3;
    store_->release_params(unit);
  }

  // Head: lnf = LN(x), gathered; logits = lnf wte^T (the tied embedding); cross-entropy.
  auto lnf = out.take(std::int64_t(BT) * C), lnf_mean = out.take(R), lnf_rstd = out.take(R);
  auto logits = out.take(std::int64_t(BT) * Vl), losses = out.take(BT);
  auto row_max = out.take(BT), sumexp = out.take(BT), target_logit = out.take(BT);
  const K::Vec<T> head = store_->params(u_head_);
  profile::region("layernorm", [&] {
    K::layernorm_forward<T>(slice(lnf, std::int64_t(r0) * C, std::int64_t(R) * C), lnf_mean,
                            lnf_rstd, x, tensor(head, u_head_, "ln_f.weight"),
                            tensor(head, u_head_, "ln_f.bias"), R, C);
  });
  profile::region("tp-comm", [&] { tp_gather_rows(lnf); });
  profile::region("matmul",
                  [&] { K::matmul_forward<T>(logits, lnf, wte, K::CVec<T>(), BT, C, Vl); });
  // Vocab-parallel cross-entropy: no rank holds the full logits; the row max and then the
  // sum of exponentials and the target's logit are reduced over tp.
  const K::VocabShard shard{v_begin, Vl, int(dims_.V)};
  profile::region("crossentropy", [&] { K::crossentropy_row_max<T>(row_max, logits, BT, shard); });
  profile::region("tp-comm", [&] {
    if (tp_ && tp_->size() > 1) tp_->all_reduce_max(row_max.data(), row_max.extent(0)).wait();
  });
  profile::region("crossentropy", [&] {
    K::crossentropy_row_sumexp<T>(sumexp, target_logit, logits, row_max, tgt, BT, shard);
  });
  // sumexp and target_logit are adjacent: one reduction for both.
  profile::region("tp-comm", [&] {
    tp_sum(slice(acts_.view(), sumexp.data() - acts_.data(), 2 * std::int64_t(BT)));
  });
  profile::region("crossentropy",
                  [&] { K::crossentropy_loss<T>(losses, row_max, sumexp, target_logit, BT); });
  double sum = 0;
  Kokkos::parallel_reduce(
      "ptrain::loss_sum", Kokkos::RangePolicy<>(0, BT),
      KOKKOS_LAMBDA(const int i, double& s) { s += double(losses(i)); }, sum);
  store_->release_params(u_head_);
  if (!for_backward) store_->release_params(u_emb_);
  last_loss_sum_ = sum;
  return sum;
}

template <class T>
void GPT<T>::backward(T dloss) {
  const int B = B_, S = int(dims_.S), C = int(dims_.C), NH = int(dims_.NH / coord_.T);
  const int HS = int(dims_.HS), Cl = NH * HS, Fl = int(dims_.F / coord_.T);
  const int BT = B * S, Vl = int(dims_.Vpad / coord_.T);
  const bool sp = sequence_parallel();
  const int R = sp ? BT / coord_.T : BT, r0 = sp ? coord_.t * R : 0;
  const auto act = activation_sizes(dims_, coord_, micro_batch_, S, layout_.has_head, sp);
  const K::IntVec tok = slice<int>(tokens_, 0, BT), tgt = slice<int>(targets_, 0, BT);
  const K::IntVec no_positions;

  Carver<T> out{slice(acts_.view(), act.per_layer * layout_.n_layers, act.outside)};
  K::Vec<T> encoded = out.take(std::int64_t(R) * C);
  auto lnf = out.take(std::int64_t(BT) * C), lnf_mean = out.take(R), lnf_rstd = out.take(R);
  auto logits = out.take(std::int64_t(BT) * Vl);
  out.take(BT);  // losses
  auto row_max = out.take(BT), sumexp = out.take(BT);

  // dres: d(residual stream), this rank's R rows. dln: d(LayerNorm out) over all BT rows.
  Carver<T> s{scratch_.view()};
  auto dres = s.take(std::int64_t(BT) * C), dln = s.take(std::int64_t(BT) * C);
  auto dgelu = s.take(std::int64_t(BT) * Fl), dfch = s.take(std::int64_t(BT) * Fl);
  auto datty = s.take(std::int64_t(BT) * Cl), dqkv = s.take(std::int64_t(BT) * 3 * Cl);
  // Sequence parallel: d(residual) gathered over tp, and one micro-batch's LayerNorm
  // parameter gradients (partial over the token shards until summed over tp).
  const K::Vec<T> dfull = sp ? s.take(std::int64_t(BT) * C) : dres;
  const K::Vec<T> dnorm = sp ? s.take(2 * std::int64_t(C)) : K::Vec<T>();
  dres = slice(dres, 0, std::int64_t(R) * C);

  // d(LN out) over all rows -> this rank's rows of its tp sum (all-reduce in place, or
  // reduce-scatter into dfull, which is free until the next gathered_dres()).
  auto reduce_dln = [&]() -> K::Vec<T> {
    const K::Vec<T> rows = sp ? slice(dfull, 0, std::int64_t(R) * C) : dln;
    tp_sum_to_rows(dln, rows);
    return rows;
  };
  // LayerNorm backward on this rank's rows: dres += LN'(dy); d(weight), d(bias) accumulated —
  // under sequence parallelism from a partial that is first summed over tp.
  auto layernorm_backward = [&](const K::Vec<T>& dy, const K::Vec<T>& inp, const K::Vec<T>& weight,
                                const K::Vec<T>& mean, const K::Vec<T>& rstd,
                                const K::Vec<T>& dweight, const K::Vec<T>& dbias) {
    if (!sp) {
      profile::region("layernorm", [&] {
        K::layernorm_backward<T>(dres, dweight, dbias, dy, inp, weight, mean, rstd, R, C);
      });
      return;
    }
    auto dw = slice(dnorm, 0, C), db = slice(dnorm, C, C);
    profile::region("layernorm", [&] {
      K::fill(dnorm, T(0));
      K::layernorm_backward<T>(dres, dw, db, dy, inp, weight, mean, rstd, R, C);
    });
    profile::region("tp-comm", [&] { tp_sum(dnorm); });
    K::axpy<T>(dweight, T(1), dw);
    K::axpy<T>(dbias, T(1), db);
  };
  // d(residual) of every token (the row-parallel layers' backward needs all rows).
  auto gathered_dres = [&]() -> K::Vec<T> {
    if (!sp) return dres;
    K::copy<T>(slice(dfull, std::int64_t(r0) * C, std::int64_t(R) * C), dres);
    profile::region("tp-comm", [&] { tp_gather_rows(dfull); });
    return dfull;
  };

  // Residual stream input of block l: block l-1's res3, or the embedding output.
  auto block_input = [&](int l) -> K::Vec<T> {
    if (l == 0) return encoded;
    const std::int64_t res3_offset = act.per_layer - std::int64_t(R) * C;
    return slice(acts_.view(), act.per_layer * (l - 1) + res3_offset, std::int64_t(R) * C);
  };

  // Head: dlogits in place; dlnf = dlogits wte; dwte += dlogits^T lnf; dx = LN'(dlnf).
  // The embedding unit is still held from the forward; its gradients complete only after
  // the embedding backward, at the very end.
  const K::Vec<T> emb = store_->params(u_emb_), demb = store_->grads(u_emb_);
  const K::Vec<T> head = store_->params(u_head_), dhead = store_->grads(u_head_);
  const K::VocabShard shard{int(coord_.t * Vl), Vl, int(dims_.V)};
  profile::region("crossentropy", [&] {
    K::crossentropy_backward<T>(logits, row_max, sumexp, tgt, BT, shard, dloss);
  });
  profile::region("zero-fill", [&] { K::fill(dln, T(0)); });
  profile::region("matmul", [&] {
    K::matmul_backward<T>(dln, tensor(demb, u_emb_, "wte.weight"), K::Vec<T>(), logits, lnf,
                          tensor(emb, u_emb_, "wte.weight"), BT, C, Vl);
  });
  K::Vec<T> dy;
  profile::region("tp-comm", [&] { dy = reduce_dln(); });  // partial over vocabulary shards
  profile::region("zero-fill", [&] { K::fill(dres, T(0)); });
  layernorm_backward(dy, block_input(int(layout_.n_layers)), tensor(head, u_head_, "ln_f.weight"),
                     lnf_mean, lnf_rstd, tensor(dhead, u_head_, "ln_f.weight"),
                     tensor(dhead, u_head_, "ln_f.bias"));
  store_->release_params(u_head_);
  store_->grads_done(u_head_);

  for (int l = int(layout_.n_layers) - 1; l >= 0; --l) {
    const int unit = u_block0_ + l;
    const Block w = block_views(store_->params(unit), unit);
    const Block g = block_views(store_->grads(unit), unit);
    const BlockActs<T> a =
        carve_block(slice(acts_.view(), act.per_layer * l, act.per_layer), BT, R, C, Cl, NH, Fl);
    // dres holds d(res3). MLP branch, then d(res2) = d(res3) + LN2'(...).
    K::Vec<T> dout = gathered_dres();
    profile::region("zero-fill", [&] { K::fill(dgelu, T(0)); });
    profile::region("matmul", [&] {
      K::matmul_backward<T>(dgelu, g.fcproj_w, g.fcproj_b, dout, a.fch_gelu, w.fcproj_w, BT, Fl, C);
    });
    profile::region("zero-fill", [&] { K::fill(dfch, T(0)); });
    profile::region("gelu", [&] { K::gelu_backward<T>(dfch, a.fch, dgelu, std::size_t(BT) * Fl); });
    profile::region("zero-fill", [&] { K::fill(dln, T(0)); });
    profile::region("matmul", [&] {
      K::matmul_backward<T>(dln, g.fc_w, g.fc_b, dfch, a.ln2, w.fc_w, BT, C, Fl);
    });
    profile::region("tp-comm", [&] { dy = reduce_dln(); });  // column-parallel input gradient
    layernorm_backward(dy, a.res2, w.ln2_w, a.ln2_mean, a.ln2_rstd, g.ln2_w, g.ln2_b);
    // Attention branch, then d(x) = d(res2) + LN1'(...).
    dout = gathered_dres();
    profile::region("zero-fill", [&] { K::fill(datty, T(0)); });
    profile::region("matmul", [&] {
      K::matmul_backward<T>(datty, g.proj_w, g.proj_b, dout, a.atty, w.proj_w, BT, Cl, C);
    });
    profile::region("attention", [&] {
      K::attention_backward<T>(dqkv, datty, a.atty, a.lse, a.qkv, B, S, NH, HS);
    });
    profile::region("zero-fill", [&] { K::fill(dln, T(0)); });
    profile::region("matmul", [&] {
      K::matmul_backward<T>(dln, g.qkv_w, g.qkv_b, dqkv, a.ln1, w.qkv_w, BT, C, 3 * Cl);
    });
    profile::region("tp-comm", [&] { dy = reduce_dln(); });
    layernorm_backward(dy, block_input(l), w.ln1_w, a.ln1_mean, a.ln1_rstd, g.ln1_w, g.ln1_b);
    store_->release_params(unit);
    store_->grads_done(unit);
  }
  const K::Vec<T> dembedded = gathered_dres();
  profile::region("embedding", [&] {
    K::encoder_backward<T>(tensor(demb, u_emb_, "wte.weight"), tensor(demb, u_emb_, "wpe.weight"),
                           dembedded, tok, no_positions, B, S, C, int(coord_.t * Vl), Vl);
  });
  store_->release_params(u_emb_);
  store_->grads_done(u_emb_);
}

template class ResidentStore<float>;
template class ResidentStore<double>;
template class GPT<float>;
template class GPT<double>;

}  // namespace ptrain::model
