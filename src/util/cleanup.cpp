#include "util/cleanup.hpp"

#include <unistd.h>

#include <csignal>
#include <cstring>

namespace ptrain::cleanup {

namespace {
constexpr int kSlots = 8;
constexpr std::size_t kPath = 4096;
// Fixed storage, so a signal handler reads no memory that ordinary code frees. A slot's path
// is written while it is not `used`, and `used` is set after.
char g_paths[kSlots][kPath];
volatile std::sig_atomic_t g_used[kSlots];
}  // namespace

void remove_on_abort(const std::string& path) {
  if (path.size() >= kPath) return;
  for (int i = 0; i < kSlots; ++i)
    if (g_used[i] && path == g_paths[i]) return;
  for (int i = 0; i < kSlots; ++i)
    if (!g_used[i]) {
      std::memcpy(g_paths[i], path.c_str(), path.size() + 1);
      g_used[i] = 1;
      return;
    }
}

void keep_on_abort(const std::string& path) {
  for (int i = 0; i < kSlots; ++i)
    if (g_used[i] && path == g_paths[i]) g_used[i] = 0;
}

void remove_now() noexcept {
  for (int i = 0; i < kSlots; ++i)
    if (g_used[i]) {
      unlink(g_paths[i]);
      g_used[i] = 0;
    }
}

}  // namespace ptrain::cleanup
