#include "ckpt/training.hpp"

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <type_traits>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/common.hpp"
#include "ckpt/lock.hpp"
#include "ckpt/weights.hpp"
#include "deck/deck.hpp"
#include "model/layout.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/memory.hpp"
#include "util/mpi.hpp"
#include "util/staging.hpp"
#include "util/version.hpp"

namespace ptrain::ckpt {

namespace {

// "3.21"
std::string fixed_seconds(double seconds) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f", seconds);
  return s;
}

// A loss to the last bit: "3.4817028045654297"
std::string fixed_17(double x) {
  char s[40];
  std::snprintf(s, sizeof s, "%.17g", x);
  return s;
}

// "1.40 GiB in 3.21 s = 445.12 MiB/s"
std::string rate(double bytes, double seconds) {
  return cat(format_bytes(bytes), " in ", fixed_seconds(seconds),
             " s = ", format_bytes(seconds > 0 ? bytes / seconds : 0), "/s");
}

// "-> out/final.h5 (1.40 GiB in 3.21 s = 445.12 MiB/s written, verified in 1.02 s)"
std::string saved(const SaveReport& r) {
  return cat("-> ", r.path, " (", rate(double(r.file_bytes), r.write_seconds),
             " written, verified in ", fixed_seconds(r.verify_seconds), " s)");
}

// Weights files: one holder of every element, the first data-parallel replica (for expert
// tensors, split over ep, the first replica of each ep rank), and for tensors every tp rank
// holds whole, tp rank 0.
TensorPredicate weights_holder(const Grid& grid) {
  const bool first_dc = grid.coord(Axis::d) == 0 && grid.coord(Axis::c) == 0;
  const bool first_replica = first_dc && grid.coord(Axis::e) == 0;
  const bool tp_root = grid.coord(Axis::t) == 0;
  return [first_dc, first_replica, tp_root](const model::TensorSpec& t) {
    return (t.expert ? first_dc : first_replica) && (tp_root || !t.tp_replicated());
  };
}

// Checkpoints: each rank owns the parameters and AdamW moments over its optimizer range
// (the whole chunk under ZeRO 0, its shard otherwise). One holder writes each element: any
// rank under ZeRO >= 1 (shards are disjoint; with zero_scope = 'node' the first replica of
// each), the first replica under ZeRO 0; tp rank 0 for tensors every tp rank holds whole.
template <class P>
TensorPredicate state_holder(const Config& config, const Grid& grid,
                             parallel::Trainer<P>& trainer) {
  const bool sharded = config.parallel.zero >= 1;
  const bool first_of_shard = trainer.data_parallel(0).replica() == 0;
  const bool first_dc = grid.coord(Axis::d) == 0 && grid.coord(Axis::c) == 0;
  const bool first_replica = first_dc && grid.coord(Axis::e) == 0;
  const bool tp_root = grid.coord(Axis::t) == 0;
  return [=](const model::TensorSpec& t) {
    return (sharded ? first_of_shard : (t.expert ? first_dc : first_replica)) &&
           (tp_root || !t.tp_replicated());
  };
}

// What this rank owns of the master weights and, with `moments`, of the optimizer's moments
// (the policy's master type: fp32 in a bf16 run, so checkpoints keep their format), staged on
// the host for the writer or reader (util/staging.hpp: the tensors themselves on a CPU build,
// host copies of them on a GPU, written back when a load's OwnedState ends). V is the
// element type the writer or reader sees (const for writing).
template <class V>
struct OwnedState {
  using T = std::remove_const_t<V>;
  std::vector<std::unique_ptr<staging::HostView<T>>> staged;
  Buffers<V> buffers;

