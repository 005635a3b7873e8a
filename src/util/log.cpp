#include "util/log.hpp"

#include <cstdio>

namespace ptrain::log {

namespace {
int g_rank = 0;
}

void set_rank(int world_rank) { g_rank = world_rank; }
int rank() { return g_rank; }

void info(const std::string& line) {
  if (g_rank != 0) return;
  std::fprintf(stdout, "%s\n", line.c_str());
  std::fflush(stdout);
}

void warn(const std::string& line) {
  if (g_rank != 0) return;
  std::fprintf(stderr, "warning: %s\n", line.c_str());
  std::fflush(stderr);
}

void error_any_rank(const std::string& line) {
  std::fprintf(stderr, "[rank %d] error: %s\n", g_rank, line.c_str());
  std::fflush(stderr);
}

}  // namespace ptrain::log
