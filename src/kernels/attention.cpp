// kernels/attention.cpp — blockwise attention: host loops over (b, h, query block, key
// block), gemm for the block products, Kokkos kernels for mask / softmax / rescale.
#include "kernels/attention.hpp"

#include <cmath>
#include <cstddef>
#include <limits>

#include "kernels/detail_math.hpp"
#include "kernels/gemm.hpp"
#include "kernels/kernels.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"

namespace ptrain::kernels {
namespace {

// A block of `want` rows out of n, never larger than n (and at least 1).
int block_rows(int want, int n) { return want < n ? want : (n > 0 ? n : 1); }

void require_len(const char* what, std::size_t extent, std::size_t need) {
  PTRAIN_REQUIRE(extent >= need, what, ": view of ", extent, " elements, needs ", need);
}

template <class T>
void check_heads(const char* what, const Heads<T>& x, int B, int T_, int C) {
  PTRAIN_REQUIRE(x.ld >= C, what, ": row stride ", x.ld, " < ", C, " columns");
  PTRAIN_REQUIRE(x.batch_stride == 0 || x.batch_stride >= std::size_t(T_) * x.ld, what,
                 ": batch stride ", x.batch_stride, " < ", T_, " rows of ", x.ld);
  if (B > 0 && T_ > 0) require_len(what, x.view.extent(0), x.at(B - 1, T_ - 1, T_) + C);
}

void check_config(const AttentionConfig& cfg, int B, int Tq, int Tk, int NH, int HS) {
  PTRAIN_REQUIRE(cfg.q_block >= 1 && cfg.k_block >= 1, "attention: block sizes must be >= 1 (",
                 cfg.q_block, ", ", cfg.k_block, ")");
  PTRAIN_REQUIRE(B >= 0 && Tq >= 0 && Tk >= 0 && NH >= 1 && HS >= 1, "attention: bad shape B=", B,
                 " Tq=", Tq, " Tk=", Tk, " NH=", NH, " HS=", HS);
}

// Number of keys j0 + c (c < nk) query row qrow may see: all, or up to its position.
KOKKOS_INLINE_FUNCTION int visible_keys(bool causal, int q_pos, int k_pos_first, int nk) {
  if (!causal) return nk;
  const int lim = q_pos - k_pos_first + 1;
  return lim < 0 ? 0 : (lim < nk ? lim : nk);
}

// True when the whole key block starting at k_pos_first lies after every query of the
// query block ending at q_pos_last (so it and all later key blocks are masked).
inline bool block_masked(const AttentionConfig& cfg, int q_pos_last, int k_pos_first) {
  return cfg.causal && k_pos_first > q_pos_last;
}

// x rows (B*T of them), columns [0, C): set to zero.
template <class T>
void zero_heads(const Heads<T>& x, int B, int T_, int C) {
  T* const base = x.view.data();
  for (int b = 0; b < B; ++b) {
    const std::size_t first = x.at(b, 0, T_);
    const int ld = x.ld;
    Kokkos::parallel_for(
        "ptrain::attention_zero_grad", T_, KOKKOS_LAMBDA(int t) {
          T* row = base + first + std::size_t(t) * ld;
          for (int c = 0; c < C; ++c) row[c] = T(0);
        });
  }
}

}  // namespace

std::int64_t attention_pairs(int Tq, int Tk, const AttentionConfig& cfg) {
  std::int64_t n = 0;
  for (int i = 0; i < Tq; ++i) n += visible_keys(cfg.causal, cfg.q_pos0 + i, cfg.k_pos0, Tk);
  return n;
}

template <class T>
void attention_forward(Vec<T> out, Vec<T> lse, CHeads<T> q, CHeads<T> k, CHeads<T> v, int B, int Tq,
                       int Tk, int NH, int HS, const AttentionConfig& cfg) {
  check_config(cfg, B, Tq, Tk, NH, HS);
  const int C = NH * HS;
  check_heads("attention_forward q", q, B, Tq, C);
  check_heads("attention_forward k", k, B, Tk, C);
  check_heads("attention_forward v", v, B, Tk, C);
  require_len("attention_forward out", out.extent(0), std::size_t(B) * Tq * C);
  require_len("attention_forward lse", lse.extent(0), std::size_t(B) * NH * Tq);

  const int bq = block_rows(cfg.q_block, Tq);
  const int bk = block_rows(cfg.k_block, Tk);
  // workspace: scores/probabilities (bq, bk) | output accumulator (bq, HS) | max (bq) | sum (bq)
  const std::size_t s_off = 0, acc_off = std::size_t(bq) * bk,
                    m_off = acc_off + std::size_t(bq) * HS, l_off = m_off + bq;
  TrackedView<T> work(MemCategory::workspace, "attention_forward_work", l_off + bq);
  const Vec<T> ws = work.view();
  T* const wsp = ws.data();
  const T scale = T(1) / std::sqrt(T(HS));
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const bool causal = cfg.causal;

  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i0 = 0; i0 < Tq; i0 += bq) {
        const int nq = i0 + bq <= Tq ? bq : Tq - i0;
        const int q_pos_first = cfg.q_pos0 + i0;
        const std::size_t q_at = q.at(b, i0, Tq) + std::size_t(h) * HS;
        Kokkos::parallel_for(
            "ptrain::attention_forward_init", nq, KOKKOS_LAMBDA(int r) {
              wsp[m_off + r] = neg_inf;
              wsp[l_off + r] = T(0);
              T* acc = wsp + acc_off + std::size_t(r) * HS;
              for (int d = 0; d < HS; ++d) acc[d] = T(0);
            });
        for (int j0 = 0; j0 < Tk; j0 += bk) {
          const int nk = j0 + bk <= Tk ? bk : Tk - j0;
          const int k_pos_first = cfg.k_pos0 + j0;
          if (block_masked(cfg, q_pos_first + nq - 1, k_pos_first)) break;
          // S (nq, nk) = scale Q_blk K_blk^T
          gemm<T>(false, true, nq, nk, HS, scale, q.view, q_at, q.ld, k.view,
                  k.at(b, j0, Tk) + std::size_t(h) * HS, k.ld, T(0), ws, s_off, nk);
          // online softmax: P = exp(S - m_new) over visible keys, rescale running sum/output
          Kokkos::parallel_for(
              "ptrain::attention_forward_softmax", nq, KOKKOS_LAMBDA(int r) {
                T* s = wsp + s_off + std::size_t(r) * nk;
                const int nv = visible_keys(causal, q_pos_first + r, k_pos_first, nk);
                for (int c = nv; c < nk; ++c) s[c] = T(0);
                if (nv == 0) return;
                const T m_prev = wsp[m_off + r];
                const T m_blk = detail::row_max(s, nv, neg_inf);
                const T m_new = m_prev > m_blk ? m_prev : m_blk;
                const T corr = m_prev == neg_inf ? T(0) : detail::exp_(m_prev - m_new);
                for (int c = 0; c < nv; ++c) s[c] = detail::exp_(s[c] - m_new);
                wsp[l_off + r] = wsp[l_off + r] * corr + detail::row_sum(s, nv);
                wsp[m_off + r] = m_new;
                T* acc = wsp + acc_off + std::size_t(r) * HS;
                for (int d = 0; d < HS; ++d) acc[d] *= corr;
              });
          // acc (nq, HS) += P (nq, nk) V_blk (nk, HS)
          gemm<T>(false, false, nq, HS, nk, T(1), ws, s_off, nk, v.view,
                  v.at(b, j0, Tk) + std::size_t(h) * HS, v.ld, T(1), ws, acc_off, HS);
        }
        T* const outp = out.data() + (std::size_t(b) * Tq + i0) * C + std::size_t(h) * HS;
        T* const lsep = lse.data() + (std::size_t(b) * NH + h) * Tq + i0;
        Kokkos::parallel_for(
            "ptrain::attention_forward_finish", nq, KOKKOS_LAMBDA(int r) {
              const T l = wsp[l_off + r];
              const T* acc = wsp + acc_off + std::size_t(r) * HS;
              T* o = outp + std::size_t(r) * C;
              const T inv = l > T(0) ? T(1) / l : T(0);
              for (int d = 0; d < HS; ++d) o[d] = acc[d] * inv;
              lsep[r] = l > T(0) ? wsp[m_off + r] + detail::log_(l) : neg_inf;
            });
      }
}

