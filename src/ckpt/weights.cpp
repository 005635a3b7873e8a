#include "ckpt/weights.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <type_traits>

#include "ckpt/h5.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/memory.hpp"

namespace ptrain::ckpt {

using model::ChunkLayout;
using model::Shape;
using model::Slab;
using model::TensorSpec;

namespace {

constexpr const char* kChecksumAlgorithm =
    "ptrain-hash64-v1: sum mod 2^64 over elements of "
    "mix64(mix64(i + 0x9e3779b97f4a7c15) ^ bits(x_i)), i the global row-major index, "
    "bits the stored IEEE bit pattern zero-extended to 64 bits, mix64 the splitmix64 finaliser";

// ---- checksum ---------------------------------------------------------------------------

std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

std::uint64_t element_hash(std::int64_t index, std::uint64_t bits) {
  return mix64(mix64(static_cast<std::uint64_t>(index) + 0x9e3779b97f4a7c15ULL) ^ bits);
}

template <class U>
std::uint64_t bits_of(U x) {
  static_assert(std::is_same_v<U, float> || std::is_same_v<U, double>);
  if constexpr (std::is_same_v<U, float>) {
    std::uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  } else {
    std::uint64_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  }
}

// Calls f(global_offset, local_offset, length) for each contiguous run (along the last
// dimension) of slab s of a tensor of global shape `shape`; local offsets count the slab's
// elements in row-major order.
template <class F>
void for_each_run(const Shape& shape, const Slab& s, F&& f) {
  const std::size_t d = shape.size();
  if (d == 0 || s.numel() == 0) return;
  std::vector<std::int64_t> stride(d, 1);
  for (std::size_t k = d - 1; k-- > 0;) stride[k] = stride[k + 1] * shape[k + 1];
  std::vector<std::int64_t> idx(d - 1, 0);  // position inside the slab, outer dims
  const std::int64_t len = s.count[d - 1];
  for (std::int64_t local = 0;; local += len) {
    std::int64_t g = s.start[d - 1];
    for (std::size_t k = 0; k + 1 < d; ++k) g += (s.start[k] + idx[k]) * stride[k];
    f(g, local, len);
    std::size_t k = d - 1;
    while (k > 0) {
      if (++idx[k - 1] < s.count[k - 1]) break;
      idx[k - 1] = 0;
      --k;
    }
    if (k == 0) return;
  }
}

// Checksum of the slabs of one tensor whose elements lie back to back at `data`.
template <class U>
std::uint64_t slabs_checksum(const Shape& shape, const std::vector<Slab>& slabs, const U* data) {
  std::uint64_t sum = 0;
  std::int64_t base = 0;
  for (const auto& s : slabs) {
    for_each_run(shape, s, [&](std::int64_t g, std::int64_t local, std::int64_t len) {
      const U* x = data + base + local;
      for (std::int64_t j = 0; j < len; ++j) sum += element_hash(g + j, bits_of(x[j]));
    });
    base += s.numel();
  }
  return sum;
}

// ---- small helpers -----------------------------------------------------------------------

std::int64_t product(const Shape& s) {
  std::int64_t n = 1;
  for (auto x : s) n *= x;
  return n;
}

std::string format_shape(const Shape& s) {
  std::string out = "(";
  for (std::size_t i = 0; i < s.size(); ++i) out += cat(i ? ", " : "", s[i]);
  return out + ")";
}

std::int64_t slabs_numel(const TensorSpec& t) {
  std::int64_t n = 0;
  for (const auto& s : t.slabs) n += s.numel();
  return n;
}

std::vector<hsize_t> to_hsize(const Shape& s) { return std::vector<hsize_t>(s.begin(), s.end()); }

std::uint64_t fnv1a(const std::string& bytes) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

template <class U>
hid_t native_type() {
  return std::is_same_v<U, float> ? H5T_NATIVE_FLOAT : H5T_NATIVE_DOUBLE;
}
template <class U>
hid_t file_type() {
  return std::is_same_v<U, float> ? H5T_IEEE_F32LE : H5T_IEEE_F64LE;
}

// Byte (de)serialisation for what ranks exchange.
class Packer {
 public:
  void i64(std::int64_t v) { raw(&v, sizeof v); }
  void u64(std::uint64_t v) { raw(&v, sizeof v); }
  void str(const std::string& s) {
    i64(static_cast<std::int64_t>(s.size()));
    raw(s.data(), s.size());
  }
  void shape(const Shape& s) {
    i64(static_cast<std::int64_t>(s.size()));
    for (auto x : s) i64(x);
  }
  std::string bytes;

