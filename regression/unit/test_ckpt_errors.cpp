// ptrain-test: np=1,2,4 labels=quick timeout=120
// Saves that must fail cleanly (issue 11): a write failing on one rank only (injected after
// the collective call, as a full disk fails on the rank whose data lands there) and a really
// full file system (a small tmpfs, when this process may mount one) end within seconds with
// the same one-line error on every rank, the temporary file removed and `latest` and the kept
// checkpoints as they were; non-finite values are never written; final weights replace the old
// file only once written and verified; unusable output folders are found before step 1; a
// checkpoint missing a tensor or its /state is refused on load; and so is a file whose group
// link heap is damaged, with an error, not a crash inside libhdf5; and names and values from a
// file appear in errors on one line.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <malloc.h>
#include <mpi.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/common.hpp"
#include "ckpt/lock.hpp"
#include "ckpt/training.hpp"
#include "ckpt/weights.hpp"
#include "ckpt_test_support.hpp"
#include "deck/deck.hpp"
#include "model/layout.hpp"
#include "test_support.hpp"
#include "util/error.hpp"
#include "util/mpi.hpp"

using namespace ptrain;
using model::ChunkLayout;
using model::TensorSpec;
using ptrain::test::small_model;
using ptrain::test::world_rank;
using ptrain::test::world_size;
using TempDir = ptrain::test::TempDir;
namespace fs = std::filesystem;

namespace {

void barrier() { MPI_Barrier(MPI_COMM_WORLD); }
bool last_rank() { return world_rank() == world_size() - 1; }

// The dense model on one chunk, each rank owning an equal contiguous range of the parameters
// and both moments (as ZeRO 1-3 shards do, cutting tensors anywhere). Without tp every rank
// is the one holder of what it owns.
struct Shards {
  Config config = small_model(50, false);
  std::vector<ChunkLayout> chunks = model::build_layout(config, model::ShardCoord{});
  std::size_t lo = 0, hi = 0;
  std::array<std::vector<float>, 3> data;  // params, m, v over [lo, hi)

