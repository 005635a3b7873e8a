// parallel/trainer.hpp — one training step on this rank: the micro-batches of its slice of
// the global batch through this rank's pipeline chunks (parallel/pipeline.hpp runs the
// schedule; one stage and forward-backward per micro-batch without a pipeline), gradient
// reduction, clipping by the global norm, the optimizer update. The loss is the mean over
// every token of the global batch, whatever the grid.
#pragma once
#include <cmath>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.hpp"
#include "data/data.hpp"
#include "deck/config.hpp"
#include "grid/grid.hpp"
#include "model/stage.hpp"
#include "optim/optim.hpp"
#include "parallel/data_parallel.hpp"
#include "parallel/pipeline.hpp"
#include "parallel/schedule.hpp"

namespace ptrain::parallel {

struct StepResult {
  std::int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  double t_forward = 0, t_backward = 0, t_optimizer = 0, t_step = 0;  // seconds
  // This rank's compute in each phase: its wall time less the time blocked on any Comm.
  double compute_forward = 0, compute_backward = 0, compute_optimizer = 0;
  std::int64_t tokens = 0;  // in the global batch
  // Traffic per group is read from the comm table around the step (parallel/report.hpp).
  double comm_overlap = 1;  // dense-grad bytes reduced before the end of the backward
  bool skipped = false;     // non-finite loss or norm, update dropped (train%nonfinite = 'skip')
  // Pipeline: time waiting for pipeline neighbours' messages before the rank's last forward
  // or backward ended, over the step time, the largest of any rank; 0 without a pipeline.
  double bubble = 0;
  // The bubble the schedule has with this step's measured time of every forward and
  // backward on every rank (the largest rank's simulated waits over the step time): what
  // `bubble` should be when the executor adds nothing to the schedule.
  double bubble_model = 0;
  // Mixture of experts (model%n_expert > 0): the load-balancing loss (in the objective, not
  // in `loss`), the share of token choices dropped at capacity, and the least and most
  // loaded expert of any MoE layer relative to that layer's mean load (1 = even).
  double aux_loss = 0, moe_dropped = 0, moe_load_min = 0, moe_load_max = 0;
  // Per MoE layer, in layer order: token choices the least, average and most loaded expert
  // took in this step's global batch (after capacity), and the share dropped at capacity.
  struct MoeLayer {
    std::int64_t layer = 0;
    double min = 0, mean = 0, max = 0, dropped = 0;
  };
  std::vector<MoeLayer> moe_layers;
  // Every run%log_every steps and at the last, when some pipeline stage has more than one
  // rank: per phase (forward, backward, optimizer, in that order), the rank whose compute
  // time (wall time less the time blocked on any Comm) over the steps since the previous
  // report (not the run's first, which pays for first touch) is the largest against the
  // median of the ranks holding its pipeline stage (the lower median: one slow rank of two is
  // named). Empty on other steps.
  struct Straggler {
    const char* phase = "";
    int rank = 0;  // world rank
    std::string host;
    double seconds = 0, median = 0;  // compute per step
    double ratio = 1;                // seconds / median
    double step_seconds = 0;         // the mean step time over the report's steps
  };
  std::vector<Straggler> stragglers;
  // Per dataset, with data%order = 'epochs' on files: epochs drawn after this step (samples
  // over windows: 1.25 is a quarter into the second epoch). Empty without epochs.
  std::vector<double> epochs;
};

// A validation pass: the mean loss per token of each dataset's validation samples and, for a
// blend, their mean weighted by data%weights (the expected loss on the blend); NaN when a stop
// signal came.
struct Validation {
  double loss = std::nan("");
  std::vector<double> datasets;  // one per dataset
};

// The one place that refuses (Error, exit code 2, the same on every rank) a backend%device
// this build does not have: 'cuda' in a CPU build, 'cpu' in a CUDA build.
void check_supported(const Config& config);

template <class P>
class Trainer {
 public:
  PTRAIN_POLICY_TYPES(P);
  Trainer(const Config& config, const Grid& grid);

  // This rank's model chunks (virtual_stages of them with the interleaved schedule, else
  // one), each with its stage, data-parallel engine and optimizer.
  int chunks() const { return int(chunks_.size()); }
  model::Stage<P>& stage(int c = 0) { return *chunks_.at(std::size_t(c)).stage; }
  DataParallel<P>& data_parallel(int c = 0) { return *chunks_.at(std::size_t(c)).dp; }
  optim::Optimizer<M>& optimizer(int c = 0) { return *chunks_.at(std::size_t(c)).optimizer; }
  std::vector<model::ChunkLayout> layouts() const;
  const std::vector<OpList>& schedule() const { return schedule_; }  // every pipeline rank's
  const data::TokenSource& data() const { return *data_; }
  // This rank's groups of more than one rank and how each communicates, for the log:
  // "dense-grad hierarchical (2 nodes x 2 ranks, mpi), tp mpi".
  std::string transports() const;

