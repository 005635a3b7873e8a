// deck/validate.cpp — checks across keys, after parsing. Never fixes a deck silently:
// the only thing resolved is parallel%dp = -1 (documented as "whatever is left").
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "deck/deck.hpp"
#include "deck/detail.hpp"
#include "util/error.hpp"

namespace ptrain::deck {
namespace {

using I64 = std::int64_t;

struct Checker {
  std::string file;

  [[noreturn]] void fail(const std::string& message) const {
    throw Error(detail::printable(cat(file, ": ", message)), kExitInput);
  }
  void require(bool ok, const std::string& message) const {
    if (!ok) fail(message);
  }
  // a*b for a, b >= 0 (the range checks run first), or an error naming what overflowed.
  I64 mul(I64 a, I64 b, const std::string& what) const {
    if (b != 0 && a > std::numeric_limits<I64>::max() / b)
      fail(cat(what, " overflows a 64-bit integer"));
    return a * b;
  }
};

std::string q(const std::string& s) { return format_value(s); }

// Every key's own range and choices.
void check_keys(const Checker& ck, const Config& c) {
  for (const KeySpec& spec : key_specs()) {
    for (int i = 0; i < spec.size(); ++i) {
      Value v;
      try {
        v = spec.get(c, i);
      } catch (const std::out_of_range&) {
        ck.fail(cat(spec.name(), " must have ", spec.extent, " elements"));
      }
      std::string why = detail::value_error(spec, i, v);
      if (!why.empty()) ck.fail(why);
    }
  }
}

// The grid's sizes against the world, and the axis order.
void check_grid(const Checker& ck, Config& c, int world_size) {
  auto& p = c.parallel;
  // The grid: D*T*P*C*E must be the world size.
  I64 tpce = ck.mul(ck.mul(ck.mul(p.tp, p.pp, "tp*pp"), p.cp, "tp*pp*cp"), p.ep, "tp*pp*cp*ep");
  if (p.dp == -1) {
    ck.require(world_size % tpce == 0, cat("parallel%dp = -1 needs the world size ", world_size,
                                           " to be a multiple of tp*pp*cp*ep = ", p.tp, "*", p.pp,
                                           "*", p.cp, "*", p.ep, " = ", tpce));
    p.dp = world_size / tpce;
  }
  ck.require(p.dp >= 1, cat("parallel%dp = ", p.dp, " must be >= 1 (or -1)"));
  I64 ranks = ck.mul(p.dp, tpce, "dp*tp*pp*cp*ep");
  ck.require(ranks == world_size,
             cat("parallel%dp*tp*pp*cp*ep = ", p.dp, "*", p.tp, "*", p.pp, "*", p.cp, "*", p.ep,
                 " = ", ranks, " does not match the world size ", world_size));

  // Axis order: a permutation of t,c,e,d,p.
  {
    std::vector<std::string> sorted = p.order, want = {"c", "d", "e", "p", "t"};
    std::sort(sorted.begin(), sorted.end());
    std::string shown;
    for (std::size_t i = 0; i < p.order.size(); ++i) shown += (i ? ", " : "") + q(p.order[i]);
    ck.require(sorted == want,
               cat("parallel%order = ", shown, " is not a permutation of t, c, e, d, p"));
  }
}

// Shapes tensor parallelism splits, and sizes the kernels index with 32-bit ints.
void check_sizes(const Checker& ck, const Config& c) {
  const auto& m = c.model;
  const auto& p = c.parallel;
  const auto& t = c.train;
  const auto& d = c.data;
  // Model shapes against tensor parallelism.
  ck.require(m.d_model % m.n_head == 0,
             cat("model%n_head = ", m.n_head, " does not divide model%d_model = ", m.d_model));
  ck.require(m.n_head % p.tp == 0,
             cat("parallel%tp = ", p.tp, " does not divide model%n_head = ", m.n_head));
  I64 ffn = ck.mul(m.ffn_mult, m.d_model, "model%ffn_mult*d_model");
  ck.require(ffn % p.tp == 0,
             cat("parallel%tp = ", p.tp, " does not divide the MLP width model%ffn_mult*d_model = ",
                 m.ffn_mult, "*", m.d_model, " = ", ffn));

  // Sizes: the kernels index a tensor, and MPI counts its elements, with 32-bit ints.
  const I64 int_max = std::numeric_limits<int>::max();
  const std::string int32 =
      cat(int_max, " (the kernels and MPI index one tensor with 32-bit ints)");
  ck.require(m.vocab <= int_max, cat("model%vocab = ", m.vocab, " exceeds ", int_max,
                                     " (the kernels index the vocabulary with 32-bit ints)"));
  const I64 vocab_padded = (m.vocab + p.tp - 1) / p.tp * p.tp;
  const I64 embedding = ck.mul(vocab_padded, m.d_model, "model%vocab*d_model");
  ck.require(embedding <= int_max,
             cat("model%vocab*d_model = ", vocab_padded, "*", m.d_model, " = ", embedding,
                 " elements of the token embedding exceed ", int32));
  const I64 width_mult =
      std::max<I64>(3, m.ffn_mult);  // qkv is 3*d_model wide, the MLP ffn_mult*d_model
  const I64 matrix = ck.mul(ck.mul(width_mult, m.d_model, "model%ffn_mult*d_model"), m.d_model,
                            "model%ffn_mult*d_model*d_model");
  ck.require(matrix <= int_max,
             cat("max(3, model%ffn_mult)*d_model*d_model = ", width_mult, "*", m.d_model, "*",
                 m.d_model, " = ", matrix, " elements of one weight matrix exceed ", int32));
  const I64 activations =
      ck.mul(ck.mul(t.micro_batch, m.seq_len, "train%micro_batch*model%seq_len"),
             width_mult * m.d_model, "train%micro_batch*model%seq_len*d_model");
  ck.require(activations <= int_max,
             cat("train%micro_batch*model%seq_len*max(3, model%ffn_mult)*d_model = ", t.micro_batch,
                 "*", m.seq_len, "*", width_mult, "*", m.d_model, " = ", activations,
                 " activation elements of one micro-batch exceed ", int_max,
                 " (the kernels index them with 32-bit ints)"));
  const I64 step_tokens = ck.mul(t.global_batch, m.seq_len, "train%global_batch*model%seq_len");
  ck.require(step_tokens <= int_max,
             cat("train%global_batch*model%seq_len = ", t.global_batch, "*", m.seq_len, " = ",
                 step_tokens, " tokens per step exceed ", int_max));
  const I64 val_tokens = ck.mul(d.val_samples, m.seq_len, "data%val_samples*model%seq_len");
  ck.require(val_tokens <= int_max,
             cat("data%val_samples*model%seq_len = ", d.val_samples, "*", m.seq_len, " = ",
                 val_tokens, " tokens per validation pass exceed ", int_max));
}

// How the layers split over the pipeline chunks, and the schedule's needs.
void check_pipeline(const Checker& ck, const Config& c) {
  const auto& m = c.model;
  const auto& p = c.parallel;
  // Pipeline: every stage chunk gets the same number of layers, or parallel%pp_layers says
  // how many each stage has; none are dropped, never silently uneven.
  I64 chunks = ck.mul(p.pp, p.virtual_stages, "parallel%pp*virtual_stages");
  if (!p.pp_layers.empty() && p.pp_layers[0] == -1 &&
      std::all_of(p.pp_layers.begin() + 1, p.pp_layers.end(), [](I64 n) { return n == 0; })) {
    // Balanced by the cost model (parallel/cost.hpp: balanced_split), resolved by the driver.
    ck.require(p.pp > 1,
               "parallel%pp_layers = -1 (a split balanced by cost) needs parallel%pp > 1");
    ck.require(m.n_layer >= chunks,
               cat("parallel%pp_layers = -1: model%n_layer = ", m.n_layer, " layers cannot fill ",
                   chunks, " pipeline chunks (parallel%pp*virtual_stages) with one each"));
  } else if (std::all_of(p.pp_layers.begin(), p.pp_layers.end(), [](I64 n) { return n == 0; })) {
    ck.require(m.n_layer % chunks == 0,
               cat("parallel%pp*virtual_stages = ", p.pp, "*", p.virtual_stages, " = ", chunks,
                   " does not divide model%n_layer = ", m.n_layer,
                   " (set parallel%pp_layers for an uneven split over the stages)"));
  } else {
    I64 given = 0, sum = 0;
    while (given < I64(p.pp_layers.size()) && p.pp_layers[std::size_t(given)] > 0)
      sum += p.pp_layers[std::size_t(given++)];
    const bool trailing_zeros =
        std::all_of(p.pp_layers.begin() + given, p.pp_layers.end(), [](I64 n) { return n == 0; });
    ck.require(
        trailing_zeros && given == chunks,
        cat("parallel%pp_layers must give one positive layer count per pipeline chunk "
            "(parallel%pp*virtual_stages = ",
            chunks,
            p.pp_schedule == "zb-v" ? ", in model order: stage s holds numbers s + 1 and 2*pp - s"
                                    : ", in order: chunk c of stage s is number c*pp + s + 1",
            "), got ", given, " before the first 0"));
    ck.require(!trailing_zeros || given != chunks || sum == m.n_layer,
               cat("parallel%pp_layers adds up to ", sum, " layers, model%n_layer = ", m.n_layer));
  }
  const bool v_shape = p.pp_schedule == "zb-v";
  if (p.virtual_stages > 1) {
    ck.require(
        p.pp_schedule == "interleaved" || v_shape,
        cat("parallel%virtual_stages = ", p.virtual_stages,
            " needs parallel%pp_schedule = 'interleaved' or 'zb-v' (got ", q(p.pp_schedule), ")"));
    ck.require(p.pp > 1,
               cat("parallel%virtual_stages = ", p.virtual_stages, " needs parallel%pp > 1"));
  }
  ck.require(p.pp_schedule != "interleaved" || p.virtual_stages > 1,
             "parallel%pp_schedule = 'interleaved' needs parallel%virtual_stages > 1");
  ck.require(!v_shape || p.virtual_stages == 2,
             cat("parallel%pp_schedule = 'zb-v' places two chunks per pipeline rank in a V: it "
                 "needs parallel%virtual_stages = 2 (got ",
                 p.virtual_stages, ")"));
  // The zero-bubble schedules split each block's backward into its input and weight
  // gradients; a MoE block's backward is not split.
  ck.require(!(p.pp_schedule == "zb-h1" || v_shape) || m.n_expert == 0,
             cat("parallel%pp_schedule = ", q(p.pp_schedule),
                 " splits each block's backward into input and weight gradients, which MoE "
                 "blocks (model%n_expert = ",
                 m.n_expert, ") do not do yet; use '1f1b' or 'interleaved'"));
}

// Micro-batches per rank, context and expert parallelism, sequence parallelism.
void check_batch_and_axes(const Checker& ck, const Config& c) {
  const auto& m = c.model;
  const auto& p = c.parallel;
  const auto& t = c.train;
  // Batch: every data/expert-parallel rank runs whole micro-batches.
  I64 per_step = ck.mul(ck.mul(t.micro_batch, p.dp, "micro_batch*dp"), p.ep, "micro_batch*dp*ep");
  ck.require(t.global_batch % per_step == 0,
             cat("train%micro_batch*parallel%dp*parallel%ep = ", t.micro_batch, "*", p.dp, "*",
                 p.ep, " = ", per_step, " does not divide train%global_batch = ", t.global_batch));
  if (p.pp_schedule == "interleaved" && per_step > 0 && t.global_batch % per_step == 0) {
    const I64 per_pipeline = t.global_batch / per_step;  // micro-batches per step
    ck.require(
        per_pipeline % p.pp == 0,
        cat("parallel%pp_schedule = 'interleaved' runs micro-batches in groups of parallel%pp = ",
            p.pp, ": train%global_batch/(micro_batch*dp*ep) = ", t.global_batch, "/", per_step,
            " = ", per_pipeline, " micro-batches per step is not a multiple of it"));
  }

  // Context parallel: zigzag cuts each sequence into 2*cp chunks (rank c holds c and
  // 2cp-1-c, balancing the causal work); contiguous into cp (rank c holds chunk c).
  if (p.cp > 1) {
    const bool zigzag = p.cp_layout == "zigzag";
    const I64 pieces = zigzag ? ck.mul(2, p.cp, "2*parallel%cp") : p.cp;
    ck.require(m.seq_len % pieces == 0,
               cat("parallel%cp = ", p.cp, " with parallel%cp_layout = ", q(p.cp_layout),
                   " needs model%seq_len = ", m.seq_len, " to be a multiple of ",
                   zigzag ? "2*cp = " : "cp = ", pieces,
                   zigzag ? " (rank c holds chunks c and 2cp-1-c of 2cp)"
                          : " (rank c holds chunk c of cp)"));
  }

  // Mixture of experts.
  if (m.n_expert > 0) {
    ck.require(m.n_expert % p.ep == 0,
               cat("parallel%ep = ", p.ep, " does not divide model%n_expert = ", m.n_expert));
    ck.require(m.top_k <= m.n_expert,
               cat("model%top_k = ", m.top_k, " exceeds model%n_expert = ", m.n_expert));
    ck.require(m.moe_every <= m.n_layer,
               cat("model%moe_every = ", m.moe_every, " exceeds model%n_layer = ", m.n_layer,
                   ": no block would have experts"));
    // n_expert copies of the MLP (2*ffn_mult*d_model*d_model) in each MoE block.
    const I64 mlp = ck.mul(2 * m.ffn_mult, ck.mul(m.d_model, m.d_model, "d_model^2"),
                           "the MLP's 2*ffn_mult*d_model^2 parameters");
    const I64 experts = ck.mul(m.n_expert, mlp, "model%n_expert*(the MLP's parameters)");
    ck.mul(experts, m.n_layer, "model%n_layer*n_expert*(the MLP's parameters)");
  } else {
    ck.require(p.ep == 1,
               cat("parallel%ep = ", p.ep, " needs model%n_expert > 0 (the model has no experts)"));
  }

  // Sequence parallel shards the tokens of a micro-batch over tp.
  if (p.sequence_parallel) {
    I64 tokens = ck.mul(t.micro_batch, m.seq_len / p.cp, "micro_batch*seq_len/cp");
    ck.require(tokens % p.tp == 0, cat("parallel%sequence_parallel needs parallel%tp = ", p.tp,
                                       " to divide train%micro_batch*model%seq_len/parallel%cp = ",
                                       t.micro_batch, "*", m.seq_len, "/", p.cp, " = ", tokens));
  }
}

// Data sources and the backend.
void check_data_and_backend(const Checker& ck, const Config& c) {
  const auto& m = c.model;
  const auto& d = c.data;
  // Data.
  if (d.source == "bytes")
    ck.require(m.vocab >= 256,
               cat("data%source = 'bytes' needs model%vocab >= 256 (got ", m.vocab, ")"));
  std::size_t blended = 0;
  for (std::size_t i = 0; i < d.paths.size(); ++i) {
    const bool path = !d.paths[i].empty(), weight = i < d.weights.size() && d.weights[i] > 0;
    blended += path ? 1 : 0;
    ck.require(path == weight, path ? cat("data%paths(", i + 1, ") = ", q(d.paths[i]),
                                          " needs a weight > 0 in data%weights(", i + 1, ")")
                                    : cat("data%weights(", i + 1, ") = ", d.weights[i],
                                          " has no file in data%paths(", i + 1, ")"));
  }
  if (d.source == "synthetic") {
    ck.require(blended == 0,
               "data%paths is a blend of files: it needs data%source = 'bytes', "
               "'u16' or 'indexed' (the synthetic source reads no file)");
  } else {
    ck.require(!d.path.empty() || blended > 0,
               cat("data%source = ", q(d.source),
                   " needs a file in data%path (or a blend in data%paths)"));
    ck.require(d.path.empty() || blended == 0,
               cat("data%path = ", q(d.path),
                   " and data%paths both name data: give one file in data%path, or a blend in "
                   "data%paths"));
  }

  const auto& g = c.parallel.grad_dtype;
  if (g != "auto" && g != m.dtype && !(g == "fp32" && m.dtype == "bf16"))
    ck.fail(cat("parallel%grad_dtype = ", q(g), " needs model%dtype = 'bf16' (got ", q(m.dtype),
                "); leave it 'auto' for an ", m.dtype, " model"));
  ck.require(c.train.spike_factor == 0 || c.train.spike_factor > 1,
             cat("train%spike_factor = ", c.train.spike_factor,
                 " would flag ordinary steps: use a factor above 1 (e.g. 3), or 0 for off"));
  ck.require(c.run.straggler_factor == 0 || c.run.straggler_factor >= 1,
             cat("run%straggler_factor = ", c.run.straggler_factor,
                 " would warn of every rank: the slowest is never faster than the median; use "
                 "a factor of at least 1 (e.g. 2), or 0 for no warnings"));
  if (c.parallel.zero_scope == "node") {
    ck.require(c.parallel.zero >= 1,
               cat("parallel%zero_scope = 'node' places ZeRO shards: it needs parallel%zero >= 1 "
                   "(got ",
                   c.parallel.zero, ")"));
    ck.require(c.parallel.ep == 1,
               cat("parallel%zero_scope = 'node' is not implemented with experts split over ep "
                   "(parallel%ep = ",
                   c.parallel.ep, "); use 'global'"));
  }
  if (c.parallel.wire_dtype == "bf16") {
    ck.require(
        m.dtype == "bf16",
        cat("parallel%wire_dtype = 'bf16' needs model%dtype = 'bf16' (got ", q(m.dtype), ")"));
    ck.require(c.parallel.zero >= 2,
               cat("parallel%wire_dtype = 'bf16' needs parallel%zero >= 2 (got ", c.parallel.zero,
                   "): the bf16 wire is ZeRO 2/3's reduce-scatter, summed in fp32 where it "
                   "arrives; ZeRO 0/1 all-reduce in the gradient type"));
  }
}

}  // namespace

PrecisionPolicy precision_policy(const Config& c) {
  auto parse = [](const std::string& s) {
    return s == "fp64" ? Precision::fp64 : s == "bf16" ? Precision::bf16 : Precision::fp32;
  };
  PrecisionPolicy p;
  p.compute = parse(c.model.dtype);
  p.master = p.compute == Precision::bf16 ? Precision::fp32 : p.compute;
  p.grad = c.parallel.grad_dtype == "auto" ? p.master : parse(c.parallel.grad_dtype);
  p.wire = c.parallel.wire_dtype == "bf16" ? Precision::bf16 : p.grad;
  return p;
}

void validate(Config& c, int world_size) {
  const Checker ck{c.deck_path.empty() ? std::string("<deck>") : c.deck_path};
  ck.require(world_size >= 1, cat("world size ", world_size, " must be at least 1"));
  // An empty folder makes the output paths "/log.csv", "/final.h5": the file system's root.
  ck.require(!c.run.out_dir.empty(),
             "run%out_dir = '' is empty: name a folder for the output (e.g. 'out')");
  // Blanks at either end of a folder name are invisible in the deck and in every message.
  for (const auto& [key, value] :
       {std::pair<const char*, const std::string&>{"run%out_dir", c.run.out_dir},
        {"checkpoint%dir", c.checkpoint.dir}}) {
    const bool blank = value.find_first_not_of(' ') == std::string::npos;
    ck.require(value.empty() || (!blank && value.front() != ' ' && value.back() != ' '),
               cat(key, " = ", q(value),
                   blank ? " is blank: name a folder"
                         : " begins or ends with blanks: name the folder without them"));
  }
  for (const auto& [key, rank] :
       {std::pair<const char*, I64>{"run%debug_fail_rank", c.run.debug_fail_rank},
        {"run%debug_hang_rank", c.run.debug_hang_rank},
        {"run%debug_slow_rank", c.run.debug_slow_rank},
        {"run%debug_flip_rank", c.run.debug_flip_rank}})
    ck.require(rank < world_size, cat(key, " = ", rank, " is not a rank of this run (", world_size,
                                      world_size == 1 ? " rank)" : " ranks)"));
  check_keys(ck, c);  // again: a Config may also be built in code
  check_grid(ck, c, world_size);
  check_sizes(ck, c);
  check_pipeline(ck, c);
  check_batch_and_axes(ck, c);
  check_data_and_backend(ck, c);
}

}  // namespace ptrain::deck
