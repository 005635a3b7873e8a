// kernels/attention.cpp — the attention entry points: argument checks, then the kernel the
// config names (attention_host.cpp or attention_device.cpp); the lse merge of key chunks.
#include "kernels/attention.hpp"

#include <cmath>
#include <cstddef>
#include <limits>
#include <string>

#include "kernels/attention_detail.hpp"
#include "kernels/detail_math.hpp"
#include "util/element_types.hpp"
#include "util/error.hpp"

namespace ptrain::kernels {
namespace {

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

// The checks the forward and the backward share: the config, and Q, K and V as heads of
// (B, Tq | Tk, NH * HS). Returns C = NH * HS.
template <class T>
int check_qkv(const std::string& fn, const CHeads<T>& q, const CHeads<T>& k, const CHeads<T>& v,
              int B, int Tq, int Tk, int NH, int HS, const AttentionConfig& cfg) {
  check_config(cfg, B, Tq, Tk, NH, HS);
  const int C = NH * HS;
  check_heads((fn + " q").c_str(), q, B, Tq, C);
  check_heads((fn + " k").c_str(), k, B, Tk, C);
  check_heads((fn + " v").c_str(), v, B, Tk, C);
  return C;
}

template <class T>
void check_backward_args(const Heads<T>& dq, const Heads<T>& dk, const Heads<T>& dv,
                         const CVec<T>& dout, const CVec<T>& out, const CVec<accumulate_t<T>>& lse,
                         const CHeads<T>& q, const CHeads<T>& k, const CHeads<T>& v, int B, int Tq,
                         int Tk, int NH, int HS, const AttentionConfig& cfg) {
  const int C = check_qkv<T>("attention_backward", q, k, v, B, Tq, Tk, NH, HS, cfg);
  check_heads("attention_backward dq", dq, B, Tq, C);
  check_heads("attention_backward dk", dk, B, Tk, C);
  check_heads("attention_backward dv", dv, B, Tk, C);
  require_len("attention_backward dout", dout.extent(0), std::size_t(B) * Tq * C);
  require_len("attention_backward out", out.extent(0), std::size_t(B) * Tq * C);
  require_len("attention_backward lse", lse.extent(0), std::size_t(B) * NH * Tq);
}

void require_kernel(const AttentionConfig& cfg) {
  PTRAIN_REQUIRE(!PTRAIN_DEVICE_BUILD || cfg.kernel == KernelShape::device,
                 "attention: the host kernel is not built for a device execution space");
}

}  // namespace

std::int64_t attention_pairs(int Tq, int Tk, const AttentionConfig& cfg) {
  std::int64_t n = 0;
  for (int i = 0; i < Tq; ++i)
    n += detail::visible_keys(cfg.causal, cfg.q_pos0 + i, cfg.k_pos0, Tk);
  return n;
}

template <class T>
AttentionScratch attention_scratch(int Tq, int Tk, int HS, const AttentionConfig& cfg) {
  check_config(cfg, 1, Tq, Tk, 1, HS);
  require_kernel(cfg);
  if (cfg.kernel == KernelShape::device)
    return detail::device_attention_scratch<T>(Tq, Tk, HS, cfg);
#if !PTRAIN_DEVICE_BUILD
  return detail::host_attention_scratch<T>(Tq, Tk, HS, cfg);
#else
  return {};
#endif
}

template <class T>
void attention_forward(Vec<T> out, Vec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k, CHeads<T> v,
                       int B, int Tq, int Tk, int NH, int HS, const AttentionConfig& cfg) {
  const int C = check_qkv<T>("attention_forward", q, k, v, B, Tq, Tk, NH, HS, cfg);
  require_len("attention_forward out", out.extent(0), std::size_t(B) * Tq * C);
  require_len("attention_forward lse", lse.extent(0), std::size_t(B) * NH * Tq);
  require_kernel(cfg);
  if (B == 0 || Tq == 0) return;
  if (cfg.kernel == KernelShape::device)
    return detail::device_attention_forward<T>(out, lse, q, k, v, B, Tq, Tk, NH, HS, cfg);
#if !PTRAIN_DEVICE_BUILD
  detail::host_attention_forward<T>(out, lse, q, k, v, B, Tq, Tk, NH, HS, cfg);
#endif
}

template <class T>
void attention_forward(Vec<T> out, Vec<accumulate_t<T>> lse, CVec<T> qkv, int B, int T_, int NH,
                       int HS, const AttentionConfig& cfg) {
  const int C = NH * HS;
  attention_forward<T>(out, lse, qkv_part<const T>(qkv, 0, C), qkv_part<const T>(qkv, 1, C),
                       qkv_part<const T>(qkv, 2, C), B, T_, T_, NH, HS, cfg);
}

template <class T>
void attention_backward(Heads<T> dq, Heads<T> dk, Heads<T> dv, CVec<T> dout, CVec<T> out,
                        CVec<accumulate_t<T>> lse, CHeads<T> q, CHeads<T> k, CHeads<T> v, int B,
                        int Tq, int Tk, int NH, int HS, const AttentionConfig& cfg,
                        bool accumulate) {
  check_backward_args(dq, dk, dv, dout, out, lse, q, k, v, B, Tq, Tk, NH, HS, cfg);
  require_kernel(cfg);
  if (B == 0) return;
  if (cfg.kernel == KernelShape::device)
    return detail::device_attention_backward<T>(dq, dk, dv, dout, out, lse, q, k, v, B, Tq, Tk, NH,
                                                HS, cfg, accumulate);
#if !PTRAIN_DEVICE_BUILD
  detail::host_attention_backward<T>(dq, dk, dv, dout, out, lse, q, k, v, B, Tq, Tk, NH, HS, cfg,
                                     accumulate);
#endif
}

template <class T>
void attention_backward(Vec<T> dqkv, CVec<T> dout, CVec<T> out, CVec<accumulate_t<T>> lse,
                        CVec<T> qkv, int B, int T_, int NH, int HS, const AttentionConfig& cfg) {
  const int C = NH * HS;
  attention_backward<T>(qkv_part<T>(dqkv, 0, C), qkv_part<T>(dqkv, 1, C), qkv_part<T>(dqkv, 2, C),
                        dout, out, lse, qkv_part<const T>(qkv, 0, C), qkv_part<const T>(qkv, 1, C),
                        qkv_part<const T>(qkv, 2, C), B, T_, T_, NH, HS, cfg, false);
}

template <class T>
void attention_merge(Vec<T> out_a, Vec<accumulate_t<T>> lse_a, CVec<T> out_b,
                     CVec<accumulate_t<T>> lse_b, int B, int T_, int NH, int HS) {
  using A = accumulate_t<T>;
  const int C = NH * HS;
  require_len("attention_merge out_a", out_a.extent(0), std::size_t(B) * T_ * C);
  require_len("attention_merge out_b", out_b.extent(0), std::size_t(B) * T_ * C);
  require_len("attention_merge lse_a", lse_a.extent(0), std::size_t(B) * NH * T_);
  require_len("attention_merge lse_b", lse_b.extent(0), std::size_t(B) * NH * T_);
  const A neg_inf = -std::numeric_limits<A>::infinity();
  Kokkos::parallel_for(
      "ptrain::attention_merge", B * NH * T_, KOKKOS_LAMBDA(int i) {
        // i = (b*NH + h)*T + t, the lse index
        const int t = i % T_, bh = i / T_, h = bh % NH, b = bh / NH;
        const A la = lse_a(i), lb = lse_b(i);
        const A m = la > lb ? la : lb;
        T* oa = out_a.data() + (std::size_t(b) * T_ + t) * C + std::size_t(h) * HS;
        const T* ob = out_b.data() + (std::size_t(b) * T_ + t) * C + std::size_t(h) * HS;
        if (m == neg_inf) {  // neither part saw a key
          for (int d = 0; d < HS; ++d) oa[d] = T(0);
          lse_a(i) = neg_inf;
          return;
        }
        const A wa = la == neg_inf ? A(0) : detail::exp_(la - m);
        const A wb = lb == neg_inf ? A(0) : detail::exp_(lb - m);
        const A sum = wa + wb, ia = wa / sum, ib = wb / sum;
        for (int d = 0; d < HS; ++d) oa[d] = T(ia * A(oa[d]) + ib * A(ob[d]));
        lse_a(i) = m + detail::log_(sum);
      });
}

#define PTRAIN_INSTANTIATE(T)                                                                      \
  template AttentionScratch attention_scratch<T>(int, int, int, const AttentionConfig&);           \
  template void attention_forward<T>(Vec<T>, Vec<accumulate_t<T>>, CHeads<T>, CHeads<T>,           \
                                     CHeads<T>, int, int, int, int, int, const AttentionConfig&);  \
  template void attention_forward<T>(Vec<T>, Vec<accumulate_t<T>>, CVec<T>, int, int, int, int,    \
                                     const AttentionConfig&);                                      \
  template void attention_backward<T>(Heads<T>, Heads<T>, Heads<T>, CVec<T>, CVec<T>,              \
                                      CVec<accumulate_t<T>>, CHeads<T>, CHeads<T>, CHeads<T>, int, \
                                      int, int, int, int, const AttentionConfig&, bool);           \
  template void attention_backward<T>(Vec<T>, CVec<T>, CVec<T>, CVec<accumulate_t<T>>, CVec<T>,    \
                                      int, int, int, int, const AttentionConfig&);                 \
  template void attention_merge<T>(Vec<T>, Vec<accumulate_t<T>>, CVec<T>, CVec<accumulate_t<T>>,   \
                                   int, int, int, int);
PTRAIN_INSTANTIATE(float)
PTRAIN_INSTANTIATE(double)
PTRAIN_INSTANTIATE(bf16)
#undef PTRAIN_INSTANTIATE

}  // namespace ptrain::kernels
