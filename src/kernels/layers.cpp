// kernels/layers.cpp — linear layer, embeddings, layer norm.
#include <cstddef>

#include "kernels/detail_math.hpp"
#include "kernels/gemm.hpp"
#include "kernels/kernels.hpp"
#include "kernels/parallel.hpp"
#include "util/error.hpp"

namespace ptrain::kernels {
namespace {

using Team = Kokkos::TeamPolicy<>::member_type;

void require_len(const char* what, std::size_t extent, std::size_t need) {
  PTRAIN_REQUIRE(extent >= need, what, ": view of ", extent, " elements, needs ", need);
}

// f(n, c) for every row n (in increasing order) and column c of an (nrows, ncols) grid;
// one thread owns each column, so f may accumulate into per-column outputs without races
// and with a fixed summation order. On a host backend the inner loop runs over a
// contiguous chunk of columns.
template <class F>
void for_rows_per_column(const char* label, int nrows, int ncols, const F& f) {
  constexpr int kChunk = 256;
  const int nchunks = (ncols + kChunk - 1) / kChunk;
  Kokkos::parallel_for(
      label, Kokkos::TeamPolicy<>(nchunks, Kokkos::AUTO), KOKKOS_LAMBDA(const Team& team) {
        const int c0 = team.league_rank() * kChunk;
        const int c1 = c0 + kChunk < ncols ? c0 + kChunk : ncols;
        for (int n = 0; n < nrows; ++n)
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, c0, c1), [&](int c) { f(n, c); });
      });
}

// f(n, c) for every element of an (nrows, ncols) grid, a team per row.
template <class F>
void for_each_row_col(const char* label, int nrows, int ncols, const F& f) {
  Kokkos::parallel_for(
      label, Kokkos::TeamPolicy<>(nrows, Kokkos::AUTO), KOKKOS_LAMBDA(const Team& team) {
        const int n = team.league_rank();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, ncols), [&](int c) { f(n, c); });
      });
}

using detail::Plus;

// One LayerNorm output: (x - m) s w + b. For float and double from y = x - m (already in y);
// for bf16 from x in fp32, rounded once.
template <class T, class A>
KOKKOS_INLINE_FUNCTION T normalized(T x, T y, A m, A s, T w, T b) {
  if constexpr (std::is_same_v<T, A>) {
    return y * s * w + b;
  } else {
    return T((A(x) - m) * s * A(w) + A(b));
  }
}

// Largest entry of positions (or T - 1 when empty), for the wpe bounds check.
int max_position(IntVec positions, int T) {
  if (positions.extent(0) == 0) return T - 1;
  require_len("encoder positions", positions.extent(0), std::size_t(T));
  int mx = -1;
  Kokkos::parallel_reduce(
      "ptrain::encoder_max_position", T,
      KOKKOS_LAMBDA(int t, int& m) { m = positions(t) > m ? positions(t) : m; },
      Kokkos::Max<int>(mx));
  return mx;
}

}  // namespace

// ---- linear layer -------------------------------------------------------------------

template <class T>
void matmul_forward(Vec<T> out, CVec<T> inp, CVec<T> weight, CVec<T> bias, int N, int C, int OC) {
  const bool has_bias = bias.extent(0) > 0;
  if (has_bias) {
    require_len("matmul_forward bias", bias.extent(0), std::size_t(OC));
    require_len("matmul_forward out", out.extent(0), std::size_t(N) * OC);
    // out = bias rows, then out += inp W^T: one pass over out instead of two.
    for_each_row_col(
        "ptrain::matmul_bias_fill", N, OC,
        KOKKOS_LAMBDA(int n, int o) { out(std::size_t(n) * OC + o) = bias(o); });
  }
  using A = accumulate_t<T>;
  gemm<T>(false, true, N, OC, C, A(1), inp, 0, C, weight, 0, C, has_bias ? A(1) : A(0), out, 0, OC);
}

