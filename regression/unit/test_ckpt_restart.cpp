// ptrain-test: np=1,2,4 labels=quick timeout=120
// Training checkpoints: parameters and both AdamW moments written from one decomposition
// (tp, pp, ep, and flat-range ownership: ZeRO shards that cut tensors mid-row, ZeRO 0 with
// one writing replica) and read into every other, element by element against a known
// function of (buffer, tensor, global index); the state round trip; the atomic save
// (`latest`, `keep`, leftover .tmp files); and every refused file refused alike on all ranks
// without touching a buffer. The row-major range decomposition is checked against a
// brute-force walk, the file against h5dump and postprocess/ckpt_tool.py.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/common.hpp"
#include "ckpt_test_support.hpp"
#include "model/layout.hpp"
#include "test_support.hpp"
#include "util/error.hpp"

using namespace ptrain;
using model::ChunkLayout;
using model::Shape;
using model::Slab;
using model::TensorSpec;

using ptrain::test::world_rank;
using ptrain::test::world_size;
using TempDir = ptrain::test::TempDir;
using ptrain::test::blocks_at;
using ptrain::test::global_index;
using ptrain::test::Place;
using ptrain::test::place;
using ptrain::test::same_blocks;
using ptrain::test::small_model;
using ptrain::test::with_decomp;

namespace {

void barrier() { MPI_Barrier(MPI_COMM_WORLD); }

// Who owns what along the data-parallel axis (the replicas left after tp, pp and ep):
//   replicated  every replica owns its whole chunk, replica 0 is the holder (ZeRO 0, load)
//   first       replica 0 owns its whole chunk, the others nothing (ZeRO 0, save)
//   zero        replica d owns [b(d), b(d+1)) of each chunk of N elements (ZeRO 1+), with
//               b(d) = d*N/D + 5 inside (0 < d < D): every tensor of this model is a multiple
//               of d_model long, so the flat size is a multiple of D, and the shift makes the
//               boundaries cut tensors mid-row (checked) as a padded ZeRO split can
enum class Own { replicated, first, zero };

struct Decomp {
  int T = 1, P = 1, V = 1, E = 1;
  Own own = Own::replicated;
  int D() const { return world_size() / (T * P * E); }
  std::string label() const {
    const char* o = own == Own::zero ? "zero" : own == Own::first ? "first" : "repl";
    return cat("tp", T, "_pp", P, "_vs", V, "_ep", E, "_dp", D(), o);
  }
};

// The decompositions of the dense model (4 heads, 4 layers) at this world size.
std::vector<Decomp> dense_decompositions() {
  using O = Own;
  switch (world_size()) {
    case 1:
      return {{1, 1, 1, 1, O::replicated}, {1, 1, 2, 1, O::zero}};
    case 2:
      return {{2, 1, 1, 1, O::replicated},
              {1, 2, 1, 1, O::replicated},
              {1, 1, 1, 1, O::zero},
              {1, 1, 1, 1, O::first},
              {1, 1, 1, 1, O::replicated}};
    case 4:
      return {{4, 1, 1, 1, O::replicated}, {2, 1, 1, 1, O::zero}, {1, 1, 1, 1, O::zero},
              {2, 2, 1, 1, O::replicated}, {1, 2, 1, 1, O::zero}, {1, 1, 1, 1, O::first},
              {2, 1, 1, 1, O::replicated}};
    default:
      return {{1, 1, 1, 1, O::replicated}};
  }
}
std::vector<Decomp> moe_decompositions() {
  using O = Own;
  switch (world_size()) {
    case 1:
      return {{1, 1, 1, 1, O::zero}};
    case 2:
      return {{1, 1, 1, 2, O::replicated}, {1, 1, 1, 1, O::zero}};
    case 4:
      return {{2, 1, 1, 2, O::replicated},
              {1, 1, 1, 4, O::first},
              {1, 1, 1, 2, O::zero},
              {1, 1, 1, 1, O::zero}};
    default:
      return {{1, 1, 1, 1, O::replicated}};
  }
}

// One holder of each element among ranks whose ranges hold it: t == 0 (e == 0) for tensors
// whose blocks do not depend on t (e); replica 0 unless the ranges split the replicas.
ckpt::TensorPredicate holder(const Config& config, const Decomp& g, int rank) {
  const Place pl = place(g, rank);
  model::ShardCoord t0 = pl.coord, e0 = pl.coord;
  t0.t = 0;
  e0.e = 0;
  const Config c = with_decomp(config, g);
  const bool replica_ok = g.own == Own::zero || pl.d == 0;
  return [pl, replica_ok, at_t0 = blocks_at(c, t0), at_e0 = blocks_at(c, e0)](const TensorSpec& s) {
    const bool split_t = !same_blocks(s.slabs, at_t0.at(s.name));
    const bool split_e = !same_blocks(s.slabs, at_e0.at(s.name));
    return replica_ok && (pl.coord.t == 0 || split_t) && (pl.coord.e == 0 || split_e);
  };
}

// The known content: exact in float (multiples of 1/8 below 2^12), distinct inside a
// tensor and between parameters (kind 0), m (1) and v (2).
double value(int kind, const std::string& name, std::int64_t i) {
  std::uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ULL;
  return static_cast<double>(h % 1000) / 8.0 + static_cast<double>(i % 4093) * 0.125 - 300.0 +
         1500.0 * kind;
}

constexpr double kJunk = -7777.0;

// One rank's model part: the layout, what each flat element means, and the owned ranges of
// params, m and v (one range per chunk, the same for the three here).
template <class T>
struct Part {
  std::vector<ChunkLayout> chunks;
  std::vector<std::vector<const TensorSpec*>> tensor_at;  // per chunk element, or null
  std::vector<std::vector<std::int64_t>> index_at;        // global index, or -1 (padding)
  std::vector<std::pair<std::size_t, std::size_t>> range;
  bool moments = true;
  std::array<std::vector<std::vector<T>>, 3> data;  // [kind][chunk]: elements lo..hi

