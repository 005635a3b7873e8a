// deck/load.cpp — read the deck once (rank 0) and give every rank the same Config.
#include <exception>

#include "deck/deck.hpp"
#include "util/error.hpp"
#include "util/mpi.hpp"

namespace ptrain::deck {

Config load(MPI_Comm comm, const std::string& path, const std::vector<std::string>& overrides,
            int world_size) {
  // Rank 0 reads and checks the deck; every rank gets its error or the echoed deck.
  std::string error, echoed;
  int code = kExitOk;
  if (mpi::rank(comm) == 0) {
    try {
      Config config = parse_file(path, overrides);
      validate(config, world_size);
      echoed = echo(config);
    } catch (const Error& e) {
      code = e.exit_code() != kExitOk ? e.exit_code() : kExitRuntime;
      error = e.what();
    } catch (const std::exception& e) {
      code = kExitRuntime;
      error = cat("reading deck '", path, "': ", e.what());
    }
  }
  mpi::agree(comm, error, code);
  // Every rank, rank 0 included, reads the same echoed text: identical Configs.
  return parse_text(mpi::broadcast(comm, 0, echoed), path);
}

}  // namespace ptrain::deck
