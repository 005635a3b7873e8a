#include "ckpt/checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <tuple>

#include "ckpt/common.hpp"
#include "ckpt/h5.hpp"
#include "ckpt/weights.hpp"
#include "util/error.hpp"
#include "util/timer.hpp"

namespace ptrain::ckpt {

using model::ChunkLayout;
using model::Shape;
using model::Slab;
using model::TensorSpec;
using namespace detail;
namespace fs = std::filesystem;

namespace {

// The three kinds of tensor datasets: parameters and the two AdamW moments.
constexpr int kKinds = 3;
const char* const kGroup[kKinds] = {"model", "optim/m", "optim/v"};
const char* const kGroupLeaf[kKinds] = {"model", "m", "v"};  // in the root, /optim, /optim
const char* const kBufferName[kKinds] = {"parameter", "m", "v"};

template <class P>
const std::vector<Owned<P>>& owned_of(const Buffers<P>& b, int kind) {
  return kind == 0 ? b.params : kind == 1 ? b.m : b.v;
}
template <class P>
int kinds_of(const Buffers<P>& b) {
  return b.moments ? 3 : 1;
}

// ---- what this rank holds -----------------------------------------------------------------

// The part of one tensor (of one kind) in this rank's owned range of one chunk.
struct Holding {
  int kind = 0;
  int chunk = 0;
  const TensorSpec* spec = nullptr;
  std::vector<Slab> boxes;  // the owned elements as global blocks, in memory order
  std::int64_t numel = 0;
  std::size_t owned = 0;  // index of the Owned buffer (of its kind) holding it
  std::size_t at = 0;     // index in the Owned buffer's data of the first owned element
  bool primary = false;   // written on save, checksummed on load
};

// Checks the buffers against the layout and lists what this rank holds (on save only what
// it writes). `known` gets every tensor of the layout with its global shape. "" when fine.
template <class P>
std::string collect_holdings(const std::vector<ChunkLayout>& chunks, const Buffers<P>& buffers,
                             const TensorPredicate& holder, bool saving, std::vector<Holding>& out,
                             std::map<std::string, Shape>& known) {
  if (!holder) return "no holder predicate was given";
  const std::size_t n_owned = buffers.params.size();
  std::vector<bool> covered(chunks.size(), false);
  for (const auto& o : buffers.params)
    if (o.chunk >= 0 && std::size_t(o.chunk) < chunks.size()) covered[std::size_t(o.chunk)] = true;
  for (std::size_t c = 0; c < chunks.size(); ++c)
    if (!covered[c])
      return cat("got no parameter buffer for model chunk ", c, " of ", chunks.size());
  const std::size_t n_moments = buffers.moments ? n_owned : 0;
  if (buffers.m.size() != n_moments || buffers.v.size() != n_moments)
    return buffers.moments ? cat("got ", buffers.m.size(), " m and ", buffers.v.size(),
                                 " v buffers for ", n_owned, " parameter buffers")
                           : std::string("m and v buffers were given but `moments` is false");
  const int kinds = kinds_of(buffers);
  for (std::size_t i = 0; i < n_owned; ++i)
    for (int k = 0; k < kinds; ++k) {
      const Owned<P>& o = owned_of(buffers, k)[i];
      const Owned<P>& p = buffers.params[i];
      if (o.chunk < 0 || std::size_t(o.chunk) >= chunks.size() || o.chunk != p.chunk ||
          o.lo != p.lo || o.hi != p.hi)
        return cat("the ", kBufferName[k], " buffer ", i, " (chunk ", o.chunk, ", [", o.lo, ", ",
                   o.hi, ")) does not match parameter buffer ", i, " (chunk ", p.chunk, ", [", p.lo,
                   ", ", p.hi, ")) among ", chunks.size(), " model chunks");
      const auto numel = static_cast<std::size_t>(chunks[std::size_t(o.chunk)].numel);
      if (o.lo > o.hi || o.hi > numel)
        return cat("the ", kBufferName[k], " range [", o.lo, ", ", o.hi, ") of chunk ", o.chunk,
                   " lies outside its ", numel, " elements");
      if (o.hi > o.lo && !o.data)
        return cat("the ", kBufferName[k], " buffer of chunk ", o.chunk, " is missing");
    }
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    for (const auto& t : chunks[c].tensors) {
      if (auto problem = tensor_problem(t, chunks[c].numel, c); !problem.empty()) return problem;
      auto [it, fresh] = known.emplace(t.name, t.global_shape);
      if (!fresh && it->second != t.global_shape)
        return cat(t.name, ": held twice on this rank with different shapes");
      const bool primary = !t.tied_copy && holder(t);
      if (saving && !primary) continue;
      const std::int64_t first = t.offset, end = t.offset + numel_of(t.slabs);
      for (int k = 0; k < kinds; ++k)
        for (std::size_t i = 0; i < n_owned; ++i) {
          const Owned<P>& o = owned_of(buffers, k)[i];
          if (std::size_t(o.chunk) != c) continue;
          const std::int64_t lo = std::max(first, static_cast<std::int64_t>(o.lo));
          const std::int64_t hi = std::min(end, static_cast<std::int64_t>(o.hi));
          if (lo >= hi) continue;
          Holding h;
          h.kind = k;
          h.chunk = static_cast<int>(c);
          h.owned = i;
          h.spec = &t;
          h.boxes = boxes_of_slabs_range(t.slabs, lo - first, hi - first);
          h.numel = hi - lo;
          h.at = static_cast<std::size_t>(lo) - o.lo;
          h.primary = primary;
          out.push_back(std::move(h));
        }
    }
  }
  if (saving) {  // one writer of each part: a tensor is written from one place on a rank
    std::map<std::pair<int, std::string>, int> count;
    for (const auto& h : out)
      if (++count[{h.kind, h.spec->name}] > 1)
        return cat(h.spec->name,
                   ": held twice on this rank (only the pipeline's tied copy of "
                   "wte may be, and it is never written)");
  }
  return {};
}

// Every rank learns every tensor of the model (the union of all layouts) by name.
std::map<std::string, Shape> gather_names(MPI_Comm comm, const std::map<std::string, Shape>& known,
                                          const std::string& where) {
  std::string error;
  auto names = union_of_shapes(comm, known, error);
  mpi::agree(comm, error.empty() ? "" : where + error);
  return names;
}

// The moments exist on every rank or on none.
void agree_on_moments(MPI_Comm comm, bool moments, const std::string& where) {
  std::vector<std::int64_t> both{moments ? 1 : 0, moments ? 0 : 1};
  mpi::max(comm, both);
  PTRAIN_REQUIRE(!(both[0] && both[1]), where,
                 "some ranks have optimizer moments (m, v) and others have none");
}

// One dataset as this rank sees it, in the common order (kind, then name).
struct DatasetPlan {
  int kind = 0;
  std::string name;
  Shape shape;
  std::vector<const Holding*> holdings;  // this rank's, their elements back to back
  std::vector<Transfer> transfers;
  std::int64_t numel = 0;  // of the holdings
  std::int64_t calls = 0;  // collective H5Dread/H5Dwrite calls (max over ranks)
  std::string path() const { return cat("/", kGroup[kind], "/", name); }
};

std::vector<DatasetPlan> make_plans(MPI_Comm comm, const std::map<std::string, Shape>& names,
                                    const std::vector<Holding>& holdings, int kinds) {
  std::vector<DatasetPlan> plans;
  std::map<std::pair<int, std::string>, std::size_t> index;
  for (int k = 0; k < kinds; ++k)
    for (const auto& [name, shape] : names) {
      index[{k, name}] = plans.size();
      DatasetPlan p;
      p.kind = k;
      p.name = name;
      p.shape = shape;
      plans.push_back(std::move(p));
    }
  for (const auto& h : holdings) plans[index.at({h.kind, h.spec->name})].holdings.push_back(&h);
  std::vector<std::int64_t> calls;
  for (auto& p : plans) {
    for (const Holding* h : p.holdings) {
      for (auto& t : transfers_of(h->boxes, p.numel)) p.transfers.push_back(std::move(t));
      p.numel += h->numel;
    }
    calls.push_back(static_cast<std::int64_t>(p.transfers.size()));
  }
  mpi::max(comm, calls);
  for (std::size_t i = 0; i < plans.size(); ++i) plans[i].calls = calls[i];
  return plans;
}

// ---- the file's catalogue and state -------------------------------------------------------

std::string checkpoint_version_problem(const std::string& path,
                                       const std::map<std::string, std::string>& attributes) {
  auto version = attributes.find("format_version");
  if (version == attributes.end())
    return cat(path, ": not a ptrain checkpoint (no format_version attribute)");
  if (version->second == kWeightsFormatVersion)
    return cat(path,
               ": is a weights file (format_version 1: parameters only), not a training "
               "checkpoint; start from it with model%init_from instead");
  if (version->second != kCheckpointFormatVersion)
    return cat(path, ": format_version ", h5::printable(version->second),
               " is not supported (this ptrain reads checkpoints of format_version ",
               kCheckpointFormatVersion, ")");
  return {};
}

Catalog checkpoint_catalog(MPI_Comm comm, const std::string& path) {
  return shared_catalog(comm, path, {"model", "optim/m", "optim/v"},
                        [&](const std::map<std::string, std::string>& attributes) {
                          return checkpoint_version_problem(path, attributes);
                        });
}

// The catalogue of a weights file just written (the verification of save_owned_weights).
Catalog weights_catalog(MPI_Comm comm, const std::string& path) {
  return shared_catalog(
      comm, path, {"model"}, [&](const std::map<std::string, std::string>& attributes) {
        auto version = attributes.find("format_version");
        if (version != attributes.end() && version->second == kWeightsFormatVersion)
          return std::string();
        return cat(path, ": not a weights file of format_version ", kWeightsFormatVersion);
      });
}

// Why the file cannot restart this model and optimizer (the first problem found), or "".
std::string catalog_problem(const std::string& path, const Catalog& file,
                            const std::map<std::string, Shape>& names, bool moments) {
  if (!file.error.empty()) return file.error;
  if (!file.groups.count("model")) return cat(path, ": no group /model (not a ptrain checkpoint)");
  const bool has_m = file.groups.count("optim/m"), has_v = file.groups.count("optim/v");
  if (!moments && (has_m || has_v))
    return cat(path,
               ": holds optimizer moments (/optim/m, /optim/v) but this run's optimizer "
               "keeps none (SGD); restart with the optimizer that wrote it (AdamW)");
  if (moments && !has_m && !has_v)
    return cat(path,
               ": holds no optimizer moments (written by an optimizer without them, SGD) "
               "but this run's optimizer needs m and v (AdamW)");
  if (moments && (!has_m || !has_v))
    return cat(path, ": no group /", has_m ? "optim/v" : "optim/m", " (the file is incomplete)");
  for (int k = 0; k < (moments ? kKinds : 1); ++k) {
    const auto& datasets = file.groups.at(kGroup[k]);
    for (const auto& [name, shape] : names) {
      const std::string dset = cat("/", kGroup[k], "/", name);
      auto it = datasets.find(name);
      if (it == datasets.end())
        return cat(path, ": no dataset ", dset, " (the model needs shape ", format_shape(shape),
                   ")");
      const FileDataset& d = it->second;
      if (d.shape != shape)
        return cat(path, ": ", dset, " has shape ", format_shape(d.shape), ", the model needs ",
                   format_shape(shape));
      if (!d.is_float()) return cat(path, ": ", dset, " is not a float32 or float64 dataset");
      if (!d.has_checksum)
        return cat(path, ": ", dset, " has no checksum attribute (not written by ptrain)");
    }
    for (const auto& [name, d] : datasets)
      if (!names.count(name))
        return cat(path, ": /", kGroup[k], "/", h5::printable(name),
                   " is not a tensor of this model (the checkpoint is of another model)");
  }
  return {};
}

// The scalars of /state: name, HDF5 file type, and how the value is read back.
enum class ScalarType { i64, u64, f64 };
struct StateField {
  const char* name;
  ScalarType type;
};
constexpr StateField kStateFields[] = {{"step", ScalarType::i64},
                                       {"consumed_samples", ScalarType::i64},
                                       {"optimizer_t", ScalarType::i64},
                                       {"seed", ScalarType::u64},
                                       {"lr", ScalarType::f64}};

// The data's fields, written after them (absent from older checkpoints).
constexpr StateField kFingerprintField = {"data_fingerprint", ScalarType::u64};
constexpr StateField kDatasetSamplesField = {"dataset_samples", ScalarType::i64};

// The state's fields as 64-bit patterns, in kStateFields order, then (has_data) the
// fingerprint and the per-dataset counts.
std::vector<std::uint64_t> state_bits(const CheckpointState& s) {
  std::vector<std::uint64_t> b = {bits_of(s.step), bits_of(s.consumed_samples),
                                  bits_of(s.optimizer_t), bits_of(s.seed), bits_of(s.lr)};
  if (s.has_data) {
    b.push_back(s.data_fingerprint);
    for (std::int64_t n : s.dataset_samples) b.push_back(bits_of(n));
  }
  return b;
}
CheckpointState state_from_bits(const std::vector<std::uint64_t>& b) {
  CheckpointState s;
  std::memcpy(&s.step, &b[0], 8);
  std::memcpy(&s.consumed_samples, &b[1], 8);
  std::memcpy(&s.optimizer_t, &b[2], 8);
  std::memcpy(&s.seed, &b[3], 8);
  std::memcpy(&s.lr, &b[4], 8);
  s.has_data = b.size() > std::size(kStateFields);
  if (s.has_data) s.data_fingerprint = b[std::size(kStateFields)];
  for (std::size_t i = std::size(kStateFields) + 1; i < b.size(); ++i)
    s.dataset_samples.push_back(std::int64_t(b[i]));
  return s;
}

hid_t native_of(ScalarType t) {
  return t == ScalarType::i64   ? H5T_NATIVE_INT64
         : t == ScalarType::u64 ? H5T_NATIVE_UINT64
                                : H5T_NATIVE_DOUBLE;
}
hid_t file_type_of(ScalarType t) {
  return t == ScalarType::i64   ? H5T_STD_I64LE
         : t == ScalarType::u64 ? H5T_STD_U64LE
                                : H5T_IEEE_F64LE;
}

// Reads and verifies /state serially (rank 0): packed "error" or the fields' bits.
std::string read_state(const std::string& path) {
  Packer out;
  try {
    auto file = open_serial(path);
    if (H5Lexists(file.get(), "state", H5P_DEFAULT) <= 0)
      throw Error(cat(path, ": no group /state (not a ptrain checkpoint)"));
    std::vector<std::uint64_t> bits;
    // A scalar (array: a 1-d dataset of at least one element) of the field's type, its values'
    // bits appended to `bits`.
    auto read_field = [&](const StateField& f, bool array) {
      const std::string what = cat(path, ": /state/", f.name);
      const std::string link = cat("state/", f.name);
      if (H5Lexists(file.get(), link.c_str(), H5P_DEFAULT) <= 0)
        throw Error(cat(path, ": no dataset /state/", f.name));
      auto dset = h5::dataset(H5Dopen2(file.get(), link.c_str(), H5P_DEFAULT), what);
      auto space = h5::space(H5Dget_space(dset.get()), what);
      auto type = h5::type(H5Dget_type(dset.get()), what);
      const H5T_class_t cls = H5Tget_class(type.get());
      const bool right_class = f.type == ScalarType::f64 ? cls == H5T_FLOAT : cls == H5T_INTEGER;
      const H5S_class_t shape = H5Sget_simple_extent_type(space.get());
      hsize_t n = 1;
      const bool right_shape =
          array ? shape == H5S_SIMPLE && H5Sget_simple_extent_ndims(space.get()) == 1 &&
                      H5Sget_simple_extent_dims(space.get(), &n, nullptr) == 1 && n >= 1 &&
                      n <= (1u << 20)
                : shape == H5S_SCALAR;
      if (!right_shape || !right_class || H5Tget_size(type.get()) != 8)
        throw Error(cat(what, " is not ", array ? "a 1-d array of" : "a scalar",
                        f.type == ScalarType::f64 ? " float64" : " 64-bit integer",
                        array ? "s" : ""));
      // Read in the field's own type: its bit pattern is what is hashed.
      std::vector<std::uint64_t> b(n);
      h5::check(H5Dread(dset.get(), native_of(f.type), H5S_ALL, H5S_ALL, H5P_DEFAULT, b.data()),
                what + ": read");
      if (H5Aexists(dset.get(), "checksum") <= 0)
        throw Error(cat(what, " has no checksum attribute (not written by ptrain)"));
      std::uint64_t stored = 0, sum = 0;
      auto attr = h5::attribute(H5Aopen(dset.get(), "checksum", H5P_DEFAULT), what);
      h5::check(H5Aread(attr.get(), H5T_NATIVE_UINT64, &stored), what + ": checksum");
      for (std::size_t i = 0; i < b.size(); ++i) sum += element_hash(std::int64_t(i), b[i]);
      if (sum != stored) throw Error(cat(what, " checksum mismatch: the data is corrupted"));
      bits.insert(bits.end(), b.begin(), b.end());
    };
    for (const auto& f : kStateFields) read_field(f, false);
    // The data's fields come as a pair (or not at all, in an older checkpoint).
    const bool fingerprint = H5Lexists(file.get(), "state/data_fingerprint", H5P_DEFAULT) > 0;
    if (fingerprint || H5Lexists(file.get(), "state/dataset_samples", H5P_DEFAULT) > 0) {
      read_field(kFingerprintField, false);
      read_field(kDatasetSamplesField, true);
    }
    out.str("");
    out.u64(bits.size());
    for (auto b : bits) out.u64(b);
  } catch (const std::exception& e) {
    out = Packer();
    out.str(e.what());
  }
  return out.bytes;
}

// /state of `path` on every rank; throws the same error on every rank.
CheckpointState shared_state(MPI_Comm comm, const std::string& path) {
  std::string bytes;
  if (mpi::rank(comm) == 0) bytes = read_state(path);
  bytes = mpi::broadcast(comm, 0, std::move(bytes));
  Unpacker in(bytes.data(), bytes.size());
  const std::string error = in.str();
  if (!error.empty()) throw Error(error);
  std::vector<std::uint64_t> bits(in.u64());
  for (auto& b : bits) b = in.u64();
  return state_from_bits(bits);
}

// ---- collective reads (load, and the verification after a save) ---------------------------

struct ReadTotals {
  std::vector<std::uint64_t> checksum;  // per plan: of the primary holdings, summed over ranks
  std::vector<std::int64_t> counted;    // per plan: elements those hold, summed over ranks
  std::int64_t bytes = 0;               // read by all ranks
};

// Reads one dataset's holdings for this rank (elements of the file's type U), sums the
// checksum of the primary ones and converts into staging[kind][owned buffer] when given.
template <class U, class T>
void read_plan(MPI_Comm comm, const DatasetPlan& p, hid_t dset, hid_t dxpl, const std::string& what,
               std::vector<std::vector<std::vector<T>>>* staging, std::uint64_t& checksum,
               std::int64_t& counted) {
  auto filespace = h5::space(H5Dget_space(dset), what);
  std::vector<U> raw(static_cast<std::size_t>(p.numel));
  WorkspaceCharge charge(raw.size() * sizeof(U));
  for_each_transfer(
      p.transfers, p.calls, filespace.get(), what, [&](const Transfer* t, hid_t fsel, hid_t msel) {
        void* ptr = t ? static_cast<void*>(raw.data() + t->offset) : empty_selection_buffer();
        collective_step(comm, cat(what, ": read"), [&] {
          h5::check(H5Dread(dset, native_type<U>(), msel, fsel, dxpl, ptr), cat(what, ": read"));
        });
      });
  std::int64_t offset = 0;
  for (const Holding* h : p.holdings) {
    const U* src = raw.data() + offset;
    if (h->primary) {
      checksum += boxes_checksum(p.shape, h->boxes, src);
      counted += h->numel;
    }
    if (staging) {
      T* dst = (*staging)[static_cast<std::size_t>(h->kind)][h->owned].data() + h->at;
      for (std::int64_t j = 0; j < h->numel; ++j) dst[j] = static_cast<T>(src[j]);
    }
    offset += h->numel;
  }
}

template <class T>
ReadTotals read_holdings(const std::string& path, MPI_Comm comm,
                         const std::vector<DatasetPlan>& plans, const Catalog& catalog,
                         std::vector<std::vector<std::vector<T>>>* staging,
                         const std::string& where) {
  ReadTotals r;
  r.checksum.assign(plans.size(), 0);
  r.counted.assign(plans.size(), 0);
  {
    auto file = open_parallel(path, comm, where);
    auto dxpl = collective_transfer_plist(where + "transfer");
    for (std::size_t i = 0; i < plans.size(); ++i) {
      const DatasetPlan& p = plans[i];
      const std::string what = cat(path, ": ", p.path());
      h5::Handle dset;
      collective_step(comm, what + ": open", [&] {
        dset = h5::dataset(H5Dopen2(file.get(), p.path().c_str(), H5P_DEFAULT), what);
      });
      const int bytes = catalog.groups.at(kGroup[p.kind]).at(p.name).elem_bytes;
      if (bytes == 4)
        read_plan<float>(comm, p, dset.get(), dxpl.get(), what, staging, r.checksum[i],
                         r.counted[i]);
      else
        read_plan<double>(comm, p, dset.get(), dxpl.get(), what, staging, r.checksum[i],
                          r.counted[i]);
      r.bytes += p.numel * bytes;
    }
  }
  mpi::sum(comm, r.checksum);
  mpi::sum(comm, r.counted);
  std::vector<std::int64_t> bytes{r.bytes};
  mpi::sum(comm, bytes);
  r.bytes = bytes[0];
  return r;
}

// Checks coverage and checksums (the same on every rank): throws naming the first bad dataset.
void check_totals(const std::string& path, const std::vector<DatasetPlan>& plans,
                  const ReadTotals& r, const Catalog& catalog, const std::string& where) {
  std::string first_bad;
  std::size_t n_bad = 0;
  for (std::size_t i = 0; i < plans.size(); ++i) {
    const DatasetPlan& p = plans[i];
    PTRAIN_REQUIRE(r.counted[i] == product(p.shape), where, "the ranks chosen to verify ", p.path(),
                   " read ", r.counted[i], " of its ", product(p.shape),
                   " elements (the owned ranges and the holder predicate must choose each "
                   "element exactly once)");
    if (r.checksum[i] != catalog.groups.at(kGroup[p.kind]).at(p.name).checksum && n_bad++ == 0)
      first_bad = p.path();
  }
  if (n_bad > 0)
    throw Error(cat(path, ": ", first_bad, " checksum mismatch: the data is corrupted",
                    n_bad > 1 ? cat(" (and ", n_bad - 1, " more tensors)") : std::string()));
}

// ---- writing ------------------------------------------------------------------------------

// What a save writes, the same on every rank but for this rank's part: its holdings, every
// dataset in the common order (pointing into `holdings`) and the checksums of whole datasets.
struct SavePlan {
  std::vector<Holding> holdings;
  std::map<std::string, Shape> names;
  std::vector<DatasetPlan> plans;
  std::vector<std::uint64_t> checksum;
  std::int64_t tensor_bytes = 0;
};

template <class T>
const T* data_of(const Buffers<const T>& buffers, const Holding& h) {
  return owned_of(buffers, h.kind)[h.owned].data + h.at;
}

// "<dataset> holds nan on rank 3" for the first element of this rank's part that is not
// finite, or "".
template <class T>
std::string first_non_finite(MPI_Comm comm, const SavePlan& s, const Buffers<const T>& buffers) {
  for (const auto& p : s.plans)
    for (const Holding* h : p.holdings) {
      const T* x = data_of(buffers, *h);
      for (std::int64_t j = 0; j < h->numel; ++j)
        if (!std::isfinite(x[j]))
          return cat(p.path(), " holds ", x[j], " on rank ", mpi::rank(comm));
    }
  return {};
}

// Checks the buffers, the holder predicate and the attributes (`error`: the caller's own
// finding), then plans the datasets and sums their checksums, all before anything is written.
// A non-finite value is refused: a diverged run must not replace the good files.
template <class T>
SavePlan plan_save(MPI_Comm comm, const std::vector<ChunkLayout>& chunks,
                   const Buffers<const T>& buffers, const TensorPredicate& holder,
                   const std::map<std::string, std::string>& attributes, std::string error,
                   const std::string& where) {
  SavePlan s;
  std::map<std::string, Shape> known;
  for (const char* reserved : {"format_version", "checksum_algorithm"})
    if (error.empty() && attributes.count(reserved))
      error = cat("the attribute name '", reserved, "' is reserved");
  if (error.empty()) error = collect_holdings(chunks, buffers, holder, true, s.holdings, known);
  mpi::agree(comm, error.empty() ? "" : where + error);
  agree_on_moments(comm, buffers.moments, where);
  s.names = gather_names(comm, known, where);
  require_same_attributes(comm, attributes, where);
  s.plans = make_plans(comm, s.names, s.holdings, kinds_of(buffers));
  const std::size_t n = s.plans.size();
  s.checksum.assign(n, 0);
  std::vector<std::int64_t> written(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    const DatasetPlan& p = s.plans[i];
    s.tensor_bytes += product(p.shape) * static_cast<std::int64_t>(sizeof(T));
    for (const Holding* h : p.holdings) {
      s.checksum[i] += boxes_checksum(p.shape, h->boxes, data_of(buffers, *h));
      written[i] += h->numel;
    }
  }
  mpi::sum(comm, s.checksum);
  mpi::sum(comm, written);
  for (std::size_t i = 0; i < n; ++i)
    PTRAIN_REQUIRE(written[i] == product(s.plans[i].shape), where, "the ranks chosen to write ",
                   s.plans[i].path(), " hold ", written[i], " of its ", product(s.plans[i].shape),
                   " elements (the owned ranges and the holder predicate must choose each "
                   "element exactly once)");
  const std::string bad = first_non_finite(comm, s, buffers);
  mpi::agree(comm, bad.empty() ? "" : cat(where, "not written: ", bad));
  return s;
}

// A scalar (array: a 1-d dataset of bits.size() elements) written by rank 0 in a collective
// call (the others select nothing).
void write_field(MPI_Comm comm, hid_t group, const StateField& f,
                 const std::vector<std::uint64_t>& bits, bool array, hid_t dxpl,
                 const std::string& what) {
  h5::Handle dset;
  const Shape shape = array ? Shape{std::int64_t(bits.size())} : Shape{};
  std::uint64_t checksum = 0;
  for (std::size_t i = 0; i < bits.size(); ++i) checksum += element_hash(std::int64_t(i), bits[i]);
  collective_step(comm, what + ": create", [&] {
    dset = create_dataset(group, f.name, file_type_of(f.type), shape, what);
    write_checksum_attribute(dset.get(), checksum, what);
  });
  auto fsel = h5::space(H5Dget_space(dset.get()), what);
  auto msel = h5::space(H5Dget_space(dset.get()), what);
  if (mpi::rank(comm) != 0) {
    h5::check(H5Sselect_none(fsel.get()), what);
    h5::check(H5Sselect_none(msel.get()), what);
  }
  collective_step(comm, what + ": write", [&] {
    h5::check(H5Dwrite(dset.get(), native_of(f.type), msel.get(), fsel.get(), dxpl, bits.data()),
              what + ": write");
  });
  close_step(comm, dset, what);
}

void write_state(MPI_Comm comm, hid_t file, const CheckpointState& state, hid_t dxpl,
                 const std::string& path) {
  auto group = create_group(comm, file, "state", path + ": /state");
  const auto bits = state_bits(state);
  for (std::size_t i = 0; i < std::size(kStateFields); ++i)
    write_field(comm, group.get(), kStateFields[i], {bits[i]}, false, dxpl,
                cat(path, ": /state/", kStateFields[i].name));
  if (state.has_data) {
    const auto data = bits.begin() + std::ptrdiff_t(std::size(kStateFields));
    write_field(comm, group.get(), kFingerprintField, {*data}, false, dxpl,
                cat(path, ": /state/", kFingerprintField.name));
    write_field(comm, group.get(), kDatasetSamplesField, {data + 1, bits.end()}, true, dxpl,
                cat(path, ": /state/", kDatasetSamplesField.name));
  }
  close_step(comm, group, path + ": /state");
}

// The file of a save: a checkpoint when `state` is given, else a weights file (/model only).
template <class T>
void write_file(const std::string& path, MPI_Comm comm, const SavePlan& s,
                const Buffers<const T>& buffers, const CheckpointState* state,
                const std::map<std::string, std::string>& attributes, const std::string& where) {
  const std::size_t n_state = state ? state_bits(*state).size() : 0;
  const std::int64_t bytes = estimated_file_bytes(s.tensor_bytes + 8 * std::int64_t(n_state),
                                                  s.plans.size() + n_state, attributes);
  const char* version = state ? kCheckpointFormatVersion : kWeightsFormatVersion;
  write_new_file(path, comm, bytes, version, attributes, where, [&](hid_t file) {
    std::vector<h5::Handle> groups;  // by kind
    h5::Handle optim;
    for (int k = 0; k < kinds_of(buffers); ++k) {
      if (k == 1) optim = create_group(comm, file, "optim", path + ": /optim");
      groups.push_back(create_group(comm, k == 0 ? file : optim.get(), kGroupLeaf[k],
                                    cat(path, ": /", kGroup[k])));
    }
    auto dxpl = collective_transfer_plist(where + "transfer");
    for (std::size_t i = 0; i < s.plans.size(); ++i) {
      const DatasetPlan& p = s.plans[i];
      TensorWrite<T> t{p.name, p.shape, s.checksum[i], &p.transfers, p.calls};
      // A save plan has at most one holding (collect_holdings).
      if (!p.holdings.empty()) t.data = data_of(buffers, *p.holdings.front());
      write_tensor(comm, groups[static_cast<std::size_t>(p.kind)].get(), dxpl.get(), t,
                   cat(path, ": ", p.path()));
    }
    if (state) write_state(comm, file, *state, dxpl.get(), path);
    for (int k = 0; k < kinds_of(buffers); ++k)
      close_step(comm, groups[static_cast<std::size_t>(k)], cat(path, ": /", kGroup[k]));
    if (optim) close_step(comm, optim, path + ": /optim");
  });
}

// What the load path checks, over the parts each rank wrote.
template <class T>
void verify_file(const std::string& path, MPI_Comm comm, const SavePlan& s, bool moments,
                 const CheckpointState* state, const std::string& where) {
  const Catalog catalog = state ? checkpoint_catalog(comm, path) : weights_catalog(comm, path);
  std::string problem = catalog_problem(path, catalog, s.names, moments);
  for (std::size_t i = 0; problem.empty() && i < s.plans.size(); ++i)
    if (catalog.groups.at(kGroup[s.plans[i].kind]).at(s.plans[i].name).checksum != s.checksum[i])
      problem = cat(path, ": ", s.plans[i].path(), " has the wrong checksum attribute");
  if (!problem.empty()) throw Error(problem);
  if (state && state_bits(shared_state(comm, path)) != state_bits(*state))
    throw Error(cat(path, ": /state reads back other values than were written"));
  const auto totals =
      read_holdings<T>(path, comm, s.plans, catalog, nullptr, where + "verification: ");
  check_totals(path, s.plans, totals, catalog, where);
}

// Rank 0 removes a temporary file that will not be published (it may be large).
void discard(MPI_Comm comm, const std::string& tmp) {
  if (mpi::rank(comm) == 0) std::remove(tmp.c_str());
}

// Writes the temporary file `tmp` of a save and verifies it. On any failure, the same on every
// rank, the file is removed and nothing is published. Returns the seconds of both.
template <class T>
std::pair<double, double> write_verified(const std::string& tmp, MPI_Comm comm, const SavePlan& s,
                                         const Buffers<const T>& buffers,
                                         const CheckpointState* state,
                                         const std::map<std::string, std::string>& attributes,
                                         const std::string& where) {
  const double t0 = MPI_Wtime();
  try {
    write_file<T>(tmp, comm, s, buffers, state, attributes, where);
  } catch (const Error& e) {
    discard(comm, tmp);
    throw e.reworded(cat(where, e.what(), " (nothing was published)"));
  }
  MPI_Barrier(comm);  // every rank's part is in the file before anyone reads it back
  const double t1 = MPI_Wtime();
  try {
    verify_file<T>(tmp, comm, s, buffers.moments, state, where);
  } catch (const Error& e) {
    // MPI-IO can lose writes to a full disk without an error: say so when that is the case.
    const std::string reason = os_write_reason(comm, tmp);
    discard(comm, tmp);
    throw e.reworded(
        cat(where, "verification of the written file failed (file removed): ", e.what(), reason));
  }
  return {t1 - t0, MPI_Wtime() - t1};
}

// ---- the folder: names, sync, rename, prune -----------------------------------------------

std::string in_folder(const std::string& dir, const std::string& name) {
  return (fs::path(dir.empty() ? "." : dir) / name).string();
}

// The step of "ckpt_<digits>.h5", or -1.
std::int64_t step_of_name(const std::string& name) {
  const std::string head = "ckpt_", tail = ".h5";
  if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
    return -1;
  const std::string digits = name.substr(head.size(), name.size() - head.size() - tail.size());
  if (digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stoll(digits);
}
bool is_temporary_name(const std::string& name) {
  const std::string tail = ".h5.tmp";
  return name.size() > tail.size() && name[0] == '.' &&
         step_of_name(name.substr(1, name.size() - 1 - 4)) >= 0 &&
         name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

// fsync of a file or folder; the data of a renamed file must be on disk before its name.
void sync_path(const std::string& path, bool folder) {
  const int fd = open(path.c_str(), folder ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) throw Error(cat(path, ": cannot open to sync: ", std::strerror(errno)));
  const int rc = fsync(fd);
  const int err = errno;
  close(fd);
  // Some file systems cannot sync a folder (EINVAL): the rename is then as durable as it gets.
  if (rc != 0 && !(folder && err == EINVAL))
    throw Error(cat(path, ": sync failed: ", std::strerror(err)));
}

void rename_path(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) throw Error(cat("cannot rename ", from, " to ", to, ": ", ec.message()));
}

// Rank 0, after verification: the temporary file becomes `final_path`, its data on disk first.
void rename_synced(const std::string& tmp, const std::string& final_path) {
  sync_path(tmp, false);
  rename_path(tmp, final_path);
}

// Rank 0 makes the folder when missing and checks that it can take the temporary file; every
// rank throws when not.
void agree_folder_ready(MPI_Comm comm, const std::string& dir, const std::string& tmp,
                        const std::string& where) {
  std::string error;
  if (mpi::rank(comm) == 0) {
    std::error_code ec;
    if (!dir.empty()) fs::create_directories(dir, ec);
    error =
        ec ? cat(where, "cannot create the folder ", dir, ": ", ec.message()) : folder_problem(tmp);
  }
  mpi::agree(comm, error);
}

// The regular files of `dir` whose names pass `keep_name`.
template <class F>
std::vector<std::string> files_in(const std::string& dir, F&& keep_name) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir.empty() ? "." : dir, ec)) {
    const std::string n = entry.path().filename().string();
    if (entry.is_regular_file() && keep_name(n)) out.push_back(n);
  }
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw Error(cat(dir, ": cannot list the checkpoint folder: ", ec.message()));
  return out;
}