  explicit Shards(bool fill = true) {
    const auto n = static_cast<std::size_t>(chunks[0].numel);
    const auto r = static_cast<std::size_t>(world_rank()),
               d = static_cast<std::size_t>(world_size());
    lo = r * n / d;
    hi = (r + 1) * n / d;
    for (std::size_t k = 0; k < 3; ++k)
      for (std::size_t i = lo; i < hi; ++i)
        data[k].push_back(fill ? float((i % 1000) * 0.125 + 1000.0 * k) : -7777.0f);
  }
  template <class P, class V>
  static ckpt::Buffers<P> buffers(V& data, std::size_t lo, std::size_t hi, bool moments) {
    ckpt::Buffers<P> b;
    b.moments = moments;
    b.params.push_back({data[0].data(), lo, hi});
    if (moments) {
      b.m.push_back({data[1].data(), lo, hi});
      b.v.push_back({data[2].data(), lo, hi});
    }
    return b;
  }
  ckpt::Buffers<const float> in(bool moments = true) const {
    return buffers<const float>(data, lo, hi, moments);
  }
  ckpt::Buffers<float> out() { return buffers<float>(data, lo, hi, true); }
  // The name of the tensor holding flat element i.
  std::string tensor_at(std::size_t i) const {
    for (const auto& t : chunks[0].tensors)
      if (std::int64_t(i) >= t.offset && std::int64_t(i) < t.offset + t.numel) return t.name;
    return "?";
  }
};

const ckpt::TensorPredicate kEveryOwner = [](const TensorSpec&) { return true; };
const std::map<std::string, std::string> kAttrs = {{"deck", "&run /\n"}, {"grid", "test"}};

ckpt::CheckpointState state_of(std::int64_t step) {
  ckpt::CheckpointState s;
  s.step = step;
  s.consumed_samples = 8 * step;
  s.optimizer_t = step;
  s.seed = 1234;
  s.lr = 1e-3;
  return s;
}

ckpt::SaveReport save(const std::string& dir, const Shards& s, std::int64_t step, int keep = 3) {
  return ckpt::save_checkpoint<float>(dir, MPI_COMM_WORLD, s.chunks, s.in(), kEveryOwner,
                                      state_of(step), kAttrs, keep);
}

// The error `fn` throws (with its exit code), checked to be one line and the same on every rank.
template <class Fn>
std::string error_of(Fn&& fn, int want_code = kExitRuntime) {
  std::string e = "(no error)";
  try {
    fn();
  } catch (const Error& x) {
    EXPECT_EQ(x.exit_code(), want_code) << x.what();
    e = x.what();
  }
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  for (const auto& theirs : mpi::all_gather(MPI_COMM_WORLD, e))
    EXPECT_EQ(theirs, e) << "ranks disagree on the error";
  return e;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The whole content of an HDF5 file as h5dump prints it, without the line naming the file.
std::string h5dump(const std::string& path) {
  FILE* p = popen(("/usr/bin/h5dump " + path + " | tail -n +2").c_str(), "r");
  std::string text;
  char buf[4096];
  while (p && !std::feof(p)) text.append(buf, std::fread(buf, 1, sizeof buf, p));
  if (p) pclose(p);
  return text;
}

// Rank 0 deletes the object `link` from the file at `path`.
void remove_link(const std::string& path, const std::string& link) {
  if (world_rank() == 0) {
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    EXPECT_GE(H5Ldelete(f, link.c_str(), H5P_DEFAULT), 0) << link;
    H5Fclose(f);
  }
  barrier();
}

// The folder's entries, sorted (rank 0's view).
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Loads `restart` into fresh buffers and checks every owned element; returns the step.
std::int64_t load_and_check(const std::string& restart, const std::string& dir) {
  Shards want, got(false);
  const auto state = ckpt::load_checkpoint<float>(restart, dir, MPI_COMM_WORLD, got.chunks,
                                                  got.out(), kEveryOwner);
  EXPECT_EQ(got.data, want.data) << restart;
  return state.step;
}

// A tmpfs of `bytes` mounted at `dir` by rank 0 for the scope (root only); mounted() is the
// same on every rank.
class SmallDisk {
 public:
  SmallDisk(const std::string& dir, std::size_t bytes) : dir_(dir) {
    int ok = 0;
    if (world_rank() == 0) {
      fs::create_directories(dir);
      ok = mount("tmpfs", dir.c_str(), "tmpfs", 0, cat("size=", bytes).c_str()) == 0;
    }
    MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    mounted_ = ok != 0;
  }
  ~SmallDisk() {
    barrier();
    if (mounted_ && world_rank() == 0) umount2(dir_.c_str(), MNT_DETACH);
  }
  SmallDisk(const SmallDisk&) = delete;
  SmallDisk& operator=(const SmallDisk&) = delete;
  bool mounted() const { return mounted_; }
  // Rank 0 fills the disk but for about `left` bytes.
  void fill_but(std::size_t left) const {
    if (world_rank() == 0) {
      std::ofstream out(dir_ + "/filler", std::ios::binary | std::ios::app);
      const std::string block(4096, 'x');
      for (std::uintmax_t free = fs::space(dir_).available; free > left + block.size();
           free = fs::space(dir_).available) {
        out.write(block.data(), std::streamsize(block.size()));
        out.flush();
        if (!out) break;
      }
    }
    barrier();
  }

 private:
  std::string dir_;
  bool mounted_ = false;
};

}  // namespace

// Issue 11, defect 2: one rank's failing step of the collective write used to leave the others
// waiting forever in the next collective call. Each step is injected to fail on the last rank
// only, after it ran.
TEST(CkptErrors, AFailedWriteOnOneRankIsEveryRanksErrorAndPublishesNothing) {
  TempDir dir;
  const Shards shards;
  save(dir.path(), shards, 1, 1);
  const std::string tmp = ".ckpt_00000002.h5.tmp";
  for (const std::string& step :
       {tmp + ": create", tmp + ": attribute deck", tmp + ": /model: create",
        tmp + ": /model/wpe.weight: create", tmp + ": /model/h.1.mlp.fc.weight: write",
        tmp + ": /optim/v/ln_f.bias: write", tmp + ": /state/lr: write", tmp + ": /optim/m: close",
        tmp + ": close"}) {
    if (last_rank()) ckpt::detail::inject_failure(step);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = error_of([&] { save(dir.path(), shards, 2, 1); });
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
    EXPECT_TRUE(
        contains(e, cat("save_checkpoint ", dir.file("ckpt_00000002.h5"), ": ", dir.file(step),
                        ": No space left on device (nothing was "
                        "published)")))
        << e;
    if (world_rank() == 0) {
      EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"ckpt_00000001.h5", "latest"}))
          << step;
    }
    EXPECT_EQ(load_and_check("latest", dir.path()), 1) << step;
  }
  // The next save works and prunes as usual.
  save(dir.path(), shards, 2, 1);
  EXPECT_EQ(load_and_check("latest", dir.path()), 2);
  if (world_rank() == 0) {
    EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"ckpt_00000002.h5", "latest"}));
  }
}

