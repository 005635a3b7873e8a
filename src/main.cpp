// main.cpp — the ptrain driver: arguments, deck, grid, then plan or train.
//
//   ptrain [options] deck.nml
//     --set group%key=value   override a deck key (repeatable)
//     --plan                  validate and print the plan (grid, memory, traffic), no training
//     --world N               plan for N ranks (no mpirun needed); with --ranks-per-node K
//     --memory SIZE           memory per rank the fit is judged against (plan and run)
//     --bandwidth RATE        bytes/s per rank for ranking --plan's advice
//     --bench                 time training steps against a measured sgemm peak
//     --machine FILE          the machine the cost model prices on (a &machine group)
//     --search                with --plan: every layout of the world, ranked by the cost model
//     --write-deck FILE       with --search: the fastest layout as a deck
//     --calibrate             measure this machine for the deck's shapes and write its &machine
//     --write-machine FILE    where --calibrate writes it (default run%out_dir/machine.nml)
//     --help-deck             the deck reference (Markdown)
//     --version, --help
//
// Errors: a deck or argument error is found identically on every rank; rank 0 prints it
// and exits with code 2 (the other ranks with 0, so the launcher's code is rank 0's). Any
// other error on one rank prints "[rank N] error: ..." and aborts the job with MPI_Abort.
#include <mpi.h>
#ifdef PTRAIN_ENABLE_CUDA
#include <cuda_runtime.h>
#endif

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/lock.hpp"
#include "ckpt/training.hpp"
#include "comm/watchdog.hpp"
#include "deck/deck.hpp"
#include "grid/grid.hpp"
#include "kernels/gemm.hpp"
#include "kernels/parallel.hpp"
#include "model/layout.hpp"
#include "parallel/calibrate.hpp"
#include "parallel/cost.hpp"
#include "parallel/plan.hpp"
#include "parallel/report.hpp"
#include "parallel/search.hpp"
#include "parallel/trainer.hpp"
#include "util/device_guard.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/memory.hpp"
#include "util/mpi.hpp"
#include "util/profile.hpp"
#include "util/signals.hpp"
#include "util/timer.hpp"
#include "util/trace.hpp"
#include "util/version.hpp"