 private:
  void raw(const void* p, std::size_t n) { bytes.append(static_cast<const char*>(p), n); }
};

class Unpacker {
 public:
  Unpacker(const char* p, std::size_t n) : p_(p), end_(p + n) {}
  bool done() const { return p_ >= end_; }
  std::int64_t i64() { return get<std::int64_t>(); }
  std::uint64_t u64() { return get<std::uint64_t>(); }
  std::string str() {
    const auto n = static_cast<std::size_t>(i64());
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  Shape shape() {
    Shape s(static_cast<std::size_t>(i64()));
    for (auto& x : s) x = i64();
    return s;
  }

 private:
  template <class V>
  V get() {
    V v;
    std::memcpy(&v, p_, sizeof v);
    p_ += sizeof v;
    return v;
  }
  const char* p_;
  const char* end_;
};

int rank_of(MPI_Comm comm) {
  int r = 0;
  MPI_Comm_rank(comm, &r);
  return r;
}

std::string broadcast_string(MPI_Comm comm, int root, std::string s) {
  long long n = static_cast<long long>(s.size());
  MPI_Bcast(&n, 1, MPI_LONG_LONG, root, comm);
  s.resize(static_cast<std::size_t>(n));
  if (n > 0) MPI_Bcast(s.data(), static_cast<int>(n), MPI_CHAR, root, comm);
  return s;
}

// Makes every rank throw the same error when any rank found one (the lowest such rank's).
void agree(MPI_Comm comm, const std::string& local_error) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  int mine = local_error.empty() ? size : rank, first = size;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == size) return;
  throw Error(broadcast_string(comm, first, local_error));
}

// Keeps a host buffer's bytes in the tracked memory statistics while it lives.
class WorkspaceCharge {
 public:
  explicit WorkspaceCharge(std::size_t bytes) : bytes_(bytes) {
    memory::add(MemCategory::workspace, bytes_);
  }
  ~WorkspaceCharge() { memory::sub(MemCategory::workspace, bytes_); }
  WorkspaceCharge(const WorkspaceCharge&) = delete;
  WorkspaceCharge& operator=(const WorkspaceCharge&) = delete;

 private:
  std::size_t bytes_;
};

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
      if (t.global_shape.empty()) return cat(t.name, ": a tensor needs at least one dimension");
      if (t.offset < 0 || t.offset + t.numel > chunks[c].numel)
        return cat(t.name, ": elements [", t.offset, ", ", t.offset + t.numel,
                   ") lie outside chunk ", c, " of ", chunks[c].numel);
      for (const auto& s : t.slabs) {
        if (s.start.size() != t.global_shape.size() || s.count.size() != t.global_shape.size())
          return cat(t.name, ": a slab has the wrong number of dimensions");
        for (std::size_t k = 0; k < s.start.size(); ++k)
          if (s.start[k] < 0 || s.count[k] < 0 || s.start[k] + s.count[k] > t.global_shape[k])
            return cat(t.name, ": slab lies outside the global shape ",
                       format_shape(t.global_shape));
      }
      if (slabs_numel(t) > t.numel)
        return cat(t.name, ": slabs hold ", slabs_numel(t), " elements, the local tensor only ",
                   t.numel);
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
  Packer mine;
  for (const auto& [name, h] : held)
    if (h.primary) {
      mine.str(name);
      mine.shape(h.spec().global_shape);
    }
  int size = 1;
  MPI_Comm_size(comm, &size);
  int my_bytes = static_cast<int>(mine.bytes.size());
  std::vector<int> counts(size), displs(size);
  MPI_Allgather(&my_bytes, 1, MPI_INT, counts.data(), 1, MPI_INT, comm);
  long long total = 0;
  for (int r = 0; r < size; ++r) {
    displs[r] = static_cast<int>(total);
    total += counts[r];
  }
  PTRAIN_REQUIRE(total < (1LL << 31), "checkpoint: the tensor catalogue is too large (", total,
                 " bytes)");
  std::string all(static_cast<std::size_t>(total), '\0');
  MPI_Allgatherv(mine.bytes.data(), my_bytes, MPI_CHAR, all.data(), counts.data(), displs.data(),
                 MPI_CHAR, comm);
  std::map<std::string, Shape> names;
  std::string error;
  for (Unpacker in(all.data(), all.size()); !in.done();) {
    std::string name = in.str();
    Shape shape = in.shape();
    auto [it, fresh] = names.emplace(name, shape);
    if (!fresh && it->second != shape && error.empty())
      error = cat(name, ": ranks disagree on its global shape (", format_shape(it->second), " and ",
                  format_shape(shape), ")");
  }
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
  agree(comm, error.empty() ? "" : where + error);
  return names;
}

