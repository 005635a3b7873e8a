// tokenize/main.cpp — ptrain-tokenize (tokenize/run.hpp): MPI around the tool. An error every
// rank agreed on is printed once by rank 0 (exit code 2 for the user's input); any other ends
// the job with MPI_Abort, as ptrain does.
#include <mpi.h>

#include <cstdio>

#include "tokenize/run.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/mpi.hpp"

int main(int argc, char** argv) {
  using namespace ptrain;
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  log::set_rank(rank);
  int code = kExitOk;
  try {
    code = tokenize::run(argc, argv, MPI_COMM_WORLD);
  } catch (const Error& e) {
    if (!e.on_all_ranks()) mpi::abort_job(e.what(), e.exit_code());
    if (rank == 0) std::fprintf(stderr, "%s\n", e.what());
    code = rank == 0 ? e.exit_code() : kExitOk;
  } catch (const std::exception& e) {
    mpi::abort_job(cat("internal error: ", e.what()), kExitRuntime);
  }
  MPI_Finalize();
  return code;
}
