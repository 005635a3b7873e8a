// ptrain-test: np=1 labels=quick timeout=120
// The cost model (parallel/cost.hpp) and the layout search (parallel/search.hpp): the
// planner's figures against published ones (the GPT configurations of Narayanan et al. 2021,
// "Efficient Large-Scale Language Model Training on GPU Clusters using Megatron-LM", Table 1
// and its equations; the model-state memory of Rajbhandari et al. 2020, "ZeRO", Figure 1),
// the machine file's defaults, the balanced pipeline split and the search.
#include <gtest/gtest.h>

#include <cmath>

#include "deck/deck.hpp"
#include "model/layout.hpp"
#include "parallel/cost.hpp"
#include "parallel/plan.hpp"
#include "parallel/search.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"

using namespace ptrain;
using namespace ptrain::parallel;

namespace {

Config deck_with(const std::vector<std::string>& sets) {
  return deck::parse_text("", "<test>", sets);
}

// Megatron-LM's GPT: vocabulary 51,200, sequence 2,048.
struct MegatronGpt {
  double billions;  // Table 1, as published (rounded to 0.1 B)
  int heads, hidden, layers;
};
constexpr MegatronGpt kMegatron[] = {{1.7, 24, 2304, 24},      {3.6, 32, 3072, 30},
                                     {7.5, 32, 4096, 36},      {18.4, 48, 6144, 40},
                                     {39.1, 64, 8192, 48},     {76.1, 80, 10240, 60},
                                     {145.6, 96, 12288, 80},   {310.1, 128, 16384, 96},
                                     {529.6, 128, 20480, 105}, {1008.0, 160, 25600, 128}};

Config megatron(const MegatronGpt& g, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> s = {cat("model%n_layer=", g.layers), cat("model%d_model=", g.hidden),
                                cat("model%n_head=", g.heads), "model%vocab=51200",
                                "model%seq_len=2048"};
  s.insert(s.end(), extra.begin(), extra.end());
  return deck_with(s);
}

}  // namespace

// Parameters: the paper's P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) plus the final
// LayerNorm (2h), which it leaves out; and Table 1's rounded figures.
TEST(CostModel, ParametersOfMegatronsGptConfigurations) {
  for (const auto& g : kMegatron) {
    const double l = g.layers, h = g.hidden;
    const double formula = 12 * l * h * h * (1 + 13 / (12 * h) + (51200.0 + 2048) / (12 * l * h));
    const double ours = double(model::global_parameter_count(megatron(g)));
    EXPECT_DOUBLE_EQ(ours, formula + 2 * h) << g.billions << "B";
    EXPECT_NEAR(ours / 1e9, g.billions, 0.05 + 1e-3 * g.billions) << g.billions << "B";
  }
}

// FLOPs per iteration with full activation recomputation (the paper's equation 3):
// F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)). The planner's executed FLOPs (model FLOPs plus
// recomputation's) differ only by the bias and LayerNorm terms (about 1/h).
TEST(CostModel, FlopsPerIterationOfMegatronsGptConfigurations) {
  for (const auto& g : kMegatron) {
    const double B = 512, s = 2048, V = 51200, l = g.layers, h = g.hidden;
    const double paper = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
    const Config c = megatron(g, {"train%recompute='full'", "train%global_batch=512"});
    const double executed = (model::flops_per_token(c) + recompute_flops_per_token(c)) * B * s;
    EXPECT_NEAR(executed / paper, 1.0, 2.0 / h) << g.billions << "B";
  }
}

// ZeRO's Figure 1: a 7.5B model with mixed-precision Adam (K = 12) on 64 data-parallel GPUs
// keeps 120 GB of model states per GPU, 31.4 GB with P_os, 16.6 GB with P_os+g and 1.9 GB with
// P_os+g+p: (2 + 2 + K) psi with the sharded parts over 64. ptrain's bf16 run with bf16
// gradients holds the same (bf16 weights and gradients, fp32 masters and two moments): at
// Megatron's 7.5B shapes (psi = 7.47e9) the planner's params + grads + optimizer bytes are the
// formula exactly, and scaled to psi = 7.5e9 the paper's figures.
TEST(CostModel, ModelStateMemoryOfZerosFigureOne) {
  const double paper_gb[] = {120, 31.4, 16.6, 1.9};
  const int D = 64;
  for (int z = 0; z < 4; ++z) {
    Config c = megatron(
        kMegatron[2], {"model%dtype='bf16'", "parallel%grad_dtype='bf16'", cat("parallel%zero=", z),
                       "train%global_batch=64", "train%micro_batch=1"});
    deck::validate(c, D);
    const MemoryEstimate m = estimate_memory(c, plan_shard(c, 0, 0, 0));
    const double psi = double(model::global_parameter_count(c));
    const double states = m.bytes[int(MemCategory::params)] + m.bytes[int(MemCategory::grads)] +
                          m.bytes[int(MemCategory::optimizer)];
    const double formula = z == 0   ? 16 * psi
                           : z == 1 ? 4 * psi + 12 * psi / D
                           : z == 2 ? 2 * psi + 14 * psi / D
                                    : 16 * psi / D;
    EXPECT_NEAR(states / formula, 1.0, 1e-3) << "ZeRO " << z;
    EXPECT_NEAR(states * 7.5e9 / psi / 1e9, paper_gb[z], 0.02 * paper_gb[z]) << "ZeRO " << z;
  }
}