// The validation loss a checkpoint was written with, or +inf (none, or unreadable).
double val_loss_of(const std::string& path) {
  try {
    const std::string text = read_string_attribute(path, kValLossAttribute);
    char* end = nullptr;
    const double x = std::strtod(text.c_str(), &end);
    return end != text.c_str() && std::isfinite(x) ? x : HUGE_VAL;
  } catch (const Error&) {
    return HUGE_VAL;
  }
}

// Rank 0: keeps the file just written and, of the others, the keep - 1 of the highest steps
// and (keep_best) the one of the lowest validation loss when it is lower than the new file's;
// removes temporary files left by crashed saves. Returns the removed files.
std::vector<std::string> prune(const std::string& dir, const std::string& name, int keep,
                               bool keep_best) {
  std::vector<std::string> removed = files_in(dir, is_temporary_name), others;
  for (const std::string& n : checkpoints_in(dir))
    if (n != name) others.push_back(n);
  std::string best;
  if (keep_best) {
    double lowest = val_loss_of(in_folder(dir, name));
    for (const std::string& n : others)
      if (const double v = val_loss_of(in_folder(dir, n)); v < lowest) lowest = v, best = n;
  }
  std::error_code ec;
  for (std::size_t i = static_cast<std::size_t>(keep - 1); i < others.size(); ++i)
    if (others[i] != best) removed.push_back(others[i]);
  for (const auto& n : removed) {
    fs::remove(in_folder(dir, n), ec);
    if (ec) throw Error(cat(in_folder(dir, n), ": cannot remove: ", ec.message()));
  }
  return removed;
}

