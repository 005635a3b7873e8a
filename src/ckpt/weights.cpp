#include "ckpt/weights.hpp"

#include <algorithm>

#include "ckpt/common.hpp"
#include "ckpt/h5.hpp"
#include "util/error.hpp"
#include "util/log.hpp"

namespace ptrain::ckpt {

using model::ChunkLayout;
using model::Shape;
using model::Slab;
using model::TensorSpec;
using namespace detail;

namespace {

// load_weights reads the /model of weights files and of training checkpoints alike.
std::string weights_version_problem(const std::string& path,
                                    const std::map<std::string, std::string>& attributes) {
  auto version = attributes.find("format_version");
  if (version == attributes.end())
    return cat(path, ": not a ptrain weights file (no format_version attribute)");
  if (version->second != kWeightsFormatVersion && version->second != "2")
    return cat(path, ": format_version ", h5::printable(version->second),
               " is not supported (this ptrain reads ", kWeightsFormatVersion,
               ", and 2 for checkpoints)");
  return {};
}

// ---- what this rank holds, and the union over ranks --------------------------------------

// One canonical tensor on this rank: every local copy (a rank can hold wte and its tied copy
// in two chunks), the first of which is read or written.
struct Held {
  std::vector<std::pair<int, const TensorSpec*>> copies;  // (chunk index, spec)
  bool primary = false;  // this rank is the chosen holder (writes / is checksummed)
  const TensorSpec& spec() const { return *copies.front().second; }
};

// Checks the layout against the buffers and groups tensors by name. Empty string when fine.
template <class P>
std::string collect_held(const std::vector<ChunkLayout>& chunks, const std::vector<P>& buffers,
                         bool skip_tied, const TensorPredicate& primary,
                         std::map<std::string, Held>& held) {
  if (buffers.size() != chunks.size())
    return cat("got ", buffers.size(), " buffers for ", chunks.size(), " model chunks");
  if (!primary) return "no predicate choosing the writing/verifying ranks was given";
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    if (!buffers[c] && chunks[c].numel > 0) return cat("chunk ", c, " has no buffer");
    for (const auto& t : chunks[c].tensors) {
      if (skip_tied && t.tied_copy) continue;
      if (auto problem = tensor_problem(t, chunks[c].numel, c); !problem.empty()) return problem;
      auto& h = held[t.name];
      if (!h.copies.empty()) {
        const auto& first = h.spec();
        bool same = first.global_shape == t.global_shape && first.numel == t.numel &&
                    first.slabs.size() == t.slabs.size();
        for (std::size_t j = 0; same && j < t.slabs.size(); ++j)
          same =
              first.slabs[j].start == t.slabs[j].start && first.slabs[j].count == t.slabs[j].count;
        if (!same || skip_tied)
          return cat(t.name, ": held twice on this rank", same ? "" : " with different blocks");
      }
      h.copies.emplace_back(static_cast<int>(c), &t);
      h.primary = h.primary || primary(t);
    }
  }
  return {};
}

// Every rank learns the name and global shape of each tensor that some rank is the chosen
// holder of (sorted by name). Then checks that each tensor held here is among them.
std::map<std::string, Shape> gather_union(MPI_Comm comm, const std::map<std::string, Held>& held,
                                          const char* role, const std::string& where) {
  std::map<std::string, Shape> mine;
  for (const auto& [name, h] : held)
    if (h.primary) mine.emplace(name, h.spec().global_shape);
  std::string error;
  const auto names = union_of_shapes(comm, mine, error);
  if (error.empty())
    for (const auto& [name, h] : held) {
      auto it = names.find(name);
      if (it == names.end()) {
        error = cat(name, ": no rank is chosen to ", role, " it");
        break;
      }
      if (it->second != h.spec().global_shape) {
        error = cat(name, ": ranks disagree on its global shape");
        break;
      }
    }
  mpi::agree(comm, error.empty() ? "" : where + error);
  return names;
}

// One dataset as this rank sees it, in the common sorted order.
struct Plan {
  std::string name;
  Shape shape;
  const Held* held = nullptr;  // null: this rank holds no part of it
  std::vector<Transfer> transfers;
  std::int64_t calls = 0;  // collective H5Dread/H5Dwrite calls (max over ranks)
};

std::vector<Plan> make_plans(MPI_Comm comm, const std::map<std::string, Shape>& names,
                             const std::map<std::string, Held>& held) {
  std::vector<Plan> plans;
  std::vector<std::int64_t> calls;
  for (const auto& [name, shape] : names) {
    Plan p;
    p.name = name;
    p.shape = shape;
    auto it = held.find(name);
    if (it != held.end()) {
      p.held = &it->second;
      p.transfers = transfers_of(it->second.spec().slabs);
    }
    calls.push_back(static_cast<std::int64_t>(p.transfers.size()));
    plans.push_back(std::move(p));
  }
  mpi::max(comm, calls);
  for (std::size_t i = 0; i < plans.size(); ++i) plans[i].calls = calls[i];
  return plans;
}

// Why the file cannot feed the model's tensors (the first problem in name order), or "".
std::string check_against_model(const std::string& path,
                                const std::map<std::string, FileDataset>& datasets,
                                const std::map<std::string, Shape>& names) {
  for (const auto& [name, shape] : names) {
    auto it = datasets.find(name);
    if (it == datasets.end())
      return cat(path, ": no dataset /model/", name, " (the model needs shape ",
                 format_shape(shape), ")");
    const FileDataset& d = it->second;
    if (d.shape != shape)
      return cat(path, ": /model/", name, " has shape ", format_shape(d.shape),
                 ", the model needs ", format_shape(shape));
    if (!d.is_float()) return cat(path, ": /model/", name, " is not a float32 or float64 dataset");
    if (!d.has_checksum)
      return cat(path, ": /model/", name, " has no checksum attribute (not written by ptrain)");
  }
  return {};
}

// Reads one dataset's slabs for this rank (elements of the file's type U), accumulates the
// checksum of what it read when it is the chosen holder, and converts into the staging copy.
template <class U, class T>
void read_dataset(MPI_Comm comm, const Plan& p, hid_t dset, hid_t dxpl, const std::string& what,
                  std::vector<std::vector<T>>& staging, std::uint64_t& checksum,
                  std::int64_t& counted) {
  auto filespace = h5::space(H5Dget_space(dset), what);
  std::vector<U> raw(p.held ? static_cast<std::size_t>(numel_of(p.held->spec().slabs)) : 0);
  for_each_transfer(
      p.transfers, p.calls, filespace.get(), what, [&](const Transfer* t, hid_t fsel, hid_t msel) {
        void* ptr = t ? static_cast<void*>(raw.data() + t->offset) : empty_selection_buffer();
        collective_step(comm, cat(what, ": read"), [&] {
          h5::check(H5Dread(dset, native_type<U>(), msel, fsel, dxpl, ptr), cat(what, ": read"));
        });
      });
  if (!p.held) return;
  const TensorSpec& spec = p.held->spec();
  if (p.held->primary) {
    checksum = boxes_checksum(p.shape, spec.slabs, raw.data());
    counted = static_cast<std::int64_t>(raw.size());
  }
  for (const auto& [chunk, t] : p.held->copies) {
    T* dst = staging[static_cast<std::size_t>(chunk)].data() + t->offset;
    for (std::size_t j = 0; j < raw.size(); ++j) dst[j] = static_cast<T>(raw[j]);
  }
}

}  // namespace

