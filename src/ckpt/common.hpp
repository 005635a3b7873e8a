// ckpt/common.hpp — internal to the ckpt module: what the weights files (weights.cpp) and the
// training checkpoints (checkpoint.cpp) share. The order-free checksum, blocks of a global
// tensor and the row-major ranges of them, the collective hyperslab transfers, agreement of
// all ranks on errors, string attributes, and the catalogue of what a file holds.
#pragma once
#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "ckpt/h5.hpp"
#include "model/layout.hpp"
#include "util/error.hpp"

namespace ptrain::ckpt::detail {

using model::Shape;
using model::Slab;

// ---- checksum (documented in weights.hpp) --------------------------------------------------

extern const char* const kChecksumAlgorithm;

inline std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

inline std::uint64_t element_hash(std::int64_t index, std::uint64_t bits) {
  return mix64(mix64(static_cast<std::uint64_t>(index) + 0x9e3779b97f4a7c15ULL) ^ bits);
}

// The stored bit pattern, zero-extended to 64 bits.
template <class U>
std::uint64_t bits_of(U x) {
  static_assert(std::is_arithmetic_v<U> && (sizeof(U) == 4 || sizeof(U) == 8));
  if constexpr (sizeof(U) == 4) {
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
// dimension) of box s of a tensor of global shape `shape`; local offsets count the box's
// elements in row-major order.
template <class F>
void for_each_run(const Shape& shape, const Slab& s, F&& f) {
  const std::size_t d = shape.size();
  if (d == 0 || s.numel() == 0) return;
  std::vector<std::int64_t> stride(d, 1);
  for (std::size_t k = d - 1; k-- > 0;) stride[k] = stride[k + 1] * shape[k + 1];
  std::vector<std::int64_t> idx(d - 1, 0);  // position inside the box, outer dims
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

// Checksum of boxes of one tensor whose elements lie back to back at `data`.
template <class U>
std::uint64_t boxes_checksum(const Shape& shape, const std::vector<Slab>& boxes, const U* data) {
  std::uint64_t sum = 0;
  std::int64_t base = 0;
  for (const auto& s : boxes) {
    for_each_run(shape, s, [&](std::int64_t g, std::int64_t local, std::int64_t len) {
      const U* x = data + base + local;
      for (std::int64_t j = 0; j < len; ++j) sum += element_hash(g + j, bits_of(x[j]));
    });
    base += s.numel();
  }
  return sum;
}

// ---- shapes and blocks ---------------------------------------------------------------------

std::int64_t product(const Shape& s);
std::string format_shape(const Shape& s);
std::int64_t numel_of(const std::vector<Slab>& boxes);
std::vector<hsize_t> to_hsize(const Shape& s);

// Elements [begin, end) of `box` in its row-major order, as boxes of the same global tensor
// in that order: in N dimensions at most a partial first row, a block of whole rows and a
// partial last row on each level, 2 * (N - 1) + 1 boxes in all.
std::vector<Slab> boxes_of_range(const Slab& box, std::int64_t begin, std::int64_t end);

// Elements [begin, end) of the concatenation of `slabs` (each row-major, in local order).
std::vector<Slab> boxes_of_slabs_range(const std::vector<Slab>& slabs, std::int64_t begin,
                                       std::int64_t end);

// Why tensor t of a chunk of `chunk_numel` elements is malformed, or "".
std::string tensor_problem(const model::TensorSpec& t, std::int64_t chunk_numel, std::size_t c);

// ---- HDF5 types ---------------------------------------------------------------------------

template <class U>
hid_t native_type() {
  return std::is_same_v<U, float> ? H5T_NATIVE_FLOAT : H5T_NATIVE_DOUBLE;
}
template <class U>
hid_t file_type() {
  return std::is_same_v<U, float> ? H5T_IEEE_F32LE : H5T_IEEE_F64LE;
}

// ---- what ranks exchange ------------------------------------------------------------------

std::uint64_t fnv1a(const std::string& bytes);

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

int rank_of(MPI_Comm comm);
std::string broadcast_string(MPI_Comm comm, int root, std::string s);
// Every rank's byte strings, concatenated in rank order, on every rank.
std::string allgather_bytes(MPI_Comm comm, const std::string& mine, const std::string& where);

// Makes every rank throw the same error when any rank found one (the lowest such rank's).
void agree(MPI_Comm comm, const std::string& local_error);

// The union over the ranks of their (tensor name -> global shape) maps, sorted by name.
// Sets `error` (when empty) if two ranks disagree on a shape; the caller agrees on it.
std::map<std::string, Shape> union_of_shapes(MPI_Comm comm, const std::map<std::string, Shape>& mine,
                                             const std::string& where, std::string& error);

// Throws "<where><what> differ between ranks" unless `bytes` is the same on every rank.
void require_same_on_all_ranks(MPI_Comm comm, const std::string& bytes, const std::string& where,
                               const std::string& what);

// In-place element-wise reductions over comm.
void sum_over_ranks(MPI_Comm comm, std::vector<std::uint64_t>& v);
void sum_over_ranks(MPI_Comm comm, std::vector<std::int64_t>& v);
void max_over_ranks(MPI_Comm comm, std::vector<std::int64_t>& v);

// Keeps a host buffer's bytes in the tracked memory statistics while it lives.
class WorkspaceCharge {
 public:
  explicit WorkspaceCharge(std::size_t bytes);
  ~WorkspaceCharge();
  WorkspaceCharge(const WorkspaceCharge&) = delete;
  WorkspaceCharge& operator=(const WorkspaceCharge&) = delete;

 private:
  std::size_t bytes_;
};

// ---- collective hyperslab transfers -------------------------------------------------------

// Boxes that one H5Dread/H5Dwrite moves: their union, traversed in the file's row-major
// order, equals their concatenation in memory. That holds when each box lies wholly after
// the previous one in row-major order (its first corner after the other's last corner), as
// for the q, k, v row blocks of qkv or the pieces of one row-major range. Otherwise (e.g.
// blocks of columns) each box is its own transfer.
struct Transfer {
  std::vector<const Slab*> boxes;
  std::int64_t offset = 0;  // of the first element in the concatenated box data
  std::int64_t numel = 0;
};
// `offset` is added to every transfer's offset (boxes of several holdings back to back).
std::vector<Transfer> transfers_of(const std::vector<Slab>& boxes, std::int64_t offset = 0);

h5::Handle collective_transfer_plist(const std::string& what);

// Runs `calls` collective transfers on a dataset of file space `filespace`:
// io(transfer, file selection, memory selection) with this rank's transfers first, then
// (nullptr, none, none) until every rank has made the same number of calls.
template <class IO>
void for_each_transfer(const std::vector<Transfer>& transfers, std::int64_t calls, hid_t filespace,
                       const std::string& what, IO&& io) {
  for (std::int64_t k = 0; k < calls; ++k) {
    auto fsel = h5::space(H5Scopy(filespace), what);
    const Transfer* t = k < static_cast<std::int64_t>(transfers.size())
                            ? &transfers[static_cast<std::size_t>(k)]
                            : nullptr;
    const hsize_t n = t ? static_cast<hsize_t>(t->numel) : 1;
    auto msel = h5::space(H5Screate_simple(1, &n, nullptr), what);
    if (t) {
      bool first = true;
      for (const Slab* s : t->boxes) {
        auto start = to_hsize(s->start), count = to_hsize(s->count);
        h5::check(H5Sselect_hyperslab(fsel.get(), first ? H5S_SELECT_SET : H5S_SELECT_OR,
                                      start.data(), nullptr, count.data(), nullptr),
                  what);
        first = false;
      }
    } else {
      h5::check(H5Sselect_none(fsel.get()), what);
      h5::check(H5Sselect_none(msel.get()), what);
    }
    io(t, fsel.get(), msel.get());
  }
}

// A buffer for the memory side of an empty selection.
void* empty_selection_buffer();

// ---- files --------------------------------------------------------------------------------

void write_string_attribute(hid_t object, const std::string& name, const std::string& value,
                            const std::string& what);
// Reads a string attribute (fixed or variable length) of an open object.
std::string read_string_attr(hid_t attr, const std::string& what);
void write_checksum_attribute(hid_t dataset, std::uint64_t checksum, const std::string& what);

// Why `path` cannot be created (its folder is missing or not writable), or "".
std::string folder_problem(const std::string& path);

// Opens a file serially for reading, with a message saying why it cannot be.
h5::Handle open_serial(const std::string& path);

// Collective create / read-only open with the MPI-IO driver.
h5::Handle create_parallel(const std::string& path, MPI_Comm comm, const std::string& where);
h5::Handle open_parallel(const std::string& path, MPI_Comm comm, const std::string& where);

// A dataset of `shape` (empty: scalar) allocated at creation and never filled.
h5::Handle create_dataset(hid_t parent, const std::string& name, hid_t type, const Shape& shape,
                          const std::string& what);

// What a file holds, read serially by one rank before the collective open.
struct FileDataset {
  Shape shape;
  char type_class = '?';  // 'f' IEEE float, 'i' signed, 'u' unsigned integer, '?' other
  int elem_bytes = 0;
  bool has_checksum = false;
  std::uint64_t checksum = 0;
  bool is_float() const { return type_class == 'f' && (elem_bytes == 4 || elem_bytes == 8); }
};

struct Catalog {
  std::string error;                              // why the file cannot be used; empty when it can
  std::map<std::string, std::string> attributes;  // string attributes of the root group
  // Datasets by group ("model", "optim/m", ...) and name; a group absent from the file
  // is absent here.
  std::map<std::string, std::map<std::string, FileDataset>> groups;
  std::string pack() const;
  static Catalog unpack(const std::string& bytes);
};

// Returns why the root attributes make the file unusable (format version), or "".
using AttributeCheck = std::function<std::string(const std::map<std::string, std::string>&)>;

// The catalogue of `path` with the datasets of `groups`, read by rank 0 and sent to every
// rank (any problem is in .error, the same on every rank).
Catalog shared_catalog(MPI_Comm comm, const std::string& path,
                       const std::vector<std::string>& groups, const AttributeCheck& check);

}  // namespace ptrain::ckpt::detail
