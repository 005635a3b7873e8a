// kernels/attention.hpp — causal multi-head attention, blockwise (flash-attention style).
// The forward runs an online softmax over key blocks and returns the log-sum-exp of each
// query row's scaled scores, so partial results over disjoint key sets (context-parallel
// ring steps) merge exactly with attention_merge. The backward recomputes the
// probabilities from lse. No (T, T) matrix is ever formed: (query block, key block) tiles live
// in scratch (team scratch, or a host thread's). Two kernels: AttentionConfig::kernel.
//
// Element types: T = double, float or bf16 is the storage of q, k, v, out, dout, dq, dk and dv;
// the arithmetic (scores, the online softmax, the block products, D = rowsum(dO * O), dS and
// the accumulation of dQ, dK and dV) is done in accumulate_t<T>, fp32 for bf16, with team
// scratch in that type; each bf16 output is rounded once, when stored. The log-sum-exp lse
// is in accumulate_t<T> too (fp32 for bf16): the backward and attention_merge read it back,
// and a bf16 lse, off by up to 2^-8 |lse|, would scale probabilities by up to exp(2^-8 |lse|).
// For float and double nothing is converted.
#pragma once
#include <cstddef>
#include <type_traits>

#include "kernels/view.hpp"
#include "util/element_types.hpp"

namespace ptrain::kernels {

// A (B, T, NH*HS) tensor inside a flat buffer: element (b, t, h*HS + d) is at
// view[offset + b*batch_stride + t*ld + h*HS + d]; batch_stride 0 means T*ld (rows of all
// batches back to back). Heads are contiguous HS-blocks (llm.c). A nonzero batch_stride
// selects a range of positions of each sequence (a context-parallel chunk).
template <class T>
struct Heads {
  Kokkos::View<T*> view;
  std::size_t offset = 0;
  int ld = 0;
  std::size_t batch_stride = 0;

