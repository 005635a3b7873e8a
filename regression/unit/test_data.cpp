// ptrain-test: np=1,2 labels=quick timeout=120
// Data module: the counter-based rng, layout-invariant sampling, the three sources, errors.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "data/data.hpp"
#include "data/rng.hpp"
#include "test_support.hpp"
#include "util/error.hpp"

using namespace ptrain;
using namespace ptrain::data;

using ptrain::test::world_rank;
using ptrain::test::world_size;

namespace {

// A file under /tmp private to this rank and process, removed at scope exit.
class TempFile {
 public:
  explicit TempFile(const std::string& tag)
      : path_(cat("/tmp/ptrain_test_data_", ::getpid(), "_r", world_rank(), "_", tag)) {}
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }
  void write(const std::vector<unsigned char>& bytes) const {
    std::ofstream f(path_, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    ASSERT_TRUE(f.good()) << path_;
  }

 private:
  std::string path_;
};

// Deterministic "random" bytes (the same on every rank).
std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<unsigned char> b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = (unsigned char)(rng::draw(seed, 99, i) & 0xFF);
  return b;
}

void put_i32(std::vector<unsigned char>& out, std::int32_t v) {
  const auto u = std::uint32_t(v);
  for (int k = 0; k < 4; ++k) out.push_back((unsigned char)((u >> (8 * k)) & 0xFF));
}

// An llm.c token file image: header (magic, version, count), then little-endian uint16.
std::vector<unsigned char> u16_image(const std::vector<std::uint16_t>& tokens,
                                     std::int32_t magic = 20240520, std::int32_t version = 1,
                                     std::int64_t count = -1) {
  std::vector<unsigned char> out;
  put_i32(out, magic);
  put_i32(out, version);
  put_i32(out, std::int32_t(count < 0 ? std::int64_t(tokens.size()) : count));
  out.resize(1024, 0);
  for (std::uint16_t t : tokens) {
    out.push_back((unsigned char)(t & 0xFF));
    out.push_back((unsigned char)(t >> 8));
  }
  return out;
}

std::vector<std::uint16_t> random_tokens(std::size_t n, std::uint64_t vocab, std::uint64_t seed) {
  std::vector<std::uint16_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = std::uint16_t(rng::below(vocab, seed, 77, i));
  return t;
}

DataSpec spec(const std::string& source, const std::string& path, std::int64_t vocab,
              std::int64_t seq_len, double val_fraction = 0.1, std::uint64_t seed = 1234,
              const std::string& order = "epochs") {
  DataSpec s;
  s.source = source;
  if (!path.empty()) s.paths = {path};
  s.weights = {1.0};
  s.order = order;
  s.vocab = vocab;
  s.seq_len = seq_len;
  s.seed = seed;
  s.val_fraction = val_fraction;
  return s;
}

constexpr std::int64_t kBatch = 64;  // the global batch of the tests' steps

// The draws of training step `step`'s global batch, `batch` samples a step from the start.
std::vector<Draw> step_draws(const TokenSource& src, std::int64_t step,
                             std::int64_t batch = kBatch) {
  Position at = position_after(src, step * batch);
  return take(src, at, step, batch);
}

// Validation samples [0, count) of dataset d.
std::vector<Draw> val_draws(std::int64_t count, int d = 0) {
  std::vector<Draw> out;
  for (std::int64_t i = 0; i < count; ++i) out.push_back(Draw{0, i, d, 0});
  return out;
}

// Samples [first, first+count) of training step `step` or of the validation set, by fetch.
void fetch_samples(const TokenSource& src, Split split, std::int64_t step, std::int64_t first,
                   std::int64_t count, std::int32_t* in, std::int32_t* tg) {
  const auto draws = split == Split::train ? step_draws(src, step, std::max(kBatch, first + count))
                                           : val_draws(first + count);
  fetch(src, split, draws.data() + first, count, in, tg);
}

// The full seq_len+1 token windows of samples [first, first+count), from fetch.
std::vector<std::vector<std::int32_t>> windows(const TokenSource& src, Split split,
                                               std::int64_t step, std::int64_t first,
                                               std::int64_t count) {
  const std::size_t T = std::size_t(src.spec().seq_len);
  std::vector<std::int32_t> in(std::size_t(count) * T), tg(std::size_t(count) * T);
  fetch_samples(src, split, step, first, count, in.data(), tg.data());
  std::vector<std::vector<std::int32_t>> out;
  for (std::size_t s = 0; s < std::size_t(count); ++s) {
    for (std::size_t t = 1; t < T; ++t)
      EXPECT_EQ(in[s * T + t], tg[s * T + t - 1]) << "targets are inputs shifted by one";
    std::vector<std::int32_t> w(in.begin() + long(s * T), in.begin() + long((s + 1) * T));
    w.push_back(tg[s * T + T - 1]);
    out.push_back(w);
  }
  return out;
}