template <class T, class G>
void matmul_backward(Vec<T> dinp, OutVec<G> dweight, OutVec<G> dbias, CVec<T> dout, CVec<T> inp,
                     CVec<T> weight, int N, int C, int OC, bool accumulate_dinp) {
  using A = accumulate_t<T>;
  if (dinp.extent(0) > 0)  // dinp (N, C) [+]= dout (N, OC) @ W (OC, C)
    gemm<T>(false, false, N, C, OC, A(1), dout, 0, OC, weight, 0, C, A(accumulate_dinp ? 1 : 0),
            dinp, 0, C);
  // dW (OC, C) += dout^T (OC, N) @ inp (N, C)
  if (dweight.extent(0) > 0)
    gemm<T, G>(true, false, OC, C, N, A(1), dout, 0, OC, inp, 0, C, A(1), dweight, 0, C);
  if (dbias.extent(0) > 0) {
    require_len("matmul_backward dbias", dbias.extent(0), std::size_t(OC));
    require_len("matmul_backward dout", dout.extent(0), std::size_t(N) * OC);
    if constexpr (std::is_same_v<G, A>) {  // the sum runs in dbias itself
      for_rows_per_column(
          "ptrain::matmul_backward_bias", N, OC,
          KOKKOS_LAMBDA(int n, int o) { dbias(o) += A(dout(std::size_t(n) * OC + o)); });
    } else {  // bf16 gradients: the column sum in fp32, added once
      Kokkos::parallel_for(
          "ptrain::matmul_backward_bias", OC, KOKKOS_LAMBDA(int o) {
            A sum = 0;
            for (int n = 0; n < N; ++n) sum += A(dout(std::size_t(n) * OC + o));
            detail::add_to(dbias(o), sum);
          });
    }
  }
}

// ---- embeddings -----------------------------------------------------------------------

template <class T>
void encoder_forward(Vec<T> out, IntVec tokens, IntVec positions, CVec<T> wte, CVec<T> wpe, int B,
                     int T_, int C, int v_begin, int v_local) {
  const int N = B * T_;
  require_len("encoder_forward out", out.extent(0), std::size_t(N) * C);
  require_len("encoder_forward tokens", tokens.extent(0), std::size_t(N));
  require_len("encoder_forward wte", wte.extent(0), std::size_t(v_local) * C);
  const bool has_wpe = wpe.extent(0) > 0;
  const bool has_pos = positions.extent(0) > 0;
  if (has_wpe)
    require_len("encoder_forward wpe", wpe.extent(0),
                std::size_t(max_position(positions, T_) + 1) * C);
  for_each_row_col(
      "ptrain::encoder_forward", N, C, KOKKOS_LAMBDA(int n, int c) {
        const int row = tokens(n) - v_begin;
        using A = accumulate_t<T>;
        A v = (row >= 0 && row < v_local) ? A(wte(std::size_t(row) * C + c)) : A(0);
        if (has_wpe) {
          const int t = n % T_;
          const int p = has_pos ? positions(t) : t;
          v += A(wpe(std::size_t(p) * C + c));
        }
        out(std::size_t(n) * C + c) = T(v);
      });
}

template <class T, class G>
void encoder_backward(OutVec<G> dwte, OutVec<G> dwpe, CVec<T> dout, IntVec tokens, IntVec positions,
                      int B, int T_, int C, int v_begin, int v_local) {
  const int N = B * T_;
  require_len("encoder_backward dout", dout.extent(0), std::size_t(N) * C);
  require_len("encoder_backward tokens", tokens.extent(0), std::size_t(N));
  const bool has_wte = dwte.extent(0) > 0;
  const bool has_wpe = dwpe.extent(0) > 0;
  const bool has_pos = positions.extent(0) > 0;
  if (has_wte) require_len("encoder_backward dwte", dwte.extent(0), std::size_t(v_local) * C);
  if (has_wpe)
    require_len("encoder_backward dwpe", dwpe.extent(0),
                std::size_t(max_position(positions, T_) + 1) * C);
  for_rows_per_column(
      "ptrain::encoder_backward", N, C, KOKKOS_LAMBDA(int n, int c) {
        const accumulate_t<T> g = dout(std::size_t(n) * C + c);
        const int row = tokens(n) - v_begin;
        if (has_wte && row >= 0 && row < v_local) detail::add_to(dwte(std::size_t(row) * C + c), g);
        if (has_wpe) {
          const int t = n % T_;
          const int p = has_pos ? positions(t) : t;
          detail::add_to(dwpe(std::size_t(p) * C + c), g);
        }
      });
}

// ---- layer norm -------------------------------------------------------------------------