  // What the element should hold after a load.
  double want(int kind, std::size_t c, std::size_t i) const {
    const TensorSpec* t = tensor_at[c][i];
    return t && index_at[c][i] >= 0 ? value(kind, t->name, index_at[c][i]) : 0.0;
  }
  int kinds() const { return moments ? 3 : 1; }
  template <class P, class V>
  static ckpt::Buffers<P> buffers(V& data,
                                  const std::vector<std::pair<std::size_t, std::size_t>>& range,
                                  bool moments) {
    ckpt::Buffers<P> b;
    b.moments = moments;
    for (int k = 0; k < (moments ? 3 : 1); ++k)
      for (std::size_t c = 0; c < range.size(); ++c) {
        ckpt::Owned<P> o{data[k][c].data(), range[c].first, range[c].second, int(c)};
        (k == 0 ? b.params : k == 1 ? b.m : b.v).push_back(o);
      }
    return b;
  }
  ckpt::Buffers<const T> in() const { return buffers<const T>(data, range, moments); }
  ckpt::Buffers<T> out() { return buffers<T>(data, range, moments); }
};

// fill: owned slab elements get their value (the tied copy and padding junk: never written);
// else everything is junk.
template <class T>
Part<T> make_part(const Config& config, const Decomp& g, bool fill, bool moments = true) {
  Part<T> part;
  const Place pl = place(g, world_rank());
  part.chunks = model::build_layout(with_decomp(config, g), pl.coord);
  part.moments = moments;
  const int D = g.D();
  for (const auto& chunk : part.chunks) {
    const auto n = static_cast<std::size_t>(chunk.numel);
    std::vector<const TensorSpec*> tensor(n, nullptr);
    std::vector<std::int64_t> index(n, -1);
    for (const auto& t : chunk.tensors) {
      for (std::int64_t k = 0; k < t.numel; ++k) tensor[t.offset + k] = &t;
      std::int64_t k = t.offset;
      for (const auto& s : t.slabs)
        for (std::int64_t j = 0; j < s.numel(); ++j)
          index[k++] = global_index(t.global_shape, s, j);
    }
    std::pair<std::size_t, std::size_t> r{0, n};
    auto boundary = [&](std::size_t d) {
      return d == 0 || d == std::size_t(D) ? d * n / D : d * n / D + 5;
    };
    if (g.own == Own::zero) r = {boundary(std::size_t(pl.d)), boundary(std::size_t(pl.d) + 1)};
    if (g.own == Own::first && pl.d != 0) r = {0, 0};
    for (int k = 0; k < part.kinds(); ++k) {
      std::vector<T> d(r.second - r.first, T(kJunk));
      if (fill)
        for (std::size_t i = r.first; i < r.second; ++i)
          if (tensor[i] && !tensor[i]->tied_copy && index[i] >= 0)
            d[i - r.first] = static_cast<T>(value(k, tensor[i]->name, index[i]));
      part.data[k].push_back(std::move(d));
    }
    part.tensor_at.push_back(std::move(tensor));
    part.index_at.push_back(std::move(index));
    part.range.push_back(r);
  }
  return part;
}

// Every owned element equals what a load should give; returns the number of wrong ones.
template <class T>
int count_wrong(const Part<T>& part, const std::string& where) {
  int wrong = 0;
  for (int k = 0; k < part.kinds(); ++k)
    for (std::size_t c = 0; c < part.chunks.size(); ++c)
      for (std::size_t i = part.range[c].first; i < part.range[c].second; ++i) {
        const T got = part.data[k][c][i - part.range[c].first];
        const T want = static_cast<T>(part.want(k, c, i));
        if (got != want && wrong++ < 3) {
          const TensorSpec* t = part.tensor_at[c][i];
          ADD_FAILURE() << where << ": buffer " << k << " chunk " << c << " element " << i << " ("
                        << (t ? t->name : "gap") << ") is " << got << ", want " << want;
        }
      }
  return wrong;
}

template <class T>
bool all_junk(const Part<T>& part) {
  for (const auto& kind : part.data)
    for (const auto& d : kind)
      for (T x : d)
        if (x != T(kJunk)) return false;
  return true;
}

// True when `at` falls strictly inside a row of some tensor's slab (not at a row start).
bool cuts_mid_row(const ChunkLayout& chunk, std::int64_t at) {
  for (const auto& t : chunk.tensors) {
    std::int64_t base = t.offset;
    for (const auto& s : t.slabs) {
      if (at > base && at < base + s.numel() && (at - base) % s.count.back() != 0) return true;
      base += s.numel();
    }
  }
  return false;
}

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), kExitRuntime);
    return e.what();
  }
  return "(no error)";
}

