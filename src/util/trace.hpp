// util/trace.hpp — a per-rank timeline of what the rank did (run%trace): compute phases,
// each group's communication, and (by difference) idle time. Events are kept in memory
// and written once at the end to out_dir/trace/rank<N>.csv for postprocess/plot_schedule.py.
// Times are seconds since trace::start(), which every rank leaves together (a barrier).
#pragma once
#include <mpi.h>

#include <string>

namespace ptrain::trace {

// Collective over comm: a barrier, then recording on (or off) and time zero.
void start(MPI_Comm comm, bool enabled);
bool enabled();
// kind: "compute", "comm:<group>" (time blocked on that group) or "io".
void record(const std::string& name, const std::string& kind, double t_begin, double t_end);
// Writes the events of this rank; returns the file written ("" when tracing is off).
std::string write(const std::string& dir, int rank);

}  // namespace ptrain::trace
