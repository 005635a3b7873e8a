// model/layers.hpp — the GPT's layers on one rank's shard (docs/ARCHITECTURE.md, "The model"), each
// with forward and backward written by hand (llm.c). A layer holds views of its parameters
// and gradients (empty gradients for a forward-only use) and owns the tensor-parallel
// collective it needs together with that collective's backward dual:
//
//   ColumnParallelLinear  forward: identity (SP: all-gather rows)  backward: all-reduce (SP:
//   reduce-scatter) RowParallelLinear     forward: all-reduce (SP: reduce-scatter) backward:
//   identity (SP: all-gather rows) Embedding             vocab-parallel rows, summed over tp like a
//   row-parallel output Head                  tied LM head (column-parallel, no bias) +
//   vocab-parallel cross-entropy
//
// Shapes: BT tokens of the micro-batch (B samples of S positions), R = rows of the residual
// stream kept on this rank (BT, or BT/tp with sequence parallelism, starting at row r0),
// C width, Cl = C/tp, Fl = F/tp, Vl = padded vocab/tp. Outputs: [=] overwritten, [+=] added.
#pragma once
#include <cstdint>

#include "comm/comm.hpp"
#include "kernels/attention.hpp"
#include "kernels/kernels.hpp"
#include "kernels/view.hpp"
#include "model/activations.hpp"
#include "model/context_parallel.hpp"
#include "model/moe.hpp"
#include "util/element_types.hpp"

namespace ptrain::model {

template <class T>
using Vec = kernels::Vec<T>;
template <class T>
using CVec = kernels::CVec<T>;

// The tensor-parallel group as the layers use it: null or of size 1 means none, and then
// every operation is the identity.
class TensorParallel {
 public:
  TensorParallel() = default;
  TensorParallel(Comm* tp, bool sequence_parallel);
  int rank() const { return rank_; }
  int size() const { return size_; }
  bool sp() const { return sp_; }  // sequence parallelism (only with size > 1)
  std::int64_t rows(std::int64_t n) const { return sp_ ? n / size_ : n; }  // R of n = BT
  std::int64_t first_row(std::int64_t n) const { return sp_ ? rank_ * (n / size_) : 0; }

  template <class T>
  void sum(const Vec<T>& x) const;  // all-reduce in place
  template <class T>
  void max(const Vec<T>& x) const;
  // rows (R, C) [=] this rank's rows of the tp sum of full (BT, C): a reduce-scatter under
  // SP; else full is summed in place and rows must be full.
  template <class T>
  void sum_to_rows(const Vec<T>& full, const Vec<T>& rows) const;
  // full (BT, C) [=] every rank's rows (SP; this rank's already in place), else nothing.
  template <class T>
  void gather_rows(const Vec<T>& full) const;