// Everything lives in ptrain, not behind a `using namespace ptrain;` at file scope: nvcc
// appends CUDA's math headers to every file, and their global `log` would clash with
// ptrain::log.
namespace ptrain {
namespace {

using parallel::fixed;
using parallel::format_duration;

const char* kUsage =
    "usage: ptrain [options] deck.nml\n"
    "  --set group%key=value   override a deck key (repeatable)\n"
    "  --plan                  validate the deck and print the plan; no training\n"
    "  --world N               plan for N ranks without mpirun (with --plan)\n"
    "  --ranks-per-node K      ranks per node for --world (default 1)\n"
    "  --memory SIZE           memory per rank, e.g. 80GiB (default: the node's memory / ranks\n"
    "                          per node); --plan says what fits, a run that would not fit stops\n"
    "  --bandwidth RATE        bytes/s a rank sends at, e.g. 25GB/s: ranks --plan's advice\n"
    "  --bench                 time training steps against a measured sgemm peak\n"
    "  --machine FILE          price steps on this machine (a &machine group, as --calibrate\n"
    "                          writes; default: the deck's &machine, else its node class)\n"
    "  --search                with --plan: every layout of the world that fits, ranked by\n"
    "                          predicted tokens/s (the top ten printed)\n"
    "  --write-deck FILE       with --search: write the fastest layout as a deck\n"
    "  --calibrate             measure gemm, attention, kernel, optimizer and link rates on\n"
    "                          these ranks for the deck's shapes, run a few of its steps, and\n"
    "                          write the &machine group the cost model uses\n"
    "  --write-machine FILE    where --calibrate writes (default run%out_dir/machine.nml)\n"
    "  --help-deck             print the deck reference (Markdown)\n"
    "  --version               print the version\n"
    "  --help                  print this help\n";

struct Options {
  std::string deck;
  std::vector<std::string> overrides;
  bool plan = false, bench = false, help = false, help_deck = false, version = false;
  bool search = false, calibrate = false;
  std::string machine, write_deck, write_machine;  // --machine, --write-deck, --write-machine
  int world = 0, ranks_per_node = 0;
  double memory = 0, bandwidth = 0;  // --memory, --bandwidth (0: not given)
};

int parse_count(const std::string& flag, const char* text) {
  char* end = nullptr;
  long v = std::strtol(text, &end, 10);
  if (!end || *end || v < 1 || v > 100000000)
    throw Error(cat("ptrain: ", flag, " expects a positive integer, got '", text, "'"), kExitInput);
  return static_cast<int>(v);
}

// Every rank parses the same argv, so an error here is collective.
Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) throw Error(cat("ptrain: ", a, " needs a value"), kExitInput);
      return argv[++i];
    };
    if (a == "--set")
      o.overrides.push_back(value());
    else if (a.rfind("--set=", 0) == 0)
      o.overrides.push_back(a.substr(6));
    else if (a == "--plan")
      o.plan = true;
    else if (a == "--bench")
      o.bench = true;
    else if (a == "--search")
      o.search = true;
    else if (a == "--calibrate")
      o.calibrate = true;
    else if (a == "--machine")
      o.machine = value();
    else if (a == "--write-deck")
      o.write_deck = value();
    else if (a == "--write-machine")
      o.write_machine = value();
    else if (a == "--world")
      o.world = parse_count(a, value());
    else if (a == "--memory" || a == "--bandwidth") {
      const char* text = value();
      const auto bytes = parse_bytes(text);
      if (!bytes)
        throw Error(cat("ptrain: ", a, " expects a size such as 80GiB, 512MiB, 1.5TB or bytes",
                        a == "--bandwidth" ? " per second (25GB/s)" : "", ", got '", text, "'"),
                    kExitInput);
      (a == "--memory" ? o.memory : o.bandwidth) = *bytes;
    } else if (a == "--ranks-per-node")
      o.ranks_per_node = parse_count(a, value());
    else if (a == "--help" || a == "-h")
      o.help = true;
    else if (a == "--help-deck")
      o.help_deck = true;
    else if (a == "--version")
      o.version = true;
    else if (!a.empty() && a[0] == '-')
      throw Error(cat("ptrain: unknown option '", a, "'\n", kUsage), kExitInput);
    else if (o.deck.empty())
      o.deck = a;
    else
      throw Error(cat("ptrain: more than one deck given ('", o.deck, "' and '", a, "')"),
                  kExitInput);
  }
  if (o.help || o.help_deck || o.version) return o;
  if (o.deck.empty()) throw Error(cat("ptrain: no deck given\n", kUsage), kExitInput);
  if ((o.world || o.ranks_per_node) && !o.plan)
    throw Error("ptrain: --world and --ranks-per-node go with --plan", kExitInput);
  if (o.search && !o.plan) throw Error("ptrain: --search goes with --plan", kExitInput);
  if (!o.write_deck.empty() && !o.search)
    throw Error("ptrain: --write-deck goes with --plan --search", kExitInput);
  if (!o.write_machine.empty() && !o.calibrate)
    throw Error("ptrain: --write-machine goes with --calibrate", kExitInput);
  if (o.calibrate && o.plan) throw Error("ptrain: --calibrate and --plan are two runs", kExitInput);
  return o;
}

// parallel%pp_layers = -1: the split the cost model balances (parallel/cost.hpp), validated
// again for the world; any other deck as it is. Every rank computes the same.
Config with_balanced_split(const Config& config, int world) {
  if (config.parallel.pp_layers.empty() || config.parallel.pp_layers[0] != -1) return config;
  Config c = parallel::balanced_split(config, parallel::machine_of(config));
  deck::validate(c, world);
  std::string counts;
  for (std::size_t i = 0; i < c.parallel.pp_layers.size() && c.parallel.pp_layers[i] > 0; ++i)
    counts += cat(i ? ", " : "", c.parallel.pp_layers[i]);
  log::info(cat("parallel%pp_layers = -1: the layers split ", counts,
                " over the pipeline chunks, the slowest chunk the fastest the cost model finds (",
                parallel::describe_machine(parallel::machine_of(c)), ")"));
  return c;
}

// Writes `text` to `path` (the user's output file): one line and exit 2 when it cannot.
void write_user_file(const std::string& path, const std::string& text, const char* what) {
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::ofstream out(path, std::ios::trunc);
  if (!(out << text).flush())
    throw Error(cat(what, " ", path, ": cannot write: ", std::strerror(errno ? errno : EIO)),
                kExitInput);
}

