// ptrain-test: np=1,2,4 labels=quick timeout=300
// model/layers: every layer's backward against central finite differences in fp64 (each rank
// alone, no tensor-parallel group), and the tensor-parallel layers on 2 and 4 ranks, with and
// without sequence parallelism, against the unsharded layer computed on one rank.
//
// A layer is run through a function (Ctx, named inputs and parameters, R) -> (output,
// gradients of L = <output, R> by the same names), so the finite-difference and the
// tensor-parallel tests share one way of calling each layer. Buffers the layer overwrites
// start as NaN ([=] outputs and scratch must not read them); gradients it accumulates into
// ([+=]) start at zero.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "model/activations.hpp"
#include "model/layers.hpp"
#include "test_support.hpp"

using namespace ptrain;
using namespace ptrain::model;
using namespace ptrain::test;

namespace {

using V = Kokkos::View<double*>;

constexpr double kFdTol = 1e-6;   // fp64 central differences, h = 1e-5
constexpr double kTpTol = 1e-12;  // sharded against whole: the same sums, regrouped

// Sizes, divisible by 4 ranks wherever tensor parallelism splits them: B*S tokens (rows
// under SP), C width (heads of HS), F the MLP's hidden width, Vp the padded vocabulary
// (Vreal real tokens).
constexpr int B = 2, S = 4, BT = B * S, C = 8, NH = 4, HS = C / NH, F = 16, Vp = 20, Vreal = 18;

const TensorParallel kOneRank;  // no group: every collective is the identity

// ---- host and device helpers ----------------------------------------------------------

V zeros(std::int64_t n) { return V("zeros", std::size_t(n)); }
V nans(std::int64_t n) {
  V v("nans", std::size_t(n));
  Kokkos::deep_copy(v, std::numeric_limits<double>::quiet_NaN());
  return v;
}
V on_dev(const HVec& h) { return dev<double>(h); }

// Every field of an activation or scratch description (model/activations.hpp) as its own
// NaN-filled view.
template <template <class> class Acts>
Acts<V> allocate(const ActShape& s) {
  Acts<V> a;
  describe(a, s, [](V& field, std::int64_t n, Role = Role::value) { field = nans(n); });
  return a;
}

ActShape shape_of(const Ctx& c) {
  const int n = c.tp->size();
  ActShape s;
  s.BT = c.BT, s.R = c.R, s.C = C, s.Cl = C / n, s.NHl = NH / n, s.Fl = F / n, s.Vl = Vp / n;
  s.sp = c.tp->sp();
  return s;
}

// Rows [r0, r0 + n) of a row-major matrix with `cols` columns.
HVec rows_of(const HVec& m, int cols, std::int64_t r0, std::int64_t n) {
  return HVec(m.begin() + r0 * cols, m.begin() + (r0 + n) * cols);
}
// Columns [c0, c0 + n) of a row-major matrix with `cols` columns.
HVec cols_of(const HVec& m, int cols, int c0, int n) {
  HVec out;
  for (std::size_t r = 0; r < m.size() / std::size_t(cols); ++r)
    out.insert(out.end(), m.begin() + std::int64_t(r) * cols + c0,
               m.begin() + std::int64_t(r) * cols + c0 + n);
  return out;
}
// m (rows, cols) as a rank holds it under SP before a gather: rows [r0, r0 + n), NaN elsewhere.
HVec only_rows(const HVec& m, int cols, std::int64_t r0, std::int64_t n) {
  HVec out(m.size(), std::numeric_limits<double>::quiet_NaN());
  std::copy(m.begin() + r0 * cols, m.begin() + (r0 + n) * cols, out.begin() + r0 * cols);
  return out;
}
double norm(const HVec& v) { return std::sqrt(dot(v, v)); }

// rel_err(got, want) < tol; printed (rank 0) so the margins can be read off the log.
void expect_close(const HVec& got, const HVec& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_GT(norm(want), 0) << what << ": all zero, nothing compared";
  const double e = rel_err(got, want);
  EXPECT_LT(e, tol) << what;
  std::printf("      %-12s rel err %.1e\n", what.c_str(), e);
}

// ---- the layers as functions of named host tensors -------------------------------------

using Args = std::map<std::string, HVec>;  // inputs and parameters by name, or their gradients
struct Outcome {
  HVec out;   // the layer's output
  Args grad;  // d<out, R>/d(each input and parameter)
};

LayerNorm<Fp64> layer_norm(const Args& a, const std::string& p) {
  LayerNorm<Fp64> l;
  l.w = on_dev(a.at(p + ".w")), l.b = on_dev(a.at(p + ".b"));
  l.dw = zeros(C), l.db = zeros(C), l.C = C;
  return l;
}
template <class Linear>
Linear linear(const Args& a, const std::string& p, int in, int out) {
  Linear l;
  l.w = on_dev(a.at(p + ".w")), l.dw = zeros(std::int64_t(out) * in);
  l.b = on_dev(a.at(p + ".b")), l.db = zeros(l.b.extent(0));
  l.in = in, l.out = out;
  return l;
}
template <class Layer>
void add_grads(Args& g, const std::string& p, const Layer& l) {
  g[p + ".w"] = host(l.dw), g[p + ".b"] = host(l.db);
}

// x (R, C) -> LN(x) (R, C).
Outcome run_layer_norm(const Ctx& c, const Args& a, const HVec& dout) {
  const auto ln = layer_norm(a, "ln");
  const V x = on_dev(a.at("x"));
  V out = nans(c.R * C), mean = nans(c.R), rstd = nans(c.R), dx = zeros(c.R * C);
  ln.forward(c, x, out, mean, rstd);
  ln.backward(c, x, mean, rstd, on_dev(dout), dx, nans(2 * C));
  Outcome o{host(out), {{"x", host(dx)}}};
  add_grads(o.grad, "ln", ln);
  return o;
}

// x (BT, in) holding this rank's rows -> y (BT, out_l); d(x) is this rank's rows (R, in).
Outcome run_column(const Ctx& c, int in, int out_l, const Args& a, const HVec& dy) {
  const auto lin = linear<ColumnParallelLinear<Fp64>>(a, "lin", in, out_l);
  V x = on_dev(a.at("x")), y = nans(c.BT * out_l);
  lin.forward(c, x, y);
  const V dx = lin.backward(c, x, on_dev(dy), nans(c.BT * in), nans(c.R * in));
  Outcome o{host(y), {{"x", host(dx)}}};
  add_grads(o.grad, "lin", lin);
  return o;
}

// x (BT, in_l) -> y (R, out), the tp sum; d(x) (BT, in_l).
Outcome run_row(const Ctx& c, int in_l, int out, const Args& a, const HVec& dy) {
  const auto lin = linear<RowParallelLinear<Fp64>>(a, "lin", in_l, out);
  const V x = on_dev(a.at("x")), y = nans(c.R * out), dx = nans(c.BT * in_l);
  lin.forward(c, x, nans(c.BT * out), y);
  lin.backward(c, x, on_dev(dy), nans(c.BT * out), dx);
  Outcome o{host(y), {{"x", host(dx)}}};
  add_grads(o.grad, "lin", lin);
  return o;
}

// qkv (BT, 3C) -> out (BT, C), all heads.
Outcome run_attention(const Ctx& c, const Args& a, const HVec& dout) {
  const Attention<Fp64> attn{NH, HS};
  const V qkv = on_dev(a.at("qkv")), out = nans(c.BT * C), lse = nans(c.BT * NH);
  const V dqkv = nans(c.BT * 3 * C);
  attn.forward(c, qkv, out, lse);
  attn.backward(c, qkv, out, lse, on_dev(dout), dqkv);
  return {host(out), {{"qkv", host(dqkv)}}};
}

MLP<Fp64> mlp_of(const Ctx& c, const Args& a, const std::string& p) {
  MLP<Fp64> m;
  m.fc = linear<ColumnParallelLinear<Fp64>>(a, p + ".fc", C, F / c.tp->size());
  m.proj = linear<RowParallelLinear<Fp64>>(a, p + ".proj", F / c.tp->size(), C);
  return m;
}

// x (BT, C) holding this rank's rows -> y (R, C); d(x) is this rank's rows (R, C).
Outcome run_mlp(const Ctx& c, const Args& a, const HVec& dy) {
  const MLP<Fp64> m = mlp_of(c, a, "mlp");
  const auto acts = allocate<MlpActs>(shape_of(c));
  V x = on_dev(a.at("x")), y = nans(c.R * C);
  m.forward(c, x, acts, nans(c.BT * C), y);
  const V dx = m.backward(c, x, acts, on_dev(dy), allocate<MlpScratch>(shape_of(c)), nans(c.BT * C),
                          nans(c.BT * C), nans(c.R * C));
  Outcome o{host(y), {{"x", host(dx)}}};
  add_grads(o.grad, "mlp.fc", m.fc);
  add_grads(o.grad, "mlp.proj", m.proj);
  return o;
}

// tokens (B, S) -> x (R, C) from this rank's vocabulary rows wte (Vl, C) and wpe (S, C).
Outcome run_embedding(const Ctx& c, const std::vector<int>& tokens, const Args& a, const HVec& dx) {
  Embedding<Fp64> e;
  e.wte = on_dev(a.at("wte")), e.wpe = on_dev(a.at("wpe"));
  e.dwte = zeros(e.wte.extent(0)), e.dwpe = zeros(e.wpe.extent(0));
  e.C = C, e.Vl = int(e.wte.extent(0)) / C, e.v_begin = c.tp->rank() * e.Vl;
  const auto tok = dev_ints(tokens);
  const V x = nans(c.R * C);
  e.forward(c, tok, nans(c.BT * C), x);
  e.backward(c, tok, on_dev(dx), nans(c.BT * C));
  return {host(x), {{"wte", host(e.dwte)}, {"wpe", host(e.dwpe)}}};
}

// x (R, C) -> {sum of the BT token losses}, with wte (Vl, C) this rank's vocabulary rows;
// the gradient is that of dloss * loss, dloss = R[0].
Outcome run_head(const Ctx& c, const std::vector<int>& targets, const Args& a, const HVec& R) {
  Head<Fp64> h;
  h.lnf = layer_norm(a, "lnf");
  h.lm.w = on_dev(a.at("wte")), h.lm.dw = zeros(h.lm.w.extent(0));
  h.lm.in = C, h.lm.out = int(h.lm.w.extent(0)) / C;
  h.v_real = Vreal;
  const auto acts = allocate<HeadActs>(shape_of(c));
  const auto tgt = dev_ints(targets);
  const V x = on_dev(a.at("x")), dx = nans(c.R * C);
  const double loss = h.forward(c, x, acts, tgt);
  h.backward(c, x, acts, tgt, R.at(0), dx, nans(c.BT * C), nans(c.R * C), nans(2 * C));
  Outcome o{{loss}, {{"x", host(dx)}, {"wte", host(h.lm.dw)}}};
  add_grads(o.grad, "lnf", h.lnf);
  return o;
}

// x (R, C) -> res3 (R, C) of one block with this rank's heads and MLP columns.
Outcome run_block(const Ctx& c, const Args& a, const HVec& dres3) {
  const int n = c.tp->size();
  Block<Fp64> blk;
  blk.ln1 = layer_norm(a, "ln1"), blk.ln2 = layer_norm(a, "ln2");
  blk.qkv = linear<ColumnParallelLinear<Fp64>>(a, "qkv", C, 3 * C / n);
  blk.attn = Attention<Fp64>{NH / n, HS};
  blk.proj = linear<RowParallelLinear<Fp64>>(a, "proj", C / n, C);
  blk.mlp = mlp_of(c, a, "mlp");
  const auto acts = allocate<BlockActs>(shape_of(c));
  auto g = allocate<Scratch>(shape_of(c));
  g.dres = nans(c.R * C);  // Block::Grads: dres cut to (R, C)
  const V x = on_dev(a.at("x"));
  blk.forward(c, x, acts, nans(c.BT * C));
  Kokkos::deep_copy(g.dres, on_dev(dres3));
  blk.backward(c, x, acts, g);
  Outcome o{host(acts.res3), {{"x", host(g.dres)}}};
  add_grads(o.grad, "ln1", blk.ln1), add_grads(o.grad, "ln2", blk.ln2);
  add_grads(o.grad, "qkv", blk.qkv), add_grads(o.grad, "proj", blk.proj);
  add_grads(o.grad, "mlp.fc", blk.mlp.fc), add_grads(o.grad, "mlp.proj", blk.mlp.proj);
  return o;
}

// The whole parameters of a block (full widths), named as run_block reads them.
Args block_params(unsigned seed) {
  Args a;
  auto add = [&](const std::string& name, std::size_t n, double scale) {
    a[name] = random_vec(n, seed++, -scale, scale);
  };
  for (const auto& p : {"ln1", "ln2"}) {
    a[std::string(p) + ".w"] = random_vec(C, seed++, 0.5, 1.5);
    add(std::string(p) + ".b", C, 0.5);
  }
  add("qkv.w", 3 * C * C, 0.7), add("qkv.b", 3 * C, 0.3);
  add("proj.w", C * C, 0.5), add("proj.b", C, 0.3);
  add("mlp.fc.w", F * C, 0.5), add("mlp.fc.b", F, 0.3);
  add("mlp.proj.w", C * F, 0.4), add("mlp.proj.b", C, 0.3);
  return a;
}

// ---- finite differences --------------------------------------------------------------------

using Layer = std::function<Outcome(const Args&, const HVec& R)>;

// Every gradient of L = <layer(args).out, R>, R random of n_out, against central differences.
void expect_backward_matches_fd(const Layer& layer, const Args& args, std::size_t n_out,
                                unsigned seed) {
  const HVec R = random_vec(n_out, seed);
  const Outcome o = layer(args, R);
  ASSERT_EQ(o.out.size(), n_out);
  for (const auto& [name, value] : args) {
    ASSERT_TRUE(o.grad.count(name)) << name << ": no gradient";
    const HVec fd = fd_grad(value, [&, n = name](const HVec& v) {
      Args perturbed = args;
      perturbed[n] = v;
      return dot(layer(perturbed, R).out, R);
    });
    expect_close(o.grad.at(name), fd, kFdTol, name);
  }
}

const Ctx kCtx(kOneRank, B, S);

TEST(LayersFd, LayerNorm) {
  const Args args = {{"x", random_vec(BT * C, 1, -2, 3)},  // x: (BT, C)
                     {"ln.w", random_vec(C, 2)},
                     {"ln.b", random_vec(C, 3)}};
  expect_backward_matches_fd(
      [](const Args& a, const HVec& R) { return run_layer_norm(kCtx, a, R); }, args, BT * C, 4);
}

TEST(LayersFd, ColumnParallelLinear) {
  const int in = 6, out = 5;
  const Args args = {{"x", random_vec(BT * in, 5)},  // x: (BT, in)
                     {"lin.w", random_vec(out * in, 6)},
                     {"lin.b", random_vec(out, 7)}};
  expect_backward_matches_fd(
      [&](const Args& a, const HVec& R) { return run_column(kCtx, in, out, a, R); }, args, BT * out,
      8);
}

TEST(LayersFd, RowParallelLinear) {
  const int in = 6, out = 5;
  const Args args = {{"x", random_vec(BT * in, 9)},  // x: (BT, in)
                     {"lin.w", random_vec(out * in, 10)},
                     {"lin.b", random_vec(out, 11)}};
  expect_backward_matches_fd(
      [&](const Args& a, const HVec& R) { return run_row(kCtx, in, out, a, R); }, args, BT * out,
      12);
}

TEST(LayersFd, Attention) {
  const Args args = {{"qkv", random_vec(BT * 3 * C, 13, -1.5, 1.5)}};  // qkv: (BT, 3C)
  expect_backward_matches_fd([](const Args& a, const HVec& R) { return run_attention(kCtx, a, R); },
                             args, BT * C, 14);
}

TEST(LayersFd, Mlp) {
  const Args args = {{"x", random_vec(BT * C, 15)},  // x: (BT, C)
                     {"mlp.fc.w", random_vec(F * C, 16)},
                     {"mlp.fc.b", random_vec(F, 17)},
                     {"mlp.proj.w", random_vec(C * F, 18)},
                     {"mlp.proj.b", random_vec(C, 19)}};
  expect_backward_matches_fd([](const Args& a, const HVec& R) { return run_mlp(kCtx, a, R); }, args,
                             BT * C, 20);
}

// Tokens cover every quarter of the vocabulary (the tp=4 shards), one twice; positions all.
const std::vector<int> kTokens = {0, 7, 12, 17, 7, 9, 14, 1};    // (B, S)
const std::vector<int> kTargets = {3, 17, 0, 9, 12, 5, 17, 10};  // (B, S)

TEST(LayersFd, Embedding) {
  const Args args = {{"wte", random_vec(Vp * C, 21)}, {"wpe", random_vec(S * C, 22)}};
  expect_backward_matches_fd(
      [](const Args& a, const HVec& R) { return run_embedding(kCtx, kTokens, a, R); }, args, BT * C,
      23);
}

TEST(LayersFd, Head) {
  const Args args = {{"x", random_vec(BT * C, 24, -2, 2)},  // x: (BT, C)
                     {"lnf.w", random_vec(C, 25, 0.5, 1.5)},
                     {"lnf.b", random_vec(C, 26)},
                     {"wte", random_vec(Vp * C, 27)}};
  expect_backward_matches_fd(
      [](const Args& a, const HVec& R) { return run_head(kCtx, kTargets, a, R); }, args, 1, 28);
}

TEST(LayersFd, Block) {
  Args args = block_params(30);
  args["x"] = random_vec(BT * C, 29, -2, 2);  // x: (BT, C)
  expect_backward_matches_fd([](const Args& a, const HVec& R) { return run_block(kCtx, a, R); },
                             args, BT * C, 31);
}

// ---- tensor parallel: shards on every rank against the whole layer -----------------------

// Runs on all ranks of the world as one tp group; the parameter says whether with sequence
// parallelism. One rank has no group to test.
class TpLayers : public testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (world_size() == 1) GTEST_SKIP() << "tensor parallelism needs 2 or more ranks";
  }
  MpiComm comm{MPI_COMM_WORLD, "tp"};
  TensorParallel tp{&comm, GetParam()};
  int t = tp.rank(), n = tp.size();
  Ctx c{tp, B, S};  // R rows from r0 under SP, else all BT
};
INSTANTIATE_TEST_SUITE_P(Tp, TpLayers, testing::Bool(), [](const testing::TestParamInfo<bool>& p) {
  return p.param ? "SequenceParallel" : "NoSequenceParallel";
});

