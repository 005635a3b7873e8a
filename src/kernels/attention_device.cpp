// kernels/attention_device.cpp — the GPU-shaped attention kernel (KernelShape::device).
// A team of threads per (b, h, tile); each thread owns whole rows of its tile (one query row
// in the forward and in dQ, one key row in dK and dV) and walks the other side's tile, which
// the team stages in scratch, in order. So each output element is summed by one thread in a
// fixed order: the result does not depend on the team size, and nothing is added atomically.
// The backward is two launches: dK and dV over key tiles, then dQ over query tiles, each
// recomputing the probabilities from lse (flash-attention's backward, without its atomics).
//
// Tiles are sized so a team's scratch fits kDeviceScratchBytes (48 KiB, what a CUDA block gets
// without opting in to more); rows in scratch are HS + 1 apart, so the threads of a tile, each
// on its own row, hit different shared-memory banks. All operands are widened to the
// accumulate type A in scratch (fp32 for bf16), and each output element is rounded once.
#include <cmath>
#include <cstddef>
#include <limits>

#include "kernels/attention_detail.hpp"
#include "kernels/detail_math.hpp"
#include "util/element_types.hpp"
#include "util/error.hpp"

namespace ptrain::kernels::detail {
namespace {

// dst: (n, ld) [=] n rows of HS elements of src (rows src_ld apart), widened to A, by the team:
// consecutive threads take consecutive elements (coalesced on a GPU).
template <class A, class T>
KOKKOS_INLINE_FUNCTION void load_tile(const Member& m, A* dst, int ld, const T* src,
                                      std::size_t src_ld, int n, int HS) {
  Kokkos::parallel_for(Kokkos::TeamThreadRange(m, n * HS), [&](int e) {
    const int r = e / HS, d = e % HS;
    dst[std::size_t(r) * ld + d] = A(src[std::size_t(r) * src_ld + d]);
  });
}

template <class A>
KOKKOS_INLINE_FUNCTION void zero_tile(const Member& m, A* dst, int ld, int n, int HS) {
  Kokkos::parallel_for(Kokkos::TeamThreadRange(m, n * HS),
                       [&](int e) { dst[std::size_t(e / HS) * ld + e % HS] = A(0); });
}

// dst rows (src_ld apart) [=] T(acc), or with accumulate T(A(dst) + acc): one rounding.
template <class T, class A>
KOKKOS_INLINE_FUNCTION void store_tile(const Member& m, T* dst, std::size_t dst_ld, const A* acc,
                                       int ld, int n, int HS, bool accumulate) {
  Kokkos::parallel_for(Kokkos::TeamThreadRange(m, n * HS), [&](int e) {
    const int r = e / HS, d = e % HS;
    T& o = dst[std::size_t(r) * dst_ld + d];
    const A a = acc[std::size_t(r) * ld + d];
    o = accumulate ? T(A(o) + a) : T(a);
  });
}

// sum_d x[d] y[d], in order.
template <class A>
KOKKOS_INLINE_FUNCTION A dot(const A* x, const A* y, int n) {
  A s = 0;
  for (int d = 0; d < n; ++d) s += x[d] * y[d];
  return s;
}

// Each launch's scratch, in elements of A, for query tiles of bq rows and key tiles of bk.
// Tiles of rows are (rows, ld = HS + 1).
struct ForwardLayout {  // Q | output accumulator (bq) | K | V (bk) | scores (bq, bk + 1) | m | l
  int bq, bk, ld, sld;
  std::size_t q, acc, k, v, s, m, l, elems;
  ForwardLayout(int bq_, int bk_, int HS) : bq(bq_), bk(bk_), ld(HS + 1), sld(bk_ + 1) {
    q = 0;
    acc = q + std::size_t(bq) * ld;
    k = acc + std::size_t(bq) * ld;
    v = k + std::size_t(bk) * ld;
    s = v + std::size_t(bk) * ld;
    m = s + std::size_t(bq) * sld;
    l = m + bq;
    elems = l + bq;
  }
};
struct KeyLayout {  // dK and dV: K | V | dK | dV (bk) | Q | dO (bq) | lse | D (bq)
  int bq, bk, ld;
  std::size_t k, v, dk, dv, q, dout, lse, D, elems;
  KeyLayout(int bq_, int bk_, int HS) : bq(bq_), bk(bk_), ld(HS + 1) {
    k = 0;
    v = k + std::size_t(bk) * ld;
    dk = v + std::size_t(bk) * ld;
    dv = dk + std::size_t(bk) * ld;
    q = dv + std::size_t(bk) * ld;
    dout = q + std::size_t(bq) * ld;
    lse = dout + std::size_t(bq) * ld;
    D = lse + bq;
    elems = D + bq;
  }
};
struct QueryLayout {  // dQ: Q | dO | dQ (bq) | lse | D (bq) | K | V (bk)
  int bq, bk, ld;
  std::size_t q, dout, dq, lse, D, k, v, elems;
  QueryLayout(int bq_, int bk_, int HS) : bq(bq_), bk(bk_), ld(HS + 1) {
    q = 0;
    dout = q + std::size_t(bq) * ld;
    dq = dout + std::size_t(bq) * ld;
    lse = dq + std::size_t(bq) * ld;
    D = lse + bq;
    k = D + bq;
    v = k + std::size_t(bk) * ld;
    elems = v + std::size_t(bk) * ld;
  }
};

// The query tile at i0 of (b, h) into a backward Layout's scratch: Q and dO widened, lse,
// and D = rowsum(dO * O) summed from the tensors in order. out, dout: (B, Tq, NH*HS).
template <class Layout, class T, class A>
KOKKOS_INLINE_FUNCTION void load_queries(const Member& team, A* w, const Layout& L,
                                         const Heads<const T>& q,
                                         const Kokkos::View<const T*>& dout,
                                         const Kokkos::View<const T*>& out,
                                         const Kokkos::View<const A*>& lse, int b, int h, int i0,
                                         int nq, int Tq, int NH, int HS) {
  const std::size_t C = std::size_t(NH) * HS, head = std::size_t(h) * HS;
  const std::size_t o_row = (std::size_t(b) * Tq + i0) * C + head;  // in out and dout
  load_tile(team, w + L.q, L.ld, q.view.data() + q.at(b, i0, Tq) + head, q.ld, nq, HS);
  load_tile(team, w + L.dout, L.ld, dout.data() + o_row, C, nq, HS);
  const A* const lsep = lse.data() + (std::size_t(b) * NH + h) * Tq + i0;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](int r) {
    w[L.lse + r] = lsep[r];
    const T* const o = out.data() + o_row + std::size_t(r) * C;
    const T* const g = dout.data() + o_row + std::size_t(r) * C;
    A s = 0;
    for (int d = 0; d < HS; ++d) s += A(g[d]) * A(o[d]);
    w[L.D + r] = s;
  });
}