ckpt::CheckpointState some_state(std::int64_t step) {
  ckpt::CheckpointState s;
  s.step = step;
  s.consumed_samples = 32 * step + 5;
  s.optimizer_t = step - 3;
  s.seed = 0xfedcba9876543210ULL;  // above 2^63: stored as uint64
  s.lr = 3e-4 / 7;
  // Even steps keep the data's fields; odd ones are written as before they existed (and must
  // load as such).
  if (step % 2 == 0) {
    s.has_data = true;
    s.data_fingerprint = 0x8000000000000001ULL * std::uint64_t(step);
    s.dataset_samples = {s.consumed_samples - 3, 0, 3};
  }
  return s;
}
bool same_state(const ckpt::CheckpointState& a, const ckpt::CheckpointState& b) {
  return a.step == b.step && a.consumed_samples == b.consumed_samples &&
         a.optimizer_t == b.optimizer_t && a.seed == b.seed && a.lr == b.lr &&
         a.has_data == b.has_data && a.data_fingerprint == b.data_fingerprint &&
         a.dataset_samples == b.dataset_samples;
}

const std::map<std::string, std::string> kAttrs = {{"deck", "&model\n  d_model = 16\n/\n"},
                                                   {"grid", "test"},
                                                   {"zero", "1"},
                                                   {"ptrain_version", "0.1.0"}};

template <class T>
ckpt::SaveReport save(const std::string& dir, const Config& config, const Decomp& g,
                      std::int64_t step, int keep = 3, bool moments = true) {
  auto part = make_part<T>(config, g, true, moments);
  auto attrs = kAttrs;
  attrs["grid"] = g.label();
  return ckpt::save_checkpoint<T>(dir, MPI_COMM_WORLD, part.chunks, part.in(),
                                  holder(config, g, world_rank()), some_state(step), attrs, keep);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Exit status of a shell command (rank 0 only); -1 when it could not run.
int run_command(const std::string& cmd, std::string* out = nullptr) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  std::string text;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) text.append(buf, n);
  const int status = pclose(p);
  if (out) *out = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

bool have_python_tools() {
  return access("/usr/bin/python3", X_OK) == 0 &&
         run_command("/usr/bin/python3 -c 'import numpy, h5py'") == 0;
}
std::string ckpt_tool() {
  return cat("/usr/bin/python3 ", PTRAIN_SOURCE_DIR, "/postprocess/ckpt_tool.py");
}

// Flips one bit of element `element` of a contiguous dataset in the raw file (rank 0).
void flip_bit(const std::string& path, const std::string& dataset, std::int64_t element,
              std::size_t elem_bytes) {
  if (world_rank() == 0) {
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t ds = H5Dopen2(f, dataset.c_str(), H5P_DEFAULT);
    const haddr_t offset = H5Dget_offset(ds);
    H5Dclose(ds);
    H5Fclose(f);
    EXPECT_NE(offset, HADDR_UNDEF) << dataset;
    const auto at = static_cast<std::streamoff>(offset + elem_bytes * element);
    std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(at);
    char byte = 0;
    io.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    io.seekp(at);
    io.write(&byte, 1);
  }
  barrier();
}

// Writes with each decomposition and reads with every one.
template <class T>
void reshard_round_trips(const Config& config, const std::vector<Decomp>& decomps,
                         const std::string& model_name) {
  TempDir dir;
  for (const auto& w : decomps) {
    const std::string sub = dir.file(model_name + "_" + w.label());
    const auto saved = save<T>(sub, config, w, 42);
    EXPECT_EQ(saved.path, sub + "/ckpt_00000042.h5");
    for (const auto& r : decomps) {
      auto part = make_part<T>(config, r, false);
      ckpt::CheckpointLoadReport report;
      const auto state =
          ckpt::load_checkpoint<T>("latest", sub, MPI_COMM_WORLD, part.chunks, part.out(),
                                   holder(config, r, world_rank()), &report);
      const std::string where = cat(model_name, " written ", w.label(), ", read ", r.label());
      EXPECT_EQ(count_wrong(part, where), 0) << where;
      EXPECT_TRUE(same_state(state, some_state(42))) << where;
      EXPECT_EQ(report.path, saved.path);
      EXPECT_EQ(report.file_dtype, sizeof(T) == 4 ? "fp32" : "fp64");
      EXPECT_EQ(report.attributes["grid"], w.label());
      EXPECT_EQ(report.attributes["format_version"], "2");
      // Every rank reads its owned ranges: at least the whole model once (3 kinds).
      const auto st = some_state(42);  // its values: 8 bytes each
      const auto values = 5 + (st.has_data ? 1 + st.dataset_samples.size() : 0);
      EXPECT_GE(report.bytes_read, saved.data_bytes - std::int64_t(8 * values)) << where;
    }
  }
}

}  // namespace

