// ptrain-test: np=1,2,4 labels=quick timeout=120
// Weights checkpoints: written by one decomposition of the model, read back by every other
// (tp, pp, virtual stages, ep, data-parallel replicas), element by element against a known
// function of (tensor, global index); the file's shapes and checksums read independently
// with plain HDF5 and h5dump; and every refused file refused alike on all ranks.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "ckpt/weights.hpp"
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

// A decomposition of the model over the world: tp fastest, then pp, then ep, then replicas.
struct Decomp {
  int T = 1, P = 1, V = 1, E = 1;
  std::string label() const { return cat("tp", T, "_pp", P, "_vs", V, "_ep", E); }
};

// The decompositions this world size can hold (the model has 4 heads, 4 layers, 4 experts).
std::vector<Decomp> decompositions() {
  switch (world_size()) {
    case 1:
      return {{1, 1, 1, 1}, {1, 1, 2, 1}};
    case 2:
      return {{2, 1, 1, 1}, {1, 2, 1, 1}, {1, 1, 2, 1}, {1, 1, 1, 2}, {1, 1, 1, 1}};
    case 4:
      return {{2, 1, 1, 1}, {2, 2, 1, 1}, {4, 1, 1, 1}, {1, 2, 2, 1},
              {2, 1, 1, 2}, {1, 1, 1, 1}, {1, 1, 1, 4}};
    default:
      return {{1, 1, 1, 1}};
  }
}

std::int64_t product(const Shape& s) {
  std::int64_t n = 1;
  for (auto x : s) n *= x;
  return n;
}
std::int64_t slab_elements(const TensorSpec& t) {
  std::int64_t n = 0;
  for (const auto& s : t.slabs) n += s.numel();
  return n;
}

// Exactly one holder of every element: the first replica, never the tied copy, and t == 0
// (e == 0) for tensors whose blocks do not depend on t (e), found by building the layout
// at t = 0 (e = 0).
ckpt::TensorPredicate primary(const Config& config, const Decomp& g, int rank) {
  const Place pl = place(g, rank);
  model::ShardCoord t0 = pl.coord, e0 = pl.coord;
  t0.t = 0;
  e0.e = 0;
  const Config c = with_decomp(config, g);
  return [pl, at_t0 = blocks_at(c, t0), at_e0 = blocks_at(c, e0)](const TensorSpec& s) {
    if (pl.d != 0 || s.tied_copy) return false;
    const bool split_t = !same_blocks(s.slabs, at_t0.at(s.name));
    const bool split_e = !same_blocks(s.slabs, at_e0.at(s.name));
    return (pl.coord.t == 0 || split_t) && (pl.coord.e == 0 || split_e);
  };
}

// The known content: exact in float (multiples of 1/8 below 2^10), distinct inside a tensor.
double value(const std::string& name, std::int64_t i) {
  std::uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ULL;
  return static_cast<double>(h % 1000) / 8.0 + static_cast<double>(i % 4093) * 0.125 - 300.0;
}

// Global row-major index of element k (row-major inside the slab) of slab s.

constexpr double kJunk = -7777.0;

// One rank's part of the model and its flat buffers.
template <class T>
struct Part {
  std::vector<ChunkLayout> chunks;
  std::vector<std::vector<T>> data;
  std::vector<const T*> in() const {
    std::vector<const T*> p;
    for (const auto& d : data) p.push_back(d.data());
    return p;
  }
  std::vector<T*> out() {
    std::vector<T*> p;
    for (auto& d : data) p.push_back(d.data());
    return p;
  }
};