// ---- public API ----------------------------------------------------------------------------

template <class T>
std::uint64_t tensor_checksum(const T* data, std::int64_t n) {
  std::uint64_t sum = 0;
  for (std::int64_t i = 0; i < n; ++i) sum += element_hash(i, bits_of(data[i]));
  return sum;
}

template <class T>
void save_weights(const std::string& path, MPI_Comm comm, const std::vector<ChunkLayout>& chunks,
                  const std::vector<const T*>& chunk_data, const TensorPredicate& writes,
                  const std::map<std::string, std::string>& attributes) {
  h5::QuietErrors quiet;
  IoPhase watched(path, path);
  const std::string where = cat("save_weights ", path, ": ");
  // 1. What this rank holds; every rank agrees on the datasets and on the attributes.
  std::map<std::string, Held> held;
  std::string error = collect_held(chunks, chunk_data, true, writes, held);
  for (const char* reserved : {"format_version", "checksum_algorithm"})
    if (error.empty() && attributes.count(reserved))
      error = cat("the attribute name '", reserved, "' is reserved");
  mpi::agree(comm, error.empty() ? "" : where + error);
  const auto names = gather_union(comm, held, "write", where);
  require_same_attributes(comm, attributes, where);
  // 2. Checksums and coverage, reduced once for all datasets before anything is written.
  auto plans = make_plans(comm, names, held);
  const std::size_t n = plans.size();
  std::vector<std::uint64_t> checksum(n, 0);
  std::vector<std::int64_t> written(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    const Plan& p = plans[i];
    if (!p.held || !p.held->primary) continue;
    const auto& [chunk, spec] = p.held->copies.front();
    checksum[i] = boxes_checksum(p.shape, spec->slabs, chunk_data[chunk] + spec->offset);
    written[i] = numel_of(spec->slabs);
  }
  mpi::sum(comm, checksum);
  mpi::sum(comm, written);
  for (std::size_t i = 0; i < n; ++i)
    PTRAIN_REQUIRE(written[i] == product(plans[i].shape), where, "the ranks chosen to write ",
                   plans[i].name, " hold ", written[i], " of its ", product(plans[i].shape),
                   " elements (the predicate must choose each element exactly once)");
  // 3. The folder must exist and be writable (checked once, so every rank fails alike).
  mpi::agree(comm, mpi::rank(comm) == 0 ? folder_problem(path) : std::string());
  // 4. Collective create, attributes, datasets and hyperslab writes.
  std::int64_t data_bytes = 0;
  for (const auto& p : plans) data_bytes += product(p.shape) * std::int64_t(sizeof(T));
  const std::int64_t bytes = estimated_file_bytes(data_bytes, n, attributes);
  write_new_file(path, comm, bytes, kWeightsFormatVersion, attributes, where, [&](hid_t file) {
    auto group = create_group(comm, file, "model", path + ": /model");
    auto dxpl = collective_transfer_plist(where + "transfer");
    for (std::size_t i = 0; i < n; ++i) {
      const Plan& p = plans[i];
      const bool writes_it = p.held && p.held->primary;  // the others select nothing
      TensorWrite<T> t{p.name, p.shape, checksum[i], writes_it ? &p.transfers : nullptr, p.calls};
      if (writes_it) t.data = chunk_data[p.held->copies.front().first] + p.held->spec().offset;
      write_tensor(comm, group.get(), dxpl.get(), t, cat(path, ": /model/", p.name));
    }
    close_step(comm, group, path + ": /model");
  });
}