TEST(CkptRestart, RowMajorRangesOfABoxAreFewBoxesInOrder) {
  // Boxes inside larger global tensors; every range [a, b) against a brute-force walk.
  const std::vector<std::pair<Shape, Slab>> cases = {
      {{10}, Slab{{3}, {5}}},
      {{7, 9}, Slab{{2, 1}, {3, 4}}},
      {{4, 6, 5}, Slab{{1, 2, 0}, {2, 3, 4}}},
      {{3, 4, 3, 5}, Slab{{0, 1, 1, 2}, {2, 3, 2, 3}}}};
  for (const auto& [shape, box] : cases) {
    const std::int64_t n = box.numel(), dims = static_cast<std::int64_t>(shape.size());
    for (std::int64_t a = 0; a <= n; ++a)
      for (std::int64_t b = a; b <= n; ++b) {
        const auto boxes = ckpt::detail::boxes_of_range(box, a, b);
        EXPECT_LE(static_cast<std::int64_t>(boxes.size()), 2 * (dims - 1) + 1);
        std::vector<std::int64_t> got, want;
        for (const auto& s : boxes)
          for (std::int64_t j = 0; j < s.numel(); ++j) got.push_back(global_index(shape, s, j));
        for (std::int64_t j = a; j < b; ++j) want.push_back(global_index(shape, box, j));
        EXPECT_EQ(got, want) << "dims " << dims << " range [" << a << ", " << b << ")";
        // One collective transfer moves them: each lies after the previous in row-major order.
        EXPECT_LE(ckpt::detail::transfers_of(boxes).size(), 1u);
      }
  }
}

TEST(CkptRestart, DenseModelReshardsAcrossTpPpAndZeroRangesFp32) {
  const auto config = small_model(50, false);
  // The ZeRO ranges must cut tensors mid-row, or the test proves little.
  for (const auto& g : dense_decompositions())
    if (g.own == Own::zero && g.D() > 1) {
      auto part = make_part<float>(config, g, false);
      int cuts = 0;
      for (std::size_t c = 0; c < part.chunks.size(); ++c) {
        cuts += cuts_mid_row(part.chunks[c], static_cast<std::int64_t>(part.range[c].first)) +
                cuts_mid_row(part.chunks[c], static_cast<std::int64_t>(part.range[c].second));
      }
      int all = 0;
      MPI_Allreduce(&cuts, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
      EXPECT_GT(all, 0) << g.label();
    }
  reshard_round_trips<float>(config, dense_decompositions(), "dense");
}

TEST(CkptRestart, MoeModelWithPaddedVocabReshardsFp64) {
  reshard_round_trips<double>(small_model(9, true), moe_decompositions(), "moe");
}

TEST(CkptRestart, FileHoldsGlobalTensorsMomentsStateAndAttributes) {
  TempDir dir;
  // Written from ZeRO shards cutting tensors mid-row where the world allows.
  auto g = dense_decompositions().back();
  for (const auto& z : dense_decompositions())
    if (z.own == Own::zero && z.D() > 1) g = z;
  const auto config = small_model(50, false);
  const auto saved = save<float>(dir.path(), config, g, 7);
  const std::int64_t n_params = model::global_parameter_count(config);
  EXPECT_EQ(saved.data_bytes, 3 * n_params * 4 + 5 * 8);
  EXPECT_GE(saved.file_bytes, saved.data_bytes);
  EXPECT_GT(saved.seconds, 0.0);
  EXPECT_GE(saved.seconds, saved.write_seconds + saved.verify_seconds);
  if (world_rank() != 0) return;

  // Every tensor of the one-rank model, all three kinds, read whole with plain serial HDF5.
  const std::string path = saved.path;
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  const auto whole = model::build_layout(config, model::ShardCoord{});
  int n_tensors = 0;
  for (const auto& t : whole.front().tensors) {
    ++n_tensors;
    for (int k = 0; k < 3; ++k) {
      const std::string name = cat(k == 0 ? "/model/" : k == 1 ? "/optim/m/" : "/optim/v/", t.name);
      hid_t ds = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
      ASSERT_GE(ds, 0) << name;
      hid_t space = H5Dget_space(ds);
      std::vector<hsize_t> dims(static_cast<std::size_t>(H5Sget_simple_extent_ndims(space)));
      H5Sget_simple_extent_dims(space, dims.data(), nullptr);
      EXPECT_EQ(Shape(dims.begin(), dims.end()), t.global_shape) << name;
      std::vector<float> x(static_cast<std::size_t>(ckpt::detail::product(t.global_shape)));
      EXPECT_GE(H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, x.data()), 0);
      int wrong = 0;
      for (std::size_t i = 0; i < x.size(); ++i)
        wrong += x[i] != static_cast<float>(value(k, t.name, static_cast<std::int64_t>(i)));
      EXPECT_EQ(wrong, 0) << name;
      std::uint64_t stored = 0;
      hid_t attr = H5Aopen(ds, "checksum", H5P_DEFAULT);
      EXPECT_GE(H5Aread(attr, H5T_NATIVE_UINT64, &stored), 0);
      EXPECT_EQ(stored, ckpt::tensor_checksum(x.data(), static_cast<std::int64_t>(x.size())))
          << name;
      H5Aclose(attr);
      H5Sclose(space);
      H5Dclose(ds);
    }
  }
  // /state, read with plain HDF5 in its documented types.
  auto scalar = [&](const char* name, hid_t type, void* out) {
    hid_t ds = H5Dopen2(f, name, H5P_DEFAULT);
    EXPECT_GE(ds, 0) << name;
    EXPECT_GE(H5Dread(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out), 0) << name;
    hid_t ft = H5Dget_type(ds);
    EXPECT_EQ(H5Tget_size(ft), 8u) << name;
    H5Tclose(ft);
    H5Dclose(ds);
  };
  std::int64_t step = 0, samples = 0, t = 0;
  std::uint64_t seed = 0;
  double lr = 0;
  scalar("/state/step", H5T_NATIVE_INT64, &step);
  scalar("/state/consumed_samples", H5T_NATIVE_INT64, &samples);
  scalar("/state/optimizer_t", H5T_NATIVE_INT64, &t);
  scalar("/state/seed", H5T_NATIVE_UINT64, &seed);
  scalar("/state/lr", H5T_NATIVE_DOUBLE, &lr);
  H5Fclose(f);
  ckpt::CheckpointState read;
  read.step = step, read.consumed_samples = samples, read.optimizer_t = t, read.seed = seed;
  read.lr = lr;
  EXPECT_TRUE(same_state(read, some_state(7)));
  EXPECT_EQ(ckpt::read_string_attribute(path, "format_version"), "2");
  EXPECT_EQ(ckpt::read_string_attribute(path, "deck"), kAttrs.at("deck"));
  EXPECT_EQ(ckpt::read_string_attribute(path, "grid"), g.label());
  const std::string date = ckpt::read_string_attribute(path, "date");
  EXPECT_EQ(date.size(), 20u) << date;  // 2024-11-29T09:00:00Z
  EXPECT_EQ(date.back(), 'Z') << date;

  // h5dump lists the datasets at their global shapes.
  if (access("/usr/bin/h5dump", X_OK) == 0) {
    std::string out;
    EXPECT_EQ(run_command("/usr/bin/h5dump -H " + path, &out), 0);
    int n_datasets = 0;
    for (std::size_t at = 0; (at = out.find("DATASET \"", at)) != std::string::npos; ++at)
      ++n_datasets;
    EXPECT_EQ(n_datasets, 3 * n_tensors + 5);
    const auto v = out.find("GROUP \"v\"");
    ASSERT_NE(v, std::string::npos) << out.substr(0, 2000);
    const auto qkv = out.find("DATASET \"h.0.attn.qkv.weight\"", v);
    ASSERT_NE(qkv, std::string::npos);
    EXPECT_EQ(out.find("DATASPACE  SIMPLE { ( 48, 16 ) / ( 48, 16 ) }", qkv),
              out.find("DATASPACE", qkv));
    const auto seed_at = out.find("DATASET \"seed\"");
    ASSERT_NE(seed_at, std::string::npos);
    EXPECT_EQ(out.find("H5T_STD_U64LE", seed_at), out.find("DATATYPE", seed_at) + 10);
  }
  // The Python tool recomputes every checksum and lists the state.
  if (have_python_tools()) {
    std::string out;
    EXPECT_EQ(run_command(ckpt_tool() + " verify " + path, &out), 0) << out;
    EXPECT_EQ(run_command(ckpt_tool() + " list " + path, &out), 0) << out;
    EXPECT_NE(out.find("h.3.mlp.proj.weight"), std::string::npos) << out;
    EXPECT_NE(out.find("step"), std::string::npos) << out;
    EXPECT_NE(out.find(g.label()), std::string::npos) << out;
  }
}

