// ckpt/weights.hpp — model weights in one HDF5 file at their GLOBAL shapes, written and read
// collectively with parallel HDF5 (MPI-IO) from the sharded flat buffers of model/layout.hpp.
//
// File layout (format_version 1):
//   /                     string attributes: format_version, checksum_algorithm, plus the
//                         caller's (ptrain version, deck text, grid, ...)
//   /model/<name>         one dataset per canonical tensor, global shape, element type of the
//                         run (IEEE float32 or float64), attribute `checksum` (uint64)
// The padded vocabulary rows of wte and the tied LM-head copy (tied_copy) are not stored.
//
// Checksum (attribute checksum_algorithm): for a tensor x with global row-major indices i,
//   checksum = sum_i mix64(mix64(i + 0x9e3779b97f4a7c15) ^ bits(x_i))   (mod 2^64)
// with bits the value's bit pattern as stored (uint32 for float32, uint64 for float64,
// zero-extended) and mix64 the splitmix64 finaliser. Addition mod 2^64 is exact and
// order-free, so every decomposition computes the same value from its own pieces.
//
// Who writes and who verifies: several ranks can hold the same block (data-parallel replicas,
// tensors replicated over tp, the tied copy). The caller names exactly one holder of each
// element with a predicate on TensorSpec (e.g. d == 0, and t == 0 for tp-replicated tensors).
// save_weights writes only from those ranks; load_weights lets every rank read what it needs
// and sums the checksums of what the predicate's ranks read. Both check that the chosen ranks
// together cover each tensor's elements exactly (by count) and fail otherwise.
//
// Every function here is collective over comm unless it says otherwise; errors are thrown as
// ptrain::Error (exit code kExitRuntime) on every rank alike. load_weights finds every
// problem (missing file, not HDF5 or truncated, missing dataset, wrong shape, checksum
// mismatch) before it changes any of the caller's buffers.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "model/layout.hpp"

namespace ptrain::ckpt {

inline constexpr const char* kWeightsFormatVersion = "1";

// True where this rank is the one holder of the tensor's slabs that writes (save) or whose
// reads are checksummed (load). tied_copy tensors are never written whatever it says.
using TensorPredicate = std::function<bool(const model::TensorSpec&)>;

// Writes the tensors of `chunks` (chunk_data[c] is chunk c's flat host buffer of
// chunks[c].numel elements) to a new file `path` (an existing one is overwritten).
// `attributes` become string attributes of the root group and must be identical on every
// rank; the names format_version and checksum_algorithm are reserved.
template <class T>
void save_weights(const std::string& path, MPI_Comm comm,
                  const std::vector<model::ChunkLayout>& chunks,
                  const std::vector<const T*>& chunk_data, const TensorPredicate& writes,
                  const std::map<std::string, std::string>& attributes);

struct LoadReport {
  std::string file_dtype;                         // "fp32", "fp64" or "mixed" (of what was read)
  std::vector<std::string> ignored;               // datasets of /model the model does not use
  std::map<std::string, std::string> attributes;  // the root group's string attributes
  std::int64_t elements_read = 0;                 // by this rank (each distinct tensor once)
};

// Fills the tensors of `chunks` from `path`: each rank reads its slabs, the padding rows of
// wte are set to zero, and a file of the other precision is converted. `path` may also be a
// training checkpoint (format_version 2, checkpoint.hpp): its /model is read the same way. Datasets
// of the file the model does not use are ignored (listed in the report, one warning on rank 0).
template <class T>
void load_weights(const std::string& path, MPI_Comm comm,
                  const std::vector<model::ChunkLayout>& chunks, const std::vector<T*>& chunk_data,
                  const TensorPredicate& verifies, LoadReport* report = nullptr);

// A string attribute of the root group ("format_version", "deck", ...). Not collective:
// opens the file on the calling rank alone. Throws when the file or attribute is missing.
std::string read_string_attribute(const std::string& path, const std::string& name);

// The checksum of a whole tensor given in global row-major order (tools and tests).
template <class T>
std::uint64_t tensor_checksum(const T* data, std::int64_t n);

}  // namespace ptrain::ckpt