template <class T>
void attention_forward(Vec<T> out, Vec<T> lse, CVec<T> qkv, int B, int T_, int NH, int HS,
                       const AttentionConfig& cfg) {
  const int C = NH * HS;
  attention_forward<T>(out, lse, qkv_part<const T>(qkv, 0, C), qkv_part<const T>(qkv, 1, C),
                       qkv_part<const T>(qkv, 2, C), B, T_, T_, NH, HS, cfg);
}

template <class T>
void attention_backward(Heads<T> dq, Heads<T> dk, Heads<T> dv, CVec<T> dout, CVec<T> out,
                        CVec<T> lse, CHeads<T> q, CHeads<T> k, CHeads<T> v, int B, int Tq, int Tk,
                        int NH, int HS, const AttentionConfig& cfg, bool accumulate) {
  check_config(cfg, B, Tq, Tk, NH, HS);
  const int C = NH * HS;
  check_heads("attention_backward q", q, B, Tq, C);
  check_heads("attention_backward k", k, B, Tk, C);
  check_heads("attention_backward v", v, B, Tk, C);
  check_heads("attention_backward dq", dq, B, Tq, C);
  check_heads("attention_backward dk", dk, B, Tk, C);
  check_heads("attention_backward dv", dv, B, Tk, C);
  require_len("attention_backward dout", dout.extent(0), std::size_t(B) * Tq * C);
  require_len("attention_backward out", out.extent(0), std::size_t(B) * Tq * C);
  require_len("attention_backward lse", lse.extent(0), std::size_t(B) * NH * Tq);
  if (!accumulate) {
    zero_heads(dq, B, Tq, C);
    zero_heads(dk, B, Tk, C);
    zero_heads(dv, B, Tk, C);
  }

  const int bq = block_rows(cfg.q_block, Tq);
  const int bk = block_rows(cfg.k_block, Tk);
  // workspace: P (bq, bk) | dP, then dS (bq, bk) | D = rowsum(dO * O) (bq)
  const std::size_t p_off = 0, ds_off = std::size_t(bq) * bk, d_off = 2 * std::size_t(bq) * bk;
  TrackedView<T> work(MemCategory::workspace, "attention_backward_work", d_off + bq);
  const Vec<T> ws = work.view();
  T* const wsp = ws.data();
  const T scale = T(1) / std::sqrt(T(HS));
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const bool causal = cfg.causal;

  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i0 = 0; i0 < Tq; i0 += bq) {
        const int nq = i0 + bq <= Tq ? bq : Tq - i0;
        const int q_pos_first = cfg.q_pos0 + i0;
        const std::size_t head = std::size_t(h) * HS;
        const std::size_t q_at = q.at(b, i0, Tq) + head;
        const std::size_t dq_at = dq.at(b, i0, Tq) + head;
        const std::size_t o_at = (std::size_t(b) * Tq + i0) * C + head;  // in out and dout
        const T* const outp = out.data() + o_at;
        const T* const doutp = dout.data() + o_at;
        const T* const lsep = lse.data() + (std::size_t(b) * NH + h) * Tq + i0;
        Kokkos::parallel_for(
            "ptrain::attention_backward_rowdot", nq, KOKKOS_LAMBDA(int r) {
              wsp[d_off + r] =
                  detail::row_dot(doutp + std::size_t(r) * C, outp + std::size_t(r) * C, HS);
            });
        for (int j0 = 0; j0 < Tk; j0 += bk) {
          const int nk = j0 + bk <= Tk ? bk : Tk - j0;
          const int k_pos_first = cfg.k_pos0 + j0;
          if (block_masked(cfg, q_pos_first + nq - 1, k_pos_first)) break;
          const std::size_t k_at = k.at(b, j0, Tk) + head;
          const std::size_t v_at = v.at(b, j0, Tk) + head;
          // P (nq, nk) = exp(scale Q K^T - lse), masked entries 0
          gemm<T>(false, true, nq, nk, HS, scale, q.view, q_at, q.ld, k.view, k_at, k.ld, T(0), ws,
                  p_off, nk);
          Kokkos::parallel_for(
              "ptrain::attention_backward_probs", nq, KOKKOS_LAMBDA(int r) {
                T* p = wsp + p_off + std::size_t(r) * nk;
                const T l = lsep[r];
                const int nv =
                    l == neg_inf ? 0 : visible_keys(causal, q_pos_first + r, k_pos_first, nk);
                for (int c = 0; c < nv; ++c) p[c] = detail::exp_(p[c] - l);
                for (int c = nv; c < nk; ++c) p[c] = T(0);
              });
          // dV_blk (nk, HS) += P^T dO
          gemm<T>(true, false, nk, HS, nq, T(1), ws, p_off, nk, dout, o_at, C, T(1), dv.view,
                  dv.at(b, j0, Tk) + head, dv.ld);
          // dP (nq, nk) = dO V_blk^T
          gemm<T>(false, true, nq, nk, HS, T(1), dout, o_at, C, v.view, v_at, v.ld, T(0), ws,
                  ds_off, nk);
          // dS = scale P (dP - D)   (scale: S was scale Q K^T)
          Kokkos::parallel_for(
              "ptrain::attention_backward_dscores", nq, KOKKOS_LAMBDA(int r) {
                const T* p = wsp + p_off + std::size_t(r) * nk;
                T* ds = wsp + ds_off + std::size_t(r) * nk;
                const T dr = wsp[d_off + r];
                for (int c = 0; c < nk; ++c) ds[c] = scale * p[c] * (ds[c] - dr);
              });
          // dQ_blk (nq, HS) += dS K_blk ; dK_blk (nk, HS) += dS^T Q_blk
          gemm<T>(false, false, nq, HS, nk, T(1), ws, ds_off, nk, k.view, k_at, k.ld, T(1), dq.view,
                  dq_at, dq.ld);
          gemm<T>(true, false, nk, HS, nq, T(1), ws, ds_off, nk, q.view, q_at, q.ld, T(1), dk.view,
                  dk.at(b, j0, Tk) + head, dk.ld);
        }
      }
}