// Rank 0, after verification: publish the file, point `latest` at it, prune the folder.
// The new pointer is written before anything is renamed, so a disk too full for it leaves the
// folder as it was. Returns the removed files.
std::vector<std::string> publish(const std::string& dir, const std::string& tmp,
                                 const std::string& name, int keep, bool keep_best) {
  const std::string pointer = in_folder(dir, "latest"), pointer_tmp = in_folder(dir, "latest.tmp");
  {
    std::ofstream out(pointer_tmp, std::ios::trunc);
    out << name << "\n";
    out.close();
    if (!out) {
      std::remove(pointer_tmp.c_str());
      throw Error(cat(pointer_tmp, ": cannot write: ", std::strerror(errno)));
    }
  }
  sync_path(pointer_tmp, false);
  rename_synced(tmp, in_folder(dir, name));
  rename_path(pointer_tmp, pointer);
  sync_path(dir.empty() ? "." : dir, true);
  return prune(dir, name, keep, keep_best);
}

// Runs `publish` (returning the files it removed) on rank 0 and agrees on how it went; a
// failure removes the temporary file. Every rank's report gets the file size and the removals.
template <class Publish>
void publish_on_root(MPI_Comm comm, const std::string& tmp, const std::string& where,
                     SaveReport& report, Publish&& publish) {
  std::vector<std::string> removed;
  std::string error;
  std::int64_t file_bytes = 0;
  if (mpi::rank(comm) == 0) {
    try {
      std::error_code ec;
      file_bytes = static_cast<std::int64_t>(fs::file_size(tmp, ec));
      removed = publish();
    } catch (const std::exception& e) {
      std::remove(tmp.c_str());
      error = where + e.what();
    }
  }
  mpi::agree(comm, error);
  Packer r;
  r.i64(file_bytes);
  for (const auto& f : removed) r.str(f);
  const std::string bytes = mpi::broadcast(comm, 0, r.bytes);
  Unpacker in(bytes.data(), bytes.size());
  report.file_bytes = in.i64();
  while (!in.done()) report.removed.push_back(in.str());
}

}  // namespace

