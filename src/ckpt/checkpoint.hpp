// ckpt/checkpoint.hpp — training checkpoints: parameters, AdamW moments and the training
// state at their GLOBAL shapes in one HDF5 file, written and read collectively (MPI-IO) by
// every rank from the parts it owns, so a file written by one grid (tp, pp, ep, ZeRO stage
// and data-parallel size) restarts any other. No rank ever holds more than its own part.
//
// File layout (format_version 2):
//   /                       string attributes: format_version "2", checksum_algorithm,
//                           date (UTC, ISO 8601; the caller's if given), and the caller's
//                           (ptrain_version, deck, grid, zero, ...)
//   /model/<name>           every parameter, global shape, element type of the run
//                           (IEEE float32 or float64), attribute checksum (uint64)
//   /optim/m/<name>         AdamW first moments, same names, shapes, type and checksum;
//   /optim/v/<name>         second moments. Both absent when the optimizer has none (SGD).
//   /state/step             int64    optimizer steps done (the LR-schedule position)
//   /state/consumed_samples int64    training samples drawn so far (the data position)
//   /state/optimizer_t      int64    the optimizer's update count t (AdamW bias correction)
//   /state/seed             uint64   run%seed: the RNG is counter-based, the seed restarts it
//   /state/lr               float64  learning rate of the last step (informational)
//   /state/data_fingerprint uint64   the data's fingerprint (data::TokenSource::fingerprint)
//   /state/dataset_samples  int64[N] of consumed_samples, those from each of the N datasets
//                           each a dataset with a checksum attribute; the last two are absent
//                           from checkpoints written before them, which still load
// Tensor names and global shapes are those of model/layout.hpp; the padded vocabulary rows
// of wte and the pipeline's tied copy of wte are not stored (their moments neither).
// Every dataset's checksum follows weights.hpp's definition (for a scalar: i = 0 and the
// bits of its int64/uint64/float64 value).
//
// Files in the checkpoint folder:
//   ckpt_00000100.h5        the checkpoint after step 100 (%08d; more digits past 10^8)
//   .ckpt_00000100.h5.tmp   the same while it is written and verified (never read)
//   latest                  one line: the file name of the newest verified checkpoint
// A save first makes sure the folder has room for the file (common.hpp: agree_space_for),
// writes the temporary file, closes it, verifies it (re-reads every written part and checks
// the per-dataset checksums), syncs it to disk, writes latest.tmp, renames the file to its
// final name, then renames latest.tmp to `latest`. So `latest` always names a whole,
// verified file, whatever moment a crash comes at.
//
// Who owns what: per chunk and per buffer (params, m, v) a rank owns a contiguous range
// [lo, hi) of the chunk's flat numbering (model/layout.hpp). A ZeRO shard may cut tensors
// anywhere (mid-row); ZeRO 0 is [0, numel) on the data-parallel replica that writes. Inside
// a tensor the owned elements map to a few global hyperslabs: per slab a partial first row,
// whole rows, a partial last row (on each level of an N-d tensor). Ranges alone do not tell
// tp/ep replicas of a tensor apart (a bias replicated over tp sits whole in every tp rank's
// buffer): the `holder` predicate names, among the ranks whose ranges cover the same
// elements, the one that writes them on save and whose reads are checksummed on load (e.g.
// t == 0 for tp-replicated tensors, and d == 0 under ZeRO 0). Ranks whose holder is false
// still read their owned ranges on load. Both save and load check that the chosen ranks
// cover every element of every dataset exactly once (by count) and fail otherwise.
//
// Saves refuse non-finite values (a diverged run): the error names the first such dataset and
// the rank holding it, and nothing is written. Every collective step of writing (and reading)
// a file agrees on its success across the ranks before the next one, so a failure on one rank
// (a full disk) is every rank's error "<file>: <object>: <operation>: <reason>", not a hang;
// the temporary file is removed and `latest` and the kept checkpoints stay as they were.
//
// Every function here is collective over comm unless it says otherwise; errors are thrown as
// ptrain::Error (exit code kExitRuntime) on every rank alike. load_checkpoint finds every
// problem (missing or dangling `latest`, missing file, not HDF5 or truncated, unknown format
// version, a missing, extra or wrongly shaped dataset, moments that the run's optimizer does
// not have or lacks, a checksum mismatch) before it changes any of the caller's buffers.
#pragma once
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ckpt/weights.hpp"
#include "model/layout.hpp"

