// kernels/attention_host.cpp — the CPU attention kernel (KernelShape::host): a block per
// (b, h, query block) in the forward and per (b, h) in the backward (which owns that head's dK
// and dV, so nothing races and the result does not depend on the thread count), run by one
// thread each with scratch of its own (kernels/parallel.hpp: the rank's host threads, on a
// Serial Kokkos too). The block products are in-kernel loops over that scratch, not gemm
// calls: on CPU threads, one small BLAS call and one parallel region per block cost more in
// fork/join than the block's arithmetic. Device builds do not build it (attention.hpp).
//
// Storage type T, arithmetic in A = accumulate_t<T>. For float and double A is T: the blocks
// read Q, V, dO and K rows where they lie and dQ, dK, dV accumulate in place. For bf16 every
// block operand is widened to fp32 in scratch first, so the block code below runs on float
// exactly as for a float call; dK and dV accumulate in fp32 scratch per key block and dQ in
// fp32 scratch over the whole head, each rounded to bf16 once, when stored.
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

#include "kernels/attention_detail.hpp"
#include "kernels/detail_math.hpp"
#include "kernels/parallel.hpp"
#include "util/element_types.hpp"

#if !PTRAIN_DEVICE_BUILD
namespace ptrain::kernels::detail {
namespace {

// Score columns a row group computes: its last row's visible keys kmax, rounded up to whole
// tiles (within nk). Past kmax every score of the group is masked, so on a causal diagonal
// block the products do about half the work.
KOKKOS_INLINE_FUNCTION int score_columns(int kmax, int nk, int tile) {
  const int n = (kmax + tile - 1) / tile * tile;
  return n < nk ? n : nk;
}

// The block products, on raw rows, R rows at a time: y[u] (n) [=] alpha x[u] (k) @ M (k, n)
// + beta y[u] for u < R, where x[u]'s elements are incx apart and M's rows ldm apart. The R
// rows share each load of M, and columns go in tiles of kTile accumulators that stay in
// vector registers across the whole sum (a plain y[j] += x[i] M[i][j] loop would wait on the
// store of y every step). Each element adds its k terms in order, so the result does not
// depend on R or the tiling.
constexpr int kTile = 16;

// On a host compiler with GNU vector types, a whole tile is one vector value. GCC 12 does not
// vectorise the plain loops below into registers for one or two tiles (it kept their sums on
// the stack: 38-46 GFLOP/s on one core against 200-220 for three or four tiles); with vector
// types every tile count runs at 140-210.
#if !PTRAIN_KERNELS_DEVICE_PASS && (defined(__GNUC__) || defined(__clang__))
#define PTRAIN_ATTENTION_TILE_VECTORS 1
template <class T>
struct TileVector;
template <>
struct TileVector<float> {
  typedef float type __attribute__((vector_size(kTile * sizeof(float))));
};
template <>
struct TileVector<double> {
  typedef double type __attribute__((vector_size(kTile * sizeof(double))));
};
#else
#define PTRAIN_ATTENTION_TILE_VECTORS 0
#endif

template <class T, int R, int Tiles, bool Partial>
KOKKOS_INLINE_FUNCTION void vec_mat_tiles(T* const (&y)[R], const T* const (&x)[R], int incx,
                                          const T* M, int ldm, int k, T alpha, T beta, int j,
                                          int width) {
  static_assert(!Partial || Tiles == 1, "only a single tile may be partial");
#if PTRAIN_ATTENTION_TILE_VECTORS
  if constexpr (!Partial) {
    using V = typename TileVector<T>::type;
    V acc[R][Tiles] = {};
    for (int i = 0; i < k; ++i) {
      const T* m = M + std::size_t(i) * ldm + j;
      V mv[Tiles];
      for (int t = 0; t < Tiles; ++t) __builtin_memcpy(&mv[t], m + t * kTile, sizeof(V));
      for (int u = 0; u < R; ++u) {
        const T xi = x[u][std::size_t(i) * incx];
        for (int t = 0; t < Tiles; ++t) acc[u][t] += xi * mv[t];
      }
    }
    for (int u = 0; u < R; ++u)
      for (int t = 0; t < Tiles; ++t) {
        T* const out = y[u] + j + t * kTile;
        V o;
        if (beta == T(0)) {
          o = alpha * acc[u][t];
        } else {
          __builtin_memcpy(&o, out, sizeof(V));
          o = beta * o + alpha * acc[u][t];
        }
        __builtin_memcpy(out, &o, sizeof(V));
      }
    return;
  }
#endif
  T acc[R][Tiles][kTile] = {};
  for (int i = 0; i < k; ++i) {
    const T* m = M + std::size_t(i) * ldm + j;
    for (int u = 0; u < R; ++u) {
      const T xi = x[u][std::size_t(i) * incx];
      for (int t = 0; t < Tiles; ++t)
        for (int l = 0; l < kTile; ++l)
          if (!Partial || l < width) acc[u][t][l] += xi * m[t * kTile + l];
    }
  }
  for (int u = 0; u < R; ++u)
    for (int t = 0; t < Tiles; ++t)
      for (int l = 0; l < kTile; ++l) {
        if (Partial && l >= width) break;
        T& out = y[u][j + t * kTile + l];
        out = beta == T(0) ? alpha * acc[u][t][l] : beta * out + alpha * acc[u][t][l];
      }
}

template <class T, int R>
KOKKOS_INLINE_FUNCTION void vec_mat(T* const (&y)[R], const T* const (&x)[R], int incx, const T* M,
                                    int ldm, int k, int n, T alpha, T beta) {
  int j = 0;
  for (; j + 4 * kTile <= n; j += 4 * kTile)
    vec_mat_tiles<T, R, 4, false>(y, x, incx, M, ldm, k, alpha, beta, j, 4 * kTile);
  // Then up to three whole tiles together (each element of x loaded then feeds them all),
  // and one partial tile: with a runtime width GCC vectorises a tile poorly (attention at
  // head size 32 took 2.4-2.8x longer), so only the last has one.
  const int whole = (n - j) / kTile;  // 0 to 3
  if (whole == 3)
    vec_mat_tiles<T, R, 3, false>(y, x, incx, M, ldm, k, alpha, beta, j, 3 * kTile);
  else if (whole == 2)
    vec_mat_tiles<T, R, 2, false>(y, x, incx, M, ldm, k, alpha, beta, j, 2 * kTile);
  else if (whole == 1)
    vec_mat_tiles<T, R, 1, false>(y, x, incx, M, ldm, k, alpha, beta, j, kTile);
  j += whole * kTile;
  if (j < n) vec_mat_tiles<T, R, 1, true>(y, x, incx, M, ldm, k, alpha, beta, j, n - j);
}

// f(std::integral_constant<int, R>{}, r0) for rows r0 .. r0 + R - 1 of [0, n): groups of
// kRows, and one smaller last group. Six, not four: on one core four tiles of six rows ran at
// 205 GFLOP/s, of four rows at 145.
constexpr int kRows = 6;

template <class F>
inline void row_groups(int n, const F& f) {
  for (int r0 = 0; r0 < n; r0 += kRows) {
    switch (n - r0 < kRows ? n - r0 : kRows) {
      case 6:
        f(std::integral_constant<int, 6>{}, r0);
        break;
      case 5:
        f(std::integral_constant<int, 5>{}, r0);
        break;
      case 4:
        f(std::integral_constant<int, 4>{}, r0);
        break;
      case 3:
        f(std::integral_constant<int, 3>{}, r0);
        break;
      case 2:
        f(std::integral_constant<int, 2>{}, r0);
        break;
      default:
        f(std::integral_constant<int, 1>{}, r0);
        break;
    }
  }
}

#if PTRAIN_ATTENTION_TILE_VECTORS
// The (16, 16) tile at src (rows ld apart) transposed into dst (rows ldt apart): four butterfly
// stages of lane shuffles on whole rows, where element by element a tile takes 256 scalar loads
// and as many stores to 16 cache lines (at head size 32 and T = 128 the forward spent about as
// long packing K^T as multiplying by it).
template <class T>
inline void transpose_tile(T* dst, int ldt, const T* src, int ld) {
  using V = typename TileVector<T>::type;
  // Stage k: rows i and i + k (i & k == 0) swap the lanes l with l & k set of row i against
  // those without of row i + k, shifted by k.
  V r[kTile];
  for (int i = 0; i < kTile; ++i) __builtin_memcpy(&r[i], src + std::size_t(i) * ld, sizeof(V));
#define PTRAIN_BUTTERFLY(K, ...)                                         \
  for (int i = 0; i < kTile; ++i)                                        \
    if (!(i & K)) {                                                      \
      const V x = r[i], y = r[i + K];                                    \
      r[i] = __builtin_shufflevector(x, y, __VA_ARGS__);                 \
      r[i + K] = __builtin_shufflevector(x, y, PTRAIN_BUTTERFLY_HI_##K); \
    }
#define PTRAIN_BUTTERFLY_HI_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define PTRAIN_BUTTERFLY_HI_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define PTRAIN_BUTTERFLY_HI_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define PTRAIN_BUTTERFLY_HI_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
  PTRAIN_BUTTERFLY(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
  PTRAIN_BUTTERFLY(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
  PTRAIN_BUTTERFLY(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
  PTRAIN_BUTTERFLY(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
#undef PTRAIN_BUTTERFLY
#undef PTRAIN_BUTTERFLY_HI_8
#undef PTRAIN_BUTTERFLY_HI_4
#undef PTRAIN_BUTTERFLY_HI_2
#undef PTRAIN_BUTTERFLY_HI_1
  for (int i = 0; i < kTile; ++i) __builtin_memcpy(dst + std::size_t(i) * ldt, &r[i], sizeof(V));
}
#endif

// bt: (k, n) [=] transpose of the (n, k) rows src (row stride ld), widened to A: whole
// (16, 16) tiles by lane shuffles where A is T, the rest element by element.
template <class A, class T>
inline void pack_transposed(A* bt, const T* src, int ld, int n, int k) {
  int n16 = 0, k16 = 0;
#if PTRAIN_ATTENTION_TILE_VECTORS
  if constexpr (std::is_same_v<A, T>) {
    n16 = n / kTile * kTile, k16 = k / kTile * kTile;
    for (int c = 0; c < n16; c += kTile)
      for (int d = 0; d < k16; d += kTile)
        transpose_tile(bt + std::size_t(d) * n + c, n, src + std::size_t(c) * ld + d, ld);
  }
#endif
  for (int c = 0; c < n; ++c) {
    const T* row = src + std::size_t(c) * ld;
    for (int d = c < n16 ? k16 : 0; d < k; ++d) bt[std::size_t(d) * n + c] = A(row[d]);
  }
}

// dst: (n, k) rows k apart [=] the (n, k) rows src (row stride ld) widened to A, or zero
// when !keep (a fresh accumulator).
template <class A, class T>
inline void pack_rows(A* dst, const T* src, int ld, int n, int k, bool keep = true) {
  for (int r = 0; r < n; ++r) {
    const T* row = src + std::size_t(r) * ld;
    A* const o = dst + std::size_t(r) * k;
    for (int d = 0; d < k; ++d) o[d] = keep ? A(row[d]) : A(0);
  }
}

// dst: (n, k) rows ld apart [=] the (n, k) rows src (k apart) rounded to T: an accumulator's
// one rounding.
template <class T, class A>
inline void store_rows(T* dst, int ld, const A* src, int n, int k) {
  for (int r = 0; r < n; ++r) {
    T* const row = dst + std::size_t(r) * ld;
    const A* const s = src + std::size_t(r) * k;
    for (int d = 0; d < k; ++d) row[d] = T(s[d]);
  }
}

// x's rows t < n of batch b, head columns [head, head + HS), set to zero.
template <class T>
inline void zero_head_rows(const Heads<T>& x, int b, int n, std::size_t head, int HS) {
  for (int t = 0; t < n; ++t) {
    T* const row = x.view.data() + x.at(b, t, n) + head;
    for (int d = 0; d < HS; ++d) row[d] = T(0);
  }
}

// A block of rows as the products read (or accumulate into) them: its first row and row
// stride. Where T is its own accumulate type these are the tensor's rows; bf16 rows are
// widened into the block's scratch at w (rows k apart), an accumulator from the tensor when
// `keep`, else from zero (rounded back once, by store_rows).
template <class A>
struct Rows {
  A* p;
  int ld;
};
template <class A, class T>
inline Rows<const A> read_rows(A* w, const T* src, int ld, int n, int k) {
  if constexpr (kWidened<T>) {
    pack_rows(w, src, ld, n, k);
    return {w, k};
  } else {
    return {src, ld};
  }
}
// dQ's rows of the query block starting at row i0: the head's widened accumulator dqw (bf16),
// or dq's own rows.
template <class A, class T>
KOKKOS_INLINE_FUNCTION Rows<A> dq_rows(A* dqw, T* dq, int ld, int i0, int HS) {
  if constexpr (kWidened<T>) {
    return {dqw + std::size_t(i0) * HS, HS};
  } else {
    return {dq, ld};
  }
}
template <class A, class T>
inline Rows<A> accumulator_rows(A* w, T* dst, int ld, int n, int k, bool keep) {
  if constexpr (kWidened<T>) {
    pack_rows(w, dst, ld, n, k, keep);
    return {w, k};
  } else {
    return {dst, ld};
  }
}

// One query row's online-softmax step over a key block: s (nv) [=] exp(s - m') with m' the
// new running max m, the running sum l rescaled and extended, and acc (HS) rescaled. The max
// and the sum of the exponentials (taken as they are stored) are in 16 lanes combined
// pairwise (8 + 8, 4 + 4, ...): four dependent steps where a left-to-right pass over the lanes
// takes sixteen, which at head size 16 or 32 cost as much as the row's products.
template <class T>
inline void online_softmax_step(T* s, int nv, T& m, T& l, T* acc, int HS, T neg_inf) {
  constexpr int W = kTile;
  const int whole = nv / W * W;
#if PTRAIN_ATTENTION_TILE_VECTORS
  using V = typename TileVector<T>::type;
  const auto halves = [](V v, auto op) {  // op over the lanes, pairwise
    v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
    v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
    v = op(v, __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
    return v[0];
  };
  const auto vmax = [](V a, V b) { return b > a ? b : a; };
  const auto vadd = [](V a, V b) { return a + b; };
  V lanes = V{} + neg_inf;
  for (int i = 0; i < whole; i += W) {
    V x;
    __builtin_memcpy(&x, s + i, sizeof(V));
    lanes = vmax(lanes, x);
  }
  T m_blk = halves(lanes, vmax);
#else
  T m_blk = detail::row_max(s, whole, neg_inf);
#endif
  for (int i = whole; i < nv; ++i) m_blk = s[i] > m_blk ? s[i] : m_blk;
  const T m_new = m > m_blk ? m : m_blk;
  const T corr = m == neg_inf ? T(0) : detail::exp_(m - m_new);
  for (int i = 0; i < nv; ++i) s[i] = detail::exp_(s[i] - m_new);
#if PTRAIN_ATTENTION_TILE_VECTORS
  V sums = V{};
  for (int i = 0; i < whole; i += W) {
    V x;
    __builtin_memcpy(&x, s + i, sizeof(V));
    sums += x;
  }
  T sum = halves(sums, vadd);
#else
  T sum = detail::row_sum(s, whole);
#endif
  for (int i = whole; i < nv; ++i) sum += s[i];
  l = l * corr + sum;
  m = m_new;
  for (int d = 0; d < HS; ++d) acc[d] *= corr;
}

// One query row of a backward block: on its nv visible keys p [=] exp(p - lse) and ds,
// holding dP = dO V^T, [=] scale p (dP - D); both 0 past them up to nk (p and dP were
// computed only up to the row group's score columns).
template <class T>
KOKKOS_INLINE_FUNCTION void softmax_backward_row(T* p, T* ds, int nv, int nk, T lse, T D, T scale) {
  for (int c = 0; c < nv; ++c) p[c] = detail::exp_(p[c] - lse);
  for (int c = 0; c < nv; ++c) ds[c] = scale * p[c] * (ds[c] - D);
  for (int c = nv; c < nk; ++c) p[c] = ds[c] = T(0);
}

// D (n) [=] rowsum(dO * O) over n rows of a head (dO's and O's rows ld apart, HS columns), in
// A, in row_dot's order.
template <class A, class T>
inline void rowsum_dout_out(A* D, const T* dout, const T* out, int ld, int n, int HS) {
  for (int r = 0; r < n; ++r) {
    const T* const g = dout + std::size_t(r) * ld;
    const T* const o = out + std::size_t(r) * ld;
    D[r] = detail::row_sum_of<A>(HS, [&](int c) { return A(g[c]) * A(o[c]); });
  }
}

// One (query block, key block) pair of the forward, as its row groups see it: the block's
// scratch and the block's rows of Q and V (head columns). The group functions take blocks
// by value: a local copy, which the block's float stores cannot alias (by reference,
// attention ran about 10% slower).
template <class T>
struct ForwardBlock {
  T* s;         // scores, then probabilities (nq, nk)
  T* acc;       // output accumulator (nq, HS)
  T* m;         // running max (nq)
  T* l;         // running sum (nq)
  const T* kt;  // K_blk^T (HS, nk)
  const T* q;   // the query block's first row, rows q_ld apart
  const T* v;   // the key block's first row of V, rows v_ld apart
  int q_ld, v_ld, nk, HS, q_pos_first, k_pos_first;
  bool causal;
  T scale, neg_inf;
};

// Forward rows r0 .. r0 + R - 1 of a block: s = scale q_r K_blk^T; online softmax over the
// visible keys; acc_r += p V_blk. Rows see different numbers of keys (causal): a row's p is 0
// past its own. Forced inline: called out of line, the forward ran about 7% slower.
template <class T, int R>
KOKKOS_FORCEINLINE_FUNCTION void forward_rows(const ForwardBlock<T> f, int r0) {
  T* s[R];
  const T* qr[R];
  const T* pr[R];
  T* acc[R];
  int nv[R], kmax = 0;
  for (int u = 0; u < R; ++u) {
    const int r = r0 + u;
    s[u] = f.s + std::size_t(r) * f.nk;
    pr[u] = s[u];
    qr[u] = f.q + std::size_t(r) * f.q_ld;
    acc[u] = f.acc + std::size_t(r) * f.HS;
    nv[u] = visible_keys(f.causal, f.q_pos_first + r, f.k_pos_first, f.nk);
    kmax = nv[u] > kmax ? nv[u] : kmax;
  }
  if (kmax == 0) return;
  vec_mat<T, R>(s, qr, 1, f.kt, f.nk, f.HS, score_columns(kmax, f.nk, kTile), f.scale, T(0));
  for (int u = 0; u < R; ++u) {
    const int r = r0 + u;
    for (int c = nv[u]; c < kmax; ++c) s[u][c] = T(0);
    if (nv[u] > 0) online_softmax_step(s[u], nv[u], f.m[r], f.l[r], acc[u], f.HS, f.neg_inf);
  }
  vec_mat<T, R>(acc, pr, 1, f.v, f.v_ld, kmax, f.HS, T(1), T(1));
}

// One (key block, query block) pair of the backward, as its row and column groups see it:
// the block's scratch, and the first rows of the blocks in Q, dQ, dO and lse (query block)
// and in K, dK, dV (key block), head columns.
template <class T>
struct BackwardBlock {
  T* p;         // P (nq, nk)
  T* ds;        // dP, then dS (nq, nk)
  const T* D;   // rowsum(dO * O) (nq)
  const T* kt;  // K_blk^T (HS, nk)
  const T* vt;  // V_blk^T (HS, nk)
  const T* q;
  T* dq;
  const T* dout;
  const T* lse;
  const T* k;
  T* dk;
  T* dv;
  int q_ld, dq_ld, dout_ld, k_ld, dk_ld, dv_ld;  // row strides
  int nq, nk, HS, q_pos_first, k_pos_first;
  bool causal;
  T scale, neg_inf;
};

// Backward query rows r0 .. r0 + R - 1 of a block: p = exp(scale q_r K^T - lse_r), masked
// entries 0; dp = dO_r V^T; ds = scale p (dp - D_r) (S was scale Q K^T); dQ_r += ds K_blk.
template <class T, int R>
KOKKOS_INLINE_FUNCTION void backward_query_rows(const BackwardBlock<T> f, int r0) {
  T* p[R];
  T* ds[R];
  T* dqr[R];
  const T* qr[R];
  const T* dor[R];
  const T* dsr[R];
  int nv[R], kmax = 0;
  for (int u = 0; u < R; ++u) {
    const int r = r0 + u;
    p[u] = f.p + std::size_t(r) * f.nk;
    ds[u] = f.ds + std::size_t(r) * f.nk;
    dsr[u] = ds[u];
    dqr[u] = f.dq + std::size_t(r) * f.dq_ld;
    qr[u] = f.q + std::size_t(r) * f.q_ld;
    dor[u] = f.dout + std::size_t(r) * f.dout_ld;
    nv[u] =
        f.lse[r] == f.neg_inf ? 0 : visible_keys(f.causal, f.q_pos_first + r, f.k_pos_first, f.nk);
    kmax = nv[u] > kmax ? nv[u] : kmax;
  }
  const int ncols = score_columns(kmax, f.nk, kTile);
  if (kmax > 0) {
    vec_mat<T, R>(p, qr, 1, f.kt, f.nk, f.HS, ncols, f.scale, T(0));
    vec_mat<T, R>(ds, dor, 1, f.vt, f.nk, f.HS, ncols, T(1), T(0));
  }
  for (int u = 0; u < R; ++u)
    softmax_backward_row(p[u], ds[u], nv[u], f.nk, f.lse[r0 + u], f.D[r0 + u], f.scale);
  if (kmax > 0) vec_mat<T, R>(dqr, dsr, 1, f.k, f.k_ld, kmax, f.HS, T(1), T(1));
}

// Backward keys c0 .. c0 + R - 1 of a block: dV_c += P[:, c]^T dO; dK_c += dS[:, c]^T Q,
// over the query rows from the first that sees key c0 (P and dS are 0 above it, causal).
template <class T, int R>
KOKKOS_INLINE_FUNCTION void backward_key_columns(const BackwardBlock<T> f, int c0) {
  const int seen = f.causal ? c0 + f.k_pos_first - f.q_pos_first : 0;
  const int r_first = seen < 0 ? 0 : seen;
  if (r_first >= f.nq) return;
  T* dvc[R];
  T* dkc[R];
  const T* pc[R];
  const T* dsc[R];
  for (int u = 0; u < R; ++u) {
    const int c = c0 + u;
    dvc[u] = f.dv + std::size_t(c) * f.dv_ld;
    dkc[u] = f.dk + std::size_t(c) * f.dk_ld;
    pc[u] = f.p + std::size_t(r_first) * f.nk + c;
    dsc[u] = f.ds + std::size_t(r_first) * f.nk + c;
  }
  const int rows = f.nq - r_first;
  vec_mat<T, R>(dvc, pc, f.nk, f.dout + std::size_t(r_first) * f.dout_ld, f.dout_ld, rows, f.HS,
                T(1), T(1));
  vec_mat<T, R>(dkc, dsc, f.nk, f.q + std::size_t(r_first) * f.q_ld, f.q_ld, rows, f.HS, T(1),
                T(1));
}

// The start of one head's backward. bf16: the head's dQ accumulator in scratch at dqw, from dq
// (accumulate) or zero, returned. Otherwise the head's rows of dq, dk and dv,
// zeroed unless accumulating; nullptr.
template <class A, class T>
inline A* begin_head(A* dqw, const Heads<T>& dq, const Heads<T>& dk, const Heads<T>& dv, int b,
                     int Tq, int Tk, std::size_t head, int HS, bool accumulate) {
  if constexpr (kWidened<T>) {
    pack_rows(dqw, dq.view.data() + dq.at(b, 0, Tq) + head, dq.ld, Tq, HS, accumulate);
    return dqw;
  } else {
    if (!accumulate) {
      zero_head_rows(dq, b, Tq, head, HS);
      zero_head_rows(dk, b, Tk, head, HS);
      zero_head_rows(dv, b, Tk, head, HS);
    }
    return nullptr;
  }
}

// One (key block, query block) pair of the backward, its operands in place: dQ's rows, then
// dK's and dV's columns.
template <class A>
inline void backward_block(const BackwardBlock<A>& blk) {
  row_groups(blk.nq,
             [&](auto rows, int r0) { backward_query_rows<A, decltype(rows)::value>(blk, r0); });
  row_groups(blk.nk,
             [&](auto cols, int c0) { backward_key_columns<A, decltype(cols)::value>(blk, c0); });
}

// Each block's scratch, as offsets in elements of the accumulate type A. Forward:
// K_blk^T (HS, bk) | scores/probabilities (bq, bk) | output accumulator (bq, HS) | running
// max (bq) | running sum (bq); widened (bf16) only: Q_blk (bq, HS) | V_blk (bk, HS).
struct ForwardScratch {
  std::size_t kt, s, acc, m, l, qw, vw, elems;
};
template <class T>
ForwardScratch forward_scratch(int bq, int bk, int HS) {
  ForwardScratch f{};
  f.kt = 0;
  f.s = f.kt + std::size_t(HS) * bk;
  f.acc = f.s + std::size_t(bq) * bk;
  f.m = f.acc + std::size_t(bq) * HS;
  f.l = f.m + bq;
  f.qw = f.l + bq;
  f.vw = f.qw + std::size_t(bq) * HS;
  f.elems = kWidened<T> ? f.vw + std::size_t(bk) * HS : f.qw;
  return f;
}

// Backward: K_blk^T (HS, bk) | V_blk^T (HS, bk) | P (bq, bk) | dP, then dS (bq, bk) | the
// head's D = rowsum(dO * O) (Tq); widened (bf16) only: K_blk (bk, HS) | Q_blk (bq, HS) | dO_blk
// (bq, HS) | dK_blk, dV_blk accumulators (bk, HS) each | the head's dQ accumulator (Tq, HS).
struct BackwardScratch {
  std::size_t kt, vt, p, ds, d, kw, qw, dow, dkw, dvw, dqw, elems;
};
template <class T>
BackwardScratch backward_scratch(int bq, int bk, int HS, int Tq) {
  BackwardScratch b{};
  b.kt = 0;
  b.vt = b.kt + std::size_t(HS) * bk;
  b.p = b.vt + std::size_t(HS) * bk;
  b.ds = b.p + std::size_t(bq) * bk;
  b.d = b.ds + std::size_t(bq) * bk;
  b.kw = b.d + Tq;
  b.qw = b.kw + std::size_t(bk) * HS;
  b.dow = b.qw + std::size_t(bq) * HS;
  b.dkw = b.dow + std::size_t(bq) * HS;
  b.dvw = b.dkw + std::size_t(bk) * HS;
  b.dqw = b.dvw + std::size_t(bk) * HS;
  b.elems = kWidened<T> ? b.dqw + std::size_t(Tq) * HS : b.kw;
  return b;
}

}  // namespace

template <class T>
AttentionScratch host_attention_scratch(int Tq, int Tk, int HS, const AttentionConfig& cfg) {
  using A = accumulate_t<T>;
  const int bq = block_rows(cfg.q_block, Tq), bk = block_rows(cfg.k_block, Tk);
  return {forward_scratch<T>(bq, bk, HS).elems * sizeof(A),
          backward_scratch<T>(bq, bk, HS, Tq).elems * sizeof(A)};
}

template <class T>
void host_attention_forward(Vec<T> out, Vec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k,
                            CHeads<T> v, int B, int Tq, int Tk, int NH, int HS,
                            const AttentionConfig& cfg) {
  using A = accumulate_t<T>;
  const int C = NH * HS;

  const int bq = block_rows(cfg.q_block, Tq);
  const int bk = block_rows(cfg.k_block, Tk);
  const int q_blocks = (Tq + bq - 1) / bq;
  const ForwardScratch sc = forward_scratch<T>(bq, bk, HS);
  const A scale = A(1) / std::sqrt(A(HS));
  const A neg_inf = -std::numeric_limits<A>::infinity();
  const bool causal = cfg.causal;
  const int q_pos0 = cfg.q_pos0, k_pos0 = cfg.k_pos0;

  parallel_blocks(
      "ptrain::attention_forward", B * NH * q_blocks, sc.elems * sizeof(A),
      [&](int block, char* scratch) {
        // block = (b*NH + h)*q_blocks + query block
        const int qb = block % q_blocks, bh = block / q_blocks;
        const int h = bh % NH, b = bh / NH, i0 = qb * bq;
        const int nq = i0 + bq <= Tq ? bq : Tq - i0;
        const int q_pos_first = q_pos0 + i0;
        A* const w = reinterpret_cast<A*>(scratch);
        const Rows<const A> qr = read_rows(
            w + sc.qw, q.view.data() + q.at(b, i0, Tq) + std::size_t(h) * HS, q.ld, nq, HS);
        for (int r = 0; r < nq; ++r) {
          w[sc.m + r] = neg_inf;
          w[sc.l + r] = A(0);
          for (int d = 0; d < HS; ++d) w[sc.acc + std::size_t(r) * HS + d] = A(0);
        }
        for (int j0 = 0; j0 < Tk; j0 += bk) {
          const int nk = j0 + bk <= Tk ? bk : Tk - j0;
          const int k_pos_first = k_pos0 + j0;
          if (block_masked(causal, q_pos_first + nq - 1, k_pos_first)) break;
          const std::size_t head = std::size_t(h) * HS;
          pack_transposed(w + sc.kt, k.view.data() + k.at(b, j0, Tk) + head, k.ld, nk, HS);
          const Rows<const A> vr =
              read_rows(w + sc.vw, v.view.data() + v.at(b, j0, Tk) + head, v.ld, nk, HS);
          const ForwardBlock<A> blk{
              w + sc.s, w + sc.acc, w + sc.m, w + sc.l,    w + sc.kt,   qr.p,   vr.p,  qr.ld,
              vr.ld,    nk,         HS,       q_pos_first, k_pos_first, causal, scale, neg_inf};
          row_groups(nq,
                     [&](auto rows, int r0) { forward_rows<A, decltype(rows)::value>(blk, r0); });
        }
        T* const outp = out.data() + (std::size_t(b) * Tq + i0) * C + std::size_t(h) * HS;
        A* const lsep = lse.data() + (std::size_t(b) * NH + h) * Tq + i0;
        for (int r = 0; r < nq; ++r) {
          const A l = w[sc.l + r];
          const A* acc = w + sc.acc + std::size_t(r) * HS;
          T* o = outp + std::size_t(r) * C;
          const A inv = l > A(0) ? A(1) / l : A(0);
          for (int d = 0; d < HS; ++d) o[d] = T(acc[d] * inv);
          lsep[r] = l > A(0) ? w[sc.m + r] + detail::log_(l) : neg_inf;
        }
      });
}

template <class T>
void host_attention_backward(Heads<T> dq, Heads<T> dk, Heads<T> dv, CVec<T> dout, CVec<T> out,
                             CVec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k, CHeads<T> v,
                             int B, int Tq, int Tk, int NH, int HS, const AttentionConfig& cfg,
                             bool accumulate) {
  using A = accumulate_t<T>;
  const int C = NH * HS;

  const int bq = block_rows(cfg.q_block, Tq);
  const int bk = block_rows(cfg.k_block, Tk);
  const BackwardScratch sc = backward_scratch<T>(bq, bk, HS, Tq);
  const A scale = A(1) / std::sqrt(A(HS));
  const A neg_inf = -std::numeric_limits<A>::infinity();
  const bool causal = cfg.causal;
  const int q_pos0 = cfg.q_pos0, k_pos0 = cfg.k_pos0;

  parallel_blocks(
      "ptrain::attention_backward", B * NH, sc.elems * sizeof(A), [&](int block, char* scratch) {
        const int h = block % NH, b = block / NH;
        const std::size_t head = std::size_t(h) * HS;
        A* const w = reinterpret_cast<A*>(scratch);
        A* const dqw = begin_head<A>(w + sc.dqw, dq, dk, dv, b, Tq, Tk, head, HS, accumulate);
        const std::size_t o_head = std::size_t(b) * Tq * C + head;  // row 0 in out and dout
        rowsum_dout_out(w + sc.d, dout.data() + o_head, out.data() + o_head, C, Tq, HS);
        // Key blocks outside, query blocks inside: K^T and V^T are packed once per key block.
        // dQ's rows still add the key blocks in order, and dK's and dV's the query blocks.
        for (int j0 = 0; j0 < Tk; j0 += bk) {
          const int nk = j0 + bk <= Tk ? bk : Tk - j0;
          const int k_pos_first = k_pos0 + j0;
          const T* const kg = k.view.data() + k.at(b, j0, Tk) + head;
          T* const dkg = dk.view.data() + dk.at(b, j0, Tk) + head;
          T* const dvg = dv.view.data() + dv.at(b, j0, Tk) + head;
          pack_transposed(w + sc.kt, kg, k.ld, nk, HS);
          pack_transposed(w + sc.vt, v.view.data() + v.at(b, j0, Tk) + head, v.ld, nk, HS);
          const Rows<const A> kr = read_rows(w + sc.kw, kg, k.ld, nk, HS);
          const Rows<A> dkr = accumulator_rows(w + sc.dkw, dkg, dk.ld, nk, HS, accumulate);
          const Rows<A> dvr = accumulator_rows(w + sc.dvw, dvg, dv.ld, nk, HS, accumulate);
          for (int i0 = 0; i0 < Tq; i0 += bq) {
            const int nq = i0 + bq <= Tq ? bq : Tq - i0;
            const int q_pos_first = q_pos0 + i0;
            if (block_masked(causal, q_pos_first + nq - 1, k_pos_first)) continue;
            const Rows<const A> qr =
                read_rows(w + sc.qw, q.view.data() + q.at(b, i0, Tq) + head, q.ld, nq, HS);
            const Rows<const A> dor =
                read_rows(w + sc.dow, dout.data() + o_head + std::size_t(i0) * C, C, nq, HS);
            const Rows<A> dqr =
                dq_rows(dqw, dq.view.data() + dq.at(b, i0, Tq) + head, dq.ld, i0, HS);
            const A* const lsep = lse.data() + (std::size_t(b) * NH + h) * Tq + i0;
            const BackwardBlock<A> blk{
                w + sc.p,    w + sc.ds,   w + sc.d + i0, w + sc.kt, w + sc.vt, qr.p,  dqr.p,
                dor.p,       lsep,        kr.p,          dkr.p,     dvr.p,     qr.ld, dqr.ld,
                dor.ld,      kr.ld,       dkr.ld,        dvr.ld,    nq,        nk,    HS,
                q_pos_first, k_pos_first, causal,        scale,     neg_inf};
            backward_block(blk);
          }
          if constexpr (kWidened<T>) {  // the key block's dK and dV, rounded once
            store_rows(dkg, dk.ld, w + sc.dkw, nk, HS);
            store_rows(dvg, dv.ld, w + sc.dvw, nk, HS);
          }
        }
        if constexpr (kWidened<T>) {  // the head's dQ, rounded once
          store_rows(dq.view.data() + dq.at(b, 0, Tq) + head, dq.ld, dqw, Tq, HS);
        }
      });
}

#define PTRAIN_INSTANTIATE(T)                                                                      \
  template AttentionScratch host_attention_scratch<T>(int, int, int, const AttentionConfig&);      \
  template void host_attention_forward<T>(Vec<T>, Vec<accumulate_t<T>>, CHeads<T>, CHeads<T>,      \
                                          CHeads<T>, int, int, int, int, int,                      \
                                          const AttentionConfig&);                                 \
  template void host_attention_backward<T>(Heads<T>, Heads<T>, Heads<T>, CVec<T>, CVec<T>,         \
                                           CVec<accumulate_t<T>>, CHeads<T>, CHeads<T>, CHeads<T>, \
                                           int, int, int, int, int, const AttentionConfig&, bool);
PTRAIN_INSTANTIATE(float)
PTRAIN_INSTANTIATE(double)
PTRAIN_INSTANTIATE(bf16)
#undef PTRAIN_INSTANTIATE

}  // namespace ptrain::kernels::detail
#endif  // !PTRAIN_DEVICE_BUILD
