// model/layout.hpp — the model's tensors, their canonical names and global shapes, and
// which block of each a rank holds. Pure arithmetic (no MPI, no allocation): the real
// parameter buffers, the checkpoint hyperslabs and `ptrain --plan` all come from here.
//
// Canonical names and global shapes (C = d_model, F = ffn_mult*C, V = vocab, S = seq_len):
//   wte.weight              (V, C)    token embedding, tied LM head (vocab-parallel over tp)
//   wpe.weight              (S, C)    learned positions
//   h.<i>.ln_1.weight/bias  (C)
//   h.<i>.attn.qkv.weight   (3C, C)   rows: q | k | v, heads contiguous (column-parallel)
//   h.<i>.attn.qkv.bias     (3C)
//   h.<i>.attn.proj.weight  (C, C)    row-parallel: tp splits the input (second) dim
//   h.<i>.attn.proj.bias    (C)       replicated over tp, added once
//   h.<i>.ln_2.weight/bias  (C)
//   h.<i>.mlp.fc.weight     (F, C)    column-parallel    h.<i>.mlp.fc.bias (F)
//   h.<i>.mlp.proj.weight   (C, F)    row-parallel       h.<i>.mlp.proj.bias (C)
//   ln_f.weight/bias        (C)
// A MoE block replaces mlp.* by moe.router.weight (E, C) and moe.fc.weight (E, F, C),
// moe.fc.bias (E, F), moe.proj.weight (E, C, F), moe.proj.bias (E, C), experts split over ep.
// The vocabulary is padded to a multiple of tp in memory; checkpoints hold the V real rows.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "deck/config.hpp"

namespace ptrain::model {

using Shape = std::vector<std::int64_t>;

// Sizes derived from the deck.
struct Dims {
  std::int64_t L, C, NH, HS, F, V, Vpad, S;  // layers, width, heads, head size, MLP width,
                                             // vocab, padded vocab, sequence length
  std::int64_t n_expert, top_k, moe_every;
  double capacity_factor, aux_loss_coef;
  bool is_moe_layer(std::int64_t layer) const {
    return n_expert > 0 && (layer % moe_every) == moe_every - 1;
  }
};
Dims dims_of(const Config& config);

// Where a rank sits on the axes that shard the model.
struct ShardCoord {
  int t = 0, tp = 1;      // tensor-parallel rank and size
  int p = 0, pp = 1;      // pipeline stage and count
  int e = 0, ep = 1;      // expert-parallel rank and size
  int c = 0, cp = 1;      // context-parallel rank and size
  bool cp_zigzag = true;  // parallel%cp_layout: zigzag (else contiguous)
  int virtual_stages = 1;
  // The chunk placement (global_chunk below): V-shaped (pp_schedule = 'zb-v') or interleaved.
  bool v_shape = false;
  // Ranks a ZeRO shard of the dense parameters is cut over: 0 for the whole dense-grad group,
  // else (parallel%zero_scope = 'node') its ranks on one node.
  int zero_shards = 0;
};

// A run of consecutive sequence positions a context-parallel rank holds: local rows
// [local, local + len) of each sample are global positions [global, global + len).
struct SeqPiece {
  int local = 0, global = 0, len = 0;
};
// The pieces of a seq_len sequence that context-parallel rank c of C holds, in local order:
// zigzag, chunks c and 2C-1-c of 2C (every rank the same causal work); contiguous, chunk c
// of C. One piece [0, S) without context parallelism.
std::vector<SeqPiece> sequence_pieces(std::int64_t seq_len, int c, int C, bool zigzag);
// The global position of each of the rank's seq_len / C local rows.
std::vector<int> sequence_positions(const std::vector<SeqPiece>& pieces);

// A block of a global tensor: rows [start, start+count) on each dimension.
struct Slab {
  Shape start, count;
  std::int64_t numel() const;
};

enum class TensorKind { matrix, embedding, bias, norm };

struct TensorSpec {
  std::string name;         // canonical, e.g. "h.3.attn.qkv.weight"
  Shape global_shape;       // in checkpoints
  Shape local_shape;        // in this rank's flat buffer (padded vocab included)
  std::vector<Slab> slabs;  // blocks of the global tensor held here, in local order
  std::int64_t offset = 0;  // element offset in the chunk's flat buffer
  std::int64_t numel = 0;   // local elements (product of local_shape)
  TensorKind kind = TensorKind::matrix;
  bool weight_decay = true;  // matrices and embeddings; not biases or norms
  // How it is split, the one fact the gradient norm, ZeRO and the checkpoint writers read:
  // over tp along dimension tp_dim (-1: every tp rank holds the same values), vocab-parallel
  // (tp_dim 0 with padded rows), and over ep along dimension 0 (experts).
  int tp_dim = -1;
  bool vocab_parallel = false;
  bool expert = false;  // split over ep; reduced over the expert-grad group, not dense-grad
  bool tp_replicated() const { return tp_dim < 0; }
  int layer = -1;          // block index, -1 for embeddings and ln_f
  bool tied_copy = false;  // the last stage's copy of wte (pipeline): not saved twice
};

// One model chunk (pipeline stage, or one virtual stage of it): its tensors laid out
// back to back in one flat buffer, in forward order.
struct ChunkLayout {
  int chunk = 0;  // virtual stage index on this rank
  std::int64_t first_layer = 0, n_layers = 0;
  bool has_embedding = false;  // first pipeline stage: wte, wpe
  bool has_head = false;       // last pipeline stage: ln_f and the tied LM head
  std::vector<TensorSpec> tensors;
  std::int64_t numel = 0;                                 // flat buffer length
  const TensorSpec& find(const std::string& name) const;  // throws when absent
};

// Global chunk (model order: 0 holds the embedding, the last the head) of local chunk `chunk`
// of pipeline rank `rank` of P: interleaved (Megatron) chunk*P + rank; V-shaped (zb-v, two
// chunks per rank) rank and 2P-1-rank, so the first rank holds both ends.
int global_chunk(int P, bool v_shape, int rank, int chunk);
// The pipeline rank and local chunk holding global chunk g (the inverse).
struct ChunkPlace {
  int rank = 0, chunk = 0;
};
ChunkPlace chunk_place(int P, bool v_shape, int g);

// The chunks a rank holds (one unless the schedule is interleaved or V-shaped).
std::vector<ChunkLayout> build_layout(const Config& config, const ShardCoord& coord);

// Summed over a rank's chunks: its layers, how many are MoE, and whether it holds the
// embedding (first) or the head (last). What its messages' counts depend on.
struct LayerCounts {
  std::int64_t layers = 0, moe_layers = 0;
  bool first = false, last = false;
};
LayerCounts layer_counts(const Config& config, const std::vector<ChunkLayout>& chunks);

// Parameters of the whole model (global shapes, unpadded vocab, each tensor once).
std::int64_t global_parameter_count(const Config& config);
// Tensors of the whole model (a checkpoint's /model datasets).
std::int64_t global_tensor_count(const Config& config);

// Model FLOPs per trained token (forward + backward), PaLM appendix B / nanoGPT:
//   6 * N + 12 * L * C * S
// with N the parameters used in matrix products and embeddings (all but wpe; for MoE the
// top_k experts a token visits instead of all experts). Attention is counted without the
// causal halving, as in those references.
double flops_per_token(const Config& config);

}  // namespace ptrain::model

