// comm/watchdog.hpp — the hang watchdog (run%hang_timeout). Every collective a Comm starts
// carries a sequence number per kind of group, and each rank publishes how many collectives
// it has entered of each kind in memory shared with the ranks of its node. A wait blocked
// longer than the timeout prints the group, the operation, its sequence number and the
// members that have not entered it (members on other nodes cannot be seen from here and
// are listed as such), then aborts the job: a hung job ends with a diagnosis instead of
// burning its allocation.
#pragma once
#include <mpi.h>

#include <cstdint>

namespace ptrain::watchdog {

constexpr int kRows = 16;  // kinds of group tracked (the first rows of the traffic table)

// Collective over `world`. timeout_s <= 0 turns the watchdog off. The shared window lives
// until MPI_Finalize (freeing it is collective, which an error path cannot promise).
void start(MPI_Comm world, double timeout_s);
double timeout_s();  // 0 when off

// This rank entered collective number `seq` of group kind `row`.
void entered(int row, std::int64_t seq);
// How many collectives of kind `row` world rank `rank` has entered, or -1 when it is not
// on this rank's node (or the watchdog is off).
std::int64_t progress(int rank, int row);

}  // namespace ptrain::watchdog
