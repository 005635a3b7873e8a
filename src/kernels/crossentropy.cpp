// kernels/crossentropy.cpp — vocab-parallel cross-entropy in four steps.
#include <cstddef>
#include <limits>

#include "kernels/detail_math.hpp"
#include "kernels/kernels.hpp"
#include "util/error.hpp"

namespace ptrain::kernels {
namespace {

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

}  // namespace

template <class T>
void crossentropy_row_max(Vec<accumulate_t<T>> row_max, CVec<T> logits, int N,
                          const VocabShard& shard) {
  require_len("crossentropy_row_max row_max", row_max.extent(0), std::size_t(N));
  require_len("crossentropy_row_max logits", logits.extent(0), std::size_t(N) * shard.v_local);
  const int V = shard.v_local, nreal = real_columns(shard);
  const accumulate_t<T> lowest = -std::numeric_limits<accumulate_t<T>>::infinity();
  Kokkos::parallel_for(
      "ptrain::crossentropy_row_max", N, KOKKOS_LAMBDA(int n) {
        row_max(n) = detail::row_max(logits.data() + std::size_t(n) * V, nreal, lowest);
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
  Kokkos::parallel_for(
      "ptrain::crossentropy_row_sumexp", N, KOKKOS_LAMBDA(int n) {
        const T* x = logits.data() + std::size_t(n) * V;
        sumexp(n) = detail::row_sum_exp(x, nreal, A(1), row_max(n));
        const int col = targets(n) - v_begin;
        target_logit(n) = (col >= 0 && col < nreal) ? A(x[col]) : A(0);
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
  Kokkos::parallel_for(
      "ptrain::crossentropy_backward", N, KOKKOS_LAMBDA(int n) {
        T* x = logits.data() + std::size_t(n) * V;
        const A m = row_max(n), scale = dloss / sumexp(n);
        const int col = targets(n) - v_begin;
        (void)
            nreal;  // nvcc: a device lambda may not capture a variable first inside `if constexpr`.
        if constexpr (std::is_same_v<T, A>) {
          for (int v = 0; v < nreal; ++v) x[v] = detail::exp_(x[v] - m) * scale;
          if (col >= 0 && col < nreal) x[col] -= dloss;
        } else {  // bf16: the target's p - 1 in fp32, rounded once
          const A target =
              col >= 0 && col < nreal ? detail::exp_(A(x[col]) - m) * scale - dloss : 0;
          for (int v = 0; v < nreal; ++v) x[v] = T(detail::exp_(A(x[v]) - m) * scale);
          if (col >= 0 && col < nreal) x[col] = T(target);
        }
        for (int v = nreal; v < V; ++v) x[v] = T(0);
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
