// kernels/kernels.hpp — the layer kernels of the GPT forward and backward (llm.c's set),
// on Kokkos Views. T is the storage type: float, double or bf16 (all instantiated in the .cpp
// files). Arithmetic is in accumulate_t<T> (util/element_types.hpp: fp32 for bf16), results are
// rounded once when stored; statistics (LayerNorm mean and rstd, the cross-entropy's row max,
// sum-exp and losses) are kept in accumulate_t<T>. Backward kernels that write parameter
// gradients take their type G as a second parameter (default T): fp32 gradients of bf16
// weights are kernels::matmul_backward<bf16, float>.
// Tensors are row-major 1-D views with explicit dims (see kernels/view.hpp); a shape
// comment names each. Outputs are marked [=] overwritten or [+=] accumulated: backward
// kernels accumulate into parameter gradients (the model sums micro-batches) and into
// input gradients where llm.c does. Inputs and outputs must not alias unless stated.
// T in shape comments is the sequence length (parameter seq_len); B*T = N tokens.
// Attention is in kernels/attention.hpp, gemm in kernels/gemm.hpp.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/view.hpp"
#include "util/element_types.hpp"

namespace ptrain::kernels {

// ---- small helpers over whole views ------------------------------------------------
template <class T>
void fill(Vec<T> x, T value);  // x [=] value
template <class T>
void copy(Vec<T> dst, CVec<T> src);  // dst [=] src; equal extents
// A 3-D block inside a flat view: element (i, j, k) at offset + i*s0 + j*s1 + k.
struct Strided {
  std::size_t offset = 0, s0 = 0, s1 = 0;
};
// dst block (n0, n1, n2) [=] src block (n0, n1, n2): packs and unpacks column ranges and
// sequence chunks (the context-parallel ring's K/V blocks). The blocks must not overlap.
template <class T>
void copy_strided(Vec<T> dst, const Strided& d, CVec<T> src, const Strided& s, int n0, int n1,
                  int n2);
template <class T>
void axpy(Vec<T> y, accumulate_t<T> alpha, CVec<T> x);  // y [+=] alpha x; equal extents
// dst [=] src rounded to dst's type (fp32 masters -> bf16 compute weights); equal extents.
template <class To, class From>
void cast(Vec<To> dst, CVec<From> src);
// dst (n) [+=] the sum over q < n_blocks of blocks (n_blocks, n), added in fp32 in block order
// and once to dst: the receiving side of a reduce-scatter whose wire carries bf16.
void add_block_sum(Vec<float> dst, CVec<bf16> blocks, int n_blocks);
template <class T>
double sum_of_squares(CVec<T> x);  // sum x^2, accumulated in double
template <class T>
std::int64_t count_nonfinite(CVec<T> x);  // elements that are NaN or +-inf
// x (n): sum_i element_hash(first + i, bits_of(x_i)) mod 2^64 (util/checksum.hpp): the same
// whatever the thread count or how a tensor is cut into views.
template <class T>
std::uint64_t checksum(CVec<T> x, std::int64_t first);
template <class T>
void flip_bit(Vec<T> x, std::size_t i, int bit);  // x_i's stored bit `bit` flipped (tests)

// ---- residual and GELU (n elements) -------------------------------------------------
// out [=] a + b. Its backward is axpy(da, 1, dout) on each input.
template <class T>
void residual_forward(Vec<T> out, CVec<T> a, CVec<T> b, std::size_t n);

// out [=] gelu(inp), tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <class T>
void gelu_forward(Vec<T> out, CVec<T> inp, std::size_t n);
// dinp = gelu'(inp) * dout (written, not added: no caller accumulates into it).
template <class T>
void gelu_backward(Vec<T> dinp, CVec<T> inp, CVec<T> dout, std::size_t n);

// ---- linear layer -------------------------------------------------------------------
// out: (N, OC) [=] inp (N, C) @ weight (OC, C)^T + bias (OC). An empty bias means none.
template <class T>
void matmul_forward(Vec<T> out, CVec<T> inp, CVec<T> weight, CVec<T> bias, int N, int C, int OC);
// dinp: (N, C) [=] dout (N, OC) @ weight (OC, C), or [+=] with accumulate_dinp;
// dweight: (OC, C) [+=] dout^T @ inp;  dbias: (OC) [+=] column sums of dout. An empty dinp,
// dweight or dbias is skipped (a split backward computes dinp and the rest apart).
template <class T, class G = T>
void matmul_backward(Vec<T> dinp, OutVec<G> dweight, OutVec<G> dbias, CVec<T> dout, CVec<T> inp,
                     CVec<T> weight, int N, int C, int OC, bool accumulate_dinp = false);

// ---- embeddings -----------------------------------------------------------------------
// The token table may be a vocab shard: wte holds rows [v_begin, v_begin + v_local) of
// the full (V, C) table. positions: (T) global position of each local t (context
// parallel chunks); empty means 0..T-1; wpe has at least max(position)+1 rows.
// out: (B, T, C) [=] wte[tokens(b,t) - v_begin] (0 for tokens outside the shard)
//                    + wpe[positions(t)] (skipped when wpe is empty: with a sharded wte the
//                    model adds positions on one tensor-parallel rank or after the all-reduce).
// tokens: (B, T)
template <class T>
void encoder_forward(Vec<T> out, IntVec tokens, IntVec positions, CVec<T> wte, CVec<T> wpe, int B,
                     int seq_len, int C, int v_begin, int v_local);
// dwte: (v_local, C) [+=] dout rows of the tokens in the shard; dwpe [+=] sum over b of
// dout(b, t) at row positions(t). An empty dwte or dwpe is skipped. Deterministic: each
// column is summed by one thread in token order.
template <class T, class G = T>
void encoder_backward(OutVec<G> dwte, OutVec<G> dwpe, CVec<T> dout, IntVec tokens, IntVec positions,
                      int B, int seq_len, int C, int v_begin, int v_local);

// ---- layer norm (eps = 1e-5) -------------------------------------------------------------
// inp: (N, C) -> out (N, C) [=] (inp - mean) * rstd * weight (C) + bias (C);
// mean, rstd: (N) [=], saved for the backward.
template <class T>
void layernorm_forward(Vec<T> out, Vec<accumulate_t<T>> mean, Vec<accumulate_t<T>> rstd,
                       CVec<T> inp, CVec<T> weight, CVec<T> bias, int N, int C);
// dinp: (N, C) [+=]; dweight, dbias: (C) [+=].
template <class T, class G = T>
void layernorm_backward(Vec<T> dinp, OutVec<G> dweight, OutVec<G> dbias, CVec<T> dout, CVec<T> inp,
                        CVec<T> weight, CVec<accumulate_t<T>> mean, CVec<accumulate_t<T>> rstd,
                        int N, int C);

// ---- cross-entropy, vocab-parallel ---------------------------------------------------
// This rank holds logits (N, v_local): columns [v_begin, v_begin + v_local) of the padded
// vocabulary; global columns >= v_real are padding (never in the softmax, zero gradient).
// Steps, with the tensor-parallel all-reduces the model puts between them:
//   (a) crossentropy_row_max     -> row_max      ... all-reduce MAX
//   (b) crossentropy_row_sumexp  -> sumexp, target_logit ... all-reduce SUM (both)
//   (c) crossentropy_loss        -> losses
//   (d) crossentropy_backward    -> dlogits, in place of the logits
// With one rank the reductions are identities and this is the plain cross-entropy.
struct VocabShard {
  int v_begin = 0;  // first global column held here
  int v_local = 0;  // columns held here
  int v_real = 0;   // real vocabulary size (global columns >= v_real are padding)
};
// row_max: (N) [=] max over real columns here (-inf if none).
template <class T>
void crossentropy_row_max(Vec<accumulate_t<T>> row_max, CVec<T> logits, int N,
                          const VocabShard& shard);
// sumexp: (N) [=] sum over real columns here of exp(logit - row_max);
// target_logit: (N) [=] logits(n, targets(n)) if the target column is here, else 0.
template <class T>
void crossentropy_row_sumexp(Vec<accumulate_t<T>> sumexp, Vec<accumulate_t<T>> target_logit,
                             CVec<T> logits, CVec<accumulate_t<T>> row_max, IntVec targets, int N,
                             const VocabShard& shard);
// losses: (N) [=] log(sumexp) + row_max - target_logit.
// (Statistics only: T names the logits' storage type, whose accumulate type these are in.)
template <class T>
void crossentropy_loss(Vec<accumulate_t<T>> losses, CVec<accumulate_t<T>> row_max,
                       CVec<accumulate_t<T>> sumexp, CVec<accumulate_t<T>> target_logit, int N);
// logits (N, v_local) [=] dlogits = (softmax - onehot(target)) * dloss for real columns,
// 0 for padding. dloss is dL/dloss(n), the same for every row (1 / tokens in the global batch
// for a mean loss).
template <class T>
void crossentropy_backward(Vec<T> logits, CVec<accumulate_t<T>> row_max,
                           CVec<accumulate_t<T>> sumexp, IntVec targets, int N,
                           const VocabShard& shard, accumulate_t<T> dloss);

// ---- mixture of experts (row gathers by index: deterministic, no atomics) ---------------
// probs: (N, E) [=] softmax over each row of logits (N, E).
template <class T>
void softmax_rows_forward(Vec<T> probs, CVec<T> logits, int N, int E);
// dlogits: (N, E) [=] softmax backward: p * (dp - sum_e p_e dp_e), from probs and dprobs.
template <class T>
void softmax_rows_backward(Vec<T> dlogits, CVec<T> probs, CVec<T> dprobs, int N, int E);
// dst (N, C) [=] (or [+=] with accumulate) sum over j < k of weight(t, j) * src(rows(t, j)),
// skipping rows(t, j) < 0; an empty weight means 1. rows, weight: (N, k). With k = 1 it
// gathers (and scales) rows.
template <class T>
void combine_rows(Vec<T> dst, CVec<T> src, IntVec rows, CVec<T> weight, int N, int k, int C,
                  bool accumulate);
// dots (N, k) [=] a(t) . b(rows(t, j)) (0 where rows(t, j) < 0). a: (N, C).
template <class T>
void row_dots(Vec<T> dots, CVec<T> a, CVec<T> b, IntVec rows, int N, int k, int C);

}  // namespace ptrain::kernels