// A group of slabs that one H5Dread/H5Dwrite moves: their union, traversed in row-major
// order, must equal their concatenation in local order. That holds when each slab's rows
// (first dimension) come after the previous one's, as for the q, k, v blocks of qkv.
// Otherwise (e.g. blocks of columns) each slab is its own transfer.
struct Transfer {
  std::vector<const Slab*> slabs;
  std::int64_t offset = 0;  // of the first element in the concatenated slab data
  std::int64_t numel = 0;
};

std::vector<Transfer> transfers_of(const TensorSpec& t) {
  std::vector<Transfer> out;
  std::int64_t offset = 0;
  for (const auto& s : t.slabs) {
    const std::int64_t n = s.numel();
    if (n == 0) continue;
    const Slab* last = out.empty() ? nullptr : out.back().slabs.back();
    if (last && s.start[0] >= last->start[0] + last->count[0]) {
      out.back().slabs.push_back(&s);
      out.back().numel += n;
    } else {
      out.push_back(Transfer{{&s}, offset, n});
    }
    offset += n;
  }
  return out;
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
      p.transfers = transfers_of(it->second.spec());
    }
    calls.push_back(static_cast<std::int64_t>(p.transfers.size()));
    plans.push_back(std::move(p));
  }
  if (!calls.empty())
    MPI_Allreduce(MPI_IN_PLACE, calls.data(), static_cast<int>(calls.size()), MPI_INT64_T, MPI_MAX,
                  comm);
  for (std::size_t i = 0; i < plans.size(); ++i) plans[i].calls = calls[i];
  return plans;
}

// Runs the plan's collective transfers: io(file selection, memory space, pointer) for
// each call; ranks with fewer transfers than the maximum select nothing.
template <class Byte, class IO>
void for_each_transfer(const Plan& p, hid_t filespace, Byte* base, std::size_t elem_bytes,
                       const std::string& what, IO&& io) {
  static_assert(sizeof(Byte) == 1);
  static double dummy = 0;  // the buffer of an empty selection
  for (std::int64_t k = 0; k < p.calls; ++k) {
    auto fsel = h5::space(H5Scopy(filespace), what);
    const bool mine = k < static_cast<std::int64_t>(p.transfers.size());
    const hsize_t n = mine ? static_cast<hsize_t>(p.transfers[k].numel) : 1;
    auto msel = h5::space(H5Screate_simple(1, &n, nullptr), what);
    Byte* ptr = reinterpret_cast<Byte*>(&dummy);
    if (mine) {
      bool first = true;
      for (const Slab* s : p.transfers[k].slabs) {
        auto start = to_hsize(s->start), count = to_hsize(s->count);
        h5::check(H5Sselect_hyperslab(fsel.get(), first ? H5S_SELECT_SET : H5S_SELECT_OR,
                                      start.data(), nullptr, count.data(), nullptr),
                  what);
        first = false;
      }
      ptr = base + static_cast<std::size_t>(p.transfers[k].offset) * elem_bytes;
    } else {
      h5::check(H5Sselect_none(fsel.get()), what);
      h5::check(H5Sselect_none(msel.get()), what);
    }
    io(fsel.get(), msel.get(), ptr);
  }
}