TEST(CkptRestart, SavesAtomicallyKeepsTheNewestAndIgnoresLeftovers) {
  TempDir dir;
  const auto g = dense_decompositions().front();
  const auto config = small_model(50, false);
  const std::string folder = dir.file("run/checkpoints");  // made by the first save
  auto load_step = [&](const std::string& restart) {
    auto part = make_part<float>(config, g, false);
    const auto state = ckpt::load_checkpoint<float>(restart, folder, MPI_COMM_WORLD, part.chunks,
                                                    part.out(), holder(config, g, world_rank()));
    EXPECT_EQ(count_wrong(part, "load " + restart), 0);
    return state.step;
  };
  auto files = [&] {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(folder))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };

  // No checkpoint yet.
  EXPECT_EQ(error_of([&] { load_step("latest"); }),
            folder + "/latest: no checkpoint to restart from (restart = 'latest' but " + folder +
                " has no 'latest' pointer)");
  EXPECT_NE(error_of([&] { save<float>(folder, config, g, 1, 0); }).find("keep = 0"),
            std::string::npos);

  std::vector<std::string> removed;
  for (std::int64_t step : {100, 200, 300, 400})
    removed = save<float>(folder, config, g, step, 2).removed;
  EXPECT_EQ(removed, std::vector<std::string>{"ckpt_00000200.h5"});
  if (world_rank() == 0) {
    EXPECT_EQ(files(),
              (std::vector<std::string>{"ckpt_00000300.h5", "ckpt_00000400.h5", "latest"}));
    EXPECT_EQ(read_text(folder + "/latest"), "ckpt_00000400.h5\n");
    EXPECT_EQ(ckpt::resolve_checkpoint("latest", folder), folder + "/ckpt_00000400.h5");
  }
  EXPECT_EQ(load_step("latest"), 400);
  EXPECT_EQ(load_step(folder + "/ckpt_00000300.h5"), 300);

  // A crash mid-save leaves a partial temporary file (and maybe latest.tmp): ignored by
  // 'latest', overwritten or removed by the next save.
  if (world_rank() == 0) {
    std::ofstream(folder + "/.ckpt_00000500.h5.tmp") << "half a file";
    std::ofstream(folder + "/.ckpt_00000450.h5.tmp") << "another one";
    std::ofstream(folder + "/latest.tmp") << "ckpt_00000500.h5\n";
  }
  barrier();
  EXPECT_EQ(load_step("latest"), 400);
  const auto report = save<float>(folder, config, g, 500, 2);
  EXPECT_EQ(report.removed,
            (std::vector<std::string>{".ckpt_00000450.h5.tmp", "ckpt_00000300.h5"}));
  if (world_rank() == 0) {
    EXPECT_EQ(files(),
              (std::vector<std::string>{"ckpt_00000400.h5", "ckpt_00000500.h5", "latest"}));
  }
  EXPECT_EQ(load_step("latest"), 500);

  // Restarted from an older step, the run's new file is kept whatever the steps say.
  save<float>(folder, config, g, 450, 2);
  if (world_rank() == 0) {
    EXPECT_EQ(files(),
              (std::vector<std::string>{"ckpt_00000450.h5", "ckpt_00000500.h5", "latest"}));
  }
  EXPECT_EQ(load_step("latest"), 450);

  // A pointer at a file that is gone.
  if (world_rank() == 0) std::filesystem::remove(folder + "/ckpt_00000450.h5");
  barrier();
  EXPECT_EQ(error_of([&] { load_step("latest"); }),
            folder + "/latest points at ckpt_00000450.h5, which does not exist");
  EXPECT_EQ(error_of([&] { load_step(""); }),
            "no checkpoint to restart from was named (restart is empty)");
}