// Slab elements = value(name, index) + shift; padding and everything else junk.
template <class T>
Part<T> make_part(const Config& c, const Decomp& g, bool fill, double shift = 0) {
  Part<T> part;
  part.chunks = model::build_layout(with_decomp(c, g), place(g, world_rank()).coord);
  for (const auto& chunk : part.chunks) {
    std::vector<T> d(static_cast<std::size_t>(chunk.numel), T(kJunk));
    if (fill)
      for (const auto& t : chunk.tensors) {
        std::int64_t k = t.offset;
        for (const auto& s : t.slabs)
          for (std::int64_t j = 0; j < s.numel(); ++j)
            d[static_cast<std::size_t>(k++)] =
                static_cast<T>(value(t.name, global_index(t.global_shape, s, j)) + shift);
      }
    part.data.push_back(std::move(d));
  }
  return part;
}

// Every slab element equals the known content (converted through the file's type F), the
// padding is zero. Returns the number of wrong elements (first few reported).
template <class T, class F = T>
int count_wrong(const Part<T>& part, const std::string& where, double shift = 0) {
  int wrong = 0;
  for (std::size_t c = 0; c < part.chunks.size(); ++c)
    for (const auto& t : part.chunks[c].tensors) {
      std::int64_t k = t.offset;
      for (const auto& s : t.slabs)
        for (std::int64_t j = 0; j < s.numel(); ++j, ++k) {
          const T want = static_cast<T>(
              static_cast<F>(value(t.name, global_index(t.global_shape, s, j)) + shift));
          if (part.data[c][static_cast<std::size_t>(k)] != want && wrong++ < 3)
            ADD_FAILURE() << where << ": " << t.name << " element " << j << " of a slab is "
                          << part.data[c][static_cast<std::size_t>(k)] << ", want " << want;
        }
      for (; k < t.offset + t.numel; ++k)
        if (part.data[c][static_cast<std::size_t>(k)] != T(0) && wrong++ < 3)
          ADD_FAILURE() << where << ": " << t.name << " padding element is not zero";
    }
  return wrong;
}

template <class T>
bool all_junk(const Part<T>& part) {
  for (const auto& d : part.data)
    for (T x : d)
      if (x != T(kJunk)) return false;
  return true;
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

// The documented checksum, written again from its definition (weights.hpp).
std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
template <class T>
std::uint64_t documented_checksum(const std::vector<T>& x) {
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &x[i], sizeof(T));
    sum += mix64(mix64(i + 0x9e3779b97f4a7c15ULL) ^ bits);
  }
  return sum;
}

// Writes with each decomposition and reads with every decomposition.
template <class T>
void reshard_round_trips(const Config& config, const std::string& model_name) {
  TempDir dir;
  const auto decomps = decompositions();
  for (const auto& w : decomps) {
    const std::string path = dir.file(model_name + "_" + w.label() + ".h5");
    {
      auto part = make_part<T>(config, w, true);
      ckpt::save_weights<T>(path, MPI_COMM_WORLD, part.chunks, part.in(),
                            primary(config, w, world_rank()), {{"grid", w.label()}});
    }
    for (const auto& r : decomps) {
      auto part = make_part<T>(config, r, false);
      ckpt::LoadReport report;
      ckpt::load_weights<T>(path, MPI_COMM_WORLD, part.chunks, part.out(),
                            primary(config, r, world_rank()), &report);
      const std::string where = cat(model_name, " written ", w.label(), ", read ", r.label());
      EXPECT_EQ(count_wrong(part, where), 0) << where;
      EXPECT_EQ(report.file_dtype, sizeof(T) == 4 ? "fp32" : "fp64");
      EXPECT_TRUE(report.ignored.empty());
      EXPECT_EQ(report.attributes["grid"], w.label());
      std::int64_t want_read = 0;
      std::vector<std::string> seen;
      for (const auto& chunk : part.chunks)
        for (const auto& t : chunk.tensors)
          if (std::find(seen.begin(), seen.end(), t.name) == seen.end()) {
            seen.push_back(t.name);
            want_read += slab_elements(t);
          }
      EXPECT_EQ(report.elements_read, want_read) << where;
    }
  }
}

}  // namespace

TEST(CkptWeights, DenseModelReshardsFp64) {
  reshard_round_trips<double>(small_model(50, false), "dense");
}

