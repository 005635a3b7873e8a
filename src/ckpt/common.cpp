#include "ckpt/common.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "comm/watchdog.hpp"
#include "util/log.hpp"
#include "util/memory.hpp"

namespace ptrain::ckpt::detail {

using model::TensorSpec;

const char* const kChecksumAlgorithm =
    "ptrain-hash64-v1: sum mod 2^64 over elements of "
    "mix64(mix64(i + 0x9e3779b97f4a7c15) ^ bits(x_i)), i the global row-major index, "
    "bits the stored IEEE bit pattern zero-extended to 64 bits, mix64 the splitmix64 finaliser";

// ---- shapes and blocks ---------------------------------------------------------------------

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

std::int64_t numel_of(const std::vector<Slab>& boxes) {
  std::int64_t n = 0;
  for (const auto& s : boxes) n += s.numel();
  return n;
}

std::vector<hsize_t> to_hsize(const Shape& s) { return std::vector<hsize_t>(s.begin(), s.end()); }

namespace {

// Elements [b, e) of the sub-box of `box` whose dimensions below k are fixed at `at`
// (global coordinates) and whose dimensions from k on are those of `box`.
void range_boxes(const Slab& box, std::size_t k, Shape& at, std::int64_t b, std::int64_t e,
                 std::vector<Slab>& out) {
  const std::size_t d = box.count.size();
  auto block = [&](std::int64_t first, std::int64_t rows) {  // rows [first, first+rows) at k
    Slab s;
    s.start = box.start;
    s.count = box.count;
    for (std::size_t j = 0; j < k; ++j) {
      s.start[j] = at[j];
      s.count[j] = 1;
    }
    s.start[k] = box.start[k] + first;
    s.count[k] = rows;
    out.push_back(std::move(s));
  };
  if (k + 1 == d) {
    block(b, e - b);
    return;
  }
  std::int64_t inner = 1;
  for (std::size_t j = k + 1; j < d; ++j) inner *= box.count[j];
  auto row = [&](std::int64_t r, std::int64_t rb, std::int64_t re) {
    at[k] = box.start[k] + r;
    range_boxes(box, k + 1, at, rb, re, out);
  };
  std::int64_t first = b / inner;
  const std::int64_t last = e / inner;  // rows before it are whole up to e
  if (first == last) {                  // inside one row
    row(first, b - first * inner, e - first * inner);
    return;
  }
  if (b % inner != 0) row(first++, b % inner, inner);  // partial first row
  if (last > first) block(first, last - first);        // whole rows
  if (e % inner != 0) row(last, 0, e % inner);         // partial last row
}

}  // namespace

std::vector<Slab> boxes_of_range(const Slab& box, std::int64_t begin, std::int64_t end) {
  std::vector<Slab> out;
  if (begin >= end || box.count.empty()) return out;
  Shape at(box.count.size(), 0);
  range_boxes(box, 0, at, begin, end, out);
  return out;
}

std::vector<Slab> boxes_of_slabs_range(const std::vector<Slab>& slabs, std::int64_t begin,
                                       std::int64_t end) {
  std::vector<Slab> out;
  std::int64_t base = 0;
  for (const auto& s : slabs) {
    const std::int64_t n = s.numel();
    const std::int64_t lo = std::max(begin, base), hi = std::min(end, base + n);
    if (lo < hi)
      for (auto& b : boxes_of_range(s, lo - base, hi - base)) out.push_back(std::move(b));
    base += n;
  }
  return out;
}

std::string tensor_problem(const TensorSpec& t, std::int64_t chunk_numel, std::size_t c) {
  if (t.global_shape.empty()) return cat(t.name, ": a tensor needs at least one dimension");
  if (t.offset < 0 || t.offset + t.numel > chunk_numel)
    return cat(t.name, ": elements [", t.offset, ", ", t.offset + t.numel, ") lie outside chunk ",
               c, " of ", chunk_numel);
  for (const auto& s : t.slabs) {
    if (s.start.size() != t.global_shape.size() || s.count.size() != t.global_shape.size())
      return cat(t.name, ": a slab has the wrong number of dimensions");
    for (std::size_t k = 0; k < s.start.size(); ++k)
      if (s.start[k] < 0 || s.count[k] < 0 || s.start[k] + s.count[k] > t.global_shape[k])
        return cat(t.name, ": slab lies outside the global shape ", format_shape(t.global_shape));
  }
  if (numel_of(t.slabs) > t.numel)
    return cat(t.name, ": slabs hold ", numel_of(t.slabs), " elements, the local tensor only ",
               t.numel);
  return {};
}

// ---- what ranks exchange ------------------------------------------------------------------

void require_same_on_all_ranks(MPI_Comm comm, const std::string& bytes, const std::string& where,
                               const std::string& what) {
  // max(h) and ~min(h) in one reduction: equal extremes mean every rank has the same h.
  std::uint64_t h[2] = {fnv1a(bytes), ~fnv1a(bytes)}, m[2];
  MPI_Allreduce(h, m, 2, MPI_UINT64_T, MPI_MAX, comm);
  PTRAIN_REQUIRE(m[0] == ~m[1], where, what, " differ between ranks");
}

void require_same_attributes(MPI_Comm comm, const std::map<std::string, std::string>& attributes,
                             const std::string& where) {
  Packer p;
  for (const auto& [k, v] : attributes) {
    p.str(k);
    p.str(v);
  }
  require_same_on_all_ranks(comm, p.bytes, where, "the attributes");
}

WorkspaceCharge::WorkspaceCharge(std::size_t bytes) : bytes_(bytes) {
  memory::add(MemCategory::workspace, bytes_);
}
WorkspaceCharge::~WorkspaceCharge() { memory::sub(MemCategory::workspace, bytes_); }

// ---- collective hyperslab transfers -------------------------------------------------------

namespace {
// Row-major order of two corners of the same tensor.
bool before(const Shape& a, const Shape& b) {
  return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end());
}
Shape last_corner(const Slab& s) {
  Shape c = s.start;
  for (std::size_t k = 0; k < c.size(); ++k) c[k] += s.count[k] - 1;
  return c;
}
}  // namespace