// `latest` is read as one line naming a file, never as raw bytes (issue 29, defect 8): a symbolic
// link counts by the name it links to when that is a checkpoint of the folder and is refused
// otherwise; a binary file, a folder and a too long or non-ASCII name are refused or quoted
// escaped and shortened, so no message carries raw bytes or runs on. Not collective: rank 0.
TEST(CkptRestart, LatestIsReadAsANameNeverAsBytes) {
  TempDir dir;
  if (world_rank() != 0) return;
  namespace fs = std::filesystem;
  const std::string folder = dir.file("ck"), pointer = folder + "/latest";
  fs::create_directories(folder);
  fs::create_directories(dir.file("other"));
  std::string hdf5("\x89HDF\r\n\x1a\n\0\0\0\0\0\x08\x08\0", 16);
  hdf5 += std::string(4000, 'x');
  for (const std::string& f : {folder + "/ckpt_00000004.h5", dir.file("other/ckpt_00000004.h5")})
    std::ofstream(f, std::ios::binary) << hdf5;
  auto point = [&](const std::string& bytes) {
    fs::remove_all(pointer);
    std::ofstream(pointer, std::ios::binary) << bytes;
  };
  auto link = [&](const std::string& target) {
    fs::remove_all(pointer);
    fs::create_symlink(target, pointer);
  };
  auto resolved = [&] { return error_of([&] { ckpt::resolve_checkpoint("latest", folder); }); };

  link("ckpt_00000004.h5");
  EXPECT_EQ(ckpt::resolve_checkpoint("latest", folder), folder + "/ckpt_00000004.h5");
  link(folder + "/ckpt_00000004.h5");
  EXPECT_EQ(ckpt::resolve_checkpoint("latest", folder), folder + "/ckpt_00000004.h5");
  link("../ck/ckpt_00000004.h5");
  EXPECT_EQ(ckpt::resolve_checkpoint("latest", folder), folder + "/ckpt_00000004.h5");
  link("../other/ckpt_00000004.h5");
  EXPECT_EQ(resolved(), pointer +
                            " is a symbolic link to ../other/ckpt_00000004.h5, not to a "
                            "checkpoint file (ckpt_<step>.h5) of " +
                            folder + "; `latest` should be a one-line file naming one");
  link("notes\x1b[2J.txt");
  EXPECT_EQ(resolved(), pointer +
                            " is a symbolic link to notes\\x1b[2J.txt, not to a checkpoint "
                            "file (ckpt_<step>.h5) of " +
                            folder + "; `latest` should be a one-line file naming one");
  link("ckpt_00000009.h5");
  EXPECT_EQ(resolved(), pointer + " is a symbolic link to ckpt_00000009.h5, which does not exist");

  point(hdf5);  // a checkpoint copied over `latest`
  EXPECT_EQ(resolved(), pointer +
                            " is not a one-line file naming a checkpoint (it holds binary "
                            "data: '\\x89HDF\\x0d\\x0a\\x1a\\x0a\\x00\\x00\\x00\\x00\\x00"
                            "\\x08\\x08\\x00xxxxx...')");
  point("ckpt_\x1b[31m.h5\n");
  EXPECT_EQ(resolved(), pointer +
                            " is not a one-line file naming a checkpoint (it holds binary "
                            "data: 'ckpt_\\x1b[31m.h5\\x0a')");
  point(std::string(300, 'a') + "\n");
  EXPECT_EQ(resolved(),
            pointer + " points at " + std::string(80, 'a') + "..., which does not exist");
  point("ckpt_\xc3\xa9.h5\n");
  EXPECT_EQ(resolved(), pointer + " points at ckpt_\\xc3\\xa9.h5, which does not exist");
  point(std::string(5000, 'a'));
  EXPECT_EQ(resolved(), pointer +
                            " is not a one-line file naming a checkpoint (it holds a line "
                            "too long for a file name: '" +
                            std::string(60, 'a') + "...')");
  fs::remove(pointer);
  fs::create_directory(pointer);
  EXPECT_EQ(resolved(), pointer + " is a folder, not a one-line file naming a checkpoint");
  fs::remove(pointer);
  point("  ckpt_00000004.h5 \r\n");
  EXPECT_EQ(ckpt::resolve_checkpoint("latest", folder), folder + "/ckpt_00000004.h5");
}