 private:
  Comm* comm_ = nullptr;
  int rank_ = 0, size_ = 1;
  bool sp_ = false;
};

// What one layer call runs on. With context parallelism S is this rank's share of each
// sequence (cp->local_len()) and its rows are the positions cp->positions().
struct Ctx {
  const TensorParallel* tp;
  const ContextParallel* cp = nullptr;  // null: whole sequences here
  int B = 0, S = 0;                     // samples, positions per sample on this rank
  std::int64_t BT = 0, R = 0, r0 = 0;
  Ctx(const TensorParallel& t, int B_, int S_, const ContextParallel* c = nullptr)
      : tp(&t),
        cp(c),
        B(B_),
        S(S_),
        BT(std::int64_t(B_) * S_),
        R(t.rows(BT)),
        r0(t.first_row(BT)) {}
  bool ring() const { return cp && cp->active(); }  // attention over the cp ring
};

// This rank's rows [r0, r0 + R) of a (BT, C) tensor.
template <class T>
Vec<T> own_rows(const Ctx& c, const Vec<T>& full, std::int64_t C);

// The layers are instantiated per precision policy P (util/element_types.hpp): weights and
// activations in P::compute (T), parameter gradients in P::grad (G), statistics (LayerNorm
// mean and rstd, the attention's log-sum-exp, the cross-entropy's) in T's accumulate type (A).

template <class P>
struct LayerNorm {
  PTRAIN_POLICY_TYPES(P);
  Vec<T> w, b;    // (C)
  Vec<G> dw, db;  // (C)
  int C = 0;
  // out, mean, rstd: (R, C), (R), (R) [=] LN(x (R, C)).
  void forward(const Ctx& c, CVec<T> x, Vec<T> out, Vec<A> mean, Vec<A> rstd) const;
  // dx (R, C) [+=] LN'(dout (R, C)); dw, db [+=] (under SP each rank saw only its rows: the
  // partial sums, in `scratch` (2C), are summed over tp first).
  void backward(const Ctx& c, CVec<T> x, CVec<A> mean, CVec<A> rstd, CVec<T> dout, Vec<T> dx,
                Vec<G> scratch) const;
  // A split backward: dx [+=] and the parameter sums into `sums` (2C, [=], summed over tp
  // under SP); then dw, db [+=] sums. Under SP the same operations as backward's.
  void backward_input(const Ctx& c, CVec<T> x, CVec<A> mean, CVec<A> rstd, CVec<T> dout, Vec<T> dx,
                      Vec<G> sums) const;
  void backward_weight(CVec<G> sums) const;
};

template <class P>
struct ColumnParallelLinear {
  PTRAIN_POLICY_TYPES(P);
  Vec<T> w, b;    // (out, in), (out) or empty; out = this rank's columns
  Vec<G> dw, db;  // their gradients
  int in = 0, out = 0;
  // x (BT, in) holds this rank's rows in place (all of them without SP); they are gathered
  // over tp. y (BT, out) [=] x w^T + b.
  void forward(const Ctx& c, Vec<T> x, Vec<T> y) const;
  // dw, db [+=]; dx (BT, in) [=] dy w, a partial sum over tp reduced to this rank's rows,
  // which are returned: (R, in), `rows` under SP, else dx itself.
  Vec<T> backward(const Ctx& c, CVec<T> x, CVec<T> dy, Vec<T> dx, Vec<T> rows) const;
  // backward split: d(input) alone (the same rows returned), then dw, db [+=] alone.
  Vec<T> backward_input(const Ctx& c, CVec<T> dy, Vec<T> dx, Vec<T> rows) const;
  void backward_weight(const Ctx& c, CVec<T> x, CVec<T> dy) const;
};

template <class P>
struct RowParallelLinear {
  PTRAIN_POLICY_TYPES(P);
  Vec<T> w, b;    // (out, in), (out): in = this rank's columns; b added by tp rank 0
  Vec<G> dw, db;  // their gradients
  int in = 0, out = 0;
  // y (R, out) [=] the tp sum of x (BT, in) w^T (+ b), formed in `partial` (BT, out) first
  // (partial may be y itself without SP).
  void forward(const Ctx& c, CVec<T> x, Vec<T> partial, Vec<T> y) const;
  // dy (R, out) of every token, gathered into `full` (BT, out) under SP; dw, db [+=];
  // dx (BT, in) [=] dy w.
  void backward(const Ctx& c, CVec<T> x, Vec<T> dy, Vec<T> full, Vec<T> dx) const;
  // backward split: dx alone, then dw, db [+=] from the rows dy (R, out), gathered again into
  // `full` under SP.
  void backward_input(const Ctx& c, Vec<T> dy, Vec<T> full, Vec<T> dx) const;
  void backward_weight(const Ctx& c, CVec<T> x, Vec<T> dy, Vec<T> full) const;
};

// Causal multi-head attention over this rank's heads on a (BT, 3Cl) qkv buffer: local, or
// the context-parallel ring (model/context_parallel.hpp) when the sequence is cut over cp.
template <class P>
struct Attention {
  PTRAIN_POLICY_TYPES(P);
  int NH = 0, HS = 0;  // this rank's heads, head size
  void forward(const Ctx& c, CVec<T> qkv, Vec<T> out, Vec<A> lse) const;
  // dqkv (BT, 3Cl) [=].
  void backward(const Ctx& c, CVec<T> qkv, CVec<T> out, CVec<A> lse, CVec<T> dout,
                Vec<T> dqkv) const;
};

// The dense MLP, y = gelu(x W_fc^T + b_fc) W_proj^T + b_proj: the block's MLP slot.
template <class P>
struct MLP {
  PTRAIN_POLICY_TYPES(P);
  ColumnParallelLinear<P> fc;
  RowParallelLinear<P> proj;
  using Acts = MlpActs<Vec<T>>;
  using Grads = MlpScratch<Vec<T>>;
  // x (BT, C) with this rank's rows in place; y (R, C) [=] mlp(x).
  void forward(const Ctx& c, Vec<T> x, const Acts& a, Vec<T> partial, Vec<T> y) const;
  // dy (R, C) -> d(x) rows (R, C) (see ColumnParallelLinear::backward).
  Vec<T> backward(const Ctx& c, CVec<T> x, const Acts& a, Vec<T> dy, const Grads& g, Vec<T> full,
                  Vec<T> dx, Vec<T> rows) const;
};

// Vocab-parallel token embedding plus learned positions (added by tp rank 0), at the global
// positions of this rank's rows under context parallelism.
template <class P>
struct Embedding {
  PTRAIN_POLICY_TYPES(P);
  Vec<T> wte, wpe;    // (Vl, C), (S, C)
  Vec<G> dwte, dwpe;  // their gradients
  int C = 0, v_begin = 0, Vl = 0;
  // x (R, C) [=] wte[tokens] + wpe, summed over the vocabulary shards via `partial` (BT, C).
  void forward(const Ctx& c, kernels::IntVec tokens, Vec<T> partial, Vec<T> x) const;
  // dwte, dwpe [+=] from dx (R, C), gathered into `full` (BT, C) under SP.
  void backward(const Ctx& c, kernels::IntVec tokens, Vec<T> dx, Vec<T> full) const;
};

// Final LayerNorm, LM head tied to wte, vocab-parallel cross-entropy: no rank forms the full
// logits; the row max, then the sum of exponentials and the target's logit, are reduced.
template <class P>
struct Head {
  PTRAIN_POLICY_TYPES(P);
  LayerNorm<P> lnf;
  ColumnParallelLinear<P> lm;  // w = wte shard (Vl, C), no bias
  int v_real = 0;              // real vocabulary (padding columns never win the softmax)
  using Acts = HeadActs<Vec<T>, Vec<A>>;
  // Returns the sum of the BT token losses.
  double forward(const Ctx& c, CVec<T> x, const Acts& a, kernels::IntVec targets) const;
  // dx (R, C) [=] the gradient of dloss * (sum of token losses); logits become dlogits.
  void backward(const Ctx& c, CVec<T> x, const Acts& a, kernels::IntVec targets, A dloss, Vec<T> dx,
                Vec<T> dln, Vec<T> rows, Vec<G> norm_scratch) const;
};

// A pre-LayerNorm transformer block: LN, attention, LN, MLP slot (the dense MLP, or with
// a routing record to fill, the MoE layer).
template <class P>
struct Block {
  PTRAIN_POLICY_TYPES(P);
  LayerNorm<P> ln1, ln2;
  ColumnParallelLinear<P> qkv;
  Attention<P> attn;
  RowParallelLinear<P> proj;
  MLP<P> mlp;
  MoE<P> moe;
  Routing* routing = nullptr;  // non-null: the MLP slot is `moe`
  using Acts = BlockActs<Vec<T>, Vec<A>>;
  using Grads = Scratch<Vec<T>, Vec<G>>;  // the backward's scratch; dres cut to (R, C)
  // Acts.res3 [=] block(x (R, C)); `partial` (BT, C) is scratch.
  void forward(const Ctx& c, CVec<T> x, const Acts& a, Vec<T> partial) const;
  // g.dres (R, C): d(res3) in, d(x) out.
  void backward(const Ctx& c, CVec<T> x, const Acts& a, const Grads& g) const;
  // The backward split (a dense block; zero-bubble schedules): the input gradient (B), which
  // keeps in `w` what the weight gradient (W) needs, then W from `w` and the inputs of the
  // linear layers in `a`. The same kernels on the same operands as backward, so every
  // gradient has its bits, except (without SP) the LayerNorm parameters', summed apart first.
  using WeightGrads = BlockWeightGrads<Vec<T>, Vec<G>>;
  void backward_input(const Ctx& c, CVec<T> x, const Acts& a, const Grads& g,
                      const WeightGrads& w) const;
  void backward_weight(const Ctx& c, const Acts& a, const Grads& g, const WeightGrads& w) const;
  // Rebuilds, before the backward, what train%recompute did not keep (model/activations.hpp):
  // selective reruns the LayerNorms, attention and GELU from the kept tensors; full reruns
  // the forward from x (`partial` (BT, C) scratch). The same kernels on the same inputs:
  // the same values as the first forward.
  void recompute(const Ctx& c, CVec<T> x, const Acts& a, Recompute mode, Vec<T> partial) const;
};

}  // namespace ptrain::model