// Parameters split over tp: this rank's part of a whole tensor (and of its gradient).
using Split = std::function<HVec(const HVec&)>;
Split rows_split(int cols, int parts, int t) {
  return [=](const HVec& m) {
    const std::int64_t n = std::int64_t(m.size()) / cols / parts;
    return rows_of(m, cols, t * n, n);
  };
}
Split cols_split(int cols, int parts, int t) {
  return [=](const HVec& m) { return cols_of(m, cols, t * (cols / parts), cols / parts); };
}
// qkv's rows (3C, ..): this rank's heads of each of q, k and v.
Split qkv_split(int cols, int parts, int t) {
  return [=](const HVec& m) {
    HVec out;
    for (int which = 0; which < 3; ++which) {
      const HVec part = rows_of(m, cols, std::int64_t(which) * C, C);
      const HVec mine = rows_split(cols, parts, t)(part);
      out.insert(out.end(), mine.begin(), mine.end());
    }
    return out;
  };
}
using Splits = std::map<std::string, Split>;  // a parameter not named is replicated

Args split_params(const Args& whole, const Splits& s) {
  Args part;
  for (const auto& [name, v] : whole) part[name] = s.count(name) ? s.at(name)(v) : v;
  return part;
}
// Every parameter gradient of the sharded layer is its split of the whole layer's.
void expect_param_grads_split(const Outcome& got, const Outcome& whole, const Splits& s) {
  for (const auto& [name, g] : whole.grad)
    if (name != "x") {
      ASSERT_TRUE(got.grad.count(name)) << name;
      expect_close(got.grad.at(name), s.count(name) ? s.at(name)(g) : g, kTpTol, name);
    }
}