  V* stage(const Kokkos::View<T*>& tensor, std::size_t at, std::size_t n) {
    const auto access = std::is_const_v<V> ? staging::Access::read : staging::Access::read_write;
    staged.push_back(std::make_unique<staging::HostView<T>>(
        Kokkos::subview(tensor, Kokkos::make_pair(at, at + n)), access));
    return staged.back()->data();
  }
};

template <class V, class P>
OwnedState<V> owned_state(parallel::Trainer<P>& trainer, bool moments = true) {
  OwnedState<V> s;
  Buffers<V>& b = s.buffers;
  b.moments = moments && !trainer.optimizer(0).state().empty();
  for (int c = 0; c < trainer.chunks(); ++c) {
    auto& dp = trainer.data_parallel(c);
    // One range per piece of the update (two or more with experts sharded apart).
    for (const auto& p : dp.update_pieces()) {
      const auto lo = std::size_t(p.lo), hi = std::size_t(p.hi), at = std::size_t(p.at);
      b.params.push_back({s.stage(dp.update_params(), at, hi - lo), lo, hi, c});
      if (b.moments)
        for (const auto& [name, view] : trainer.optimizer(c).state())
          (name == "m" ? b.m : b.v).push_back({s.stage(view, at, hi - lo), lo, hi, c});
    }
  }
  return s;
}

// Why `dir` is no folder to write in, or "". With `create` it is made when missing; without,
// its nearest existing ancestor must take new entries (it is made at the first save).
std::string folder_unusable(const std::string& dir, bool create) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path at = dir;
  while (!at.empty() && !fs::exists(at, ec)) at = at.parent_path();
  if (at.empty()) at = ".";
  if (!fs::is_directory(at, ec))
    return cat(at.string(),
               fs::is_regular_file(at, ec) ? " is a file, not a folder" : " is not a folder");
  if (create && !fs::exists(dir, ec)) {
    fs::create_directories(dir, ec);
    if (ec) return cat("cannot create it: ", ec.message());
    at = dir;
  }
  // Permission bits do not tell (root ignores them, a read-only mount does not show): try.
  std::string probe = (at / ".ptrain-probe-XXXXXX").string();
  const int fd = mkstemp(probe.data());
  if (fd < 0) return cat("cannot write in ", at.string(), ": ", std::strerror(errno));
  close(fd);
  unlink(probe.c_str());
  return {};
}

// Reads the user's file (init_from, restart): a problem any rank finds becomes every
// rank's, and the user's to fix: exit code 2, printed once.
template <class R, class F>
R users_file(F&& read) {
  R result{};
  try {
    mpi::agree_on(MPI_COMM_WORLD, [&] { result = read(); });
  } catch (const Error& e) {
    throw Error(e.what(), kExitInput);
  }
  return result;
}

}  // namespace

std::string checkpoint_dir(const Config& config) {
  const std::string& d = config.checkpoint.dir;
  return !d.empty() && d[0] == '/' ? d : config.run.out_dir + "/" + d;
}

namespace {
// "ckpt_00000004.h5, ckpt_00000002.h5" (at most 3 named)
std::string listed(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < 3; ++i) out += cat(i ? ", " : "", names[i]);
  return names.size() > 3 ? cat(out, " and ", names.size() - 3, " more") : out;
}

// Rank 0: why this run may not use the checkpoints in its folder, or "". A fresh run that writes
// checkpoints would prune another run's: refused, unless checkpoint%overwrite (then they are
// removed here). restart = 'latest' without `latest` in a folder of checkpoints would start
// from step 0 and prune them: refused.
std::string checkpoints_problem(const Config& config) {
  const std::string dir = checkpoint_dir(config);
  const std::string& restart = config.checkpoint.restart;
  std::error_code ec;
  if (restart == "latest" &&
      std::filesystem::exists(std::filesystem::symlink_status(dir + "/latest", ec))) {
    try {  // a `latest` that names no file is found here, before anything is written
      resolve_checkpoint(restart, dir);
      return "";
    } catch (const Error& e) {
      return cat("checkpoint%restart = 'latest': ", e.what());
    }
  }
  if (!restart.empty() && restart != "latest") return "";
  if (restart.empty() && config.checkpoint.every == 0) return "";
  const std::vector<std::string> found = checkpoints_in(dir);
  if (found.empty()) return "";
  if (restart == "latest")
    return cat("checkpoint%restart = 'latest': ", dir, " has no `latest` pointer but holds ",
               listed(found), "; name one (checkpoint%restart = '", dir, "/", found[0],
               "'), or move them away to start afresh");
  if (!config.checkpoint.overwrite)
    return cat("checkpoint%dir ", dir, " holds checkpoints of an earlier run (", listed(found),
               "): set checkpoint%restart = 'latest' to continue it, checkpoint%overwrite = "
               ".true. to remove them, or choose another folder");
  for (const std::string& n : found) std::filesystem::remove(dir + "/" + n, ec);
  std::filesystem::remove(dir + "/latest", ec);
  log::info(cat("checkpoint: removed ", found.size(), " checkpoint(s) of an earlier run from ", dir,
                " (checkpoint%overwrite)"));
  return "";
}
}  // namespace