std::vector<Transfer> transfers_of(const std::vector<Slab>& boxes, std::int64_t offset) {
  std::vector<Transfer> out;
  for (const auto& s : boxes) {
    const std::int64_t n = s.numel();
    if (n == 0) continue;
    const Slab* prev = out.empty() ? nullptr : out.back().boxes.back();
    if (prev && before(last_corner(*prev), s.start)) {
      out.back().boxes.push_back(&s);
      out.back().numel += n;
    } else {
      out.push_back(Transfer{{&s}, offset, n});
    }
    offset += n;
  }
  return out;
}

h5::Handle collective_transfer_plist(const std::string& what) {
  auto dxpl = h5::plist(H5Pcreate(H5P_DATASET_XFER), what);
  h5::check(H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_COLLECTIVE), what);
  return dxpl;
}

void* empty_selection_buffer() {
  static double dummy = 0;
  return &dummy;
}

// ---- collective steps, and writing a file -------------------------------------------------

namespace {
std::string& injected_failure() {
  static std::string what;
  return what;
}

bool& space_check() {
  static bool on = true;
  return on;
}

h5::Handle create_parallel(const std::string& path, MPI_Comm comm, const std::string& where) {
  auto fapl = h5::plist(H5Pcreate(H5P_FILE_ACCESS), where + "file access");
  // ROMIO (the MPI-IO of MPICH and its kin) writes non-interleaved collective writes
  // independently and returns at once, so a full disk fails the write on one rank only; HDF5
  // 1.10 then skips a collective call (resetting the file view) on that rank and the others
  // wait in it forever. Collective buffering ends every write with ROMIO's agreement on the
  // error code, so every rank fails alike and collective_step reports it. Other MPI-IOs
  // (Open MPI's OMPIO) ignore the hint.
  MPI_Info info = MPI_INFO_NULL;
  MPI_Info_create(&info);
  MPI_Info_set(info, "romio_cb_write", "enable");
  const herr_t set = H5Pset_fapl_mpio(fapl.get(), comm, info);  // HDF5 keeps a copy
  MPI_Info_free(&info);
  h5::check(set, where + "MPI-IO driver");
  h5::check(H5Pset_coll_metadata_write(fapl.get(), true), where + "collective metadata");
  // The 1.8 format stores attributes larger than 64 KiB (a long deck) densely.
  h5::check(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_V18), where + "format");
  return h5::file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()),
                  cat(path, ": cannot create"));
}

