#include "model/layers.hpp"

#include <vector>

#include "kernels/gemm.hpp"
#include "util/error.hpp"
#include "util/profile.hpp"

namespace ptrain::model {

namespace K = kernels;

namespace {

using kernels::slice;

// d(output) rows (R, n) of every token: gathered into `full` (BT, n) under SP, else as given.
template <class T>
Vec<T> all_rows(const Ctx& c, const Vec<T>& rows, const Vec<T>& full, int n) {
  if (!c.tp->sp()) return rows;
  K::copy<T>(own_rows(c, full, n), rows);
  c.tp->gather_rows(full);
  return full;
}

}  // namespace

template <class T>
Vec<T> own_rows(const Ctx& c, const Vec<T>& full, std::int64_t C) {
  return slice(full, c.r0 * C, c.R * C);
}

// ---- TensorParallel ----------------------------------------------------------------

TensorParallel::TensorParallel(Comm* tp, bool sequence_parallel)
    : comm_(tp && tp->size() > 1 ? tp : nullptr) {
  if (!comm_) return;
  rank_ = comm_->rank();
  size_ = comm_->size();
  sp_ = sequence_parallel;
}

template <class T>
void TensorParallel::sum(const Vec<T>& x) const {
  if (!comm_) return;
  profile::region("tp-comm", [&] { comm_->all_reduce_sum(x.data(), x.extent(0)).wait(); });
}

template <class T>
void TensorParallel::max(const Vec<T>& x) const {
  if (!comm_) return;
  profile::region("tp-comm", [&] { comm_->all_reduce_max(x.data(), x.extent(0)).wait(); });
}

template <class T>
void TensorParallel::sum_to_rows(const Vec<T>& full, const Vec<T>& rows) const {
  if (!comm_) return;
  if (!sp_) return sum(full);
  const std::vector<int> counts(std::size_t(size_), int(rows.extent(0)));
  profile::region("tp-comm",
                  [&] { comm_->reduce_scatter_sum(full.data(), rows.data(), counts).wait(); });
}

template <class T>
void TensorParallel::gather_rows(const Vec<T>& full) const {
  if (!sp_) return;
  const int n = int(full.extent(0)) / size_;
  const std::vector<int> counts(std::size_t(size_), n);
  profile::region("tp-comm", [&] {
    comm_->all_gather(full.data() + std::size_t(rank_) * n, full.data(), counts).wait();
  });
}

// ---- LayerNorm ---------------------------------------------------------------------

template <class P>
void LayerNorm<P>::forward(const Ctx& c, CVec<T> x, Vec<T> out, Vec<A> mean, Vec<A> rstd) const {
  profile::region("layernorm",
                  [&] { K::layernorm_forward<T>(out, mean, rstd, x, w, b, int(c.R), C); });
}

template <class P>
void LayerNorm<P>::backward(const Ctx& c, CVec<T> x, CVec<A> mean, CVec<A> rstd, CVec<T> dout,
                            Vec<T> dx, Vec<G> scratch) const {
  if (!c.tp->sp()) {
    profile::region("layernorm", [&] {
      K::layernorm_backward<T, G>(dx, dw, db, dout, x, w, mean, rstd, int(c.R), C);
    });
    return;
  }
  const auto dw_part = slice(scratch, 0, C), db_part = slice(scratch, C, C);
  profile::region("layernorm", [&] {
    K::fill(scratch, G(0));
    K::layernorm_backward<T, G>(dx, dw_part, db_part, dout, x, w, mean, rstd, int(c.R), C);
  });
  c.tp->sum(scratch);
  K::axpy<G>(dw, 1, dw_part);
  K::axpy<G>(db, 1, db_part);
}

template <class P>
void LayerNorm<P>::backward_input(const Ctx& c, CVec<T> x, CVec<A> mean, CVec<A> rstd, CVec<T> dout,
                                  Vec<T> dx, Vec<G> sums) const {
  const auto dw_part = slice(sums, 0, C), db_part = slice(sums, C, C);
  profile::region("layernorm", [&] {
    K::fill(sums, G(0));
    K::layernorm_backward<T, G>(dx, dw_part, db_part, dout, x, w, mean, rstd, int(c.R), C);
  });
  if (c.tp->sp()) c.tp->sum(sums);
}

template <class P>
void LayerNorm<P>::backward_weight(CVec<G> sums) const {
  K::axpy<G>(dw, 1, slice(sums, 0, C));
  K::axpy<G>(db, 1, slice(sums, C, C));
}

// ---- tensor-parallel linear layers -------------------------------------------------------

template <class P>
void ColumnParallelLinear<P>::forward(const Ctx& c, Vec<T> x, Vec<T> y) const {
  c.tp->gather_rows(x);
  profile::region("matmul", [&] { K::matmul_forward<T>(y, x, w, b, int(c.BT), in, out); });
}

template <class P>
auto ColumnParallelLinear<P>::backward(const Ctx& c, CVec<T> x, CVec<T> dy, Vec<T> dx,
                                       Vec<T> rows) const -> Vec<T> {
  profile::region("matmul",
                  [&] { K::matmul_backward<T, G>(dx, dw, db, dy, x, w, int(c.BT), in, out); });
  const Vec<T> mine = c.tp->sp() ? rows : dx;
  c.tp->sum_to_rows(dx, mine);
  return mine;
}

template <class P>
auto ColumnParallelLinear<P>::backward_input(const Ctx& c, CVec<T> dy, Vec<T> dx, Vec<T> rows) const
    -> Vec<T> {
  profile::region("matmul",
                  [&] { K::matmul_backward<T, G>(dx, {}, {}, dy, {}, w, int(c.BT), in, out); });
  const Vec<T> mine = c.tp->sp() ? rows : dx;
  c.tp->sum_to_rows(dx, mine);
  return mine;
}

template <class P>
void ColumnParallelLinear<P>::backward_weight(const Ctx& c, CVec<T> x, CVec<T> dy) const {
  profile::region("matmul",
                  [&] { K::matmul_backward<T, G>({}, dw, db, dy, x, w, int(c.BT), in, out); });
}

template <class P>
void RowParallelLinear<P>::forward(const Ctx& c, CVec<T> x, Vec<T> partial, Vec<T> y) const {
  const Vec<T> p = c.tp->sp() ? partial : y;
  const Vec<T> bias = c.tp->rank() == 0 ? b : Vec<T>();
  profile::region("matmul", [&] { K::matmul_forward<T>(p, x, w, bias, int(c.BT), in, out); });
  c.tp->sum_to_rows(p, y);
}

template <class P>
void RowParallelLinear<P>::backward(const Ctx& c, CVec<T> x, Vec<T> dy, Vec<T> full,
                                    Vec<T> dx) const {
  const Vec<T> d = all_rows(c, dy, full, out);
  profile::region("matmul",
                  [&] { K::matmul_backward<T, G>(dx, dw, db, d, x, w, int(c.BT), in, out); });
}

template <class P>
void RowParallelLinear<P>::backward_input(const Ctx& c, Vec<T> dy, Vec<T> full, Vec<T> dx) const {
  const Vec<T> d = all_rows(c, dy, full, out);
  profile::region("matmul",
                  [&] { K::matmul_backward<T, G>(dx, {}, {}, d, {}, w, int(c.BT), in, out); });
}

template <class P>
void RowParallelLinear<P>::backward_weight(const Ctx& c, CVec<T> x, Vec<T> dy, Vec<T> full) const {
  const Vec<T> d = all_rows(c, dy, full, out);
  profile::region("matmul",
                  [&] { K::matmul_backward<T, G>({}, dw, db, d, x, w, int(c.BT), in, out); });
}

// ---- attention, MLP ------------------------------------------------------------------------

template <class P>
void Attention<P>::forward(const Ctx& c, CVec<T> qkv, Vec<T> out, Vec<A> lse) const {
  if (c.ring()) return ring_attention_forward<T>(*c.cp, c.B, NH, HS, qkv, out, lse);
  profile::region("attention", [&] { K::attention_forward<T>(out, lse, qkv, c.B, c.S, NH, HS); });
}

template <class P>
void Attention<P>::backward(const Ctx& c, CVec<T> qkv, CVec<T> out, CVec<A> lse, CVec<T> dout,
                            Vec<T> dqkv) const {
  if (c.ring()) return ring_attention_backward<T>(*c.cp, c.B, NH, HS, qkv, out, lse, dout, dqkv);
  profile::region("attention",
                  [&] { K::attention_backward<T>(dqkv, dout, out, lse, qkv, c.B, c.S, NH, HS); });
}

template <class P>
void MLP<P>::forward(const Ctx& c, Vec<T> x, const Acts& a, Vec<T> partial, Vec<T> y) const {
  fc.forward(c, x, a.fch);
  profile::region("gelu", [&] { K::gelu_forward<T>(a.fch_gelu, a.fch, a.fch.extent(0)); });
  proj.forward(c, a.fch_gelu, partial, y);
}

template <class P>
auto MLP<P>::backward(const Ctx& c, CVec<T> x, const Acts& a, Vec<T> dy, const Grads& g,
                      Vec<T> full, Vec<T> dx, Vec<T> rows) const -> Vec<T> {
  proj.backward(c, a.fch_gelu, dy, full, g.dgelu);
  profile::region("gelu", [&] { K::gelu_backward<T>(g.dfch, a.fch, g.dgelu, a.fch.extent(0)); });
  return fc.backward(c, x, g.dfch, dx, rows);
}

// ---- embedding and head --------------------------------------------------------------------

template <class P>
void Embedding<P>::forward(const Ctx& c, K::IntVec tokens, Vec<T> partial, Vec<T> x) const {
  const Vec<T> out = c.tp->sp() ? partial : x;
  const K::IntVec positions = c.cp ? c.cp->positions() : K::IntVec();
  profile::region("embedding", [&] {
    K::encoder_forward<T>(out, tokens, positions, wte, c.tp->rank() == 0 ? wpe : Vec<T>(), c.B, c.S,
                          C, v_begin, Vl);
  });
  c.tp->sum_to_rows(out, x);
}

template <class P>
void Embedding<P>::backward(const Ctx& c, K::IntVec tokens, Vec<T> dx, Vec<T> full) const {
  const Vec<T> d = all_rows(c, dx, full, C);
  const K::IntVec positions = c.cp ? c.cp->positions() : K::IntVec();
  profile::region("embedding", [&] {
    K::encoder_backward<T, G>(dwte, dwpe, d, tokens, positions, c.B, c.S, C, v_begin, Vl);
  });
}

template <class P>
double Head<P>::forward(const Ctx& c, CVec<T> x, const Acts& a, K::IntVec targets) const {
  const int BT = int(c.BT);
  const K::VocabShard shard{c.tp->rank() * lm.out, lm.out, v_real};
  const auto sumexp = slice(a.sums, 0, BT), target_logit = slice(a.sums, BT, BT);
  lnf.forward(c, x, own_rows(c, a.lnf, lnf.C), a.lnf_mean, a.lnf_rstd);
  lm.forward(c, a.lnf, a.logits);
  profile::region("crossentropy",
                  [&] { K::crossentropy_row_max<T>(a.row_max, a.logits, BT, shard); });
  c.tp->max(a.row_max);
  profile::region("crossentropy", [&] {
    K::crossentropy_row_sumexp<T>(sumexp, target_logit, a.logits, a.row_max, targets, BT, shard);
  });
  c.tp->sum(a.sums);
  profile::region("crossentropy",
                  [&] { K::crossentropy_loss<T>(a.losses, a.row_max, sumexp, target_logit, BT); });
  double sum = 0;
  const Vec<A> losses = a.losses;
  Kokkos::parallel_reduce(
      "ptrain::loss_sum", Kokkos::RangePolicy<>(0, BT),
      KOKKOS_LAMBDA(const int i, double& s) { s += double(losses(i)); }, sum);
  return sum;
}

template <class P>
void Head<P>::backward(const Ctx& c, CVec<T> x, const Acts& a, K::IntVec targets, A dloss,
                       Vec<T> dx, Vec<T> dln, Vec<T> rows, Vec<G> norm_scratch) const {
  const K::VocabShard shard{c.tp->rank() * lm.out, lm.out, v_real};
  profile::region("crossentropy", [&] {
    K::crossentropy_backward<T>(a.logits, a.row_max, slice(a.sums, 0, c.BT), targets, int(c.BT),
                                shard, dloss);
  });
  const Vec<T> dy = lm.backward(c, a.lnf, a.logits, dln, rows);  // partial over vocab shards
  profile::region("zero-fill", [&] { K::fill(dx, T(0)); });
  lnf.backward(c, x, a.lnf_mean, a.lnf_rstd, dy, dx, norm_scratch);
}

// ---- Block ---------------------------------------------------------------------------------

template <class P>
void Block<P>::forward(const Ctx& c, CVec<T> x, const Acts& a, Vec<T> partial) const {
  const int C = ln1.C;
  ln1.forward(c, x, own_rows(c, a.ln1, C), a.ln1_mean, a.ln1_rstd);
  qkv.forward(c, a.ln1, a.qkv);
  attn.forward(c, a.qkv, a.atty, a.lse);
  proj.forward(c, a.atty, partial, a.res2);
  profile::region("residual", [&] { K::axpy<T>(a.res2, A(1), x); });
  ln2.forward(c, a.res2, own_rows(c, a.ln2, C), a.ln2_mean, a.ln2_rstd);
  if (routing)
    moe.forward(c, a.ln2, a.moe, *routing, partial, a.res3);
  else
    mlp.forward(c, a.ln2, a.mlp, partial, a.res3);
  profile::region("residual", [&] { K::axpy<T>(a.res3, A(1), a.res2); });
}

template <class P>
void Block<P>::backward(const Ctx& c, CVec<T> x, const Acts& a, const Grads& g) const {
  // Under SP the reduced d(LayerNorm out) rows land in dfull, free until its next gather.
  const Vec<T> rows = c.tp->sp() ? slice(g.dfull, 0, c.R * ln1.C) : g.dln;
  // g.dres holds d(res3): the MLP branch, then d(res2) = d(res3) + LN2'(...).
  Vec<T> dy = routing ? moe.backward(c, a.ln2, a.moe, *routing, g.dres, g.moe, g.dfull, g.dln, rows)
                      : mlp.backward(c, a.ln2, a.mlp, g.dres, g.mlp, g.dfull, g.dln, rows);
  ln2.backward(c, a.res2, a.ln2_mean, a.ln2_rstd, dy, g.dres, g.dnorm);
  // The attention branch, then d(x) = d(res2) + LN1'(...).
  proj.backward(c, a.atty, g.dres, g.dfull, g.datty);
  attn.backward(c, a.qkv, a.atty, a.lse, g.datty, g.dqkv);
  dy = qkv.backward(c, a.ln1, g.dqkv, g.dln, rows);
  ln1.backward(c, x, a.ln1_mean, a.ln1_rstd, dy, g.dres, g.dnorm);
}

template <class P>
void Block<P>::backward_input(const Ctx& c, CVec<T> x, const Acts& a, const Grads& g,
                              const WeightGrads& w) const {
  PTRAIN_REQUIRE(!routing, "model: a MoE block's backward does not split (internal)");
  const int C = ln1.C;
  const Vec<T> rows = c.tp->sp() ? slice(g.dfull, 0, c.R * C) : g.dln;
  // The MLP branch as in backward, its output gradient d(res3) and d(fch) kept. d(res3) goes
  // first: the LayerNorm below adds into g.dres.
  K::copy<T>(w.dres3, g.dres);
  mlp.proj.backward_input(c, g.dres, g.dfull, g.mlp.dgelu);
  profile::region("gelu", [&] {
    K::gelu_backward<T>(g.mlp.dfch, a.mlp.fch, g.mlp.dgelu, a.mlp.fch.extent(0));
  });
  K::copy<T>(w.dfch, g.mlp.dfch);  // after the GELU's backward: w.dfch may be a.mlp.fch
  Vec<T> dy = mlp.fc.backward_input(c, g.mlp.dfch, g.dln, rows);
  ln2.backward_input(c, a.res2, a.ln2_mean, a.ln2_rstd, dy, g.dres, w.ln2);
  K::copy<T>(w.dres2, g.dres);  // after LN2's backward: w.dres2 may be a.res2
  // The attention branch; d(qkv) kept once the attention's backward has read qkv.
  proj.backward_input(c, g.dres, g.dfull, g.datty);
  attn.backward(c, a.qkv, a.atty, a.lse, g.datty, g.dqkv);
  K::copy<T>(w.dqkv, g.dqkv);
  dy = qkv.backward_input(c, g.dqkv, g.dln, rows);
  ln1.backward_input(c, x, a.ln1_mean, a.ln1_rstd, dy, g.dres, w.ln1);
}

template <class P>
void Block<P>::backward_weight(const Ctx& c, const Acts& a, const Grads& g,
                               const WeightGrads& w) const {
  mlp.proj.backward_weight(c, a.mlp.fch_gelu, w.dres3, g.dfull);
  mlp.fc.backward_weight(c, a.ln2, w.dfch);
  ln2.backward_weight(w.ln2);
  proj.backward_weight(c, a.atty, w.dres2, g.dfull);
  qkv.backward_weight(c, a.ln1, w.dqkv);
  ln1.backward_weight(w.ln1);
}

template <class P>
void Block<P>::recompute(const Ctx& c, CVec<T> x, const Acts& a, Recompute mode,
                         Vec<T> partial) const {
  if (mode == Recompute::full) return forward(c, x, a, partial);
  if (mode != Recompute::selective) return;
  const int C = ln1.C;
  ln1.forward(c, x, own_rows(c, a.ln1, C), a.ln1_mean, a.ln1_rstd);
  c.tp->gather_rows(a.ln1);
  attn.forward(c, a.qkv, a.atty, a.lse);
  ln2.forward(c, a.res2, own_rows(c, a.ln2, C), a.ln2_mean, a.ln2_rstd);
  c.tp->gather_rows(a.ln2);
  if (!routing)
    profile::region("gelu",
                    [&] { K::gelu_forward<T>(a.mlp.fch_gelu, a.mlp.fch, a.mlp.fch.extent(0)); });
}

#define PTRAIN_LAYERS_INSTANTIATE(T)                                                \
  template void TensorParallel::sum<T>(const Vec<T>&) const;                        \
  template void TensorParallel::max<T>(const Vec<T>&) const;                        \
  template void TensorParallel::sum_to_rows<T>(const Vec<T>&, const Vec<T>&) const; \
  template void TensorParallel::gather_rows<T>(const Vec<T>&) const;                \
  template Vec<T> own_rows<T>(const Ctx&, const Vec<T>&, std::int64_t);
PTRAIN_LAYERS_INSTANTIATE(float)
PTRAIN_LAYERS_INSTANTIATE(double)
PTRAIN_LAYERS_INSTANTIATE(bf16)
#undef PTRAIN_LAYERS_INSTANTIATE

#define PTRAIN_LAYERS_INSTANTIATE(P)       \
  template struct LayerNorm<P>;            \
  template struct ColumnParallelLinear<P>; \
  template struct RowParallelLinear<P>;    \
  template struct Attention<P>;            \
  template struct MLP<P>;                  \
  template struct Embedding<P>;            \
  template struct Head<P>;                 \
  template struct Block<P>;
PTRAIN_LAYERS_INSTANTIATE(Fp32)
PTRAIN_LAYERS_INSTANTIATE(Fp64)
PTRAIN_LAYERS_INSTANTIATE(Bf16)
PTRAIN_LAYERS_INSTANTIATE(Bf16Grads)
#undef PTRAIN_LAYERS_INSTANTIATE

}  // namespace ptrain::model