// --plan --search: the ranked layouts, and with --write-deck the fastest as a deck.
void search_layouts(const Options& o, const Config& config, int world, int ranks_per_node) {
  const parallel::MemoryBudget budget =
      parallel::memory_budget(config, {o.memory, o.bandwidth}, ranks_per_node);
  const parallel::LayoutSearch s = parallel::search_layouts(
      config, world, ranks_per_node, budget.bytes, parallel::machine_of(config));
  std::fputs(
      cat("\n", parallel::describe_machine(parallel::machine_of(config)), "\nmemory a rank has: ",
          budget.bytes > 0 ? cat(format_bytes(budget.bytes), " (", budget.source, ")")
                           : budget.source,
          "\n", parallel::search_report(s))
          .c_str(),
      stdout);
  if (o.write_deck.empty()) return;
  if (s.ranked.empty())
    throw Error(cat("--write-deck ", o.write_deck, ": no layout fits, nothing written"),
                kExitInput);
  write_user_file(o.write_deck, deck::echo(s.ranked.front().config), "--write-deck");
  std::fputs(cat("wrote the fastest layout to ", o.write_deck, "\n").c_str(), stdout);
}

// `ptrain --plan`: with --world, plan for a machine we are not on (login node);
// otherwise for this job's ranks and their real node map.
int run_plan(const Options& o, int world_rank, int world_size) {
  if (o.world > 0) {
    if (world_rank != 0) return kExitOk;  // a pure computation: rank 0 alone does it
    Config config = deck::parse_file(o.deck, o.overrides);
    if (!o.machine.empty()) deck::read_machine(config, o.machine);
    if (o.search) {
      // The search sets the layout itself: a deck whose own layout does not suit this world
      // is searched all the same, its model and training checked on one rank.
      std::string own;
      try {
        Config c = config;
        deck::validate(c, o.world);
      } catch (const Error& e) {
        own = e.what();
      }
      if (!own.empty()) {
        Config neutral = config;
        neutral.parallel.tp = neutral.parallel.pp = neutral.parallel.cp = 1;
        neutral.parallel.ep = neutral.parallel.dp = neutral.parallel.virtual_stages = 1;
        neutral.parallel.zero = 0;
        neutral.parallel.sequence_parallel = false;
        neutral.parallel.pp_schedule = "1f1b";
        std::fill(neutral.parallel.pp_layers.begin(), neutral.parallel.pp_layers.end(), 0);
        neutral.train.micro_batch = 1;
        deck::validate(neutral, 1);
        std::fputs(cat("the deck's own layout is not one of ", o.world, " ranks (", own,
                       "): searching them all\n")
                       .c_str(),
                   stdout);
        search_layouts(o, neutral, o.world, o.ranks_per_node ? o.ranks_per_node : 1);
        return kExitOk;
      }
    }
    deck::validate(config, o.world);
    config = with_balanced_split(config, o.world);
    Layout layout(GridShape::from_config(config), o.world, o.ranks_per_node ? o.ranks_per_node : 1);
    layout.check_topology(config.parallel.strict_topology);
    std::fputs(parallel::plan_report(config, layout, {o.memory, o.bandwidth}).c_str(), stdout);
    if (o.search) search_layouts(o, config, o.world, o.ranks_per_node ? o.ranks_per_node : 1);
    return kExitOk;
  }
  Config config = deck::load(MPI_COMM_WORLD, o.deck, o.overrides, world_size, o.machine);
  if (auto w = deck::no_keys_warning(config, o.overrides.size()); !w.empty()) log::warn(w);
  config = with_balanced_split(config, world_size);
  Grid grid(MPI_COMM_WORLD, GridShape::from_config(config), config.parallel.strict_topology);
  log::info(parallel::plan_report(config, grid.layout(), {o.memory, o.bandwidth}));
  if (o.search) {
    std::string error;
    if (world_rank == 0) {
      try {
        search_layouts(o, config, world_size, grid.layout().max_ranks_per_node());
      } catch (const Error& e) {
        error = e.what();
      }
    }
    mpi::agree(MPI_COMM_WORLD, error, kExitInput);
  }
  return kExitOk;
}

// This rank's threads (backend%threads): the node's cores shared among the ranks on it
// unless the deck says otherwise, never more threads than cores.
int threads_for(const Config& config, const Grid& grid) {
  if (config.backend.threads > 0) return int(config.backend.threads);
  int ranks_here = 0;
  MPI_Comm_size(grid.node_comm(), &ranks_here);
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks_here));
}