  StepResult step(std::int64_t s);  // optimizer step s (1-based)
  Validation evaluate();
  // Where the training stream is (data/data.hpp): after the steps run, or as a restart set it.
  const data::Position& data_position() const { return position_; }
  void set_data_position(data::Position at) { position_ = std::move(at); }
  // run%consistency_every (0: does nothing): the replicas of every tensor compare checksums of
  // their compute weights — data-parallel copies, tp-replicated tensors, wte and its tied copy
  // on the last pipeline stage — and a difference throws Error(kExitRuntime, all_ranks) naming
  // the step, the tensor and the ranks. Collective over every rank; `step` labels the message,
  // and a step already checked is not checked again.
  void check_replicas(std::int64_t step);
  bool can_evaluate() const { return data_->has_val(); }

 private:
  struct Chunk {
    std::unique_ptr<DataParallel<P>> dp;
    std::unique_ptr<model::Stage<P>> stage;
    std::unique_ptr<optim::Optimizer<M>> optimizer;
  };
  // Samples draws[0, B): this rank's positions of each, into the host buffers.
  model::MicroBatch fetch(data::Split split, const data::Draw* draws, int B);
  void finish_gradients();
  void measure_bubble(StepResult& r);
  void moe_summary(StepResult& r);
  // Loss sum and the squared gradient norm, summed over every rank at once.
  std::pair<double, double> loss_and_norm_squared(double loss_sum);
  // A non-finite step, or (spike_median > 0) a finite loss above train%spike_factor times
  // that median: skipped, or throws (train%nonfinite).
  void skip_nonfinite(StepResult& r, double spike_median = 0);
  // The median loss of the last kRecentSteps updated steps: 0 with train%spike_factor off or
  // fewer than kLeastSteps of them (the history starts again at a restart).
  double recent_median() const;
  static constexpr std::size_t kRecentSteps = 20, kLeastSteps = 5;
  // Every rank's compute seconds per phase since the last report, gathered into r.stragglers.
  void report_stragglers(StepResult& r);
  // The groups check_replicas compares over, from the layouts (run%consistency_every > 0).
  void plan_replica_checks();
  // This rank's contiguous slice [first, first+count) of n samples.
  std::pair<std::int64_t, std::int64_t> my_slice(std::int64_t n) const;

  const Config& config_;
  const Grid& grid_;
  // gradient reduction; the tp, pp, cp and ep groups; expert gradients (experts split over
  // ep); the tied embedding's two ends (the grid's embed group; with the V placement of zb-v
  // both ends are the first stage's chunks: its dense-grad group). All from make_comm.
  std::unique_ptr<Comm> dense_grad_, tp_, pp_, cp_, ep_, expert_grad_, ends_;
  // The trainer's own reductions (loss, norm, expert statistics, validation, bubble, the
  // first non-finite gradient) over every rank, and the op times over the pipeline group:
  // the "stats" row of the traffic table.
  std::unique_ptr<Comm> stats_, stage_stats_;
  // parallel%zero_scope = 'node' over more than one node: the dense-grad group's ranks on this
  // node (ZeRO's shards) and across the nodes (their replicas), rows dense-grad-intra/-inter.
  NodeLevels dense_grad_levels_;
  std::unique_ptr<Comm> dense_grad_shards_, dense_grad_replicas_;
  std::vector<Chunk> chunks_;
  std::vector<OpList> schedule_;
  Pipeline pipeline_shape_;  // what schedule_ is for
  int micro_batches_ = 0;    // per step on this pipeline
  std::unique_ptr<PipelineExecutor<P>> pipeline_;
  std::unique_ptr<data::TokenSource> data_;
  data::Position position_;        // of the training stream, before the next step
  std::vector<data::Draw> draws_;  // the global batch of the step being run
  optim::LrSchedule lr_schedule_;
  std::vector<int> positions_;                  // this rank's of each sample (empty: all)
  std::vector<std::int32_t> inputs_, targets_;  // one micro-batch, host
  std::int64_t consecutive_skips_ = 0;
  std::deque<double> recent_losses_;  // of the updated steps, the newest last
  std::vector<std::string> hosts_;    // of every world rank, for messages naming a rank
  // Compute seconds (blocked time excluded) of forward, backward and optimizer since the last
  // straggler report, this rank's step time, and the steps they cover.
  double computed_[4] = {0, 0, 0, 0};
  std::int64_t computed_steps_ = 0;
  bool ran_a_step_ = false;
  // run%consistency_every: each group whose members hold copies of the same tensors, as a
  // host-space Comm with the tensors (chunk, index in its layout) compared over it.
  struct Replicas {
    std::unique_ptr<Comm> comm;
    std::string who;  // the members, as the message names them: "data-parallel replicas"
    std::vector<std::pair<int, int>> tensors;
    bool copies = false;  // ZeRO 3: compare whole copies (checksums summed over their shards)
  };
  std::vector<Replicas> replicas_;
  // ZeRO 3: the groups one copy is sharded over (dense tensors; experts split over ep), over
  // which a copy's checksums are summed before they are compared.
  std::unique_ptr<Comm> copy_dense_, copy_experts_;
  std::int64_t checked_step_ = -1;
};

}  // namespace ptrain::parallel
