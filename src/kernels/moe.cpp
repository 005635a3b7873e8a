// kernels/moe.cpp — the mixture-of-experts kernels: the router's softmax, and row gathers
// and combines by index (each output row written by one thread: deterministic, no atomics).
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
}  // namespace

template <class T>
void softmax_rows_forward(Vec<T> probs, CVec<T> logits, int N, int E) {
  require_len("softmax_rows_forward probs", probs.extent(0), std::size_t(N) * E);
  require_len("softmax_rows_forward logits", logits.extent(0), std::size_t(N) * E);
  using A = accumulate_t<T>;
  const A neg_inf = -std::numeric_limits<A>::infinity();
  Kokkos::parallel_for(
      "ptrain::softmax_rows_forward", N, KOKKOS_LAMBDA(int t) {
        const T* x = logits.data() + std::size_t(t) * E;
        T* p = probs.data() + std::size_t(t) * E;
        const A m = detail::row_max(x, E, neg_inf);
        A sum = 0;
        (void)p;  // nvcc: a device lambda may not capture a variable first inside `if constexpr`.
        if constexpr (std::is_same_v<T, A>) {
          for (int e = 0; e < E; ++e) sum += (p[e] = detail::exp_(x[e] - m));
          for (int e = 0; e < E; ++e) p[e] /= sum;
        } else {  // bf16: the exponentials stay in fp32 until the division
          for (int e = 0; e < E; ++e) sum += detail::exp_(A(x[e]) - m);
          for (int e = 0; e < E; ++e) p[e] = T(detail::exp_(A(x[e]) - m) / sum);
        }
      });
}

template <class T>
void softmax_rows_backward(Vec<T> dlogits, CVec<T> probs, CVec<T> dprobs, int N, int E) {
  require_len("softmax_rows_backward dlogits", dlogits.extent(0), std::size_t(N) * E);
  require_len("softmax_rows_backward probs", probs.extent(0), std::size_t(N) * E);
  require_len("softmax_rows_backward dprobs", dprobs.extent(0), std::size_t(N) * E);
  Kokkos::parallel_for(
      "ptrain::softmax_rows_backward", N, KOKKOS_LAMBDA(int t) {
        const T* p = probs.data() + std::size_t(t) * E;
        const T* dp = dprobs.data() + std::size_t(t) * E;
        T* dx = dlogits.data() + std::size_t(t) * E;
        using A = accumulate_t<T>;
        const A s = detail::row_dot(p, dp, E);
        for (int e = 0; e < E; ++e) dx[e] = T(A(p[e]) * (A(dp[e]) - s));
      });
}

template <class T>
void combine_rows(Vec<T> dst, CVec<T> src, IntVec rows, CVec<T> weight, int N, int k, int C,
                  bool accumulate) {
  require_len("combine_rows dst", dst.extent(0), std::size_t(N) * C);
  require_len("combine_rows rows", rows.extent(0), std::size_t(N) * k);
  const bool weighted = weight.extent(0) > 0;
  if (weighted) require_len("combine_rows weight", weight.extent(0), std::size_t(N) * k);
  Kokkos::parallel_for(
      "ptrain::combine_rows", N, KOKKOS_LAMBDA(int t) {
        using A = accumulate_t<T>;
        T* d = dst.data() + std::size_t(t) * C;
        // nvcc: a device lambda may not capture a variable first inside `if constexpr`.
        (void)accumulate, (void)k, (void)rows, (void)weighted, (void)weight, (void)src;
        if constexpr (std::is_same_v<T, A>) {
          if (!accumulate)
            for (int c = 0; c < C; ++c) d[c] = T(0);
          for (int j = 0; j < k; ++j) {
            const int r = rows(std::size_t(t) * k + j);
            if (r < 0) continue;
            const T w = weighted ? weight(std::size_t(t) * k + j) : T(1);
            const T* s = src.data() + std::size_t(r) * C;
            for (int c = 0; c < C; ++c) d[c] += w * s[c];
          }
        } else {  // bf16: each output element summed over the k choices in fp32, rounded once
          for (int c = 0; c < C; ++c) {
            A sum = accumulate ? A(d[c]) : A(0);
            for (int j = 0; j < k; ++j) {
              const int r = rows(std::size_t(t) * k + j);
              if (r < 0) continue;
              const A w = weighted ? A(weight(std::size_t(t) * k + j)) : A(1);
              sum += w * A(src(std::size_t(r) * C + c));
            }
            d[c] = T(sum);
          }
        }
      });
}

template <class T>
void row_dots(Vec<T> dots, CVec<T> a, CVec<T> b, IntVec rows, int N, int k, int C) {
  require_len("row_dots dots", dots.extent(0), std::size_t(N) * k);
  require_len("row_dots a", a.extent(0), std::size_t(N) * C);
  require_len("row_dots rows", rows.extent(0), std::size_t(N) * k);
  Kokkos::parallel_for(
      "ptrain::row_dots", N, KOKKOS_LAMBDA(int t) {
        for (int j = 0; j < k; ++j) {
          const int r = rows(std::size_t(t) * k + j);
          dots(std::size_t(t) * k + j) = r < 0
                                             ? T(0)
                                             : T(detail::row_dot(a.data() + std::size_t(t) * C,
                                                                 b.data() + std::size_t(r) * C, C));
        }
      });
}

#define PTRAIN_INSTANTIATE(T)                                                           \
  template void softmax_rows_forward<T>(Vec<T>, CVec<T>, int, int);                     \
  template void softmax_rows_backward<T>(Vec<T>, CVec<T>, CVec<T>, int, int);           \
  template void combine_rows<T>(Vec<T>, CVec<T>, IntVec, CVec<T>, int, int, int, bool); \
  template void row_dots<T>(Vec<T>, CVec<T>, CVec<T>, IntVec, int, int, int);
PTRAIN_INSTANTIATE(float)
PTRAIN_INSTANTIATE(double)
PTRAIN_INSTANTIATE(bf16)
#undef PTRAIN_INSTANTIATE

}  // namespace ptrain::kernels