// The tile a team owns: team = (b*NH + h)*tiles + tile, the tile's rows [first, first + n) of
// T in tiles of `rows`, and its head's first column.
struct TileOf {
  int b, h, first, n;
  std::size_t head;
};
KOKKOS_INLINE_FUNCTION TileOf tile_of(const Member& team, int tiles, int rows, int T, int NH,
                                      int HS) {
  const int tile = team.league_rank() % tiles, bh = team.league_rank() / tiles;
  const int first = tile * rows;
  return {bh / NH, bh % NH, first, first + rows <= T ? rows : T - first, std::size_t(bh % NH) * HS};
}

// The key tile at j0 of (b, head) into a Layout's scratch: K and V widened.
template <class Layout, class T, class A>
KOKKOS_INLINE_FUNCTION void load_keys(const Member& team, A* w, const Layout& L,
                                      const Heads<const T>& k, const Heads<const T>& v, int b,
                                      int j0, int nk, int Tk, std::size_t head, int HS) {
  load_tile(team, w + L.k, L.ld, k.view.data() + k.at(b, j0, Tk) + head, k.ld, nk, HS);
  load_tile(team, w + L.v, L.ld, v.view.data() + v.at(b, j0, Tk) + head, v.ld, nk, HS);
}

// The largest tiles, from the config's blocks (at most 64 rows) down by halving the larger
// side, whose Layout fits kDeviceScratchBytes.
template <class Layout, class A>
Layout fit_tiles(int Tq, int Tk, int HS, const AttentionConfig& cfg) {
  int bq = block_rows(cfg.q_block < 64 ? cfg.q_block : 64, Tq);
  int bk = block_rows(cfg.k_block < 64 ? cfg.k_block : 64, Tk);
  for (;;) {
    const Layout l(bq, bk, HS);
    if (l.elems * sizeof(A) <= kDeviceScratchBytes) return l;
    PTRAIN_REQUIRE(bq > 1 || bk > 1, "attention: head size ", HS, " needs ", l.elems * sizeof(A),
                   " B of team scratch even for 1-row tiles, over ", kDeviceScratchBytes, " B");
    if (bk >= bq && bk > 1)
      bk = (bk + 1) / 2;
    else
      bq = (bq + 1) / 2;
  }
}

