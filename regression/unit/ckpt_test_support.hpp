// Helpers shared by the checkpoint tests (test_ckpt.cpp, test_ckpt_restart.cpp): a small
// model, where a rank sits in a decomposition, and which blocks of a global tensor it holds
// (global_index is in test_support.hpp).
// A decomposition D is any struct with int members T, P, V, E (tp, pp, virtual stages, ep).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "deck/config.hpp"
#include "model/layout.hpp"

namespace ptrain::test {

// 4 heads, `layers` blocks (MoE: 4 experts in every second block), vocab as given.
inline Config small_model(std::int64_t vocab, bool moe, std::int64_t layers = 4,
                          std::int64_t C = 16) {
  Config c{};
  c.model.n_layer = layers;
  c.model.d_model = C;
  c.model.n_head = 4;
  c.model.vocab = vocab;
  c.model.seq_len = 8;
  c.model.ffn_mult = 2;
  c.model.n_expert = moe ? 4 : 0;
  c.model.top_k = 2;
  c.model.moe_every = 2;
  c.parallel.tp = c.parallel.pp = c.parallel.ep = c.parallel.virtual_stages = 1;
  return c;
}

struct Place {
  model::ShardCoord coord;
  int d = 0;  // replica index
};

// tp fastest, then pp, then ep, then replicas.
template <class D>
Place place(const D& g, int rank) {
  Place p;
  p.coord.tp = g.T;
  p.coord.pp = g.P;
  p.coord.ep = g.E;
  p.coord.virtual_stages = g.V;
  p.coord.t = rank % g.T;
  p.coord.p = rank / g.T % g.P;
  p.coord.e = rank / (g.T * g.P) % g.E;
  p.d = rank / (g.T * g.P * g.E);
  return p;
}

template <class D>
Config with_decomp(Config c, const D& g) {
  c.parallel.tp = g.T;
  c.parallel.pp = g.P;
  c.parallel.ep = g.E;
  c.parallel.virtual_stages = g.V;
  return c;
}

// The blocks each tensor has at a coordinate, by name.
inline std::map<std::string, std::vector<model::Slab>> blocks_at(const Config& c,
                                                                 const model::ShardCoord& at) {
  std::map<std::string, std::vector<model::Slab>> out;
  for (const auto& chunk : model::build_layout(c, at))
    for (const auto& t : chunk.tensors) out[t.name] = t.slabs;
  return out;
}

inline bool same_blocks(const std::vector<model::Slab>& a, const std::vector<model::Slab>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].start != b[i].start || a[i].count != b[i].count) return false;
  return true;
}

}  // namespace ptrain::test