// The same on a really full file system: the second checkpoint does not fit. Found by the
// space check before the file is made, and, with that check off (as when the disk fills up
// while the file is written), by the writes themselves or the verification.
TEST(CkptErrors, AFullDiskEndsTheSaveWithOneErrorAndKeepsLatest) {
  TempDir dir;
  const std::string disk_dir = dir.file("disk");
  SmallDisk disk(disk_dir, 4 << 20);
  if (!disk.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  const std::string folder = disk_dir + "/checkpoints";
  const Shards shards;
  const auto first = save(folder, shards, 1);
  disk.fill_but(std::size_t(first.file_bytes / 3));
  for (bool space_check : {true, false}) {
    ckpt::detail::check_space_first(space_check);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = error_of([&] { save(folder, shards, 2); });
    ckpt::detail::check_space_first(true);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
    // Without the check the failure shows in a write, or (MPI-IO loses some writes to a full
    // disk silently) in the verification.
    const std::string tmp = folder + "/.ckpt_00000002.h5.tmp: ";
    EXPECT_EQ(e.rfind("save_checkpoint " + folder + "/ckpt_00000002.h5: ", 0), 0u) << e;
    if (space_check) {
      EXPECT_TRUE(contains(e, tmp + "create: No space left on device (")) << e;
    }
    EXPECT_TRUE(contains(e, ": No space left on device")) << e;
    if (world_rank() == 0) {
      EXPECT_EQ(entries(folder), (std::vector<std::string>{"ckpt_00000001.h5", "latest"}));
    }
    EXPECT_EQ(load_and_check("latest", folder), 1);
  }
}

// Issue 11, defect 1: a diverged run published all-NaN checkpoints and pruned the good ones.
TEST(CkptErrors, NonFiniteValuesAreNeverWritten) {
  TempDir dir;
  save(dir.path(), Shards(), 1, 1);
  for (int kind : {0, 1, 2}) {
    Shards bad;
    const std::size_t at = (bad.hi - bad.lo) / 2;
    if (last_rank())
      bad.data[std::size_t(kind)][at] = kind == 1 ? std::numeric_limits<float>::infinity()
                                                  : std::numeric_limits<float>::quiet_NaN();
    const std::string name = cat(kind == 0   ? "/model/"
                                 : kind == 1 ? "/optim/m/"
                                             : "/optim/v/",
                                 bad.tensor_at(bad.lo + at));
    const std::string e = error_of([&] { save(dir.path(), bad, 2, 1); });
    EXPECT_EQ(e, mpi::broadcast(
                     MPI_COMM_WORLD, world_size() - 1,
                     cat("save_checkpoint ", dir.file("ckpt_00000002.h5"), ": not written: ", name,
                         " holds ", kind == 1 ? "inf" : "nan", " on rank ", world_size() - 1)));
    if (world_rank() == 0) {
      EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"ckpt_00000001.h5", "latest"}));
    }
  }
  EXPECT_EQ(load_and_check("latest", dir.path()), 1);
}