// Threads a team: the config's, else one per tile row on a device and one on a host (whose
// teams are the parallelism); never more than the space allows for this kernel.
template <class F>
void launch(const char* name, int league, int rows, const AttentionConfig& cfg,
            std::size_t scratch_bytes, const F& body) {
  if (league == 0) return;
  // Host spaces report a nominal level-0 limit (32 KiB) that their teams do not have.
  PTRAIN_REQUIRE(!PTRAIN_DEVICE_BUILD || scratch_bytes <= std::size_t(Team::scratch_size_max(0)),
                 name, ": ", scratch_bytes, " B of team scratch, over the ",
                 Team::scratch_size_max(0), " B this execution space allows");
  int threads = cfg.team_size > 0 ? cfg.team_size : (PTRAIN_DEVICE_BUILD ? rows : 1);
  const Team probe = Team(league, 1).set_scratch_size(0, Kokkos::PerTeam(scratch_bytes));
  const int most = probe.team_size_max(body, Kokkos::ParallelForTag());
  threads = threads < most ? threads : most;
  Kokkos::parallel_for(
      name, Team(league, threads).set_scratch_size(0, Kokkos::PerTeam(scratch_bytes)), body);
}

}  // namespace

template <class T>
AttentionScratch device_attention_scratch(int Tq, int Tk, int HS, const AttentionConfig& cfg) {
  using A = accumulate_t<T>;
  const std::size_t f = fit_tiles<ForwardLayout, A>(Tq, Tk, HS, cfg).elems;
  const std::size_t k = fit_tiles<KeyLayout, A>(Tq, Tk, HS, cfg).elems;
  const std::size_t q = fit_tiles<QueryLayout, A>(Tq, Tk, HS, cfg).elems;
  return {f * sizeof(A), (k > q ? k : q) * sizeof(A)};
}