// Rank 0: errno of reserving `bytes` in a new file at `path` (removed again), 0 when it could,
// or when the file system cannot reserve space (then unknown, taken as fine).
int reserve_errno(const std::string& path, std::int64_t bytes) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int err = fd < 0 ? errno : fallocate(fd, 0, 0, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  if (fd >= 0) close(fd);
  std::remove(path.c_str());
  return err == EOPNOTSUPP || err == ENOSYS ? 0 : err;
}
}  // namespace

// ---- the I/O watchdog ---------------------------------------------------------------------

namespace {
using Clock = std::chrono::steady_clock;

struct IoWatch {
  std::mutex m;
  std::condition_variable cv;
  int depth = 0;  // IoPhases alive (nested)
  double timeout = 0;
  Clock::time_point deadline;
  std::string path, discard, what;
  int rank = 0;
  bool started = false;  // the thread
};
// Never freed: its thread lives until the process ends.
IoWatch& io_watch() {
  static IoWatch* w = new IoWatch;
  return *w;
}

// What writing 1 MiB beside `path` gives on this rank: "" when it works.
std::string write_probe(const std::string& path) {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  const std::string probe =
      ((dir.empty() ? std::filesystem::path(".") : dir) / cat(".ptrain-io-probe-", getpid()))
          .string();
  const int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  int err = fd < 0 ? errno : 0;
  static const char zeros[64 * 1024] = {};
  for (int k = 0; fd >= 0 && err == 0 && k < 16; ++k)
    if (write(fd, zeros, sizeof zeros) != ssize_t(sizeof zeros)) err = errno ? errno : EIO;
  if (fd >= 0 && err == 0 && fsync(fd) != 0) err = errno;
  if (fd >= 0) close(fd);
  unlink(probe.c_str());
  return err ? cat("writing beside it fails: ", std::strerror(err)) : std::string();
}

void watch_io() {
  IoWatch& w = io_watch();
  std::unique_lock<std::mutex> lock(w.m);
  for (;;) {
    if (w.depth == 0 || w.timeout <= 0) {
      w.cv.wait(lock);
      continue;
    }
    if (Clock::now() < w.deadline) {
      w.cv.wait_until(lock, w.deadline);
      continue;
    }
    const std::string path = w.path, discard = w.discard, what = w.what;
    const int rank = w.rank;
    const double timeout = w.timeout;
    lock.unlock();
    const std::string reason = write_probe(path);
    // A rank with a reason speaks first; of the others, rank 0 (all are stuck alike).
    if (reason.empty()) std::this_thread::sleep_for(std::chrono::seconds(rank == 0 ? 3 : 10));
    if (!discard.empty()) unlink(discard.c_str());
    const std::string step = what.empty()               ? cat(path, ": I/O")
                             : what.rfind(path, 0) == 0 ? what
                                                        : cat(path, ": ", what);
    mpi::abort_job(
        cat(step, ": no progress for ", timeout, " s (run%hang_timeout) on rank ", rank,
            " inside HDF5; ",
            reason.empty() ? std::string("writing beside the file works on this rank (another "
                                         "rank's write failed, or the file system hangs)")
                           : cat("on rank ", rank, " ", reason),
            discard.empty() ? std::string()
                            : std::string("; the file being written is removed, the checkpoints "
                                          "and `latest` already there are untouched"),
            "; aborting the job"),
        kExitRuntime);
  }
}
}  // namespace

