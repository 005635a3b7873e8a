// regression/fuzz/weights_fuzzer.cpp — libFuzzer target for the readers of weights files and
// checkpoints (ckpt/weights.hpp load_weights, ckpt/checkpoint.hpp load_checkpoint).
// The input is the bytes of an HDF5 file. It is written to a file in /dev/shm and read, on one
// rank (MPI_COMM_SELF, MPI-IO and all), into a small fixed model (1 block, d_model 8, 2 heads,
// vocab 16, seq_len 4) by load_weights<float>, load_checkpoint<double> with AdamW moments,
// load_checkpoint<float> without (SGD), and read_string_attribute.
// Findings: any crash or undefined behaviour (ASan, UBSan), a hang (libFuzzer -timeout), an
// exception other than ptrain::Error, and any broken promise of the readers' headers: an
// error is one line (no raw control bytes), and a failed load leaves the caller's buffers as
// they were. Inputs on which libhdf5 crashes or hangs by itself, whoever calls it, are
// skipped (see "libhdf5's own crashes" below); run.sh keeps the first 20 for reference.
//
// `weights_fuzzer --write-seeds DIR` writes the seed corpus (run.sh does) and exits: files the
// C++ writers make of the same model (weights in fp32 and fp64, a checkpoint with moments in
// fp64 and one without in fp32), and copies of them in HDF5's earliest file format (version 0
// superblock, version 1 object headers, symbol-table groups: what h5py writes by default),
// whose metadata has no checksums, so that mutations get past HDF5's checksum checks.
#include <fcntl.h>
#include <hdf5.h>
#include <mpi.h>
#include <sanitizer/lsan_interface.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/weights.hpp"
#include "deck/config.hpp"
#include "model/layout.hpp"
#include "util/error.hpp"

// The sanitizers' settings, built in (they hold however the binary is started).
// A damaged file can make libhdf5 ask for absurd sizes (a header claiming 2^60 bytes): there
// malloc returns NULL and HDF5 reports an error, as it does without ASan (which would abort),
// and libFuzzer's -malloc_limit_mb (2048) is never reached.
extern "C" const char* __asan_default_options() {
  return "allocator_may_return_null=1:max_allocation_size_mb=1024";
}
extern "C" const char* __lsan_default_options() { return "print_suppressions=0"; }
// Leaks that are not ptrain's:
// - Open MPI keeps small allocations of MPI_Init (its components, PMIx, hwloc, libevent) that
//   nothing frees (most are made with leak checking off, LLVMFuzzerInitialize).
// - libhdf5 1.10.8 leaks what it allocated for an object header whose decoding fails on a
//   damaged file (H5Aexists / H5Aiterate2 / H5Oopen -> H5O_protect -> H5C_protect -> the
//   header's deserialize -> H5FL_blk_realloc), found by this target; ptrain cannot free it.
//   With libFuzzer's fast unwinder a leak's stack ends at the first libhdf5 frame, so this
//   hides every leak of memory HDF5 allocated; ptrain's own allocations stay checked.
extern "C" const char* __lsan_default_suppressions() {
  return "leak:libmpi.so\n"
         "leak:libopen-pal.so\n"
         "leak:libopen-rte.so\n"
         "leak:libpmix.so\n"
         "leak:libhwloc.so\n"
         "leak:libevent\n"
         "leak:/openmpi/lib/openmpi3/mca_\n"
         "leak:pmix_\n"
         "leak:__vasprintf_internal\n"
         "leak:libhdf5_openmpi.so\n";
}

namespace {

using namespace ptrain;
namespace fs = std::filesystem;

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "weights_fuzzer: %s\n", what.c_str());
  std::abort();
}

Config tiny_model() {
  Config c{};
  c.model.n_layer = 1;
  c.model.d_model = 8;
  c.model.n_head = 2;
  c.model.vocab = 16;
  c.model.seq_len = 4;
  c.model.ffn_mult = 2;
  c.model.n_expert = 0;
  c.model.top_k = 2;
  c.model.moe_every = 1;
  c.parallel.tp = c.parallel.pp = c.parallel.ep = c.parallel.virtual_stages = 1;
  return c;
}

