// deck/load.cpp — read the deck once (rank 0) and give every rank the same Config.
#include <climits>
#include <exception>

#include "deck/deck.hpp"
#include "util/error.hpp"

namespace ptrain::deck {

Config load(MPI_Comm comm, const std::string& path, const std::vector<std::string>& overrides,
            int world_size) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  // Rank 0 sends either (0, echoed deck) or (exit code, error message).
  long long head[2] = {0, 0};
  std::string payload;
  if (rank == 0) {
    int code = 0;
    try {
      Config config = parse_file(path, overrides);
      validate(config, world_size);
      payload = echo(config);
    } catch (const Error& e) {
      code = e.exit_code() != kExitOk ? e.exit_code() : kExitRuntime;
      payload = e.what();
    } catch (const std::exception& e) {
      code = kExitRuntime;
      payload = cat("reading deck '", path, "': ", e.what());
    }
    if (payload.size() > static_cast<std::size_t>(INT_MAX)) {
      code = kExitInput;
      payload = cat("deck '", path, "' is too large");
    }
    head[0] = code;
    head[1] = static_cast<long long>(payload.size());
  }
  MPI_Bcast(head, 2, MPI_LONG_LONG, 0, comm);
  payload.resize(static_cast<std::size_t>(head[1]));
  MPI_Bcast(payload.data(), static_cast<int>(head[1]), MPI_CHAR, 0, comm);
  if (head[0] != 0) throw Error(payload, static_cast<int>(head[0]));
  // Every rank, rank 0 included, reads the same echoed text: identical Configs.
  return parse_text(payload, path);
}

}  // namespace ptrain::deck
