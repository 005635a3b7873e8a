// util/error.hpp — one-line errors that say what and where.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace ptrain {

// Concatenate anything streamable: cat("step ", s, ": loss ", x).
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// Exit codes the driver uses. The user's mistakes (deck, data file, init or restart file,
// output folder) are 2; faults of the run are 1.
enum ExitCode : int { kExitOk = 0, kExitRuntime = 1, kExitInput = 2 };

// Who raises an error: one rank (the driver aborts the job with MPI_Abort), or every rank
// alike after agreeing on it (the driver prints it once and every rank exits cleanly).
// Input errors (kExitInput) are always found on every rank.
enum class ErrorScope { this_rank, all_ranks };

// An error meant for the user: the message is one complete line
// ("deck.nml:12:5: unknown key 'tpp' in &parallel (did you mean 'tp'?)").
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, int exit_code = kExitRuntime,
                 ErrorScope scope = ErrorScope::this_rank)
      : std::runtime_error(message), exit_code_(exit_code), scope_(scope) {}
  int exit_code() const { return exit_code_; }
  bool on_all_ranks() const { return exit_code_ == kExitInput || scope_ == ErrorScope::all_ranks; }
  // The same error (exit code, who raises it) with another message: a caller adding context.
  Error reworded(const std::string& message) const { return Error(message, exit_code_, scope_); }

 private:
  int exit_code_;
  ErrorScope scope_;
};

// Throws Error(cat(args...)) when cond is false.
#define PTRAIN_REQUIRE(cond, ...)                                   \
  do {                                                              \
    if (!(cond)) throw ::ptrain::Error(::ptrain::cat(__VA_ARGS__)); \
  } while (0)

}  // namespace ptrain