TEST(CostModel, NodeClassDefaultsFillWhatTheMachineFileLeavesOut) {
  Config c = deck_with({"machine%node_class='h200'", "machine%gemm_gflops_bf16=700000"});
  const Machine m = machine_of(c);
  EXPECT_DOUBLE_EQ(m.gemm_bf16, 7e14);
  EXPECT_DOUBLE_EQ(m.gemm_fp32, node_class_defaults("h200").gemm_fp32);
  EXPECT_EQ(std::count(m.defaulted.begin(), m.defaulted.end(), "gemm_gflops_bf16"), 0);
  EXPECT_EQ(std::count(m.defaulted.begin(), m.defaulted.end(), "gemm_gflops_fp32"), 1);
  EXPECT_NE(describe_machine(m).find("from node class 'h200'"), std::string::npos);
  EXPECT_NE(describe_machine(machine_of(deck_with({}))).find("stated defaults"), std::string::npos);
  // A CPU rank of 4 threads has 4 cores' rates.
  EXPECT_DOUBLE_EQ(machine_of(deck_with({"backend%threads=4"})).gemm_fp32,
                   4 * node_class_defaults("cpu").gemm_fp32);
}

// The prediction follows the layout: tensor parallelism divides the compute and adds exposed
// tp traffic; a pipeline's bubble is the simulated schedule's; recomputation adds executed,
// not model, FLOPs.
TEST(CostModel, PredictionFollowsTheLayout) {
  const std::vector<std::string> model = {"model%n_layer=8",   "model%d_model=256",
                                          "model%n_head=8",    "model%vocab=8192",
                                          "model%seq_len=256", "train%global_batch=16"};
  auto predict = [&](std::vector<std::string> sets) {
    sets.insert(sets.end(), model.begin(), model.end());
    Config c = deck_with(sets);
    deck::validate(c, 4);
    return predict_step(c, 4, 4, machine_of(c));
  };
  const StepPrediction dp = predict({"train%micro_batch=4"}),
                       tp = predict({"parallel%tp=4", "train%micro_batch=16"});
  // The same tokens a rank, a quarter of each product: about the same compute.
  EXPECT_NEAR(tp.forward / dp.forward, 1.0, 0.3);
  double tp_exposed = 0;
  for (const auto& g : tp.comm)
    if (g.group == GroupKind::tp) tp_exposed = g.exposed;
  EXPECT_GT(tp_exposed, 0);
  const StepPrediction pp = predict({"parallel%pp=4", "train%micro_batch=2"});
  // (p-1)/(m+p-1) = 3/11 at equal stages; the LM head's stage is the slowest, so more.
  EXPECT_GT(pp.bubble, 0.9 * 3 / 11);
  EXPECT_LT(pp.bubble, 0.8);
  const StepPrediction full = predict({"train%recompute='full'", "train%micro_batch=4"});
  EXPECT_DOUBLE_EQ(full.model_flops, dp.model_flops);
  EXPECT_GT(full.executed_flops, dp.executed_flops);
  EXPECT_GT(full.step, dp.step);
  EXPECT_NEAR(dp.mfu * dp.step, dp.model_flops / (4 * machine_of(deck_with({})).gemm_fp32), 1e-12);
}