// This rank's GPU in a CUDA build (-1 in a CPU build): its rank among its node's ranks, round
// robin over the GPUs it sees. Where CUDA_VISIBLE_DEVICES leaves each rank its own GPU (Slurm's
// --gpus-per-task) that is device 0 for all, and distinct. Two ranks of a node on one GPU (by
// PCI bus id) are refused, every rank alike, unless backend%share_gpus (then one line says
// that every group uses MPI).
int device_for(const Config& config, const Grid& grid) {
#ifdef PTRAIN_ENABLE_CUDA
  int gpus = 0;
  const cudaError_t rc = cudaGetDeviceCount(&gpus);
  const int rank = mpi::rank(MPI_COMM_WORLD), mine = mpi::rank(grid.node_comm());
  std::string error, bus;
  if (rc != cudaSuccess || gpus == 0) {
    error = cat("rank ", rank, ": no CUDA device is visible (", cudaGetErrorString(rc),
                "); backend%device = 'cuda' needs one GPU a rank");
  } else {
    char id[32] = {};
    if (cudaDeviceGetPCIBusId(id, int(sizeof id), mine % gpus) == cudaSuccess) bus = id;
  }
  const std::vector<std::string> buses = mpi::all_gather(grid.node_comm(), bus);
  int sharing = 0;
  for (const std::string& b : buses) sharing += !bus.empty() && b == bus;
  if (error.empty() && sharing > 1 && !config.backend.share_gpus) {
    error = cat(sharing, " ranks on ", mpi::host_name(), " would share GPU ", bus, " (",
                buses.size(), " ranks, ", gpus, " GPU(s) visible to rank ", rank,
                "): start one rank per GPU, or set backend%share_gpus = .true. (tests)");
  }
  mpi::agree(MPI_COMM_WORLD, error, kExitInput);
  // Shared on purpose: NCCL takes no two ranks of one GPU, so the trainer gives every group
  // MPI (parallel/trainer.cpp, choice()); one line says so.
  const std::int64_t most = mpi::max(MPI_COMM_WORLD, std::int64_t(sharing));
  if (most > 1 && rank == 0)
    log::warn(cat("backend%share_gpus: up to ", most,
                  " ranks share a GPU; NCCL needs one GPU per rank, so every group uses MPI"));
  return mine % gpus;
#else
  (void)config, (void)grid;
  return -1;
#endif
}

// Kokkos with `threads` host threads (an OpenMP or Threads backend takes them; Serial runs on
// one) and Kokkos' own warnings off (its OpenMP backend warns on every rank when
// OMP_PROC_BIND is unset). Kokkos 3.7 replaced InitArguments by InitializationSettings
// (Kokkos 4 has only the latter): the one Kokkos version test in the code.
struct KokkosScope {
  KokkosScope(int threads, int device) {
#if KOKKOS_VERSION >= 30700
    Kokkos::InitializationSettings settings;
    settings.set_num_threads(threads).set_disable_warnings(true);
    if (device >= 0) settings.set_device_id(device);
    Kokkos::initialize(settings);
#else
    Kokkos::InitArguments args;
    args.num_threads = threads;
    args.disable_warnings = true;
    if (device >= 0) args.device_id = device;
    Kokkos::initialize(args);
#endif
    device_guard::install();
  }
  ~KokkosScope() { Kokkos::finalize(); }
  KokkosScope(const KokkosScope&) = delete;
  KokkosScope& operator=(const KokkosScope&) = delete;
};

// BLAS and the host kernels take turns on the same cores (gemm fences the kernels first), so
// both get the rank's threads: backend%blas_threads overrides BLAS's share.
int blas_threads_for(const Config& config, int threads) {
  return config.backend.blas_threads > 0 ? int(config.backend.blas_threads) : threads;
}

// The gemm MFU is measured against: the compute type's (a bf16 run's gemms take bf16
// operands; fp32 and fp64 runs are measured against sgemm, as before).
Precision probe_precision(const Config& config) {
  return deck::precision_policy(config).compute == Precision::bf16 ? Precision::bf16
                                                                   : Precision::fp32;
}
const char* probe_name(Precision p) { return p == Precision::bf16 ? "bf16 gemm" : "sgemm"; }

