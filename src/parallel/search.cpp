#include "parallel/search.hpp"

#include <algorithm>
#include <cstdio>

#include "deck/deck.hpp"
#include "model/layout.hpp"
#include "parallel/plan.hpp"
#include "parallel/report.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"
#include "util/timer.hpp"

namespace ptrain::parallel {

namespace {

std::vector<int> divisors(std::int64_t n) {
  std::vector<int> out;
  for (std::int64_t k = 1; k <= n; ++k)
    if (n % k == 0) out.push_back(int(k));
  return out;
}

const char* const kLevels[] = {"none", "selective", "full"};

// The --set values that turn `deck` into `c`, layout keys only.
std::vector<std::string> sets_between(const Config& deck, const Config& c) {
  std::vector<std::string> s;
  const auto& a = deck.parallel;
  const auto& b = c.parallel;
  auto add_int = [&](const char* key, std::int64_t x, std::int64_t y) {
    if (x != y) s.push_back(cat(key, "=", y));
  };
  add_int("parallel%dp", a.dp, b.dp);
  add_int("parallel%tp", a.tp, b.tp);
  add_int("parallel%pp", a.pp, b.pp);
  add_int("parallel%cp", a.cp, b.cp);
  add_int("parallel%ep", a.ep, b.ep);
  add_int("parallel%zero", a.zero, b.zero);
  if (a.sequence_parallel != b.sequence_parallel)
    s.push_back(cat("parallel%sequence_parallel=", b.sequence_parallel ? ".true." : ".false."));
  if (a.pp_schedule != b.pp_schedule)
    s.push_back(cat("parallel%pp_schedule='", b.pp_schedule, "'"));
  add_int("parallel%virtual_stages", a.virtual_stages, b.virtual_stages);
  if (a.pp_layers != b.pp_layers) {
    std::string v;
    for (std::size_t i = 0; i < b.pp_layers.size() && b.pp_layers[i] != 0; ++i)
      v += cat(i ? "," : "", b.pp_layers[i]);
    s.push_back(cat("parallel%pp_layers=", v.empty() ? std::string("0") : v));
  }
  add_int("train%micro_batch", deck.train.micro_batch, c.train.micro_batch);
  if (deck.train.recompute != c.train.recompute)
    s.push_back(cat("train%recompute='", c.train.recompute, "'"));
  return s;
}

// (schedule, virtual stages) worth pricing for pp stages of L layers and m micro-batches:
// 1F1B; interleaved at 2 and 4 chunks a rank; the zero-bubble ZB-H1 and ZB-V (two chunks in a
// V).
std::vector<std::pair<const char*, int>> schedules_for(int pp, std::int64_t L, std::int64_t m) {
  std::vector<std::pair<const char*, int>> out{{"1f1b", 1}};
  if (pp == 1) return out;
  for (int v : {2, 4})
    if (L >= std::int64_t(pp) * v && m % pp == 0) out.push_back({"interleaved", v});
  out.push_back({"zb-h1", 1});
  if (L >= std::int64_t(pp) * 2) out.push_back({"zb-v", 2});
  return out;
}

struct SearchContext {
  const Config& deck;
  int world, ranks_per_node;
  double budget;
  const Machine& m;
};

// `base` at every ZeRO stage that matters, each at the lowest recompute level the deck's rules
// accept that fits the budget, priced into `out`.
void price_layout(const SearchContext& x, const Config& base, LayoutSearch& out) {
  const auto& par = base.parallel;
  const bool zero_matters = par.dp * par.ep * par.cp > 1;
  for (int zero = 0; zero <= (zero_matters ? 3 : 0); ++zero) {
    for (const char* level : kLevels) {
      Config c = base;
      c.parallel.zero = zero;
      c.train.recompute = level;
      try {
        deck::validate(c, x.world);
        if (c.parallel.pp_layers[0] == -1) {
          c = balanced_split(c, x.m);
          deck::validate(c, x.world);
        }
      } catch (const Error&) {
        break;  // these rules do not change with the recompute level
      }
      ++out.considered;
      const LargestShard big = largest_shard(c, x.ranks_per_node);
      if (x.budget > 0 && big.bytes > x.budget) continue;  // more recomputation
      LayoutCandidate cand;
      cand.prediction = predict_step(c, x.world, x.ranks_per_node, x.m);
      cand.largest = big.bytes;
      cand.sets = sets_between(x.deck, c);
      cand.config = std::move(c);
      out.ranked.push_back(std::move(cand));
      ++out.priced;
      break;  // the lowest recompute level that fits
    }
  }
}

}  // namespace

LayoutSearch search_layouts(const Config& deck, int world, int ranks_per_node, double budget,
                            const Machine& m) {
  const double t0 = wall_seconds();
  LayoutSearch out;
  out.budget = budget;
  const SearchContext x{deck, world, ranks_per_node, budget, m};
  const model::Dims d = model::dims_of(deck);
  const int rpn = std::max(1, ranks_per_node);
  for (int tp : divisors(world)) {
    if (tp > rpn || d.NH % tp != 0) continue;  // tp groups stay inside a node
    for (int cp : divisors(world / tp)) {
      if (cp > 16 || d.S % (2 * cp) != 0) continue;
      const std::vector<int> eps =
          d.n_expert > 0 ? divisors(world / (tp * cp)) : std::vector<int>{1};
      for (int ep : eps) {
        if (d.n_expert % ep != 0) continue;
        for (int pp : divisors(world / (tp * cp * ep))) {
          if (pp > d.L) continue;
          const int dp = world / (tp * cp * ep * pp);
          if (deck.train.global_batch % (std::int64_t(dp) * ep) != 0) continue;
          ++out.grids;
          const std::int64_t per_rank = deck.train.global_batch / (std::int64_t(dp) * ep);
          for (int micro : divisors(per_rank)) {
            for (auto [schedule, v] : schedules_for(pp, d.L, per_rank / micro)) {
              Config base = deck;
              auto& par = base.parallel;
              par.tp = tp, par.cp = cp, par.ep = ep, par.pp = pp, par.dp = dp;
              par.sequence_parallel = tp > 1;
              par.pp_schedule = schedule, par.virtual_stages = v;
              std::fill(par.pp_layers.begin(), par.pp_layers.end(), 0);
              if (d.L % (std::int64_t(pp) * v) != 0) par.pp_layers[0] = -1;
              base.train.micro_batch = micro;
              price_layout(x, base, out);
            }
          }
        }
      }
    }
  }
  std::stable_sort(out.ranked.begin(), out.ranked.end(),
                   [](const LayoutCandidate& a, const LayoutCandidate& b) {
                     return a.prediction.tokens_per_s > b.prediction.tokens_per_s;
                   });
  out.seconds = wall_seconds() - t0;
  return out;
}

std::string search_report(const LayoutSearch& s, int shown) {
  std::string r = cat("layout search: ", s.grids, " process grids, ", s.considered,
                      " layouts the deck's rules accept, ", s.priced,
                      s.budget > 0 ? cat(" fit ", format_bytes(s.budget), " a rank and were priced")
                                   : std::string(" priced (memory not judged: no --memory)"),
                      "; ", fixed("%.2f", s.seconds), " s\n");
  if (s.ranked.empty()) return r + "no layout fits: more ranks, more memory or a smaller model\n";
  char head[256];
  std::snprintf(head, sizeof head, "%4s %9s %10s %9s %7s %10s  %-22s %s\n", "#", "step s", "tok/s",
                "memory", "bubble", "exposed s", "bound", "layout (--set)");
  r += head;
  for (int i = 0; i < int(s.ranked.size()) && i < shown; ++i) {
    const LayoutCandidate& c = s.ranked[std::size_t(i)];
    const StepPrediction& p = c.prediction;
    double exposed = 0;
    for (const auto& g : p.comm) exposed += g.exposed;
    std::string sets;
    for (const auto& v : c.sets) sets += cat(sets.empty() ? "" : " ", v);
    char line[512];
    std::snprintf(line, sizeof line, "%4d %9.4g %10.0f %9s %6.1f%% %10.3g  %-22s %s\n", i + 1,
                  p.step, p.tokens_per_s, format_bytes(c.largest).c_str(), 100 * p.bubble, exposed,
                  p.bound.c_str(), sets.empty() ? "(the deck's own)" : sets.c_str());
    r += line;
  }
  return r;
}

}  // namespace ptrain::parallel