TEST(CkptWeights, MoeModelWithEmptyVocabSlabReshardsFp32) {
  // vocab 9 over tp 4: rows 3 per rank, the last rank holds none of the real ones.
  reshard_round_trips<float>(small_model(9, true), "moe");
}

TEST(CkptWeights, ConvertsPrecisionOnLoad) {
  TempDir dir;
  const auto g = decompositions().front();
  const auto config = small_model(50, true);
  const double shift = 1.0 / 3.0 / 4096.0;  // not representable in float
  const std::string path = dir.file("fp64.h5");
  auto src = make_part<double>(config, g, true, shift);
  ckpt::save_weights<double>(path, MPI_COMM_WORLD, src.chunks, src.in(),
                             primary(config, g, world_rank()), {});
  auto dst = make_part<float>(config, decompositions().back(), false);
  ckpt::LoadReport report;
  ckpt::load_weights<float>(path, MPI_COMM_WORLD, dst.chunks, dst.out(),
                            primary(config, decompositions().back(), world_rank()), &report);
  EXPECT_EQ((count_wrong<float, double>(dst, "fp64 -> fp32", shift)), 0);
  EXPECT_EQ(report.file_dtype, "fp64");

  const std::string path32 = dir.file("fp32.h5");
  auto src32 = make_part<float>(config, g, true);
  ckpt::save_weights<float>(path32, MPI_COMM_WORLD, src32.chunks, src32.in(),
                            primary(config, g, world_rank()), {});
  auto dst64 = make_part<double>(config, g, false);
  ckpt::load_weights<double>(path32, MPI_COMM_WORLD, dst64.chunks, dst64.out(),
                             primary(config, g, world_rank()), &report);
  EXPECT_EQ((count_wrong<double, float>(dst64, "fp32 -> fp64")), 0);
  EXPECT_EQ(report.file_dtype, "fp32");
}