h5::Handle collective_transfer_plist(const std::string& what) {
  auto dxpl = h5::plist(H5Pcreate(H5P_DATASET_XFER), what);
  h5::check(H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_COLLECTIVE), what);
  return dxpl;
}

void write_string_attribute(hid_t object, const std::string& name, const std::string& value,
                            const std::string& what) {
  auto type = h5::type(H5Tcopy(H5T_C_S1), what);
  h5::check(H5Tset_size(type.get(), std::max<std::size_t>(value.size(), 1)), what);
  h5::check(H5Tset_strpad(type.get(), H5T_STR_NULLPAD), what);
  h5::check(H5Tset_cset(type.get(), H5T_CSET_UTF8), what);
  auto space = h5::space(H5Screate(H5S_SCALAR), what);
  auto attr = h5::attribute(
      H5Acreate2(object, name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT),
      cat(what, ": attribute ", name));
  const std::string padded = value.empty() ? std::string(1, '\0') : value;
  h5::check(H5Awrite(attr.get(), type.get(), padded.data()), cat(what, ": attribute ", name));
}

// Reads a string attribute (fixed or variable length) of an open object.
std::string read_string_attr(hid_t attr, const std::string& what) {
  auto type = h5::type(H5Aget_type(attr), what);
  PTRAIN_REQUIRE(H5Tget_class(type.get()) == H5T_STRING, what, " is not a string");
  const H5T_cset_t cset = H5Tget_cset(type.get());  // HDF5 does not convert between csets
  if (H5Tis_variable_str(type.get()) > 0) {
    auto mem = h5::type(H5Tcopy(H5T_C_S1), what);
    h5::check(H5Tset_size(mem.get(), H5T_VARIABLE), what);
    h5::check(H5Tset_cset(mem.get(), cset), what);
    char* s = nullptr;
    h5::check(H5Aread(attr, mem.get(), &s), what);
    std::string out = s ? s : "";
    H5free_memory(s);
    return out;
  }
  const std::size_t n = H5Tget_size(type.get());
  std::string out(n, '\0');
  auto mem = h5::type(H5Tcopy(H5T_C_S1), what);
  h5::check(H5Tset_size(mem.get(), n), what);
  h5::check(H5Tset_strpad(mem.get(), H5T_STR_NULLPAD), what);
  h5::check(H5Tset_cset(mem.get(), cset), what);
  h5::check(H5Aread(attr, mem.get(), out.data()), what);
  out.resize(std::strlen(out.c_str()));
  return out;
}

// ---- what a file holds (read serially by one rank before the collective open) -----------

struct FileDataset {
  Shape shape;
  int elem_bytes = 0;  // 4 or 8 for IEEE floats, 0 for anything else
  bool has_checksum = false;
  std::uint64_t checksum = 0;
};

struct Catalog {
  std::string error;  // why the file cannot be used; empty when it can
  std::map<std::string, FileDataset> datasets;
  std::map<std::string, std::string> attributes;

  std::string pack() const {
    Packer p;
    p.str(error);
    p.i64(static_cast<std::int64_t>(datasets.size()));
    for (const auto& [name, d] : datasets) {
      p.str(name);
      p.shape(d.shape);
      p.i64(d.elem_bytes);
      p.i64(d.has_checksum);
      p.u64(d.checksum);
    }
    p.i64(static_cast<std::int64_t>(attributes.size()));
    for (const auto& [k, v] : attributes) {
      p.str(k);
      p.str(v);
    }
    return p.bytes;
  }
  static Catalog unpack(const std::string& bytes) {
    Unpacker in(bytes.data(), bytes.size());
    Catalog c;
    c.error = in.str();
    for (auto n = in.i64(); n > 0; --n) {
      std::string name = in.str();
      FileDataset d;
      d.shape = in.shape();
      d.elem_bytes = static_cast<int>(in.i64());
      d.has_checksum = in.i64() != 0;
      d.checksum = in.u64();
      c.datasets.emplace(std::move(name), d);
    }
    for (auto n = in.i64(); n > 0; --n) {
      std::string k = in.str();
      c.attributes[k] = in.str();
    }
    return c;
  }
};

