#include "parallel/calibrate.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <memory>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/comm.hpp"
#include "deck/deck.hpp"
#include "kernels/attention.hpp"
#include "kernels/gemm.hpp"
#include "kernels/kernels.hpp"
#include "model/layout.hpp"
#include "optim/optim.hpp"
#include "parallel/cost.hpp"
#include "parallel/plan.hpp"
#include "parallel/report.hpp"
#include "parallel/trainer.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/mpi.hpp"
#include "util/timer.hpp"

namespace ptrain::parallel {

namespace {

// Every rank of `comm` has arrived before any goes on (an all-reduce of nothing).
void line_up(Comm& comm) {
  double nothing = 0;
  comm.all_reduce_sum_now(&nothing, 1);
}

// x[0..n) as rank 0 of `comm` has it, on every rank.
void from_rank0(Comm& comm, double* x, int n) {
  if (comm.rank() != 0) std::fill(x, x + n, 0.0);
  comm.all_reduce_sum_now(x, n);
}

// Seconds per call of f() on this rank, every rank starting together: f() once to warm up and
// size the run, then as many calls as take about `budget` seconds (at least one; the same
// number on every rank, as f may be a collective); the median over the ranks.
template <class F>
double timed(Comm& comm, double budget, F&& f) {
  line_up(comm);
  double once = wall_seconds();
  f();
  Kokkos::fence();
  once = wall_seconds() - once;
  comm.all_reduce_max(&once, 1, Space::host).wait();
  const int calls = int(std::clamp(budget / std::max(once, 1e-9), 1.0, 1000.0));
  line_up(comm);
  const double t0 = wall_seconds();
  for (int k = 0; k < calls; ++k) {
    f();
    Kokkos::fence();
  }
  const double mine = (wall_seconds() - t0) / calls;
  std::vector<double> all(std::size_t(comm.size()));
  comm.all_gather(&mine, all.data(), std::vector<int>(all.size(), 1), Space::host).wait();
  std::nth_element(all.begin(), all.begin() + std::ptrdiff_t(all.size() / 2), all.end());
  return all[all.size() / 2];
}

// Least squares of y ~ sum_j c_j x_j, each row weighted 1 / y (relative errors): the
// coefficients, or empty when the system is singular. At most 3 unknowns.
std::vector<double> fit(const std::vector<std::vector<double>>& x, const std::vector<double>& y) {
  const std::size_t n = x.empty() ? 0 : x[0].size();
  std::vector<std::vector<double>> a(n, std::vector<double>(n + 1, 0.0));
  for (std::size_t i = 0; i < y.size(); ++i) {
    const double w = 1 / (y[i] * y[i]);
    for (std::size_t j = 0; j < n; ++j) {
      for (std::size_t k = 0; k < n; ++k) a[j][k] += w * x[i][j] * x[i][k];
      a[j][n] += w * x[i][j] * y[i];
    }
  }
  for (std::size_t j = 0; j < n; ++j) {  // Gauss-Jordan with partial pivoting
    std::size_t pivot = j;
    for (std::size_t r = j + 1; r < n; ++r)
      if (std::abs(a[r][j]) > std::abs(a[pivot][j])) pivot = r;
    std::swap(a[j], a[pivot]);
    if (std::abs(a[j][j]) < 1e-300) return {};
    for (std::size_t r = 0; r < n; ++r) {
      if (r == j) continue;
      const double f = a[r][j] / a[j][j];
      for (std::size_t k = j; k <= n; ++k) a[r][k] -= f * a[j][k];
    }
  }
  std::vector<double> c(n);
  for (std::size_t j = 0; j < n; ++j) c[j] = a[j][n] / a[j][j];
  return c;
}

// The median relative error of a fit: |model - measured| / measured.
double fit_error(const std::vector<std::vector<double>>& x, const std::vector<double>& y,
                 const std::vector<double>& c) {
  std::vector<double> e;
  for (std::size_t i = 0; i < y.size(); ++i) {
    double m = 0;
    for (std::size_t j = 0; j < c.size(); ++j) m += c[j] * x[i][j];
    e.push_back(std::abs(m - y[i]) / y[i]);
  }
  std::nth_element(e.begin(), e.begin() + std::ptrdiff_t(e.size() / 2), e.end());
  return e.empty() ? 0 : e[e.size() / 2];
}

// ---- gemm ----------------------------------------------------------------------------------

using GemmShape = std::tuple<double, double, double>;  // M, N, K

// The products the deck's layers make (forward and both backward ones) at tp 1, 2, 4, 8 and
// micro-batches of 1/4, 1 and 4 times the deck's rows.
std::vector<GemmShape> deck_gemm_shapes(const Config& config) {
  const model::Dims d = model::dims_of(config);
  const double R = double(config.train.micro_batch) * double(d.S / config.parallel.cp);
  std::set<GemmShape> shapes;
  for (int t : {1, 2, 4, 8}) {
    if (d.C % t != 0 || d.NH % t != 0) continue;
    for (double rows : {R / 4, R, 4 * R}) {
      if (rows < 1) continue;
      const double C = double(d.C), F = double(d.F);
      for (auto [out, in] : {std::pair{3 * C / t, C}, std::pair{C, C / t}, std::pair{F / t, C},
                             std::pair{C, F / t}}) {
        shapes.insert({rows, out, in});
        shapes.insert({rows, in, out});
        shapes.insert({in, out, rows});
      }
    }
  }
  return {shapes.begin(), shapes.end()};
}

template <class T>
double gemm_call_seconds(Comm& comm, double budget, const GemmShape& s) {
  // Plain ints, not structured bindings: a lambda may not capture those in C++17.
  const int M = int(std::get<0>(s)), N = int(std::get<1>(s)), K = int(std::get<2>(s));
  Kokkos::View<T*> a("calibrate::a", std::size_t(M) * std::size_t(K)),
      b("calibrate::b", std::size_t(K) * std::size_t(N)),
      c("calibrate::c", std::size_t(M) * std::size_t(N));
  Kokkos::deep_copy(a, T(0.5f));
  Kokkos::deep_copy(b, T(0.25f));
  return timed(comm, budget, [&] { kernels::gemm<T>(false, false, M, N, K, 1, a, b, 0, c); });
}

struct GemmFit {
  double peak = 0, half_dim = 0, overhead = 0, error = 0;
  int shapes = 0;
};

// t = a F + b F / d + o with F = 2MNK: peak = 1/a, half dimension b/a, overhead o. Shapes
// whose one call would take more than ~0.2 s at a first probe's rate are left out.
template <class T>
GemmFit fit_gemm(Comm& comm, const std::vector<GemmShape>& shapes) {
  const double probe = 2.0 * 512 * 512 * 512 / gemm_call_seconds<T>(comm, 0.05, {512, 512, 512});
  std::vector<std::vector<double>> x;
  std::vector<double> y;
  for (const GemmShape& s : shapes) {
    const auto [M, N, K] = s;
    const double F = 2 * M * N * K;
    if (F > 0.2 * probe || M * K + K * N + M * N > 6.4e7) continue;
    y.push_back(gemm_call_seconds<T>(comm, 0.02, s));
    x.push_back({F, F / std::min({M, N, K}), 1.0});
  }
  GemmFit g;
  g.shapes = int(y.size());
  std::vector<double> c = fit(x, y);
  if (c.size() == 3 && (c[1] < 0 || c[2] < 0)) {  // no negative costs: fit without them
    std::vector<std::vector<double>> x2;
    for (auto& r : x) x2.push_back({r[0], r[1]});
    c = fit(x2, y);
    if (c.size() == 2 && c[1] < 0) c[1] = 0;
    if (c.size() == 2) c.push_back(0);
    g.error = c.size() == 3 ? fit_error(x, y, c) : 0;
  } else if (c.size() == 3) {
    g.error = fit_error(x, y, c);
  }
  if (c.size() != 3 || c[0] <= 0) return {probe, 0, 0, 0, g.shapes};  // the probe alone
  g.peak = 1 / c[0], g.half_dim = c[1] / c[0], g.overhead = c[2];
  return g;
}

// ---- attention, row kernels, optimizer -------------------------------------------------------

template <class T>
std::pair<double, double> attention_rates(Comm& comm, const Config& config) {
  using A = accumulate_t<T>;
  const model::Dims d = model::dims_of(config);
  const int B = int(config.train.micro_batch), S = int(d.S / config.parallel.cp),
            NH = int(d.NH / config.parallel.tp), HS = int(d.HS);
  const std::size_t rows = std::size_t(B) * std::size_t(S);
  Kokkos::View<T*> qkv("calibrate::qkv", rows * 3 * std::size_t(NH * HS)),
      out("calibrate::out", rows * std::size_t(NH * HS)),
      dout("calibrate::dout", rows * std::size_t(NH * HS)),
      dqkv("calibrate::dqkv", rows * 3 * std::size_t(NH * HS));
  Kokkos::View<A*> lse("calibrate::lse", rows * std::size_t(NH));
  Kokkos::deep_copy(qkv, T(0.01f));
  Kokkos::deep_copy(dout, T(0.01f));
  const double pairs = double(S) * (S + 1) / 2 * B * NH;
  const double f =
      timed(comm, 0.1, [&] { kernels::attention_forward<T>(out, lse, qkv, B, S, NH, HS); });
  const double b = timed(
      comm, 0.1, [&] { kernels::attention_backward<T>(dqkv, dout, out, lse, qkv, B, S, NH, HS); });
  return {4 * HS * pairs / f, 8 * HS * pairs / b};
}

// Bytes per second of LayerNorm's forward and GELU's, by the cost model's byte counts.
template <class T>
double elementwise_rate(Comm& comm, const Config& config) {
  using A = accumulate_t<T>;
  const model::Dims d = model::dims_of(config);
  const int N = int(config.train.micro_batch * d.S), C = int(d.C);
  const std::size_t n = std::size_t(N) * std::size_t(C), nf = std::size_t(N) * std::size_t(d.F);
  Kokkos::View<T*> x("calibrate::x", n), y("calibrate::y", n), w("calibrate::w", std::size_t(C)),
      bias("calibrate::bias", std::size_t(C)), h("calibrate::h", nf), g("calibrate::g", nf);
  Kokkos::View<A*> mean("calibrate::mean", std::size_t(N)), rstd("calibrate::rstd", std::size_t(N));
  Kokkos::deep_copy(x, T(0.5f));
  Kokkos::deep_copy(h, T(0.5f));
  Kokkos::deep_copy(w, T(1.0f));
  const double ln =
      timed(comm, 0.1, [&] { kernels::layernorm_forward<T>(y, mean, rstd, x, w, bias, N, C); });
  const double gelu = timed(comm, 0.1, [&] { kernels::gelu_forward<T>(g, h, nf); });
  const double bytes = (3.0 * double(n) + 2.0 * double(nf)) * double(sizeof(T));
  return bytes / (ln + gelu);
}

template <class M, class G>
double optimizer_rate(Comm& comm, const Config& config) {
  const std::size_t n = std::size_t(1) << 22;
  Kokkos::View<M*> p("calibrate::p", n);
  Kokkos::View<G*> grad("calibrate::grad", n);
  Kokkos::deep_copy(p, M(0.5));
  Kokkos::deep_copy(grad, G(0.001f));
  auto opt = optim::make_optimizer<M>(config.train.optimizer, {{0, n, true}}, 0, n,
                                      optim::hyper_from_config(config));
  const double t = timed(comm, 0.1, [&] { opt->step(p, grad, 1e-4, 1.0); });
  const double sw = double(sizeof(M)), gw = double(sizeof(G));
  return double(n) * (config.train.optimizer == "adamw" ? gw + 6 * sw : gw + 2 * sw) / t;
}

// ---- communication ---------------------------------------------------------------------------

struct CommFit {
  bool measured = false;
  std::array<double, 4> latency{}, bandwidth{};
};

// The four operations over `comm` (more than one rank) at 64 B .. 16 MiB, fitted.
CommFit fit_comm(Comm& comm) {
  CommFit out;
  const int n = comm.size();
  if (n < 2) return out;
  out.measured = true;
  const std::size_t most = std::size_t(4) << 20;  // floats: 16 MiB
  Kokkos::View<float*> a("calibrate::send", most), b("calibrate::recv", most);
  for (int op = 0; op < 4; ++op) {
    std::vector<std::vector<double>> x;
    std::vector<double> y;
    for (std::size_t count = 16; count <= most; count *= 8) {
      const std::size_t per = std::max<std::size_t>(1, count / std::size_t(n));
      double bytes = 0;
      const double t = timed(comm, 0.02, [&] {
        const double before = comm.stats().bytes;
        switch (op) {
          case 0:
            comm.all_reduce_sum(a.data(), count).wait();
            break;
          case 1:
            comm.all_gather(a.data(), b.data(), std::vector<int>(std::size_t(n), int(per))).wait();
            break;
          case 2:
            comm.all_to_all(a.data(), b.data(), per).wait();
            break;
          default: {  // pairs 0-1, 2-3, ...: each sends and receives count floats
            const int peer = comm.rank() ^ 1;
            if (peer < n) {
              auto r = comm.recv(b.data(), count, peer, 7);
              comm.send(a.data(), count, peer, 7).wait();
              r.wait();
            }
          }
        }
        bytes = comm.stats().bytes - before;
      });
      const double steps = op == 0 ? 2.0 * (n - 1) : op == 3 ? 1.0 : double(n - 1);
      if (bytes <= 0) continue;
      x.push_back({steps, bytes});
      y.push_back(t);
    }
    std::vector<double> c = fit(x, y);
    if (c.size() != 2 || c[1] <= 0) continue;  // keep the class's figure
    out.latency[std::size_t(op)] = std::max(0.0, c[0]);
    out.bandwidth[std::size_t(op)] = 1 / c[1];
  }
  return out;
}

// How much of an all-reduce started before a gemm runs behind it: (t_gemm + t_reduce -
// t_both) / min(t_gemm, t_reduce), between 0 and 1, the two sized to take about as long.
double overlap_share(Comm& comm) {
  if (comm.size() < 2) return -1;
  std::size_t count = std::size_t(1) << 16;
  Kokkos::View<float*> a("calibrate::overlap", std::size_t(1) << 22);
  double t_reduce = 0;
  for (;;) {  // a reduction of about 20 ms (or 16 MiB)
    t_reduce = timed(comm, 0.05, [&] { comm.all_reduce_sum(a.data(), count).wait(); });
    if (t_reduce > 0.02 || count >= a.extent(0)) break;
    count = std::min(a.extent(0), count * 4);
  }
  int n = 64;
  Kokkos::View<float*> x("calibrate::x", 2048 * 2048), y("calibrate::y", 2048 * 2048),
      z("calibrate::z", 2048 * 2048);
  auto gemm = [&] { kernels::gemm<float>(false, false, n, n, n, 1, x, y, 0, z); };
  double t_gemm = 0;
  for (;;) {  // a gemm of about as long
    t_gemm = timed(comm, 0.05, gemm);
    if (t_gemm > t_reduce || n >= 2048) break;
    n = std::min(2048, n * 2);
  }
  const double t_both = timed(comm, 0.1, [&] {
    Request r = comm.all_reduce_sum(a.data(), count);
    gemm();
    r.wait();
  });
  const double share = (t_gemm + t_reduce - t_both) / std::min(t_gemm, t_reduce);
  return std::clamp(share, 0.0, 1.0);
}

// ---- shared cores ----------------------------------------------------------------------------

// A node running more rank threads than it has CPUs: how much faster a rank alone computes
// than with every rank of the node computing (`scale`), how many ranks' worth of compute the
// node has (`cores`: ranks over scale), and the share of a core a rank waiting in MPI still
// takes (`wait_load`). A gemm's time with all n ranks computing, with one (the others waiting
// in a barrier), and with floor(cores) of them: sharing, that one takes
// t_one * max(1, (k + wait_load * (n - k)) / cores) with k computing.
struct SharedCores {
  double scale = 1, cores = 0, wait_load = 0;
};

SharedCores shared_cores(Comm& node) {
  const int n = node.size(), me = node.rank();
  const int dim = 192;
  Kokkos::View<float*> a("calibrate::wa", dim * dim), b("calibrate::wb", dim * dim),
      c("calibrate::wc", dim * dim);
  Kokkos::deep_copy(a, 0.5f);
  Kokkos::deep_copy(b, 0.25f);
  auto gemm = [&] {
    kernels::gemm<float>(false, false, dim, dim, dim, 1, a, b, 0, c);
    Kokkos::fence();
  };
  const double all = timed(node, 0.2, gemm);
  const int calls = int(std::clamp(0.2 / std::max(all, 1e-9), 1.0, 10000.0));
  auto with = [&](int k) {  // seconds a call with ranks 0..k-1 computing, the others waiting
    line_up(node);
    const double t0 = wall_seconds();
    if (me < k)
      for (int i = 0; i < calls; ++i) gemm();
    double mine = me < k ? (wall_seconds() - t0) / calls : 0;
    line_up(node);  // the others wait here, in MPI
    node.all_reduce_sum_now(&mine, 1);
    return mine / k;
  };
  SharedCores out;
  const double one = with(1);
  out.scale = std::max(1.0, all / one);
  out.cores = std::clamp(double(n) / out.scale, 1.0, double(n));
  const int k = int(out.cores);
  if (k > 1 && k < n) {
    const double slowed = with(k) / one;
    out.wait_load = std::clamp((slowed * out.cores - k) / double(n - k), 0.0, 1.0);
  }
  return out;
}

// ---- the deck itself -------------------------------------------------------------------------

// This rank's mean compute per step (forward, backward, optimizer; time blocked in
// communication excluded) over `steps` real steps after a first, uncounted one.
template <class P>
std::array<double, 3> deck_phases(const Config& config, const Grid& grid, int steps) {
  Trainer<P> trainer(config, grid);
  for (int c = 0; c < trainer.chunks(); ++c)
    trainer.data_parallel(c).init_weights(std::uint64_t(config.run.seed));
  std::array<double, 3> sum{};
  for (int s = 1; s <= steps + 1; ++s) {
    const StepResult r = trainer.step(s);
    if (s == 1) continue;
    sum[0] += r.compute_forward, sum[1] += r.compute_backward, sum[2] += r.compute_optimizer;
  }
  for (double& x : sum) x /= steps;
  return sum;
}

std::array<double, 3> measured_phases(const Config& config, const Grid& grid, int steps) {
  const PrecisionPolicy policy = deck::precision_policy(config);
  if (policy.compute == Precision::fp64) return deck_phases<Fp64>(config, grid, steps);
  if (policy.compute == Precision::fp32) return deck_phases<Fp32>(config, grid, steps);
  if (policy.grad == Precision::bf16) return deck_phases<Bf16Grads>(config, grid, steps);
  return deck_phases<Bf16>(config, grid, steps);
}

// Progress lines on rank 0: "calibrate: <what> (<seconds since the start> s)".
class Progress {
 public:
  void operator()(const std::string& s) const {
    log::info(cat("calibrate: ", s, " (", fixed("%.0f", wall_seconds() - t0_), " s)"));
  }