// All positions where `w` occurs in `tokens`.
template <class Tok>
std::vector<std::int64_t> occurrences(const std::vector<Tok>& tokens,
                                      const std::vector<std::int32_t>& w) {
  std::vector<std::int64_t> at;
  for (std::size_t p = 0; p + w.size() <= tokens.size(); ++p) {
    std::size_t k = 0;
    while (k < w.size() && std::int32_t(tokens[p + k]) == w[k]) ++k;
    if (k == w.size()) at.push_back(std::int64_t(p));
  }
  return at;
}

// Expects open_source(s) to throw one line containing every piece of `needles`.
void expect_open_error(const DataSpec& s, const std::vector<std::string>& needles) {
  try {
    auto src = open_source(s);
    ADD_FAILURE() << "no error for source " << s.source << " path "
                  << (s.paths.empty() ? "" : s.paths[0]);
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_EQ(e.exit_code(), kExitInput) << msg;  // the user's data: exit code 2
    for (const auto& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << msg << "\n  lacks: " << n;
  }
}

// Sources used by the invariance tests: one of each kind, backed by this rank's files.
struct Sources {
  TempFile bytes_file{"inv.bin"}, u16_file{"inv.u16"};
  std::vector<std::unique_ptr<TokenSource>> all;
  Sources() {
    bytes_file.write(random_bytes(20000, 5));
    u16_file.write(u16_image(random_tokens(20000, 3000, 6)));
    all.push_back(open_source(spec("synthetic", "", 50, 24)));
    all.push_back(open_source(spec("bytes", bytes_file.path(), 256, 24)));
    all.push_back(open_source(spec("u16", u16_file.path(), 3000, 24)));
  }
};

}  // namespace

// ---------------------------------------------------------------- rng

TEST(Rng, PhiloxMatchesRandom123KnownAnswers) {
  const rng::Block z = rng::philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(z.w[0], 0x6627e8d5u);
  EXPECT_EQ(z.w[1], 0xe169c58du);
  EXPECT_EQ(z.w[2], 0xbc57ac4cu);
  EXPECT_EQ(z.w[3], 0x9b00dbd8u);
  const std::uint32_t f = 0xffffffffu;
  const rng::Block o = rng::philox4x32_10(f, f, f, f, f, f);
  EXPECT_EQ(o.w[0], 0x408f276du);
  EXPECT_EQ(o.w[1], 0x41c83b0eu);
  EXPECT_EQ(o.w[2], 0xa20bc7c6u);
  EXPECT_EQ(o.w[3], 0x6d5451fdu);
  const rng::Block p = rng::philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u,
                                          0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(p.w[0], 0xd16cfe09u);
  EXPECT_EQ(p.w[1], 0x94fdccebu);
  EXPECT_EQ(p.w[2], 0x5001e420u);
  EXPECT_EQ(p.w[3], 0x24126ea1u);
}

TEST(Rng, PureFunctionsWithTheRightMoments) {
  const int n = 200000;
  double su = 0, su2 = 0, sz = 0, sz2 = 0, sz4 = 0;
  for (int i = 0; i < n; ++i) {
    const double u = rng::uniform(42, 7, std::uint64_t(i), 3);
    ASSERT_GT(u, 0.0);
    ASSERT_LT(u, 1.0);
    su += u;
    su2 += u * u;
    const double z = rng::normal(42, 8, std::uint64_t(i));
    sz += z;
    sz2 += z * z;
    sz4 += z * z * z * z;
  }
  EXPECT_NEAR(su / n, 0.5, 0.003);
  EXPECT_NEAR(su2 / n - (su / n) * (su / n), 1.0 / 12.0, 0.002);
  EXPECT_NEAR(sz / n, 0.0, 0.01);
  EXPECT_NEAR(sz2 / n, 1.0, 0.015);
  EXPECT_NEAR(sz4 / n, 3.0, 0.1);  // Gaussian kurtosis
  // Pure: the same arguments give the same value; each argument matters.
  EXPECT_EQ(rng::draw(1, 2, 3, 4), rng::draw(1, 2, 3, 4));
  EXPECT_NE(rng::draw(1, 2, 3, 4), rng::draw(2, 2, 3, 4));
  EXPECT_NE(rng::draw(1, 2, 3, 4), rng::draw(1, 3, 3, 4));
  EXPECT_NE(rng::draw(1, 2, 3, 4), rng::draw(1, 2, 4, 4));
  EXPECT_NE(rng::draw(1, 2, 3, 4), rng::draw(1, 2, 3, 5));
  EXPECT_EQ(rng::normal(9, 1, 5), rng::normal(9, 1, 5));
  EXPECT_GT(rng::to_open_unit(0), 0.0);
  EXPECT_LT(rng::to_open_unit(~std::uint64_t(0)), 1.0);
}

