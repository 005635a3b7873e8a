// kernels/attention_detail.hpp — what attention.cpp and its two kernels share (private to
// src/kernels/attention*.cpp): the masking rules, the team policy and its scratch, and each
// kernel's entry points. The public functions check their arguments, then call one kernel.
#pragma once
#include <Kokkos_Core.hpp>
#include <cstddef>
#include <type_traits>

#include "kernels/attention.hpp"
#include "kernels/detail_math.hpp"
#include "util/element_types.hpp"

namespace ptrain::kernels::detail {

// A block of `want` rows out of n, never larger than n (and at least 1).
inline int block_rows(int want, int n) { return want < n ? want : (n > 0 ? n : 1); }

// Number of keys j0 + c (c < nk) a query at q_pos may see: all, or up to its position.
KOKKOS_INLINE_FUNCTION int visible_keys(bool causal, int q_pos, int k_pos_first, int nk) {
  if (!causal) return nk;
  const int lim = q_pos - k_pos_first + 1;
  return lim < 0 ? 0 : (lim < nk ? lim : nk);
}

// True when the whole key block starting at k_pos_first lies after every query of the
// query block ending at q_pos_last (so it and all later key blocks are masked).
KOKKOS_INLINE_FUNCTION bool block_masked(bool causal, int q_pos_last, int k_pos_first) {
  return causal && k_pos_first > q_pos_last;
}

using Team = Kokkos::TeamPolicy<Kokkos::Schedule<Kokkos::Dynamic>>;
using Member = Team::member_type;

template <class T>
KOKKOS_INLINE_FUNCTION T* scratch(const Member& m, std::size_t elems, int level = 0) {
  return static_cast<T*>(m.team_scratch(level).get_shmem(elems * sizeof(T)));
}

// Each kernel's calls, argument checks done (attention.hpp has their contracts).
template <class T>
void host_attention_forward(Vec<T> out, Vec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k,
                            CHeads<T> v, int B, int Tq, int Tk, int NH, int HS,
                            const AttentionConfig& cfg);
template <class T>
void host_attention_backward(Heads<T> dq, Heads<T> dk, Heads<T> dv, CVec<T> dout, CVec<T> out,
                             CVec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k, CHeads<T> v,
                             int B, int Tq, int Tk, int NH, int HS, const AttentionConfig& cfg,
                             bool accumulate);
template <class T>
AttentionScratch host_attention_scratch(int Tq, int Tk, int HS, const AttentionConfig& cfg);

template <class T>
void device_attention_forward(Vec<T> out, Vec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k,
                              CHeads<T> v, int B, int Tq, int Tk, int NH, int HS,
                              const AttentionConfig& cfg);
template <class T>
void device_attention_backward(Heads<T> dq, Heads<T> dk, Heads<T> dv, CVec<T> dout, CVec<T> out,
                               CVec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k, CHeads<T> v,
                               int B, int Tq, int Tk, int NH, int HS, const AttentionConfig& cfg,
                               bool accumulate);
template <class T>
AttentionScratch device_attention_scratch(int Tq, int Tk, int HS, const AttentionConfig& cfg);

}  // namespace ptrain::kernels::detail