bool has_hdf5_signature(const std::string& path) {
  static const char sig[8] = {'\211', 'H', 'D', 'F', '\r', '\n', '\032', '\n'};
  std::ifstream in(path, std::ios::binary);
  char head[8] = {};
  in.read(head, 8);
  return in.gcount() == 8 && std::memcmp(head, sig, 8) == 0;
}

// Opens a file serially for reading, with a message saying why it cannot be.
h5::Handle open_serial(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) throw Error(cat(path, ": cannot open: ", std::strerror(errno)));
  if (S_ISDIR(st.st_mode)) throw Error(cat(path, ": is a folder, not an HDF5 file"));
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) {
    const std::string why = h5::last_error();
    if (!has_hdf5_signature(path)) throw Error(cat(path, ": not an HDF5 file"));
    throw Error(cat(path, ": HDF5 cannot read it (truncated or damaged file): ", why));
  }
  return h5::Handle(f, H5Fclose);
}

Catalog read_catalog(const std::string& path) {
  Catalog c;
  try {
    auto file = open_serial(path);
    std::vector<std::string> attr_names;
    hsize_t idx = 0;
    H5Aiterate2(
        file.get(), H5_INDEX_NAME, H5_ITER_INC, &idx,
        [](hid_t, const char* name, const H5A_info_t*, void* out) -> herr_t {
          static_cast<std::vector<std::string>*>(out)->push_back(name);
          return 0;
        },
        &attr_names);
    for (const auto& name : attr_names) {
      auto attr = h5::attribute(H5Aopen(file.get(), name.c_str(), H5P_DEFAULT),
                                cat(path, ": attribute ", name));
      auto type = h5::type(H5Aget_type(attr.get()), path);
      if (H5Tget_class(type.get()) == H5T_STRING)
        c.attributes[name] = read_string_attr(attr.get(), cat(path, ": attribute ", name));
    }
    auto version = c.attributes.find("format_version");
    if (version == c.attributes.end())
      throw Error(cat(path, ": not a ptrain weights file (no format_version attribute)"));
    if (version->second != kWeightsFormatVersion)
      throw Error(cat(path, ": format_version ", version->second,
                      " is not supported (this ptrain reads ", kWeightsFormatVersion, ")"));
    if (H5Lexists(file.get(), "model", H5P_DEFAULT) <= 0)
      throw Error(cat(path, ": no group /model (not a ptrain weights file)"));
    auto group = h5::group(H5Gopen2(file.get(), "model", H5P_DEFAULT), cat(path, ": /model"));
    H5G_info_t info;
    h5::check(H5Gget_info(group.get(), &info), cat(path, ": /model"));
    for (hsize_t i = 0; i < info.nlinks; ++i) {
      const ssize_t len = H5Lget_name_by_idx(group.get(), ".", H5_INDEX_NAME, H5_ITER_INC, i,
                                             nullptr, 0, H5P_DEFAULT);
      h5::check(static_cast<herr_t>(len < 0 ? -1 : 0), cat(path, ": /model"));
      std::string name(static_cast<std::size_t>(len) + 1, '\0');
      H5Lget_name_by_idx(group.get(), ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(), name.size(),
                         H5P_DEFAULT);
      name.resize(static_cast<std::size_t>(len));
      const std::string what = cat(path, ": /model/", name);
      auto obj = h5::checked(H5Oopen(group.get(), name.c_str(), H5P_DEFAULT), H5Oclose, what);
      if (H5Iget_type(obj.get()) != H5I_DATASET) continue;
      FileDataset d;
      auto space = h5::space(H5Dget_space(obj.get()), what);
      const int nd = H5Sget_simple_extent_ndims(space.get());
      h5::check(nd < 0 ? -1 : 0, what);
      std::vector<hsize_t> dims(static_cast<std::size_t>(nd));
      H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
      d.shape.assign(dims.begin(), dims.end());
      auto type = h5::type(H5Dget_type(obj.get()), what);
      if (H5Tget_class(type.get()) == H5T_FLOAT) {
        const std::size_t bytes = H5Tget_size(type.get());
        if (bytes == 4 || bytes == 8) d.elem_bytes = static_cast<int>(bytes);
      }
      if (H5Aexists(obj.get(), "checksum") > 0) {
        auto attr = h5::attribute(H5Aopen(obj.get(), "checksum", H5P_DEFAULT), what);
        h5::check(H5Aread(attr.get(), H5T_NATIVE_UINT64, &d.checksum), what + ": checksum");
        d.has_checksum = true;
      }
      c.datasets.emplace(name, std::move(d));
    }
  } catch (const std::exception& e) {  // reported by every rank, not thrown on rank 0 alone
    c.error = e.what();
  }
  return c;
}

