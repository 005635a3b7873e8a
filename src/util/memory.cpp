#include "util/memory.hpp"

#include <cstdio>

namespace ptrain {

const char* to_string(MemCategory c) {
  switch (c) {
    case MemCategory::params: return "params";
    case MemCategory::grads: return "grads";
    case MemCategory::optimizer: return "optimizer";
    case MemCategory::activations: return "activations";
    case MemCategory::comm: return "comm";
    case MemCategory::workspace: return "workspace";
    case MemCategory::count: break;
  }
  return "?";
}

namespace memory {
namespace {
MemoryStats g_stats;
}
void add(MemCategory c, std::size_t bytes) {
  auto i = static_cast<int>(c);
  g_stats.current[i] += bytes;
  g_stats.total_current += bytes;
  if (g_stats.current[i] > g_stats.peak[i]) g_stats.peak[i] = g_stats.current[i];
  if (g_stats.total_current > g_stats.total_peak) g_stats.total_peak = g_stats.total_current;
}
void sub(MemCategory c, std::size_t bytes) {
  auto i = static_cast<int>(c);
  g_stats.current[i] -= bytes;
  g_stats.total_current -= bytes;
}
const MemoryStats& stats() { return g_stats; }
void reset_peaks() {
  g_stats.peak = g_stats.current;
  g_stats.total_peak = g_stats.total_current;
}
}  // namespace memory

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 5) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

}  // namespace ptrain
