// deck/load.cpp — read the deck once (rank 0) and give every rank the same Config.
#include <cstdint>
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
  std::int64_t deck_keys = -1;
  if (mpi::rank(comm) == 0) {
    try {
      Config config = parse_file(path, overrides);
      validate(config, world_size);
      echoed = echo(config);
      deck_keys = config.deck_keys;
    } catch (const Error& e) {
      code = e.exit_code() != kExitOk ? e.exit_code() : kExitRuntime;
      error = e.what();
    } catch (const std::exception& e) {
      code = kExitRuntime;
      error = cat("reading deck '", path, "': ", e.what());
    }
  }
  mpi::agree(comm, error, code);
  MPI_Bcast(&deck_keys, 1, MPI_INT64_T, 0, comm);
  // Every rank, rank 0 included, reads the same echoed text: identical Configs.
  Config config = parse_text(mpi::broadcast(comm, 0, echoed), path);
  config.deck_keys = static_cast<int>(deck_keys);  // of the file, not of the echo (every key)
  return config;
}

std::string no_keys_warning(const Config& config, std::size_t n_overrides) {
  if (config.deck_keys != 0) return {};
  return cat("deck ", config.deck_path, " sets no keys: every value",
             n_overrides ? cat(" but the ", n_overrides, " --set override(s)") : std::string(),
             " is the default (ptrain --help-deck lists them)");
}

}  // namespace ptrain::deck
