// ptrain-test: np=1 labels=quick timeout=120
// Optim module: AdamW / SGD against a scalar reference from the published formulas and
// against torch.optim.AdamW (when /usr/bin/python3 has torch), shard independence,
// checkpoint-style resume, the LR schedule, segments, clipping.
#include <gtest/gtest.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "data/rng.hpp"
#include "optim/optim.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"

using namespace ptrain;
using namespace ptrain::optim;

namespace {

constexpr std::size_t kN = 1000;
constexpr int kSteps = 6;

// Decay mask over the flat buffer: matrices (decay) and biases/norms (no decay).
std::vector<Segment> mask() {
  return {{0, 300, true},    {300, 310, false}, {310, 700, true},
          {700, 720, false}, {720, 723, false}, {723, 1000, true}};
}

bool decayed(std::size_t i) {
  for (const Segment& s : mask())
    if (i >= s.begin && i < s.end) return s.decay;
  return false;
}

Hyper hyper() {
  Hyper h;
  h.beta1 = 0.9;
  h.beta2 = 0.95;
  h.eps = 1e-8;
  h.weight_decay = 0.1;
  return h;
}

LrSchedule schedule() {
  LrSchedule s;
  s.lr = 1e-2;
  s.min_lr = 1e-3;
  s.warmup = 2;
  s.steps = kSteps;
  return s;
}

// Initial parameters and the gradient of each step: pure functions of the index. Some
// gradients are tiny so that eps matters, some are zero.
double param0(std::size_t i) { return 0.5 * rng::normal(7, 1, i); }
double grad(int step, std::size_t i) {
  const double scale = i % 17 == 0 ? 1e-7 : (i % 13 == 0 ? 0.0 : 1.0);
  return scale * rng::normal(7, 2, std::uint64_t(step), i);
}

// The published AdamW (Loshchilov & Hutter; PyTorch docs), one element at a time, in double.
std::vector<double> reference_adamw(int steps) {
  const Hyper h = hyper();
  const LrSchedule s = schedule();
  std::vector<double> p(kN), m(kN, 0.0), v(kN, 0.0);
  for (std::size_t i = 0; i < kN; ++i) p[i] = param0(i);
  for (int t = 1; t <= steps; ++t) {
    const double lr = s.at(t);
    for (std::size_t i = 0; i < kN; ++i) {
      const double g = grad(t, i);
      if (decayed(i)) p[i] -= lr * h.weight_decay * p[i];
      m[i] = h.beta1 * m[i] + (1 - h.beta1) * g;
      v[i] = h.beta2 * v[i] + (1 - h.beta2) * g * g;
      const double mhat = m[i] / (1 - std::pow(h.beta1, t));
      const double vhat = v[i] / (1 - std::pow(h.beta2, t));
      p[i] -= lr * mhat / (std::sqrt(vhat) + h.eps);
    }
  }
  return p;
}

std::vector<double> reference_sgd(int steps) {
  const Hyper h = hyper();
  const LrSchedule s = schedule();
  std::vector<double> p(kN);
  for (std::size_t i = 0; i < kN; ++i) p[i] = param0(i);
  for (int t = 1; t <= steps; ++t) {
    const double lr = s.at(t);
    for (std::size_t i = 0; i < kN; ++i) {
      if (decayed(i)) p[i] -= lr * h.weight_decay * p[i];
      p[i] -= lr * grad(t, i);
    }
  }
  return p;
}

template <class T>
Kokkos::View<T*> filled(const char* label, int step) {  // step 0: params, else grads
  Kokkos::View<T*> v(std::string(label), kN);
  auto h = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < kN; ++i) h(i) = T(step == 0 ? param0(i) : grad(step, i));
  Kokkos::deep_copy(v, h);
  return v;
}

template <class T>
std::vector<T> to_vector(const Kokkos::View<T*>& v) {
  auto h = Kokkos::create_mirror_view(v);
  Kokkos::deep_copy(h, v);
  return std::vector<T>(h.data(), h.data() + h.extent(0));
}

