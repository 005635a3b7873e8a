/* mpi_yield.c — libptrain_mpi_yield.so: idle MPICH ranks give their core away when a node has
 * more ranks than cores. CMakeLists.txt preloads it into every rank launched through MPICH's
 * mpiexec (-genv LD_PRELOAD in MPIEXEC_PREFLAGS, the one place launch flags are worked out).
 *
 * Why: MPICH's ch4 device spins in every blocking call and has no setting to yield the core
 * (Open MPI has one, which its --oversubscribe turns on). The tests run up to 8 ranks on 2
 * cores: a spinning rank keeps its core for a whole scheduler tick while the rank it waits
 * for cannot run, so every collective step costs milliseconds. Measured here, 500 4-rank
 * all-reduces on 2 cores take 5 s spinning and 0.1 s with this; the 8-rank grid test goes
 * from over 6 minutes to 10 s.
 *
 * How: every wait in MPICH ch4:ucx (Debian's MPICH; MPI_Wait, the collectives inside
 * MPI_Comm_split, ROMIO's, HDF5's) polls ucp_worker_progress. This wraps it: after a few
 * polls in a row that found nothing, the rank sleeps for a microsecond (about 50 us with the
 * default timer slack), and the ranks it waits for run. It changes no result, only when
 * ranks run. It is inactive unless hydra's MPI_LOCALNRANKS exceeds the CPUs this process may
 * use, and never called by an MPI that does not use UCX. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef unsigned (*progress_fn)(void *);

static int oversubscribed(void) {
  const char *ranks = getenv("MPI_LOCALNRANKS");
  cpu_set_t set;
  int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
  return ranks && atoi(ranks) > cpus;
}

unsigned ucp_worker_progress(void *worker) {
  static progress_fn real;
  static int yielding = -1;
  static unsigned idle;
  if (!real) {
    void *sym = dlsym(RTLD_NEXT, "ucp_worker_progress");
    memcpy(&real, &sym, sizeof real); /* object to function pointer, the POSIX way */
    yielding = oversubscribed();
  }
  const unsigned events = real(worker);
  if (events || !yielding) {
    idle = 0;
  } else if (++idle >= 4) {
    const struct timespec nap = {0, 1000};
    nanosleep(&nap, NULL);
    idle = 0;
  }
  return events;
}
