#include "comm/watchdog.hpp"

#include <vector>

namespace ptrain::watchdog {

namespace {
struct State {
  double timeout = 0;
  std::int64_t* mine = nullptr;         // this rank's kRows counters
  std::vector<std::int64_t*> by_world;  // each world rank's counters, null if off-node
};
State& state() {
  static State s;
  return s;
}
}  // namespace

void start(MPI_Comm world, double timeout_s) {
  State& s = state();
  s.timeout = timeout_s > 0 ? timeout_s : 0;
  if (s.timeout == 0 || s.mine) return;
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  MPI_Win win = MPI_WIN_NULL;
  MPI_Win_allocate_shared(MPI_Aint(kRows * sizeof(std::int64_t)), int(sizeof(std::int64_t)),
                          MPI_INFO_NULL, node, &s.mine, &win);
  for (int r = 0; r < kRows; ++r) s.mine[r] = 0;
  int world_size = 0, node_size = 0;
  MPI_Comm_size(world, &world_size);
  MPI_Comm_size(node, &node_size);
  // World rank of each node rank, then the address of its counters.
  MPI_Group wg, ng;
  MPI_Comm_group(world, &wg);
  MPI_Comm_group(node, &ng);
  std::vector<int> node_ranks(static_cast<std::size_t>(node_size)), world_ranks(node_ranks.size());
  for (int i = 0; i < node_size; ++i) node_ranks[std::size_t(i)] = i;
  MPI_Group_translate_ranks(ng, node_size, node_ranks.data(), wg, world_ranks.data());
  MPI_Group_free(&wg);
  MPI_Group_free(&ng);
  s.by_world.assign(std::size_t(world_size), nullptr);
  for (int i = 0; i < node_size; ++i) {
    MPI_Aint bytes = 0;
    int unit = 0;
    std::int64_t* base = nullptr;
    MPI_Win_shared_query(win, i, &bytes, &unit, &base);
    s.by_world[std::size_t(world_ranks[std::size_t(i)])] = base;
  }
  MPI_Barrier(node);  // every counter zeroed before anyone reads it
}

double timeout_s() { return state().timeout; }

void entered(int row, std::int64_t seq) {
  State& s = state();
  if (s.mine && row >= 0 && row < kRows) __atomic_store_n(&s.mine[row], seq, __ATOMIC_RELAXED);
}

std::int64_t progress(int rank, int row) {
  const State& s = state();
  if (!s.mine || row < 0 || row >= kRows || rank < 0 || rank >= int(s.by_world.size()) ||
      !s.by_world[std::size_t(rank)])
    return -1;
  return __atomic_load_n(&s.by_world[std::size_t(rank)][row], __ATOMIC_RELAXED);
}

}  // namespace ptrain::watchdog