std::vector<std::string> checkpoints_in(const std::string& dir) {
  std::vector<std::string> names =
      files_in(dir, [](const std::string& n) { return step_of_name(n) >= 0; });
  std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
    return step_of_name(a) > step_of_name(b);
  });
  return names;
}

// ---- public API ----------------------------------------------------------------------------

std::string checkpoint_file_name(std::int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "ckpt_%08lld.h5", static_cast<long long>(step));
  return buf;
}

namespace {
// What a file system entry that is no regular file is, for a message.
std::string kind_of(const fs::file_status& st) {
  switch (st.type()) {
    case fs::file_type::directory:
      return "a folder";
    case fs::file_type::fifo:
      return "a named pipe";
    case fs::file_type::socket:
      return "a socket";
    case fs::file_type::block:
    case fs::file_type::character:
      return "a device";
    default:
      return "no regular file";
  }
}

// A `latest` that is a symbolic link (made by hand): the checkpoint it links to, when that is a
// checkpoint file of `dir`; otherwise refused, saying what it links to.
std::string linked_checkpoint(const std::string& pointer, const std::string& dir) {
  std::error_code ec;
  const fs::path target = fs::read_symlink(pointer, ec);
  const std::string name = target.filename().string();
  const fs::path parent = target.parent_path();
  const fs::path folder = dir.empty() ? "." : dir;
  const bool here = !ec && step_of_name(name) >= 0 &&
                    (parent.empty() ||
                     fs::equivalent(parent.is_absolute() ? parent : folder / parent, folder, ec));
  if (!here)
    throw Error(cat(pointer, " is a symbolic link to ", h5::printable(target.string(), 80),
                    ", not to a checkpoint file (ckpt_<step>.h5) of ", folder.string(),
                    "; `latest` should be a one-line file naming one"));
  const std::string path = in_folder(dir, name);
  if (!fs::is_regular_file(path, ec))
    throw Error(cat(pointer, " is a symbolic link to ", name, ", which does not exist"));
  return path;
}
}  // namespace

