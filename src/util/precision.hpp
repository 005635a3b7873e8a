// util/precision.hpp — the precision policy (plain C++: the deck reads it; the element types
// it names are in util/element_types.hpp).
//
// One policy, chosen once from the deck (deck::precision_policy), says which type each kind
// of buffer has:
//   master   the optimizer's weights and AdamW moments (fp32; fp64 for the reference)
//   compute  weights as the kernels read them, and activations (bf16, fp32 or fp64)
//   grad     the gradient buffers (fp32 by default; bf16 with parallel%grad_dtype = 'bf16')
//   wire     what the data-parallel reduction sends (the grad type; bf16 accumulates in fp32
//            on the receiving side)
// fp32 and fp64 decks are the policy with every field equal.
#pragma once
#include <cstddef>

namespace ptrain {

enum class Precision { fp64, fp32, bf16 };

// "fp64", "fp32", "bf16": the deck's spelling.
inline const char* to_string(Precision p) {
  switch (p) {
    case Precision::fp64:
      return "fp64";
    case Precision::fp32:
      return "fp32";
    case Precision::bf16:
      return "bf16";
  }
  return "?";
}
inline std::size_t bytes_of(Precision p) {
  return p == Precision::fp64 ? 8 : p == Precision::fp32 ? 4 : 2;
}

struct PrecisionPolicy {
  Precision master = Precision::fp32, compute = Precision::fp32, grad = Precision::fp32,
            wire = Precision::fp32;
  // Every field the same: the single-type runs (fp32, fp64) whose results must not change.
  bool uniform() const { return master == compute && compute == grad && grad == wire; }
};

}  // namespace ptrain
