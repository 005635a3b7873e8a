// ckpt/common.hpp — internal to the ckpt module: what the weights files (weights.cpp) and the
// training checkpoints (checkpoint.cpp) share. The order-free checksum, blocks of a global
// tensor and the row-major ranges of them, the collective hyperslab transfers, the writing of
// a file in steps all ranks agree on, string attributes, and the catalogue of what a file holds.
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
#include "util/checksum.hpp"
#include "util/error.hpp"
#include "util/mpi.hpp"

namespace ptrain::ckpt::detail {

using model::Shape;
using model::Slab;

// ---- checksum (documented in weights.hpp; mix64, element_hash, bits_of in util/checksum.hpp)

extern const char* const kChecksumAlgorithm;

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

// The union over the ranks of their (tensor name -> global shape) maps, sorted by name.
// Sets `error` (when empty) if two ranks disagree on a shape; the caller agrees on it.
std::map<std::string, Shape> union_of_shapes(MPI_Comm comm,
                                             const std::map<std::string, Shape>& mine,
                                             std::string& error);

// Throws "<where><what> differ between ranks" unless `bytes` is the same on every rank.
void require_same_on_all_ranks(MPI_Comm comm, const std::string& bytes, const std::string& where,
                               const std::string& what);
// The same for the root attributes of a file to write.
void require_same_attributes(MPI_Comm comm, const std::map<std::string, std::string>& attributes,
                             const std::string& where);

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

// ---- collective steps, and writing a file -------------------------------------------------
// Writing (or reading) a file is a sequence of collective HDF5 calls. When one of them fails
// on one rank only (the disk fills up under the rank whose data lands there) and that rank
// threw at once, the others would wait forever in the next collective call. So each step runs
// on every rank and then all agree on how it went: a failure anywhere is the same one-line
// Error ("<file>: <object>: <operation>: <reason>") everywhere before the next collective call,
// and every rank unwinds (closes) the same handles.

// Testing: the next collective step of this rank whose description contains `what` fails
// after it ran, as a full disk makes a write fail (empty: none).
void inject_failure(const std::string& what);
// Throws the injected failure when `what` matches it (and forgets it).
void fail_if_injected(const std::string& what);

// The I/O watchdog. HDF5's collective calls are beyond the Comm watchdog: a write that fails
// on one rank inside one of them (the metadata flush of a close) leaves that rank in another
// MPI call than the others, forever. While an IoPhase lives, each collective step must begin
// within run%hang_timeout (watchdog::timeout_s(); 0: not watched) of the previous one's
// start or end. When one does not, a thread of this rank ends the job (MPI_Abort) with one
// line: the file, the step, this rank, and what writing beside the file gives there (a full
// disk, a quota, the file size limit), after removing `discard` (the temporary file being
// written; "" when reading). A rank that finds no reason waits a few seconds first (rank 0
// 3 s, the others 10 s), so that one line is heard. Phases nest (the outermost counts).
class IoPhase {
 public:
  IoPhase(const std::string& path, const std::string& discard);
  ~IoPhase();
  IoPhase(const IoPhase&) = delete;
  IoPhase& operator=(const IoPhase&) = delete;
  static void step(const std::string& what);  // a collective step begins or ends
};

// Runs `step`, one collective HDF5 operation described by `what`, then agrees on its outcome.
template <class Fn>
void collective_step(MPI_Comm comm, const std::string& what, Fn&& step) {
  IoPhase::step(what);
  mpi::agree_on(comm, [&] {
    step();
    fail_if_injected(what);
  });
  IoPhase::step(what);
}

// Closes a handle of a file being written, as a write step (a file's close flushes).
void close_step(MPI_Comm comm, h5::Handle& handle, const std::string& what);

// A new file `path` (an existing one is overwritten) with the root attributes of every ptrain
// file: format_version, checksum_algorithm, then `attributes` (the same on every rank).
h5::Handle create_file(const std::string& path, MPI_Comm comm, const char* format_version,
                       const std::map<std::string, std::string>& attributes,
                       const std::string& where);

// A generous size of a file of `n_datasets` datasets holding `data_bytes` in all, with the
// root `attributes` (HDF5's metadata included).
std::int64_t estimated_file_bytes(std::int64_t data_bytes, std::size_t n_datasets,
                                  const std::map<std::string, std::string>& attributes);

// HDF5 writes its metadata collectively when it flushes (at the latest when the file closes);
// when that write fails on one rank only, that rank leaves the flush early and the others wait
// inside HDF5 forever, beyond any agreement of ours. So a full disk must be found before:
// rank 0 reserves `bytes` at `path` (fallocate, then releases them) and every rank throws
// "<path>: create: <reason> (<size> needed)" when that fails. File systems without fallocate
// are not checked. Every rank also checks its own file size limit (ulimit -f), which would
// fail its writes past it. Once the file exists, write_new_file reserves the space again and
// keeps it (fallocate KEEP_SIZE, freed by HDF5's truncate at the close), so space taken by
// others in between cannot fail a write.
void agree_space_for(MPI_Comm comm, const std::string& path, std::int64_t bytes);
// Why this rank's file size limit (ulimit -f) forbids a file of `bytes` ("rank 1's file size
// limit (ulimit -f) is 300 KiB, below the file's 1.2 MiB; raise it in the job script"), or "".
// Not collective.
std::string file_size_limit_problem(std::int64_t bytes);
// Rank 0 reserves `bytes` for the file at `path` without changing its size (see above).
void keep_space_for(MPI_Comm comm, const std::string& path, std::int64_t bytes);
// Testing: turns that check off, so that a full disk fails the writes themselves.
void check_space_first(bool on);

// Rank 0 empties a file being given up after a failed write, before anyone closes it: the
// space it took is then free for the metadata HDF5 still writes at the close (see above).
void give_up(MPI_Comm comm, const std::string& path);

// What the OS says about writing more next to `path` (a full disk, a quota, a read-only file
// system): ": <reason>", or "" when it sees no problem. Rank 0 looks, every rank gets it; for
// the failures HDF5 reports only as "file write failed".
std::string os_write_reason(MPI_Comm comm, const std::string& path);

// Writes a new file: checks the space (about `bytes`), creates it (create_file), lets
// `contents(file)` write it, closes it. A failure anywhere is the same Error on every rank,
// after which the file is given up and closed on every rank alike.
template <class Contents>
void write_new_file(const std::string& path, MPI_Comm comm, std::int64_t bytes,
                    const char* format_version,
                    const std::map<std::string, std::string>& attributes, const std::string& where,
                    Contents&& contents) {
  agree_space_for(comm, path, bytes);
  h5::Handle file;  // outlives the handler below: closed after the file is emptied
  try {
    file = create_file(path, comm, format_version, attributes, where);
    keep_space_for(comm, path, bytes);
    contents(file.get());
    close_step(comm, file, path);
  } catch (const Error& e) {
    const std::string reason = os_write_reason(comm, path);
    give_up(comm, path);
    throw e.reworded(e.what() + reason);
  }
}

h5::Handle create_group(MPI_Comm comm, hid_t parent, const char* name, const std::string& what);

// One tensor dataset: its global shape, the checksum of all of it, and this rank's part, the
// `transfers` of the elements at `data`, in `calls` collective writes (the most any rank
// makes; a rank with fewer transfers, or none, selects nothing in the rest).
template <class T>
struct TensorWrite {
  std::string name;
  Shape shape;
  std::uint64_t checksum = 0;
  const std::vector<Transfer>* transfers = nullptr;
  std::int64_t calls = 0;
  const T* data = nullptr;
};

// Creates the dataset under `group` with its checksum attribute and writes every rank's part.
template <class T>
void write_tensor(MPI_Comm comm, hid_t group, hid_t dxpl, const TensorWrite<T>& t,
                  const std::string& what);

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

// Collective read-only open with the MPI-IO driver.
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