std::string resolve_checkpoint(const std::string& restart, const std::string& dir) {
  if (restart.empty()) throw Error("no checkpoint to restart from was named (restart is empty)");
  if (restart != "latest") return restart;
  const std::string pointer = in_folder(dir, "latest");
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(pointer, ec);
  if (fs::is_symlink(st)) return linked_checkpoint(pointer, dir);
  if (!fs::exists(st))
    throw Error(cat(pointer, ": no checkpoint to restart from (restart = 'latest' but ",
                    dir.empty() ? "." : dir, " has no 'latest' pointer)"));
  if (!fs::is_regular_file(st))
    throw Error(cat(pointer, " is ", kind_of(st), ", not a one-line file naming a checkpoint"));
  // One line naming a file: never more than a path's length is read, nor binary bytes used.
  constexpr std::size_t kMost = 4096;
  std::ifstream in(pointer, std::ios::binary);
  std::string bytes(kMost + 1, '\0');
  in.read(bytes.data(), std::streamsize(bytes.size()));
  if (in.bad() || !in.is_open()) throw Error(cat(pointer, ": cannot read"));
  bytes.resize(std::size_t(in.gcount()));
  const bool binary = std::any_of(bytes.begin(), bytes.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return (u < 0x20 && c != '\n' && c != '\r' && c != '\t') || u == 0x7f;
  });
  std::string name = bytes.substr(0, bytes.find('\n'));
  if (binary || name.size() > kMost)
    throw Error(cat(pointer, " is not a one-line file naming a checkpoint (it holds ",
                    binary ? "binary data" : "a line too long for a file name", ": '",
                    h5::printable(bytes, 60), "')"));
  const auto first = name.find_first_not_of(" \t\r"), last = name.find_last_not_of(" \t\r");
  name = first == std::string::npos ? "" : name.substr(first, last - first + 1);
  if (name.empty()) throw Error(cat(pointer, ": is empty (it should name a checkpoint file)"));
  const std::string target = fs::path(name).is_absolute() ? name : in_folder(dir, name);
  if (!fs::exists(target, ec))
    throw Error(cat(pointer, " points at ", h5::printable(name, 80), ", which does not exist"));
  return target;
}

