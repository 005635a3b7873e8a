#include "model/layout.hpp"

#include <algorithm>

#include "model/activations.hpp"
#include "util/error.hpp"

namespace ptrain::model {

Dims dims_of(const Config& config) {
  const auto& m = config.model;
  Dims d{};
  d.L = m.n_layer;
  d.C = m.d_model;
  d.NH = m.n_head;
  d.HS = m.d_model / m.n_head;
  d.F = m.ffn_mult * m.d_model;
  d.V = m.vocab;
  const std::int64_t tp = config.parallel.tp;
  d.Vpad = (m.vocab + tp - 1) / tp * tp;
  d.S = m.seq_len;
  d.n_expert = m.n_expert;
  d.top_k = m.top_k;
  d.moe_every = m.moe_every;
  d.capacity_factor = m.capacity_factor;
  d.aux_loss_coef = m.aux_loss_coef;
  return d;
}

std::int64_t Slab::numel() const {
  std::int64_t n = 1;
  for (auto c : count) n *= c;
  return n;
}

const TensorSpec& ChunkLayout::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return t;
  throw Error(cat("model layout: no tensor '", name, "' in chunk ", chunk));
}

namespace {

// Appends tensors to a chunk, assigning flat offsets in order.
class ChunkBuilder {
 public:
  explicit ChunkBuilder(ChunkLayout& chunk) : chunk_(chunk) {}

  TensorSpec& add(std::string name, Shape global, Shape local, std::vector<Slab> slabs,
                  TensorKind kind, int layer) {
    TensorSpec t;
    t.name = std::move(name);
    t.global_shape = std::move(global);
    t.local_shape = std::move(local);
    t.slabs = std::move(slabs);
    t.kind = kind;
    t.weight_decay = kind == TensorKind::matrix || kind == TensorKind::embedding;
    t.layer = layer;
    t.numel = 1;
    for (auto n : t.local_shape) t.numel *= n;
    t.offset = chunk_.numel;
    chunk_.numel += t.numel;
    chunk_.tensors.push_back(std::move(t));
    return chunk_.tensors.back();
  }

  // A tensor every rank holds whole.
  TensorSpec& replicated(std::string name, Shape shape, TensorKind kind, int layer) {
    Slab all{Shape(shape.size(), 0), shape};
    return add(std::move(name), shape, shape, {all}, kind, layer);
  }

  // A tensor split over `parts` along dimension `dim` (this rank holds part `index`).
  TensorSpec& split(std::string name, Shape shape, int dim, std::int64_t parts, std::int64_t index,
                    TensorKind kind, int layer) {
    Shape local = shape;
    local[dim] = shape[dim] / parts;
    Slab s{Shape(shape.size(), 0), local};
    s.start[dim] = index * local[dim];
    auto& t = add(std::move(name), shape, local, {s}, kind, layer);
    t.tp_dim = dim;
    return t;
  }