template <class T>
void device_attention_forward(Vec<T> out, Vec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k,
                              CHeads<T> v, int B, int Tq, int Tk, int NH, int HS,
                              const AttentionConfig& cfg) {
  using A = accumulate_t<T>;
  const ForwardLayout L = fit_tiles<ForwardLayout, A>(Tq, Tk, HS, cfg);
  const int bq = L.bq, bk = L.bk, C = NH * HS, q_tiles = (Tq + bq - 1) / bq;
  const A scale = A(1) / std::sqrt(A(HS));
  const A neg_inf = -std::numeric_limits<A>::infinity();
  const bool causal = cfg.causal;
  const int q_pos0 = cfg.q_pos0, k_pos0 = cfg.k_pos0;
  // x: (B, T, C) in heads of HS; out: (B, Tq, C); lse: (B, NH, Tq)
  const auto body = KOKKOS_LAMBDA(const Member& team) {
    const TileOf t = tile_of(team, q_tiles, bq, Tq, NH, HS);
    const int b = t.b, h = t.h, i0 = t.first, nq = t.n, q_pos_first = q_pos0 + i0;
    const std::size_t head = t.head;
    A* const w = scratch<A>(team, L.elems);
    load_tile(team, w + L.q, L.ld, q.view.data() + q.at(b, i0, Tq) + head, q.ld, nq, HS);
    zero_tile(team, w + L.acc, L.ld, nq, HS);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](int r) {
      w[L.m + r] = neg_inf;
      w[L.l + r] = A(0);
    });
    for (int j0 = 0; j0 < Tk; j0 += bk) {
      const int nk = j0 + bk <= Tk ? bk : Tk - j0;
      const int k_pos_first = k_pos0 + j0;
      if (block_masked(causal, q_pos_first + nq - 1, k_pos_first)) break;
      team.team_barrier();
      load_keys(team, w, L, k, v, b, j0, nk, Tk, head, HS);
      team.team_barrier();
      // Row r's online-softmax step over the tile: s = scale q_r K^T on its visible keys,
      // running max m and sum l updated, acc = acc * exp(m - m') + p V.
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](int r) {
        const int nv = visible_keys(causal, q_pos_first + r, k_pos_first, nk);
        if (nv == 0) return;
        const A* const qr = w + L.q + std::size_t(r) * L.ld;
        A* const s = w + L.s + std::size_t(r) * L.sld;
        A m_blk = neg_inf;
        for (int c = 0; c < nv; ++c) {
          s[c] = scale * dot(qr, w + L.k + std::size_t(c) * L.ld, HS);
          m_blk = s[c] > m_blk ? s[c] : m_blk;
        }
        const A m_old = w[L.m + r];
        const A m_new = m_old > m_blk ? m_old : m_blk;
        const A corr = m_old == neg_inf ? A(0) : exp_(m_old - m_new);
        A sum = 0;
        for (int c = 0; c < nv; ++c) {
          s[c] = exp_(s[c] - m_new);
          sum += s[c];
        }
        w[L.l + r] = w[L.l + r] * corr + sum;
        w[L.m + r] = m_new;
        A* const acc = w + L.acc + std::size_t(r) * L.ld;
        for (int d = 0; d < HS; ++d) {
          A a = acc[d] * corr;
          for (int c = 0; c < nv; ++c) a += s[c] * w[L.v + std::size_t(c) * L.ld + d];
          acc[d] = a;
        }
      });
    }
    team.team_barrier();
    T* const outp = out.data() + (std::size_t(b) * Tq + i0) * C + head;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq * HS), [&](int e) {
      const int r = e / HS, d = e % HS;
      const A l = w[L.l + r];
      outp[std::size_t(r) * C + d] = T(l > A(0) ? w[L.acc + std::size_t(r) * L.ld + d] / l : A(0));
    });
    A* const lsep = lse.data() + (std::size_t(b) * NH + h) * Tq + i0;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](int r) {
      const A l = w[L.l + r];
      lsep[r] = l > A(0) ? w[L.m + r] + log_(l) : neg_inf;
    });
  };
  launch("ptrain::attention_forward(device)", B * NH * q_tiles, bq, cfg, L.elems * sizeof(A), body);
}

