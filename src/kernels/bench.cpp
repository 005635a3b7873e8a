// kernels/bench.cpp — per-kernel timings at a GPT shape.
#include "kernels/bench.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>

#include "kernels/attention.hpp"
#include "kernels/kernels.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"
#include "util/timer.hpp"

namespace ptrain::kernels {
namespace {

// Deterministic values in [-0.5, 0.5) from a hash of the index.
template <class T>
void fill_random(const Vec<T>& x, std::uint64_t seed) {
  Kokkos::parallel_for(
      "ptrain::bench_fill", x.extent(0), KOKKOS_LAMBDA(std::size_t i) {
        std::uint64_t z = (std::uint64_t(i) + seed) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        x(i) = T(double(z >> 11) * (1.0 / 9007199254740992.0) - 0.5);
      });
}

// Mean seconds per call of f over at least `seconds` (after one warm-up call).
double time_calls(const std::function<void()>& f, double seconds) {
  f();
  Kokkos::fence();
  int calls = 0;
  const double t0 = wall_seconds();
  double elapsed = 0;
  do {
    f();
    Kokkos::fence();
    ++calls;
    elapsed = wall_seconds() - t0;
  } while (elapsed < seconds || calls < 2);
  return elapsed / calls;
}

}  // namespace

template <class T>
std::vector<KernelTiming> benchmark_kernels(const BenchShape& s, double seconds_per_kernel) {
  PTRAIN_REQUIRE(s.B > 0 && s.T > 0 && s.C > 0 && s.NH > 0 && s.V > 0 && s.C % s.NH == 0,
                 "benchmark_kernels: bad shape B=", s.B, " T=", s.T, " C=", s.C, " NH=", s.NH,
                 " V=", s.V);
  const int B = s.B, Tn = s.T, C = s.C, NH = s.NH, HS = C / NH, V = s.V, N = B * Tn;
  const std::size_t NC = std::size_t(N) * C;
  std::vector<TrackedView<T>> bufs;
  auto buf = [&](std::size_t n) -> Vec<T> {
    bufs.emplace_back(MemCategory::workspace, "bench", n);
    fill_random(bufs.back().view(), bufs.size() * 7919);
    return bufs.back().view();
  };
  // one block's tensors and their gradients
  const Vec<T> x = buf(NC), dx = buf(NC), ln = buf(NC), dln = buf(NC), mean = buf(N), rstd = buf(N);
  const Vec<T> lnw = buf(C), lnb = buf(C), dlnw = buf(C), dlnb = buf(C);
  const Vec<T> qkv = buf(3 * NC), dqkv = buf(3 * NC), wqkv = buf(3 * std::size_t(C) * C),
               bqkv = buf(3 * C), dwqkv = buf(3 * std::size_t(C) * C), dbqkv = buf(3 * C);
  const Vec<T> att = buf(NC), datt = buf(NC), lse = buf(std::size_t(B) * NH * Tn);
  const Vec<T> wo = buf(std::size_t(C) * C), bo = buf(C), dwo = buf(std::size_t(C) * C),
               dbo = buf(C);
  const Vec<T> h = buf(4 * NC), dh = buf(4 * NC), g = buf(4 * NC), dg = buf(4 * NC);
  const Vec<T> wfc = buf(4 * std::size_t(C) * C), bfc = buf(4 * C),
               dwfc = buf(4 * std::size_t(C) * C), dbfc = buf(4 * C);
  const Vec<T> wte = buf(std::size_t(V) * C), dwte = buf(std::size_t(V) * C),
               wpe = buf(std::size_t(Tn) * C), dwpe = buf(std::size_t(Tn) * C);
  const Vec<T> logits = buf(std::size_t(N) * V), mx = buf(N), se = buf(N), tl = buf(N),
               loss = buf(N);
  TrackedView<int> tokens_buf(MemCategory::workspace, "bench_tokens", N);
  const Kokkos::View<int*> tokens = tokens_buf.view();
  Kokkos::parallel_for(
      "ptrain::bench_tokens", N,
      KOKKOS_LAMBDA(int n) { tokens(n) = int((std::int64_t(n) * 7919) % V); });
  const IntVec no_pos;
  const Vec<T> none;
  const VocabShard shard{0, V, V};
  // attention on a (B, T, 3C) buffer of scale-1 q.k scores
  scale(qkv, T(0.1));

  std::vector<KernelTiming> out;
  auto run = [&](const std::string& name, double gflop, const std::function<void()>& f) {
    out.push_back({name, time_calls(f, seconds_per_kernel), gflop});
  };
  auto mm_flop = [&](int in, int outc) { return 2.0 * N * in * outc * 1e-9; };
  const std::string rows = std::to_string(N) + "x";
  auto mm_name = [&](const char* what, int in, int outc) {
    return std::string(what) + " (" + rows + std::to_string(in) + " -> " + std::to_string(outc) +
           ")";
  };
  const double attn_flop = 4.0 * B * NH * HS * (double(Tn) * (Tn + 1) / 2) * 1e-9;

  run("encoder_forward", 0,
      [&] { encoder_forward<T>(x, tokens, no_pos, wte, wpe, B, Tn, C, 0, V); });
  run("encoder_backward", 0,
      [&] { encoder_backward<T>(dwte, dwpe, dx, tokens, no_pos, B, Tn, C, 0, V); });
  run("layernorm_forward", 0, [&] { layernorm_forward<T>(ln, mean, rstd, x, lnw, lnb, N, C); });
  run("layernorm_backward", 0,
      [&] { layernorm_backward<T>(dx, dlnw, dlnb, dln, x, lnw, mean, rstd, N, C); });
  run(mm_name("matmul_forward qkv", C, 3 * C), mm_flop(C, 3 * C),
      [&] { matmul_forward<T>(qkv, ln, wqkv, bqkv, N, C, 3 * C); });
  run(mm_name("matmul_backward qkv", C, 3 * C), 2 * mm_flop(C, 3 * C),
      [&] { matmul_backward<T>(dln, dwqkv, dbqkv, dqkv, ln, wqkv, N, C, 3 * C); });
  scale(qkv, T(0.1));
  run("attention_forward", attn_flop, [&] { attention_forward<T>(att, lse, qkv, B, Tn, NH, HS); });
  run("attention_backward", 2.5 * attn_flop,
      [&] { attention_backward<T>(dqkv, datt, att, lse, qkv, B, Tn, NH, HS); });
  run(mm_name("matmul_forward attn_proj", C, C), mm_flop(C, C),
      [&] { matmul_forward<T>(x, att, wo, bo, N, C, C); });
  run(mm_name("matmul_backward attn_proj", C, C), 2 * mm_flop(C, C),
      [&] { matmul_backward<T>(datt, dwo, dbo, dx, att, wo, N, C, C); });
  run("residual_forward", 0, [&] { residual_forward<T>(x, ln, att, NC); });
  run(mm_name("matmul_forward fc", C, 4 * C), mm_flop(C, 4 * C),
      [&] { matmul_forward<T>(h, ln, wfc, bfc, N, C, 4 * C); });
  run(mm_name("matmul_backward fc", C, 4 * C), 2 * mm_flop(C, 4 * C),
      [&] { matmul_backward<T>(dln, dwfc, dbfc, dh, ln, wfc, N, C, 4 * C); });
  run("gelu_forward", 0, [&] { gelu_forward<T>(g, h, 4 * NC); });
  run("gelu_backward", 0, [&] { gelu_backward<T>(dh, h, dg, 4 * NC); });
  run(mm_name("matmul_forward mlp_proj", 4 * C, C), mm_flop(4 * C, C),
      [&] { matmul_forward<T>(x, g, wfc, bo, N, 4 * C, C); });
  run(mm_name("matmul_backward mlp_proj", 4 * C, C), 2 * mm_flop(4 * C, C),
      [&] { matmul_backward<T>(dg, dwfc, dbo, dx, g, wfc, N, 4 * C, C); });
  run(mm_name("matmul_forward lm_head", C, V), mm_flop(C, V),
      [&] { matmul_forward<T>(logits, ln, wte, none, N, C, V); });
  run("crossentropy_row_max", 0, [&] { crossentropy_row_max<T>(mx, logits, N, shard); });
  run("crossentropy_row_sumexp", 0,
      [&] { crossentropy_row_sumexp<T>(se, tl, logits, mx, tokens, N, shard); });
  run("crossentropy_loss", 0, [&] { crossentropy_loss<T>(loss, mx, se, tl, N); });
  run("crossentropy_backward", 0,
      [&] { crossentropy_backward<T>(logits, mx, se, tokens, N, shard, T(1.0 / N)); });
  run(mm_name("matmul_backward lm_head", C, V), 2 * mm_flop(C, V),
      [&] { matmul_backward<T>(dln, dwte, none, logits, ln, wte, N, C, V); });
  return out;
}

template std::vector<KernelTiming> benchmark_kernels<float>(const BenchShape&, double);
template std::vector<KernelTiming> benchmark_kernels<double>(const BenchShape&, double);

}  // namespace ptrain::kernels
