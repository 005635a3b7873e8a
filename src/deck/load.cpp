// deck/load.cpp — read the deck once (rank 0) and give every rank the same Config.
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>

#include "deck/deck.hpp"
#include "util/error.hpp"
#include "util/mpi.hpp"

namespace ptrain::deck {

Config load(MPI_Comm comm, const std::string& path, const std::vector<std::string>& overrides,
            int world_size, const std::string& machine_file) {
  // Rank 0 reads and checks the deck; every rank gets its error or the echoed deck.
  std::string error, echoed;
  int code = kExitOk;
  std::int64_t deck_keys = -1;
  if (mpi::rank(comm) == 0) {
    try {
      Config config = parse_file(path, overrides);
      if (!machine_file.empty()) read_machine(config, machine_file);
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

void read_machine(Config& config, const std::string& path) {
  if (std::ifstream probe(path); !probe)
    throw Error(cat("--machine ", path, ": cannot open: ", std::strerror(errno ? errno : ENOENT)),
                kExitInput);
  Config file;
  try {
    file = parse_file(path);
  } catch (const Error& e) {
    throw Error(cat("--machine: ", e.what()), kExitInput);
  }
  // A deck given by mistake parses too: the file must name the group.
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (char& c : text) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (text.find("&machine") == std::string::npos)
    throw Error(cat(path, ": no &machine group (a machine file is what ptrain --calibrate writes)"),
                kExitInput);
  config.machine = file.machine;
}

std::string no_keys_warning(const Config& config, std::size_t n_overrides) {
  if (config.deck_keys != 0) return {};
  return cat("deck ", config.deck_path, " sets no keys: every value",
             n_overrides ? cat(" but the ", n_overrides, " --set override(s)") : std::string(),
             " is the default (ptrain --help-deck lists them)");
}

}  // namespace ptrain::deck
