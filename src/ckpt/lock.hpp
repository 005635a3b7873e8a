// ckpt/lock.hpp — a run owns its folders for its lifetime. Two runs in one run%out_dir would
// write deck.nml, log.csv and `latest` over each other (and race on latest.tmp); two in one
// checkpoint folder would prune each other's files. So rank 0 holds a lock file, `.ptrain.lock`,
// in run%out_dir and in the checkpoint folder, from before deck.nml is written to the end.
//
// The lock is made with open(O_CREAT | O_EXCL), which is atomic on local file systems, NFS v3
// and later, Lustre and GPFS (flock and fcntl locks are not reliable there), and names its
// holder, one "key = value" a line:
//   host = n12
//   pid = 4242
//   slurm_job = 991                  (SLURM_JOB_ID; none outside Slurm)
//   started = 2026-12-04T08:00:00Z
// A thread of rank 0 refreshes its modification time every 10 s (the heartbeat). A lock is
// stale, its run over, when its heartbeat is older than 120 s; when its host is this host and
// its process is gone; or when its host is another and its Slurm job is this one (a requeued
// job: Slurm ended the old run first). A stale lock is taken over with one warning naming the
// old holder: renamed aside, checked to be the very file judged (else put back), removed,
// and made anew with O_EXCL, so of two runs taking it over at once one wins and the other is
// refused. A live one refuses the run (exit 2) with one line naming its holder and the file
// to remove if that run has ended. Rank 0 removes its locks at every exit it makes: the end
// of the run, an error every rank agreed on and a stop signal (FolderLocks), and an aborted
// job or a second signal, best effort (util/cleanup.hpp). A lock whose file another run has
// taken over is never removed nor refreshed by this one.
#pragma once
#include <mpi.h>

#include <string>

namespace ptrain::ckpt {

inline constexpr const char* kLockName = ".ptrain.lock";

// Rank 0: takes the lock of folder `dir` (made when missing) for this run; "" when taken (or
// held already, under any name of the folder), else why not, in one line: "run%out_dir '/x/out'
// is in use by another run (host n12, pid 4242, Slurm job 991, started ..., lock refreshed 3 s
// ago); if that run has ended, remove /x/out/.ptrain.lock". `key` is the deck key naming the
// folder. Not collective.
std::string lock_folder(const std::string& key, const std::string& dir);

// lock_folder on rank 0 of comm, its refusal an Error(kExitInput) on every rank. Collective.
void hold_folder(MPI_Comm comm, const std::string& key, const std::string& dir);

// Rank 0: removes the locks this process holds (those still its own). Not collective; idempotent.
void release_folders();

// The driver's hold on its folders: released however the scope ends (a return, an Error).
class FolderLocks {
 public:
  FolderLocks() = default;
  ~FolderLocks() { release_folders(); }
  FolderLocks(const FolderLocks&) = delete;
  FolderLocks& operator=(const FolderLocks&) = delete;
};

}  // namespace ptrain::ckpt