// The catalogue of `path`, read by rank 0 and sent to every rank.
Catalog shared_catalog(MPI_Comm comm, const std::string& path) {
  std::string bytes;
  if (rank_of(comm) == 0) bytes = read_catalog(path).pack();
  return Catalog::unpack(broadcast_string(comm, 0, std::move(bytes)));
}

// Why the file cannot feed the model's tensors (the first problem in name order), or "".
std::string check_against_model(const std::string& path, const Catalog& file,
                                const std::map<std::string, Shape>& names) {
  for (const auto& [name, shape] : names) {
    auto it = file.datasets.find(name);
    if (it == file.datasets.end())
      return cat(path, ": no dataset /model/", name, " (the model needs shape ",
                 format_shape(shape), ")");
    const FileDataset& d = it->second;
    if (d.shape != shape)
      return cat(path, ": /model/", name, " has shape ", format_shape(d.shape),
                 ", the model needs ", format_shape(shape));
    if (d.elem_bytes == 0)
      return cat(path, ": /model/", name, " is not a float32 or float64 dataset");
    if (!d.has_checksum)
      return cat(path, ": /model/", name, " has no checksum attribute (not written by ptrain)");
  }
  return {};
}

// Reads one dataset's slabs for this rank (elements of the file's type U), accumulates the
// checksum of what it read when it is the chosen holder, and converts into the staging copy.
template <class U, class T>
void read_dataset(const Plan& p, hid_t dset, hid_t dxpl, const std::string& what,
                  std::vector<std::vector<T>>& staging, std::uint64_t& checksum,
                  std::int64_t& counted) {
  auto filespace = h5::space(H5Dget_space(dset), what);
  std::vector<U> raw(p.held ? static_cast<std::size_t>(slabs_numel(p.held->spec())) : 0);
  for_each_transfer(p, filespace.get(), reinterpret_cast<char*>(raw.data()), sizeof(U), what,
                    [&](hid_t fsel, hid_t msel, void* ptr) {
                      h5::check(H5Dread(dset, native_type<U>(), msel, fsel, dxpl, ptr),
                                cat(what, ": read"));
                    });
  if (!p.held) return;
  const TensorSpec& spec = p.held->spec();
  if (p.held->primary) {
    checksum = slabs_checksum(p.shape, spec.slabs, raw.data());
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
  const std::string where = cat("save_weights ", path, ": ");
  // 1. What this rank holds; every rank agrees on the datasets and on the attributes.
  std::map<std::string, Held> held;
  std::string error = collect_held(chunks, chunk_data, true, writes, held);
  for (const char* reserved : {"format_version", "checksum_algorithm"})
    if (error.empty() && attributes.count(reserved))
      error = cat("the attribute name '", reserved, "' is reserved");
  agree(comm, error.empty() ? "" : where + error);
  const auto names = gather_union(comm, held, "write", where);
  {
    Packer p;
    for (const auto& [k, v] : attributes) {
      p.str(k);
      p.str(v);
    }
    // max(h) and ~min(h) in one reduction: equal extremes mean every rank has the same h.
    std::uint64_t h[2] = {fnv1a(p.bytes), ~fnv1a(p.bytes)}, m[2];
    MPI_Allreduce(h, m, 2, MPI_UINT64_T, MPI_MAX, comm);
    PTRAIN_REQUIRE(m[0] == ~m[1], where, "the attributes differ between ranks");
  }
  // 2. Checksums and coverage, reduced once for all datasets before anything is written.
  auto plans = make_plans(comm, names, held);
  const std::size_t n = plans.size();
  std::vector<std::uint64_t> checksum(n, 0);
  std::vector<std::int64_t> written(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    const Plan& p = plans[i];
    if (!p.held || !p.held->primary) continue;
    const auto& [chunk, spec] = p.held->copies.front();
    checksum[i] = slabs_checksum(p.shape, spec->slabs, chunk_data[chunk] + spec->offset);
    written[i] = slabs_numel(*spec);
  }
  if (n > 0) {
    MPI_Allreduce(MPI_IN_PLACE, checksum.data(), static_cast<int>(n), MPI_UINT64_T, MPI_SUM, comm);
    MPI_Allreduce(MPI_IN_PLACE, written.data(), static_cast<int>(n), MPI_INT64_T, MPI_SUM, comm);
  }
  for (std::size_t i = 0; i < n; ++i)
    PTRAIN_REQUIRE(written[i] == product(plans[i].shape), where, "the ranks chosen to write ",
                   plans[i].name, " hold ", written[i], " of its ", product(plans[i].shape),
                   " elements (the predicate must choose each element exactly once)");
  // 3. The folder must exist and be writable (checked once, so every rank fails alike).
  std::string folder_error;
  if (rank_of(comm) == 0) {
    std::filesystem::path dir = std::filesystem::path(path).parent_path();
    if (dir.empty()) dir = ".";
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec))
      folder_error = cat(path, ": cannot create: folder ", dir.string(), " does not exist");
    else if (access(dir.c_str(), W_OK) != 0)
      folder_error = cat(path, ": cannot create: folder ", dir.string(), " is not writable");
  }
  agree(comm, folder_error);
  // 4. Collective create, attributes, datasets and hyperslab writes.
  auto fapl = h5::plist(H5Pcreate(H5P_FILE_ACCESS), where + "file access");
  h5::check(H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL), where + "MPI-IO driver");
  h5::check(H5Pset_coll_metadata_write(fapl.get(), true), where + "collective metadata");
  // The 1.8 format stores attributes larger than 64 KiB (a long deck) densely.
  h5::check(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_V18), where + "format");
  auto file = h5::file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()),
                       cat(path, ": cannot create"));
  write_string_attribute(file.get(), "format_version", kWeightsFormatVersion, path);
  write_string_attribute(file.get(), "checksum_algorithm", kChecksumAlgorithm, path);
  for (const auto& [k, v] : attributes) write_string_attribute(file.get(), k, v, path);
  auto group = h5::group(H5Gcreate2(file.get(), "model", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                         path + ": /model");
  auto dcpl = h5::plist(H5Pcreate(H5P_DATASET_CREATE), where + "dataset creation");
  h5::check(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), where + "fill time");
  h5::check(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY), where + "allocation time");
  auto dxpl = collective_transfer_plist(where + "transfer");
  auto scalar = h5::space(H5Screate(H5S_SCALAR), where + "scalar");
  for (std::size_t i = 0; i < n; ++i) {
    const Plan& p = plans[i];
    const std::string what = cat(path, ": /model/", p.name);
    const auto dims = to_hsize(p.shape);
    auto space =
        h5::space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), what);
    auto dset = h5::dataset(H5Dcreate2(group.get(), p.name.c_str(), file_type<T>(), space.get(),
                                       H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
                            what + ": create");
    auto attr = h5::attribute(
        H5Acreate2(dset.get(), "checksum", H5T_STD_U64LE, scalar.get(), H5P_DEFAULT, H5P_DEFAULT),
        what + ": checksum");
    h5::check(H5Awrite(attr.get(), H5T_NATIVE_UINT64, &checksum[i]), what + ": checksum");
    // Non-writers still take part in the collective calls, selecting nothing.
    Plan mine = p;
    if (!p.held || !p.held->primary) mine.transfers.clear();
    const T* base = nullptr;
    if (p.held) base = chunk_data[p.held->copies.front().first] + p.held->spec().offset;
    for_each_transfer(mine, space.get(), reinterpret_cast<const char*>(base), sizeof(T), what,
                      [&](hid_t fsel, hid_t msel, const void* ptr) {
                        h5::check(
                            H5Dwrite(dset.get(), native_type<T>(), msel, fsel, dxpl.get(), ptr),
                            what + ": write");
                      });
  }
}

