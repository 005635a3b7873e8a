// util/profile.hpp — where a step's time goes, by kernel family (ptrain --bench).
// Off by default: then a region costs one branch. When on, each region is fenced at both
// ends (Kokkos kernels may be asynchronous on a device) and its time accumulated by name.
#pragma once
#include <Kokkos_Core.hpp>
#include <string>
#include <utility>
#include <vector>

#include "util/timer.hpp"

namespace ptrain::profile {

void enable(bool on);
bool enabled();
void add(const char* name, double seconds);
std::vector<std::pair<std::string, double>> totals();  // in first-seen order
void reset();

// Runs f, timing it under `name` when profiling is on.
template <class F>
void region(const char* name, F&& f) {
  if (!enabled()) {
    f();
    return;
  }
  Kokkos::fence();
  const double t0 = wall_seconds();
  f();
  Kokkos::fence();
  add(name, wall_seconds() - t0);
}

}  // namespace ptrain::profile