namespace {

// One backward call's operands and constants, as its two launches read them.
template <class T>
struct Backward {
  using A = accumulate_t<T>;
  Heads<T> dq, dk, dv;
  CVec<T> dout, out;
  CVec<A> lse;
  CHeads<T> q, k, v;
  int B, Tq, Tk, NH, HS, q_pos0, k_pos0;
  bool causal, accumulate;
  A scale, neg_inf;
};

// For query row q_r and key k_c (rows in scratch): p = exp(scale q.k - lse) and
// dS = scale p (dO.v - D), with the row's lse and D.
template <class A>
struct ScoreGrad {
  A p, ds;
};
template <class A>
KOKKOS_INLINE_FUNCTION ScoreGrad<A> score_grad(const A* qr, const A* kc, const A* dor, const A* vc,
                                               A lse, A D, A scale, int HS) {
  const A p = exp_(scale * dot(qr, kc, HS) - lse);
  return {p, scale * p * (dot(dor, vc, HS) - D)};
}

// dK and dV: a team per (b, h, key tile), a thread per key row c, over the query rows that
// see it: dV_c += p dO, dK_c += dS q.
template <class T>
void backward_keys(const Backward<T>& a, const AttentionConfig& cfg) {
  using A = accumulate_t<T>;
  const KeyLayout KL = fit_tiles<KeyLayout, A>(a.Tq, a.Tk, a.HS, cfg);
  const int k_tiles = (a.Tk + KL.bk - 1) / KL.bk;
  const auto body = KOKKOS_LAMBDA(const Member& team) {
    const int Tq = a.Tq, Tk = a.Tk, HS = a.HS;
    const TileOf t = tile_of(team, k_tiles, KL.bk, Tk, a.NH, HS);
    const int j0 = t.first, nk = t.n, k_pos_first = a.k_pos0 + j0;
    A* const w = scratch<A>(team, KL.elems);
    load_keys(team, w, KL, a.k, a.v, t.b, j0, nk, Tk, t.head, HS);
    zero_tile(team, w + KL.dk, KL.ld, nk, HS);
    zero_tile(team, w + KL.dv, KL.ld, nk, HS);
    for (int i0 = 0; i0 < Tq; i0 += KL.bq) {
      const int nq = i0 + KL.bq <= Tq ? KL.bq : Tq - i0;
      const int q_pos_first = a.q_pos0 + i0;
      if (block_masked(a.causal, q_pos_first + nq - 1, k_pos_first)) continue;
      team.team_barrier();
      load_queries(team, w, KL, a.q, a.dout, a.out, a.lse, t.b, t.h, i0, nq, Tq, a.NH, HS);
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nk), [&](int c) {
        const A* const kc = w + KL.k + std::size_t(c) * KL.ld;
        const A* const vc = w + KL.v + std::size_t(c) * KL.ld;
        A* const dkc = w + KL.dk + std::size_t(c) * KL.ld;
        A* const dvc = w + KL.dv + std::size_t(c) * KL.ld;
        const int seen = a.causal ? k_pos_first + c - q_pos_first : 0;  // first row seeing c
        for (int r = seen < 0 ? 0 : seen; r < nq; ++r) {
          if (w[KL.lse + r] == a.neg_inf) continue;
          const A* const qr = w + KL.q + std::size_t(r) * KL.ld;
          const A* const dor = w + KL.dout + std::size_t(r) * KL.ld;
          const ScoreGrad<A> g =
              score_grad(qr, kc, dor, vc, w[KL.lse + r], w[KL.D + r], a.scale, HS);
          for (int d = 0; d < HS; ++d) {
            dvc[d] += g.p * dor[d];
            dkc[d] += g.ds * qr[d];
          }
        }
      });
    }
    team.team_barrier();
    store_tile(team, a.dk.view.data() + a.dk.at(t.b, j0, Tk) + t.head, a.dk.ld, w + KL.dk, KL.ld,
               nk, HS, a.accumulate);
    store_tile(team, a.dv.view.data() + a.dv.at(t.b, j0, Tk) + t.head, a.dv.ld, w + KL.dv, KL.ld,
               nk, HS, a.accumulate);
  };
  launch("ptrain::attention_backward_dkdv(device)", a.B * a.NH * k_tiles, KL.bk, cfg,
         KL.elems * sizeof(A), body);
}