 private:
  double t0_ = wall_seconds();
};

// The gemm fits of every compute type (the compute type's shape), attention, the row kernels
// and the optimizer, every rank computing at once.
void measure_compute(Comm& world, const Config& config, Config::machine_group& mc,
                     const Progress& said) {
  const auto shapes = deck_gemm_shapes(config);
  const GemmFit f32 = fit_gemm<float>(world, shapes);
  said(cat("sgemm at ", f32.shapes, " of the deck's shapes: ", fixed("%.1f", f32.peak / 1e9),
           " GFLOP/s large, half that at a smallest dimension of ", fixed("%.0f", f32.half_dim),
           ", ", fixed("%.1f", f32.overhead * 1e6), " us a call; median fit error ",
           fixed("%.1f%%", 100 * f32.error)));
  const GemmFit b16 = fit_gemm<bf16>(world, shapes);
  said(cat("bf16 gemm: ", fixed("%.1f", b16.peak / 1e9), " GFLOP/s large (fit error ",
           fixed("%.1f%%", 100 * b16.error), ")"));
  const GemmFit f64 = fit_gemm<double>(world, shapes);
  said(cat("dgemm: ", fixed("%.1f", f64.peak / 1e9), " GFLOP/s large (fit error ",
           fixed("%.1f%%", 100 * f64.error), ")"));
  const PrecisionPolicy policy = deck::precision_policy(config);
  const GemmFit& own = policy.compute == Precision::bf16   ? b16
                       : policy.compute == Precision::fp64 ? f64
                                                           : f32;
  mc.gemm_gflops_fp32 = f32.peak / 1e9;
  mc.gemm_gflops_bf16 = b16.peak / 1e9;
  mc.gemm_gflops_fp64 = f64.peak / 1e9;
  mc.gemm_half_dim = std::max(own.half_dim, 1e-3);
  mc.gemm_overhead_us = std::max(own.overhead * 1e6, 1e-3);

  std::pair<double, double> att;
  double elem = 0, opt = 0;
  if (policy.compute == Precision::bf16) {
    att = attention_rates<bf16>(world, config);
    elem = elementwise_rate<bf16>(world, config);
    opt = policy.grad == Precision::bf16 ? optimizer_rate<float, bf16>(world, config)
                                         : optimizer_rate<float, float>(world, config);
  } else if (policy.compute == Precision::fp64) {
    att = attention_rates<double>(world, config);
    elem = elementwise_rate<double>(world, config);
    opt = optimizer_rate<double, double>(world, config);
  } else {
    att = attention_rates<float>(world, config);
    elem = elementwise_rate<float>(world, config);
    opt = optimizer_rate<float, float>(world, config);
  }
  mc.attention_gflops = att.first / 1e9, mc.attention_backward_gflops = att.second / 1e9;
  mc.elementwise_gbs = elem / 1e9, mc.optimizer_gbs = opt / 1e9;
  said(cat("attention ", fixed("%.2f", mc.attention_gflops), " GFLOP/s forward, ",
           fixed("%.2f", mc.attention_backward_gflops), " backward; row kernels ",
           fixed("%.2f", mc.elementwise_gbs), " GB/s; optimizer ", fixed("%.2f", mc.optimizer_gbs),
           " GB/s"));
}

// Every rate so far was measured with all ranks computing at once. Where a node runs more
// rank threads than it has CPUs they shared them: the rates become a rank's alone, and the
// cost model shares the cores among the ranks busy at a time (cores_per_node, wait_load).
void measure_shared_cores(Comm& world, Comm& node, int threads, Config::machine_group& mc,
                          const Progress& said) {
  const int cpus = int(std::max(1u, std::thread::hardware_concurrency()));
  const int demand = node.size() * std::max(1, threads);
  double oversubscribed = demand > cpus ? 1 : 0;
  world.all_reduce_max(&oversubscribed, 1, Space::host).wait();
  if (oversubscribed == 0) return;
  const SharedCores mine = shared_cores(node);
  std::array<double, 3> figures = {mine.scale, mine.cores, mine.wait_load};
  from_rank0(world, figures.data(), 3);  // node 0's rank 0 speaks for every node
  const SharedCores shared{figures[0], figures[1], figures[2]};
  mc.cores_per_node = shared.cores;
  mc.wait_load = shared.wait_load;
  for (double* rate :
       {&mc.gemm_gflops_fp32, &mc.gemm_gflops_bf16, &mc.gemm_gflops_fp64, &mc.attention_gflops,
        &mc.attention_backward_gflops, &mc.elementwise_gbs, &mc.optimizer_gbs})
    *rate *= shared.scale;
  mc.gemm_overhead_us = std::max(mc.gemm_overhead_us / shared.scale, 1e-3);
  said(cat("a node runs ", demand, " rank thread(s) on ", cpus, " CPU(s): a rank alone computes ",
           fixed("%.2f", shared.scale),
           " times faster than with all computing (the rates are a rank's alone); "
           "cores_per_node = ",
           fixed("%.2f", mc.cores_per_node), "; a rank waiting in MPI takes ",
           fixed("%.0f%%", 100 * mc.wait_load), " of a core"));
}

// What the links were measured on, for the machine's name.
struct LinksMeasured {
  bool intra = false;
  int nodes = 1;
};

// The four collectives inside a node (its ranks) and across nodes (one rank of each node,
// every local index at once), and the overlap share; node 0's rank 0 speaks for every rank.
LinksMeasured measure_links(Comm& world, Comm& node, const Grid& grid, Config::machine_group& mc,
                            const Progress& said) {
  const CommFit intra = fit_comm(node);
  // The overlap inside a node when every node has two ranks or more, else across nodes: every
  // rank takes part in the same measurement.
  double least_node = -double(node.size());
  world.all_reduce_max(&least_node, 1, Space::host).wait();
  least_node = -least_node;
  double overlap = least_node >= 2 ? overlap_share(node) : -1;
  const SplitComm across_nodes =
      split_comm(grid.cart(), node.rank(), grid.node(), "calibrate-across");
  Comm* const across = across_nodes.comm.get();
  double nodes = across->size();
  world.all_reduce_max(&nodes, 1, Space::host).wait();
  const CommFit inter = fit_comm(*across);
  if (least_node < 2 && nodes > 1) overlap = overlap_share(*across);
  std::array<double, 17> figures{};
  for (std::size_t i = 0; i < 4; ++i) {
    figures[i] = intra.latency[i], figures[4 + i] = intra.bandwidth[i];
    figures[8 + i] = inter.latency[i], figures[12 + i] = inter.bandwidth[i];
  }
  figures[16] = overlap;
  from_rank0(world, figures.data(), int(figures.size()));
  overlap = figures[16];
  if (overlap >= 0) mc.comm_overlap = std::max(overlap, 1e-3);
  double intra_measured = intra.measured ? 1 : 0;
  world.all_reduce_max(&intra_measured, 1, Space::host).wait();
  for (std::size_t i = 0; i < 4; ++i) {
    mc.comm_intra_latency_us[i] = figures[i] * 1e6, mc.comm_intra_gbs[i] = figures[4 + i] / 1e9;
    mc.comm_inter_latency_us[i] = figures[8 + i] * 1e6,
    mc.comm_inter_gbs[i] = figures[12 + i] / 1e9;
  }
  said(cat("communication inside a node ",
           intra_measured > 0
               ? cat("(", node.size(), " ranks): all-reduce ", fixed("%.1f", figures[0] * 1e6),
                     " us a step, ", fixed("%.2f", figures[4] / 1e9), " GB/s; send/recv ",
                     fixed("%.1f", figures[3] * 1e6), " us, ", fixed("%.2f", figures[7] / 1e9),
                     " GB/s; ", fixed("%.0f%%", 100 * std::max(overlap, 0.0)),
                     " of a reduction hides behind a gemm")
               : std::string("not measured (one rank a node)"),
           "; across nodes ",
           nodes > 1 ? cat("(", nodes, " nodes): all-reduce ", fixed("%.1f", figures[8] * 1e6),
                           " us a step, ", fixed("%.2f", figures[12] / 1e9), " GB/s")
                     : std::string("not measured (one node)")));
  return {intra_measured > 0, int(nodes)};
}

// The deck's own steps against the model at the measured rates: the forward, backward and
// optimizer factors (sums over every rank).
void measure_factors(Comm& world, const Config& config, const Grid& grid, Config::machine_group& mc,
                     const Progress& said) {
  Config model_config = config;
  model_config.machine = mc;
  model_config.machine.forward_factor = model_config.machine.backward_factor =
      model_config.machine.optimizer_factor = 1;
  const Machine m = machine_of(model_config);
  const int steps = 3;
  const std::array<double, 3> measured = measured_phases(config, grid, steps);
  const int p = grid.coord(Axis::p);
  const double mb = double(micro_batches_per_step(config));
  // This rank's stage as the model runs it, slowed as the model slows it on shared cores.
  const StepPrediction predicted = predict_step(model_config, grid.layout(), m);
  const double share = predicted.share.at(std::size_t(p));
  double sums[6] = {measured[0], measured[1], measured[2], 0, 0, 0};
  for (int c = 0; c < int(config.parallel.virtual_stages); ++c) {
    const ChunkCompute k = chunk_compute(model_config, m, p, c);
    sums[3] += share * mb * k.forward, sums[4] += share * mb * (k.backward + k.recompute);
  }
  sums[5] = predicted.all_busy * optimizer_seconds(model_config, m, p, grid.ranks_per_node());
  world.all_reduce_sum_now(sums, 6);
  mc.forward_factor = sums[3] > 0 ? sums[0] / sums[3] : 1;
  mc.backward_factor = sums[4] > 0 ? sums[1] / sums[4] : 1;
  mc.optimizer_factor = sums[5] > 0 ? sums[2] / sums[5] : 1;
  said(cat("the deck's ", steps, " steps: measured over modelled compute forward ",
           fixed("%.2f", mc.forward_factor), ", backward ", fixed("%.2f", mc.backward_factor),
           ", optimizer ", fixed("%.2f", mc.optimizer_factor)));
}

}  // namespace

Config calibrate(const Config& config, const Grid& grid, int threads) {
  auto world = make_comm(grid.cart(), "calibrate");
  auto node = make_comm(grid.node_comm(), "calibrate-node");
  const Progress said;
  Config out = config;
  auto& mc = out.machine;
  measure_compute(*world, config, mc, said);
  measure_shared_cores(*world, *node, threads, mc, said);
  const LinksMeasured links = measure_links(*world, *node, grid, mc, said);
  measure_factors(*world, config, grid, mc, said);
  const std::string unmeasured =
      cat(links.intra ? "" : "; inside a node not measured (node class figures)",
          links.nodes > 1 ? "" : "; across nodes not measured (node class figures)");
  mc.name = mpi::broadcast(
      grid.cart(), 0,
      cat("calibrated ", utc_now("%Y-%m-%d"), " on ", mpi::host_name(), ", ", grid.world_size(),
          " rank(s), ", grid.ranks_per_node(), " a node, deck ", config.deck_path, unmeasured));
  // Rates not measured keep 0 (the node class's figure).
  return out;
}

}  // namespace ptrain::parallel