namespace {

// Step 3 of load_weights: the chosen holders' checksums add up to the stored ones (the
// same on every rank), or an Error naming the first corrupted tensor.
void verify_checksums(MPI_Comm comm, const std::string& path, const std::string& where,
                      const std::vector<Plan>& plans,
                      const std::map<std::string, FileDataset>& datasets,
                      std::vector<std::uint64_t>& checksum, std::vector<std::int64_t>& counted) {
  mpi::sum(comm, checksum);
  mpi::sum(comm, counted);
  std::string first_bad;
  std::size_t n_bad = 0;
  for (std::size_t i = 0; i < plans.size(); ++i) {
    PTRAIN_REQUIRE(counted[i] == product(plans[i].shape), where, "the ranks chosen to verify ",
                   plans[i].name, " read ", counted[i], " of its ", product(plans[i].shape),
                   " elements (the predicate must choose each element exactly once)");
    if (checksum[i] != datasets.at(plans[i].name).checksum && n_bad++ == 0)
      first_bad = plans[i].name;
  }
  if (n_bad > 0)
    throw Error(cat(path, ": /model/", first_bad, " checksum mismatch: the data is corrupted",
                    n_bad > 1 ? cat(" (and ", n_bad - 1, " more tensors)") : std::string()));
}

// Datasets of /model the model does not have: named in one warning, and returned.
std::vector<std::string> warn_ignored(const std::string& path,
                                      const std::map<std::string, FileDataset>& datasets,
                                      const std::map<std::string, Shape>& names) {
  std::vector<std::string> ignored;
  for (const auto& [name, d] : datasets)
    if (!names.count(name)) ignored.push_back(name);
  if (!ignored.empty()) {
    std::string list;
    for (std::size_t i = 0; i < ignored.size() && i < 5; ++i)
      list += cat(i ? ", " : "", h5::printable(ignored[i]));
    log::warn(cat(path, ": ", ignored.size(), " dataset(s) of /model are not part of the model ",
                  "and were ignored: ", list, ignored.size() > 5 ? ", ..." : ""));
  }
  return ignored;
}

}  // namespace

