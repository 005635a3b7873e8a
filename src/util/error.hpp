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

// Exit codes the driver uses. Deck errors are the user's to fix (2);
// data and checkpoint problems are runtime errors (1).
enum ExitCode : int { kExitOk = 0, kExitRuntime = 1, kExitInput = 2 };

// An error meant for the user: the message is one complete line
// ("deck.nml:12:5: unknown key 'tpp' in &parallel (did you mean 'tp'?)").
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, int exit_code = kExitRuntime)
      : std::runtime_error(message), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

// Throws Error(cat(args...)) when cond is false.
#define PTRAIN_REQUIRE(cond, ...)                         \
  do {                                                    \
    if (!(cond)) throw ::ptrain::Error(::ptrain::cat(__VA_ARGS__)); \
  } while (0)

}  // namespace ptrain