 private:
  ChunkLayout& chunk_;
};

void add_embedding(ChunkBuilder& b, const Dims& d, const ShardCoord& c, bool tied_copy) {
  // Vocab-parallel: rank t holds padded rows [t*Vl, (t+1)*Vl); only the real rows
  // (< V) are part of the global tensor, the rest is padding that stays zero.
  const std::int64_t Vl = d.Vpad / c.tp;
  const std::int64_t begin = c.t * Vl;
  const std::int64_t end = std::min<std::int64_t>(begin + Vl, d.V);
  Slab rows{{begin, 0}, {std::max<std::int64_t>(0, end - begin), d.C}};
  auto& wte = b.add("wte.weight", {d.V, d.C}, {Vl, d.C}, {rows}, TensorKind::embedding, -1);
  wte.tp_dim = 0;
  wte.vocab_parallel = true;
  wte.tied_copy = tied_copy;
}

void add_block(ChunkBuilder& b, const Dims& d, const ShardCoord& c, int i) {
  const std::string h = cat("h.", i, ".");
  const std::int64_t C = d.C, F = d.F, T = c.tp, t = c.t;
  b.replicated(h + "ln_1.weight", {C}, TensorKind::norm, i);
  b.replicated(h + "ln_1.bias", {C}, TensorKind::norm, i);
  // qkv is column-parallel by heads: this rank's q, k and v rows are three blocks.
  const std::int64_t Cl = C / T;
  std::vector<Slab> w, bias;
  for (std::int64_t j = 0; j < 3; ++j) {
    w.push_back(Slab{{j * C + t * Cl, 0}, {Cl, C}});
    bias.push_back(Slab{{j * C + t * Cl}, {Cl}});
  }
  b.add(h + "attn.qkv.weight", {3 * C, C}, {3 * Cl, C}, w, TensorKind::matrix, i).tp_dim = 0;
  b.add(h + "attn.qkv.bias", {3 * C}, {3 * Cl}, bias, TensorKind::bias, i).tp_dim = 0;
  b.split(h + "attn.proj.weight", {C, C}, 1, T, t, TensorKind::matrix, i);
  b.replicated(h + "attn.proj.bias", {C}, TensorKind::bias, i);
  b.replicated(h + "ln_2.weight", {C}, TensorKind::norm, i);
  b.replicated(h + "ln_2.bias", {C}, TensorKind::norm, i);
  if (d.is_moe_layer(i)) {
    const std::int64_t E = d.n_expert, El = E / c.ep, e0 = c.e * El, Fl = F / T;
    b.replicated(h + "moe.router.weight", {E, C}, TensorKind::matrix, i);
    // Experts split over ep (dimension 0) and, like the dense MLP, over tp; proj.bias is
    // ep-split but tp-replicated (added once after the row-parallel reduction).
    auto expert = [&](std::string name, Shape global, Shape local, Slab s, TensorKind k,
                      int tp_dim) {
      auto& spec =
          b.add(std::move(name), std::move(global), std::move(local), {std::move(s)}, k, i);
      spec.expert = true;
      spec.tp_dim = tp_dim;
    };
    expert(h + "moe.fc.weight", {E, F, C}, {El, Fl, C}, Slab{{e0, t * Fl, 0}, {El, Fl, C}},
           TensorKind::matrix, 1);
    expert(h + "moe.fc.bias", {E, F}, {El, Fl}, Slab{{e0, t * Fl}, {El, Fl}}, TensorKind::bias, 1);
    expert(h + "moe.proj.weight", {E, C, F}, {El, C, Fl}, Slab{{e0, 0, t * Fl}, {El, C, Fl}},
           TensorKind::matrix, 2);
    expert(h + "moe.proj.bias", {E, C}, {El, C}, Slab{{e0, 0}, {El, C}}, TensorKind::bias, -1);
  } else {
    b.split(h + "mlp.fc.weight", {F, C}, 0, T, t, TensorKind::matrix, i);
    b.split(h + "mlp.fc.bias", {F}, 0, T, t, TensorKind::bias, i);
    b.split(h + "mlp.proj.weight", {C, F}, 1, T, t, TensorKind::matrix, i);
    b.replicated(h + "mlp.proj.bias", {C}, TensorKind::bias, i);
  }
}

}  // namespace

int global_chunk(int P, bool v_shape, int rank, int chunk) {
  if (v_shape) return chunk == 0 ? rank : 2 * P - 1 - rank;
  return chunk * P + rank;
}

ChunkPlace chunk_place(int P, bool v_shape, int g) {
  if (v_shape) return g < P ? ChunkPlace{g, 0} : ChunkPlace{2 * P - 1 - g, 1};
  return {g % P, g / P};
}

