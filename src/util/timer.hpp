// util/timer.hpp — wall-clock timing.
#pragma once
#include <chrono>

namespace ptrain {

inline double wall_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
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
