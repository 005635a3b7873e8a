// ptrain-test: np=1 labels=quick timeout=120
// model/moe: the MoE layer on one rank. Its backward (router, gates, experts and the
// load-balancing loss) against central finite differences in fp64, with a capacity that
// drops tokens and dropless, the router's probabilities far from ties so that no small
// perturbation changes a choice; and a case worked by hand: the routing, the dropped
// tokens, the loads and the aux loss.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "model/activations.hpp"
#include "model/layers.hpp"
#include "test_support.hpp"

using namespace ptrain;
using namespace ptrain::model;
using namespace ptrain::test;

namespace {

using V = Kokkos::View<double*>;
using Args = std::map<std::string, HVec>;

constexpr int B = 2, S = 4, BT = B * S, C = 8, F = 12, E = 4, K = 2;
const TensorParallel kOneRank;

V nans(std::int64_t n) {
  V v("nans", std::size_t(n));
  Kokkos::deep_copy(v, std::numeric_limits<double>::quiet_NaN());
  return v;
}
V zeros(std::int64_t n) { return V("zeros", std::size_t(n)); }

template <template <class> class Acts>
Acts<V> allocate(const ActShape& s) {
  Acts<V> a;
  describe(a, s, [](V& field, std::int64_t n) { field = nans(n); });
  return a;
}

ActShape moe_shape(int bt, int e, int k) {
  ActShape s;
  s.BT = s.R = bt, s.C = s.Cl = C, s.Fl = F, s.moe = true, s.E = e, s.k = k, s.expert_rows = bt * k;
  return s;
}

struct Result {
  HVec y;
  double aux = 0;
  Args grad;
  Routing routing;
};

// y = moe(x); the backward of L = <y, R> + aux_scale * aux.
Result run(const Args& a, const HVec& R, int bt, int e, int k, double capacity, double aux_scale) {
  const Ctx c(kOneRank, 1, bt);
  MoE<Fp64> m;
  m.router = dev<double>(a.at("router")), m.drouter = zeros(e * C);
  m.fc_w = dev<double>(a.at("fc.w")), m.fc_b = dev<double>(a.at("fc.b"));
  m.proj_w = dev<double>(a.at("proj.w")), m.proj_b = dev<double>(a.at("proj.b"));
  m.dfc_w = zeros(e * F * C), m.dfc_b = zeros(e * F), m.dproj_w = zeros(e * C * F),
  m.dproj_b = zeros(e * C);
  m.C = C, m.Fl = F, m.E = e, m.El = e, m.k = k, m.capacity_factor = capacity, m.aux_coef = 0.5;
  m.aux_scale = aux_scale;
  const ActShape s = moe_shape(bt, e, k);
  const auto acts = allocate<MoeActs>(s);
  const auto g = allocate<MoeScratch>(s);
  Result r;
  V x = dev<double>(a.at("x")), y = nans(bt * C);
  m.forward(c, x, acts, r.routing, nans(bt * C), y);
  const V dx = m.backward(c, x, acts, r.routing, dev<double>(R), g, nans(bt * C), nans(bt * C),
                          nans(bt * C));
  r.y = host(y), r.aux = r.routing.aux;
  r.grad = {{"x", host(dx)},         {"router", host(m.drouter)}, {"fc.w", host(m.dfc_w)},
            {"fc.b", host(m.dfc_b)}, {"proj.w", host(m.dproj_w)}, {"proj.b", host(m.dproj_b)}};
  return r;
}

Args params(unsigned seed) {
  return {{"x", random_vec(BT * C, seed, -1, 1)},
          {"router", random_vec(E * C, seed + 1, -3, 3)},  // well-separated probabilities
          {"fc.w", random_vec(E * F * C, seed + 2, -0.5, 0.5)},
          {"fc.b", random_vec(E * F, seed + 3, -0.3, 0.3)},
          {"proj.w", random_vec(E * C * F, seed + 4, -0.5, 0.5)},
          {"proj.b", random_vec(E * C, seed + 5, -0.3, 0.3)}};
}

void expect_matches_fd(double capacity, bool expect_drops) {
  const Args a = params(40);
  const HVec R = random_vec(BT * C, 47);
  const double aux_scale = 0.7;
  const Result r = run(a, R, BT, E, K, capacity, aux_scale);
  EXPECT_EQ(r.routing.dropped > 0, expect_drops) << "dropped " << r.routing.dropped;
  for (const auto& [name, value] : a) {
    const HVec fd = fd_grad(value, [&, n = name](const HVec& v) {
      Args p = a;
      p[n] = v;
      const Result q = run(p, R, BT, E, K, capacity, aux_scale);
      EXPECT_EQ(q.routing.expert, r.routing.expert) << n << ": a perturbation changed the routing";
      return dot(q.y, R) + aux_scale * q.aux;
    });
    const double e = rel_err(r.grad.at(name), fd);
    EXPECT_LT(e, 1e-6) << name;
    std::printf("      %-8s rel err %.1e\n", name.c_str(), e);
  }
}

TEST(MoeFd, WithDroppedTokens) { expect_matches_fd(0.75, true); }
TEST(MoeFd, Dropless) { expect_matches_fd(0.0, false); }

// Four tokens, two experts, top 1, capacity ceil(1.0 * 1 * 4 / 2) = 2. Every token's router
// logits are (2, 0): all choose expert 0, p0 = 1/(1+e^-2). Tokens 0 and 1 are kept in token
// order, 2 and 3 dropped (their output is 0). f = (1, 0), P = (p0, 1-p0), so
// aux = coef * E * (f0 P0 + f1 P1) = 0.5 * 2 * p0.
TEST(MoeByHand, CapacityDropsInTokenOrderAndAux) {
  const int bt = 4, e = 2, k = 1;
  Args a = {{"x", HVec(bt * C, 0.0)},
            {"router", HVec(e * C, 0.0)},
            {"fc.w", random_vec(e * F * C, 3)},
            {"fc.b", random_vec(e * F, 4)},
            {"proj.w", random_vec(e * C * F, 5)},
            {"proj.b", random_vec(e * C, 6)}};
  for (int t = 0; t < bt; ++t) a["x"][std::size_t(t) * C] = 1.0 + 0.1 * t;  // x(t, 0)
  a["router"][0] = 2.0 / 1.0;  // expert 0's logit: 2 * x(t, 0)
  const Result r = run(a, HVec(bt * C, 1.0), bt, e, k, 1.0, 1.0);
  EXPECT_EQ(r.routing.expert, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(r.routing.row, (std::vector<int>{0, 1, -1, -1}));
  EXPECT_EQ(r.routing.dropped, 2);
  EXPECT_EQ(r.routing.load, (std::vector<std::int64_t>{2, 0}));
  double aux = 0;
  for (int t = 0; t < bt; ++t) aux += 1.0 / (1.0 + std::exp(-2.0 * (1.0 + 0.1 * t))) / bt;
  EXPECT_NEAR(r.aux, 0.5 * 2 * aux, 1e-15);
  for (int t = 2; t < bt; ++t)
    for (int j = 0; j < C; ++j) EXPECT_EQ(r.y[std::size_t(t) * C + std::size_t(j)], 0.0) << t;
  EXPECT_NE(r.y[0], 0.0);
}

}  // namespace