// ---------------------------------------------------------------- layout invariance

TEST(Data, MicroBatchSplitDoesNotChangeTheStream) {
  Sources sources;
  for (const auto& src : sources.all) {
    for (Split split : {Split::train, Split::val}) {
      for (std::int64_t step : {0, 1, 17}) {
        const auto whole = windows(*src, split, step, 0, 8);
        for (std::int64_t micro : {2, 1}) {
          std::vector<std::vector<std::int32_t>> pieces;
          for (std::int64_t first = 0; first < 8; first += micro)
            for (auto& w : windows(*src, split, step, first, micro)) pieces.push_back(w);
          EXPECT_EQ(pieces, whole) << src->describe() << " micro " << micro;
        }
      }
    }
  }
}

TEST(Data, RankSlicesReproduceTheGlobalBatch) {
  Sources sources;
  const int R = world_size(), r = world_rank();
  const std::int64_t G = 12;  // global batch; slices are uneven for R that does not divide it
  for (const auto& src : sources.all) {
    const std::int64_t T = src->spec().seq_len;
    for (std::int64_t step : {0, 5}) {
      const std::int64_t first = G * r / R, count = G * (r + 1) / R - first;
      std::vector<std::int32_t> in(std::size_t(count * T)), tg(in.size());
      fetch_samples(*src, Split::train, step, first, count, in.data(), tg.data());
      std::vector<int> counts(static_cast<std::size_t>(R)), displs(counts.size());
      for (int q = 0; q < R; ++q) {
        displs[std::size_t(q)] = int(G * q / R * T);
        counts[std::size_t(q)] = int((G * (q + 1) / R - G * q / R) * T);
      }
      std::vector<std::int32_t> gin(std::size_t(G * T)), gtg(gin.size());
      MPI_Gatherv(in.data(), int(in.size()), MPI_INT32_T, gin.data(), counts.data(), displs.data(),
                  MPI_INT32_T, 0, MPI_COMM_WORLD);
      MPI_Gatherv(tg.data(), int(tg.size()), MPI_INT32_T, gtg.data(), counts.data(), displs.data(),
                  MPI_INT32_T, 0, MPI_COMM_WORLD);
      if (r == 0) {
        std::vector<std::int32_t> fin(gin.size()), ftg(gin.size());
        fetch_samples(*src, Split::train, step, 0, G, fin.data(), ftg.data());
        EXPECT_EQ(gin, fin) << src->describe();
        EXPECT_EQ(gtg, ftg) << src->describe();
      }
    }
  }
}

TEST(Data, StepsSamplesAndSplitsDiffer) {
  Sources sources;
  for (const auto& src : sources.all) {
    const auto s0 = windows(*src, Split::train, 0, 0, 8);
    EXPECT_NE(s0, windows(*src, Split::train, 1, 0, 8)) << src->describe();
    EXPECT_NE(s0, windows(*src, Split::val, 0, 0, 8)) << src->describe();
    EXPECT_NE(s0[0], s0[1]) << src->describe();
    // The validation set is fixed: the step argument does not change it.
    EXPECT_EQ(windows(*src, Split::val, 0, 0, 8), windows(*src, Split::val, 9, 0, 8));
  }
}

// ---------------------------------------------------------------- file sources