// Sets this rank's BLAS threads and returns the per-rank peak MFU is measured against:
// backend%peak_gflops, or a gemm probe of the compute type.
double peak_gflops(const Config& config, int threads, bool bench) {
  const int blas = blas_threads_for(config, threads);
  kernels::set_blas_threads(blas);
  const int kernel_threads = kernels::host_threads();
  log::info(cat("threads: ", threads, " per rank; host kernels on ", kernels::host_threads_name(),
                " with ", kernel_threads, ", BLAS ", blas, " (", kernels::blas_name(), ")"));
  if (auto w = kernels::blas_spin_warning(kernel_threads, blas); !w.empty()) log::warn(w);
  if (config.backend.peak_gflops > 0) return config.backend.peak_gflops;
  const Precision probe = probe_precision(config);
  const double peak = kernels::measure_gemm_peak_gflops(bench ? 2.0 : 0.3, probe);
  log::info(cat("peak: ", probe_name(probe), " probe (", kernels::gemm_probe_shape(), ", ", blas,
                " BLAS thread(s) per rank) = ", fixed("%.1f", peak),
                " GFLOP/s per rank; MFU is measured against it"));
  return peak;
}

// --bench probes again after the steps, for comparison: a shared node's speed drifts over a
// run. The done line stays against the probe before the steps (`before`), as the step lines
// are; this line gives the rank's GFLOP/s against the probe after them.
void log_probe_after(const Config& config, double before, double gflops_per_rank) {
  const Precision probe = probe_precision(config);
  const double after = kernels::measure_gemm_peak_gflops(2.0, probe);
  log::info(cat("peak: ", probe_name(probe), " probe after the steps = ", fixed("%.1f", after),
                " GFLOP/s per rank (before them ", fixed("%.1f", before),
                "); against it the steps ran at ", fixed("%.1f%%", 100 * gflops_per_rank / after)));
}

template <class P>
void log_model_and_data(const Config& config, const parallel::Trainer<P>& trainer) {
  std::int64_t held = 0;
  for (const auto& layout : trainer.layouts()) held += layout.numel;
  log::info(cat("model: ", model::global_parameter_count(config), " parameters, ",
                config.model.dtype, ", rank 0 holds ", held, " in ", trainer.chunks(),
                trainer.chunks() == 1 ? " flat buffer" : " flat buffers (chunks)"));
  log::info(cat("data: ", trainer.data().describe()));
  log::info(cat("comm: rank 0's groups: ", trainer.transports()));
  if (auto floor = trainer.data().entropy_floor())
    log::info(cat("data: entropy floor of the synthetic process = ", fixed("%.4f", *floor),
                  " nats/token (the best achievable loss)"));
}

// Rank 0's measured peak of every memory category, with --plan's prediction for its shard
// beside it.
void log_memory_peaks(const Config& config, const Grid& grid) {
  const MemoryStats m = memory::stats();
  const parallel::MemoryEstimate plan = parallel::estimate_memory(
      config, parallel::plan_shard(config, 0, 0, 0, grid.ranks_per_node()));
  std::string parts;
  for (std::size_t c = 0; c < std::size_t(MemCategory::count); ++c)
    parts += cat(c ? ", " : "", to_string(MemCategory(c)), " ", format_bytes(double(m.peak[c])),
                 " (plan ", format_bytes(plan.bytes[c]), ")");
  log::info(cat("memory: peak ", format_bytes(double(m.total_peak)),
                " on rank 0 (by category, each at its own peak: ", parts, "); plan total ",
                format_bytes(plan.total()), " (the categories' peaks summed)"));
}

// The run's mean step and its parts (steps after the first), beside the cost model's.
struct MeasuredStep {
  double step = 0, forward = 0, backward = 0, optimizer = 0, bubble = 0;
  int steps = 0;
  void add(const parallel::StepResult& r) {
    step += r.t_step, forward += r.t_forward, backward += r.t_backward;
    optimizer += r.t_optimizer, bubble += r.bubble;
    ++steps;
  }
  // "cost model: measured step 0.412 s (forward 0.12, ...), predicted 0.398 s: 1.04 times"
  std::string against(const parallel::StepPrediction& p) const {
    const double n = double(steps);
    return cat("cost model: measured step ", fixed("%.4g", step / n), " s (forward ",
               fixed("%.3g", forward / n), ", backward ", fixed("%.3g", backward / n),
               ", optimizer ", fixed("%.3g", optimizer / n), ", bubble ",
               fixed("%.1f%%", 100 * bubble / n), "; rank 0, communication inside), predicted ",
               fixed("%.4g", p.step), " s (forward ", fixed("%.3g", p.forward), ", backward ",
               fixed("%.3g", p.backward + p.recompute), ", optimizer ", fixed("%.3g", p.optimizer),
               ", bubble ", fixed("%.1f%%", 100 * p.bubble), "): measured ",
               fixed("%.2f", step / n / p.step), " times the prediction");
  }
};