struct Model {
  std::vector<model::ChunkLayout> chunks = model::build_layout(tiny_model(), model::ShardCoord{});
  std::size_t numel = static_cast<std::size_t>(chunks.at(0).numel);
};
const Model& the_model() {
  static const Model m;
  return m;
}

// One rank holds everything and is the holder of every tensor.
bool everything(const model::TensorSpec&) { return true; }

std::string& work_dir() {
  static std::string dir;
  return dir;
}

void remove_work_dir() {
  std::error_code ignored;
  if (!work_dir().empty()) fs::remove_all(work_dir(), ignored);
}

// ---- the checks ---------------------------------------------------------------------------

constexpr double kSentinel = -7777.25;  // what the buffers hold before a load

template <class T>
bool untouched(const std::vector<T>& v) {
  for (const T& x : v)
    if (x != static_cast<T>(kSentinel)) return false;
  return true;
}

void check_error(const char* call, const Error& e) {
  for (char c : std::string(e.what()))
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      finding(cat(call, ": raw control byte in the error: ", e.what()));
}

// Runs one load; `unchanged` says whether the caller's buffers still hold the sentinel.
template <class Load, class Unchanged>
void run_load(const char* call, Load&& load, Unchanged&& unchanged) {
  try {
    load();
  } catch (const Error& e) {
    check_error(call, e);
    if (!unchanged()) finding(cat(call, " failed (", e.what(), ") after changing the buffers"));
  } catch (const std::exception& e) {
    finding(cat(call, ": an exception that is not ptrain::Error: ", e.what()));
  } catch (...) {
    finding(cat(call, ": an exception that is not ptrain::Error (not even std::exception)"));
  }
}

void load_all(const std::string& path) {
  const Model& m = the_model();
  {  // the weights of the model (a weights file or a checkpoint's /model)
    std::vector<float> params(m.numel, static_cast<float>(kSentinel));
    run_load(
        "load_weights<float>",
        [&] {
          ckpt::load_weights<float>(path, MPI_COMM_SELF, m.chunks, {params.data()}, everything);
        },
        [&] { return untouched(params); });
  }
  for (bool moments : {true, false}) {  // a training checkpoint: AdamW (fp64), SGD (fp32)
    auto restart = [&](auto zero) {
      using T = decltype(zero);
      std::vector<T> p(m.numel, T(kSentinel)), mv(moments ? m.numel : 0, T(kSentinel)),
          vv(moments ? m.numel : 0, T(kSentinel));
      ckpt::Buffers<T> b;
      b.moments = moments;
      b.params.push_back({p.data(), 0, m.numel});
      if (moments) {
        b.m.push_back({mv.data(), 0, m.numel});
        b.v.push_back({vv.data(), 0, m.numel});
      }
      run_load(
          moments ? "load_checkpoint<double> (AdamW)" : "load_checkpoint<float> (SGD)",
          [&] { ckpt::load_checkpoint<T>(path, "", MPI_COMM_SELF, m.chunks, b, everything); },
          [&] { return untouched(p) && untouched(mv) && untouched(vv); });
    };
    if (moments)
      restart(double{});
    else
      restart(float{});
  }
  for (const char* name : {"format_version", "deck"})
    run_load(
        "read_string_attribute", [&] { (void)ckpt::read_string_attribute(path, name); },
        [] { return true; });
}

// ---- libhdf5's own crashes ------------------------------------------------------------------
// libhdf5 1.10 itself crashes on some damaged files, whoever calls it: h5py and h5dump die on
// them as well (e.g. a NULL dereference in H5A__close when the root's object header, with a
// damaged attribute message, is evicted at H5Fclose). ptrain cannot catch that. So each input
// first goes to HDF5 alone, in another process (a worker, below): a serial walk through
// everything ptrain's readers touch (every attribute, link, group and dataset: their types,
// shapes, checksums and data). When libhdf5 crashes (a signal, an ASan report) or hangs (10 s)
// there, the input is skipped (not added to the corpus) and, with
// WEIGHTS_FUZZER_HDF5_CRASHES=DIR, the first 20 are kept in DIR. A crash of the readers on an
// input that HDF5 alone survives is a finding.