// Runs `steps` updates of the whole buffer cut into shards [cuts[k], cuts[k+1]).
template <class T>
std::vector<T> run_sharded(const std::string& name, const std::vector<std::size_t>& cuts,
                           int steps) {
  auto p = filled<T>("p", 0);
  std::vector<std::unique_ptr<Optimizer<T>>> opts;
  for (std::size_t k = 0; k + 1 < cuts.size(); ++k)
    opts.push_back(make_optimizer<T>(name, mask(), cuts[k], cuts[k + 1], hyper()));
  for (int t = 1; t <= steps; ++t) {
    auto g = filled<T>("g", t);
    for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
      const auto range = std::make_pair(cuts[k], cuts[k + 1]);
      opts[k]->step(Kokkos::subview(p, range), Kokkos::subview(g, range), schedule().at(t), 1.0);
    }
  }
  return to_vector(p);
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i)
    d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

}  // namespace

// ---------------------------------------------------------------- update rules

TEST(Optim, AdamWMatchesThePublishedFormulaInDouble) {
  for (int steps : {1, kSteps}) {
    const auto got = run_sharded<double>("adamw", {0, kN}, steps);
    const auto want = reference_adamw(steps);
    EXPECT_LT(max_abs_diff(got, want), 1e-12) << steps << " steps";
  }
  // Decay matters: the same run without weight decay differs on decayed elements only.
  auto p = filled<double>("p", 0);
  Hyper no_wd = hyper();
  no_wd.weight_decay = 0;
  AdamW<double> opt(mask(), 0, kN, no_wd);
  opt.step(p, filled<double>("g", 1), schedule().at(1), 1.0);
  const auto a = to_vector(p), b = run_sharded<double>("adamw", {0, kN}, 1);
  for (std::size_t i = 0; i < kN; ++i) {
    if (!decayed(i)) {
      EXPECT_EQ(a[i], b[i]) << i;
    } else if (param0(i) != 0) {
      EXPECT_NE(a[i], b[i]) << i;
    }
  }
}

TEST(Optim, AdamWInFloatTracksTheDoubleReference) {
  const auto got = run_sharded<float>("adamw", {0, kN}, kSteps);
  const auto want = reference_adamw(kSteps);
  double worst = 0;
  for (std::size_t i = 0; i < kN; ++i) worst = std::max(worst, std::fabs(double(got[i]) - want[i]));
  EXPECT_LT(worst, 2e-6);
}

TEST(Optim, SGDMatchesThePublishedFormula) {
  const auto got = run_sharded<double>("sgd", {0, kN}, kSteps);
  EXPECT_LT(max_abs_diff(got, reference_sgd(kSteps)), 1e-14);
  const auto f = run_sharded<float>("sgd", {0, kN}, kSteps);
  const auto want = reference_sgd(kSteps);
  for (std::size_t i = 0; i < kN; ++i) EXPECT_NEAR(double(f[i]), want[i], 1e-6) << i;
}

TEST(Optim, ShardsGiveBitIdenticalUpdates) {
  const std::vector<std::size_t> whole = {0, kN}, cuts = {0, 137, 305, 705, kN};
  for (const char* name : {"adamw", "sgd"}) {
    const auto d1 = run_sharded<double>(name, whole, kSteps);
    const auto d3 = run_sharded<double>(name, cuts, kSteps);
    EXPECT_EQ(std::memcmp(d1.data(), d3.data(), kN * sizeof(double)), 0) << name;
    const auto f1 = run_sharded<float>(name, whole, kSteps);
    const auto f3 = run_sharded<float>(name, cuts, kSteps);
    EXPECT_EQ(std::memcmp(f1.data(), f3.data(), kN * sizeof(float)), 0) << name;
  }
}

