// util/log.hpp — rank-0 logging. Every rank may call; only the world's rank 0 prints
// unless `all_ranks` is asked for (then lines carry a "[rank N]" prefix).
#pragma once
#include <string>

#include "util/error.hpp"

namespace ptrain::log {

void set_rank(int world_rank);  // called once after MPI_Init
int rank();

void info(const std::string& line);            // rank 0 only, to stdout
void warn(const std::string& line);            // rank 0 only, "warning: ..." to stderr
void error_any_rank(const std::string& line);  // any rank, "[rank N] error: ..." to stderr

}  // namespace ptrain::log