TEST(CkptWeights, FileHoldsGlobalTensorsChecksumsAndAttributes) {
  TempDir dir;
  const auto g = decompositions().back();  // the most sharded, or replicas
  const auto config = small_model(50, true);
  const std::string path = dir.file("global.h5");
  const std::string deck = "&model\n  d_model = 16\n/\n" + std::string(100000, 'x');  // > 64 KiB
  auto part = make_part<float>(config, g, true);
  ckpt::save_weights<float>(path, MPI_COMM_WORLD, part.chunks, part.in(),
                            primary(config, g, world_rank()),
                            {{"deck", deck}, {"ptrain_version", "0.1.0"}, {"empty", ""}});
  EXPECT_EQ(ckpt::read_string_attribute(path, "format_version"), "1");
  EXPECT_EQ(ckpt::read_string_attribute(path, "deck"), deck);
  EXPECT_EQ(ckpt::read_string_attribute(path, "ptrain_version"), "0.1.0");
  EXPECT_EQ(ckpt::read_string_attribute(path, "empty"), "");
  EXPECT_NE(error_of([&] { ckpt::read_string_attribute(path, "nope"); }).find("no attribute"),
            std::string::npos);

  if (world_rank() == 0) {
    // Every tensor of the one-rank model, read whole with plain serial HDF5.
    const auto whole = model::build_layout(config, model::ShardCoord{});
    int n_tensors = 0;
    for (const auto& chunk : whole)
      for (const auto& t : chunk.tensors) {
        ++n_tensors;
        const std::string name = "/model/" + t.name;
        hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
        ASSERT_GE(f, 0);
        hid_t ds = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
        ASSERT_GE(ds, 0) << name;
        hid_t space = H5Dget_space(ds);
        std::vector<hsize_t> dims(static_cast<std::size_t>(H5Sget_simple_extent_ndims(space)));
        H5Sget_simple_extent_dims(space, dims.data(), nullptr);
        EXPECT_EQ(Shape(dims.begin(), dims.end()), t.global_shape) << name;
        hid_t type = H5Dget_type(ds);
        EXPECT_EQ(H5Tget_class(type), H5T_FLOAT);
        EXPECT_EQ(H5Tget_size(type), 4u);
        std::vector<float> x(static_cast<std::size_t>(product(t.global_shape)));
        EXPECT_GE(H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, x.data()), 0);
        int wrong = 0;
        for (std::size_t i = 0; i < x.size(); ++i)
          wrong += x[i] != static_cast<float>(value(t.name, static_cast<std::int64_t>(i)));
        EXPECT_EQ(wrong, 0) << name;
        std::uint64_t stored = 0;
        hid_t attr = H5Aopen(ds, "checksum", H5P_DEFAULT);
        EXPECT_GE(H5Aread(attr, H5T_NATIVE_UINT64, &stored), 0);
        EXPECT_EQ(stored, documented_checksum(x)) << name;
        EXPECT_EQ(stored, ckpt::tensor_checksum(x.data(), static_cast<std::int64_t>(x.size())));
        H5Aclose(attr);
        H5Tclose(type);
        H5Sclose(space);
        H5Dclose(ds);
        H5Fclose(f);
      }
    // h5dump lists exactly these datasets at their global shapes.
    if (access("/usr/bin/h5dump", X_OK) == 0) {
      std::string out;
      if (FILE* p = popen(("/usr/bin/h5dump -H " + path).c_str(), "r")) {
        char buf[4096];
        while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
        EXPECT_EQ(pclose(p), 0);
      }
      int n_datasets = 0;
      for (std::size_t at = 0; (at = out.find("DATASET \"", at)) != std::string::npos; ++at)
        ++n_datasets;
      EXPECT_EQ(n_datasets, n_tensors);
      auto qkv = out.find("DATASET \"h.0.attn.qkv.weight\"");
      ASSERT_NE(qkv, std::string::npos) << out.substr(0, 2000);
      EXPECT_EQ(out.find("DATASPACE  SIMPLE { ( 48, 16 ) / ( 48, 16 ) }", qkv),
                out.find("DATASPACE", qkv));
      auto fc = out.find("DATASET \"h.1.moe.fc.weight\"");
      ASSERT_NE(fc, std::string::npos);
      EXPECT_EQ(out.find("DATASPACE  SIMPLE { ( 4, 32, 16 ) / ( 4, 32, 16 ) }", fc),
                out.find("DATASPACE", fc));
      auto wte = out.find("DATASET \"wte.weight\"");
      ASSERT_NE(wte, std::string::npos);
      EXPECT_EQ(out.find("DATASPACE  SIMPLE { ( 50, 16 ) / ( 50, 16 ) }", wte),
                out.find("DATASPACE", wte));
    }
  }
}