template <class T>
void attention_backward(Vec<T> dqkv, CVec<T> dout, CVec<T> out, CVec<T> lse, CVec<T> qkv, int B,
                        int T_, int NH, int HS, const AttentionConfig& cfg) {
  const int C = NH * HS;
  attention_backward<T>(qkv_part<T>(dqkv, 0, C), qkv_part<T>(dqkv, 1, C), qkv_part<T>(dqkv, 2, C),
                        dout, out, lse, qkv_part<const T>(qkv, 0, C), qkv_part<const T>(qkv, 1, C),
                        qkv_part<const T>(qkv, 2, C), B, T_, T_, NH, HS, cfg, false);
}

template <class T>
void attention_merge(Vec<T> out_a, Vec<T> lse_a, CVec<T> out_b, CVec<T> lse_b, int B, int T_,
                     int NH, int HS) {
  const int C = NH * HS;
  require_len("attention_merge out_a", out_a.extent(0), std::size_t(B) * T_ * C);
  require_len("attention_merge out_b", out_b.extent(0), std::size_t(B) * T_ * C);
  require_len("attention_merge lse_a", lse_a.extent(0), std::size_t(B) * NH * T_);
  require_len("attention_merge lse_b", lse_b.extent(0), std::size_t(B) * NH * T_);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  Kokkos::parallel_for(
      "ptrain::attention_merge", B * NH * T_, KOKKOS_LAMBDA(int i) {
        // i = (b*NH + h)*T + t, the lse index
        const int t = i % T_, bh = i / T_, h = bh % NH, b = bh / NH;
        const T la = lse_a(i), lb = lse_b(i);
        const T m = la > lb ? la : lb;
        T* oa = out_a.data() + (std::size_t(b) * T_ + t) * C + std::size_t(h) * HS;
        const T* ob = out_b.data() + (std::size_t(b) * T_ + t) * C + std::size_t(h) * HS;
        if (m == neg_inf) {  // neither part saw a key
          for (int d = 0; d < HS; ++d) oa[d] = T(0);
          lse_a(i) = neg_inf;
          return;
        }
        const T wa = la == neg_inf ? T(0) : detail::exp_(la - m);
        const T wb = lb == neg_inf ? T(0) : detail::exp_(lb - m);
        const T sum = wa + wb, ia = wa / sum, ib = wb / sum;
        for (int d = 0; d < HS; ++d) oa[d] = ia * oa[d] + ib * ob[d];
        lse_a(i) = m + detail::log_(sum);
      });
}

#define PTRAIN_INSTANTIATE(T)                                                                    \
  template void attention_forward<T>(Vec<T>, Vec<T>, CHeads<T>, CHeads<T>, CHeads<T>, int, int,  \
                                     int, int, int, const AttentionConfig&);                     \
  template void attention_forward<T>(Vec<T>, Vec<T>, CVec<T>, int, int, int, int,                \
                                     const AttentionConfig&);                                    \
  template void attention_backward<T>(Heads<T>, Heads<T>, Heads<T>, CVec<T>, CVec<T>, CVec<T>,   \
                                      CHeads<T>, CHeads<T>, CHeads<T>, int, int, int, int, int,  \
                                      const AttentionConfig&, bool);                             \
  template void attention_backward<T>(Vec<T>, CVec<T>, CVec<T>, CVec<T>, CVec<T>, int, int, int, \
                                      int, const AttentionConfig&);                              \
  template void attention_merge<T>(Vec<T>, Vec<T>, CVec<T>, CVec<T>, int, int, int, int);
PTRAIN_INSTANTIATE(float)
PTRAIN_INSTANTIATE(double)
#undef PTRAIN_INSTANTIATE

}  // namespace ptrain::kernels