namespace {
// A file the run will write, with a generous size worked out from the deck alone.
struct PlannedFile {
  const char* key;         // the deck key that asks for it
  std::string what;        // "a checkpoint in <folder>", "<out_dir>/final.h5"
  std::string folder;      // where it goes
  const char* folder_key;  // the deck key that chooses the folder
  double bytes;
};

// A checkpoint (checkpoint%every > 0) holds the parameters and AdamW's m and v in the master
// type (fp64 in an fp64 run, fp32 otherwise) and /state's five scalars; final.h5
// (checkpoint%save_final) the parameters.
std::vector<PlannedFile> planned_files(const Config& config) {
  const double params = double(model::global_parameter_count(config));
  const auto tensors = std::size_t(model::global_tensor_count(config));
  const double elem = deck::precision_policy(config).master == Precision::fp64 ? 8 : 4;
  const std::map<std::string, std::string> attributes{{"deck", deck::echo(config)}};
  auto bytes = [&](std::size_t copies, std::size_t scalars) {
    const double data = std::min(params * elem * double(copies) + 8.0 * double(scalars), 4e18);
    return double(
        detail::estimated_file_bytes(std::int64_t(data), tensors * copies + scalars, attributes));
  };
  std::vector<PlannedFile> out;
  if (config.checkpoint.every > 0)
    out.push_back({"checkpoint%every", cat("a checkpoint in ", checkpoint_dir(config)),
                   checkpoint_dir(config), "checkpoint%dir",
                   bytes(config.train.optimizer == "adamw" ? 3 : 1, 5)});
  if (config.checkpoint.save_final)
    out.push_back({"checkpoint%save_final", config.run.out_dir + "/final.h5", config.run.out_dir,
                   "run%out_dir", bytes(1, 0)});
  return out;
}

// A file that can never be written (larger than its file system, or than a rank's file size
// limit) is refused before step 1, not found at its first save; one larger than the space free
// now is said in one line. Collective over comm.
void check_file_sizes(const Config& config, MPI_Comm comm) {
  std::string error;
  for (const PlannedFile& f : planned_files(config)) {
    if (!error.empty()) break;
    const std::string file = cat(f.key, ": ", f.what, " (about ", format_bytes(f.bytes), ")");
    if (auto limit = detail::file_size_limit_problem(std::int64_t(f.bytes)); !limit.empty()) {
      error = cat(file, " cannot be written: ", limit);
      break;
    }
    std::filesystem::path at = f.folder;
    std::error_code ec;
    while (!at.empty() && !std::filesystem::exists(at, ec)) at = at.parent_path();
    struct statvfs fs {};
    if (mpi::rank(comm) != 0 || statvfs(at.empty() ? "." : at.c_str(), &fs) != 0) continue;
    const double total = double(fs.f_blocks) * double(fs.f_frsize);
    const double free = double(fs.f_bavail) * double(fs.f_frsize);
    if (f.bytes > total)
      error = cat(file, " can never fit: the file system there holds ", format_bytes(total),
                  " in all; choose a folder on a larger one (", f.folder_key, ")");
    else if (f.bytes > free)
      log::warn(cat(file, " is larger than the ", format_bytes(free),
                    " free there now: it will not be written unless space is freed first"));
  }
  mpi::agree(comm, error, kExitInput);
}
}  // namespace