TEST(Data, BytesSamplesAreFileWindowsInTheirRegion) {
  TempFile file("region.bin");
  const auto bytes = random_bytes(5000, 11);
  file.write(bytes);
  const std::int64_t T = 32, n = 5000, n_val = 1000, n_train = n - n_val;  // val_fraction 0.2
  for (const char* order : {"epochs", "random"}) {
    const bool epochs = std::string(order) == "epochs";
    auto src = open_source(spec("bytes", file.path(), 256, T, 0.2, 1234, order));
    EXPECT_EQ(src->windows(0), epochs ? (n_train - 1) / T : 0);
    std::set<std::int64_t> train_at, val_at;
    for (std::int64_t step = 0; step < 2; ++step) {
      for (const auto& w : windows(*src, Split::train, step, 0, 50)) {
        const auto at = occurrences(bytes, w);
        ASSERT_EQ(at.size(), 1u);
        EXPECT_LE(at[0] + T + 1, n_train) << "training sample reaches into the validation region";
        if (epochs) {
          EXPECT_EQ(at[0] % T, 0) << "epochs draw whole windows";
        }
        train_at.insert(at[0]);
      }
    }
    for (const auto& w : windows(*src, Split::val, 0, 0, 100)) {
      const auto at = occurrences(bytes, w);
      ASSERT_EQ(at.size(), 1u);
      EXPECT_GE(at[0], n_train);
      EXPECT_LE(at[0] + T + 1, n);
      if (epochs) {
        EXPECT_EQ((at[0] - n_train) % T, 0);
      }
      val_at.insert(at[0]);
    }
    // 100 training samples are 100 distinct windows of the first epoch (124 of them); the
    // validation region's 31 windows all come in 100 samples; random offsets spread too.
    EXPECT_GE(train_at.size(), epochs ? 100u : 95u) << order;
    EXPECT_GE(val_at.size(), epochs ? std::size_t((n_val - 1) / T) : 90u) << order;
    EXPECT_NE(src->describe().find(file.path()), std::string::npos);
    EXPECT_NE(src->describe().find(cat("order '", order, "'")), std::string::npos);
    EXPECT_FALSE(src->entropy_floor().has_value());
  }
}

TEST(Data, U16RoundTripWithTheLlmcHeader) {
  TempFile file("round.u16");
  const std::int64_t vocab = 50257, T = 16, n = 3000, n_train = 3000 - 300;
  const auto tokens = random_tokens(std::size_t(n), std::uint64_t(vocab), 12);
  file.write(u16_image(tokens));
  auto src = open_source(spec("u16", file.path(), vocab, T, 0.1));
  bool high = false;
  for (const auto& w : windows(*src, Split::train, 3, 0, 50)) {
    const auto at = occurrences(tokens, w);
    ASSERT_EQ(at.size(), 1u);
    EXPECT_LE(at[0] + T + 1, n_train);
    for (auto t : w) high = high || t > 255;
  }
  EXPECT_TRUE(high) << "tokens above 255 must survive (both bytes read)";
  for (const auto& w : windows(*src, Split::val, 0, 0, 50)) {
    const auto at = occurrences(tokens, w);
    ASSERT_EQ(at.size(), 1u);
    EXPECT_GE(at[0], n_train);
  }
  EXPECT_NE(src->describe().find("3000 tokens"), std::string::npos) << src->describe();
}

TEST(Data, NoValidationRegionWhenValFractionIsZero) {
  TempFile file("noval.bin");
  file.write(random_bytes(500, 3));
  auto src = open_source(spec("bytes", file.path(), 256, 16, 0.0));
  EXPECT_FALSE(src->has_val());
  std::vector<std::int32_t> in(16), tg(16);
  EXPECT_THROW(fetch_samples(*src, Split::val, 0, 0, 1, in.data(), tg.data()), Error);
  EXPECT_NO_THROW(fetch_samples(*src, Split::train, 0, 0, 1, in.data(), tg.data()));
}

TEST(Data, ErrorsNameTheFileAndTheProblem) {
  TempFile missing("missing.bin");  // never written
  expect_open_error(spec("bytes", missing.path(), 256, 8), {missing.path(), "cannot open"});
  expect_open_error(spec("u16", missing.path(), 256, 8), {missing.path(), "cannot open"});
  expect_open_error(spec("bytes", "/tmp", 256, 8), {"'/tmp'", "not a regular file"});
  expect_open_error(spec("bytes", "", 256, 8), {"needs data%path"});
  expect_open_error(spec("parquet", "", 256, 8), {"unknown data%source 'parquet'"});
  expect_open_error(spec("synthetic", "", 256, 0), {"seq_len"});

  TempFile small("small.bin");
  small.write(random_bytes(100, 1));
  expect_open_error(
      spec("bytes", small.path(), 256, 100, 0.0),
      {small.path(), "has 100 tokens, needs at least seq_len+1 = 101 in the training region"});
  EXPECT_NO_THROW(open_source(spec("bytes", small.path(), 256, 99, 0.0)));  // exactly enough
  expect_open_error(spec("bytes", small.path(), 100, 8), {small.path(), "vocab >= 256"});
  TempFile thin_val("thinval.bin");
  thin_val.write(random_bytes(1000, 2));
  expect_open_error(spec("bytes", thin_val.path(), 256, 64, 0.05),
                    {thin_val.path(), "seq_len+1 = 65 in the validation region"});

  const auto tokens = random_tokens(200, 500, 4);
  TempFile magic("magic.u16"), version("version.u16"), size("size.u16"), header("header.u16"),
      few("few.u16");
  magic.write(u16_image(tokens, 1234));
  expect_open_error(spec("u16", magic.path(), 500, 8), {magic.path(), "magic 1234"});
  version.write(u16_image(tokens, 20240520, 2));
  expect_open_error(spec("u16", version.path(), 500, 8), {version.path(), "version 2"});
  size.write(u16_image(tokens, 20240520, 1, 201));
  expect_open_error(spec("u16", size.path(), 500, 8),
                    {size.path(), "header says 201 tokens", "file has 1424 bytes"});
  header.write(std::vector<unsigned char>(100, 0));
  expect_open_error(spec("u16", header.path(), 500, 8),
                    {header.path(), "too short for the llm.c header"});
  few.write(u16_image(random_tokens(40, 500, 5)));
  expect_open_error(spec("u16", few.path(), 500, 64, 0.0), {few.path(), "has 40 tokens"});
}

