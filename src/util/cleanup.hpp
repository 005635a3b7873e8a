// util/cleanup.hpp — files this process removes when it ends at once: mpi::abort_job and a
// second stop signal (util/signals.hpp) end it without unwinding, so the owner of such a file
// (a folder lock, ckpt/lock.hpp) registers it here too. Best effort, for a handful of paths.
#pragma once
#include <string>

namespace ptrain::cleanup {

// `path` is removed if the process ends at once (at most 8 paths at a time, each below 4 KiB;
// others are ignored). Not async-signal-safe: call from ordinary code.
void remove_on_abort(const std::string& path);
// `path` is no longer removed (its owner removed it, or gave it up).
void keep_on_abort(const std::string& path);
// Removes the registered paths now. Async-signal-safe: the abort paths and signal handlers
// call it.
void remove_now() noexcept;

}  // namespace ptrain::cleanup