void check_writable(const Config& config, MPI_Comm comm) {
  std::string error;
  if (mpi::rank(comm) == 0) {
    // Each folder is locked (ckpt/lock.hpp) before anything in it is written or removed.
    auto check = [&](const char* key, const std::string& dir, bool create) {
      const std::string problem = folder_unusable(dir, create);
      if (error.empty() && !problem.empty()) error = cat(key, " folder '", dir, "': ", problem);
      std::error_code ec;
      if (error.empty() && std::filesystem::is_directory(dir, ec)) error = lock_folder(key, dir);
    };
    check("run%out_dir", config.run.out_dir, true);
    check("checkpoint%dir", checkpoint_dir(config), config.checkpoint.every > 0);
    if (error.empty()) error = checkpoints_problem(config);
  }
  mpi::agree(comm, error, kExitInput);
  check_file_sizes(config, comm);
}

template <class P>
void initialise(const Config& config, const Grid& grid, parallel::Trainer<P>& trainer) {
  using T = typename P::master;
  if (config.model.init_from.empty()) {
    for (int c = 0; c < trainer.chunks(); ++c)
      trainer.data_parallel(c).init_weights(std::uint64_t(config.run.seed));
    return;
  }
  LoadReport report;
  const auto layouts = trainer.layouts();
  std::vector<std::vector<T>> whole;
  std::vector<T*> out;
  for (const auto& layout : layouts) {
    whole.emplace_back(std::size_t(layout.numel));
    out.push_back(whole.back().data());
  }
  users_file<bool>([&] {
    load_weights<T>(config.model.init_from, MPI_COMM_WORLD, layouts, out, weights_holder(grid),
                    &report);
    return true;
  });
  for (int c = 0; c < trainer.chunks(); ++c)
    trainer.data_parallel(c).set_weights(whole[std::size_t(c)].data());
  log::info(cat("model: weights read from ", config.model.init_from, " (", report.file_dtype, ")"));
}

namespace {
// Where a restart's training stream goes on: the checkpoint's position when it was written for
// the same data; refused (exit 2) for other data unless data%allow_change, which keeps the
// sample count (and the per-dataset counts when the number of datasets is the same; else the
// blend's counts after that many samples). A checkpoint from before data fingerprints goes on
// at its sample count in this deck's data, as the blend replays it.
data::Position data_position(const Config& config, const data::TokenSource& source,
                             const CheckpointState& state, const CheckpointLoadReport& report) {
  const std::string written =
      report.attributes.count("data") ? report.attributes.at("data") : std::string("unknown");
  if (!state.has_data) {
    log::warn(cat("restart: ", report.path,
                  " was written before checkpoints kept the data's fingerprint: its data is "
                  "not compared with this run's; going on at sample ",
                  state.consumed_samples));
  } else if (state.data_fingerprint != source.fingerprint()) {
    if (!config.data.allow_change)
      throw Error(cat("restart: ", report.path, " was written for other data (", written,
                      ") than this run reads (", source.describe(),
                      "); set data%allow_change = .true. to go on with this data at sample ",
                      state.consumed_samples),
                  kExitInput);
    log::warn(cat("restart: ", report.path, " was written for other data (", written,
                  "); data%allow_change: going on with this run's data at sample ",
                  state.consumed_samples));
  }
  data::Position at;
  if (state.has_data && int(state.dataset_samples.size()) == source.datasets()) {
    at.consumed = state.consumed_samples;
    at.per_dataset = state.dataset_samples;
  } else {
    at = data::position_after(source, state.consumed_samples);
  }
  const std::string where = data::describe_position(source, at);
  log::info(cat("data: going on at sample ", at.consumed, where.empty() ? "" : ", ", where));
  return at;
}
}  // namespace