void walk_attributes(hid_t obj) {
  H5Aexists(obj, "checksum");
  H5Aexists(obj, "format_version");
  H5Aiterate2(
      obj, H5_INDEX_NAME, H5_ITER_NATIVE, nullptr,
      [](hid_t loc, const char* name, const H5A_info_t*, void*) -> herr_t {
        const hid_t attr = H5Aopen(loc, name, H5P_DEFAULT);
        if (attr < 0) return 0;
        const hid_t type = H5Aget_type(attr), space = H5Aget_space(attr);
        const hssize_t n = H5Sget_simple_extent_npoints(space);
        if (H5Tget_class(type) == H5T_STRING && H5Tis_variable_str(type) > 0) {
          const hid_t mem = H5Tcopy(H5T_C_S1);
          H5Tset_size(mem, H5T_VARIABLE);
          H5Tset_cset(mem, H5Tget_cset(type));
          char* str = nullptr;
          if (n == 1 && H5Aread(attr, mem, &str) >= 0) H5free_memory(str);
          H5Tclose(mem);
        } else if (n >= 0 && n < (1 << 20) && H5Tget_size(type) < (1 << 20)) {
          std::vector<char> bytes(H5Tget_size(type) * static_cast<std::size_t>(n) + 8);
          H5Aread(attr, type, bytes.data());
          std::uint64_t u = 0;
          if (H5Tget_class(type) == H5T_INTEGER && n == 1) H5Aread(attr, H5T_NATIVE_UINT64, &u);
        }
        H5Sclose(space);
        H5Tclose(type);
        H5Aclose(attr);
        return 0;
      },
      nullptr);
}

void walk_group(hid_t group, int depth) {
  walk_attributes(group);
  if (depth > 3) return;  // hard links may form cycles
  std::vector<std::string> names;
  H5Literate(
      group, H5_INDEX_NAME, H5_ITER_NATIVE, nullptr,
      [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
        static_cast<std::vector<std::string>*>(out)->push_back(name);
        return 0;
      },
      &names);
  H5G_info_t info;
  H5Gget_info(group, &info);
  for (const auto& name : names) {
    H5Lexists(group, name.c_str(), H5P_DEFAULT);
    const hid_t obj = H5Oopen(group, name.c_str(), H5P_DEFAULT);
    if (obj < 0) continue;
    if (H5Iget_type(obj) == H5I_GROUP) {
      walk_group(obj, depth + 1);
    } else if (H5Iget_type(obj) == H5I_DATASET) {
      walk_attributes(obj);
      const hid_t space = H5Dget_space(obj), type = H5Dget_type(obj);
      const int nd = H5Sget_simple_extent_ndims(space);
      std::vector<hsize_t> dims(nd > 0 ? static_cast<std::size_t>(nd) : 0);
      if (nd > 0) H5Sget_simple_extent_dims(space, dims.data(), nullptr);
      H5Sget_simple_extent_type(space);
      H5Tget_size(type);
      H5Tget_sign(type);
      const H5T_class_t cls = H5Tget_class(type);
      const hssize_t n = H5Sget_simple_extent_npoints(space);
      if ((cls == H5T_FLOAT || cls == H5T_INTEGER) && n >= 0 && n < (1 << 22)) {
        std::vector<double> data(static_cast<std::size_t>(n) + 1);
        H5Dread(obj, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data());
      }
      H5Tclose(type);
      H5Sclose(space);
    }
    H5Oclose(obj);
  }
}

void walk_file(const std::string& path) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (file < 0) return;
  for (const char* link : {"model", "optim", "optim/m", "optim/v", "state", "state/step"})
    H5Lexists(file, link, H5P_DEFAULT);
  walk_group(file, 0);
  H5Fclose(file);
}