template <class T>
SaveReport save_checkpoint(const std::string& dir, MPI_Comm comm,
                           const std::vector<ChunkLayout>& chunks, const Buffers<const T>& buffers,
                           const TensorPredicate& holder, const CheckpointState& state,
                           const std::map<std::string, std::string>& attributes, int keep,
                           bool keep_best) {
  h5::QuietErrors quiet;
  const double t0 = MPI_Wtime();
  const std::string name = checkpoint_file_name(state.step);
  const std::string tmp = in_folder(dir, "." + name + ".tmp");
  const std::string where = cat("save_checkpoint ", in_folder(dir, name), ": ");
  IoPhase watched(tmp, tmp);

  // 1. What this rank writes; every rank agrees on the datasets, attributes and state.
  std::string error;
  if (keep < 1) error = cat("keep = ", keep, ": at least the newest checkpoint must be kept");
  if (error.empty() && state.step < 0) error = cat("the step ", state.step, " is negative");
  std::int64_t drawn = 0;
  for (std::int64_t n : state.dataset_samples) drawn += n;
  if (error.empty() && state.has_data &&
      (state.dataset_samples.empty() || drawn != state.consumed_samples))
    error = cat("the samples of ", state.dataset_samples.size(), " datasets sum to ", drawn,
                ", not to the ", state.consumed_samples, " consumed");
  const SavePlan s = plan_save(comm, chunks, buffers, holder, attributes, error, where);
  Packer st;
  for (auto b : state_bits(state)) st.u64(b);
  st.i64(keep);
  st.i64(keep_best);
  require_same_on_all_ranks(comm, st.bytes, where, "the state (step, samples, t, seed, lr, keep)");

  // 2. The folder (made when missing) and the date, by rank 0 for everyone.
  agree_folder_ready(comm, dir, tmp, where);
  std::map<std::string, std::string> attrs = attributes;
  const std::string date = mpi::broadcast(comm, 0, mpi::rank(comm) == 0 ? utc_now() : "");
  if (!attrs.count("date")) attrs["date"] = date;

  // 3. The temporary file, written and verified; then published by rank 0.
  SaveReport report;
  std::tie(report.write_seconds, report.verify_seconds) =
      write_verified(tmp, comm, s, buffers, &state, attrs, where);
  publish_on_root(comm, tmp, where, report,
                  [&] { return publish(dir, tmp, name, keep, keep_best); });
  report.path = in_folder(dir, name);
  report.data_bytes = s.tensor_bytes + static_cast<std::int64_t>(state_bits(state).size()) * 8;
  report.seconds = MPI_Wtime() - t0;
  return report;
}