template <class P>
std::int64_t resume(const Config& config, const Grid& grid, parallel::Trainer<P>& trainer) {
  using T = typename P::master;
  if (config.checkpoint.restart.empty()) return 0;
  if (config.checkpoint.restart == "latest") {
    // Rank 0 looks for everyone (check_writable has refused a folder of checkpoints without it).
    const bool here = log::rank() == 0 && std::filesystem::exists(std::filesystem::symlink_status(
                                              checkpoint_dir(config) + "/latest"));
    if (mpi::max(MPI_COMM_WORLD, here) == 0) {
      log::warn(cat("checkpoint%restart = 'latest' but ", checkpoint_dir(config),
                    " has no checkpoint yet: starting from step 0"));
      return 0;
    }
  }
  CheckpointLoadReport report;
  const auto state = users_file<CheckpointState>([&] {
    const OwnedState<T> owned = owned_state<T>(trainer);  // written back as it ends
    return load_checkpoint<T>(config.checkpoint.restart, checkpoint_dir(config), MPI_COMM_WORLD,
                              trainer.layouts(), owned.buffers, state_holder(config, grid, trainer),
                              &report);
  });
  for (int c = 0; c < trainer.chunks(); ++c) {
    trainer.data_parallel(c).finish_step();  // masters -> compute weights; ZeRO 1/2: gathered
    trainer.optimizer(c).set_t(state.optimizer_t);
  }
  if (state.seed != std::uint64_t(config.run.seed))
    throw Error(cat("restart: ", report.path, " was written with run%seed = ", state.seed,
                    ", this run has ", config.run.seed),
                kExitInput);
  auto attr = [&](const char* k) {
    return report.attributes.count(k) ? report.attributes.at(k) : std::string("?");
  };
  log::info(cat("restart: ", report.path, " at step ", state.step, " (written on ", attr("grid"),
                ", ZeRO ", attr("zero"), "); ", rate(double(report.bytes_read), report.seconds),
                " read"));
  trainer.set_data_position(data_position(config, trainer.data(), state, report));
  return state.step;
}

namespace {
// A checkpoint's root attributes: what wrote it, the data it read (shown when a restart refuses
// other data), and (keep_best) the validation loss.
std::map<std::string, std::string> checkpoint_attributes(const Config& config, const Grid& grid,
                                                         double val_loss, const std::string& data) {
  std::map<std::string, std::string> attrs{
      {"ptrain_version", PTRAIN_VERSION},    {"deck", deck::echo(config)},
      {"grid", grid.shape().str()},          {"zero", std::to_string(config.parallel.zero)},
      {"compute_dtype", config.model.dtype}, {"run", config.run.name}};
  if (!std::isnan(val_loss)) attrs[kValLossAttribute] = fixed_17(val_loss);
  attrs["data"] = data;
  return attrs;
}

// A host copy of what this rank writes into a checkpoint: of its owned ranges of the masters
// and moments, the parts of the tensors `holder` chooses (none on a ZeRO 0 replica that writes
// nothing). The rest of each range is allocated, never touched and never read.
template <class T>
struct Snapshot {
  std::vector<std::unique_ptr<T[]>> ranges;
  Buffers<const T> buffers;
  std::size_t bytes = 0;  // copied
  std::unique_ptr<detail::WorkspaceCharge> charge;
};

template <class T, class P>
Snapshot<T> take_snapshot(parallel::Trainer<P>& trainer, const TensorPredicate& holder) {
  Snapshot<T> s;
  Buffers<const T>& b = s.buffers;
  b.moments = !trainer.optimizer(0).state().empty();
  for (int c = 0; c < trainer.chunks(); ++c) {
    auto& dp = trainer.data_parallel(c);
    // view: what the optimizer updates (masters or moments); piece p of it -> a host range
    auto copy = [&](const Kokkos::View<T*>& view, const auto& p) {
      s.ranges.emplace_back(new T[std::size_t(p.hi - p.lo)]);  // uninitialised: not touched
      T* range = s.ranges.back().get();
      for (const auto& t : dp.layout().tensors) {
        const std::int64_t lo = std::max<std::int64_t>(p.lo, t.offset),
                           hi = std::min<std::int64_t>(p.hi, t.offset + t.numel);
        if (t.tied_copy || !holder(t) || lo >= hi) continue;
        const auto at = std::size_t(p.at + lo - p.lo), n = std::size_t(hi - lo);
        staging::copy_out<T>(Kokkos::subview(view, Kokkos::make_pair(at, at + n)),
                             range + (lo - p.lo), n);
        s.bytes += n * sizeof(T);
      }
      return const_cast<const T*>(range);
    };
    for (const auto& p : dp.update_pieces()) {
      const auto lo = std::size_t(p.lo), hi = std::size_t(p.hi);
      b.params.push_back({copy(dp.update_params(), p), lo, hi, c});
      if (b.moments)
        for (const auto& [name, view] : trainer.optimizer(c).state())
          (name == "m" ? b.m : b.v).push_back({copy(view, p), lo, hi, c});
    }
  }
  s.charge = std::make_unique<detail::WorkspaceCharge>(s.bytes);
  return s;
}
}  // namespace