  Heads() = default;
  Heads(Kokkos::View<T*> v, std::size_t off, int row_stride, std::size_t bstride = 0)
      : view(v), offset(off), ld(row_stride), batch_stride(bstride) {}
  // Heads<float> -> Heads<const float>
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  Heads(const Heads<U>& o)
      : view(o.view), offset(o.offset), ld(o.ld), batch_stride(o.batch_stride) {}
  // Index in view of element (b, t, 0) for sequences of length seq_len.
  KOKKOS_INLINE_FUNCTION std::size_t at(int b, int t, int seq_len) const {
    const std::size_t bs = batch_stride ? batch_stride : std::size_t(seq_len) * std::size_t(ld);
    return offset + std::size_t(b) * bs + std::size_t(t) * std::size_t(ld);
  }
};
template <class T>
using CHeads = typename detail::NonDeduced<Heads<const T>>::type;

// Part `which` (0 = q, 1 = k, 2 = v) of a qkv buffer (B, T, 3C), C = NH*HS.
template <class T>
Heads<T> qkv_part(Kokkos::View<T*> qkv, int which, int C) {
  return Heads<T>(qkv, std::size_t(which) * C, 3 * C);
}

// Which kernel a call runs (kernels/view.hpp's KernelShape; by default the process-wide one).
// - host: a thread per block (kernels/parallel.hpp), its rows register-blocked (the CPU kernel).
// - device: a team of threads with one query or key row each and tiles in team scratch
//   within kDeviceScratchBytes; its backward is two launches (dK and dV over key tiles, dQ
//   over query tiles), so no two threads add into one element and the result does not depend
//   on the team size (the GPU kernel; CPU builds run it too, which is how it is tested).
// The two sum in different orders: results agree to rounding, not bit for bit.

// The level-0 team scratch the device kernel's tiles are sized to fit: what a CUDA block
// gets without opting in to more.
constexpr std::size_t kDeviceScratchBytes = 48 * 1024;

struct AttentionConfig {
  KernelShape kernel = kernel_shape();
  int team_size = 0;   // device kernel: threads a team (0: a tile row each on a GPU, 1 on CPUs)
  int q_block = 64;    // query rows per block (the device kernel's tiles: at most this and 64)
  int k_block = 64;    // key rows per block
  bool causal = true;  // mask key j for query i when k_pos0 + j > q_pos0 + i
  int q_pos0 = 0;      // sequence position of query row 0 (context-parallel chunks)
  int k_pos0 = 0;      // sequence position of key row 0
};

// The scratch, in bytes, each block of a call of this config at these shapes works in: the
// device kernel's level-0 team scratch (the forward's, and the largest of the backward's
// launches), or the host kernel's per-thread scratch.
struct AttentionScratch {
  std::size_t forward = 0, backward = 0;
};
template <class T>
AttentionScratch attention_scratch(int Tq, int Tk, int HS, const AttentionConfig& cfg = {});

// The (query, key) pairs left unmasked for Tq queries at positions q_pos0.. against Tk keys
// at k_pos0.. (per sample and head): the useful work of a causal attention call.
std::int64_t attention_pairs(int Tq, int Tk, const AttentionConfig& cfg);

// Scaled dot-product attention, scale 1/sqrt(HS), of queries q (B, Tq, NH*HS) against
// keys k and values v (B, Tk, NH*HS). NH is this rank's heads (tensor parallel splits them).
// out: (B, Tq, NH*HS) [=]; lse: (B, NH, Tq) [=] log sum_j exp(scale q.k_j) over the unmasked
// keys, in accumulate_t<T> (fp32 for bf16). A query row with no unmasked key gets out = 0 and
// lse = -inf.
template <class T>
void attention_forward(Vec<T> out, Vec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k, CHeads<T> v,
                       int B, int Tq, int Tk, int NH, int HS, const AttentionConfig& cfg = {});
// The same on a qkv buffer (B, T, 3*NH*HS) (queries and keys the same T positions).
template <class T>
void attention_forward(Vec<T> out, Vec<accumulate_t<T>> lse, CVec<T> qkv, int B, int seq_len,
                       int NH, int HS, const AttentionConfig& cfg = {});

// Backward of attention_forward. dout, out: (B, Tq, NH*HS), lse: (B, NH, Tq) — with
// context parallelism the merged (final) out and lse, so that calling this once per key
// chunk yields that chunk's exact contributions. dq: (B, Tq, ..) and dk, dv: (B, Tk, ..)
// [=] (zeroed first) or, with accumulate, [+=]. For bf16 the call's whole contribution is
// summed in fp32 and each element stored once: bf16(float(old) + contribution) with accumulate.
template <class T>
void attention_backward(Heads<T> dq, Heads<T> dk, Heads<T> dv, CVec<T> dout, CVec<T> out,
                        CVec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k, CHeads<T> v, int B,
                        int Tq, int Tk, int NH, int HS, const AttentionConfig& cfg = {},
                        bool accumulate = false);
// The same on qkv buffers: dqkv (B, T, 3*NH*HS) [=].
template <class T>
void attention_backward(Vec<T> dqkv, CVec<T> dout, CVec<T> out, CVec<accumulate_t<T>> lse,
                        CVec<T> qkv, int B, int seq_len, int NH, int HS,
                        const AttentionConfig& cfg = {});

// Merges two attentions of the same queries over disjoint key sets A and B into the
// attention over A u B: (out_a, lse_a) [=] merge((out_a, lse_a), (out_b, lse_b)).
// out: (B, T, NH*HS), lse: (B, NH, T) in accumulate_t<T>; for bf16 the merge is fp32 and
// out_a is rounded once.
template <class T>
void attention_merge(Vec<T> out_a, Vec<accumulate_t<T>> lse_a, CVec<T> out_b,
                     CVec<accumulate_t<T>> lse_b, int B, int seq_len, int NH, int HS);

}  // namespace ptrain::kernels