// A node of 2 cores running 4 ranks (machine%cores_per_node = 2): ranks that compute in step
// (dp) run at half speed; a pipeline's waiting ranks give theirs to the others, so its stages
// are slowed less, by the busy share the schedule gives them; with a core a rank nothing
// changes.
TEST(CostModel, SharedCoresSlowWhatComputesAtOnce) {
  const std::vector<std::string> model = {"model%n_layer=8",   "model%d_model=256",
                                          "model%n_head=8",    "model%vocab=8192",
                                          "model%seq_len=256", "train%global_batch=16"};
  auto predict = [&](std::vector<std::string> sets, int cores) {
    sets.insert(sets.end(), model.begin(), model.end());
    sets.push_back(cat("machine%cores_per_node=", cores));
    Config c = deck_with(sets);
    deck::validate(c, 4);
    return predict_step(c, 4, 4, machine_of(c));
  };
  const std::vector<std::string> dp = {"train%micro_batch=4"},
                                 pp = {"parallel%pp=4", "train%micro_batch=2"};
  const StepPrediction dp_own = predict(dp, 0), dp_shared = predict(dp, 2);
  EXPECT_NEAR(dp_shared.forward / dp_own.forward, 2.0, 1e-12);
  EXPECT_NEAR(dp_shared.share.at(0), 2.0, 1e-12);
  EXPECT_NEAR(dp_shared.mfu / dp_own.mfu, 2 * dp_own.step / dp_shared.step, 1e-12);
  EXPECT_DOUBLE_EQ(predict(dp, 4).step, dp_own.step);  // a core a rank
  const StepPrediction pp_own = predict(pp, 0), pp_shared = predict(pp, 2);
  for (double x : pp_shared.share) {
    EXPECT_GT(x, 1.05);  // others compute meanwhile
    EXPECT_LT(x, 1.95);  // but not all the time
  }
  EXPECT_GT(pp_shared.step, pp_own.step);
  EXPECT_LT(pp_shared.step / pp_own.step, dp_shared.step / dp_own.step);
}

// parallel%pp_layers = -1: with GPT-2's heavy head (a 50,304-word vocabulary) the last stage
// gets fewer blocks, and its slowest chunk is faster than the even split's.
TEST(CostModel, BalancedSplitUnloadsTheHead) {
  for (int pp : {2, 4}) {
    Config c = deck_with({"model%n_layer=12", "model%d_model=768", "model%n_head=12",
                          "model%vocab=50304", "model%seq_len=256", cat("parallel%pp=", pp),
                          "parallel%pp_layers=-1", "train%global_batch=8", "train%micro_batch=1"});
    deck::validate(c, pp);
    const Machine m = machine_of(c);
    const Config balanced = balanced_split(c, m);
    deck::validate(const_cast<Config&>(balanced), pp);
    std::int64_t sum = 0;
    for (int k = 0; k < pp; ++k) sum += balanced.parallel.pp_layers[std::size_t(k)];
    EXPECT_EQ(sum, 12);
    EXPECT_LT(balanced.parallel.pp_layers[std::size_t(pp - 1)], balanced.parallel.pp_layers[0]);
    Config even = c;
    std::fill(even.parallel.pp_layers.begin(), even.parallel.pp_layers.end(), 0);
    auto slowest = [&](const Config& x) {
      double most = 0;
      for (int p = 0; p < pp; ++p) {
        const ChunkCompute k = chunk_compute(x, m, p, 0);
        most = std::max(most, k.forward + k.backward + k.recompute);
      }
      return most;
    };
    EXPECT_LT(slowest(balanced), slowest(even)) << "pp " << pp;
    EXPECT_LT(predict_step(balanced, pp, pp, m).step, predict_step(even, pp, pp, m).step);
  }
}

// The search: every candidate valid and fitting, ranked by predicted tokens/s; a budget too
// small for any leaves none.
TEST(CostModel, SearchRanksValidFittingLayouts) {
  Config c =
      deck_with({"model%n_layer=8", "model%d_model=256", "model%n_head=8", "model%vocab=8192",
                 "model%seq_len=256", "train%global_batch=16", "train%micro_batch=2"});
  deck::validate(c, 8);
  const LayoutSearch s = search_layouts(c, 8, 8, 0, machine_of(c));
  ASSERT_GT(s.ranked.size(), 20u);
  for (std::size_t i = 0; i < s.ranked.size(); ++i) {
    Config x = s.ranked[i].config;
    EXPECT_NO_THROW(deck::validate(x, 8));
    if (i > 0) {
      EXPECT_GE(s.ranked[i - 1].prediction.tokens_per_s, s.ranked[i].prediction.tokens_per_s);
    }
  }
  const double least = s.ranked.back().largest;
  double smallest = least;
  for (const auto& r : s.ranked) smallest = std::min(smallest, r.largest);
  const LayoutSearch tight = search_layouts(c, 8, 8, smallest * 1.0001, machine_of(c));
  ASSERT_FALSE(tight.ranked.empty());
  for (const auto& r : tight.ranked) EXPECT_LE(r.largest, smallest * 1.0001);
  EXPECT_TRUE(search_layouts(c, 8, 8, 1000, machine_of(c)).ranked.empty());
  EXPECT_NE(search_report(s).find("layout search: "), std::string::npos);
}