TEST(CkptRestart, RefusesBadFilesAlikeOnEveryRankWithoutTouchingBuffers) {
  TempDir dir;
  const auto g = dense_decompositions().back();
  const auto config = small_model(50, false);
  auto load = [&](const std::string& path, const Config& c, bool moments = true) {
    auto part = make_part<float>(c, g, false, moments);
    const std::string e = error_of([&] {
      ckpt::load_checkpoint<float>(path, dir.path(), MPI_COMM_WORLD, part.chunks, part.out(),
                                   holder(c, g, world_rank()));
    });
    EXPECT_TRUE(all_junk(part)) << "buffers changed by a failed load of " << path;
    return e;
  };
  auto saved = [&](const std::string& name, const Config& c, bool moments = true) {
    const auto r = save<float>(dir.file(name), c, g, 3, 3, moments);
    return r.path;
  };

  const std::string missing = dir.file("missing.h5");
  EXPECT_EQ(load(missing, config), missing + ": cannot open: No such file or directory");

  // One flipped bit in the raw bytes of one moment element, then of the step.
  const std::string corrupt = saved("corrupt", config);
  const std::string copy = dir.file("corrupt_state.h5");
  if (world_rank() == 0) std::filesystem::copy_file(corrupt, copy);
  barrier();
  flip_bit(corrupt, "/optim/m/h.1.mlp.fc.weight", 37, 4);
  EXPECT_EQ(load(corrupt, config),
            corrupt + ": /optim/m/h.1.mlp.fc.weight checksum mismatch: the data is corrupted");
  flip_bit(copy, "/state/step", 0, 8);
  EXPECT_EQ(load(copy, config), copy + ": /state/step checksum mismatch: the data is corrupted");
  if (world_rank() == 0 && have_python_tools()) {
    std::string out;
    EXPECT_NE(run_command(ckpt_tool() + " verify " + corrupt, &out), 0) << out;
    EXPECT_NE(out.find("/optim/m/h.1.mlp.fc.weight"), std::string::npos) << out;
    EXPECT_NE(run_command(ckpt_tool() + " verify " + copy, &out), 0) << out;
    EXPECT_NE(out.find("/state/step"), std::string::npos) << out;
  }

  // The data's fields (an even step keeps them): a 1-d array, checked as ckpt_tool checks it.
  const std::string with_data = save<float>(dir.file("data"), config, g, 4).path;
  if (world_rank() == 0 && have_python_tools()) {
    std::string out;
    EXPECT_EQ(run_command(ckpt_tool() + " verify " + with_data, &out), 0) << out;
    EXPECT_EQ(run_command(ckpt_tool() + " list " + with_data, &out), 0) << out;
    EXPECT_NE(out.find("state.dataset_samples   [130, 0, 3]"), std::string::npos) << out;
  }
  flip_bit(with_data, "/state/dataset_samples", 2, 8);
  EXPECT_EQ(load(with_data, config),
            with_data + ": /state/dataset_samples checksum mismatch: the data is corrupted");

  const std::string cut = saved("cut", config);
  if (world_rank() == 0) {
    EXPECT_EQ(truncate(cut.c_str(), static_cast<off_t>(std::filesystem::file_size(cut) / 2)), 0);
  }
  barrier();
  const std::string e = load(cut, config);
  EXPECT_EQ(e.rfind(cut + ": HDF5 cannot read it (truncated or damaged file): ", 0), 0u) << e;

  // Another model: narrower, deeper.
  const std::string narrow = saved("narrow", small_model(50, false, 4, 8));
  EXPECT_EQ(load(narrow, config),
            narrow + ": /model/h.0.attn.proj.bias has shape (8), the model needs (16)");
  if (4 % (g.P * g.V) == 0 && 8 % (g.P * g.V) == 0) {
    const std::string deep = saved("deep", small_model(50, false, 8));
    EXPECT_EQ(load(deep, config), deep +
                                      ": /model/h.4.attn.proj.bias is not a tensor of this "
                                      "model (the checkpoint is of another model)");
  }

  // Format versions: a weights file, and a version from the future.
  const std::string weights = dir.file("weights.h5");
  {
    // The weights writer takes whole chunks: every rank's full parameter buffer.
    const Decomp whole{g.T, g.P, g.V, g.E, Own::replicated};
    auto full = make_part<float>(config, whole, true, false);
    std::vector<const float*> data;
    for (const auto& d : full.data[0]) data.push_back(d.data());
    const auto h = holder(config, whole, world_rank());
    ckpt::save_weights<float>(weights, MPI_COMM_WORLD, full.chunks, data,
                              [&](const TensorSpec& t) { return !t.tied_copy && h(t); }, {});
  }
  EXPECT_EQ(load(weights, config),
            weights +
                ": is a weights file (format_version 1: parameters only), not a training "
                "checkpoint; start from it with model%init_from instead");
  const std::string future = saved("future", config);
  if (world_rank() == 0) {
    hid_t f = H5Fopen(future.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    EXPECT_GE(H5Adelete(f, "format_version"), 0);
    hid_t type = H5Tcopy(H5T_C_S1);
    H5Tset_size(type, 1);
    hid_t space = H5Screate(H5S_SCALAR);
    hid_t attr = H5Acreate2(f, "format_version", type, space, H5P_DEFAULT, H5P_DEFAULT);
    EXPECT_GE(H5Awrite(attr, type, "3"), 0);
    H5Aclose(attr);
    H5Sclose(space);
    H5Tclose(type);
    H5Fclose(f);
  }
  barrier();
  EXPECT_EQ(load(future, config), future +
                                      ": format_version 3 is not supported (this ptrain "
                                      "reads checkpoints of format_version 2)");

  // Optimizers with and without moments do not mix.
  const std::string adamw = saved("adamw", config);
  EXPECT_EQ(load(adamw, config, false),
            adamw +
                ": holds optimizer moments (/optim/m, /optim/v) but this run's optimizer "
                "keeps none (SGD); restart with the optimizer that wrote it (AdamW)");
  const std::string sgd = saved("sgd", config, false);
  EXPECT_EQ(load(sgd, config, true),
            sgd +
                ": holds no optimizer moments (written by an optimizer without them, SGD) "
                "but this run's optimizer needs m and v (AdamW)");
  {  // ... but an SGD run restarts from it, and init_from reads a checkpoint's /model.
    auto part = make_part<float>(config, g, false, false);
    ckpt::load_checkpoint<float>(sgd, "", MPI_COMM_WORLD, part.chunks, part.out(),
                                 holder(config, g, world_rank()));
    EXPECT_EQ(count_wrong(part, "sgd"), 0);
  }
  if (g.own != Own::zero) {
    const Decomp whole{g.T, g.P, g.V, g.E, Own::replicated};
    auto part = make_part<float>(config, whole, false, false);
    std::vector<float*> data;
    for (auto& d : part.data[0]) data.push_back(d.data());
    const auto h = holder(config, whole, world_rank());
    ckpt::load_weights<float>(adamw, MPI_COMM_WORLD, part.chunks, data,
                              [&](const TensorSpec& t) { return !t.tied_copy && h(t); });
    EXPECT_EQ(count_wrong(part, "init_from a checkpoint"), 0);
  }
  // Nothing half-done stops a correct load afterwards.
  auto part = make_part<float>(config, g, false);
  ckpt::load_checkpoint<float>(adamw, "", MPI_COMM_WORLD, part.chunks, part.out(),
                               holder(config, g, world_rank()));
  EXPECT_EQ(count_wrong(part, "after the refusals"), 0);
}

TEST(CkptRestart, RefusesOwnershipThatMissesOrRepeatsElements) {
  TempDir dir;
  const auto config = small_model(50, false);
  Decomp g{1, 1, 1, 1, Own::zero};
  auto part = make_part<double>(config, g, true);
  auto bad_save = [&](const ckpt::TensorPredicate& h, int keep = 3) {
    return error_of([&] {
      ckpt::save_checkpoint<double>(dir.path(), MPI_COMM_WORLD, part.chunks, part.in(), h,
                                    some_state(1), kAttrs, keep);
    });
  };
  const auto h = holder(config, g, world_rank());
  auto no_wpe = [&](const TensorSpec& t) { return t.name != "wpe.weight" && h(t); };
  const std::string e = bad_save(no_wpe);
  EXPECT_NE(e.find("the ranks chosen to write /model/wpe.weight hold 0 of its 128 elements"),
            std::string::npos)
      << e;
  EXPECT_NE(bad_save(h).find("(no error)"), std::string::npos);
  if (world_size() > 1) {
    // Everyone owning everything as holder: replicas would write twice.
    Decomp r{1, 1, 1, 1, Own::replicated};
    auto everyone = make_part<double>(config, r, true);
    const std::string twice = error_of([&] {
      ckpt::save_checkpoint<double>(
          dir.path(), MPI_COMM_WORLD, everyone.chunks, everyone.in(),
          [](const TensorSpec&) { return true; }, some_state(2), kAttrs, 3);
    });
    EXPECT_NE(twice.find("must choose each element exactly once"), std::string::npos) << twice;
    auto attrs = kAttrs;
    attrs["grid"] = cat(world_rank());
    const std::string differ = error_of([&] {
      ckpt::save_checkpoint<double>(dir.path(), MPI_COMM_WORLD, part.chunks, part.in(), h,
                                    some_state(2), attrs, 3);
    });
    EXPECT_NE(differ.find("the attributes differ between ranks"), std::string::npos) << differ;
  }
  // Only the good save is in the folder.
  if (world_rank() == 0) {
    EXPECT_EQ(read_text(dir.file("latest")), "ckpt_00000001.h5\n");
  }
}