TEST(Optim, ResumingFromSavedStateIsBitIdentical) {
  // 6 straight steps vs 3 steps, state copied out and into a fresh optimizer, 3 more.
  const auto straight = run_sharded<double>("adamw", {0, kN}, kSteps);
  auto p = filled<double>("p", 0);
  AdamW<double> first(mask(), 0, kN, hyper());
  for (int t = 1; t <= 3; ++t) first.step(p, filled<double>("g", t), schedule().at(t), 1.0);
  AdamW<double> second(mask(), 0, kN, hyper());
  const auto saved = first.state(), fresh = second.state();
  ASSERT_EQ(saved.size(), 2u);
  EXPECT_EQ(saved[0].first, "m");
  EXPECT_EQ(saved[1].first, "v");
  for (std::size_t k = 0; k < saved.size(); ++k) {
    ASSERT_EQ(saved[k].second.extent(0), kN);
    Kokkos::deep_copy(fresh[k].second, saved[k].second);
  }
  EXPECT_EQ(first.t(), 3);
  second.set_t(first.t());
  for (int t = 4; t <= kSteps; ++t) second.step(p, filled<double>("g", t), schedule().at(t), 1.0);
  const auto resumed = to_vector(p);
  EXPECT_EQ(std::memcmp(resumed.data(), straight.data(), kN * sizeof(double)), 0);
}

TEST(Optim, AdamWMatchesTorch) {
  // Write the problem, let torch.optim.AdamW solve it, compare to 1e-12 in fp64.
  const std::string dir = cat("/tmp/ptrain_test_optim_", ::getpid());
  const std::string in = dir + ".in", out = dir + ".out", script = dir + ".py";
  {
    std::ofstream f(in);
    f.precision(17);
    f << kN << " " << kSteps << " " << mask().size() << "\n";
    for (const Segment& s : mask()) f << s.begin << " " << s.end << " " << int(s.decay) << "\n";
    for (int t = 1; t <= kSteps; ++t) f << schedule().at(t) << "\n";
    for (std::size_t i = 0; i < kN; ++i) f << param0(i) << "\n";
    for (int t = 1; t <= kSteps; ++t)
      for (std::size_t i = 0; i < kN; ++i) f << grad(t, i) << "\n";
  }
  {
    std::ofstream f(script);
    f << R"PY(import sys
try:
    import torch
except Exception:
    sys.exit(77)
vals = open(sys.argv[1]).read().split()
pos = 0
def take(k):
    global pos
    pos += k
    return vals[pos - k:pos]
n, steps, nseg = map(int, take(3))
segs = [tuple(map(int, take(3))) for _ in range(nseg)]
lrs = [float(x) for x in take(steps)]
p0 = torch.tensor([float(x) for x in take(n)], dtype=torch.float64)
grads = torch.tensor([float(x) for x in take(n * steps)], dtype=torch.float64).reshape(steps, n)
out = []
for kind in ("adamw", "sgd"):
    params = [p0[b:e].clone().requires_grad_(True) for b, e, d in segs]
    decay = [p for p, (b, e, d) in zip(params, segs) if d]
    keep = [p for p, (b, e, d) in zip(params, segs) if not d]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": keep, "weight_decay": 0.0}]
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=lrs[0], betas=(0.9, 0.95), eps=1e-8)
    else:  # decoupled decay by hand: torch's SGD weight_decay is an L2 term
        opt = torch.optim.SGD([{"params": params}], lr=lrs[0])
    for t in range(steps):
        for g in opt.param_groups:
            g["lr"] = lrs[t]
        for p, (b, e, d) in zip(params, segs):
            p.grad = grads[t, b:e].clone()
            if kind == "sgd" and d:
                with torch.no_grad():
                    p.mul_(1 - lrs[t] * 0.1)
        opt.step()
    out += [repr(float(x)) for x in torch.cat([p.detach() for p in params])]
open(sys.argv[2], "w").write("\n".join(out) + "\n")
)PY";
  }
  const int rc = std::system(cat("/usr/bin/python3 ", script, " ", in, " ", out, " 2>&1").c_str());
  std::vector<double> torch_result;
  {
    std::ifstream f(out);
    double x;
    while (f >> x) torch_result.push_back(x);
  }
  std::remove(in.c_str());
  std::remove(out.c_str());
  std::remove(script.c_str());
  if (!WIFEXITED(rc) || WEXITSTATUS(rc) == 77 || WEXITSTATUS(rc) == 127)
    GTEST_SKIP() << "/usr/bin/python3 with torch is not available";
  ASSERT_EQ(WEXITSTATUS(rc), 0) << "the torch script failed";
  ASSERT_EQ(torch_result.size(), 2 * kN);
  const std::vector<double> torch_adamw(torch_result.begin(), torch_result.begin() + kN);
  const std::vector<double> torch_sgd(torch_result.begin() + kN, torch_result.end());
  EXPECT_LT(max_abs_diff(run_sharded<double>("adamw", {0, kN}, kSteps), torch_adamw), 1e-12);
  EXPECT_LT(max_abs_diff(run_sharded<double>("sgd", {0, kN}, kSteps), torch_sgd), 1e-12);
  // The oracle itself agrees with the scalar reference (it is the same algorithm).
  EXPECT_LT(max_abs_diff(reference_adamw(kSteps), torch_adamw), 1e-12);
}