// Both shapes compute the same sums in the same order (detail::team_lanes is row_sum's order
// spread over a team's threads): the statistics agree bit for bit.
template <class T>
void layernorm_forward(Vec<T> out, Vec<accumulate_t<T>> mean, Vec<accumulate_t<T>> rstd,
                       CVec<T> inp, CVec<T> weight, CVec<T> bias, int N, int C) {
  using A = accumulate_t<T>;
  require_len("layernorm_forward out", out.extent(0), std::size_t(N) * C);
  require_len("layernorm_forward inp", inp.extent(0), std::size_t(N) * C);
  require_len("layernorm_forward mean", mean.extent(0), std::size_t(N));
  require_len("layernorm_forward rstd", rstd.extent(0), std::size_t(N));
  require_len("layernorm_forward weight", weight.extent(0), std::size_t(C));
  require_len("layernorm_forward bias", bias.extent(0), std::size_t(C));
  // x, y: (N, C) rows; for float and double the variance is of y = x - m written to y first
  // (so the host loop vectorises), for bf16 of x - m in fp32 (y could hold it only rounded)
  if (kernel_shape() == KernelShape::host) {
    parallel_items(
        "ptrain::layernorm_forward", N,
        KOKKOS_LAMBDA(int n) {
          const T* x = inp.data() + std::size_t(n) * C;
          T* y = out.data() + std::size_t(n) * C;
          const A m = detail::row_sum(x, C) / A(C);
          A var;
          if constexpr (detail::kWidened<T>) {
            var = detail::row_sum_of<A>(C, [&](int c) { return (A(x[c]) - m) * (A(x[c]) - m); });
          } else {
            for (int c = 0; c < C; ++c) y[c] = x[c] - m;
            var = detail::row_dot(y, y, C);
          }
          const A s = A(1) / detail::sqrt_(var / A(C) + A(1e-5));
          for (int c = 0; c < C; ++c) y[c] = normalized<T>(x[c], y[c], m, s, weight(c), bias(c));
          mean(n) = m;
          rstd(n) = s;
        },
        rows_per_fork(C));
    return;
  }
  Kokkos::parallel_for(
      "ptrain::layernorm_forward(teams)", detail::row_teams<A>(N), KOKKOS_LAMBDA(const Team& team) {
        const int n = team.league_rank();
        const T* x = inp.data() + std::size_t(n) * C;
        T* y = out.data() + std::size_t(n) * C;
        A* const lanes = detail::lanes_of<A>(team);
        const A m = detail::team_lanes(
                        team, lanes, C, A(0), [&](int c) { return A(x[c]); }, Plus{}) /
                    A(C);
        A var;
        if constexpr (detail::kWidened<T>) {
          var = detail::team_lanes(
              team, lanes, C, A(0), [&](int c) { return (A(x[c]) - m) * (A(x[c]) - m); }, Plus{});
        } else {
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](int c) { y[c] = x[c] - m; });
          team.team_barrier();
          var = detail::team_lanes(
              team, lanes, C, A(0), [&](int c) { return A(y[c]) * A(y[c]); }, Plus{});
        }
        const A s = A(1) / detail::sqrt_(var / A(C) + A(1e-5));
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](int c) {
          y[c] = normalized<T>(x[c], y[c], m, s, weight(c), bias(c));
        });
        Kokkos::single(Kokkos::PerTeam(team), [&] {
          mean(n) = m;
          rstd(n) = s;
        });
      });
}