template <class T>
void load_weights(const std::string& path, MPI_Comm comm, const std::vector<ChunkLayout>& chunks,
                  const std::vector<T*>& chunk_data, const TensorPredicate& verifies,
                  LoadReport* report) {
  h5::QuietErrors quiet;
  const std::string where = cat("load_weights ", path, ": ");
  // 1. What this rank needs; every rank learns the union, then what the file holds.
  std::map<std::string, Held> held;
  const std::string error = collect_held(chunks, chunk_data, false, verifies, held);
  agree(comm, error.empty() ? "" : where + error);
  const auto names = gather_union(comm, held, "verify", where);
  const Catalog catalog = shared_catalog(comm, path);
  if (!catalog.error.empty()) throw Error(catalog.error);  // the same on every rank
  const std::string mismatch = check_against_model(path, catalog, names);
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
    auto fapl = h5::plist(H5Pcreate(H5P_FILE_ACCESS), where + "file access");
    h5::check(H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL), where + "MPI-IO driver");
    h5::check(H5Pset_all_coll_metadata_ops(fapl.get(), true), where + "collective metadata");
    auto file =
        h5::file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), cat(path, ": cannot open"));
    auto group = h5::group(H5Gopen2(file.get(), "model", H5P_DEFAULT), path + ": /model");
    auto dxpl = collective_transfer_plist(where + "transfer");
    for (std::size_t i = 0; i < n; ++i) {
      const Plan& p = plans[i];
      const std::string what = cat(path, ": /model/", p.name);
      auto dset = h5::dataset(H5Dopen2(group.get(), p.name.c_str(), H5P_DEFAULT), what);
      if (catalog.datasets.at(p.name).elem_bytes == 4)
        read_dataset<float>(p, dset.get(), dxpl.get(), what, staging, checksum[i], counted[i]);
      else
        read_dataset<double>(p, dset.get(), dxpl.get(), what, staging, checksum[i], counted[i]);
      if (p.held) elements_read += slabs_numel(p.held->spec());
    }
  }
  // 3. Verify: the chosen holders' checksums add up to the stored ones (same on every rank).
  if (n > 0) {
    MPI_Allreduce(MPI_IN_PLACE, checksum.data(), static_cast<int>(n), MPI_UINT64_T, MPI_SUM, comm);
    MPI_Allreduce(MPI_IN_PLACE, counted.data(), static_cast<int>(n), MPI_INT64_T, MPI_SUM, comm);
  }
  std::string first_bad;
  std::size_t n_bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    PTRAIN_REQUIRE(counted[i] == product(plans[i].shape), where, "the ranks chosen to verify ",
                   plans[i].name, " read ", counted[i], " of its ", product(plans[i].shape),
                   " elements (the predicate must choose each element exactly once)");
    if (checksum[i] != catalog.datasets.at(plans[i].name).checksum && n_bad++ == 0)
      first_bad = plans[i].name;
  }
  if (n_bad > 0)
    throw Error(cat(path, ": /model/", first_bad, " checksum mismatch: the data is corrupted",
                    n_bad > 1 ? cat(" (and ", n_bad - 1, " more tensors)") : std::string()));

  // 4. Only now the caller's buffers change.
  for (std::size_t c = 0; c < chunks.size(); ++c)
    std::copy(staging[c].begin(), staging[c].end(), chunk_data[c]);
  std::vector<std::string> ignored;
  for (const auto& [name, d] : catalog.datasets)
    if (!names.count(name)) ignored.push_back(name);
  if (!ignored.empty()) {
    std::string list;
    for (std::size_t i = 0; i < ignored.size() && i < 5; ++i)
      list += cat(i ? ", " : "", ignored[i]);
    log::warn(cat(path, ": ", ignored.size(), " dataset(s) of /model are not part of the model ",
                  "and were ignored: ", list, ignored.size() > 5 ? ", ..." : ""));
  }
  if (report) {
    bool any4 = false, any8 = false;
    for (const auto& [name, shape] : names) {
      (catalog.datasets.at(name).elem_bytes == 4 ? any4 : any8) = true;
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