IoPhase::IoPhase(const std::string& path, const std::string& discard) {
  const double timeout = watchdog::timeout_s();
  IoWatch& w = io_watch();
  std::lock_guard<std::mutex> lock(w.m);
  if (w.depth++ > 0 || timeout <= 0) return;
  if (!w.started) {
    std::thread(watch_io).detach();
    w.started = true;
  }
  w.timeout = timeout;
  w.path = path, w.discard = discard, w.what.clear();
  w.rank = log::rank();  // the world rank, as every message names it
  w.deadline = Clock::now() +
               std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout));
  w.cv.notify_all();
}

IoPhase::~IoPhase() {
  IoWatch& w = io_watch();
  std::lock_guard<std::mutex> lock(w.m);
  --w.depth;
  w.cv.notify_all();
}

void IoPhase::step(const std::string& what) {
  IoWatch& w = io_watch();
  std::lock_guard<std::mutex> lock(w.m);
  if (w.depth == 0 || w.timeout <= 0) return;
  w.what = what;
  w.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(w.timeout));
}

void inject_failure(const std::string& what) { injected_failure() = what; }

void fail_if_injected(const std::string& what) {
  std::string& injected = injected_failure();
  if (injected.empty() || what.find(injected) == std::string::npos) return;
  injected.clear();
  throw Error(cat(what, ": ", std::strerror(ENOSPC)));
}

void close_step(MPI_Comm comm, h5::Handle& handle, const std::string& what) {
  collective_step(comm, what + ": close", [&] { handle.close(what); });
}

h5::Handle create_file(const std::string& path, MPI_Comm comm, const char* format_version,
                       const std::map<std::string, std::string>& attributes,
                       const std::string& where) {
  h5::Handle file;
  collective_step(comm, path + ": create", [&] { file = create_parallel(path, comm, where); });
  std::map<std::string, std::string> all{{"format_version", format_version},
                                         {"checksum_algorithm", kChecksumAlgorithm}};
  all.insert(attributes.begin(), attributes.end());
  // The reserved ones first, then the caller's in name order, as files have always had them.
  auto write = [&](const std::string& name) {
    collective_step(comm, cat(path, ": attribute ", name),
                    [&] { write_string_attribute(file.get(), name, all.at(name), path); });
  };
  write("format_version");
  write("checksum_algorithm");
  for (const auto& [name, value] : attributes) write(name);
  return file;
}

std::int64_t estimated_file_bytes(std::int64_t data_bytes, std::size_t n_datasets,
                                  const std::map<std::string, std::string>& attributes) {
  // Observed: about 400 bytes of metadata per dataset; the attributes are stored once.
  std::int64_t bytes = data_bytes + 64 * 1024 + 1024 * static_cast<std::int64_t>(n_datasets);
  for (const auto& [name, value] : attributes)
    bytes += 2 * static_cast<std::int64_t>(name.size() + value.size()) + 256;
  return bytes;
}

void check_space_first(bool on) { space_check() = on; }

void agree_space_for(MPI_Comm comm, const std::string& path, std::int64_t bytes) {
  const int err = mpi::rank(comm) == 0 && space_check() ? reserve_errno(path, bytes) : 0;
  std::string error = err ? cat(path, ": create: ", std::strerror(err), " (",
                                format_bytes(double(bytes)), " needed)")
                          : std::string();
  if (error.empty()) {
    error = file_size_limit_problem(bytes);
    if (!error.empty()) error = cat(path, ": create: ", error);
  }
  mpi::agree(comm, error);
}

