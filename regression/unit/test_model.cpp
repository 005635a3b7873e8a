// ptrain-test: np=1 labels=quick timeout=300
// The whole GPT: backward against central finite differences in fp64, fp32 against fp64,
// layout-invariant init, and gradient accumulation over micro-batches.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "data/data.hpp"
#include "deck/deck.hpp"
#include "model/stage.hpp"
#include "test_support.hpp"

using namespace ptrain;

namespace {

Config tiny_config(std::vector<std::string> extra = {}) {
  std::map<std::string, std::string> kv = {{"model%n_layer", "2"},      {"model%d_model", "8"},
                                           {"model%n_head", "2"},       {"model%vocab", "11"},
                                           {"model%seq_len", "5"},      {"model%ffn_mult", "2"},
                                           {"train%global_batch", "2"}, {"train%micro_batch", "2"}};
  for (const auto& e : extra) kv[e.substr(0, e.find('='))] = e.substr(e.find('=') + 1);
  std::vector<std::string> o;
  for (const auto& [k, v] : kv) o.push_back(k + "=" + v);
  Config c = deck::parse_text("", "<test>", o);
  deck::validate(c, 1);
  return c;
}

// The whole model on one rank: one stage holding every layer, with `slots` activation slots.
template <class T>
model::Stage<Uniform<T>> whole_model(const Config& c, int micro_batch, int slots = 1) {
  return model::Stage<Uniform<T>>(c, {}, model::build_layout(c, {}).at(0), micro_batch, slots);
}

struct Batch {
  std::vector<std::int32_t> x, y;
};
Batch batch_of(const Config& c, int B, std::int64_t step = 1) {
  auto src = data::open_source(data::spec_from_config(c));
  Batch b;
  b.x.resize(std::size_t(B * c.model.seq_len));
  b.y.resize(b.x.size());
  data::Position at = data::position_after(*src, 0);
  const auto draws = data::take(*src, at, step, B);
  data::fetch(*src, data::Split::train, draws.data(), B, b.x.data(), b.y.data());
  return b;
}

}  // namespace

TEST(Model, BackwardMatchesFiniteDifferencesFp64) {
  const Config c = tiny_config({"model%dtype='fp64'"});
  auto gpt = whole_model<double>(c, 2);
  gpt.init_weights(7);
  // Larger weights than GPT-2's 0.02 so every path carries a visible gradient.
  auto p = gpt.params();
  {
    staging::HostView<double> w(p, staging::Access::read_write);
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = w[i] * 10.0 + 0.01 * std::sin(double(i));
  }
  const Batch b = batch_of(c, 2);
  const double scale = 1.0 / 10.0;  // dloss of the mean over 2*5 tokens
  gpt.zero_grads();
  gpt.forward(0, {b.x.data(), b.y.data(), 2});
  gpt.backward(0, scale);
  const auto analytic = test::host(gpt.grads());

  std::vector<double> numeric(analytic.size());
  const double h = 1e-5;
  const auto& wte = gpt.layout().find("wte.weight");
  for (std::size_t i = 0; i < numeric.size(); ++i) {
    const double keep = test::get(p, i);
    test::set(p, i, keep + h);
    const double up = gpt.forward(0, {b.x.data(), b.y.data(), 2}) * scale;
    test::set(p, i, keep - h);
    const double down = gpt.forward(0, {b.x.data(), b.y.data(), 2}) * scale;
    test::set(p, i, keep);
    numeric[i] = (up - down) / (2 * h);
  }
  EXPECT_LT(test::rel_err(analytic, numeric), 1e-6);
  // Every tensor separately, so a small tensor's error is not hidden by a large one.
  for (const auto& t : gpt.layout().tensors) {
    std::vector<double> a(analytic.begin() + t.offset, analytic.begin() + t.offset + t.numel);
    std::vector<double> n(numeric.begin() + t.offset, numeric.begin() + t.offset + t.numel);
    EXPECT_LT(test::rel_err(a, n), 1e-6) << t.name;
  }
  EXPECT_GT(
      std::abs(analytic[std::size_t(wte.offset)]) + std::abs(analytic[std::size_t(wte.offset + 1)]),
      0);
}

TEST(Model, Fp32AgreesWithFp64) {
  const Config c64 = tiny_config({"model%dtype='fp64'", "model%d_model=16", "model%vocab=37"});
  const Config c32 = tiny_config({"model%dtype='fp32'", "model%d_model=16", "model%vocab=37"});
  auto g64 = whole_model<double>(c64, 2);
  auto g32 = whole_model<float>(c32, 2);
  g64.init_weights(3);
  g32.init_weights(3);
  EXPECT_LT(test::rel_err(test::host(g64.params()), test::host(g32.params())), 1e-7);
  const Batch b = batch_of(c64, 2);
  g64.zero_grads();
  g32.zero_grads();
  const double l64 = g64.forward(0, {b.x.data(), b.y.data(), 2});
  const double l32 = g32.forward(0, {b.x.data(), b.y.data(), 2});
  EXPECT_NEAR(l32, l64, 1e-5 * std::abs(l64));
  g64.backward(0, 0.1);
  g32.backward(0, 0.1f);
  EXPECT_LT(test::rel_err(test::host(g64.grads()), test::host(g32.grads())), 1e-4);
}