TEST_P(TpLayers, ColumnParallelLinearEqualsWholeLayer) {
  const int in = 6, out = 8, out_l = out / n;
  const Args whole = {{"lin.w", random_vec(out * in, 40)}, {"lin.b", random_vec(out, 41)}};
  const HVec x = random_vec(BT * in, 42), dy = random_vec(BT * out, 43);  // (BT, in), (BT, out)
  Args all = whole;
  all["x"] = x;
  const Outcome ref = run_column(kCtx, in, out, all, dy);
  const Splits s = {{"lin.w", rows_split(in, n, t)}, {"lin.b", rows_split(1, n, t)}};
  Args mine = split_params(whole, s);
  mine["x"] = only_rows(x, in, c.r0, c.R);
  const Outcome got = run_column(c, in, out_l, mine, cols_of(dy, out, t * out_l, out_l));
  expect_close(got.out, cols_of(ref.out, out, t * out_l, out_l), kTpTol, "y");
  expect_close(got.grad.at("x"), rows_of(ref.grad.at("x"), in, c.r0, c.R), kTpTol, "x");
  expect_param_grads_split(got, ref, s);
}

TEST_P(TpLayers, RowParallelLinearEqualsWholeLayer) {
  const int in = 8, out = 6, in_l = in / n;
  const Args whole = {{"lin.w", random_vec(out * in, 44)}, {"lin.b", random_vec(out, 45)}};
  const HVec x = random_vec(BT * in, 46), dy = random_vec(BT * out, 47);  // (BT, in), (BT, out)
  Args all = whole;
  all["x"] = x;
  const Outcome ref = run_row(kCtx, in, out, all, dy);
  const Splits s = {{"lin.w", cols_split(in, n, t)}};  // the bias: whole, added by rank 0
  Args mine = split_params(whole, s);
  mine["x"] = cols_of(x, in, t * in_l, in_l);
  const Outcome got = run_row(c, in_l, out, mine, rows_of(dy, out, c.r0, c.R));
  expect_close(got.out, rows_of(ref.out, out, c.r0, c.R), kTpTol, "y");
  expect_close(got.grad.at("x"), cols_of(ref.grad.at("x"), in, t * in_l, in_l), kTpTol, "x");
  expect_param_grads_split(got, ref, s);
}

