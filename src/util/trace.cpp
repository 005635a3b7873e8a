#include "util/trace.hpp"

#include <cstdio>
#include <vector>

#include "util/error.hpp"
#include "util/mpi.hpp"
#include "util/timer.hpp"

namespace ptrain::trace {

namespace {
struct Event {
  std::string name, kind;
  double t0, t1;
};
bool g_on = false;
double g_zero = 0;
std::vector<Event> g_events;
}  // namespace

void start(MPI_Comm comm, bool on) {
  mpi::check(MPI_Barrier(comm), "MPI_Barrier");
  g_on = on;
  g_zero = wall_seconds();
  g_events.clear();
}

bool enabled() { return g_on; }

void record(const std::string& name, const std::string& kind, double t_begin, double t_end) {
  if (g_on) g_events.push_back({name, kind, t_begin - g_zero, t_end - g_zero});
}

std::string write(const std::string& dir, int rank) {
  if (!g_on) return "";
  const std::string path = cat(dir, "/rank", rank, ".csv");
  std::FILE* f = std::fopen(path.c_str(), "w");
  PTRAIN_REQUIRE(f, "trace: cannot write '", path, "'");
  std::fprintf(f, "rank,name,kind,t_begin,t_end\n");
  for (const auto& e : g_events)
    std::fprintf(f, "%d,%s,%s,%.6f,%.6f\n", rank, e.name.c_str(), e.kind.c_str(), e.t0, e.t1);
  const bool ok = std::fclose(f) == 0;
  PTRAIN_REQUIRE(ok, "trace: error writing '", path, "'");
  return path;
}

}  // namespace ptrain::trace