// Issue 11, defect 7 and issue 10: final weights from what each rank owns, written under a
// temporary name, verified and renamed, so a failed save leaves the previous file whole.
TEST(CkptErrors, FinalWeightsReplaceThePreviousFileOnlyOnceWritten) {
  TempDir dir;
  const std::string path = dir.file("final.h5");
  const Shards shards;
  auto save_final = [&](const Shards& s) {
    return ckpt::save_owned_weights<float>(path, MPI_COMM_WORLD, s.chunks, s.in(false), kEveryOwner,
                                           kAttrs);
  };
  const auto report = save_final(shards);
  EXPECT_EQ(report.path, path);
  EXPECT_GT(report.file_bytes, report.data_bytes);
  // A weights file (format 1, no moments, no state) that init_from reads into whole chunks.
  {
    std::vector<float> whole(std::size_t(shards.chunks[0].numel), -1.0f);
    ckpt::LoadReport loaded;
    ckpt::load_weights<float>(
        path, MPI_COMM_WORLD, shards.chunks, {whole.data()},
        [](const TensorSpec&) { return world_rank() == 0; }, &loaded);
    EXPECT_EQ(loaded.attributes.at("format_version"), "1");
    EXPECT_EQ(loaded.attributes.count("date"), 0u);
    EXPECT_EQ(std::vector<float>(whole.begin() + long(shards.lo), whole.begin() + long(shards.hi)),
              shards.data[0]);
  }
  if (world_rank() == 0) {
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    EXPECT_EQ(H5Lexists(f, "optim", H5P_DEFAULT), 0);
    EXPECT_EQ(H5Lexists(f, "state", H5P_DEFAULT), 0);
    H5Fclose(f);
  }
  const std::string before = world_rank() == 0 ? read_file(path) : "";
  // The same file as save_weights writes from whole chunks (but for the objects' times): one
  // /model writer.
  {
    std::vector<float> whole(std::size_t(shards.chunks[0].numel));
    const std::vector<std::string> parts = mpi::all_gather(
        MPI_COMM_WORLD, std::string(reinterpret_cast<const char*>(shards.data[0].data()),
                                    shards.data[0].size() * sizeof(float)));
    std::string all;
    for (const auto& p : parts) all += p;
    std::memcpy(whole.data(), all.data(), all.size());
    const std::string other = dir.file("whole.h5");
    ckpt::save_weights<float>(
        other, MPI_COMM_WORLD, shards.chunks, {whole.data()},
        [](const TensorSpec&) { return world_rank() == 0; }, kAttrs);
    if (world_rank() == 0 && access("/usr/bin/h5dump", X_OK) == 0) {
      EXPECT_TRUE(h5dump(other) == h5dump(path)) << "save_weights and save_owned_weights differ";
    }
    if (world_rank() == 0) fs::remove(other);
    barrier();
  }

  Shards other;
  for (auto& x : other.data[0]) x += 1;
  if (last_rank()) ckpt::detail::inject_failure(".final.h5.tmp: /model/h.2.attn.qkv.weight: write");
  const std::string e = error_of([&] { save_final(other); });
  EXPECT_TRUE(contains(e, cat("save weights ", path, ": ", dir.file(".final.h5.tmp"),
                              ": /model/h.2.attn.qkv.weight: write: No space left on device")))
      << e;
  if (last_rank()) other.data[0][0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(contains(error_of([&] { save_final(other); }), "not written: /model/"));
  if (world_rank() == 0) {
    EXPECT_EQ(read_file(path), before) << "the previous final.h5 changed";
    EXPECT_EQ(entries(dir.path()), std::vector<std::string>{"final.h5"});
  }
}

// Issue 11, defect 5: an unusable output or checkpoint folder was found at the first save.
TEST(CkptErrors, UnusableOutputFoldersAreFoundBeforeStepOne) {
  TempDir dir;
  ckpt::FolderLocks locks;  // check_writable locks the folders it accepts (ckpt/lock.hpp)
  if (world_rank() == 0) std::ofstream(dir.file("a_file")) << "x";
  barrier();
  Config c = deck::defaults();
  c.checkpoint.dir = "checkpoints";
  c.checkpoint.every = 10;
  auto refusal = [&] {
    return error_of([&] { ckpt::check_writable(c, MPI_COMM_WORLD); }, kExitInput);
  };
  c.run.out_dir = dir.file("a_file/out");
  EXPECT_EQ(refusal(), "run%out_dir folder '" + c.run.out_dir + "': " + dir.file("a_file") +
                           " is a file, not a folder");
  c.run.out_dir = dir.file("a_file");
  EXPECT_EQ(refusal(), "run%out_dir folder '" + c.run.out_dir + "': " + dir.file("a_file") +
                           " is a file, not a folder");
  // A checkpoint folder in a file's place, also when only a signal would make it.
  c.run.out_dir = dir.file("out");
  for (std::int64_t every : {10, 0}) {
    c.checkpoint.every = every;
    c.checkpoint.dir = dir.file("a_file/ck");
    EXPECT_EQ(refusal(), "checkpoint%dir folder '" + c.checkpoint.dir + "': " + dir.file("a_file") +
                             " is a file, not a folder");
  }
  // Usable: out_dir is made, the checkpoint folder only when saves are periodic.
  c.checkpoint.dir = "checkpoints";
  c.checkpoint.every = 0;
  ckpt::check_writable(c, MPI_COMM_WORLD);
  if (world_rank() == 0) {
    EXPECT_TRUE(fs::is_directory(c.run.out_dir));
    EXPECT_FALSE(fs::exists(c.run.out_dir + "/checkpoints"));
    EXPECT_EQ(entries(c.run.out_dir), std::vector<std::string>{".ptrain.lock"})
        << "the probe file was left behind";
  }
  c.checkpoint.every = 5;
  ckpt::check_writable(c, MPI_COMM_WORLD);
  if (world_rank() == 0) {
    EXPECT_TRUE(fs::is_directory(c.run.out_dir + "/checkpoints"));
  }

  // A read-only folder: permission bits for a normal user, a read-only mount for root (who
  // ignores permission bits).
  const std::string ro = dir.file("ro");
  int mounted = 0;
  if (world_rank() == 0) {
    fs::create_directories(ro);
    if (geteuid() == 0)
      mounted = mount("tmpfs", ro.c_str(), "tmpfs", MS_RDONLY, "size=64k") == 0;
    else
      chmod(ro.c_str(), 0555);
  }
  MPI_Bcast(&mounted, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (geteuid() != 0 || mounted) {
    c.checkpoint.dir = ro + "/ck";
    for (std::int64_t every : {5, 0}) {
      c.checkpoint.every = every;
      const std::string e = refusal();
      EXPECT_EQ(e.rfind("checkpoint%dir folder '" + c.checkpoint.dir + "': ", 0), 0u) << e;
      EXPECT_TRUE(contains(e, "Read-only file system") || contains(e, "Permission denied")) << e;
    }
  }
  barrier();
  if (world_rank() == 0) {
    if (mounted) umount2(ro.c_str(), MNT_DETACH);
    chmod(ro.c_str(), 0755);
  }
}

// Issue 11, defect 9 (the loading side): a checkpoint or weights file missing a tensor, a
// group or /state is refused in one line naming the file and what is missing.
TEST(CkptErrors, FilesMissingATensorOrTheStateAreRefused) {
  TempDir dir;
  const Shards shards;
  const std::string good = save(dir.path(), shards, 3).path;
  auto without = [&](const std::string& link) {
    const std::string copy = dir.file(cat("without", std::hash<std::string>()(link), ".h5"));
    if (world_rank() == 0) fs::copy_file(good, copy);
    remove_link(copy, link);
    return copy;
  };
  auto refusal = [&](const std::string& path) {
    Shards got(false);
    const std::string e = error_of([&] {
      ckpt::load_checkpoint<float>(path, "", MPI_COMM_WORLD, got.chunks, got.out(), kEveryOwner);
    });
    EXPECT_EQ(got.data, Shards(false).data) << "a refused load changed the buffers";
    return e;
  };
  const std::pair<const char*, const char*> cases[] = {
      {"/model/wpe.weight", "no dataset /model/wpe.weight (the model needs shape (8, 16))"},
      {"/optim/v/ln_f.bias", "no dataset /optim/v/ln_f.bias (the model needs shape (16))"},
      {"/optim/m", "no group /optim/m (the file is incomplete)"},
      {"/model", "no group /model (not a ptrain checkpoint)"},
      {"/state/lr", "no dataset /state/lr"},
      {"/state", "no group /state (not a ptrain checkpoint)"}};
  for (const auto& [link, message] : cases) {
    const std::string f = without(link);
    EXPECT_EQ(refusal(f), f + ": " + message);
  }

  // Final weights missing a tensor, read by init_from.
  const std::string weights = dir.file("final.h5");
  ckpt::save_owned_weights<float>(weights, MPI_COMM_WORLD, shards.chunks, shards.in(false),
                                  kEveryOwner, kAttrs);
  remove_link(weights, "/model/h.3.ln_2.bias");
  std::vector<float> whole(std::size_t(shards.chunks[0].numel), -1.0f);
  EXPECT_EQ(error_of([&] {
              ckpt::load_weights<float>(weights, MPI_COMM_WORLD, shards.chunks, {whole.data()},
                                        [](const TensorSpec&) { return world_rank() == 0; });
            }),
            weights + ": no dataset /model/h.3.ln_2.bias (the model needs shape (16))");
  EXPECT_EQ(whole, std::vector<float>(whole.size(), -1.0f));
}

// Found by regression/fuzz/weights_fuzzer: the catalogue of a file listed a group's links by
// index in name order (H5Lget_name_by_idx, H5_ITER_INC). For a group with dense link storage
// (/model has more than 8 links) libhdf5 1.10 builds a table of all the links on each such
// call, and when the group's link heap is damaged (its direct block fails its checksum) it frees
// the table's uninitialised entries (H5G__dense_get_name_by_idx -> H5G__link_release_table ->
// free of a garbage pointer): a crash inside libhdf5 (SEGV under ASan, "free(): invalid
// pointer" or heap corruption without), in place of an error. The links are now walked in the
// storage's native order, which needs no table: the load fails with one line, on every rank.
// While rank 0 (which reads the catalogue) loads, glibc's M_PERTURB fills fresh allocations
// with a pattern (the complement of 0xa5), so that the old code frees a garbage pointer every
// time, not only when the heap happens to hold one.
TEST(CkptErrors, ADamagedLinkHeapIsAnErrorNotACrashInsideHdf5) {
  struct Perturb {
    Perturb() {
      if (world_rank() == 0) mallopt(M_PERTURB, 0xa5);
    }
    ~Perturb() {
      if (world_rank() == 0) mallopt(M_PERTURB, 0);
    }
  };
  TempDir dir;
  const Shards shards;
  const std::string checkpoint = save(dir.path(), shards, 3).path;
  const std::string weights = dir.file("final.h5");
  ckpt::save_owned_weights<float>(weights, MPI_COMM_WORLD, shards.chunks, shards.in(false),
                                  kEveryOwner, kAttrs);
  // A copy with one byte changed inside the first fractal-heap direct block ("FHDB"): the link
  // heap of the first group with dense links (/model in a weights file).
  auto damaged = [&](const std::string& path) {
    const std::string copy = path + ".damaged.h5";
    if (world_rank() == 0) {
      std::string bytes = read_file(path);
      const std::size_t at = bytes.find("FHDB");
      EXPECT_NE(at, std::string::npos) << path << " has no fractal heap";
      if (at != std::string::npos) bytes[at + 40] = static_cast<char>(bytes[at + 40] ^ 0x5a);
      std::ofstream(copy, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
    }
    barrier();
    return copy;
  };
  const std::string bad_weights = damaged(weights);
  std::vector<float> whole(std::size_t(shards.chunks[0].numel), -1.0f);
  const std::string e = error_of([&] {
    Perturb perturb;
    ckpt::load_weights<float>(bad_weights, MPI_COMM_WORLD, shards.chunks, {whole.data()},
                              [](const TensorSpec&) { return world_rank() == 0; });
  });
  EXPECT_TRUE(contains(e, bad_weights + ": /model: ")) << e;
  EXPECT_EQ(whole, std::vector<float>(whole.size(), -1.0f));

  const std::string bad_checkpoint = damaged(checkpoint);
  Shards got(false);
  const std::string e2 = error_of([&] {
    Perturb perturb;
    ckpt::load_checkpoint<float>(bad_checkpoint, "", MPI_COMM_WORLD, got.chunks, got.out(),
                                 kEveryOwner);
  });
  EXPECT_TRUE(contains(e2, bad_checkpoint + ": /")) << e2;
  EXPECT_EQ(got.data, Shards(false).data) << "a refused load changed the buffers";
}

// Found by regression/fuzz/weights_fuzzer: names and values read from a file went into errors
// as they were, so a damaged (or hostile) file made a message of several lines, or one with
// terminal control bytes ("<file>: /model/<raw bytes>: bad object header version number").
// They are now written with \xNN for control characters (and cut to 200 characters).
TEST(CkptErrors, NamesAndValuesFromAFileAreWrittenOnOneLineInErrors) {
  TempDir dir;
  const Shards shards;
  const std::string good = save(dir.path(), shards, 3).path;
  // A copy changed by rank 0 with HDF5 (`edit` gets the open file).
  auto edited = [&](const std::string& name, auto edit) {
    const std::string copy = dir.file(name);
    if (world_rank() == 0) {
      fs::copy_file(good, copy);
      hid_t f = H5Fopen(copy.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
      edit(f);
      H5Fclose(f);
    }
    barrier();
    return copy;
  };
  auto load = [&](const std::string& path) {
    Shards got(false);
    return error_of([&] {
      ckpt::load_checkpoint<float>(path, "", MPI_COMM_WORLD, got.chunks, got.out(), kEveryOwner);
    });
  };
  // A link whose name holds a new line and an escape, leading nowhere (H5Oopen fails).
  const std::string dangling = edited("dangling.h5", [](hid_t f) {
    EXPECT_GE(H5Lcreate_soft("/nowhere", f, "/model/x\ny\x1b[31m", H5P_DEFAULT, H5P_DEFAULT), 0);
  });
  EXPECT_TRUE(contains(load(dangling), dangling + ": /model/x\\x0ay\\x1b[31m: ")) << load(dangling);
  // A dataset the model does not have, named with a tab.
  const std::string extra = edited("extra.h5", [](hid_t f) {
    const hsize_t n = 2;
    hid_t space = H5Screate_simple(1, &n, nullptr);
    hid_t d = H5Dcreate2(f, "/optim/m/tab\there", H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT,
                         H5P_DEFAULT);
    EXPECT_GE(d, 0);
    H5Dclose(d);
    H5Sclose(space);
  });
  EXPECT_EQ(load(extra), extra +
                             ": /optim/m/tab\\x09here is not a tensor of this model "
                             "(the checkpoint is of another model)");
  // A format_version of two lines.
  const std::string version = edited("version.h5", [](hid_t f) {
    H5Adelete(f, "format_version");
    hid_t type = H5Tcopy(H5T_C_S1);
    H5Tset_size(type, 3);
    hid_t space = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(f, "format_version", type, space, H5P_DEFAULT, H5P_DEFAULT);
    EXPECT_GE(H5Awrite(a, type, "2\n3"), 0);
    H5Aclose(a);
    H5Sclose(space);
    H5Tclose(type);
  });
  EXPECT_EQ(load(version), version +
                               ": format_version 2\\x0a3 is not supported (this ptrain "
                               "reads checkpoints of format_version 2)");
  std::vector<float> whole(std::size_t(shards.chunks[0].numel), -1.0f);
  EXPECT_EQ(error_of([&] {
              ckpt::load_weights<float>(version, MPI_COMM_WORLD, shards.chunks, {whole.data()},
                                        [](const TensorSpec&) { return world_rank() == 0; });
            }),
            version +
                ": format_version 2\\x0a3 is not supported (this ptrain reads 1, and 2 for "
                "checkpoints)");
}