// run%trace: every rank's timeline from construction on (time zero just after a barrier).
class RunTrace {
 public:
  RunTrace(const Config& config, const Grid& grid)
      : on_(config.run.trace), dir_(config.run.out_dir + "/trace"), rank_(grid.world_rank()) {
    if (on_ && log::rank() == 0) std::filesystem::create_directories(dir_);
    trace::start(MPI_COMM_WORLD, on_);
  }
  void write() const {
    if (!on_) return;
    trace::write(dir_, rank_);
    log::info(cat("trace: per-rank timelines in ", dir_,
                  "/rank*.csv (postprocess/plot_schedule.py draws them)"));
  }

 private:
  bool on_;
  std::string dir_;
  int rank_;
};

// What a run's steps add up to: the last losses, and over the steps after the first (the
// first pays for first touch) the tokens, the step seconds and the cost model's measurement.
struct RunTotals {
  double last_loss = std::nan(""), last_val = std::nan("");
  double tokens = 0, busy = 0;
  std::int64_t profiled_steps = 0;  // --bench's, the first excluded
  MeasuredStep measured;
};

// The end of a run: the cost model against the measured steps, the memory peaks, the probe
// after the steps (--bench), the done line and --bench's kernel table.
void log_run_end(const Config& config, const Grid& grid, double peak, bool bench,
                 const RunTotals& t, const parallel::StepPrediction& predicted, double seconds) {
  const int world = grid.world_size();
  const double tok_s = t.busy > 0 ? t.tokens / t.busy : 0;
  const double gflops = model::flops_per_token(config) * tok_s / 1e9;
  if (t.measured.steps > 0) log::info(t.measured.against(predicted));
  log_memory_peaks(config, grid);  // before the second probe, whose buffers are not the run's
  if (bench && config.backend.peak_gflops <= 0) log_probe_after(config, peak, gflops / world);
  log::info(
      cat("done: ", config.run.steps, " steps in ", format_duration(seconds), "; final loss ",
          fixed("%.4f", t.last_loss),
          std::isnan(t.last_val) ? std::string() : cat(", val loss ", fixed("%.4f", t.last_val)),
          "; ", fixed("%.0f", tok_s), " tok/s, ", fixed("%.1f", gflops), " GFLOP/s = ",
          fixed("%.1f%%", 100 * gflops / (peak * world)), " of peak (steps after the first)"));
  if (bench)
    log::info(parallel::bench_report(t.busy / std::max<double>(1, double(t.profiled_steps)),
                                     t.profiled_steps));
}

template <class P>
int train(const Config& config, const Grid& grid, int threads, bool bench) {
  const double peak = peak_gflops(config, threads, bench);
  memory::reset_peaks();  // the sgemm probe's buffers are gone: the peaks are the run's
  parallel::Trainer<P> trainer(config, grid);
  log_model_and_data(config, trainer);

  ckpt::initialise(config, grid, trainer);  // init_from, or from the seed
  const std::int64_t done = ckpt::resume(config, grid, trainer);
  ckpt::Checkpoints<P> checkpoints(config, grid, trainer);
  const RunTrace trace(config, grid);

  parallel::RunLog runlog(config, peak, grid.world_size(), done + 1);
  const double t0 = wall_seconds();
  RunTotals totals;
  const parallel::Machine machine = parallel::machine_of(config);
  const parallel::StepPrediction predicted = parallel::predict_step(config, grid.layout(), machine);
  log::info(cat("cost model: predicted ", parallel::describe_prediction(predicted), " (",
                parallel::describe_machine(machine), ")"));
  for (std::int64_t s = done + 1; s <= config.run.steps; ++s) {
    profile::enable(bench && s > done + 1);  // --bench: kernel breakdown, first step excluded
    totals.profiled_steps += profile::enabled() ? 1 : 0;
    const auto r = runlog.measure([&] { return trainer.step(s); });
    profile::enable(false);
    totals.last_loss = r.loss;
    parallel::Validation val;
    const bool eval_now =
        (config.run.eval_every > 0 && s % config.run.eval_every == 0) || s == config.run.steps;
    if (eval_now && trainer.can_evaluate()) {
      val = trainer.evaluate();
      totals.last_val = val.loss;
    }
    if (s > done + 1 || config.run.steps == done + 1) {  // the first step pays for first touch
      totals.tokens += double(r.tokens);
      totals.busy += r.t_step;
      totals.measured.add(r);
    }
    runlog.step(r, val, wall_seconds() - t0);
    checkpoints.poll(s);  // a background write that has ended: logged, or its error thrown
    const bool periodic = config.checkpoint.every > 0 && s % config.checkpoint.every == 0;
    const int sig = signals::agreed_stop_signal(MPI_COMM_WORLD);
    // run%consistency_every: replicas agree before any checkpoint is written from this state.
    const std::int64_t every = config.run.consistency_every;
    if (every > 0 && (s % every == 0 || periodic || sig)) trainer.check_replicas(s);
    if (periodic || sig) checkpoints.save(s, r.lr, totals.last_val);
    if (sig) {
      checkpoints.wait(s);  // the stop's checkpoint is on disk before the job ends
      trace.write();
      log::info(cat("stopped by signal ", sig, " after step ", s, " of ", config.run.steps,
                    "; resume with --set checkpoint%restart='latest'"));
      return kExitOk;
    }
  }
  checkpoints.wait(config.run.steps);
  trace.write();
  if (done >= config.run.steps)
    log::info(cat("restart: the checkpoint is at step ", done, " of ", config.run.steps,
                  "; nothing left to train"));

  if (config.checkpoint.save_final) {
    trainer.check_replicas(std::max(done, config.run.steps));  // unless that step was checked
    ckpt::save_final(config, grid, trainer);
  }
  log_run_end(config, grid, peak, bench, totals, predicted, wall_seconds() - t0);
  return kExitOk;
}

