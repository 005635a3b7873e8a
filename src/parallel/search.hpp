// parallel/search.hpp — `ptrain --plan --search`: which grid to run. Every layout of the
// deck's model on the world — dp, tp (within a node), pp, cp, ep, ZeRO stage, sequence
// parallelism, train%recompute, micro-batch, pipeline schedule and virtual stages — that the
// deck's rules accept and whose largest shard fits the memory a rank has, ranked by the cost
// model's tokens/s (parallel/cost.hpp). Choices that cannot win are not priced: of the ZeRO
// stages and recompute levels that fit only the lowest (each higher one adds communication or
// recomputation and saves only memory), sequence parallelism always with tp > 1 (the same
// traffic, a tp-th of the LayerNorm work and activations), 1F1B rather than GPipe (the same
// bubble, more memory); 1F1B, interleaved at 2 and 4 chunks a rank, ZB-H1 and ZB-V priced. A
// pipeline whose layers do not split evenly gets the split balanced by cost
// (parallel%pp_layers = -1).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "deck/config.hpp"
#include "parallel/cost.hpp"

namespace ptrain::parallel {

struct LayoutCandidate {
  Config config;                  // the deck with this layout, validated
  std::vector<std::string> sets;  // --set values that make it from the deck
  StepPrediction prediction;
  double largest = 0;  // bytes of its largest shard
};

struct LayoutSearch {
  std::vector<LayoutCandidate> ranked;  // every fitting candidate priced, fastest first
  std::int64_t grids = 0;               // process grids (dp, tp, pp, cp, ep) tried
  std::int64_t considered = 0;          // layouts the deck's rules accept
  std::int64_t priced = 0;              // of those, fitting and priced
  double budget = 0;                    // bytes a rank has (0: not judged)
  double seconds = 0;                   // the search's own time
};

// `deck` validated for some world; `budget` bytes per rank (0: everything fits).
LayoutSearch search_layouts(const Config& deck, int world, int ranks_per_node, double budget,
                            const Machine& m);

// The top `shown` as a table: predicted step time and tokens/s, memory, bubble, exposed
// communication, what bounds each, and its --set options; then how many were considered and
// how long the search took.
std::string search_report(const LayoutSearch& s, int shown = 10);

}  // namespace ptrain::parallel
