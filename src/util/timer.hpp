// util/timer.hpp — wall-clock timing.
#pragma once
#include <chrono>
#include <ctime>
#include <string>

namespace ptrain {

inline double wall_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

// The time now in UTC, formatted by strftime (default ISO 8601: 2026-12-04T13:42:57Z).
inline std::string utc_now(const char* format = "%Y-%m-%dT%H:%M:%SZ") {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  return std::string(buf, std::strftime(buf, sizeof buf, format, &tm));
}

// Accumulates elapsed time over start()/stop() pairs.
class Stopwatch {
 public:
  void start() { t0_ = wall_seconds(); }
  double stop() {
    double dt = wall_seconds() - t0_;
    total_ += dt;
    return dt;
  }
  double total() const { return total_; }
  void reset() { total_ = 0; }

 private:
  double t0_ = 0, total_ = 0;
};

}  // namespace ptrain