std::string file_size_limit_problem(std::int64_t bytes) {
  struct rlimit limit {};
  if (getrlimit(RLIMIT_FSIZE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY ||
      limit.rlim_cur >= rlim_t(bytes))
    return "";
  return cat("rank ", log::rank(), "'s file size limit (ulimit -f) is ",
             format_bytes(double(limit.rlim_cur)), ", below the file's ",
             format_bytes(double(bytes)), "; raise it in the job script");
}

void keep_space_for(MPI_Comm comm, const std::string& path, std::int64_t bytes) {
  if (mpi::rank(comm) != 0 || !space_check()) return;
  const int fd = open(path.c_str(), O_WRONLY);
  if (fd < 0) return;  // the writes will say what is wrong
  (void)fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(bytes));
  close(fd);
}

std::string os_write_reason(MPI_Comm comm, const std::string& path) {
  int err = mpi::rank(comm) == 0 ? reserve_errno(path + ".probe", 1 << 20) : 0;
  MPI_Bcast(&err, 1, MPI_INT, 0, comm);
  return err ? cat(": ", std::strerror(err)) : std::string();
}

void give_up(MPI_Comm comm, const std::string& path) {
  std::error_code ignored;  // a file never made has nothing to free, nor its close to write
  if (mpi::rank(comm) == 0) std::filesystem::resize_file(path, 0, ignored);
  MPI_Barrier(comm);
}

h5::Handle create_group(MPI_Comm comm, hid_t parent, const char* name, const std::string& what) {
  h5::Handle group;
  collective_step(comm, what + ": create", [&] {
    group = h5::group(H5Gcreate2(parent, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), what);
  });
  return group;
}

template <class T>
void write_tensor(MPI_Comm comm, hid_t group, hid_t dxpl, const TensorWrite<T>& t,
                  const std::string& what) {
  h5::Handle dset, space;
  collective_step(comm, what + ": create", [&] {
    dset = create_dataset(group, t.name, file_type<T>(), t.shape, what);
    write_checksum_attribute(dset.get(), t.checksum, what);
    space = h5::space(H5Dget_space(dset.get()), what);
  });
  // Ranks that write nothing (or less) still take part in every collective call.
  static const std::vector<Transfer> none;
  for_each_transfer(t.transfers ? *t.transfers : none, t.calls, space.get(), what,
                    [&](const Transfer* tr, hid_t fsel, hid_t msel) {
                      const void* ptr = tr ? static_cast<const void*>(t.data + tr->offset)
                                           : empty_selection_buffer();
                      collective_step(comm, cat(what, ": write"), [&] {
                        h5::check(H5Dwrite(dset.get(), native_type<T>(), msel, fsel, dxpl, ptr),
                                  cat(what, ": write"));
                      });
                    });
  close_step(comm, dset, what);
}
template void write_tensor<float>(MPI_Comm, hid_t, hid_t, const TensorWrite<float>&,
                                  const std::string&);
template void write_tensor<double>(MPI_Comm, hid_t, hid_t, const TensorWrite<double>&,
                                   const std::string&);

// ---- files --------------------------------------------------------------------------------

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

void write_checksum_attribute(hid_t dataset, std::uint64_t checksum, const std::string& what) {
  auto scalar = h5::space(H5Screate(H5S_SCALAR), what);
  auto attr = h5::attribute(
      H5Acreate2(dataset, "checksum", H5T_STD_U64LE, scalar.get(), H5P_DEFAULT, H5P_DEFAULT),
      what + ": checksum");
  h5::check(H5Awrite(attr.get(), H5T_NATIVE_UINT64, &checksum), what + ": checksum");
}

std::string folder_problem(const std::string& path) {
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    return cat(path, ": cannot create: folder ", dir.string(), " does not exist");
  if (access(dir.c_str(), W_OK) != 0)
    return cat(path, ": cannot create: folder ", dir.string(), " is not writable");
  return {};
}

namespace {
bool has_hdf5_signature(const std::string& path) {
  static const char sig[8] = {'\211', 'H', 'D', 'F', '\r', '\n', '\032', '\n'};
  std::ifstream in(path, std::ios::binary);
  char head[8] = {};
  in.read(head, 8);
  return in.gcount() == 8 && std::memcmp(head, sig, 8) == 0;
}
}  // namespace

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

