#include "util/signals.hpp"

#include <unistd.h>

#include <csignal>
#include <cstdint>

#include "util/cleanup.hpp"
#include "util/mpi.hpp"

namespace ptrain::signals {

namespace {
volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal) {
    cleanup::remove_now();  // the folder locks (ckpt/lock.hpp)
    _exit(128 + sig);
  }
  g_stop_signal = sig;
}
}  // namespace

void install_stop_handlers() {
  std::signal(SIGUSR1, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
}

void restore_default_handlers() {
  std::signal(SIGUSR1, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  if (g_stop_signal != 0) std::raise(int(g_stop_signal));
}

int stop_signal() { return int(g_stop_signal); }

int agreed_stop_signal(MPI_Comm comm) { return int(mpi::max(comm, std::int64_t(stop_signal()))); }

}  // namespace ptrain::signals