template <class T>
SaveReport save_owned_weights(const std::string& path, MPI_Comm comm,
                              const std::vector<ChunkLayout>& chunks,
                              const Buffers<const T>& buffers, const TensorPredicate& holder,
                              const std::map<std::string, std::string>& attributes) {
  h5::QuietErrors quiet;
  const double t0 = MPI_Wtime();
  const fs::path final_path(path);
  const std::string dir = final_path.parent_path().string();
  const std::string tmp = in_folder(dir, "." + final_path.filename().string() + ".tmp");
  const std::string where = cat("save weights ", path, ": ");
  IoPhase watched(tmp, tmp);
  const Buffers<const T> params{buffers.params, false, {}, {}};
  const SavePlan s = plan_save(comm, chunks, params, holder, attributes, "", where);
  agree_folder_ready(comm, dir, tmp, where);
  SaveReport report;
  std::tie(report.write_seconds, report.verify_seconds) =
      write_verified(tmp, comm, s, params, nullptr, attributes, where);
  publish_on_root(comm, tmp, where, report, [&] {
    rename_synced(tmp, path);
    sync_path(dir.empty() ? "." : dir, true);
    return std::vector<std::string>{};
  });
  report.path = path;
  report.data_bytes = s.tensor_bytes;
  report.seconds = MPI_Wtime() - t0;
  return report;
}

