// ptrain-test: np=1 labels=quick timeout=120
// The Megatron indexed reader (source 'indexed') on files of an independent writer
// (regression/lib/megatron_indexed.py, numpy, Megatron's layout field by field): every dtype,
// empty and one-token documents, a file of one document; every malformed index or data file
// refused in one line with exit code 2.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "data/data.hpp"
#include "data/indexed.hpp"
#include "data/rng.hpp"
#include "util/error.hpp"

using namespace ptrain;
using namespace ptrain::data;

namespace {

const std::string kPython = "/usr/bin/python3";
const std::string kWriter = PTRAIN_SOURCE_DIR "/regression/lib/megatron_indexed.py";

// A folder under /tmp for this process, removed at the end.
class Folder {
 public:
  Folder() : path_(cat("/tmp/ptrain_test_indexed_", ::getpid())) {
    std::system(cat("mkdir -p ", path_).c_str());
  }
  ~Folder() { std::system(cat("rm -rf ", path_).c_str()); }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

bool have_numpy() {
  return std::system((kPython + " -c 'import numpy' >/dev/null 2>&1").c_str()) == 0;
}

// Writes PREFIX.bin/.idx with the numpy writer: documents of tokens in `dtype`.
void write_dataset(const std::string& prefix, const std::vector<std::vector<double>>& docs,
                   const std::string& dtype) {
  {
    std::ofstream f(prefix + ".docs");
    for (const auto& doc : docs) {
      for (std::size_t i = 0; i < doc.size(); ++i) {
        char v[32];
        std::snprintf(v, sizeof v, dtype.rfind("float", 0) == 0 ? "%.1f" : "%.0f", doc[i]);
        f << (i ? " " : "") << v;
      }
      f << '\n';
    }
  }
  const std::string cmd = cat(kPython, " ", kWriter, " ", prefix, ".docs ", prefix, " ", dtype);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}
void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

DataSpec indexed_spec(const std::string& prefix, std::int64_t vocab, std::int64_t seq_len,
                      double val_fraction = 0.0) {
  DataSpec s;
  s.source = "indexed";
  s.paths = {prefix};
  s.weights = {1.0};
  s.vocab = vocab;
  s.seq_len = seq_len;
  s.val_fraction = val_fraction;
  return s;
}

// Every training window of the first epoch, in the order drawn.
std::vector<std::vector<std::int32_t>> one_epoch(const TokenSource& src) {
  const std::int64_t T = src.spec().seq_len, W = src.windows(0);
  Position at = position_after(src, 0);
  const auto draws = take(src, at, 1, W);
  std::vector<std::int32_t> in(std::size_t(W * T)), tg(in.size());
  fetch(src, Split::train, draws.data(), W, in.data(), tg.data());
  std::vector<std::vector<std::int32_t>> out;
  for (std::int64_t w = 0; w < W; ++w) {
    std::vector<std::int32_t> x(in.begin() + w * T, in.begin() + (w + 1) * T);
    x.push_back(tg[std::size_t(w * T + T - 1)]);
    out.push_back(x);
  }
  return out;
}

// The windows an epoch must hold: the concatenated documents cut at multiples of T.
std::vector<std::vector<std::int32_t>> expected_windows(
    const std::vector<std::vector<double>>& docs, std::int64_t T) {
  std::vector<std::int32_t> all;
  for (const auto& d : docs)
    for (double t : d) all.push_back(std::int32_t(t));
  std::vector<std::vector<std::int32_t>> out;
  for (std::int64_t w = 0; w < (std::int64_t(all.size()) - 1) / T; ++w)
    out.emplace_back(all.begin() + w * T, all.begin() + w * T + T + 1);
  return out;
}

// Expects open_source(s) to throw one line, exit code 2, containing every needle.
void expect_refused(const DataSpec& s, const std::vector<std::string>& needles) {
  try {
    open_source(s);
    ADD_FAILURE() << "no error; expected " << needles.back();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_EQ(e.exit_code(), kExitInput) << msg;
    for (const auto& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << msg << "\n  lacks: " << n;
  }
}

}  // namespace

TEST(DataIndexed, EveryDtypeReadsTheWritersTokens) {
  if (!have_numpy()) GTEST_SKIP() << kPython << " with numpy is absent";
  Folder dir;
  const std::int64_t T = 8;
  for (const char* dtype :
       {"uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16"}) {
    // Documents of random lengths (empty and one-token ones among them), each ending with an
    // end-of-document token 0; tokens below 100 fit every dtype.
    std::vector<std::vector<double>> docs;
    for (int d = 0; d < 40; ++d) {
      const int n = d % 7 == 3 ? 0 : d % 5 == 1 ? 1 : int(rng::below(30, 3, 4, std::uint64_t(d)));
      std::vector<double> doc;
      for (int t = 0; t + 1 < n; ++t)
        doc.push_back(1 + double(rng::below(99, 3, 5, std::uint64_t(d * 100 + t))));
      if (n > 0) doc.push_back(0);
      docs.push_back(doc);
    }
    const std::string prefix = dir / dtype;
    write_dataset(prefix, docs, dtype);
    auto src = open_source(indexed_spec(prefix, 100, T));
    auto got = one_epoch(*src), want = expected_windows(docs, T);
    ASSERT_EQ(got.size(), want.size()) << dtype;
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want) << dtype << ": an epoch is every window of the documents, once";
    EXPECT_NE(src->describe().find(cat("(", dtype, ") in 40 documents")), std::string::npos)
        << src->describe();
  }
}

TEST(DataIndexed, OneDocumentAndValidation) {
  if (!have_numpy()) GTEST_SKIP() << kPython << " with numpy is absent";
  Folder dir;
  std::vector<double> doc;
  for (int t = 0; t < 1000; ++t) doc.push_back(double(t % 50000));
  write_dataset(dir / "one", {doc}, "uint16");
  auto src = open_source(indexed_spec(dir / "one", 50257, 16, 0.1));
  EXPECT_EQ(src->windows(0), (900 - 1) / 16);
  std::vector<std::int32_t> in(16), tg(16);
  const Draw v{0, 3, 0, 0};
  fetch(*src, Split::val, &v, 1, in.data(), tg.data());
  EXPECT_GE(in[0], 900) << "validation comes from the tail";
  EXPECT_EQ((in[0] - 900) % 16, 0);
  EXPECT_EQ(tg[15], in[0] + 16);
}

TEST(DataIndexed, MalformedFilesAreRefusedInOneLine) {
  if (!have_numpy()) GTEST_SKIP() << kPython << " with numpy is absent";
  Folder dir;
  const std::string base = dir / "base";
  std::vector<std::vector<double>> docs = {{5, 6, 7, 0}, {}, {8, 0}, {9, 9, 9, 9, 9, 9, 0}};
  write_dataset(base, docs, "int32");  // 4 sequences, 13 tokens of 4 bytes
  const std::string idx = read_file(base + ".idx"), bin = read_file(base + ".bin");
  ASSERT_EQ(idx.size(), indexed::kHeaderBytes + 12 * 4 + 8 * 5);
  EXPECT_NO_THROW(open_source(indexed_spec(base, 10, 4)));
  int case_no = 0;
  // The index with `bytes` put at `at`, or cut to `size`, and the data file as given.
  auto variant = [&](std::string i, const std::string& b, const std::vector<std::string>& needles) {
    const std::string prefix = dir / cat("bad", case_no++);
    write_file(prefix + ".idx", i);
    write_file(prefix + ".bin", b);
    expect_refused(indexed_spec(prefix, 10, 4), needles);
    return prefix;
  };
  auto patched = [&](std::size_t at, std::uint64_t v, int bytes) {
    std::string i = idx;
    for (int k = 0; k < bytes; ++k) i[at + std::size_t(k)] = char((v >> (8 * k)) & 0xFF);
    return i;
  };
  const std::size_t lengths = indexed::kHeaderBytes, pointers = lengths + 16,
                    documents = pointers + 32;
  std::string magic = idx;
  magic[3] = 'X';
  variant(magic, bin, {".idx'", "not a Megatron indexed dataset index"});
  variant(idx.substr(0, 20), bin, {".idx'", "has 20 bytes, too short for the header"});
  variant(patched(9, 2, 8), bin, {"index version 2, expected 1"});
  variant(patched(17, 9, 1), bin, {"dtype code 9"});
  variant(patched(17, 0, 1), bin, {"dtype code 0"});
  variant(idx.substr(0, idx.size() - 1), bin, {"header says 4 sequences", "truncated"});
  variant(idx + std::string(3, '\0'), bin, {"header says 4 sequences"});
  variant(idx + std::string(4, '\0'), bin, {"multimodal"});
  variant(patched(18, 5, 8), bin, {"header says 5 sequences"});
  variant(patched(18, ~std::uint64_t(0), 8), bin, {"header says 18446744073709551615 sequences"});
  variant(patched(26, std::uint64_t(1) << 62, 8), bin, {"document index of 4611686018427387904"});
  variant(patched(lengths + 4, 0xFFFFFFFF, 4), bin, {"sequence 1 has length -1"});
  variant(patched(pointers + 16, 20, 8), bin, {"sequence 2 starts at byte 20", "expected 16"});
  variant(patched(documents, 1, 8), bin, {"begins with 1, expected 0"});
  variant(patched(documents + 16, 0, 8), bin, {"document index entry 2 is 0"});
  variant(patched(documents + 32, 3, 8), bin, {"ends at sequence 3, expected 4"});
  variant(patched(documents + 32, 9, 8), bin, {"document index entry 4 is 9"});
  variant(idx, bin.substr(0, bin.size() - 4),
          {".bin' has 48 bytes", "says 4 sequences of 13 int32"});
  variant(idx, bin + "x", {".bin' has 53 bytes"});
  std::string big = bin;
  big[4] = 10;  // token 1 (of document 0) = 10 = vocab
  variant(idx, big, {".bin'", "token 10 at position 1", "vocab = 10"});
  // Float tokens must be integers.
  write_dataset(dir / "f", {{1.0, 2.5, 0.0}, {3, 3, 3, 3, 0}}, "float32");
  expect_refused(indexed_spec(dir / "f", 10, 4), {"f.bin'", "token 2.5 at position 1"});
  // Missing files, and a path given with the extension.
  expect_refused(indexed_spec(dir / "none", 10, 4), {"none.idx'", "cannot open"});
  std::remove((base + ".bin").c_str());
  expect_refused(indexed_spec(base, 10, 4), {"base.bin'", "cannot open"});
  write_dataset(base, docs, "int32");
  expect_refused(indexed_spec(base + ".bin", 10, 4), {"takes the prefix", "'" + base + "'"});
  // Too short for seq_len+1.
  expect_refused(indexed_spec(base, 10, 13), {"has 13 tokens, needs at least seq_len+1 = 14"});
}

// parse_index on the images ptrain-tokenize writes (index_image): what it says.
TEST(DataIndexed, TheWritersImageParses) {
  const std::string image = indexed::index_image(indexed::kUint16, {3, 0, 1, 5});
  const indexed::Index ix = indexed::parse_index(
      reinterpret_cast<const unsigned char*>(image.data()), image.size(), 18, "x.idx", "x.bin");
  EXPECT_EQ(ix.dtype, indexed::kUint16);
  EXPECT_EQ(ix.sequences, 4);
  EXPECT_EQ(ix.documents, 4);
  EXPECT_EQ(ix.tokens, 9);
  EXPECT_EQ(ix.empty_documents, 0);
  EXPECT_EQ(indexed::dtype_for_vocab(50257), indexed::kUint16);
  EXPECT_EQ(indexed::dtype_for_vocab(65500), indexed::kInt32);
  EXPECT_THROW(indexed::parse_index(reinterpret_cast<const unsigned char*>(image.data()),
                                    image.size(), 17, "x.idx", "x.bin"),
               Error);
}