// A checkpoint being written in the background: the snapshot it writes, the thread, and how
// the write ended (set by the thread before `done`).
template <class P>
struct Checkpoints<P>::Write {
  using T = typename P::master;
  std::int64_t step = 0;  // of the checkpoint
  Snapshot<T> snapshot;
  std::thread thread;
  std::atomic<bool> done{false};
  SaveReport report;
  std::optional<Error> error;
};

template <class P>
Checkpoints<P>::Checkpoints(const Config& config, const Grid& grid, parallel::Trainer<P>& trainer)
    : config_(config), grid_(grid), trainer_(trainer) {
  if (!config.checkpoint.async) return;
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_MULTIPLE)  // the same library on every rank: every rank refuses
    throw Error(
        "checkpoint%async = .true. needs an MPI library with MPI_THREAD_MULTIPLE (its writing "
        "thread calls MPI while training does), which this one does not provide; set it to "
        ".false.",
        kExitInput);
  // Never freed: freeing is collective, which an error path cannot promise; MPI_Finalize does.
  mpi::check(MPI_Comm_dup(MPI_COMM_WORLD, &io_comm_), "MPI_Comm_dup");
}

template <class P>
Checkpoints<P>::~Checkpoints() {
  if (!in_flight_) return;
  // Every rank's thread goes on with the same write, whatever ended this rank's steps; an I/O
  // fault that parts them is the I/O watchdog's to end.
  in_flight_->thread.join();
  if (!in_flight_->error)
    log::info(cat("checkpoint: step ", in_flight_->step, " ", saved(in_flight_->report),
                  ", in the background"));
}

template <class P>
void Checkpoints<P>::save(std::int64_t step, double lr, double val_loss) {
  using T = typename P::master;
  const data::Position& at = trainer_.data_position();
  CheckpointState state;
  state.step = step;
  state.consumed_samples = at.consumed;
  state.optimizer_t = trainer_.optimizer(0).t();
  state.seed = std::uint64_t(config_.run.seed);
  state.lr = lr;
  state.has_data = true;
  state.data_fingerprint = trainer_.data().fingerprint();
  state.dataset_samples = at.per_dataset;
  const auto attrs = checkpoint_attributes(config_, grid_, val_loss, trainer_.data().describe());
  const TensorPredicate holder = state_holder(config_, grid_, trainer_);
  const std::string dir = checkpoint_dir(config_);
  const int keep = int(config_.checkpoint.keep);
  const bool keep_best = config_.checkpoint.keep_best;
  // A checkpoint folder made after the start (a save on a signal) is locked now.
  hold_folder(MPI_COMM_WORLD, "checkpoint%dir", dir);
  if (!config_.checkpoint.async) {
    const auto report = save_checkpoint<T>(dir, MPI_COMM_WORLD, trainer_.layouts(),
                                           owned_state<const T>(trainer_).buffers, holder, state,
                                           attrs, keep, keep_best);
    log::info(cat("checkpoint: step ", step, " ", saved(report)));
    return;
  }
  const double t0 = MPI_Wtime();
  const std::int64_t before = in_flight_ ? in_flight_->step : 0;
  if (in_flight_) finish(step);  // at most one write in flight
  const double t1 = MPI_Wtime();
  auto w = std::make_unique<Write>();
  w->step = step;
  w->snapshot = take_snapshot<T>(trainer_, holder);
  Write* write = w.get();
  w->thread = std::thread([write, dir, comm = io_comm_, layouts = trainer_.layouts(), holder, state,
                           attrs, keep, keep_best] {
    try {
      write->report = save_checkpoint<T>(dir, comm, layouts, write->snapshot.buffers, holder, state,
                                         attrs, keep, keep_best);
    } catch (const Error& e) {
      write->error = e;
    } catch (const std::exception& e) {
      write->error = Error(cat("internal error: ", e.what()));
    }
    write->done.store(true, std::memory_order_release);
  });
  in_flight_ = std::move(w);
  log::info(cat(
      "checkpoint: step ", step, " copied to host memory (",
      format_bytes(double(write->snapshot.bytes)), " on rank 0 in ",
      fixed_seconds(MPI_Wtime() - t1), " s",
      before ? cat(", after ", fixed_seconds(t1 - t0), " s waiting for step ", before, "'s write")
             : std::string(),
      "); writing it in the background"));
}