template <class T, class G>
void layernorm_backward(Vec<T> dinp, OutVec<G> dweight, OutVec<G> dbias, CVec<T> dout, CVec<T> inp,
                        CVec<T> weight, CVec<accumulate_t<T>> mean, CVec<accumulate_t<T>> rstd,
                        int N, int C) {
  using A = accumulate_t<T>;
  require_len("layernorm_backward dinp", dinp.extent(0), std::size_t(N) * C);
  require_len("layernorm_backward dout", dout.extent(0), std::size_t(N) * C);
  require_len("layernorm_backward inp", inp.extent(0), std::size_t(N) * C);
  require_len("layernorm_backward dweight", dweight.extent(0), std::size_t(C));
  require_len("layernorm_backward dbias", dbias.extent(0), std::size_t(C));
  require_len("layernorm_backward weight", weight.extent(0), std::size_t(C));
  require_len("layernorm_backward mean", mean.extent(0), std::size_t(N));
  require_len("layernorm_backward rstd", rstd.extent(0), std::size_t(N));
  // dinp += rstd (w dout - mean(w dout) - xhat mean(w dout xhat)), row by row; wg = w dout
  if (kernel_shape() == KernelShape::host) {
    parallel_items(
        "ptrain::layernorm_backward_input", N,
        KOKKOS_LAMBDA(int n) {
          const T* x = inp.data() + std::size_t(n) * C;
          const T* g = dout.data() + std::size_t(n) * C;
          T* dx = dinp.data() + std::size_t(n) * C;
          const A m = mean(n), s = rstd(n);
          const A sum_g = detail::row_sum_of<A>(C, [&](int c) { return A(weight(c)) * A(g[c]); });
          const A sum_gx = detail::row_sum_of<A>(
              C, [&](int c) { return A(weight(c)) * A(g[c]) * (A(x[c]) - m) * s; });
          const A mean_g = sum_g / A(C), mean_gx = sum_gx / A(C);
          for (int c = 0; c < C; ++c)
            detail::add_to(dx[c],
                           (A(weight(c)) * A(g[c]) - mean_g - (A(x[c]) - m) * s * mean_gx) * s);
        },
        rows_per_fork(C));
  } else {
    Kokkos::parallel_for(
        "ptrain::layernorm_backward_input(teams)", detail::row_teams<A>(N),
        KOKKOS_LAMBDA(const Team& team) {
          const int n = team.league_rank();
          const T* x = inp.data() + std::size_t(n) * C;
          const T* g = dout.data() + std::size_t(n) * C;
          T* dx = dinp.data() + std::size_t(n) * C;
          A* const lanes = detail::lanes_of<A>(team);
          const A m = mean(n), s = rstd(n);
          const A sum_g = detail::team_lanes(
              team, lanes, C, A(0), [&](int c) { return A(weight(c)) * A(g[c]); }, Plus{});
          const A sum_gx = detail::team_lanes(
              team, lanes, C, A(0),
              [&](int c) { return A(weight(c)) * A(g[c]) * (A(x[c]) - m) * s; }, Plus{});
          const A mean_g = sum_g / A(C), mean_gx = sum_gx / A(C);
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](int c) {
            detail::add_to(dx[c],
                           (A(weight(c)) * A(g[c]) - mean_g - (A(x[c]) - m) * s * mean_gx) * s);
          });
        });
  }
  for_rows_per_column(
      "ptrain::layernorm_backward_params", N, C, KOKKOS_LAMBDA(int n, int c) {
        const std::size_t i = std::size_t(n) * C + c;
        detail::add_to(dbias(c), A(dout(i)));
        detail::add_to(dweight(c), A(dout(i)) * (A(inp(i)) - mean(n)) * rstd(n));
      });
}

#define PTRAIN_INSTANTIATE(T, G)                                                                  \
  template void matmul_backward<T, G>(Vec<T>, OutVec<G>, OutVec<G>, CVec<T>, CVec<T>, CVec<T>,    \
                                      int, int, int, bool);                                       \
  template void encoder_backward<T, G>(OutVec<G>, OutVec<G>, CVec<T>, IntVec, IntVec, int, int,   \
                                       int, int, int);                                            \
  template void layernorm_backward<T, G>(Vec<T>, OutVec<G>, OutVec<G>, CVec<T>, CVec<T>, CVec<T>, \
                                         CVec<accumulate_t<T>>, CVec<accumulate_t<T>>, int, int);
PTRAIN_INSTANTIATE(float, float)
PTRAIN_INSTANTIATE(double, double)
PTRAIN_INSTANTIATE(bf16, float)
PTRAIN_INSTANTIATE(bf16, bf16)
#undef PTRAIN_INSTANTIATE

#define PTRAIN_INSTANTIATE(T)                                                                     \
  template void matmul_forward<T>(Vec<T>, CVec<T>, CVec<T>, CVec<T>, int, int, int);              \
  template void encoder_forward<T>(Vec<T>, IntVec, IntVec, CVec<T>, CVec<T>, int, int, int, int,  \
                                   int);                                                          \
  template void layernorm_forward<T>(Vec<T>, Vec<accumulate_t<T>>, Vec<accumulate_t<T>>, CVec<T>, \
                                     CVec<T>, CVec<T>, int, int);
PTRAIN_INSTANTIATE(float)
PTRAIN_INSTANTIATE(double)
PTRAIN_INSTANTIATE(bf16)
#undef PTRAIN_INSTANTIATE

}  // namespace ptrain::kernels