TEST(Optim, StateIsChargedToTheOptimizerCategory) {
  const auto before = memory::stats().current[int(MemCategory::optimizer)];
  {
    AdamW<float> adam(mask(), 100, 600, hyper());
    EXPECT_EQ(adam.size(), 500u);
    EXPECT_GE(memory::stats().current[int(MemCategory::optimizer)],
              before + 2 * 500 * sizeof(float));
    SGD<double> sgd(mask(), 0, kN, hyper());
    EXPECT_TRUE(sgd.state().empty());
  }
  EXPECT_EQ(memory::stats().current[int(MemCategory::optimizer)], before);
  EXPECT_THROW(make_optimizer<double>("lion", mask(), 0, kN, hyper()), Error);
  AdamW<double> opt(mask(), 0, 10, hyper());
  Kokkos::View<double*> wrong("wrong", 11);
  EXPECT_THROW(opt.step(wrong, wrong, 1e-3, 1.0), Error);
}

// Clipping inside the update (grad_scale) gives bit for bit what scaling the gradients
// first and stepping with grad_scale 1 gave, and leaves the gradients as they were.
template <class T>
void check_grad_scale(const std::string& name) {
  const double factor = clip_factor(3.7, 1.0);
  auto folded = make_optimizer<T>(name, mask(), 0, kN, hyper());
  auto scaled = make_optimizer<T>(name, mask(), 0, kN, hyper());
  auto p_folded = filled<T>("p", 0), p_scaled = filled<T>("p", 0);
  for (int t = 1; t <= 3; ++t) {
    const auto g = filled<T>("g", t), g_scaled = filled<T>("g", t);
    const T f = T(factor);
    Kokkos::parallel_for(
        "scale", kN, KOKKOS_LAMBDA(std::size_t i) { g_scaled(i) *= f; });
    folded->step(p_folded, g, schedule().at(t), factor);
    scaled->step(p_scaled, g_scaled, schedule().at(t), 1.0);
    EXPECT_EQ(to_vector(g), to_vector(filled<T>("g", t))) << name << " step " << t;
  }
  EXPECT_EQ(to_vector(p_folded), to_vector(p_scaled)) << name;
  EXPECT_NE(to_vector(p_folded), to_vector(filled<T>("p", 0))) << name;
  Kokkos::View<T*> p("p", kN), g("g", kN);
  EXPECT_THROW(folded->step(p, g, 1e-3, std::numeric_limits<double>::quiet_NaN()), Error);
}

TEST(Optim, ClippingInsideTheUpdateEqualsScalingTheGradientsFirst) {
  check_grad_scale<float>("adamw");
  check_grad_scale<double>("adamw");
  check_grad_scale<float>("sgd");
  check_grad_scale<double>("sgd");
}

// ---------------------------------------------------------------- schedule, segments, clipping

