// parallel/report.hpp — what a training run reports: the per-step log line and
// out_dir/log.csv (RunLog), the --bench kernel breakdown, and the number formats they share.
#pragma once
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "deck/config.hpp"
#include "parallel/trainer.hpp"

namespace ptrain::parallel {

std::string format_duration(double seconds);      // "1h05m", "3m07s", "42s"; "-" if unknown
std::string fixed(const char* format, double x);  // one number through snprintf

// One log line per run%log_every steps on rank 0, and every step a row of out_dir/log.csv.
// The communication columns come from the comm table (comm/comm.hpp): bytes_<group> and
// exposed_<group>_s ('-' in the name as '_') for every group this rank uses (more than one
// rank), in the grid's group order, and overlap_dense_grad after the dense-grad pair. The
// dense-grad columns are always there (zero on one rank): scripts read them.
//
// A step's traffic is what measure() saw during the training step alone, so a validation
// pass or a checkpoint between it and step() does not count. A restarted run appends to
// the log.csv it finds, in that file's columns (a group the new grid lacks is left empty,
// one it adds is not logged).
class RunLog {
 public:
  RunLog(const Config& config, double peak_gflops_per_rank, int world, std::int64_t first_step);

  // Runs the training step f() -> StepResult, keeping each group's traffic for step().
  template <class F>
  StepResult measure(F&& f) {
    const std::vector<GroupTraffic> before = traffic_by_group();
    StepResult r = f();
    traffic_ = traffic_since(before);
    return r;
  }
  // Writes the row of step r (and the log line when due); `val` the validation of this step
  // (loss NaN when not evaluated), elapsed the wall time since the first step began.
  void step(const StepResult& r, const Validation& val, double elapsed);

 private:
  const Config& config_;
  std::int64_t first_step_;
  double peak_, flops_per_token_, bubble_theory_;  // (p-1)/(v*m+p-1)
  std::vector<std::size_t> groups_;                // rows of the comm table with columns
  std::vector<std::string> columns_;               // of log.csv, in its order
  std::vector<GroupTraffic> traffic_;
  std::size_t datasets_ = 1;  // of the data (several: a blend)
  std::ofstream csv_;
};

// --bench: seconds per step by kernel family (util/profile.hpp), against the step time.
std::string bench_report(double step_seconds, std::int64_t steps);

}  // namespace ptrain::parallel