h5::Handle open_parallel(const std::string& path, MPI_Comm comm, const std::string& where) {
  auto fapl = h5::plist(H5Pcreate(H5P_FILE_ACCESS), where + "file access");
  h5::check(H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL), where + "MPI-IO driver");
  h5::check(H5Pset_all_coll_metadata_ops(fapl.get(), true), where + "collective metadata");
  return h5::file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), cat(path, ": cannot open"));
}

h5::Handle create_dataset(hid_t parent, const std::string& name, hid_t type, const Shape& shape,
                          const std::string& what) {
  auto dcpl = h5::plist(H5Pcreate(H5P_DATASET_CREATE), what + ": dataset creation");
  h5::check(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), what + ": fill time");
  h5::check(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY), what + ": allocation time");
  const auto dims = to_hsize(shape);
  auto space =
      shape.empty()
          ? h5::space(H5Screate(H5S_SCALAR), what)
          : h5::space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), what);
  return h5::dataset(
      H5Dcreate2(parent, name.c_str(), type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
      what + ": create");
}

// ---- catalogue ----------------------------------------------------------------------------

std::string Catalog::pack() const {
  Packer p;
  p.str(error);
  p.i64(static_cast<std::int64_t>(attributes.size()));
  for (const auto& [k, v] : attributes) {
    p.str(k);
    p.str(v);
  }
  p.i64(static_cast<std::int64_t>(groups.size()));
  for (const auto& [group, datasets] : groups) {
    p.str(group);
    p.i64(static_cast<std::int64_t>(datasets.size()));
    for (const auto& [name, d] : datasets) {
      p.str(name);
      p.shape(d.shape);
      p.i64(d.type_class);
      p.i64(d.elem_bytes);
      p.i64(d.has_checksum);
      p.u64(d.checksum);
    }
  }
  return p.bytes;
}

Catalog Catalog::unpack(const std::string& bytes) {
  Unpacker in(bytes.data(), bytes.size());
  Catalog c;
  c.error = in.str();
  for (auto n = in.i64(); n > 0; --n) {
    std::string k = in.str();
    c.attributes[k] = in.str();
  }
  for (auto g = in.i64(); g > 0; --g) {
    auto& datasets = c.groups[in.str()];
    for (auto n = in.i64(); n > 0; --n) {
      std::string name = in.str();
      FileDataset d;
      d.shape = in.shape();
      d.type_class = static_cast<char>(in.i64());
      d.elem_bytes = static_cast<int>(in.i64());
      d.has_checksum = in.i64() != 0;
      d.checksum = in.u64();
      datasets.emplace(std::move(name), d);
    }
  }
  return c;
}