// Column then row: the MLP's fc and proj, the chain that needs no communication in between.
TEST_P(TpLayers, MlpEqualsWholeMlp) {
  const Args whole = {{"mlp.fc.w", random_vec(F * C, 48)},
                      {"mlp.fc.b", random_vec(F, 49)},
                      {"mlp.proj.w", random_vec(C * F, 50)},
                      {"mlp.proj.b", random_vec(C, 51)}};
  const HVec x = random_vec(BT * C, 52), dy = random_vec(BT * C, 53);  // (BT, C) each
  Args all = whole;
  all["x"] = x;
  const Outcome ref = run_mlp(kCtx, all, dy);
  const Splits s = {{"mlp.fc.w", rows_split(C, n, t)},
                    {"mlp.fc.b", rows_split(1, n, t)},
                    {"mlp.proj.w", cols_split(F, n, t)}};
  Args mine = split_params(whole, s);
  mine["x"] = only_rows(x, C, c.r0, c.R);
  const Outcome got = run_mlp(c, mine, rows_of(dy, C, c.r0, c.R));
  expect_close(got.out, rows_of(ref.out, C, c.r0, c.R), kTpTol, "y");
  expect_close(got.grad.at("x"), rows_of(ref.grad.at("x"), C, c.r0, c.R), kTpTol, "x");
  expect_param_grads_split(got, ref, s);
}