// dQ: a team per (b, h, query tile), a thread per query row r, over its visible keys:
// dQ_r += dS k.
template <class T>
void backward_queries(const Backward<T>& a, const AttentionConfig& cfg) {
  using A = accumulate_t<T>;
  const QueryLayout QL = fit_tiles<QueryLayout, A>(a.Tq, a.Tk, a.HS, cfg);
  const int q_tiles = (a.Tq + QL.bq - 1) / QL.bq;
  const auto body = KOKKOS_LAMBDA(const Member& team) {
    const int Tq = a.Tq, Tk = a.Tk, HS = a.HS;
    const TileOf t = tile_of(team, q_tiles, QL.bq, Tq, a.NH, HS);
    const int i0 = t.first, nq = t.n, q_pos_first = a.q_pos0 + i0;
    A* const w = scratch<A>(team, QL.elems);
    load_queries(team, w, QL, a.q, a.dout, a.out, a.lse, t.b, t.h, i0, nq, Tq, a.NH, HS);
    zero_tile(team, w + QL.dq, QL.ld, nq, HS);
    for (int j0 = 0; j0 < Tk; j0 += QL.bk) {
      const int nk = j0 + QL.bk <= Tk ? QL.bk : Tk - j0;
      const int k_pos_first = a.k_pos0 + j0;
      if (block_masked(a.causal, q_pos_first + nq - 1, k_pos_first)) break;
      team.team_barrier();
      load_keys(team, w, QL, a.k, a.v, t.b, j0, nk, Tk, t.head, HS);
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](int r) {
        if (w[QL.lse + r] == a.neg_inf) return;
        const int nv = visible_keys(a.causal, q_pos_first + r, k_pos_first, nk);
        const A* const qr = w + QL.q + std::size_t(r) * QL.ld;
        const A* const dor = w + QL.dout + std::size_t(r) * QL.ld;
        A* const dqr = w + QL.dq + std::size_t(r) * QL.ld;
        for (int c = 0; c < nv; ++c) {
          const A* const kc = w + QL.k + std::size_t(c) * QL.ld;
          const ScoreGrad<A> g = score_grad(qr, kc, dor, w + QL.v + std::size_t(c) * QL.ld,
                                            w[QL.lse + r], w[QL.D + r], a.scale, HS);
          for (int d = 0; d < HS; ++d) dqr[d] += g.ds * kc[d];
        }
      });
    }
    team.team_barrier();
    store_tile(team, a.dq.view.data() + a.dq.at(t.b, i0, Tq) + t.head, a.dq.ld, w + QL.dq, QL.ld,
               nq, HS, a.accumulate);
  };
  launch("ptrain::attention_backward_dq(device)", a.B * a.NH * q_tiles, QL.bq, cfg,
         QL.elems * sizeof(A), body);
}

}  // namespace

template <class T>
void device_attention_backward(Heads<T> dq, Heads<T> dk, Heads<T> dv, CVec<T> dout, CVec<T> out,
                               CVec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k, CHeads<T> v,
                               int B, int Tq, int Tk, int NH, int HS, const AttentionConfig& cfg,
                               bool accumulate) {
  using A = accumulate_t<T>;
  const Backward<T> a{dq,
                      dk,
                      dv,
                      dout,
                      out,
                      lse,
                      q,
                      k,
                      v,
                      B,
                      Tq,
                      Tk,
                      NH,
                      HS,
                      cfg.q_pos0,
                      cfg.k_pos0,
                      cfg.causal,
                      accumulate,
                      A(1) / std::sqrt(A(HS)),
                      -std::numeric_limits<A>::infinity()};
  backward_keys(a, cfg);
  backward_queries(a, cfg);
}

#define PTRAIN_INSTANTIATE(T)                                                                      \
  template AttentionScratch device_attention_scratch<T>(int, int, int, const AttentionConfig&);    \
  template void device_attention_forward<T>(Vec<T>, Vec<accumulate_t<T>>, CHeads<T>, CHeads<T>,    \
                                            CHeads<T>, int, int, int, int, int,                    \
                                            const AttentionConfig&);                               \
  template void device_attention_backward<T>(                                                      \
      Heads<T>, Heads<T>, Heads<T>, CVec<T>, CVec<T>, CVec<accumulate_t<T>>, CHeads<T>, CHeads<T>, \
      CHeads<T>, int, int, int, int, int, const AttentionConfig&, bool);
PTRAIN_INSTANTIATE(float)
PTRAIN_INSTANTIATE(double)
PTRAIN_INSTANTIATE(bf16)
#undef PTRAIN_INSTANTIATE

}  // namespace ptrain::kernels::detail
