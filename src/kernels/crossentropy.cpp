// kernels/crossentropy.cpp — vocab-parallel cross-entropy in four steps.
#include <cstddef>
#include <limits>

#include "kernels/detail_math.hpp"
#include "kernels/kernels.hpp"
#include "kernels/parallel.hpp"
#include "util/error.hpp"

namespace ptrain::kernels {
namespace {

using Team = Kokkos::TeamPolicy<>::member_type;

void require_len(const char* what, std::size_t extent, std::size_t need) {
  PTRAIN_REQUIRE(extent >= need, what, ": view of ", extent, " elements, needs ", need);
}

// Number of this shard's columns that are real (not padding).
int real_columns(const VocabShard& s) {
  PTRAIN_REQUIRE(s.v_begin >= 0 && s.v_local >= 0 && s.v_real >= 0,
                 "cross-entropy: bad vocab shard (v_begin ", s.v_begin, ", v_local ", s.v_local,
                 ", v_real ", s.v_real, ")");
  const int n = s.v_real - s.v_begin;
  return n < 0 ? 0 : (n > s.v_local ? s.v_local : n);
}

// One row's backward, before its logits x are overwritten: the row max m, dloss / sum of
// exponentials, the target's column here (hit: it is a real column of this shard) and, for
// bf16, the target's dloss (p - 1) in fp32.
template <class A>
struct GradRow {
  A m, scale;
  int col;
  bool hit;
  A target;
};
template <class T, class A>
KOKKOS_INLINE_FUNCTION GradRow<A> grad_row(const T* x, A m, A sumexp, int col, int nreal, A dloss) {
  const A scale = dloss / sumexp;
  const bool hit = col >= 0 && col < nreal;
  const A target = detail::kWidened<T> && hit ? detail::exp_(A(x[col]) - m) * scale - dloss : A(0);
  return {m, scale, col, hit, target};
}

}  // namespace

// Both shapes sum in the same order (detail::team_lanes): the row sums agree bit for bit.
template <class T>
void crossentropy_row_max(Vec<accumulate_t<T>> row_max, CVec<T> logits, int N,
                          const VocabShard& shard) {
  using A = accumulate_t<T>;
  require_len("crossentropy_row_max row_max", row_max.extent(0), std::size_t(N));
  require_len("crossentropy_row_max logits", logits.extent(0), std::size_t(N) * shard.v_local);
  const int V = shard.v_local, nreal = real_columns(shard);
  const A lowest = -std::numeric_limits<A>::infinity();
  if (kernel_shape() == KernelShape::host) {
    parallel_items(
        "ptrain::crossentropy_row_max", N,
        KOKKOS_LAMBDA(int n) {
          row_max(n) = detail::row_max(logits.data() + std::size_t(n) * V, nreal, lowest);
        },
        rows_per_fork(V));
    return;
  }
  Kokkos::parallel_for(
      "ptrain::crossentropy_row_max(teams)", detail::row_teams<A>(N),
      KOKKOS_LAMBDA(const Team& team) {
        const int n = team.league_rank();
        const T* x = logits.data() + std::size_t(n) * V;
        const A m = detail::team_lanes(
            team, detail::lanes_of<A>(team), nreal, lowest, [&](int v) { return A(x[v]); },
            detail::Max{});
        Kokkos::single(Kokkos::PerTeam(team), [&] { row_max(n) = m; });
      });
}

template <class T>
void crossentropy_row_sumexp(Vec<accumulate_t<T>> sumexp, Vec<accumulate_t<T>> target_logit,
                             CVec<T> logits, CVec<accumulate_t<T>> row_max, IntVec targets, int N,
                             const VocabShard& shard) {
  using A = accumulate_t<T>;
  require_len("crossentropy_row_sumexp sumexp", sumexp.extent(0), std::size_t(N));
  require_len("crossentropy_row_sumexp target_logit", target_logit.extent(0), std::size_t(N));
  require_len("crossentropy_row_sumexp row_max", row_max.extent(0), std::size_t(N));
  require_len("crossentropy_row_sumexp targets", targets.extent(0), std::size_t(N));
  require_len("crossentropy_row_sumexp logits", logits.extent(0), std::size_t(N) * shard.v_local);
  const int V = shard.v_local, nreal = real_columns(shard), v_begin = shard.v_begin;
  if (kernel_shape() == KernelShape::host) {
    parallel_items(
        "ptrain::crossentropy_row_sumexp", N,
        KOKKOS_LAMBDA(int n) {
          const T* x = logits.data() + std::size_t(n) * V;
          sumexp(n) = detail::row_sum_exp(x, nreal, A(1), row_max(n));
          const int col = targets(n) - v_begin;
          target_logit(n) = (col >= 0 && col < nreal) ? A(x[col]) : A(0);
        },
        rows_per_fork(V));
    return;
  }
  Kokkos::parallel_for(
      "ptrain::crossentropy_row_sumexp(teams)", detail::row_teams<A>(N),
      KOKKOS_LAMBDA(const Team& team) {
        const int n = team.league_rank();
        const T* x = logits.data() + std::size_t(n) * V;
        const A m = row_max(n);
        const A sum = detail::team_lanes(
            team, detail::lanes_of<A>(team), nreal, A(0),
            [&](int v) { return detail::exp_(A(x[v]) * A(1) - m); }, detail::Plus{});
        Kokkos::single(Kokkos::PerTeam(team), [&] {
          sumexp(n) = sum;
          const int col = targets(n) - v_begin;
          target_logit(n) = (col >= 0 && col < nreal) ? A(x[col]) : A(0);
        });
      });
}

template <class T>
void crossentropy_loss(Vec<accumulate_t<T>> losses, CVec<accumulate_t<T>> row_max,
                       CVec<accumulate_t<T>> sumexp, CVec<accumulate_t<T>> target_logit, int N) {
  require_len("crossentropy_loss losses", losses.extent(0), std::size_t(N));
  require_len("crossentropy_loss row_max", row_max.extent(0), std::size_t(N));
  require_len("crossentropy_loss sumexp", sumexp.extent(0), std::size_t(N));
  require_len("crossentropy_loss target_logit", target_logit.extent(0), std::size_t(N));
  Kokkos::parallel_for(
      "ptrain::crossentropy_loss", N,
      KOKKOS_LAMBDA(int n) { losses(n) = detail::log_(sumexp(n)) + row_max(n) - target_logit(n); });
}

template <class T>
void crossentropy_backward(Vec<T> logits, CVec<accumulate_t<T>> row_max,
                           CVec<accumulate_t<T>> sumexp, IntVec targets, int N,
                           const VocabShard& shard, accumulate_t<T> dloss) {
  using A = accumulate_t<T>;
  require_len("crossentropy_backward logits", logits.extent(0), std::size_t(N) * shard.v_local);
  require_len("crossentropy_backward row_max", row_max.extent(0), std::size_t(N));
  require_len("crossentropy_backward sumexp", sumexp.extent(0), std::size_t(N));
  require_len("crossentropy_backward targets", targets.extent(0), std::size_t(N));
  const int V = shard.v_local, nreal = real_columns(shard), v_begin = shard.v_begin;
  // logits row x (V) [=] dloss (softmax(x) - onehot(target)) on the real columns, 0 past them.
  // For bf16 the target's p - 1 is formed in fp32 and rounded once (read before x is written).
  if (kernel_shape() == KernelShape::host) {
    parallel_items(
        "ptrain::crossentropy_backward", N,
        KOKKOS_LAMBDA(int n) {
          T* x = logits.data() + std::size_t(n) * V;
          const GradRow<A> g =
              grad_row(x, row_max(n), sumexp(n), targets(n) - v_begin, nreal, dloss);
          for (int v = 0; v < nreal; ++v) x[v] = T(detail::exp_(A(x[v]) - g.m) * g.scale);
          if (g.hit) x[g.col] = detail::kWidened<T> ? T(g.target) : T(A(x[g.col]) - dloss);
          for (int v = nreal; v < V; ++v) x[v] = T(0);
        },
        rows_per_fork(V));
    return;
  }
  Kokkos::parallel_for(
      "ptrain::crossentropy_backward(teams)", detail::row_teams<A>(N),
      KOKKOS_LAMBDA(const Team& team) {
        const int n = team.league_rank();
        T* x = logits.data() + std::size_t(n) * V;
        const GradRow<A> g = grad_row(x, row_max(n), sumexp(n), targets(n) - v_begin, nreal, dloss);
        team.team_barrier();  // every thread has read x[col]
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, V), [&](int v) {
          x[v] = v < nreal ? T(detail::exp_(A(x[v]) - g.m) * g.scale) : T(0);
        });
        team.team_barrier();
        Kokkos::single(Kokkos::PerTeam(team), [&] {
          if (g.hit) x[g.col] = detail::kWidened<T> ? T(g.target) : T(A(x[g.col]) - dloss);
        });
      });
}

#define PTRAIN_INSTANTIATE(T)                                                                      \
  template void crossentropy_row_max<T>(Vec<accumulate_t<T>>, CVec<T>, int, const VocabShard&);    \
  template void crossentropy_row_sumexp<T>(Vec<accumulate_t<T>>, Vec<accumulate_t<T>>, CVec<T>,    \
                                           CVec<accumulate_t<T>>, IntVec, int, const VocabShard&); \
  template void crossentropy_loss<T>(Vec<accumulate_t<T>>, CVec<accumulate_t<T>>,                  \
                                     CVec<accumulate_t<T>>, CVec<accumulate_t<T>>, int);           \
  template void crossentropy_backward<T>(Vec<T>, CVec<accumulate_t<T>>, CVec<accumulate_t<T>>,     \
                                         IntVec, int, const VocabShard&, accumulate_t<T>);
PTRAIN_INSTANTIATE(float)
PTRAIN_INSTANTIATE(double)
PTRAIN_INSTANTIATE(bf16)
#undef PTRAIN_INSTANTIATE

}  // namespace ptrain::kernels