// The walks run in a worker process that walks one input after the other, so that a crash
// ends the worker alone. Its parent is a helper forked before MPI_Init, while this process is
// small and holds no MPI state (a fork costs ~20 ms here, more as the fuzzer grows): when a
// worker dies (a crash, or the 10 s alarm of a hang), the helper answers for it and forks the
// next one.
struct Walker {
  int request = -1, reply = -1;  // pipes to the workers and from them (or the helper)
};
Walker& walker() {
  static Walker w;
  return w;
}

// Reads requests (a path and a new line) and answers 'y' after each walk; returns at EOF.
void work(int requests, int replies) {
  if (!std::getenv("WEIGHTS_FUZZER_WALK_STDERR")) {  // a crash report is not a finding here
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
  }
  std::string path;
  char c;
  while (read(requests, &c, 1) == 1) {
    if (c != '\n') {
      path += c;
      continue;
    }
    alarm(10);
    walk_file(path);
    alarm(0);
    if (write(replies, "y", 1) != 1) return;
    path.clear();
  }
}

[[noreturn]] void serve_walks(int requests, int replies) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  while (true) {
    const pid_t pid = fork();
    if (pid < 0) _exit(1);
    if (pid == 0) {
      work(requests, replies);
      _exit(0);
    }
    int status = 0;
    pid_t got;
    while ((got = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
    }
    if (got == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0) _exit(0);  // EOF: done
    if (write(replies, "n", 1) != 1) _exit(0);  // the worker died on the walk it was doing
  }
}

void start_walker() {
  int to[2], from[2];
  if (pipe(to) != 0 || pipe(from) != 0) finding("cannot make the walker's pipes");
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) finding("cannot fork the walker");
  if (pid == 0) {
    close(to[1]);
    close(from[0]);
    serve_walks(to[0], from[1]);
  }
  close(to[0]);
  close(from[1]);
  walker() = Walker{to[1], from[0]};
}

// True when libhdf5 alone crashes or hangs on the file (see above). libFuzzer's -timeout
// alarm interrupts the waits (EINTR).
bool hdf5_itself_fails(const std::string& path) {
  const std::string line = path + "\n";
  for (std::size_t done = 0; done < line.size();) {
    const ssize_t n = write(walker().request, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) finding(cat("the walker is gone (write: ", std::strerror(errno), ")"));
    done += static_cast<std::size_t>(n);
  }
  char fate = 0;
  ssize_t n;
  while ((n = read(walker().reply, &fate, 1)) < 0 && errno == EINTR) {
  }
  if (n != 1)
    finding(n == 0 ? "the walker is gone" : cat("the walker: read: ", std::strerror(errno)));
  return fate != 'y';
}

void keep_hdf5_crash(const std::uint8_t* data, std::size_t size) {
  static int kept = 0;
  const char* dir = std::getenv("WEIGHTS_FUZZER_HDF5_CRASHES");
  if (!dir || !*dir || kept >= 20) return;
  std::uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a of the input names the file
  for (std::size_t i = 0; i < size; ++i) h = (h ^ data[i]) * 0x100000001b3ULL;
  char name[32];
  std::snprintf(name, sizeof name, "/hdf5-%016llx.h5", static_cast<unsigned long long>(h));
  fs::create_directories(dir);
  std::ofstream(std::string(dir) + name, std::ios::binary)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  ++kept;
}

std::size_t& hdf5_crashes() {
  static std::size_t n = 0;
  return n;
}

void report_hdf5_crashes() {
  std::fprintf(stderr, "weights_fuzzer: %zu inputs crashed or hung libhdf5 itself (skipped)\n",
               hdf5_crashes());
}

// ---- the seed corpus ----------------------------------------------------------------------

template <class T>
std::vector<T> values(std::size_t n, double scale) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(scale * std::sin(0.37 * double(i) + 1));
  return v;
}