TEST(Optim, LrScheduleAtKnownSteps) {
  LrSchedule s;
  s.lr = 1.0;
  s.min_lr = 0.1;
  s.warmup = 10;
  s.steps = 110;
  EXPECT_DOUBLE_EQ(s.at(1), 0.1);
  EXPECT_DOUBLE_EQ(s.at(5), 0.5);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(35), 0.1 + 0.45 * (1 + std::cos(M_PI / 4)), 1e-15);
  EXPECT_NEAR(s.at(60), 0.55, 1e-15);
  EXPECT_NEAR(s.at(110), 0.1, 1e-15);
  EXPECT_NEAR(s.at(500), 0.1, 1e-15);
  EXPECT_THROW(s.at(0), Error);
  s.decay = LrSchedule::constant;
  EXPECT_DOUBLE_EQ(s.at(5), 0.5);
  EXPECT_DOUBLE_EQ(s.at(60), 1.0);
  EXPECT_DOUBLE_EQ(s.at(500), 1.0);
  LrSchedule c;  // no warmup: the cosine starts at step 1
  c.lr = 2.0;
  c.min_lr = 0.0;
  c.warmup = 0;
  c.steps = 4;
  EXPECT_NEAR(c.at(1), 1.0 + std::cos(M_PI / 4), 1e-15);
  EXPECT_NEAR(c.at(2), 1.0, 1e-15);
  EXPECT_NEAR(c.at(4), 0.0, 1e-15);
  LrSchedule w;  // warmup longer than the run
  w.lr = 1.0;
  w.min_lr = 0.25;
  w.warmup = 10;
  w.steps = 5;
  EXPECT_DOUBLE_EQ(w.at(5), 0.5);
  EXPECT_DOUBLE_EQ(w.at(11), 0.25);
}

TEST(Optim, ShardSegmentsCutAndMerge) {
  const auto s = shard_segments(mask(), 250, 700);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].begin, 0u);
  EXPECT_EQ(s[0].end, 50u);
  EXPECT_TRUE(s[0].decay);
  EXPECT_EQ(s[1].begin, 50u);
  EXPECT_EQ(s[1].end, 60u);
  EXPECT_FALSE(s[1].decay);
  EXPECT_EQ(s[2].begin, 60u);
  EXPECT_EQ(s[2].end, 450u);
  EXPECT_TRUE(s[2].decay);
  const auto m = shard_segments(mask(), 705, 800);  // [700,720) and [720,723) merge
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0].end, 18u);
  EXPECT_FALSE(m[0].decay);
  EXPECT_EQ(m[1].end, 95u);
  EXPECT_TRUE(shard_segments(mask(), 400, 400).empty());
  EXPECT_THROW(shard_segments(mask(), 900, 1001), Error);                        // past the end
  EXPECT_THROW(shard_segments({{0, 10, true}, {12, 20, false}}, 0, 20), Error);  // a gap
  EXPECT_THROW(shard_segments({{10, 20, true}}, 0, 20), Error);                  // not covered
}

// The norm itself is kernels::sum_of_squares (tested in test_kernels.cpp).
TEST(Optim, ClipFactor) {
  EXPECT_EQ(clip_factor(5.0, 0.0), 1.0);
  EXPECT_EQ(clip_factor(5.0, -1.0), 1.0);
  EXPECT_EQ(clip_factor(0.5, 1.0), 1.0);
  EXPECT_EQ(clip_factor(1.0, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_factor(4.0, 1.0), 1.0 / (4.0 + 1e-6));
}

TEST(Optim, SettingsFromTheDeck) {
  Config c;
  c.train.lr = 6e-4;
  c.train.min_lr = 6e-5;
  c.train.warmup = 7;
  c.train.decay = "constant";
  c.run.steps = 50;
  c.train.beta1 = 0.8;
  c.train.beta2 = 0.99;
  c.train.eps = 1e-6;
  c.train.weight_decay = 0.05;
  const LrSchedule s = schedule_from_config(c);
  EXPECT_EQ(s.lr, 6e-4);
  EXPECT_EQ(s.min_lr, 6e-5);
  EXPECT_EQ(s.warmup, 7);
  EXPECT_EQ(s.steps, 50);
  EXPECT_EQ(s.decay, LrSchedule::constant);
  const Hyper h = hyper_from_config(c);
  EXPECT_EQ(h.beta1, 0.8);
  EXPECT_EQ(h.beta2, 0.99);
  EXPECT_EQ(h.eps, 1e-6);
  EXPECT_EQ(h.weight_decay, 0.05);
  c.train.decay = "linear";
  EXPECT_THROW(schedule_from_config(c), Error);
}