// A token file rewritten during the run (a token >= vocab appears after the open-time scan)
// is an error at the fetch, not a negative loss.
TEST(Data, U16FileChangedAfterOpenIsRefusedAtFetch) {
  TempFile file("changed.u16");
  std::vector<std::uint16_t> tokens(4000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = std::uint16_t(i % 500);
  file.write(u16_image(tokens));
  auto src = open_source(spec("u16", file.path(), 500, 64, 0.0));
  for (auto& t : tokens) t = 777;
  file.write(u16_image(tokens));
  std::vector<std::int32_t> in(64), tg(64);
  try {
    fetch_samples(*src, Split::train, 1, 0, 1, in.data(), tg.data());
    ADD_FAILURE() << "no error for a token >= vocab";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 777"), std::string::npos) << e.what();
  }
}

TEST(Data, U16TokenOutOfVocabIsFoundByTheScan) {
  // The first of two bad tokens is named.
  TempFile file("oov.u16");
  std::vector<std::uint16_t> tokens(1100000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = std::uint16_t(i % 500);
  tokens[1048575] = 777;
  tokens[1060000] = 901;
  file.write(u16_image(tokens));
  expect_open_error(spec("u16", file.path(), 500, 64),
                    {file.path(), "token 777 at position 1048575", "vocab = 500"});
  EXPECT_NO_THROW(open_source(spec("u16", file.path(), 1000, 64)));
}

// ---------------------------------------------------------------- epochs and blends

TEST(Rng, PermuteIsABijectionOfEverySize) {
  for (std::uint64_t n : {1u, 2u, 3u, 5u, 16u, 17u, 1000u, 4097u}) {
    std::vector<int> hits(n, 0);
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint64_t p = rng::permute(i, n, 7, 1, 2);
      ASSERT_LT(p, n);
      ++hits[p];
    }
    EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), std::ptrdiff_t(n)) << n;
  }
  // Another seed, stream or epoch is another permutation.
  auto perm = [](std::uint64_t seed, std::uint64_t stream, std::uint64_t a) {
    std::vector<std::uint64_t> v;
    for (std::uint64_t i = 0; i < 1000; ++i) v.push_back(rng::permute(i, 1000, seed, stream, a));
    return v;
  };
  const auto p = perm(7, 1, 2);
  EXPECT_EQ(p, perm(7, 1, 2));
  EXPECT_NE(p, perm(8, 1, 2));
  EXPECT_NE(p, perm(7, 2, 2));
  EXPECT_NE(p, perm(7, 1, 3));
  // Large domains work in O(1) per index.
  EXPECT_LT(rng::permute(123456789, std::uint64_t(1) << 40, 1, 2, 3), std::uint64_t(1) << 40);
}

// A u16 file whose token i is i: a sample's first token is its offset.
struct CountingFile {
  TempFile file{"count.u16"};
  explicit CountingFile(std::size_t n) {
    std::vector<std::uint16_t> tokens(n);
    for (std::size_t i = 0; i < n; ++i) tokens[i] = std::uint16_t(i);
    file.write(u16_image(tokens));
  }
};