template <class T>
CheckpointState load_checkpoint(const std::string& restart, const std::string& dir, MPI_Comm comm,
                                const std::vector<ChunkLayout>& chunks, const Buffers<T>& buffers,
                                const TensorPredicate& holder, CheckpointLoadReport* report) {
  h5::QuietErrors quiet;
  IoPhase watched(restart == "latest" ? in_folder(dir, restart) : restart, "");
  const double t0 = MPI_Wtime();
  // 1. The file (rank 0 resolves 'latest' for everyone).
  std::string path, error;
  if (mpi::rank(comm) == 0) {
    try {
      path = resolve_checkpoint(restart, dir);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  mpi::agree(comm, error);
  path = mpi::broadcast(comm, 0, path);
  const std::string where = cat("load_checkpoint ", path, ": ");

  // 2. What this rank needs, the model's tensors, what the file holds and its state.
  std::vector<Holding> holdings;
  std::map<std::string, Shape> known;
  error = collect_holdings(chunks, buffers, holder, false, holdings, known);
  mpi::agree(comm, error.empty() ? "" : where + error);
  agree_on_moments(comm, buffers.moments, where);
  const auto names = gather_names(comm, known, where);
  const Catalog catalog = checkpoint_catalog(comm, path);
  if (auto problem = catalog_problem(path, catalog, names, buffers.moments); !problem.empty())
    throw Error(problem);  // the same on every rank
  const CheckpointState state = shared_state(comm, path);
  const auto plans = make_plans(comm, names, holdings, kinds_of(buffers));

  // 3. Collective reads into staging copies of the owned ranges (padding stays zero), then
  // the checksums: every problem is found before the caller's buffers change.
  const int kinds = kinds_of(buffers);
  std::vector<std::vector<std::vector<T>>> staging(static_cast<std::size_t>(kinds));
  std::size_t staging_bytes = 0;
  for (int k = 0; k < kinds; ++k)
    for (const auto& o : owned_of(buffers, k)) {
      staging[static_cast<std::size_t>(k)].emplace_back(o.hi - o.lo, T(0));
      staging_bytes += (o.hi - o.lo) * sizeof(T);
    }
  WorkspaceCharge charge(staging_bytes);
  const auto totals = read_holdings<T>(path, comm, plans, catalog, &staging, where);
  check_totals(path, plans, totals, catalog, where);

  // 4. Only now the caller's buffers change.
  for (int k = 0; k < kinds; ++k)
    for (std::size_t i = 0; i < buffers.params.size(); ++i) {
      const auto& src = staging[static_cast<std::size_t>(k)][i];
      std::copy(src.begin(), src.end(), owned_of(buffers, k)[i].data);
    }
  if (report) {
    bool any4 = false, any8 = false;
    for (const auto& p : plans)
      (catalog.groups.at(kGroup[p.kind]).at(p.name).elem_bytes == 4 ? any4 : any8) = true;
    report->path = path;
    report->file_dtype = any4 && any8 ? "mixed" : any8 ? "fp64" : "fp32";
    report->attributes = catalog.attributes;
    report->bytes_read = totals.bytes;
    report->seconds = MPI_Wtime() - t0;
  }
  return state;
}

#define PTRAIN_CKPT_INSTANTIATE(T)                                                                 \
  template SaveReport save_checkpoint<T>(const std::string&, MPI_Comm,                             \
                                         const std::vector<ChunkLayout>&, const Buffers<const T>&, \
                                         const TensorPredicate&, const CheckpointState&,           \
                                         const std::map<std::string, std::string>&, int, bool);    \
  template CheckpointState load_checkpoint<T>(const std::string&, const std::string&, MPI_Comm,    \
                                              const std::vector<ChunkLayout>&, const Buffers<T>&,  \
                                              const TensorPredicate&, CheckpointLoadReport*);      \
  template SaveReport save_owned_weights<T>(                                                       \
      const std::string&, MPI_Comm, const std::vector<ChunkLayout>&, const Buffers<const T>&,      \
      const TensorPredicate&, const std::map<std::string, std::string>&);
PTRAIN_CKPT_INSTANTIATE(float)
PTRAIN_CKPT_INSTANTIATE(double)
#undef PTRAIN_CKPT_INSTANTIATE

}  // namespace ptrain::ckpt
