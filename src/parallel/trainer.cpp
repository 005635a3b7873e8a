#include "parallel/trainer.hpp"

#include <chrono>
#include <cmath>
#include <thread>
#include <limits>

#include "kernels/kernels.hpp"
#include "util/error.hpp"
#include "util/profile.hpp"
#include "util/signals.hpp"
#include "util/timer.hpp"

namespace ptrain::parallel {

namespace {

model::ShardCoord shard_coord(const Config& config, const Grid& grid) {
  model::ShardCoord c;
  c.t = grid.coord(Axis::t);
  c.T = grid.size(Axis::t);
  c.p = grid.coord(Axis::p);
  c.P = grid.size(Axis::p);
  c.e = grid.coord(Axis::e);
  c.E = grid.size(Axis::e);
  c.virtual_stages = int(config.parallel.virtual_stages);
  return c;
}

std::vector<optim::Segment> decay_segments(const model::ChunkLayout& layout) {
  std::vector<optim::Segment> segs;
  for (const auto& t : layout.tensors)
    segs.push_back({std::size_t(t.offset), std::size_t(t.offset + t.numel), t.weight_decay});
  return segs;
}

}  // namespace

void check_supported(const Config& c, int world_size) {
  auto no = [](bool asked, const char* what) {
    if (asked) throw Error(cat(what, " is not implemented in this version of ptrain"), kExitInput);
  };
  no(c.parallel.pp > 1 || c.parallel.cp > 1 || c.parallel.ep > 1,
     "training with parallel%pp, cp or ep > 1 (data and tensor parallelism so far; --plan works)");
  (void)world_size;
  no(c.model.n_expert > 0, "model%n_expert > 0 (mixture-of-experts layers)");
  no(c.train.recompute != "none", "train%recompute other than 'none'");
  no(c.backend.device != "cpu", "backend%device other than 'cpu'");
  no(c.model.dtype == "bf16", "model%dtype = 'bf16' (mixed precision comes with the CUDA backend)");
}

template <class T>
Trainer<T>::Trainer(const Config& config, const Grid& grid)
    : config_(config),
      grid_(grid),
      dense_grad_(grid.comm(GroupKind::dense_grad), "dense-grad"),
      batch_(grid.comm(GroupKind::batch), "batch"),
      tp_(grid.comm(GroupKind::tp), "tp"),
      dp_(config, dense_grad_, model::build_layout(config, shard_coord(config, grid)).at(0), &tp_),
      model_(config, shard_coord(config, grid), dp_.layout(), int(config.train.micro_batch), 1,
             dp_.store(), &tp_),
      data_(data::open_source(data::spec_from_config(config))),
      schedule_(optim::schedule_from_config(config)) {
  optimizer_ = optim::make_optimizer<T>(config.train.optimizer, decay_segments(model_.layout()),
                                        std::size_t(dp_.update_lo()), std::size_t(dp_.update_hi()),
                                        optim::hyper_from_config(config));
  const std::size_t n = std::size_t(config.train.micro_batch * config.model.seq_len);
  inputs_.resize(n);
  targets_.resize(n);
}

template <class T>
std::pair<std::int64_t, std::int64_t> Trainer<T>::my_slice(std::int64_t n) const {
  const std::int64_t ranks = grid_.group_size(GroupKind::batch),
                     r = grid_.group_rank(GroupKind::batch);
  const std::int64_t per = n / ranks, extra = n % ranks;
  const std::int64_t first = r * per + std::min(r, extra);
  return {first, per + (r < extra ? 1 : 0)};
}

template <class T>
StepResult Trainer<T>::step(std::int64_t s) {
  StepResult r;
  r.step = s;
  const double t0 = wall_seconds();
  const std::int64_t S = config_.model.seq_len, mb = config_.train.micro_batch;
  const std::int64_t global = config_.train.global_batch;
  r.tokens = global * S;
  const T dloss = T(1.0 / double(r.tokens));  // d(mean loss) / d(token loss)

  if (s == 1 && config_.run.debug_hang_rank == grid_.world_rank())
    std::this_thread::sleep_for(std::chrono::seconds(3600));  // the watchdog's test
  dp_.begin_step();
  const auto [first, count] = my_slice(global);  // the deck makes count a multiple of mb
  double loss_sum = 0;
  Stopwatch fwd, bwd, opt;
  for (std::int64_t j = 0; j < count; j += mb) {
    const int B = int(std::min(mb, count - j));
    profile::region("data", [&] {
      data::fetch(*data_, data::Split::train, s, first + j, B, inputs_.data(), targets_.data());
    });
    fwd.start();
    loss_sum += model_.forward(0, {inputs_.data(), targets_.data(), B});
    Kokkos::fence();
    fwd.stop();
    bwd.start();
    dp_.begin_micro_batch(j + mb >= count);
    model_.backward(0, dloss);
    if (config_.run.debug_fail_rank == grid_.world_rank())
      throw Error(cat("run%debug_fail_rank: rank ", grid_.world_rank(),
                      " fails on purpose in the backward of step ", s));
    Kokkos::fence();
    bwd.stop();
  }
  profile::region("grad-sync", [&] { dp_.finish_gradients(); });
  batch_.all_reduce_sum_now(&loss_sum, 1);
  r.loss = loss_sum / double(r.tokens);

  opt.start();
  auto grads = dp_.update_grads();
  if (s == config_.run.debug_nan_step && grid_.world_rank() == 0)
    Kokkos::deep_copy(Kokkos::subview(grads, 0), std::numeric_limits<T>::quiet_NaN());
  r.grad_norm = std::sqrt(dp_.grad_norm_squared());
  r.lr = schedule_.at(s);
  // Loss and norm are the same on every rank, so every rank takes the same decision.
  if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm)) {
    skip_nonfinite(r);
  } else {
    consecutive_skips_ = 0;
    profile::region("clip", [&] {
      const double factor = optim::clip_factor(r.grad_norm, config_.train.clip);
      if (factor != 1.0) kernels::scale<T>(grads, T(factor));
    });
    profile::region("optimizer", [&] { optimizer_->step(dp_.update_params(), grads, r.lr); });
    profile::region("param-gather", [&] { dp_.finish_step(); });
  }
  Kokkos::fence();
  opt.stop();
  r.comm_overlap = dp_.overlap_fraction();

  r.t_forward = fwd.total();
  r.t_backward = bwd.total();
  r.t_optimizer = opt.total();
  r.t_step = wall_seconds() - t0;
  return r;
}

