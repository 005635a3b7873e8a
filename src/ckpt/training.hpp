// ckpt/training.hpp — a Trainer's weights and state to and from files: the initial weights
// (model%init_from, or the seed), checkpoints (every N steps, or on a signal), restart, and
// the final weights. The driver calls these; the file formats are in weights.hpp and
// checkpoint.hpp.
#pragma once
#include <mpi.h>

#include <cstdint>
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

// A checkpoint after `step` (lr: that step's learning rate, informational), logged with
// its bandwidth.
template <class P>
// `val_loss`: the validation loss last measured (NaN: none yet), kept in the file for
// checkpoint%keep_best.
void save(const Config& config, const Grid& grid, parallel::Trainer<P>& trainer, std::int64_t step,
          double lr, double val_loss);

// out_dir/final.h5 (checkpoint%save_final), written like a checkpoint from what each rank
// owns (its ZeRO shard, or the whole chunk): under a temporary name, verified, then renamed,
// so a failed save leaves a previous final.h5 as it was.
template <class P>
void save_final(const Config& config, const Grid& grid, parallel::Trainer<P>& trainer);

}  // namespace ptrain::ckpt