TEST(CkptWeights, RefusesBadFilesAlikeOnEveryRankWithoutTouchingBuffers) {
  TempDir dir;
  const auto g = decompositions().back();
  const auto config = small_model(50, false);
  auto load = [&](const std::string& path, const Config& c) {
    auto part = make_part<float>(c, g, false);
    const std::string e = error_of([&] {
      ckpt::load_weights<float>(path, MPI_COMM_WORLD, part.chunks, part.out(),
                                primary(c, g, world_rank()));
    });
    EXPECT_TRUE(all_junk(part)) << "buffers changed by a failed load of " << path;
    return e;
  };
  auto save = [&](const std::string& path, const Config& c) {
    auto part = make_part<float>(c, g, true);
    ckpt::save_weights<float>(path, MPI_COMM_WORLD, part.chunks, part.in(),
                              primary(c, g, world_rank()), {});
  };

  const std::string missing = dir.file("missing.h5");
  EXPECT_EQ(load(missing, config), missing + ": cannot open: No such file or directory");

  const std::string text = dir.file("text.h5");
  if (world_rank() == 0) std::ofstream(text) << "not an HDF5 file at all\n";
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_EQ(load(text, config), text + ": not an HDF5 file");

  const std::string narrow = dir.file("narrow.h5");
  save(narrow, small_model(50, false, 4, 8));
  EXPECT_EQ(load(narrow, config),
            narrow + ": /model/h.0.attn.proj.bias has shape (8), the model needs (16)");

  const std::string shallow = dir.file("shallow.h5");
  save(shallow, small_model(50, false, 2));
  EXPECT_EQ(load(shallow, config),
            shallow + ": no dataset /model/h.2.attn.proj.bias (the model needs shape (16))");

  // Extra datasets are ignored: the 2-layer model loads from the 4-layer file.
  const std::string deep = dir.file("deep.h5");
  save(deep, config);
  if (4 % (g.P * g.V) == 0 && 2 % (g.P * g.V) == 0) {
    const auto two = small_model(50, false, 2);
    auto part = make_part<float>(two, g, false);
    ckpt::LoadReport report;
    ckpt::load_weights<float>(deep, MPI_COMM_WORLD, part.chunks, part.out(),
                              primary(two, g, world_rank()), &report);
    EXPECT_EQ(count_wrong(part, "2 layers from 4"), 0);
    EXPECT_EQ(report.ignored.size(), 24u);  // 12 tensors in each of blocks 2 and 3
  }

  // One flipped bit in the raw bytes of one element.
  const std::string corrupt = dir.file("corrupt.h5");
  save(corrupt, config);
  if (world_rank() == 0) {
    hid_t f = H5Fopen(corrupt.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t ds = H5Dopen2(f, "/model/h.1.mlp.fc.weight", H5P_DEFAULT);
    const haddr_t offset = H5Dget_offset(ds);
    H5Dclose(ds);
    H5Fclose(f);
    ASSERT_NE(offset, HADDR_UNDEF);
    std::fstream io(corrupt, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(offset + 4 * 37));
    char byte = 0;
    io.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    io.seekp(static_cast<std::streamoff>(offset + 4 * 37));
    io.write(&byte, 1);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_EQ(load(corrupt, config),
            corrupt + ": /model/h.1.mlp.fc.weight checksum mismatch: the data is corrupted");

  const std::string cut = dir.file("cut.h5");
  save(cut, config);
  if (world_rank() == 0) {
    const auto size = std::filesystem::file_size(cut);
    ASSERT_EQ(truncate(cut.c_str(), static_cast<off_t>(size / 2)), 0);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string e = load(cut, config);
  EXPECT_EQ(e.rfind(cut + ": HDF5 cannot read it (truncated or damaged file): ", 0), 0u) << e;
  EXPECT_NE(e.find("truncated file"), std::string::npos) << e;

  EXPECT_NE(load(dir.file(""), config).find("is a folder"), std::string::npos);
}

TEST(CkptWeights, RefusesInconsistentWrites) {
  TempDir dir;
  const auto g = decompositions().front();
  const auto config = small_model(50, false);
  auto part = make_part<double>(config, g, true);
  auto save = [&](const std::string& path, const ckpt::TensorPredicate& writes,
                  const std::map<std::string, std::string>& attrs) {
    return error_of([&] {
      ckpt::save_weights<double>(path, MPI_COMM_WORLD, part.chunks, part.in(), writes, attrs);
    });
  };
  const auto pred = primary(config, g, world_rank());

  const std::string nowhere = dir.file("no/such/folder.h5");
  EXPECT_EQ(save(nowhere, pred, {}),
            nowhere + ": cannot create: folder " + dir.file("no/such") + " does not exist");

  auto no_ln_f = [&](const TensorSpec& s) { return s.name != "ln_f.bias" && pred(s); };
  EXPECT_EQ(save(dir.file("a.h5"), no_ln_f, {}),
            cat("save_weights ", dir.file("a.h5"), ": ln_f.bias: no rank is chosen to write it"));

  EXPECT_NE(save(dir.file("b.h5"), pred, {{"format_version", "2"}}).find("is reserved"),
            std::string::npos);

  if (world_size() > 1) {
    // Every rank writes tensors held whole: replicas would write them twice.
    auto everyone = [&](const TensorSpec& s) { return !s.tied_copy; };
    const std::string e = save(dir.file("c.h5"), everyone, {});
    EXPECT_NE(e.find("the predicate must choose each element exactly once"), std::string::npos)
        << e;
    EXPECT_NE(save(dir.file("d.h5"), pred, {{"grid", cat(world_rank())}})
                  .find("the attributes differ between ranks"),
              std::string::npos);
  }
  // Nothing half-done stops a correct save afterwards.
  EXPECT_EQ(save(dir.file("ok.h5"), pred, {}), "(no error)");
}

TEST(CkptWeights, BlocksOutOfRowOrderAreMovedOneByOne) {
  // Hand-made layouts whose slabs cannot be one row-major hyperslab union: rank r holds
  // column blocks r and 2R-1-r of x (6, 2R), and row blocks 2R-1-r then r of y (4R, 3),
  // followed by 5 padding elements. Read back whole on every rank.
  TempDir dir;
  const std::int64_t R = world_size(), r = world_rank();
  auto tensor = [](std::string name, Shape global, std::vector<Slab> slabs, std::int64_t pad,
                   std::int64_t offset) {
    TensorSpec t;
    t.name = std::move(name);
    t.global_shape = std::move(global);
    t.slabs = std::move(slabs);
    t.numel = slab_elements(t) + pad;
    t.local_shape = {t.numel};
    t.offset = offset;
    return t;
  };
  ChunkLayout zigzag;
  zigzag.tensors.push_back(
      tensor("x", {6, 2 * R}, {Slab{{0, r}, {6, 1}}, Slab{{0, 2 * R - 1 - r}, {6, 1}}}, 0, 0));
  zigzag.tensors.push_back(
      tensor("y", {4 * R, 3}, {Slab{{2 * (2 * R - 1 - r), 0}, {2, 3}}, Slab{{2 * r, 0}, {2, 3}}}, 5,
             zigzag.tensors[0].numel));
  zigzag.numel = zigzag.tensors[0].numel + zigzag.tensors[1].numel;
  ChunkLayout whole;
  whole.tensors.push_back(tensor("x", {6, 2 * R}, {Slab{{0, 0}, {6, 2 * R}}}, 0, 0));
  whole.tensors.push_back(tensor("y", {4 * R, 3}, {Slab{{0, 0}, {4 * R, 3}}}, 5, 12 * R));
  whole.numel = 12 * R + 12 * R + 5;

  auto fill = [](const ChunkLayout& chunk) {
    Part<double> part;
    part.chunks = {chunk};
    part.data.emplace_back(static_cast<std::size_t>(chunk.numel), kJunk);
    for (const auto& t : chunk.tensors) {
      std::int64_t k = t.offset;
      for (const auto& s : t.slabs)
        for (std::int64_t j = 0; j < s.numel(); ++j)
          part.data[0][static_cast<std::size_t>(k++)] =
              value(t.name, global_index(t.global_shape, s, j));
    }
    return part;
  };
  auto everyone = [](const TensorSpec&) { return true; };
  auto rank0 = [r](const TensorSpec&) { return r == 0; };
  const std::string path = dir.file("zigzag.h5");
  auto src = fill(zigzag);
  ckpt::save_weights<double>(path, MPI_COMM_WORLD, src.chunks, src.in(), everyone, {});
  Part<double> dst{{whole}, {std::vector<double>(static_cast<std::size_t>(whole.numel), kJunk)}};
  ckpt::load_weights<double>(path, MPI_COMM_WORLD, dst.chunks, dst.out(), rank0);
  EXPECT_EQ(count_wrong(dst, "zigzag -> whole"), 0);
  Part<double> back{{zigzag}, {std::vector<double>(static_cast<std::size_t>(zigzag.numel), kJunk)}};
  ckpt::load_weights<double>(path, MPI_COMM_WORLD, back.chunks, back.out(), everyone);
  EXPECT_EQ(count_wrong(back, "zigzag -> zigzag"), 0);
}