namespace ptrain::ckpt {

inline constexpr const char* kCheckpointFormatVersion = "2";

// Elements [lo, hi) of chunk `chunk`'s flat numbering, stored at data[0 .. hi - lo).
// P is const T when saving, T when loading.
template <class P>
struct Owned {
  P* data = nullptr;
  std::size_t lo = 0, hi = 0;
  int chunk = 0;
};

// The Owned ranges of the parameters (at least one per chunk; more when a rank's shard is
// not one flat range, as with experts sharded apart) and, when the optimizer keeps moments
// (AdamW), the same ranges of m and v; `moments` must be the same on every rank.
template <class P>
struct Buffers {
  std::vector<Owned<P>> params;
  bool moments = false;
  std::vector<Owned<P>> m, v;  // like params when `moments`, else empty
};

// The training state besides the tensors (the /state group).
struct CheckpointState {
  std::int64_t step = 0;              // optimizer steps done (the LR-schedule position)
  std::int64_t consumed_samples = 0;  // training samples drawn so far (the data position)
  std::int64_t optimizer_t = 0;       // the optimizer's update count t
  std::uint64_t seed = 0;             // run%seed
  double lr = 0;                      // learning rate of the last step (informational)
  // The data (data/data.hpp): with has_data, its fingerprint and the samples drawn from each
  // dataset (summing to consumed_samples, at least one). A checkpoint written before these
  // were kept reads back has_data = false.
  bool has_data = false;
  std::uint64_t data_fingerprint = 0;
  std::vector<std::int64_t> dataset_samples;
};

struct SaveReport {
  std::string path;                  // the final file
  std::int64_t data_bytes = 0;       // tensor and state bytes of the file (all ranks together)
  std::int64_t file_bytes = 0;       // the file's size
  double write_seconds = 0;          // create and collective writes, until closed
  double verify_seconds = 0;         // the re-read of every written part
  double seconds = 0;                // everything, renames and pruning included
  std::vector<std::string> removed;  // files pruned (older checkpoints, stale .tmp files)
};

// "ckpt_00000100.h5". Not collective.
std::string checkpoint_file_name(std::int64_t step);
// The checkpoint files ("ckpt_<step>.h5") in folder `dir`, the highest step first (none when
// it does not exist). Not collective.
std::vector<std::string> checkpoints_in(const std::string& dir);

// Writes the checkpoint of step state.step into folder `dir` (created when missing) as
// described above, then keeps the newest `keep` (>= 1) checkpoints of the folder: the one
// just written and, of the others, those of the highest steps; with `keep_best` also the one
// whose kValLossAttribute is lowest (files without it, or unreadable, do not compete). `attributes`
// become string attributes of the root group and must be identical on every rank; the names
// format_version and checksum_algorithm are reserved. `state` must be the same on every rank.
template <class T>
SaveReport save_checkpoint(const std::string& dir, MPI_Comm comm,
                           const std::vector<model::ChunkLayout>& chunks,
                           const Buffers<const T>& buffers, const TensorPredicate& holder,
                           const CheckpointState& state,
                           const std::map<std::string, std::string>& attributes, int keep,
                           bool keep_best = false);
// The root attribute keep_best reads: the validation loss when the checkpoint was written.
inline constexpr const char* kValLossAttribute = "val_loss";

// Writes the parameters of `buffers` (its moments are ignored) as a weights file
// (format_version 1, weights.hpp) at `path` from owned ranges, as save_checkpoint does: no rank
// holds more than its own part. Like a checkpoint it is written as ".<name>.tmp" in the same
// folder, verified and renamed, so a failed save leaves an existing `path` as it was.
// `attributes` as for save_checkpoint (no date is added). Returns no removed files.
template <class T>
SaveReport save_owned_weights(const std::string& path, MPI_Comm comm,
                              const std::vector<model::ChunkLayout>& chunks,
                              const Buffers<const T>& buffers, const TensorPredicate& holder,
                              const std::map<std::string, std::string>& attributes);

struct CheckpointLoadReport {
  std::string path;                               // the file read
  std::string file_dtype;                         // "fp32", "fp64" or "mixed"
  std::map<std::string, std::string> attributes;  // the root group's string attributes
  std::int64_t bytes_read = 0;                    // by all ranks together
  double seconds = 0;
};

// The file `restart` names: for "latest" the file the pointer `dir`/latest names (inside
// dir), else `restart` itself. Throws when "latest" has no pointer or points at a missing
// file. Not collective.
std::string resolve_checkpoint(const std::string& restart, const std::string& dir);

// Fills the owned ranges of `buffers` from the checkpoint `restart` names (see
// resolve_checkpoint) and returns its state. The file may come from any grid; padding rows
// are set to zero, the tied copy of wte is filled from wte.weight (moments included), and a
// file of the other precision is converted.
template <class T>
CheckpointState load_checkpoint(const std::string& restart, const std::string& dir, MPI_Comm comm,
                                const std::vector<model::ChunkLayout>& chunks,
                                const Buffers<T>& buffers, const TensorPredicate& holder,
                                CheckpointLoadReport* report = nullptr);

}  // namespace ptrain::ckpt