TEST(Model, InitIsGpt2) {
  const Config c = tiny_config({"model%dtype='fp64'", "model%d_model=64", "model%n_head=4",
                                "model%vocab=500", "model%n_layer=8"});
  auto gpt = whole_model<double>(c, 1);
  gpt.init_weights(1);
  auto stddev = [&](const std::string& name) {
    auto v = test::host(gpt.param(name));
    double s = 0;
    for (double x : v) s += x * x;
    return std::sqrt(s / double(v.size()));
  };
  EXPECT_NEAR(stddev("wte.weight"), 0.02, 0.001);
  EXPECT_NEAR(stddev("h.0.mlp.fc.weight"), 0.02, 0.001);
  EXPECT_NEAR(stddev("h.3.attn.proj.weight"), 0.02 / 4.0, 0.0003);  // 1/sqrt(2*8)
  for (double x : test::host(gpt.param("h.1.attn.qkv.bias"))) EXPECT_EQ(x, 0.0);
  for (double x : test::host(gpt.param("h.1.ln_2.weight"))) EXPECT_EQ(x, 1.0);
  for (double x : test::host(gpt.param("ln_f.bias"))) EXPECT_EQ(x, 0.0);
}

TEST(Model, MicroBatchesAccumulateToTheFullBatchGradient) {
  const Config c =
      tiny_config({"model%dtype='fp64'", "train%global_batch=4", "train%micro_batch=4"});
  const Batch b = batch_of(c, 4);
  auto whole = whole_model<double>(c, 4), parts = whole_model<double>(c, 1);
  whole.init_weights(5);
  parts.init_weights(5);
  const double dloss = 1.0 / (4 * 5);
  whole.zero_grads();
  const double lw = whole.forward(0, {b.x.data(), b.y.data(), 4});
  whole.backward(0, dloss);
  parts.zero_grads();
  double lp = 0;
  for (int j = 0; j < 4; ++j) {
    lp += parts.forward(0, {b.x.data() + j * 5, b.y.data() + j * 5, 1});
    parts.backward(0, dloss);
  }
  EXPECT_NEAR(lp, lw, 1e-12 * lw);
  EXPECT_LT(test::rel_err(test::host(whole.grads()), test::host(parts.grads())), 1e-12);
}

// Three micro-batches in flight (forward, forward, forward, then the three backwards), as a
// pipeline schedule runs them, against three forward/backward pairs.
TEST(Stage, MicroBatchesInFlightMatchSequentialPairs) {
  const Config c =
      tiny_config({"model%dtype='fp64'", "train%global_batch=6", "train%micro_batch=2"});
  const Batch b = batch_of(c, 6);
  const double dloss = 1.0 / (6 * 5);
  auto pairs = whole_model<double>(c, 2), inflight = whole_model<double>(c, 2, 3);
  pairs.init_weights(9);
  inflight.init_weights(9);
  pairs.zero_grads();
  double lp = 0;
  for (int k = 0; k < 3; ++k) {
    lp += pairs.forward(0, {b.x.data() + k * 10, b.y.data() + k * 10, 2});
    pairs.backward(0, dloss);
  }
  for (bool reverse : {false, true}) {
    inflight.zero_grads();
    double li = 0;
    for (int k = 0; k < 3; ++k)
      li += inflight.forward(k, {b.x.data() + k * 10, b.y.data() + k * 10, 2});
    for (int j = 0; j < 3; ++j) inflight.backward(reverse ? 2 - j : j, dloss);
    EXPECT_EQ(li, lp);
    const auto a = test::host(pairs.grads()), g = test::host(inflight.grads());
    if (reverse)
      EXPECT_LT(test::rel_err(a, g), 1e-13);  // the same sums in another order
    else
      EXPECT_EQ(a, g);  // the same operations in the same order: bit for bit
  }
}