TEST(Data, EveryWindowOnceAnEpochInAnotherOrderEachEpoch) {
  const std::int64_t n = 3000, T = 16, n_train = 2700, W = (n_train - 1) / T;  // 168 windows
  CountingFile data{std::size_t(n)};
  auto src = open_source(spec("u16", data.file.path(), 60000, T, 0.1));
  ASSERT_EQ(src->windows(0), W);
  // Three epochs in steps of 10 samples (W is not a multiple of 10).
  Position at = position_after(*src, 0);
  std::vector<std::int64_t> starts;
  for (std::int64_t step = 1; std::int64_t(starts.size()) < 3 * W; ++step) {
    const auto draws = take(*src, at, step, 10);
    std::vector<std::int32_t> in(10 * T), tg(10 * T);
    fetch(*src, Split::train, draws.data(), 10, in.data(), tg.data());
    for (std::int64_t j = 0; j < 10; ++j) {
      EXPECT_EQ(tg[std::size_t(j * T + T - 1)], in[std::size_t(j * T)] + T) << "contiguous";
      starts.push_back(in[std::size_t(j * T)]);
    }
  }
  for (int e = 0; e < 3; ++e) {
    std::vector<int> hits(std::size_t(W), 0);
    for (std::int64_t k = e * W; k < (e + 1) * W; ++k) {
      ASSERT_EQ(starts[std::size_t(k)] % T, 0);
      ++hits[std::size_t(starts[std::size_t(k)] / T)];
    }
    EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), std::ptrdiff_t(W)) << "epoch " << e;
  }
  EXPECT_FALSE(std::equal(starts.begin(), starts.begin() + W, starts.begin() + W))
      << "each epoch has its own order";
  // The last window ends at the training region's end at most (its last token is shared).
  EXPECT_LE(*std::max_element(starts.begin(), starts.end()) + T, n_train - 1);
  char done[16];
  std::snprintf(done, sizeof done, "%.0f", 100.0 * double(at.consumed % W) / double(W));
  EXPECT_EQ(describe_position(*src, at), cat("epoch ", at.consumed / W + 1, " (", done, "% done)"));
}

// A restart resumes the stream from its position whatever the global batch, micro-batch or rank
// count: the samples after it are those of the uninterrupted stream.
TEST(Data, ThePositionAloneContinuesTheStream) {
  Sources sources;
  TempFile a("blend_a.bin"), b("blend_b.bin");
  a.write(random_bytes(9000, 21));
  b.write(random_bytes(4000, 22));
  DataSpec blend = spec("bytes", a.path(), 256, 24);
  blend.paths = {a.path(), b.path()};
  blend.weights = {0.7, 0.3};
  sources.all.push_back(open_source(blend));
  for (const auto& src : sources.all) {
    if (src->windows(0) == 0) continue;  // the synthetic source keys on (step, j)
    Position at = position_after(*src, 0);
    std::vector<Draw> whole;
    for (std::int64_t step = 1; step <= 6; ++step)
      for (const Draw& d : take(*src, at, step, 12)) whole.push_back(d);
    // Stopped after 3 steps of 12, restarted with steps of 8 from the saved position.
    Position saved = position_after(*src, 36);
    std::vector<Draw> resumed;
    for (std::int64_t step = 4; step <= 8; ++step)
      for (const Draw& d : take(*src, saved, step, 8)) resumed.push_back(d);
    const std::size_t T = std::size_t(src->spec().seq_len);
    std::vector<std::int32_t> w1(36 * T), t1(w1.size()), w2(w1.size()), t2(w1.size());
    fetch(*src, Split::train, whole.data() + 36, 36, w1.data(), t1.data());
    fetch(*src, Split::train, resumed.data(), 36, w2.data(), t2.data());
    EXPECT_EQ(w1, w2) << src->describe();
    EXPECT_EQ(t1, t2) << src->describe();
    EXPECT_EQ(saved.consumed, 76);
    EXPECT_EQ(saved.per_dataset, position_after(*src, 76).per_dataset);
  }
}

// Realised counts within one sample of weight*g at every prefix, for any weights.
TEST(Data, BlendsKeepEveryPrefixWithinOneSampleOfTheWeights) {
  TempFile file("blend.bin");
  file.write(random_bytes(3000, 31));
  for (int trial = 0; trial < 40; ++trial) {
    const int k = 2 + trial % 7;
    DataSpec s = spec("bytes", file.path(), 256, 16);
    s.paths.assign(std::size_t(k), file.path());
    s.weights.clear();
    double sum = 0;
    for (int i = 0; i < k; ++i) {
      const double u = rng::uniform(5, 6, std::uint64_t(trial), std::uint64_t(i));
      s.weights.push_back(u * u * u + 1e-3);
      sum += s.weights.back();
    }
    for (double& w : s.weights) w /= sum;
    auto src = open_source(s);
    Position at = position_after(*src, 0);
    std::vector<std::int64_t> next(std::size_t(k), 0);
    double worst = 0;
    for (std::int64_t step = 1; step <= 100; ++step) {
      for (const Draw& d : take(*src, at, step, 30)) {
        EXPECT_EQ(d.k, next[std::size_t(d.dataset)]++) << "a dataset's samples in order";
      }
      for (int i = 0; i < k; ++i)
        worst = std::max(worst, std::abs(double(at.per_dataset[std::size_t(i)]) -
                                         s.weights[std::size_t(i)] * double(at.consumed)));
    }
    // Every prefix, not only step ends: sample by sample.
    Position one = position_after(*src, 0);
    for (std::int64_t g = 0; g < 3000; ++g) {
      take(*src, one, 0, 1);
      for (int i = 0; i < k; ++i)
        worst = std::max(worst, std::abs(double(one.per_dataset[std::size_t(i)]) -
                                         s.weights[std::size_t(i)] * double(one.consumed)));
    }
    EXPECT_LT(worst, 1.0 - 1.0 / double(2 * k - 2) + 1e-9) << k << " datasets, trial " << trial;
    EXPECT_EQ(one.per_dataset, position_after(*src, 3000).per_dataset);
  }
}