std::vector<ChunkLayout> build_layout(const Config& config, const ShardCoord& coord) {
  const Dims d = dims_of(config);
  const int n_chunks = coord.pp * coord.virtual_stages;
  // Layers of global chunk g: parallel%pp_layers when the deck splits unevenly (one count per
  // global chunk, validated), else n_layer / chunks each.
  const auto& uneven = config.parallel.pp_layers;
  const bool given =
      coord.pp == config.parallel.pp && coord.pp > 1 && !uneven.empty() && uneven[0] > 0;
  PTRAIN_REQUIRE(given || d.L % n_chunks == 0, "model layout: n_layer = ", d.L,
                 " is not divisible by pp*virtual_stages = ", n_chunks);
  auto layers_of = [&](int g) { return given ? uneven[std::size_t(g)] : d.L / n_chunks; };
  std::vector<ChunkLayout> chunks;
  for (int v = 0; v < coord.virtual_stages; ++v) {
    const int g = global_chunk(coord.pp, coord.v_shape, coord.p, v);
    ChunkLayout chunk;
    chunk.chunk = v;
    chunk.first_layer = 0;
    for (int k = 0; k < g; ++k) chunk.first_layer += layers_of(k);
    chunk.n_layers = layers_of(g);
    chunk.has_embedding = g == 0;
    chunk.has_head = g == n_chunks - 1;
    ChunkBuilder b(chunk);
    if (chunk.has_embedding) {
      add_embedding(b, d, coord, false);
      b.replicated("wpe.weight", {d.S, d.C}, TensorKind::embedding, -1);
    }
    for (std::int64_t i = chunk.first_layer; i < chunk.first_layer + chunk.n_layers; ++i)
      add_block(b, d, coord, static_cast<int>(i));
    if (chunk.has_head) {
      b.replicated("ln_f.weight", {d.C}, TensorKind::norm, -1);
      b.replicated("ln_f.bias", {d.C}, TensorKind::norm, -1);
      if (!chunk.has_embedding) add_embedding(b, d, coord, true);  // the tied LM head
    }
    chunks.push_back(std::move(chunk));
  }
  return chunks;
}

LayerCounts layer_counts(const Config& config, const std::vector<ChunkLayout>& chunks) {
  const Dims d = dims_of(config);
  LayerCounts n;
  for (const auto& ch : chunks) {
    n.layers += ch.n_layers;
    for (std::int64_t l = ch.first_layer; l < ch.first_layer + ch.n_layers; ++l)
      n.moe_layers += d.is_moe_layer(l) ? 1 : 0;
    n.first = n.first || ch.has_embedding;
    n.last = n.last || ch.has_head;
  }
  return n;
}

namespace {
// One rank holding everything: each tensor exactly once, at its global shape.
std::vector<ChunkLayout> whole_model(const Config& config) {
  Config whole = config;
  whole.parallel.tp = 1;
  return build_layout(whole, ShardCoord{});
}
}  // namespace

std::int64_t global_tensor_count(const Config& config) {
  std::int64_t n = 0;
  for (const auto& chunk : whole_model(config)) n += std::int64_t(chunk.tensors.size());
  return n;
}

std::int64_t global_parameter_count(const Config& config) {
  std::int64_t n = 0;
  for (const auto& chunk : whole_model(config))
    for (const auto& t : chunk.tensors) {
      std::int64_t g = 1;
      for (auto s : t.global_shape) g *= s;
      n += g;
    }
  return n;
}

double flops_per_token(const Config& config) {
  const Dims d = dims_of(config);
  double n = static_cast<double>(global_parameter_count(config)) - double(d.S) * d.C;
  // A token visits top_k experts of each MoE layer, not all of them.
  const double expert_params = 2.0 * d.F * d.C + d.F + d.C;
  for (std::int64_t i = 0; i < d.L; ++i)
    if (d.is_moe_layer(i)) n -= (d.n_expert - d.top_k) * expert_params;
  return 6.0 * n + 12.0 * d.L * d.C * d.S;
}

}  // namespace ptrain::model

