// main.cpp — the ptrain driver (placeholder until the deck and grid land).
#include <mpi.h>

#include <cstdio>

#include "util/version.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  std::printf("ptrain %s\n", PTRAIN_VERSION);
  MPI_Finalize();
  return 0;
}