namespace ptrain::model {

// Elements of the activations one chunk keeps for the backward of one micro-batch, and of
// the backward's scratch: totals of the lists in model/activations.hpp, which the stage
// carves its buffers from. `--plan` prints them.
// Elements of the compute type, and (the *_stats fields) of its accumulate type: the
// statistics, fp32 in a bf16 run; scratch_grads of the grad type.
struct ActivationSizes {
  std::int64_t per_layer = 0;  // kept per block (BlockActs, less what recompute rebuilds)
  std::int64_t input = 0;      // the stage input (InputActs)
  std::int64_t head = 0;       // the head's (HeadActs): a pool of its own (Stage)
  std::int64_t scratch = 0;    // backward gradients of activations, reused across blocks
  std::int64_t recompute = 0;  // one block's recomputed activations (workspace)
  std::int64_t per_layer_stats = 0, head_stats = 0, recompute_stats = 0;
  std::int64_t scratch_grads = 0;  // LayerNorm parameter gradients under SP
  // One W record of a split backward (BlockWeightGrads, InputWeightGrads): values and the
  // LayerNorm sums (grad type).
  std::int64_t weight_per_layer = 0, weight_input = 0, weight_per_layer_grads = 0;
  // One micro-batch's slot, the head's apart.
  std::int64_t kept(std::int64_t n_layers) const { return per_layer * n_layers + input; }
  std::int64_t kept_stats(std::int64_t n_layers) const { return per_layer_stats * n_layers; }
  std::int64_t weight(std::int64_t n_layers) const {
    return weight_per_layer * n_layers + weight_input;
  }
  std::int64_t weight_grads(std::int64_t n_layers) const {
    return weight_per_layer_grads * n_layers;
  }
};
// How many micro-batches a chunk's activation buffers hold at once, from the schedule
// checker: `acts` from a forward until its weight gradient (W, or a whole backward), `head`
// (the head's activations, on the chunk with the head) until its input gradient, `weight`
// (W records) from a split backward's B until its W.
struct SlotCounts {
  int acts = 1, head = 1, weight = 0;
  SlotCounts(int n = 1) : acts(n), head(n) {}  // NOLINT: a count of whole-backward slots
  SlotCounts(int a, int h, int w) : acts(a), head(h), weight(w) {}
};
// Bytes of what a chunk's stage allocates in MemCategory::activations for `slots`, with
// values, statistics and gradients of w, w_stat and w_grad bytes (the plan's figure and
// the tracked allocator's agree by construction).
double activation_bytes(const ActivationSizes& a, std::int64_t n_layers, const SlotCounts& slots,
                        double w, double w_stat, double w_grad);
// B samples of T local tokens (T = seq_len / cp).
// train%recompute: what a block keeps for its backward. selective drops the LayerNorm
// outputs, the attention output and the GELU output (cheap to recompute from what is kept);
// full keeps only each block's output (the next block's input) and reruns the block's
// forward in its backward.
enum class Recompute { none, selective, full };
Recompute recompute_mode(const std::string& deck_value);

ActivationSizes activation_sizes(const Dims& d, const ShardCoord& c, std::int64_t B, std::int64_t T,
                                 bool has_head, bool sequence_parallel = false,
                                 Recompute recompute = Recompute::none, bool has_embedding = false);

}  // namespace ptrain::model

namespace ptrain::model {

// A unit is what the model touches at once: the embedding (wte, wpe), one block, or the
// head (ln_f, and on a last pipeline stage its tied wte copy). Units are contiguous,
// disjoint ranges of the chunk's flat buffer in forward order; ZeRO 3 gathers parameters
// and ZeRO 2/3 reduce gradients one unit at a time.
struct Unit {
  enum Kind { embedding, block, head } kind;
  int layer = -1;               // block index for Kind::block
  std::int64_t lo = 0, hi = 0;  // flat range
};
std::vector<Unit> units_of(const ChunkLayout& chunk);

}  // namespace ptrain::model