template <class T>
void load_weights(const std::string& path, MPI_Comm comm, const std::vector<ChunkLayout>& chunks,
                  const std::vector<T*>& chunk_data, const TensorPredicate& verifies,
                  LoadReport* report) {
  h5::QuietErrors quiet;
  IoPhase watched(path, "");
  const std::string where = cat("load_weights ", path, ": ");
  // 1. What this rank needs; every rank learns the union, then what the file holds.
  std::map<std::string, Held> held;
  const std::string error = collect_held(chunks, chunk_data, false, verifies, held);
  mpi::agree(comm, error.empty() ? "" : where + error);
  const auto names = gather_union(comm, held, "verify", where);
  const Catalog catalog =
      shared_catalog(comm, path, {"model"}, [&](const std::map<std::string, std::string>& attrs) {
        return weights_version_problem(path, attrs);
      });
  if (!catalog.error.empty()) throw Error(catalog.error);  // the same on every rank
  if (!catalog.groups.count("model"))
    throw Error(cat(path, ": no group /model (not a ptrain weights file)"));
  const auto& datasets = catalog.groups.at("model");
  const std::string mismatch = check_against_model(path, datasets, names);
  if (!mismatch.empty()) throw Error(mismatch);
  auto plans = make_plans(comm, names, held);
  const std::size_t n = plans.size();

  // 2. Collective reads of each rank's slabs into a staging copy (padding rows stay zero).
  std::vector<std::vector<T>> staging(chunks.size());
  std::size_t staging_bytes = 0;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    staging[c].assign(static_cast<std::size_t>(chunks[c].numel), T(0));
    staging_bytes += staging[c].size() * sizeof(T);
  }
  WorkspaceCharge charge(staging_bytes);
  std::vector<std::uint64_t> checksum(n, 0);
  std::vector<std::int64_t> counted(n, 0);
  std::int64_t elements_read = 0;
  {
    auto file = open_parallel(path, comm, where);
    auto group = h5::group(H5Gopen2(file.get(), "model", H5P_DEFAULT), path + ": /model");
    auto dxpl = collective_transfer_plist(where + "transfer");
    for (std::size_t i = 0; i < n; ++i) {
      const Plan& p = plans[i];
      const std::string what = cat(path, ": /model/", p.name);
      h5::Handle dset;
      collective_step(comm, what + ": open", [&] {
        dset = h5::dataset(H5Dopen2(group.get(), p.name.c_str(), H5P_DEFAULT), what);
      });
      if (datasets.at(p.name).elem_bytes == 4)
        read_dataset<float>(comm, p, dset.get(), dxpl.get(), what, staging, checksum[i],
                            counted[i]);
      else
        read_dataset<double>(comm, p, dset.get(), dxpl.get(), what, staging, checksum[i],
                             counted[i]);
      if (p.held) elements_read += numel_of(p.held->spec().slabs);
    }
  }
  // 3. Verify.
  verify_checksums(comm, path, where, plans, datasets, checksum, counted);

  // 4. Only now the caller's buffers change.
  for (std::size_t c = 0; c < chunks.size(); ++c)
    std::copy(staging[c].begin(), staging[c].end(), chunk_data[c]);
  std::vector<std::string> ignored = warn_ignored(path, datasets, names);
  if (report) {
    bool any4 = false, any8 = false;
    for (const auto& [name, shape] : names) {
      (datasets.at(name).elem_bytes == 4 ? any4 : any8) = true;
    }
    report->file_dtype = any4 && any8 ? "mixed" : any8 ? "fp64" : "fp32";
    report->ignored = std::move(ignored);
    report->attributes = catalog.attributes;
    report->elements_read = elements_read;
  }
}

std::string read_string_attribute(const std::string& path, const std::string& name) {
  h5::QuietErrors quiet;
  auto file = open_serial(path);
  if (H5Aexists(file.get(), name.c_str()) <= 0)
    throw Error(cat(path, ": no attribute '", name, "'"));
  auto attr = h5::attribute(H5Aopen(file.get(), name.c_str(), H5P_DEFAULT),
                            cat(path, ": attribute ", name));
  return read_string_attr(attr.get(), cat(path, ": attribute ", name));
}

#define PTRAIN_CKPT_INSTANTIATE(T)                                                             \
  template std::uint64_t tensor_checksum<T>(const T*, std::int64_t);                           \
  template void save_weights<T>(const std::string&, MPI_Comm, const std::vector<ChunkLayout>&, \
                                const std::vector<const T*>&, const TensorPredicate&,          \
                                const std::map<std::string, std::string>&);                    \
  template void load_weights<T>(const std::string&, MPI_Comm, const std::vector<ChunkLayout>&, \
                                const std::vector<T*>&, const TensorPredicate&, LoadReport*);
PTRAIN_CKPT_INSTANTIATE(float)
PTRAIN_CKPT_INSTANTIATE(double)
#undef PTRAIN_CKPT_INSTANTIATE

}  // namespace ptrain::ckpt