TEST(Data, TheFingerprintChangesWithTheData) {
  TempFile a("fp_a.bin"), b("fp_b.bin");
  a.write(random_bytes(4000, 41));
  auto changed = random_bytes(4000, 41);
  changed[3999] ^= 1;  // the last byte
  b.write(changed);
  const std::uint64_t base = open_source(spec("bytes", a.path(), 256, 16))->fingerprint();
  EXPECT_EQ(open_source(spec("bytes", a.path(), 256, 16))->fingerprint(), base);
  EXPECT_EQ(open_source(spec("bytes", a.path(), 300, 16))->fingerprint(), base) << "not vocab";
  EXPECT_NE(open_source(spec("bytes", b.path(), 256, 16))->fingerprint(), base);
  EXPECT_NE(open_source(spec("bytes", a.path(), 256, 17))->fingerprint(), base);
  EXPECT_NE(open_source(spec("bytes", a.path(), 256, 16, 0.2))->fingerprint(), base);
  EXPECT_NE(open_source(spec("bytes", a.path(), 256, 16, 0.1, 1234, "random"))->fingerprint(),
            base);
  DataSpec blend = spec("bytes", a.path(), 256, 16);
  blend.paths = {a.path(), a.path()};
  blend.weights = {0.5, 0.5};
  const std::uint64_t even = open_source(blend)->fingerprint();
  blend.weights = {0.6, 0.4};
  EXPECT_NE(open_source(blend)->fingerprint(), even);
  EXPECT_NE(even, base);
}

// The ranks opening one file share the token scan and all report the bad token, wherever it is.
TEST(Data, TheRanksShareTheTokenScanAndAgree) {
  int pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  const std::string path = cat("/tmp/ptrain_test_data_", pid, "_shared.u16");
  std::vector<std::uint16_t> tokens(5000, 7);
  tokens[4990] = 900;  // in the last rank's share
  if (world_rank() == 0) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    const auto image = u16_image(tokens);
    f.write(reinterpret_cast<const char*>(image.data()), std::streamsize(image.size()));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  try {
    open_source(spec("u16", path, 500, 16), MPI_COMM_WORLD);
    ADD_FAILURE() << "no error for token 900";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), kExitInput);
    EXPECT_NE(std::string(e.what()).find("token 900 at position 4990"), std::string::npos)
        << e.what();
  }
  // A file missing on one rank only is every rank's error.
  const std::string mine = world_rank() == 0 ? path : path + ".missing";
  try {
    open_source(spec("u16", mine, 1000, 16), MPI_COMM_WORLD);
    EXPECT_EQ(world_size(), 1) << "rank 0 opened it, every other rank must fail with its peers";
  } catch (const Error& e) {
    EXPECT_GT(world_size(), 1);
    EXPECT_NE(std::string(e.what()).find("cannot open"), std::string::npos) << e.what();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) std::remove(path.c_str());
}

// ---------------------------------------------------------------- synthetic

namespace {
// Plug-in conditional entropy H(next | prev) in nats from transition counts.
double conditional_entropy(const std::map<std::pair<int, int>, double>& pairs) {
  std::map<int, double> from;
  double total = 0;
  for (const auto& [k, c] : pairs) {
    from[k.first] += c;
    total += c;
  }
  double h = 0;
  for (const auto& [k, c] : pairs) h -= c / total * std::log(c / from[k.first]);
  return h;
}
}  // namespace

