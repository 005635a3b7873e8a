// util/profile.hpp — where a step's time goes, by kernel family (ptrain --bench).
// Off by default: then a region costs one branch. When on, each region is fenced at both
// ends (Kokkos kernels may be asynchronous on a device) and its time accumulated by name.
#pragma once
#include <Kokkos_Core.hpp>
#include <string>
#include <utility>
#include <vector>

#include "util/timer.hpp"
#include "util/trace.hpp"

namespace ptrain::profile {

void enable(bool on);
bool enabled();
void add(const char* name, double seconds);
std::vector<std::pair<std::string, double>> totals();  // in first-seen order
void reset();

// True for the regions that wrap communication: their blocked time is traced by the
// collectives themselves (comm/comm.hpp), per group.
bool is_communication(const char* name);

// Runs f, timing it under `name` when profiling is on, and recording it as compute on the
// run%trace timeline.
template <class F>
void region(const char* name, F&& f) {
  const bool traced = trace::enabled() && !is_communication(name);
  if (!enabled() && !traced) {
    f();
    return;
  }
  Kokkos::fence();
  const double t0 = wall_seconds();
  f();
  Kokkos::fence();
  const double t1 = wall_seconds();
  if (enabled()) add(name, t1 - t0);
  if (traced) trace::record(name, "compute", t0, t1);
}

}  // namespace ptrain::profile