// `ptrain --calibrate`: the deck's &machine group measured on these ranks (parallel/calibrate.hpp),
// written by rank 0 to --write-machine or run%out_dir/machine.nml.
int calibrate_machine(const Options& o, const Config& config, const Grid& grid, int threads) {
  kernels::set_blas_threads(blas_threads_for(config, threads));
  const std::string path =
      o.write_machine.empty() ? config.run.out_dir + "/machine.nml" : o.write_machine;
  log::info(cat("calibrate: measuring this machine for ", config.deck_path, " on ",
                grid.world_size(), " rank(s); the &machine group goes to ", path));
  const Config measured = parallel::calibrate(config, grid, threads);
  std::string error;
  if (grid.world_rank() == 0) {
    try {
      write_user_file(
          path,
          cat("! ptrain machine file (ptrain --calibrate): use it with --machine ", path,
              " (--plan, --plan --search, a run); rates at 0 take the node class's\n",
              deck::echo_group(measured, "machine")),
          "--write-machine");
    } catch (const Error& e) {
      error = e.what();
    }
  }
  mpi::agree(MPI_COMM_WORLD, error, kExitInput);
  log::info(cat("calibrate: wrote ", path, "\n", deck::echo_group(measured, "machine")));
  return kExitOk;
}

// The plan's verdict before anything is allocated: every shard against the memory a rank has
// (--memory, or this node's memory over the ranks on it; the least over the nodes, so every
// rank judges alike). A deck that does not fit stops here on every rank, exit 2, with the
// changes that would make it fit.
void check_fits(const Config& config, const Grid& grid, const Options& o) {
  int ranks_here = 0;
  MPI_Comm_size(grid.node_comm(), &ranks_here);
  parallel::MemoryBudget budget =
      parallel::memory_budget(config, {o.memory, o.bandwidth}, ranks_here);
  MPI_Allreduce(MPI_IN_PLACE, &budget.bytes, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  const std::string refusal = parallel::fit_refusal(config, grid.layout(), budget, o.bandwidth);
  if (!refusal.empty()) throw Error(refusal, kExitInput);
}

int run(int argc, char** argv, int world_rank, int world_size) {
  const Options o = parse_args(argc, argv);
  if (o.help) {
    log::info(kUsage);
    return kExitOk;
  }
  if (o.version) {
    log::info(cat("ptrain ", PTRAIN_VERSION));
    return kExitOk;
  }
  if (o.help_deck) {
    log::info(deck::help_deck());
    return kExitOk;
  }
  if (o.plan) {
    signals::restore_default_handlers();  // a login-node tool: SIGTERM ends it
    return run_plan(o, world_rank, world_size);
  }

  Config config = deck::load(MPI_COMM_WORLD, o.deck, o.overrides, world_size, o.machine);
  if (auto w = deck::no_keys_warning(config, o.overrides.size()); !w.empty()) log::warn(w);
  config = with_balanced_split(config, world_size);
  Grid grid(MPI_COMM_WORLD, GridShape::from_config(config), config.parallel.strict_topology);
  parallel::check_supported(config);              // before Kokkos starts on a device
  const int threads = threads_for(config, grid);  // the deck and the node map decide them
  KokkosScope kokkos(threads, device_for(config, grid));
  kernels::set_host_threads(threads);  // a Serial Kokkos: ptrain's own OpenMP threads
  kernels::set_gemm_tf32(config.backend.tf32);
  if (config.backend.kernels != "auto")
    kernels::set_kernel_shape(config.backend.kernels == "device" ? kernels::KernelShape::device
                                                                 : kernels::KernelShape::host);
  log::info(cat("ptrain ", PTRAIN_VERSION, ": ", config.run.name, " from ", config.deck_path,
                " on ", world_size, " rank(s)"));
  log::info(grid.describe());
  watchdog::start(MPI_COMM_WORLD, config.run.hang_timeout);
  if (o.calibrate) return calibrate_machine(o, config, grid, threads);
  const model::Dims dims = model::dims_of(config);
  if (dims.Vpad != dims.V)
    log::info(cat("model: vocab ", dims.V, " padded to ", dims.Vpad, " (a multiple of tp = ",
                  config.parallel.tp, "); padded rows never win the softmax"));
  ckpt::FolderLocks locks;  // this run's folders are its own until run() ends, however it ends
  ckpt::check_writable(config, MPI_COMM_WORLD);  // out_dir and checkpoint%dir, before step 1
  std::string unwritten;
  if (world_rank == 0) {
    const std::string echo = deck::echo(config), path = config.run.out_dir + "/deck.nml";
    std::ofstream out(path);
    if (!(out << echo).flush())
      unwritten =
          cat(path, ": cannot write the resolved deck: ", std::strerror(errno ? errno : EIO));
    else
      log::info("resolved deck (also in " + path + "):\n" + echo);
  }
  mpi::agree(MPI_COMM_WORLD, unwritten, kExitRuntime);
  check_fits(config, grid, o);  // before the trainer allocates anything
  // The one switch on the precision policy: everything below is instantiated per policy.
  const PrecisionPolicy policy = deck::precision_policy(config);
  if (policy.compute == Precision::fp64) return train<Fp64>(config, grid, threads, o.bench);
  if (policy.compute == Precision::fp32) return train<Fp32>(config, grid, threads, o.bench);
  if (policy.grad == Precision::bf16) return train<Bf16Grads>(config, grid, threads, o.bench);
  return train<Bf16>(config, grid, threads, o.bench);
}

// MPI around run(): one rank's fault aborts the job; an error raised on every rank alike is
// printed once and ends the job cleanly with its code (rank 0's exit status).
int guarded_main(int argc, char** argv) {
  signals::install_stop_handlers();  // a stop signal during set-up is a request, not a kill
  // The main thread calls MPI, and with checkpoint%async a checkpoint's writing thread too
  // (over its own communicator); Kokkos' OpenMP threads never do. A library that provides less
  // refuses only checkpoint%async (ckpt::Checkpoints).
  int provided = 0;
  device_guard::prepare_mpi();
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  log::set_rank(rank);
  int code = kExitOk;
  try {
    code = run(argc, argv, rank, size);
  } catch (const Error& e) {
    // Errors raised on every rank alike (the user's input, a diverged step): report once,
    // exit cleanly. One rank's error aborts the job so the others cannot hang.
    // Only the rank that prints exits with the error's code: a launcher that sees another
    // rank's non-zero exit first (Open MPI's mpirun) tears the job down at once and may drop
    // rank 0's line still on its way. mpirun, mpiexec (Hydra) and srun return rank 0's code.
    if (e.on_all_ranks()) {
      if (rank == 0) std::fprintf(stderr, "%s\n", e.what());
      MPI_Finalize();
      return rank == 0 ? e.exit_code() : kExitOk;
    }
    mpi::abort_job(e.what(), e.exit_code());
  } catch (const std::exception& e) {
    mpi::abort_job(cat("internal error: ", e.what()), kExitRuntime);
  }
  MPI_Finalize();
  return code;
}

}  // namespace
}  // namespace ptrain

int main(int argc, char** argv) { return ptrain::guarded_main(argc, argv); }
