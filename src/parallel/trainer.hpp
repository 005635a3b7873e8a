// parallel/trainer.hpp — one training step on this rank: the micro-batches of its slice of
// the global batch, forward/backward with gradient accumulation, clipping by the global
// norm, the optimizer update. The loss is the mean over every token of the global batch
// (ARCHITECTURE.md section 3), whatever the grid.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/comm.hpp"
#include "data/data.hpp"
#include "deck/config.hpp"
#include "grid/grid.hpp"
#include "model/stage.hpp"
#include "optim/optim.hpp"
#include "parallel/data_parallel.hpp"

namespace ptrain::parallel {

struct StepResult {
  std::int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  double t_forward = 0, t_backward = 0, t_optimizer = 0, t_step = 0;  // seconds
  std::int64_t tokens = 0;                                            // in the global batch
  // Traffic per group is read from the comm table around the step (parallel/report.hpp).
  double comm_overlap = 1;  // dense-grad bytes reduced before the end of the backward
  bool skipped = false;  // non-finite loss or norm, update dropped (train%nonfinite = 'skip')
};

// The one place that refuses (Error, exit code 2, the same on every rank) what this version
// cannot train yet: pipeline, context or expert parallelism, mixture of experts,
// recomputation, a device other than the CPU, bf16.
void check_supported(const Config& config, int world_size);

template <class T>
class Trainer {
 public:
  Trainer(const Config& config, const Grid& grid);

  model::Stage<T>& model() { return model_; }  // this rank's one stage (no pipeline yet)
  DataParallel<T>& data_parallel() { return dp_; }
  const data::TokenSource& data() const { return *data_; }
  optim::Optimizer<T>& optimizer() { return *optimizer_; }

  StepResult step(std::int64_t s);  // optimizer step s (1-based)
  double evaluate();  // mean loss over the validation samples; NaN when a stop signal came
  bool can_evaluate() const { return data_->has_val(); }

 private:
  void skip_nonfinite(StepResult& r);  // or throws (train%nonfinite)
  // This rank's contiguous slice [first, first+count) of n samples.
  std::pair<std::int64_t, std::int64_t> my_slice(std::int64_t n) const;

  const Config& config_;
  const Grid& grid_;
  MpiComm dense_grad_, batch_, tp_;  // gradient reduction; loss sums; tensor parallelism
  DataParallel<T> dp_;
  model::Stage<T> model_;
  std::unique_ptr<data::TokenSource> data_;
  std::unique_ptr<optim::Optimizer<T>> optimizer_;
  optim::LrSchedule schedule_;
  std::vector<std::int32_t> inputs_, targets_;  // one micro-batch, host
  std::int64_t consecutive_skips_ = 0;
};

}  // namespace ptrain::parallel