namespace {

std::map<std::string, FileDataset> read_group(hid_t file, const std::string& path,
                                              const std::string& group_name) {
  std::map<std::string, FileDataset> out;
  const std::string where = cat(path, ": /", group_name);
  auto group = h5::group(H5Gopen2(file, group_name.c_str(), H5P_DEFAULT), where);
  // The link names in the storage's own order (the map `out` sorts them). Not by index in
  // name order (H5Lget_name_by_idx, H5_ITER_INC): for a group with dense link storage (more
  // than 8 links, as /model has) HDF5 1.10 then builds a table of every link on each call, and
  // when that fails on a damaged file it frees the table's uninitialised entries
  // (H5G__dense_get_name_by_idx -> H5G__link_release_table): a crash inside libhdf5 instead
  // of an error. Native order walks the links without a table.
  std::vector<std::string> names;
  h5::check(H5Literate(
                group.get(), H5_INDEX_NAME, H5_ITER_NATIVE, nullptr,
                [](hid_t, const char* name, const H5L_info_t*, void* list) -> herr_t {
                  static_cast<std::vector<std::string>*>(list)->push_back(name);
                  return 0;
                },
                &names),
            where);
  for (const std::string& name : names) {
    const std::string what = cat(where, "/", h5::printable(name));  // names are the file's
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
    d.elem_bytes = static_cast<int>(H5Tget_size(type.get()));
    switch (H5Tget_class(type.get())) {
      case H5T_FLOAT:
        d.type_class = 'f';
        break;
      case H5T_INTEGER:
        d.type_class = H5Tget_sign(type.get()) == H5T_SGN_NONE ? 'u' : 'i';
        break;
      default:
        break;
    }
    if (H5Aexists(obj.get(), "checksum") > 0) {
      auto attr = h5::attribute(H5Aopen(obj.get(), "checksum", H5P_DEFAULT), what);
      h5::check(H5Aread(attr.get(), H5T_NATIVE_UINT64, &d.checksum), what + ": checksum");
      d.has_checksum = true;
    }
    out.emplace(name, std::move(d));
  }
  return out;
}

Catalog read_catalog(const std::string& path, const std::vector<std::string>& groups,
                     const AttributeCheck& check) {
  Catalog c;
  try {
    auto file = open_serial(path);
    // In native order, for the reason read_group gives (dense attribute storage alike).
    std::vector<std::string> attr_names;
    h5::check(H5Aiterate2(
                  file.get(), H5_INDEX_NAME, H5_ITER_NATIVE, nullptr,
                  [](hid_t, const char* name, const H5A_info_t*, void* out) -> herr_t {
                    static_cast<std::vector<std::string>*>(out)->push_back(name);
                    return 0;
                  },
                  &attr_names),
              cat(path, ": root attributes"));
    for (const auto& name : attr_names) {
      const std::string what = cat(path, ": attribute ", h5::printable(name));
      auto attr = h5::attribute(H5Aopen(file.get(), name.c_str(), H5P_DEFAULT), what);
      auto type = h5::type(H5Aget_type(attr.get()), path);
      if (H5Tget_class(type.get()) == H5T_STRING)
        c.attributes[name] = read_string_attr(attr.get(), what);
    }
    c.error = check(c.attributes);
    if (!c.error.empty()) return c;
    for (const auto& g : groups) {
      // Each level of the path must exist (H5Lexists fails on a missing intermediate).
      bool present = true;
      for (std::size_t at = g.find('/'); present; at = g.find('/', at + 1)) {
        present = H5Lexists(file.get(), g.substr(0, at).c_str(), H5P_DEFAULT) > 0;
        if (at == std::string::npos) break;
      }
      if (present) c.groups[g] = read_group(file.get(), path, g);
    }
  } catch (const std::exception& e) {  // reported by every rank, not thrown on rank 0 alone
    c.error = e.what();
  }
  return c;
}

}  // namespace

Catalog shared_catalog(MPI_Comm comm, const std::string& path,
                       const std::vector<std::string>& groups, const AttributeCheck& check) {
  std::string bytes;
  if (mpi::rank(comm) == 0) bytes = read_catalog(path, groups, check).pack();
  return Catalog::unpack(mpi::broadcast(comm, 0, std::move(bytes)));
}

std::map<std::string, Shape> union_of_shapes(MPI_Comm comm,
                                             const std::map<std::string, Shape>& mine,
                                             std::string& error) {
  Packer packed;
  for (const auto& [name, shape] : mine) {
    packed.str(name);
    packed.shape(shape);
  }
  std::map<std::string, Shape> names;
  for (const std::string& theirs : mpi::all_gather(comm, packed.bytes))
    for (Unpacker in(theirs.data(), theirs.size()); !in.done();) {
      std::string name = in.str();
      Shape shape = in.shape();
      auto [it, fresh] = names.emplace(name, shape);
      if (!fresh && it->second != shape && error.empty())
        error = cat(name, ": ranks disagree on its global shape (", format_shape(it->second),
                    " and ", format_shape(shape), ")");
    }
  return names;
}

}  // namespace ptrain::ckpt::detail
