#include "util/memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>

#include "util/error.hpp"
#include "util/log.hpp"

namespace ptrain {

const char* to_string(MemCategory c) {
  switch (c) {
    case MemCategory::params:
      return "params";
    case MemCategory::grads:
      return "grads";
    case MemCategory::optimizer:
      return "optimizer";
    case MemCategory::activations:
      return "activations";
    case MemCategory::comm:
      return "comm";
    case MemCategory::workspace:
      return "workspace";
    case MemCategory::count:
      break;
  }
  return "?";
}

namespace memory {
namespace {
// A background checkpoint write (ckpt/training.hpp) charges its buffers from its own thread.
std::mutex g_mutex;
MemoryStats g_stats;
}  // namespace
void add(MemCategory c, std::size_t bytes) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  auto i = static_cast<int>(c);
  g_stats.current[i] += bytes;
  g_stats.total_current += bytes;
  if (g_stats.current[i] > g_stats.peak[i]) g_stats.peak[i] = g_stats.current[i];
  if (g_stats.total_current > g_stats.total_peak) g_stats.total_peak = g_stats.total_current;
}
void sub(MemCategory c, std::size_t bytes) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  auto i = static_cast<int>(c);
  g_stats.current[i] -= bytes;
  g_stats.total_current -= bytes;
}
MemoryStats stats() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  return g_stats;
}
void reset_peaks() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  g_stats.peak = g_stats.current;
  g_stats.total_peak = g_stats.total_current;
}
void allocation_failed(MemCategory c, const std::string& label, std::size_t bytes,
                       const char* why) {
  const MemoryStats now = stats();
  std::string held;
  for (int i = 0; i < static_cast<int>(MemCategory::count); ++i)
    if (now.current[std::size_t(i)] > 0)
      held += cat(held.empty() ? "" : ", ", to_string(MemCategory(i)), " ",
                  format_bytes(double(now.current[std::size_t(i)])));
  std::string words = why ? why : "";
  words = words.substr(0, words.find('\n'));  // Kokkos' first line
  throw Error(cat("out of memory on rank ", log::rank(), ": ", format_bytes(double(bytes)), " for ",
                  to_string(c), " ('", label, "') with ", format_bytes(double(now.total_current)),
                  " already tracked here", held.empty() ? "" : " (" + held + ")",
                  "; ptrain --plan with --memory predicts each category and what to change (",
                  words, ")"));
}

void advise_huge_pages(void* p, std::size_t bytes) {
#ifdef MADV_HUGEPAGE
  // Advice only: EINVAL where the kernel has no transparent huge pages is not an error.
  (void)madvise(p, bytes, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
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

std::optional<double> parse_bytes(const std::string& text) {
  std::string s;
  for (char ch : text)
    if (!std::isspace(static_cast<unsigned char>(ch)))
      s += char(std::tolower(static_cast<unsigned char>(ch)));
  if (s.size() > 2 && s.compare(s.size() - 2, 2, "/s") == 0) s.resize(s.size() - 2);
  if (s.empty()) return std::nullopt;
  const char* begin = s.c_str();
  char* end = nullptr;
  const double x = std::strtod(begin, &end);
  if (end == begin || !std::isfinite(x) || x <= 0) return std::nullopt;
  const std::string unit(end);
  static const char* prefixes = "kmgtpe";
  double scale = 0;
  if (unit.empty() || unit == "b") {
    scale = 1;
  } else if (const char* at = std::strchr(prefixes, unit[0]); at && *at) {
    const int power = int(at - prefixes) + 1;
    const std::string rest = unit.substr(1);
    if (rest.empty() || rest == "i" || rest == "ib")
      scale = std::pow(1024.0, power);
    else if (rest == "b")
      scale = std::pow(1000.0, power);
  }
  if (scale == 0) return std::nullopt;
  // At least one byte, and no more than a 64-bit count holds (1e30GiB is a typo, not a node).
  const double bytes = x * scale;
  if (!(bytes >= 1 && bytes <= 9.2e18)) return std::nullopt;
  return bytes;
}

NodeMemory node_memory() {
  NodeMemory m;
  auto take = [&](double bytes, const char* source) {
    if (bytes > 0 && (m.bytes == 0 || bytes < m.bytes)) m.bytes = bytes, m.source = source;
  };
  {
    std::ifstream in("/proc/meminfo");
    std::string key;
    double kib = 0;
    while (in >> key >> kib) {
      if (key == "MemTotal:") {
        take(kib * 1024.0, "/proc/meminfo MemTotal");
        break;
      }
      in.ignore(1 << 20, '\n');
    }
  }
  if (m.bytes == 0) {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0) take(double(pages) * double(page), "sysconf physical pages");
  }
  // A limit of "max" (v2) or one near 2^63 (v1, none set) reads as no limit.
  for (const auto& [path, name] :
       {std::pair<const char*, const char*>{"/sys/fs/cgroup/memory.max", "cgroup memory.max"},
        {"/sys/fs/cgroup/memory/memory.limit_in_bytes", "cgroup memory.limit_in_bytes"}}) {
    std::ifstream in(path);
    double limit = 0;
    if (in >> limit && limit < 1e18) take(limit, name);
  }
  return m;
}

}  // namespace ptrain