// train%nonfinite: 'skip' drops the step's update (no parameter or optimizer state changes)
// until max_skips in a row; 'stop' (or too many skips) ends the run on every rank alike,
// naming the first tensor with a non-finite gradient and its rank, before any checkpoint
// could be written from that state.
template <class T>
void Trainer<T>::skip_nonfinite(StepResult& r) {
  const bool skip = config_.train.nonfinite == "skip";
  if (skip && ++consecutive_skips_ <= config_.train.max_skips) {
    r.skipped = true;
    return;
  }
  struct {
    int tensor, rank;
  } first{dp_.first_nonfinite_grad(), grid_.world_rank()};
  if (first.tensor < 0) first.tensor = std::numeric_limits<int>::max();
  MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_2INT, MPI_MINLOC, MPI_COMM_WORLD);
  const auto& tensors = dp_.layout().tensors;
  const std::string where =
      first.tensor < int(tensors.size())
          ? cat("; the first non-finite gradient is ", tensors[std::size_t(first.tensor)].name,
                " on rank ", first.rank)
          : std::string("; every gradient is finite (the loss is not)");
  throw Error(cat("step ", r.step, ": loss ", r.loss, ", gradient norm ", r.grad_norm, where,
                  skip ? cat(" (", config_.train.max_skips, " steps skipped in a row)")
                       : std::string(" (train%nonfinite = 'stop')"),
                  ". No checkpoint was written from this state; lower train%lr, or set "
                  "train%nonfinite = 'skip' to drop such steps"),
              kExitRuntime, ErrorScope::all_ranks);
}

template <class T>
double Trainer<T>::evaluate() {
  const std::int64_t S = config_.model.seq_len, mb = config_.train.micro_batch;
  const std::int64_t n =
      config_.data.val_samples > 0 ? config_.data.val_samples : config_.train.global_batch;
  const auto [first, count] = my_slice(n);
  // Every rank runs the same number of forwards (ZeRO 3 gathers are collective); a rank
  // whose slice is shorter repeats its first sample and discards that loss.
  const std::int64_t ranks = grid_.group_size(GroupKind::batch);
  const std::int64_t passes = ((n + ranks - 1) / ranks + mb - 1) / mb;
  double loss_sum = 0;
  for (std::int64_t k = 0; k < passes; ++k) {
    // A stop signal (time limit) must not wait for a long validation: every rank agrees
    // before each pass and leaves together.
    if (signals::agreed_stop_signal(MPI_COMM_WORLD)) return std::nan("");
    const std::int64_t j = k * mb;
    const int B = int(std::max<std::int64_t>(1, std::min(mb, count - j)));
    const bool real = j < count;
    data::fetch(*data_, data::Split::val, 0, real ? first + j : first, B, inputs_.data(),
                targets_.data());
    const double l = model_.forward(0, {inputs_.data(), targets_.data(), B}, false);
    if (real) loss_sum += l;
  }
  batch_.all_reduce_sum_now(&loss_sum, 1);
  return loss_sum / double(n * S);
}

template class Trainer<float>;
template class Trainer<double>;

}  // namespace ptrain::parallel