template <class P>
void Checkpoints<P>::poll(std::int64_t step) {
  if (!in_flight_) return;
  const bool here = in_flight_->done.load(std::memory_order_acquire);
  if (mpi::max(MPI_COMM_WORLD, here ? 0 : 1) == 0) finish(step);
}

template <class P>
void Checkpoints<P>::wait(std::int64_t step) {
  if (in_flight_) finish(step);
}

template <class P>
void Checkpoints<P>::finish(std::int64_t step) {
  const std::unique_ptr<Write> w = std::move(in_flight_);
  w->thread.join();
  if (w->error)  // the same on every rank (save_checkpoint agrees on it)
    throw w->error->reworded(
        cat("checkpoint of step ", w->step, ", written in the background: ", w->error->what()));
  const std::string during = step > w->step + 1    ? cat("steps ", w->step + 1, "-", step)
                             : step == w->step + 1 ? cat("step ", step)
                                                   : std::string();
  log::info(cat("checkpoint: step ", w->step, " ", saved(w->report), ", in the background",
                during.empty() ? std::string() : cat(" during ", during)));
}

template <class P>
void save_final(const Config& config, const Grid& grid, parallel::Trainer<P>& trainer) {
  using T = typename P::master;
  const std::string path = config.run.out_dir + "/final.h5";
  const std::map<std::string, std::string> attrs{{"ptrain_version", PTRAIN_VERSION},
                                                 {"deck", deck::echo(config)},
                                                 {"grid", grid.shape().str()},
                                                 {"compute_dtype", config.model.dtype},
                                                 {"step", std::to_string(config.run.steps)}};
  const auto report = save_owned_weights<T>(path, MPI_COMM_WORLD, trainer.layouts(),
                                            owned_state<const T>(trainer, false).buffers,
                                            state_holder(config, grid, trainer), attrs);
  log::info(cat("checkpoint: final weights ", saved(report)));
}

#define PTRAIN_TRAINING_INSTANTIATE(P)                                                \
  template void initialise<P>(const Config&, const Grid&, parallel::Trainer<P>&);     \
  template std::int64_t resume<P>(const Config&, const Grid&, parallel::Trainer<P>&); \
  template class Checkpoints<P>;                                                      \
  template void save_final<P>(const Config&, const Grid&, parallel::Trainer<P>&);
PTRAIN_TRAINING_INSTANTIATE(Fp32)
PTRAIN_TRAINING_INSTANTIATE(Fp64)
PTRAIN_TRAINING_INSTANTIATE(Bf16)
PTRAIN_TRAINING_INSTANTIATE(Bf16Grads)
#undef PTRAIN_TRAINING_INSTANTIATE

}  // namespace ptrain::ckpt
