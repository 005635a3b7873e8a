// deck/config.hpp — the typed, validated deck: config.model.n_layer, config.parallel.order[0], ...
// Generated from deck/schema.def, so a key exists here exactly when it exists in the deck.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ptrain {

namespace deck_types {
using INT = std::int64_t;
using REAL = double;
using BOOL = bool;
using STR = std::string;
template <class T, int Extent>
struct Field {
  using type = std::vector<T>;  // fixed-length array of Extent values
};
template <class T>
struct Field<T, 0> {
  using type = T;
};
}  // namespace deck_types

struct Config {
#define PTRAIN_NOLIMIT 0
#define PTRAIN_GROUP_BEGIN(g, doc) struct g##_group {
#define PTRAIN_KEY(g, k, TYPE, EXTENT, def, lo, hi, choices, doc) \
  deck_types::Field<deck_types::TYPE, EXTENT>::type k{};
#define PTRAIN_GROUP_END(g) \
  }                         \
  g;
#include "deck/schema.def"
#undef PTRAIN_GROUP_BEGIN
#undef PTRAIN_KEY
#undef PTRAIN_GROUP_END
#undef PTRAIN_NOLIMIT

  std::string deck_path;  // where it was read from ("<string>" for text)
  int deck_keys = -1;     // keys the deck text itself assigns (--set not counted); -1: unknown
};

}  // namespace ptrain
