#include "parallel/report.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>

#include "data/data.hpp"
#include "grid/layout.hpp"
#include "model/layout.hpp"
#include "parallel/plan.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/memory.hpp"
#include "util/profile.hpp"

namespace ptrain::parallel {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "-";
  const long t = long(s + 0.5);
  if (t >= 3600) return cat(t / 3600, "h", (t % 3600) / 60 < 10 ? "0" : "", (t % 3600) / 60, "m");
  if (t >= 60) return cat(t / 60, "m", t % 60 < 10 ? "0" : "", t % 60, "s");
  return cat(t, "s");
}

std::string fixed(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

namespace {

const std::size_t kDenseGrad = std::size_t(GroupKind::dense_grad);

// "dense-grad" -> "dense_grad": CSV headers that are identifiers in awk, Python and pandas.
std::string column_stem(std::string group) {
  for (char& c : group)
    if (c == '-') c = '_';
  return group;
}

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> cells(1);
  for (char c : line)
    if (c == ',')
      cells.emplace_back();
    else
      cells.back() += c;
  return cells;
}

// Rewrites log.csv with its header and the rows of steps < first_step (through a temporary
// file and a rename: a crash here loses nothing). Returns the header ("" when none).
std::string keep_rows_before(const std::string& path, std::int64_t first_step) {
  std::ifstream in(path);
  std::string header, line;
  if (!std::getline(in, header) || header.empty()) return "";
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << header << '\n';
    while (std::getline(in, line))
      if (!line.empty() && std::strtoll(line.c_str(), nullptr, 10) < first_step)
        out << line << '\n';
    if (!out.flush()) throw Error(cat("cannot write '", tmp, "'"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw Error(cat("cannot replace '", path, "'"));
  return header;
}

// log.csv column of the slowest rank of a phase, or its compute time over the median's:
// "slowest_forward_rank", "slowest_forward_ratio".
std::string straggler_column(const char* phase, const char* what) {
  return cat("slowest_", phase, "_", what);
}

// The slowest ranks' log.csv cells; returns them as text for the log, "forward rank 3 (host)
// 0.0520 s = 1.04x, ...".
std::string straggler_cells(const StepResult& r, std::map<std::string, std::string>& cell) {
  std::string text;
  for (const auto& w : r.stragglers) {
    cell[straggler_column(w.phase, "rank")] = std::to_string(w.rank);
    cell[straggler_column(w.phase, "ratio")] = fixed("%.4f", w.ratio);
    text += cat(text.empty() ? "" : ", ", w.phase, " rank ", w.rank, " (", w.host, ") ",
                fixed("%.4f", w.seconds), " s = ", fixed("%.2f", w.ratio), "x");
  }
  return text;
}

// A warning for each phase whose slowest rank is more than run%straggler_factor times its
// stage's median (0: none) and slower by at least kStragglerFloor of the step time: a phase of
// a few milliseconds doubles on a shared node without holding anyone up.
constexpr double kStragglerFloor = 0.05;
void warn_stragglers(const StepResult& r, double factor) {
  for (const auto& w : r.stragglers)
    if (factor > 0 && w.ratio > factor && w.seconds - w.median >= kStragglerFloor * w.step_seconds)
      log::warn(cat("step ", r.step, ": rank ", w.rank, " on ", w.host, " is a straggler: its ",
                    w.phase, " computes ", fixed("%.4f", w.seconds), " s per step, ",
                    fixed("%.2f", w.ratio), "x the median ", fixed("%.4f", w.median),
                    " s of its pipeline stage's ranks (run%straggler_factor = ", factor, ")"));
}

// log.csv column of one MoE layer's statistic: "moe_h3_max".
std::string moe_column(std::int64_t layer, const char* what) {
  return cat("moe_h", layer, "_", what);
}

// Each MoE layer's loads into its log.csv cells; returns them as text for the log,
// "h.1 164/247.8/319 (3.2% dropped), ...".
std::string moe_layer_cells(const StepResult& r, std::map<std::string, std::string>& cell) {
  std::string text;
  for (const auto& m : r.moe_layers) {
    cell[moe_column(m.layer, "min")] = fixed("%.0f", m.min);
    cell[moe_column(m.layer, "mean")] = fixed("%.2f", m.mean);
    cell[moe_column(m.layer, "max")] = fixed("%.0f", m.max);
    cell[moe_column(m.layer, "dropped")] = fixed("%.6f", m.dropped);
    text += cat(text.empty() ? "" : ", ", "h.", m.layer, " ", fixed("%.0f", m.min), "/",
                fixed("%.1f", m.mean), "/", fixed("%.0f", m.max),
                m.dropped > 0 ? fixed(" (%.1f%% dropped)", 100 * m.dropped) : "");
  }
  return text;
}

// log.csv column of dataset d's (0-based) figure: "epoch" or "val_loss" for one dataset,
// "epoch_1", "val_loss_2" ... for a blend.
std::string dataset_column(const char* what, std::size_t d, std::size_t datasets) {
  return datasets > 1 ? cat(what, "_", d + 1) : std::string(what);
}

// Each dataset's epochs into log.csv; returns them as text for the log: "epoch 2 (25% done)",
// "epochs 2 (25% done), 1 (80% done)".
std::string epoch_cells(const StepResult& r, std::map<std::string, std::string>& cell) {
  std::string text;
  for (std::size_t d = 0; d < r.epochs.size(); ++d) {
    const double e = r.epochs[d];
    cell[dataset_column("epoch", d, r.epochs.size())] = fixed("%.6f", e);
    text += cat(d ? ", " : "", fixed("%.0f", std::floor(e) + 1), " (",
                fixed("%.0f%% done", 100 * (e - std::floor(e))), ")");
  }
  return text.empty() ? text : cat(r.epochs.size() > 1 ? " | epochs " : " | epoch ", text);
}

}  // namespace

RunLog::RunLog(const Config& config, double peak_gflops_per_rank, int world,
               std::int64_t first_step)
    : config_(config),
      first_step_(first_step),
      peak_(peak_gflops_per_rank * world),
      flops_per_token_(model::flops_per_token(config)),
      bubble_theory_(pipeline_bubble(config)),
      traffic_(traffic_since(traffic_by_group())) {  // zero until measure() runs
  for (std::size_t i = 0; i < traffic_.size(); ++i)
    if (traffic_[i].used || i == kDenseGrad) groups_.push_back(i);
  if (log::rank() != 0) return;
  columns_ = {"step",        "loss",  "val_loss",       "lr",     "grad_norm", "tokens_per_s",
              "gflops",      "mfu",   "peak_mem_bytes", "t_step", "t_forward", "t_backward",
              "t_optimizer", "eta_s", "skipped"};
  const data::DataSpec data = data::spec_from_config(config);
  datasets_ = data.weights.size();
  if (datasets_ > 1)
    for (std::size_t d = 0; d < datasets_; ++d)
      columns_.push_back(dataset_column("val_loss", d, datasets_));
  if (data.source != "synthetic" && data.order == "epochs")
    for (std::size_t d = 0; d < datasets_; ++d)
      columns_.push_back(dataset_column("epoch", d, datasets_));
  if (config.parallel.pp > 1)
    columns_.insert(columns_.end(), {"bubble", "bubble_model", "bubble_theory"});
  if (config.model.n_expert > 0) {
    columns_.insert(columns_.end(), {"aux_loss", "moe_dropped", "moe_load_min", "moe_load_max"});
    const model::Dims d = model::dims_of(config);
    for (std::int64_t l = 0; l < d.L; ++l)
      if (d.is_moe_layer(l))
        for (const char* x : {"min", "mean", "max", "dropped"})
          columns_.push_back(moe_column(l, x));
  }
  for (std::size_t i : groups_) {
    const std::string g = column_stem(traffic_[i].group);
    columns_.insert(columns_.end(), {"bytes_" + g, "exposed_" + g + "_s"});
    if (i == kDenseGrad) columns_.push_back("overlap_dense_grad");
  }
  if (world > config.parallel.pp)  // some stage has ranks to compare (Trainer::report_stragglers)
    for (const char* phase : {"forward", "backward", "optimizer"})
      columns_.insert(columns_.end(),
                      {straggler_column(phase, "rank"), straggler_column(phase, "ratio")});
  // A restarted run continues the same log.csv, in the columns it has, without the rows a
  // crashed run wrote after its last checkpoint (they are about to be computed again).
  const std::string path = config.run.out_dir + "/log.csv";
  std::string header;
  if (first_step > 1) header = keep_rows_before(path, first_step);
  if (!header.empty()) columns_ = split_csv_line(header);
  csv_.open(path, header.empty() ? std::ios::trunc : std::ios::app);
  if (!csv_) throw Error(cat("cannot write '", path, "'"));
  for (std::size_t c = 0; header.empty() && c < columns_.size(); ++c)
    csv_ << columns_[c] << (c + 1 < columns_.size() ? ',' : '\n');
}

void RunLog::step(const StepResult& r, const Validation& val, double elapsed) {
  const double val_loss = val.loss;
  const double tok_s = double(r.tokens) / r.t_step;
  const double gflops = flops_per_token_ * double(r.tokens) / r.t_step / 1e9;
  const double mfu = peak_ > 0 ? gflops / peak_ : 0;
  const double eta =
      elapsed / double(r.step - first_step_ + 1) * double(config_.run.steps - r.step);
  const double mem = double(memory::stats().total_peak);
  if (log::rank() != 0) return;
  // Losses and norms to the last bit (%.17g), so runs can be compared exactly.
  std::map<std::string, std::string> cell = {
      {"step", std::to_string(r.step)},
      {"loss", fixed("%.17g", r.loss)},
      {"val_loss", std::isnan(val_loss) ? "" : fixed("%.17g", val_loss)},
      {"lr", fixed("%.6g", r.lr)},
      {"grad_norm", fixed("%.17g", r.grad_norm)},
      {"tokens_per_s", fixed("%.1f", tok_s)},
      {"gflops", fixed("%.3f", gflops)},
      {"mfu", fixed("%.4f", mfu)},
      {"peak_mem_bytes", fixed("%.0f", mem)},
      {"t_step", fixed("%.6f", r.t_step)},
      {"t_forward", fixed("%.6f", r.t_forward)},
      {"t_backward", fixed("%.6f", r.t_backward)},
      {"t_optimizer", fixed("%.6f", r.t_optimizer)},
      {"eta_s", fixed("%.1f", eta)},
      {"skipped", r.skipped ? "1" : "0"},
      {"overlap_dense_grad", fixed("%.4f", r.comm_overlap)},
      {"bubble", fixed("%.4f", r.bubble)},
      {"bubble_model", fixed("%.4f", r.bubble_model)},
      {"bubble_theory", fixed("%.4f", bubble_theory_)},
      {"aux_loss", fixed("%.17g", r.aux_loss)},
      {"moe_dropped", fixed("%.6f", r.moe_dropped)},
      {"moe_load_min", fixed("%.4f", r.moe_load_min)},
      {"moe_load_max", fixed("%.4f", r.moe_load_max)}};
  std::string val_text;
  if (datasets_ > 1 && !std::isnan(val_loss)) {
    for (std::size_t d = 0; d < val.datasets.size(); ++d) {
      cell[dataset_column("val_loss", d, datasets_)] = fixed("%.17g", val.datasets[d]);
      val_text += cat(d ? ", " : " (datasets ", fixed("%.4f", val.datasets[d]));
    }
    val_text += ")";
  }
  const std::string epoch_text = epoch_cells(r, cell);
  const std::string moe_text = moe_layer_cells(r, cell);
  const std::string straggler_text = straggler_cells(r, cell);
  std::string comm_text;
  for (std::size_t i : groups_) {
    const GroupTraffic& t = traffic_[i];
    const std::string g = column_stem(t.group);
    cell["bytes_" + g] = fixed("%.0f", t.stats.bytes);
    cell["exposed_" + g + "_s"] = fixed("%.6f", t.stats.exposed_s);
    if (t.stats.bytes > 0)
      comm_text += cat(" | ", t.group, " comm ", format_bytes(t.stats.bytes), ", ",
                       fixed("%.3f", t.stats.exposed_s), " s exposed",
                       i == kDenseGrad ? fixed(", %.0f%% overlapped", 100 * r.comm_overlap) : "");
  }
  for (std::size_t c = 0; c < columns_.size(); ++c)
    csv_ << cell[columns_[c]] << (c + 1 < columns_.size() ? ',' : '\n');
  // A full disk or a quota: said at once, and the job ends (rank 0 alone writes the log).
  if (!csv_.flush())
    throw Error(cat(config_.run.out_dir, "/log.csv: cannot write the row of step ", r.step, ": ",
                    std::strerror(errno ? errno : EIO)));
  // Steps with a straggler report (every log_every, the last) always print.
  const bool print = r.step == 1 || r.step % config_.run.log_every == 0 ||
                     r.step == config_.run.steps || !std::isnan(val_loss) || r.skipped;
  if (!print) return;
  log::info(
      cat("step ", fixed("%5.0f", double(r.step)), "/", config_.run.steps, " | loss ",
          fixed("%.4f", r.loss),
          std::isnan(val_loss) ? std::string() : cat(" | val ", fixed("%.4f", val_loss), val_text),
          epoch_text, " | lr ", fixed("%.2e", r.lr), " | norm ", fixed("%.3f", r.grad_norm), " | ",
          fixed("%.0f", tok_s), " tok/s | ", fixed("%.1f", gflops), " GFLOP/s | MFU ",
          fixed("%.1f%%", 100 * mfu), " | mem ", format_bytes(mem), " | fwd ",
          fixed("%.3f", r.t_forward), " bwd ", fixed("%.3f", r.t_backward), " opt ",
          fixed("%.3f", r.t_optimizer), " s", comm_text,
          config_.model.n_expert > 0
              ? cat(" | moe aux ", fixed("%.4f", r.aux_loss), ", dropped ",
                    fixed("%.1f%%", 100 * r.moe_dropped), ", expert load ",
                    fixed("%.2f", r.moe_load_min), "-", fixed("%.2f", r.moe_load_max), " of mean")
              : std::string(),
          config_.parallel.pp > 1
              ? cat(" | bubble ", fixed("%.1f%%", 100 * r.bubble), " (schedule at these op times ",
                    fixed("%.1f%%", 100 * r.bubble_model), ", equal stages ",
                    fixed("%.1f%%", 100 * bubble_theory_), ")")
              : std::string(),
          " | ETA ", format_duration(eta),
          r.skipped ? " | SKIPPED: not finite, update dropped (train%nonfinite)" : ""));
  if (!moe_text.empty())
    log::info(cat("step ", fixed("%5.0f", double(r.step)),
                  " | expert loads min/mean/max tokens: ", moe_text));
  if (straggler_text.empty()) return;
  log::info(cat("step ", fixed("%5.0f", double(r.step)),
                " | slowest ranks, compute per step (waits excluded) against the median of their "
                "pipeline stage: ",
                straggler_text));
  warn_stragglers(r, config_.run.straggler_factor);
}

std::string bench_report(double step_seconds, std::int64_t steps) {
  if (steps == 0) return "bench: run at least 2 steps for a kernel breakdown";
  // Microseconds: the data region of a step is a millisecond or less.
  std::string r = cat("bench: time per step by kernel family (mean of ", steps,
                      " steps after the first, each region fenced)\n");
  double sum = 0;
  for (const auto& [name, t] : profile::totals()) {
    const double per = t / double(steps);
    sum += per;
    r += cat("  ", name, std::string(name.size() < 14 ? 14 - name.size() : 0, ' '),
             fixed("%11.6f s", per), fixed("  %5.1f%%\n", 100 * per / step_seconds));
  }
  r += cat("  other         ", fixed("%11.6f s", step_seconds - sum),
           fixed("  %5.1f%%", 100 * (step_seconds - sum) / step_seconds));
  return r;
}

}  // namespace ptrain::parallel
