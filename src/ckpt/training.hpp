// ckpt/training.hpp — a Trainer's weights and state to and from files: the initial weights
// (model%init_from, or the seed), checkpoints (every N steps, or on a signal), restart, and
// the final weights. The driver calls these; the file formats are in weights.hpp and
// checkpoint.hpp.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>

#include "deck/config.hpp"
#include "grid/grid.hpp"
#include "parallel/trainer.hpp"

namespace ptrain::ckpt {

// checkpoint%dir, relative to run%out_dir unless absolute.
std::string checkpoint_dir(const Config& config);

// Before step 1 (collective over comm): run%out_dir and the checkpoint folder can be written,
// so a mistake there ends the run at once rather than at the first save. Rank 0 creates
// out_dir, and the checkpoint folder when checkpoint%every > 0 (otherwise it would only be
// made by a save on a signal: then its nearest existing ancestor must be writable), and
// writes a probe file in each, then locks each existing one for this run (ckpt/lock.hpp;
// the caller holds a FolderLocks). It also refuses (before deck.nml is written) a fresh run that
// writes checkpoints into a folder holding some (checkpoint%overwrite removes them instead)
// and restart = 'latest' in a folder of checkpoints without `latest`; then a checkpoint
// (checkpoint%every > 0) or final.h5 (checkpoint%save_final) that can never be written, by the
// deck's estimate of its size: larger than its folder's file system or than any rank's file
// size limit (one larger than the space free now is warned of). Throws Error(..., kExitInput)
// naming the key and the folder, the same on every rank.
void check_writable(const Config& config, MPI_Comm comm);

// model%init_from (every rank reads the whole file and keeps its part), else the GPT-2
// init from run%seed.
template <class P>
void initialise(const Config& config, const Grid& grid, parallel::Trainer<P>& trainer);

// checkpoint%restart on any grid: returns the step to continue after (0: from the start).
// 'latest' with no checkpoint in the folder yet (a job requeued before its first one)
// starts from the beginning with a warning; a named file or a dangling `latest` must exist.
template <class P>
std::int64_t resume(const Config& config, const Grid& grid, parallel::Trainer<P>& trainer);

// The checkpoints of a run (checkpoint%every, a stop signal), each written by
// save_checkpoint (verified, published atomically, `latest` updated, older ones pruned, an
// error the same on every rank). With checkpoint%async a thread of every rank writes it from a
// host snapshot of what the rank holds (its masters and moments), over a communicator of its
// own, while the steps go on; the steps after the snapshot change the tensors, not the copy.
// At most one write is in flight: a save waits for the one before. Every member is collective
// over the world, called at the same points on every rank.
template <class P>
class Checkpoints {
 public:
  Checkpoints(const Config& config, const Grid& grid, parallel::Trainer<P>& trainer);
  // Waits for a write still in flight (its thread ends on every rank alike); never throws.
  ~Checkpoints();
  Checkpoints(const Checkpoints&) = delete;
  Checkpoints& operator=(const Checkpoints&) = delete;

  // The checkpoint after `step` (lr: that step's learning rate, informational; val_loss: the
  // validation loss last measured, NaN if none, kept for checkpoint%keep_best), logged with its
  // bandwidth; in the background with checkpoint%async.
  void save(std::int64_t step, double lr, double val_loss);
  // At the end of `step`: when a background write has ended on every rank, logs it, or throws
  // its error (the same on every rank). No communication when none is in flight.
  void poll(std::int64_t step);
  // Waits for the write in flight, if any, at the end of `step` (a stop, the end of the run),
  // then logs it or throws its error as poll does.
  void wait(std::int64_t step);

 private:
  struct Write;
  void finish(std::int64_t step);  // joins the write in flight, logs it or throws its error
  const Config& config_;
  const Grid& grid_;
  parallel::Trainer<P>& trainer_;
  MPI_Comm io_comm_ = MPI_COMM_NULL;  // the writing thread's (checkpoint%async)
  std::unique_ptr<Write> in_flight_;
};

// out_dir/final.h5 (checkpoint%save_final), written like a checkpoint from what each rank
// owns (its ZeRO shard, or the whole chunk): under a temporary name, verified, then renamed,
// so a failed save leaves a previous final.h5 as it was.
template <class P>
void save_final(const Config& config, const Grid& grid, parallel::Trainer<P>& trainer);

}  // namespace ptrain::ckpt