// Heads split over tp: qkv column-parallel, proj row-parallel, LayerNorm grads reduced.
TEST_P(TpLayers, BlockEqualsWholeBlock) {
  const Args whole = block_params(60);
  const HVec x = random_vec(BT * C, 61, -2, 2), dy = random_vec(BT * C, 62);  // (BT, C) each
  Args all = whole;
  all["x"] = x;
  const Outcome ref = run_block(kCtx, all, dy);
  const Splits s = {{"qkv.w", qkv_split(C, n, t)},     {"qkv.b", qkv_split(1, n, t)},
                    {"proj.w", cols_split(C, n, t)},   {"mlp.fc.w", rows_split(C, n, t)},
                    {"mlp.fc.b", rows_split(1, n, t)}, {"mlp.proj.w", cols_split(F, n, t)}};
  Args mine = split_params(whole, s);
  mine["x"] = rows_of(x, C, c.r0, c.R);
  const Outcome got = run_block(c, mine, rows_of(dy, C, c.r0, c.R));
  expect_close(got.out, rows_of(ref.out, C, c.r0, c.R), kTpTol, "res3");
  expect_close(got.grad.at("x"), rows_of(ref.grad.at("x"), C, c.r0, c.R), kTpTol, "x");
  expect_param_grads_split(got, ref, s);
}