namespace ptrain::model {

std::vector<SeqPiece> sequence_pieces(std::int64_t seq_len, int c, int C, bool zigzag) {
  PTRAIN_REQUIRE(C >= 1 && c >= 0 && c < C, "model: context-parallel rank ", c, " of ", C);
  const int chunks = zigzag && C > 1 ? 2 * C : C;
  PTRAIN_REQUIRE(seq_len % chunks == 0, "model: seq_len ", seq_len, " does not split in ", chunks,
                 " chunks");
  const int L = int(seq_len / chunks);
  if (chunks == C) return {SeqPiece{0, c * L, L}};
  return {SeqPiece{0, c * L, L}, SeqPiece{L, (2 * C - 1 - c) * L, L}};
}

std::vector<int> sequence_positions(const std::vector<SeqPiece>& pieces) {
  std::vector<int> pos;
  for (const SeqPiece& p : pieces)
    for (int i = 0; i < p.len; ++i) pos.push_back(p.global + i);
  return pos;
}

ActShape act_shape(const Dims& d, const ShardCoord& c, std::int64_t B, std::int64_t T, bool sp,
                   bool moe) {
  ActShape s;
  s.moe = moe && d.n_expert > 0;
  s.E = d.n_expert;
  s.k = d.top_k;
  s.ep = c.ep > 1;
  s.expert_rows = s.moe ? c.ep * B * T * d.top_k : 0;
  s.BT = B * T;
  s.R = sp ? s.BT / c.tp : s.BT;
  s.C = d.C;
  s.Cl = d.C / c.tp;
  s.NHl = d.NH / c.tp;
  s.Fl = d.F / c.tp;
  s.Vl = d.Vpad / c.tp;
  s.sp = sp;
  return s;
}

ActivationSizes activation_sizes(const Dims& d, const ShardCoord& c, std::int64_t B, std::int64_t T,
                                 bool has_head, bool sequence_parallel, Recompute recompute,
                                 bool has_embedding) {
  ActivationSizes a;
  for (bool moe : {false, true}) {  // room for either kind of block in every layer slot
    if (moe && d.n_expert == 0) break;
    ActShape s = act_shape(d, c, B, T, sequence_parallel, moe);
    s.recompute = recompute;
    using Block = BlockActs<std::int64_t>;
    const DescribedSizes kept = sizes_of<Block>(with_part(s, ActShape::kept)),
                         redone = sizes_of<Block>(with_part(s, ActShape::recomputed)),
                         scratch = sizes_of<Scratch<std::int64_t>>(s),
                         head = has_head ? sizes_of<HeadActs<std::int64_t>>(s) : DescribedSizes{},
                         weight = sizes_of<BlockWeightGrads<std::int64_t>>(s);
    a.per_layer = std::max(a.per_layer, kept.values);
    a.per_layer_stats = std::max(a.per_layer_stats, kept.stats);
    a.scratch = std::max(a.scratch, scratch.values);
    a.scratch_grads = std::max(a.scratch_grads, scratch.grads);
    // one block's recomputed tensors, and for a rerun forward its tp partial sums (BT, C)
    a.recompute =
        std::max(a.recompute, redone.values + (recompute == Recompute::full ? s.BT * s.C : 0));
    a.recompute_stats = std::max(a.recompute_stats, redone.stats);
    a.input = sizes_of<InputActs<std::int64_t>>(s).values;
    a.head = head.values;
    a.head_stats = head.stats;
    a.weight_per_layer = std::max(a.weight_per_layer, weight.values);
    a.weight_per_layer_grads = std::max(a.weight_per_layer_grads, weight.grads);
    a.weight_input = has_embedding ? sizes_of<InputWeightGrads<std::int64_t>>(s).values : 0;
  }
  return a;
}

double activation_bytes(const ActivationSizes& a, std::int64_t n_layers, const SlotCounts& slots,
                        double w, double w_stat, double w_grad) {
  const double acts = slots.acts, head = slots.head, weight = slots.weight;
  return (double(a.kept(n_layers)) * acts + double(a.head) * head + double(a.recompute) +
          double(a.weight(n_layers)) * weight) *
             w +
         (double(a.kept_stats(n_layers)) * acts + double(a.head_stats) * head +
          double(a.recompute_stats)) *
             w_stat +
         double(a.weight_grads(n_layers)) * weight * w_grad;
}

Recompute recompute_mode(const std::string& v) {
  if (v == "selective") return Recompute::selective;
  if (v == "full") return Recompute::full;
  PTRAIN_REQUIRE(v == "none", "model: train%recompute = '", v, "'");
  return Recompute::none;
}

}  // namespace ptrain::model

namespace ptrain::model {

std::vector<Unit> units_of(const ChunkLayout& chunk) {
  std::vector<Unit> units;
  for (const auto& t : chunk.tensors) {
    const Unit::Kind kind = t.layer >= 0 ? Unit::block
                            : (t.name == "wte.weight" && !t.tied_copy) || t.name == "wpe.weight"
                                ? Unit::embedding
                                : Unit::head;
    if (units.empty() || units.back().kind != kind || units.back().layer != t.layer)
      units.push_back(Unit{kind, t.layer, t.offset, t.offset});
    units.back().hi = t.offset + t.numel;
  }
  return units;
}

}  // namespace ptrain::model