// Copies the attributes of `src` to `dst` as they are (type, shape, bytes).
void copy_attributes(hid_t src, hid_t dst) {
  H5Aiterate2(
      src, H5_INDEX_NAME, H5_ITER_NATIVE, nullptr,
      [](hid_t loc, const char* name, const H5A_info_t*, void* out) -> herr_t {
        const hid_t attr = H5Aopen(loc, name, H5P_DEFAULT);
        const hid_t type = H5Aget_type(attr), space = H5Aget_space(attr);
        const auto n = static_cast<std::size_t>(H5Sget_simple_extent_npoints(space));
        std::vector<char> bytes(H5Tget_size(type) * n);
        H5Aread(attr, type, bytes.data());
        const hid_t copy =
            H5Acreate2(*static_cast<hid_t*>(out), name, type, space, H5P_DEFAULT, H5P_DEFAULT);
        H5Awrite(copy, type, bytes.data());
        H5Aclose(copy);
        H5Sclose(space);
        H5Tclose(type);
        H5Aclose(attr);
        return 0;
      },
      &dst);
}

// Recreates the groups and datasets under `src` in `dst`, with their attributes.
void copy_tree(hid_t src, hid_t dst) {
  std::vector<std::string> names;
  H5Literate(
      src, H5_INDEX_NAME, H5_ITER_NATIVE, nullptr,
      [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
        static_cast<std::vector<std::string>*>(out)->push_back(name);
        return 0;
      },
      &names);
  for (const auto& name : names) {
    const hid_t obj = H5Oopen(src, name.c_str(), H5P_DEFAULT);
    if (H5Iget_type(obj) == H5I_GROUP) {
      const hid_t g = H5Gcreate2(dst, name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      copy_attributes(obj, g);
      copy_tree(obj, g);
      H5Gclose(g);
    } else if (H5Iget_type(obj) == H5I_DATASET) {
      const hid_t type = H5Dget_type(obj), space = H5Dget_space(obj);
      const auto n = static_cast<std::size_t>(H5Sget_simple_extent_npoints(space));
      std::vector<char> bytes(H5Tget_size(type) * n);
      H5Dread(obj, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data());
      const hid_t d =
          H5Dcreate2(dst, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data());
      copy_attributes(obj, d);
      H5Dclose(d);
      H5Sclose(space);
      H5Tclose(type);
    }
    H5Oclose(obj);
  }
}

// A copy of `from` in HDF5's earliest file format (HDF5's and h5py's default file access):
// version 0 superblock, version 1 object headers, symbol-table groups, no metadata checksums.
void copy_earliest(const std::string& from, const std::string& to) {
  const hid_t src = H5Fopen(from.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  const hid_t dst = H5Fcreate(to.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (src < 0 || dst < 0) finding("--write-seeds: cannot open " + from + " or create " + to);
  copy_attributes(src, dst);
  copy_tree(src, dst);
  H5Fclose(src);
  H5Fclose(dst);
}

// Writes the seed files into `dir` and returns their names.
std::vector<std::string> write_seeds(const std::string& dir) {
  fs::create_directories(dir);
  const Model& m = the_model();
  const std::map<std::string, std::string> attrs{{"deck", "&model\n  n_layer = 1\n/\n"},
                                                 {"ptrain_version", "fuzz"}};
  std::vector<std::string> written;
  auto weights = [&](auto zero, const std::string& name) {
    using T = decltype(zero);
    const auto data = values<T>(m.numel, 0.5);
    ckpt::save_weights<T>(dir + "/" + name, MPI_COMM_SELF, m.chunks, {data.data()}, everything,
                          attrs);
    written.push_back(name);
  };
  weights(float{}, "weights_fp32.h5");
  weights(double{}, "weights_fp64.h5");
  auto checkpoint = [&](auto zero, bool moments, const std::string& name) {
    using T = decltype(zero);
    const auto p = values<T>(m.numel, 0.5), mv = values<T>(m.numel, 0.01),
               vv = values<T>(m.numel, 0.001);
    ckpt::Buffers<const T> b;
    b.moments = moments;
    b.params.push_back({p.data(), 0, m.numel});
    if (moments) {
      b.m.push_back({mv.data(), 0, m.numel});
      b.v.push_back({vv.data(), 0, m.numel});
    }
    ckpt::CheckpointState state;
    state.step = 7;
    state.consumed_samples = 56;
    state.optimizer_t = 7;
    state.seed = 4242;
    state.lr = 3e-3;
    const std::string folder = dir + "/ckpt_" + name;
    const auto report =
        ckpt::save_checkpoint<T>(folder, MPI_COMM_SELF, m.chunks, b, everything, state, attrs, 1);
    fs::rename(report.path, dir + "/" + name);
    fs::remove_all(folder);
    written.push_back(name);
  };
  checkpoint(double{}, true, "ckpt_adamw_fp64.h5");
  checkpoint(float{}, false, "ckpt_sgd_fp32.h5");
  for (const auto& name : written) copy_earliest(dir + "/" + name, dir + "/v0_" + name);
  // Every seed must load: the fuzzer starts from files that pass.
  for (const auto& name : written) {
    for (const std::string& file : {dir + "/" + name, dir + "/v0_" + name}) {
      std::vector<float> params(m.numel);
      try {
        ckpt::load_weights<float>(file, MPI_COMM_SELF, m.chunks, {params.data()}, everything);
      } catch (const Error& e) {
        finding(cat("--write-seeds: a seed does not load: ", e.what()));
      }
    }
  }
  for (std::size_t i = 0, n = written.size(); i < n; ++i) written.push_back("v0_" + written[i]);
  return written;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Open MPI and HDF5 allocate once, at MPI_Init and at their first file, what they never
  // free, some of it in components Open MPI unloads again (whose frames then name no library
  // that a suppression could match). Those allocations are made with leak checking off: MPI_Init,
  // then a warm-up that writes the seeds and loads one of each. Leaks of later inputs count.
  __lsan_disable();
  // No HDF5 free lists, here and in the walker (forked below): with them, a libhdf5 over-read
  // on a damaged file reads a block the free list recycled, and whether ASan sees it depends
  // on what each process walked before, so the walker could pass a file on which the fuzzing
  // process then reports libhdf5's bug as ptrain's. Every block from malloc has red zones.
  H5set_free_list_limits(0, 0, 0, 0, 0, 0);
  start_walker();
  int initialized = 0;
  MPI_Initialized(&initialized);
  // Open MPI would take SIGABRT (a finding) for its own stack trace, and libFuzzer then keeps
  // its hands off it: no artifact. Let libFuzzer have the signals.
  setenv("OMPI_MCA_opal_signal", "", 0);
  if (!initialized) MPI_Init(argc, argv);       // never finalized: libFuzzer exits without a hook
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // the loaders quiet HDF5 too; the seeds' copy
  for (int i = 1; i + 1 < *argc; ++i)
    if (std::strcmp((*argv)[i], "--write-seeds") == 0) {
      const auto names = write_seeds((*argv)[i + 1]);
      std::printf("weights_fuzzer: %zu seeds in %s\n", names.size(), (*argv)[i + 1]);
      std::exit(0);
    }
  const char* shm = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  work_dir() = cat(shm, "/weights_fuzzer.", getpid());
  fs::create_directories(work_dir());
  std::atexit(remove_work_dir);
  std::atexit(report_hdf5_crashes);
  const std::string warmup = work_dir() + "/warmup";
  for (const auto& name : write_seeds(warmup)) load_all(warmup + "/" + name);
  fs::remove_all(warmup);
  __lsan_enable();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = work_dir() + "/input.h5";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    if (!out) finding("cannot write " + path);
  }
  if (hdf5_itself_fails(path)) {
    ++hdf5_crashes();
    keep_hdf5_crash(data, size);
    return -1;  // not added to the corpus
  }
  load_all(path);
  return 0;
}