// Vocabulary rows split over tp; wpe replicated (added by rank 0, its gradient everywhere).
TEST_P(TpLayers, EmbeddingEqualsWholeEmbedding) {
  const Args whole = {{"wte", random_vec(Vp * C, 63)}, {"wpe", random_vec(S * C, 64)}};
  const HVec dx = random_vec(BT * C, 65);  // (BT, C)
  const Outcome ref = run_embedding(kCtx, kTokens, whole, dx);
  const Splits s = {{"wte", rows_split(C, n, t)}};
  const Outcome got = run_embedding(c, kTokens, split_params(whole, s), rows_of(dx, C, c.r0, c.R));
  expect_close(got.out, rows_of(ref.out, C, c.r0, c.R), kTpTol, "x");
  expect_param_grads_split(got, ref, s);
}

// Vocab-parallel logits and cross-entropy: the same loss and gradients as the whole vocabulary.
TEST_P(TpLayers, HeadEqualsWholeHead) {
  const Args whole = {{"lnf.w", random_vec(C, 66, 0.5, 1.5)},
                      {"lnf.b", random_vec(C, 67)},
                      {"wte", random_vec(Vp * C, 68, -2, 2)}};
  const HVec x = random_vec(BT * C, 69, -2, 2);  // (BT, C)
  Args all = whole;
  all["x"] = x;
  const HVec dloss = {0.3};
  const Outcome ref = run_head(kCtx, kTargets, all, dloss);
  const Splits s = {{"wte", rows_split(C, n, t)}};
  Args mine = split_params(whole, s);
  mine["x"] = rows_of(x, C, c.r0, c.R);
  const Outcome got = run_head(c, kTargets, mine, dloss);
  expect_close(got.out, ref.out, kTpTol, "loss");
  expect_close(got.grad.at("x"), rows_of(ref.grad.at("x"), C, c.r0, c.R), kTpTol, "x");
  expect_param_grads_split(got, ref, s);
}

}  // namespace
