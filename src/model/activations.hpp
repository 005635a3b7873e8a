// model/activations.hpp — the one description of what a stage keeps between its forward
// and its backward, and of the backward's scratch. Each struct below is a list of named
// tensors; `describe(acts, shape, f)` visits them in carving order with their element
// counts. With V = std::int64_t the visit sums sizes (model::activation_sizes, which
// `--plan` prints); with V = a view it carves a buffer (model/stage.cpp). A new layer or a
// recomputation mode changes these lists, and both the plan and the buffers follow.
// Statistics (LayerNorm mean and rstd, the log-sum-exp, the cross-entropy's) are fields of
// type S, kept in the compute type's accumulate type (fp32 in a bf16 run), and the scratch of
// the LayerNorm parameter gradients of type W (the grad type). describe passes each field's
// Role as a third argument (visitors: `[&](auto& field, std::int64_t n, Role role =
// Role::value)`), so sizes and buffers keep the three apart whatever the types.
#pragma once
#include <cstdint>

#include "model/layout.hpp"

namespace ptrain::model {

// What a described field holds: the compute type, a statistic (accumulate type), a
// gradient (grad type).
enum class Role { value, stat, grad };

// The sizes that shape a stage's activations for micro-batches of B samples.
struct ActShape {
  std::int64_t BT = 0;  // tokens of the micro-batch on this rank: B * (seq_len / cp)
  std::int64_t R = 0;   // rows of the residual stream kept here: BT, or BT / tp with SP
  std::int64_t C = 0, Cl = 0, NHl = 0, Fl = 0, Vl = 0;  // width; this tp rank's share
  bool sp = false;                                      // sequence parallelism
  // A MoE block (model/moe.hpp): E experts, top k; rows an ep rank may receive for its
  // experts (every token of every ep rank, dropless), and whether tokens leave the rank.
  bool moe = false;
  std::int64_t E = 0, k = 0, expert_rows = 0;
  bool ep = false;  // expert parallelism: separate send and receive buffers
  // A block's activations split by recomputation: `kept` sizes what a block keeps between
  // its forward and backward (the recomputed tensors are empty), `recomputed` what is
  // rebuilt in the backward (into one block's worth of workspace; the rest empty).
  Recompute recompute = Recompute::none;
  enum Part { whole, kept, recomputed } part = whole;
};
// s with part p.
inline ActShape with_part(ActShape s, ActShape::Part p) {
  s.part = p;
  return s;
}
ActShape act_shape(const Dims& d, const ShardCoord& c, std::int64_t B, std::int64_t T, bool sp,
                   bool moe = false);

// The dense MLP in a block's MLP slot (an MoE layer brings its own lists).
template <class V>
struct MlpActs {
  V fch, fch_gelu;  // (BT, Fl) each
};
template <class V, class F>
void describe(MlpActs<V>& a, const ActShape& s, F&& f) {
  f(a.fch, s.BT * s.Fl), f(a.fch_gelu, s.BT * s.Fl);
}
template <class V>
struct MlpScratch {
  V dgelu, dfch;  // (BT, Fl) each
};
template <class V, class F>
void describe(MlpScratch<V>& a, const ActShape& s, F&& f) {
  f(a.dgelu, s.BT * s.Fl), f(a.dfch, s.BT * s.Fl);
}

// The MoE layer in a block's MLP slot: the router's logits and probabilities (BT, E), the
// gates of each token's choices (BT, k) and of each send row, then rows in send order (to the
// experts' ranks) and in receive order (the experts' inputs, hidden activations, outputs).
// Without expert parallelism send and receive order are the same rows, held once.
template <class V>
struct MoeActs {
  V logits, probs, gates, send_gates;  // (BT, E) x2, (BT, k) x2
  V xs, xr, fch, fch_gelu, yr,
      ys;  // (BT*k, C) ep only, (rows, C), (rows, Fl) x2, (rows, C), ep only
};
template <class V, class F>
void describe(MoeActs<V>& a, const ActShape& s, F&& f) {
  const std::int64_t sent = s.ep ? s.BT * s.k : 0;
  f(a.logits, s.BT * s.E), f(a.probs, s.BT * s.E), f(a.gates, s.BT * s.k),
      f(a.send_gates, s.BT * s.k);
  f(a.xs, sent * s.C), f(a.xr, s.expert_rows * s.C), f(a.fch, s.expert_rows * s.Fl);
  f(a.fch_gelu, s.expert_rows * s.Fl), f(a.yr, s.expert_rows * s.C), f(a.ys, sent * s.C);
}
template <class V>
struct MoeScratch {
  V dgates, dprobs, dlogits;       // (BT, k), (BT, E) x2
  V dys, dyr, dh, dpre, dxr, dxs;  // send and receive order, as MoeActs
};
template <class V, class F>
void describe(MoeScratch<V>& a, const ActShape& s, F&& f) {
  const std::int64_t sent = s.ep ? s.BT * s.k : 0;
  f(a.dgates, s.BT * s.k), f(a.dprobs, s.BT * s.E), f(a.dlogits, s.BT * s.E);
  f(a.dys, sent * s.C), f(a.dyr, s.expert_rows * s.C), f(a.dh, s.expert_rows * s.Fl);
  f(a.dpre, s.expert_rows * s.Fl), f(a.dxr, s.expert_rows * s.C), f(a.dxs, sent * s.C);
}

// One block: res2 = x + attn(LN1(x)), res3 = res2 + mlp(LN2(res2)).
template <class V, class S = V>
struct BlockActs {
  V ln1, qkv, atty;                          // (BT, C) gathered, (BT, 3Cl), (BT, Cl)
  S lse;                                     // (B, NHl, T)
  V ln2;                                     // (BT, C) gathered
  MlpActs<V> mlp;                            // a dense block's
  MoeActs<V> moe;                            // a MoE block's
  S ln1_mean, ln1_rstd, ln2_mean, ln2_rstd;  // (R) each
  V res2, res3;                              // (R, C)
};
template <class V, class S, class F>
void describe(BlockActs<V, S>& a, const ActShape& s, F&& f) {
  // n elements, or none when the field is in the other part (`cheap`: selective drops it).
  const bool sel = s.recompute == Recompute::selective, full = s.recompute == Recompute::full;
  auto part = [&](bool cheap, std::int64_t n) {
    const bool redone = full || (sel && cheap);
    return s.part == ActShape::whole || (s.part == ActShape::recomputed) == redone ? n : 0;
  };
  f(a.ln1, part(true, s.BT * s.C)), f(a.qkv, part(false, s.BT * 3 * s.Cl));
  f(a.atty, part(true, s.BT * s.Cl)), f(a.lse, part(false, s.BT * s.NHl), Role::stat);
  f(a.ln2, part(true, s.BT * s.C));
  if (s.moe) {
    describe(a.moe, s, [&](auto& field, std::int64_t n, Role r = Role::value) {
      f(field, part(false, n), r);
    });
  } else {
    f(a.mlp.fch, part(false, s.BT * s.Fl)), f(a.mlp.fch_gelu, part(true, s.BT * s.Fl));
  }
  f(a.ln1_mean, part(false, s.R), Role::stat), f(a.ln1_rstd, part(false, s.R), Role::stat);
  f(a.ln2_mean, part(false, s.R), Role::stat), f(a.ln2_rstd, part(false, s.R), Role::stat);
  f(a.res2, part(false, s.R * s.C));
  // res3, the next block's input, is always kept
  f(a.res3, s.part == ActShape::recomputed ? 0 : s.R * s.C);
}

// The stage's input: the embedding output on the first stage, else the received activation.
template <class V>
struct InputActs {
  V x;  // (R, C)
};
template <class V, class F>
void describe(InputActs<V>& a, const ActShape& s, F&& f) {
  f(a.x, s.R * s.C);
}

// The head of the last stage: final LayerNorm, tied LM head, vocab-parallel cross-entropy.
template <class V, class S = V>
struct HeadActs {
  V lnf;                 // (BT, C) gathered
  S lnf_mean, lnf_rstd;  // (R), (R)
  V logits;              // (BT, Vl)
  S losses, row_max;     // (BT), (BT)
  S sums;                // (2, BT): sum of exponentials, target logit (reduced together)
};
template <class V, class S, class F>
void describe(HeadActs<V, S>& a, const ActShape& s, F&& f) {
  f(a.lnf, s.BT * s.C), f(a.lnf_mean, s.R, Role::stat), f(a.lnf_rstd, s.R, Role::stat);
  f(a.logits, s.BT * s.Vl), f(a.losses, s.BT, Role::stat), f(a.row_max, s.BT, Role::stat);
  f(a.sums, 2 * s.BT, Role::stat);
}

// What a split backward (zero-bubble schedules: the input gradient B now, the weight gradient W
// later) keeps of one block from its B to its W: the output gradients of its four linear layers
// (rows of d(res2) and d(res3): sequence parallelism gathers them again in W) and its
// LayerNorms' parameter sums (weight then bias, 2C each; grad type). Their inputs (ln1, atty,
// ln2, fch_gelu) stay in the micro-batch's slot, which lives until W. Without recomputation
// the gradients take the places of tensors only B reads (qkv, fch, res2, res3) and have no
// room here; with it W reruns the recomputation, which reads those tensors.
template <class V, class W = V>
struct BlockWeightGrads {
  V dqkv, dfch, dres2, dres3;  // (BT, 3Cl), (BT, Fl), (R, C), (R, C)
  W ln1, ln2;                  // (2C) each
};
template <class V, class W, class F>
void describe(BlockWeightGrads<V, W>& a, const ActShape& s, F&& f) {
  const bool own = s.recompute != Recompute::none;
  f(a.dqkv, own ? s.BT * 3 * s.Cl : 0), f(a.dfch, own ? s.BT * s.Fl : 0);
  f(a.dres2, own ? s.R * s.C : 0), f(a.dres3, own ? s.R * s.C : 0);
  f(a.ln1, 2 * s.C, Role::grad), f(a.ln2, 2 * s.C, Role::grad);
}
// The first chunk's W also keeps d(input) (R, C) for the embedding's gradients (in the input's
// place without recomputation).
template <class V>
struct InputWeightGrads {
  V dx;
};
template <class V, class F>
void describe(InputWeightGrads<V>& a, const ActShape& s, F&& f) {
  f(a.dx, s.recompute != Recompute::none ? s.R * s.C : 0);
}

// The backward's scratch, shared by the micro-batches of a stage (one backward at a time);
// `partial` of the forward (tp partial sums before their reduction) reuses dres.
template <class V, class W = V>
struct Scratch {
  V dres, dln;  // d(residual) (R, C) in a (BT, C) slot; d(LayerNorm out) (BT, C)
  MlpScratch<V> mlp;
  MoeScratch<V> moe;
  V datty, dqkv;  // (BT, Cl), (BT, 3Cl)
  V dfull;        // sequence parallel only: d(residual) gathered (BT, C)
  W dnorm;        // sequence parallel only: LN parameter gradients (2C)
};
template <class V, class W, class F>
void describe(Scratch<V, W>& a, const ActShape& s, F&& f) {
  f(a.dres, s.BT * s.C), f(a.dln, s.BT * s.C);
  if (s.moe)
    describe(a.moe, s, f);
  else
    describe(a.mlp, s, f);
  f(a.datty, s.BT * s.Cl), f(a.dqkv, s.BT * 3 * s.Cl);
  f(a.dfull, s.sp ? s.BT * s.C : 0), f(a.dnorm, s.sp ? 2 * s.C : 0, Role::grad);
}

// Elements of one description: of the compute type, statistics, gradient scratch.
struct DescribedSizes {
  std::int64_t values = 0, stats = 0, grads = 0;
};
template <class Acts>
DescribedSizes sizes_of(const ActShape& s) {
  Acts a;
  DescribedSizes n;
  describe(a, s, [&](std::int64_t& field, std::int64_t count, Role role = Role::value) {
    field = count;
    (role == Role::stat ? n.stats : role == Role::grad ? n.grads : n.values) += count;
  });
  return n;
}

}  // namespace ptrain::model