// The model cut into two stages on one rank, activations and their gradients handed across
// by hand (what the pipeline executor will send): the same loss and gradients as one stage.
TEST(Stage, TwoStagesChainedEqualTheWholeModel) {
  const Config c = tiny_config({"model%dtype='fp64'", "model%n_layer=4"});
  const Batch b = batch_of(c, 2);
  const double dloss = 1.0 / (2 * 5);
  auto whole = whole_model<double>(c, 2);
  whole.init_weights(4);
  whole.zero_grads();
  const double lw = whole.forward(0, {b.x.data(), b.y.data(), 2});
  whole.backward(0, dloss);

  std::vector<model::Stage<Fp64>> stages;
  stages.reserve(2);
  for (int p = 0; p < 2; ++p) {
    model::ShardCoord coord;
    coord.p = p;
    coord.pp = 2;
    stages.emplace_back(c, coord, model::build_layout(c, coord).at(0), 2);
    stages.back().init_weights(4);
    stages.back().zero_grads();
  }
  const model::MicroBatch mb{b.x.data(), b.y.data(), 2};
  EXPECT_EQ(stages[0].forward(0, mb), 0.0);
  kernels::copy<double>(stages[1].input(0, 2), stages[0].output(0));
  const double ls = stages[1].forward(0, mb);
  stages[1].backward(0, dloss);
  stages[0].backward(0, dloss, stages[1].input_grad());
  EXPECT_NEAR(ls, lw, 1e-14 * lw);
  // Every tensor by name; the tied wte's gradient is the sum of both stages' copies.
  for (const auto& t : whole.layout().tensors) {
    auto want = test::host(whole.grad(t.name));
    std::vector<double> got(want.size(), 0.0);
    for (auto& s : stages)
      for (const auto& u : s.layout().tensors)
        if (u.name == t.name) {
          const auto part = test::host(s.grad(t.name));
          for (std::size_t i = 0; i < got.size(); ++i) got[i] += part[i];
        }
    EXPECT_LT(test::rel_err(want, got), 1e-13) << t.name;
  }
}

// Zero-bubble schedules split each backward into B (the input gradient) and W (the weight
// gradients), W later. Two stages on one rank, three micro-batches in flight, W delayed behind
// the next B as ZB-H1 does: the same input gradients, bit for bit, and the same parameter
// gradients (bit for bit but for the LayerNorms', whose sums are added to the gradient in one
// go instead of row by row), with and without recomputation.
TEST(Stage, SplitBackwardEqualsTheWhole) {
  for (const std::string recompute : {"none", "selective", "full"}) {
    SCOPED_TRACE(recompute);
    const Config c = tiny_config({"model%dtype='fp64'", "model%n_layer=4", "train%global_batch=6",
                                  "train%micro_batch=2", "train%recompute='" + recompute + "'"});
    const Batch b = batch_of(c, 6);
    const double dloss = 1.0 / (6 * 5);
    // [0]: whole backwards, [1]: split ones; each two stages of the model.
    std::vector<std::vector<model::Stage<Fp64>>> runs(2);
    for (int split = 0; split < 2; ++split) {
      runs[std::size_t(split)].reserve(2);
      for (int p = 0; p < 2; ++p) {
        model::ShardCoord coord;
        coord.p = p, coord.pp = 2;
        auto& s =
            runs[std::size_t(split)].emplace_back(c, coord, model::build_layout(c, coord).at(0), 2,
                                                  model::SlotCounts(3, 3, split ? 2 : 0));
        EXPECT_EQ(s.splits(), split == 1);
        s.init_weights(5);
        s.zero_grads();
      }
    }
    std::vector<std::vector<double>> input_grads[2];
    for (int split = 0; split < 2; ++split) {
      auto& st = runs[std::size_t(split)];
      for (int k = 0; k < 3; ++k) {
        const model::MicroBatch mb{b.x.data() + k * 10, b.y.data() + k * 10, 2};
        st[0].forward(k, mb);
        kernels::copy<double>(st[1].input(k, 2), st[0].output(k));
        st[1].forward(k, mb);
      }
      for (int k = 0; k < 3; ++k) {
        if (split) {
          st[1].backward_input(k, dloss);
          st[0].backward_input(k, dloss, st[1].input_grad());
          if (k > 0) st[1].backward_weight(k - 1), st[0].backward_weight(k - 1);
        } else {
          st[1].backward(k, dloss);
          st[0].backward(k, dloss, st[1].input_grad());
        }
        input_grads[split].push_back(test::host(st[1].input_grad()));
      }
      if (split) st[1].backward_weight(2), st[0].backward_weight(2);
    }
    EXPECT_EQ(input_grads[0], input_grads[1]);
    for (int p = 0; p < 2; ++p)
      for (const auto& t : runs[0][std::size_t(p)].layout().tensors) {
        const auto whole = test::host(runs[0][std::size_t(p)].grad(t.name)),
                   split = test::host(runs[1][std::size_t(p)].grad(t.name));
        if (t.kind == model::TensorKind::norm)
          EXPECT_LT(test::rel_err(whole, split), 1e-14) << t.name;
        else
          EXPECT_EQ(whole, split) << t.name;
      }
  }
}