TEST(Data, SyntheticStreamHasTheAdvertisedEntropyRate) {
  const double ln2 = std::log(2.0);
  const std::vector<std::pair<std::int64_t, double>> cases = {
      {16, 1.75 * ln2},
      {3, 1.5 * ln2},
      {2, ln2}};  // p = (1/2,1/4,1/8,1/8), (1/2,1/4,1/4), (1/2,1/2)
  for (const auto& [vocab, h_true] : cases) {
    auto src = open_source(spec("synthetic", "", vocab, 128, 0.1, 777));
    ASSERT_TRUE(src->entropy_floor().has_value());
    EXPECT_NEAR(*src->entropy_floor(), h_true, 1e-12);
    std::map<std::pair<int, int>, double> train_pairs, val_pairs;
    std::vector<int> first(std::size_t(vocab), 0);
    const std::int64_t per_step = 256, steps = vocab == 16 ? 8 : 2;
    for (std::int64_t step = 0; step < steps; ++step) {
      for (const auto& w : windows(*src, Split::train, step, 0, per_step)) {
        ++first[std::size_t(w[0])];
        for (std::size_t t = 1; t < w.size(); ++t) {
          ASSERT_GE(w[t], 0);
          ASSERT_LT(w[t], vocab);
          train_pairs[{w[t - 1], w[t]}] += 1;
        }
      }
    }
    for (const auto& w : windows(*src, Split::val, 0, 0, 256))
      for (std::size_t t = 1; t < w.size(); ++t) val_pairs[{w[t - 1], w[t]}] += 1;
    // 262k transitions for vocab 16: the plug-in estimate's error is ~0.002 nats.
    EXPECT_NEAR(conditional_entropy(train_pairs), h_true, 0.01) << "vocab " << vocab;
    EXPECT_NEAR(conditional_entropy(val_pairs), h_true, 0.03) << "vocab " << vocab;
    std::map<int, int> successors;
    for (const auto& kv : train_pairs) ++successors[kv.first.first];
    for (const auto& [v, k] : successors) EXPECT_LE(k, std::min<std::int64_t>(4, vocab)) << v;
    // Validation is another stream of the same chain: no transition the training stream lacks.
    for (const auto& kv : val_pairs) EXPECT_EQ(train_pairs.count(kv.first), 1u);
    // The first token is uniform: chi-square over the vocabulary, loose bound.
    const double expect = double(per_step * steps) / double(vocab);
    double chi2 = 0;
    for (int c : first) chi2 += (c - expect) * (c - expect) / expect;
    EXPECT_LT(chi2, 3.0 * double(vocab) + 20) << "vocab " << vocab;
  }
  auto src = open_source(spec("synthetic", "", 16, 8));
  EXPECT_NE(src->describe().find("entropy floor 1.2130"), std::string::npos) << src->describe();
}

TEST(Data, SpecFromConfig) {
  Config c;
  c.data.source = "bytes";
  c.data.path = "/x";
  c.data.order = "epochs";
  c.data.val_fraction = 0.25;
  c.model.vocab = 300;
  c.model.seq_len = 7;
  c.run.seed = 99;
  const DataSpec s = spec_from_config(c);
  EXPECT_EQ(s.source, "bytes");
  EXPECT_EQ(s.paths, std::vector<std::string>{"/x"});
  EXPECT_EQ(s.weights, std::vector<double>{1.0});
  EXPECT_EQ(s.order, "epochs");
  EXPECT_EQ(s.vocab, 300);
  EXPECT_EQ(s.seq_len, 7);
  EXPECT_EQ(s.seed, 99u);
  EXPECT_EQ(s.val_fraction, 0.25);
}

TEST(Data, TinyShakespeareSmoke) {
  const std::string path = PTRAIN_SOURCE_DIR "/../shared/data/tinyshakespeare.txt";
  std::ifstream f(path, std::ios::binary);
  if (!f) GTEST_SKIP() << path << " is absent";
  const std::vector<unsigned char> text((std::istreambuf_iterator<char>(f)),
                                        std::istreambuf_iterator<char>());
  const std::int64_t T = 64, n = std::int64_t(text.size());
  const std::int64_t n_train = n - std::int64_t(std::floor(double(n) * 0.1));
  auto src = open_source(spec("bytes", path, 256, T, 0.1));
  for (const auto& w : windows(*src, Split::train, 100, 0, 4)) {
    const std::string s(w.begin(), w.end());
    const auto at = std::string(text.begin(), text.begin() + n_train).find(s);
    EXPECT_NE(at, std::string::npos);
  }
  for (const auto& w : windows(*src, Split::val, 0, 0, 4)) {
    const std::string s(w.begin(), w.end());
    EXPECT_NE(std::string(text.begin() + n_train, text.end()).find(s), std::string::npos);
  }
  EXPECT_NE(src->describe().find(cat(n, " tokens")), std::string::npos) << src->describe();
}
