#include "parallel/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <limits>
#include <thread>

#include "kernels/kernels.hpp"
#include "util/error.hpp"
#include "util/mpi.hpp"
#include "util/profile.hpp"
#include "util/signals.hpp"
#include "util/timer.hpp"

namespace ptrain::parallel {

namespace {

model::ShardCoord shard_coord(const Config& config, const Grid& grid) {
  model::ShardCoord c;
  c.t = grid.coord(Axis::t);
  c.tp = grid.size(Axis::t);
  c.p = grid.coord(Axis::p);
  c.pp = grid.size(Axis::p);
  c.e = grid.coord(Axis::e);
  c.ep = grid.size(Axis::e);
  c.c = grid.coord(Axis::c);
  c.cp = grid.size(Axis::c);
  c.cp_zigzag = config.parallel.cp_layout == "zigzag";
  c.virtual_stages = int(config.parallel.virtual_stages);
  c.v_shape = c.pp > 1 && v_shaped(schedule_kind(config.parallel.pp_schedule));
  return c;
}

// Which elements of what the optimizer updates decay: the layout's tensors through the
// update pieces; the gaps between pieces (shard padding, zero) do not.
template <class T>
std::vector<optim::Segment> decay_segments(const DataParallel<T>& dp) {
  std::vector<optim::Segment> flat, segs;
  for (const auto& t : dp.layout().tensors)
    flat.push_back({std::size_t(t.offset), std::size_t(t.offset + t.numel), t.weight_decay});
  std::size_t at = 0;
  for (const auto& p : dp.update_pieces()) {
    if (std::size_t(p.at) > at) segs.push_back({at, std::size_t(p.at), false});
    for (auto s : optim::shard_segments(flat, std::size_t(p.lo), std::size_t(p.hi)))
      segs.push_back({s.begin + std::size_t(p.at), s.end + std::size_t(p.at), s.decay});
    at = std::size_t(p.at + p.hi - p.lo);
  }
  if (std::size_t(dp.update_size()) > at)
    segs.push_back({at, std::size_t(dp.update_size()), false});
  return segs;
}

// What make_comm may choose for a group (backend%comm = 'mpi': one MPI communicator each).
// `reduces`: a data-parallel reduction, which may go in two levels over nodes; `collective`:
// no tagged messages (the pipeline's and the cp ring's are), so NCCL can carry it inside a
// node on GPUs, one per rank (not with backend%share_gpus); `used`: it has work to do.
CommChoice choice(const Config& c, const Grid& grid, bool reduces, bool collective,
                  bool used = true) {
  if (c.backend.comm == "mpi" || !used) return {};
  return {grid.node(), reduces, collective && c.backend.device == "cuda" && !c.backend.share_gpus};
}

// Sums of checksums mod 2^64 over `group`, in place (a Comm has no unsigned type): the 32-bit
// halves summed as int64 (exact below 2^31 ranks), then put back together.
void sum_checksums(Comm& group, std::vector<std::uint64_t>& v) {
  std::vector<std::int64_t> halves(2 * v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    halves[2 * i] = std::int64_t(v[i] & 0xffffffffULL);
    halves[2 * i + 1] = std::int64_t(v[i] >> 32);
  }
  group.all_reduce_sum(halves.data(), halves.size(), Space::host).wait();
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = std::uint64_t(halves[2 * i]) + (std::uint64_t(halves[2 * i + 1]) << 32);
}

// The first index at which the members of `group` hold different values, or v.size(): one
// all-reduce of the maxima of the values and of their complements (max ~x = ~min x).
std::size_t first_difference(Comm& group, const std::vector<std::uint64_t>& v) {
  std::vector<std::int64_t> x(2 * v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    x[2 * i] = std::int64_t(v[i]);
    x[2 * i + 1] = ~std::int64_t(v[i]);
  }
  group.all_reduce_max(x.data(), x.size(), Space::host).wait();
  for (std::size_t i = 0; i < v.size(); ++i)
    if (x[2 * i] != ~x[2 * i + 1]) return i;
  return v.size();
}

// "rank 3", "ranks 0, 2 and 5", with `hosts` "rank 3 (host a)", "ranks 2 and 3 (hosts a, b)";
// at most 8 named.
std::string name_ranks(const std::vector<int>& ranks, const std::vector<std::string>* hosts) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ", on;
  const std::size_t named = std::min<std::size_t>(ranks.size(), 8);
  for (std::size_t i = 0; i < named; ++i) {
    out += cat(i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ", ranks[i]);
    if (hosts) on += cat(i == 0 ? "" : ", ", (*hosts)[std::size_t(ranks[i])]);
  }
  if (named < ranks.size()) out += cat(" and ", ranks.size() - named, " more");
  if (hosts) out += cat(ranks.size() == 1 ? " (host " : " (hosts ", on, ")");
  return out;
}

// The members of `group` hold different checksums of `tensor`: who holds which, by a vote over
// every member's value. Collective over the group; the same text on every member.
std::string replica_difference(Comm& group, std::uint64_t value, int world_rank,
                               const std::vector<std::string>& hosts, const std::string& tensor,
                               const std::string& who) {
  const int n = group.size();
  const std::int64_t mine[2] = {std::int64_t(value), world_rank};
  std::vector<std::int64_t> all(std::size_t(2 * n));
  group.all_gather(mine, all.data(), std::vector<int>(std::size_t(n), 2), Space::host).wait();
  // The ranks holding each value, values in order of their lowest rank.
  std::vector<std::pair<std::int64_t, std::vector<int>>> holders;
  for (int q = 0; q < n; ++q) {
    const std::int64_t x = all[std::size_t(2 * q)];
    auto it =
        std::find_if(holders.begin(), holders.end(), [x](const auto& h) { return h.first == x; });
    if (it == holders.end()) it = holders.emplace(holders.end(), x, std::vector<int>());
    it->second.push_back(int(all[std::size_t(2 * q + 1)]));
  }
  for (auto& h : holders) std::sort(h.second.begin(), h.second.end());
  std::sort(holders.begin(), holders.end(),
            [](const auto& a, const auto& b) { return a.second.front() < b.second.front(); });
  const auto most = std::max_element(
      holders.begin(), holders.end(),
      [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
  if (2 * most->second.size() > std::size_t(n)) {
    std::vector<int> odd;
    for (const auto& h : holders)
      if (&h != &*most) odd.insert(odd.end(), h.second.begin(), h.second.end());
    std::sort(odd.begin(), odd.end());
    return cat(tensor, " on ", name_ranks(odd, &hosts), " differs from ",
               name_ranks(most->second, nullptr), " (", who, ")");
  }
  std::string sets;
  for (std::size_t i = 0; i < holders.size(); ++i)
    sets += cat(i == 0                    ? ""
                : i + 1 == holders.size() ? " and "
                                          : ", ",
                name_ranks(holders[i].second, &hosts));
  return cat(tensor, " differs between ", sets, " (", who, "; no majority says which is wrong)");
}

}  // namespace

void check_supported(const Config& c) {
  // What this build can run, not what the deck means: `--plan` plans a GPU deck anywhere.
  // backend%device is 'cpu' or 'cuda' (the deck's choices).
#ifdef PTRAIN_ENABLE_CUDA
  // A CUDA Kokkos puts every tensor on the GPU: this build trains there or not at all.
  if (c.backend.device != "cuda")
    throw Error(cat("backend%device = '", c.backend.device,
                    "': this ptrain was built without the CPU backend (-DPTRAIN_ENABLE_CUDA=ON "
                    "trains on GPUs only); set backend%device = 'cuda', or use a CPU build"),
                kExitInput);
  if (c.backend.kernels == "host")
    throw Error(
        "backend%kernels = 'host': this ptrain was built without the host kernel shapes "
        "(-DPTRAIN_ENABLE_CUDA=ON); use 'auto' or 'device'",
        kExitInput);
#else
  if (c.backend.device == "cuda")
    throw Error(
        "backend%device = 'cuda': this ptrain was built without CUDA (configure with "
        "-DPTRAIN_ENABLE_CUDA=ON)",
        kExitInput);
#endif
}

template <class P>
std::string Trainer<P>::transports() const {
  std::string out;
  Comm* experts = config_.model.n_expert > 0 ? expert_grad_.get() : nullptr;
  for (const Comm* c : {dense_grad_.get(), dense_grad_shards_.get(), dense_grad_replicas_.get(),
                        tp_.get(), pp_.get(), cp_.get(), ep_.get(), experts, ends_.get()})
    if (c && c->size() > 1) out += cat(out.empty() ? "" : ", ", c->name(), " ", c->describe());
  return out.empty() ? "no group of more than one rank" : out;
}

template <class P>
Trainer<P>::Trainer(const Config& config, const Grid& grid)
    : config_(config),
      grid_(grid),
      dense_grad_(make_comm(grid.comm(GroupKind::dense_grad), "dense-grad",
                            choice(config, grid, true, true))),
      tp_(make_comm(grid.comm(GroupKind::tp), "tp", choice(config, grid, false, true))),
      pp_(make_comm(grid.comm(GroupKind::pp), "pp")),
      cp_(make_comm(grid.comm(GroupKind::cp), "cp")),
      ep_(make_comm(grid.comm(GroupKind::ep), "ep",
                    choice(config, grid, false, true, config.model.n_expert > 0))),
      expert_grad_(make_comm(grid.comm(GroupKind::expert_grad), "expert-grad",
                             choice(config, grid, true, true, config.model.n_expert > 0))),
      stats_(make_comm(grid.cart(), "stats")),
      stage_stats_(make_comm(grid.comm(GroupKind::pp), "stats")),
      data_(data::open_source(data::spec_from_config(config), grid.cart())),
      lr_schedule_(optim::schedule_from_config(config)) {
  const model::ShardCoord coord = shard_coord(config, grid);
  const int stages = coord.pp, v = coord.virtual_stages, mb = int(config.train.micro_batch);
  // Micro-batches per step: the deck makes every batch rank's slice a multiple of mb.
  micro_batches_ = int(my_slice(config.train.global_batch).second / mb);
  const int m = micro_batches_;
  const ScheduleKind kind =
      stages == 1 ? ScheduleKind::one_f_one_b : schedule_kind(config.parallel.pp_schedule);
  schedule_ = make_schedule(kind, stages, m, v);
  pipeline_shape_ = pipeline_of(kind, stages, m, v);
  const ScheduleCheck check =
      check_schedule(schedule_, pipeline_shape_, memory_bound(kind, stages, m, v));
  PTRAIN_REQUIRE(check.error.empty(), "pipeline schedule: ", check.error);

  NodeScope node_scope;
  if (config.parallel.zero_scope == "node" && dense_grad_->size() > 1) {
    dense_grad_levels_ = node_levels(grid.comm(GroupKind::dense_grad), "dense-grad", grid.node(),
                                     "parallel%zero_scope = 'node'");
    if (dense_grad_levels_.nodes > 1) {
      dense_grad_shards_ = make_comm(dense_grad_levels_.node.get(), "dense-grad-intra",
                                     choice(config, grid, false, true));
      dense_grad_replicas_ = make_comm(dense_grad_levels_.across.get(), "dense-grad-inter");
      node_scope = {dense_grad_shards_.get(), dense_grad_replicas_.get()};
    }
  }
  std::vector<typename PipelineExecutor<P>::Chunk> executed;
  for (const model::ChunkLayout& layout : model::build_layout(config, coord)) {
    Chunk ch;
    ch.dp = std::make_unique<DataParallel<P>>(config, *dense_grad_, layout, tp_.get(),
                                              expert_grad_.get(), node_scope);
    // Activation slots, head slots and W records: the most micro-batches this chunk has in
    // flight in the schedule.
    const model::SlotCounts n = check.in_flight[std::size_t(coord.p)][std::size_t(layout.chunk)];
    const model::SlotCounts slots(std::max(1, n.acts), std::max(1, n.head), n.weight);
    ch.stage = std::make_unique<model::Stage<P>>(config, coord, ch.dp->layout(), mb, slots,
                                                 ch.dp->store(), tp_.get(), cp_.get(), ep_.get());
    ch.optimizer = optim::make_optimizer<M>(config.train.optimizer, decay_segments(*ch.dp), 0,
                                            std::size_t(ch.dp->update_size()),
                                            optim::hyper_from_config(config));
    executed.push_back({ch.stage.get(), ch.dp.get()});
    chunks_.push_back(std::move(ch));
  }
  pipeline_ = std::make_unique<PipelineExecutor<P>>(
      *pp_, std::move(executed), schedule_[std::size_t(coord.p)], mb, coord.v_shape);
  // wte lives on the first stage and, tied to the LM head, on the last: both ends' dense-grad
  // groups with this tp rank (the grid's embed group) sum its gradient. In a V both ends are
  // the first stage's two chunks: its dense-grad group sums both chunks' shards.
  if (coord.v_shape && coord.p == 0)
    ends_ = make_comm(grid.comm(GroupKind::dense_grad), "embed", choice(config, grid, false, true));
  else if (!coord.v_shape && stages > 1 && grid.in_group(GroupKind::embed))
    ends_ = make_comm(grid.comm(GroupKind::embed), "embed", choice(config, grid, false, true));
  // This rank's positions of every sample (all of them without context parallelism).
  if (coord.cp > 1)
    positions_ = model::sequence_positions(
        model::sequence_pieces(config.model.seq_len, coord.c, coord.cp, coord.cp_zigzag));
  const std::size_t n = std::size_t(config.train.micro_batch * config.model.seq_len / coord.cp);
  inputs_.resize(n);
  targets_.resize(n);
  position_ = data::position_after(*data_, 0);
  hosts_ = mpi::all_gather(grid.cart(), mpi::host_name());
  if (config.run.debug_slow_rank == grid.world_rank()) pipeline_->slow_down(9);
  plan_replica_checks();
}

template <class P>
std::vector<model::ChunkLayout> Trainer<P>::layouts() const {
  std::vector<model::ChunkLayout> out;
  for (const auto& ch : chunks_) out.push_back(ch.stage->layout());
  return out;
}

template <class P>
std::pair<std::int64_t, std::int64_t> Trainer<P>::my_slice(std::int64_t n) const {
  const std::int64_t ranks = grid_.group_size(GroupKind::batch),
                     r = grid_.group_rank(GroupKind::batch);
  const std::int64_t per = n / ranks, extra = n % ranks;
  const std::int64_t first = r * per + std::min(r, extra);
  return {first, per + (r < extra ? 1 : 0)};
}

template <class P>
model::MicroBatch Trainer<P>::fetch(data::Split split, const data::Draw* draws, int B) {
  profile::region("data", [&] {
    data::fetch(*data_, split, draws, B, inputs_.data(), targets_.data(), positions_);
  });
  return model::MicroBatch{inputs_.data(), targets_.data(), B};
}

template <class P>
void Trainer<P>::finish_gradients() {
  for (auto& ch : chunks_) ch.dp->finish_gradients();
  if (ends_ && pipeline_shape_.v_shape)  // both ends here: chunk 0 (embedding), 1 (head)
    chunks_[0].dp->sum_tied_embedding(*ends_, chunks_[1].dp.get());
  else if (ends_)
    for (auto& ch : chunks_) ch.dp->sum_tied_embedding(*ends_);
}

template <class P>
std::pair<double, double> Trainer<P>::loss_and_norm_squared(double loss_sum) {
  // The loss comes from the last stage, the same on every tp rank: counted once, from tp
  // rank 0. Each rank's share of the norm covers what it owns (DataParallel).
  double v[2] = {grid_.coord(Axis::t) == 0 ? loss_sum : 0.0, 0.0};
  profile::region("grad-norm", [&] {
    for (auto& ch : chunks_) v[1] += ch.dp->owned_grad_sum_of_squares();
  });
  stats_->all_reduce_sum_now(v, 2);
  return {v[0], v[1]};
}

// The MoE layers' step, over every rank: the load-balancing loss (mean over the global
// batch's micro-batches, summed over layers), the share of token choices dropped, the
// least and most loaded expert of any layer relative to that layer's mean load, and each
// layer's loads.
template <class P>
void Trainer<P>::moe_summary(StepResult& r) {
  const std::int64_t L = config_.model.n_layer, E = config_.model.n_expert;
  const std::size_t row = std::size_t(E + 3);  // aux, dropped, choices, load[E]
  std::vector<double> v(std::size_t(L) * row, 0.0);
  // Every tp rank routes the same tokens (count them once); cp ranks hold different tokens
  // of the same micro-batches, whose aux loss they share (count it once).
  const bool count = grid_.coord(Axis::t) == 0, count_aux = count && grid_.coord(Axis::c) == 0;
  for (auto& ch : chunks_) {
    const std::vector<typename model::Stage<P>::MoeStats> stats = ch.stage->take_moe_stats();
    for (std::size_t l = 0; l < stats.size(); ++l) {
      double* x = v.data() + std::size_t(ch.stage->layout().first_layer + std::int64_t(l)) * row;
      if (!count || stats[l].load.empty()) continue;
      x[0] += count_aux ? stats[l].aux : 0.0;
      x[1] += double(stats[l].dropped);
      x[2] += double(stats[l].choices);
      for (std::size_t e = 0; e < stats[l].load.size(); ++e) x[3 + e] += double(stats[l].load[e]);
    }
  }
  stats_->all_reduce_sum_now(v.data(), int(v.size()));
  double aux = 0, dropped = 0, choices = 0, lo = 0, hi = 0;
  bool first = true;
  for (std::int64_t l = 0; l < L; ++l) {
    const double* x = v.data() + std::size_t(l) * row;
    if (x[2] == 0) continue;  // a dense block
    aux += x[0], dropped += x[1], choices += x[2];
    double kept = 0;
    StepResult::MoeLayer layer{l, x[3], 0, x[3], x[1] / x[2]};
    for (std::int64_t e = 0; e < E; ++e) {
      kept += x[3 + e];
      layer.min = std::min(layer.min, x[3 + e]), layer.max = std::max(layer.max, x[3 + e]);
    }
    const double mean = kept / double(E);
    layer.mean = mean;
    r.moe_layers.push_back(layer);
    if (mean > 0) {
      lo = first ? layer.min / mean : std::min(lo, layer.min / mean);
      hi = first ? layer.max / mean : std::max(hi, layer.max / mean);
      first = false;
    }
  }
  r.aux_loss = aux * double(config_.train.micro_batch) / double(config_.train.global_batch);
  r.moe_dropped = choices > 0 ? dropped / choices : 0;
  r.moe_load_min = lo, r.moe_load_max = hi;
}

// The measured bubble, and what the schedule gives with this step's measured time of every
// forward and backward on every stage (stages are never quite equal, nor are the ops of
// one stage on a shared machine), both as the largest rank's waits for pipeline messages
// over the step time.
template <class P>
void Trainer<P>::measure_bubble(StepResult& r) {
  const std::vector<double>& mine = pipeline_->compute_op_seconds();
  // Each rank's computes: forwards, backwards, Bs and Ws of its list.
  std::vector<int> computes;
  for (const OpList& list : schedule_)
    computes.push_back(int(
        std::count_if(list.begin(), list.end(), [](const Op& op) { return is_compute(op.kind); })));
  const int expected = computes[std::size_t(pp_->rank())];
  PTRAIN_REQUIRE(int(mine.size()) == expected, "pipeline: ", mine.size(),
                 " compute times this step, expected ", expected);
  std::vector<double> all;
  for (int n : computes) all.resize(all.size() + std::size_t(n));
  stage_stats_->all_gather(mine.data(), all.data(), computes, Space::host).wait();
  std::vector<std::vector<double>> seconds;
  std::ptrdiff_t at = 0;
  for (int n : computes) {
    seconds.emplace_back(all.begin() + at, all.begin() + at + n);
    at += n;
  }
  const ScheduleTiming sim = simulate_schedule(schedule_, pipeline_shape_, seconds);
  // Waits before each rank's last compute, as the executor measures them (a rank that
  // finishes early spends the tail in the next collective).
  double waiting = 0;
  for (double w : sim.waiting) waiting = std::max(waiting, w);
  double b[2] = {pipeline_->input_wait_seconds() / r.t_step, waiting / r.t_step};
  stats_->all_reduce_max(b, 2, Space::host).wait();
  r.bubble = b[0];
  r.bubble_model = b[1];
}

template <class P>
StepResult Trainer<P>::step(std::int64_t s) {
  StepResult r;
  r.step = s;
  const double t0 = wall_seconds();
  const std::int64_t S = config_.model.seq_len, mb = config_.train.micro_batch;
  r.tokens = config_.train.global_batch * S;
  const A dloss = A(1.0 / double(r.tokens));  // d(mean loss) / d(token loss)

  if (s == 1 && config_.run.debug_hang_rank == grid_.world_rank())
    std::this_thread::sleep_for(std::chrono::seconds(3600));  // the watchdog's test
  for (auto& ch : chunks_) ch.dp->begin_step();
  // The whole global batch is drawn on every rank (a blend's choices depend on every sample
  // before), so the position moves alike everywhere.
  profile::region("data",
                  [&] { draws_ = data::take(*data_, position_, s, config_.train.global_batch); });
  for (int d = 0; d < data_->datasets() && data_->windows(d) > 0; ++d)
    r.epochs.push_back(double(position_.per_dataset[std::size_t(d)]) / double(data_->windows(d)));
  const auto [first, count] = my_slice(config_.train.global_batch);
  MicroBatches mbs;
  mbs.count = int(count / mb);
  mbs.samples = [mb](int) { return int(mb); };
  mbs.fetch = [&, first = first](int i) {
    return fetch(data::Split::train, draws_.data() + first + i * mb, int(mb));
  };
  const double loss_sum = pipeline_->train(mbs, dloss);
  if (config_.run.debug_fail_rank == grid_.world_rank())
    throw Error(cat("run%debug_fail_rank: rank ", grid_.world_rank(),
                    " fails on purpose after the backward of step ", s));
  const auto computed = pipeline_->take_compute_seconds();
  r.t_forward = computed.forward, r.t_backward = computed.backward;
  if (config_.model.n_expert > 0) moe_summary(r);
  profile::region("grad-sync", [&] { finish_gradients(); });

  Stopwatch opt;
  opt.start();
  const double blocked = exposed_seconds();  // the norm's all-reduce, ZeRO's parameter gather
  if (s == config_.run.debug_nan_step && grid_.world_rank() == 0)
    Kokkos::deep_copy(Kokkos::subview(data_parallel(0).update_grads(), 0),
                      G(std::numeric_limits<float>::quiet_NaN()));
  const auto [loss, norm_squared] = loss_and_norm_squared(loss_sum);
  r.loss = loss / double(r.tokens);
  r.grad_norm = std::sqrt(norm_squared);
  r.lr = lr_schedule_.at(s);
  // Loss and norm are the same on every rank, so every rank takes the same decision.
  const bool finite = std::isfinite(r.loss) && std::isfinite(r.grad_norm);
  const double median = finite ? recent_median() : 0;
  if (!finite || (median > 0 && r.loss > config_.train.spike_factor * median)) {
    skip_nonfinite(r, finite ? median : 0);
  } else {
    consecutive_skips_ = 0;
    recent_losses_.push_back(r.loss);
    if (recent_losses_.size() > kRecentSteps) recent_losses_.pop_front();
    const double factor = optim::clip_factor(r.grad_norm, config_.train.clip);
    for (auto& ch : chunks_) {
      // Clipping scales the gradients inside the update: one pass over them, not two.
      profile::region("optimizer", [&] {
        ch.optimizer->step(ch.dp->update_params(), ch.dp->update_grads(), r.lr, factor);
      });
      profile::region("param-gather", [&] { ch.dp->finish_step(); });
    }
  }
  if (s == config_.run.debug_flip_step && config_.run.debug_flip_rank == grid_.world_rank())
    chunks_.back().dp->flip_weight_bit();  // the replica check's test: a silent corruption
  Kokkos::fence();
  opt.stop();
  r.comm_overlap = 1;
  for (auto& ch : chunks_) r.comm_overlap = std::min(r.comm_overlap, ch.dp->overlap_fraction());
  r.t_optimizer = opt.total();
  r.t_step = wall_seconds() - t0;
  r.compute_forward = computed.forward - computed.forward_blocked;
  r.compute_backward = computed.backward - computed.backward_blocked;
  r.compute_optimizer = r.t_optimizer - (exposed_seconds() - blocked);
  if (ran_a_step_) {  // the first step pays for first touch, unevenly: not compared
    computed_[0] += r.compute_forward;
    computed_[1] += r.compute_backward;
    computed_[2] += r.compute_optimizer;
    computed_[3] += r.t_step;
    ++computed_steps_;
  }
  ran_a_step_ = true;
  if (pp_->size() > 1) measure_bubble(r);
  // Decided by the step number, so every rank takes part in the same steps.
  if (s % config_.run.log_every == 0 || s == config_.run.steps) report_stragglers(r);
  return r;
}

// Every rank's compute per phase since the last report, each compared with the median of the
// ranks holding its pipeline stage (the same work; a pipeline's uneven stages show in the
// bubble instead).
template <class P>
void Trainer<P>::report_stragglers(StepResult& r) {
  const int world = grid_.world_size(), stages = grid_.size(Axis::p);
  // No steps since the last report (the first step alone): the same on every rank.
  if (computed_steps_ == 0) return;
  const double steps = double(computed_steps_);
  const double mine[4] = {computed_[0] / steps, computed_[1] / steps, computed_[2] / steps,
                          double(grid_.coord(Axis::p))};
  const double step_seconds = computed_[3] / steps;
  std::fill(std::begin(computed_), std::end(computed_), 0.0);
  computed_steps_ = 0;
  if (world == stages) return;  // one rank per stage: no rank to compare with
  std::vector<double> all(std::size_t(4 * world));
  stats_->all_gather(mine, all.data(), std::vector<int>(std::size_t(world), 4), Space::host).wait();
  static const char* const kPhases[3] = {"forward", "backward", "optimizer"};
  for (int k = 0; k < 3; ++k) {
    std::vector<std::vector<double>> by_stage(static_cast<std::size_t>(stages));
    for (int q = 0; q < world; ++q)
      by_stage[std::size_t(all[std::size_t(4 * q + 3)])].push_back(all[std::size_t(4 * q + k)]);
    std::vector<double> median(std::size_t(stages), 0.0);
    for (int p = 0; p < stages; ++p) {
      auto& v = by_stage[std::size_t(p)];
      std::nth_element(v.begin(), v.begin() + std::ptrdiff_t((v.size() - 1) / 2), v.end());
      median[std::size_t(p)] = v[(v.size() - 1) / 2];
    }
    StepResult::Straggler w;
    w.phase = kPhases[k];
    w.ratio = -1;
    for (int q = 0; q < world; ++q) {
      const double x = all[std::size_t(4 * q + k)],
                   m = median[std::size_t(all[std::size_t(4 * q + 3)])];
      const double ratio = m > 0 ? x / m : 1.0;
      if (ratio > w.ratio) w = {kPhases[k], q, hosts_[std::size_t(q)], x, m, ratio, step_seconds};
    }
    r.stragglers.push_back(w);
  }
}

// What is a replica of what (run%consistency_every). ZeRO 0-2 keep the whole compute weights
// on every rank (ZeRO 1/2 after the parameter gather): dense tensors are copies over the
// dense-grad group, expert tensors over the expert-grad group when ep splits them. ZeRO 3
// keeps one shard per rank, so the data-parallel ranks hold no copies of each other, except
// with zero_scope = 'node', whose node groups each hold a whole sharded copy (compared across
// the nodes). Under any stage tp-replicated tensors are copies over tp, and wte on the first
// pipeline stage and its tied copy on the last are copies over the embed group; under ZeRO 3
// the checksums of a copy are summed over the group that shards it before they are compared.
template <class P>
void Trainer<P>::plan_replica_checks() {
  if (config_.run.consistency_every == 0) return;
  const bool zero3 = config_.parallel.zero == 3, split = grid_.size(Axis::e) > 1;
  const std::string sharded = zero3 ? "; under ZeRO 3 a rank stands for the copy its data-parallel "
                                      "group shards"
                                    : "";
  // copies: each member stands for the copy its data-parallel group shards (ZeRO 3 over tp and
  // the ends, whose shards need not line up); else members hold the same part of a tensor.
  // Each host-space Comm is named after its group (`kind`), so the watchdog's sequence numbers
  // stay alike on every member of a kind (the ends' group has no middle stages).
  auto group = [&](MPI_Comm comm, const char* kind, std::string who, bool copies, auto&& compared) {
    Replicas g{make_comm(comm, kind), std::move(who), {}, copies};
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      const auto& tensors = chunks_[c].dp->layout().tensors;
      for (std::size_t i = 0; i < tensors.size(); ++i)
        if (compared(tensors[i])) g.tensors.emplace_back(int(c), int(i));
    }
    // Every member lists the same tensors: they hold the same chunks' layouts.
    if (g.comm->size() > 1 && !g.tensors.empty()) replicas_.push_back(std::move(g));
  };
  using Spec = model::TensorSpec;
  if (!zero3) {
    group(grid_.comm(GroupKind::dense_grad), "dense-grad", "data-parallel replicas", false,
          [&](const Spec& t) { return !(split && t.expert); });
    if (split)
      group(grid_.comm(GroupKind::expert_grad), "expert-grad", "expert data-parallel replicas",
            false, [](const Spec& t) { return t.expert; });
  } else if (dense_grad_replicas_) {  // every node cuts its copy alike
    group(dense_grad_levels_.across.get(), "dense-grad-inter",
          "replicas on other nodes, parallel%zero_scope = 'node'", false,
          [](const Spec&) { return true; });
  }
  group(grid_.comm(GroupKind::tp), "tp", "tp ranks" + sharded, zero3,
        [](const Spec& t) { return t.tp_replicated(); });
  // In a V both copies are on the first stage (check_replicas compares them there).
  if (ends_ && !pipeline_shape_.v_shape)
    group(grid_.comm(GroupKind::embed), "embed",
          "wte and its tied copy on the last pipeline stage" + sharded, zero3,
          [](const Spec& t) { return t.name == "wte.weight"; });
  if (zero3) {
    copy_dense_ = dense_grad_shards_ ? make_comm(dense_grad_levels_.node.get(), "dense-grad-intra")
                                     : make_comm(grid_.comm(GroupKind::dense_grad), "dense-grad");
    if (split) copy_experts_ = make_comm(grid_.comm(GroupKind::expert_grad), "expert-grad");
  }
}

template <class P>
void Trainer<P>::check_replicas(std::int64_t step) {
  if (config_.run.consistency_every == 0 || step == checked_step_) return;
  checked_step_ = step;
  std::string error;
  profile::region("consistency", [&] {
    std::vector<std::vector<std::uint64_t>> held, sums;
    for (auto& ch : chunks_) held.push_back(ch.dp->weight_checksums());
    sums = held;
    if (copy_dense_) {  // ZeRO 3: each copy's checksums, summed over its shards
      const bool split = copy_experts_ != nullptr;
      for (const bool experts : {false, true}) {
        if (experts && !split) break;
        std::vector<std::uint64_t> v;
        for (std::size_t c = 0; c < chunks_.size(); ++c)
          for (std::size_t i = 0; i < sums[c].size(); ++i)
            if ((split && chunks_[c].dp->layout().tensors[i].expert) == experts)
              v.push_back(sums[c][i]);
        sum_checksums(experts ? *copy_experts_ : *copy_dense_, v);
        std::size_t k = 0;
        for (std::size_t c = 0; c < chunks_.size(); ++c)
          for (std::size_t i = 0; i < sums[c].size(); ++i)
            if ((split && chunks_[c].dp->layout().tensors[i].expert) == experts)
              sums[c][i] = v[k++];
      }
    }
    // zb-v: wte and its tied copy are this rank's two chunks (whole copies: summed over their
    // shards under ZeRO 3). No collective: nothing to keep in step.
    if (ends_ && pipeline_shape_.v_shape) {
      std::uint64_t wte[2] = {0, 0};
      for (std::size_t c = 0; c < 2; ++c) {
        const auto& tensors = chunks_[c].dp->layout().tensors;
        for (std::size_t i = 0; i < tensors.size(); ++i)
          if (tensors[i].name == "wte.weight") wte[c] = (copy_dense_ ? sums : held)[c][i];
      }
      if (wte[0] != wte[1])
        error = cat("step ", step, ": replicas differ: wte.weight on rank ", grid_.world_rank(),
                    " (host ", hosts_[std::size_t(grid_.world_rank())],
                    ") differs from its tied copy on the same rank (the V's two ends)",
                    ", found by run%consistency_every; no checkpoint was written from this state");
    }
    // Every group is compared on every member, so the collectives match whatever is found.
    for (Replicas& g : replicas_) {
      std::vector<std::uint64_t> v;
      for (const auto& [c, i] : g.tensors)
        v.push_back((g.copies ? sums : held)[std::size_t(c)][std::size_t(i)]);
      const std::size_t k = first_difference(*g.comm, v);
      if (k == v.size()) continue;
      const auto [c, i] = g.tensors[k];
      const std::string what = replica_difference(
          *g.comm, v[k], grid_.world_rank(), hosts_,
          chunks_[std::size_t(c)].dp->layout().tensors[std::size_t(i)].name, g.who);
      if (error.empty())
        error = cat("step ", step, ": replicas differ: ", what,
                    ", found by run%consistency_every; no checkpoint was written from this state");
    }
  });
  // The lowest rank that found a difference tells every rank (maxima of negatives).
  int lowest = error.empty() ? std::numeric_limits<int>::min() : -grid_.world_rank();
  stats_->all_reduce_max(&lowest, 1, Space::host).wait();
  if (lowest == std::numeric_limits<int>::min()) return;
  throw Error(mpi::broadcast(grid_.cart(), -lowest, error), kExitRuntime, ErrorScope::all_ranks);
}

template <class P>
double Trainer<P>::recent_median() const {
  if (config_.train.spike_factor <= 0 || recent_losses_.size() < kLeastSteps) return 0;
  std::vector<double> v(recent_losses_.begin(), recent_losses_.end());
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// train%nonfinite: 'skip' drops the step's update (no parameter or optimizer state changes)
// until max_skips in a row; 'stop' (or too many skips) ends the run on every rank alike,
// naming the first tensor with a non-finite gradient and its rank (or, for a loss spike, the
// median it exceeded), before any checkpoint could be written from that state.
template <class P>
void Trainer<P>::skip_nonfinite(StepResult& r, double spike_median) {
  const bool skip = config_.train.nonfinite == "skip";
  if (skip && ++consecutive_skips_ <= config_.train.max_skips) {
    r.skipped = true;
    return;
  }
  const std::string how = skip ? cat(" (", config_.train.max_skips, " steps skipped in a row)")
                               : std::string(" (train%nonfinite = 'stop')");
  const std::string advice =
      skip ? std::string(", or raise train%max_skips")
           : std::string(", or set train%nonfinite = 'skip' to drop such steps");
  if (spike_median > 0)
    throw Error(cat("step ", r.step, ": loss ", r.loss, " is above train%spike_factor = ",
                    config_.train.spike_factor, " times the median ", spike_median, " of the last ",
                    recent_losses_.size(), " steps (gradient norm ", r.grad_norm, ")", how,
                    ". No checkpoint was written from this state; lower train%lr", advice),
                kExitRuntime, ErrorScope::all_ranks);
  // The first non-finite gradient in model order: chunk by global chunk, tensor by tensor.
  int key = std::numeric_limits<int>::max();
  std::string name;
  for (std::size_t c = chunks_.size(); c-- > 0;) {
    const int i = chunks_[c].dp->first_nonfinite_grad();
    if (i < 0) continue;
    const int global = model::global_chunk(grid_.size(Axis::p), pipeline_shape_.v_shape,
                                           grid_.coord(Axis::p), int(c));
    key = (global << 20) + i;
    name = chunks_[c].dp->layout().tensors[std::size_t(i)].name;
  }
  // The smallest key, and the lowest rank holding it (maxima of negatives).
  int least[2] = {-key, 0};
  stats_->all_reduce_max(least, 1, Space::host).wait();
  least[1] = key == -least[0] ? -grid_.world_rank() : std::numeric_limits<int>::min();
  stats_->all_reduce_max(least + 1, 1, Space::host).wait();
  const int rank = -least[1];
  name = mpi::broadcast(grid_.cart(), rank, name);
  const std::string where =
      -least[0] < std::numeric_limits<int>::max()
          ? cat("; the first non-finite gradient is ", name, " on rank ", rank)
          : std::string("; every gradient is finite (the loss is not)");
  throw Error(cat("step ", r.step, ": loss ", r.loss, ", gradient norm ", r.grad_norm, where, how,
                  ". No checkpoint was written from this state; lower train%lr", advice),
              kExitRuntime, ErrorScope::all_ranks);
}

template <class P>
Validation Trainer<P>::evaluate() {
  const std::int64_t S = config_.model.seq_len, mb = config_.train.micro_batch;
  const std::int64_t n =
      config_.data.val_samples > 0 ? config_.data.val_samples : config_.train.global_batch;
  const auto [first, count] = my_slice(n);
  // Every rank runs the same number of forwards (ZeRO 3 gathers are collective); a rank
  // whose slice is shorter repeats its first sample and discards that loss.
  const std::int64_t ranks = grid_.group_size(GroupKind::batch);
  const std::int64_t passes = ((n + ranks - 1) / ranks + mb - 1) / mb;
  const std::int64_t group = grid_.size(Axis::p);  // passes in flight through the pipeline
  const int datasets = data_->datasets();
  std::vector<double> sums(std::size_t(datasets), 0.0);
  std::vector<data::Draw> draws(static_cast<std::size_t>(mb));
  for (int d = 0; d < datasets; ++d) {
    for (std::int64_t k0 = 0; k0 < passes; k0 += group) {
      // A stop signal (time limit) must not wait for a long validation: every rank agrees
      // before each group of passes and leaves together.
      if (signals::agreed_stop_signal(grid_.cart())) return {};
      MicroBatches mbs;
      mbs.count = int(std::min(group, passes - k0));
      mbs.samples = [&, k0 = k0, count = count](int i) {
        const std::int64_t j = (k0 + i) * mb;
        return int(std::max<std::int64_t>(1, std::min(mb, count - j)));
      };
      mbs.fetch = [&, k0 = k0, first = first, count = count](int i) {
        const std::int64_t j = (k0 + i) * mb;
        const int B = mbs.samples(i);
        for (int b = 0; b < B; ++b)
          draws[std::size_t(b)] = {0, j < count ? first + j + b : first, d, 0};
        return fetch(data::Split::val, draws.data(), B);
      };
      const std::vector<double> losses = pipeline_->forward_only(mbs);
      for (int i = 0; i < mbs.count; ++i)
        if ((k0 + i) * mb < count) sums[std::size_t(d)] += losses[std::size_t(i)];
    }
  }
  pipeline_->take_compute_seconds();
  if (grid_.coord(Axis::t) != 0) std::fill(sums.begin(), sums.end(), 0.0);
  stats_->all_reduce_sum_now(sums.data(), datasets);
  Validation v;
  v.loss = 0;
  for (int d = 0; d < datasets; ++d) {
    v.datasets.push_back(sums[std::size_t(d)] / double(n * S));
    v.loss += data_->spec().weights[std::size_t(d)] * v.datasets.back();
  }
  if (datasets == 1) v.loss = v.datasets[0];  // the same number, not rounded by the weighting
  return v;
}

template class Trainer<Fp32>;
template class Trainer<Fp64>;
template class Trainer<Bf16>;
template class Trainer<Bf16Grads>;

}  // namespace ptrain::parallel
