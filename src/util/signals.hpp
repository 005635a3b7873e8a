// util/signals.hpp — SIGUSR1 / SIGTERM (Slurm's --signal and its time limit) as a request to
// stop cleanly: the first signal sets a flag that the run polls at safe points (step ends,
// validation passes), where every rank agrees, writes a checkpoint and exits 0; a second
// signal exits at once (after removing the files registered with cleanup::remove_on_abort).
// Installed first thing in main, so a signal during set-up is a request too, never a kill.
#pragma once
#include <mpi.h>

namespace ptrain::signals {

void install_stop_handlers();
// Work that trains nothing (--plan): the signals end it as they end any program again, and
// one that came already ends it now.
void restore_default_handlers();
int stop_signal();  // this rank's first signal, 0 if none
// The signal any rank of `comm` has received (0: none); collective.
int agreed_stop_signal(MPI_Comm comm);

}  // namespace ptrain::signals
