// data/data.cpp — the synthetic Markov source, the file sources (bytes, u16, indexed) read by
// memory map, the order of samples (epochs, random), blends, fetch.
#include "data/data.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "data/indexed.hpp"
#include "data/rng.hpp"
#include "util/checksum.hpp"
#include "util/error.hpp"
#include "util/mpi.hpp"

namespace ptrain::data {

namespace {

// rng streams of the data module; each use of randomness has its own.
enum Stream : std::uint64_t {
  kSuccessors = 0x64617461'00000001ull,   // synthetic: successor table, (v, attempt)
  kTrainTokens = 0x64617461'00000002ull,  // synthetic: (step, j*(T+1) + t)
  kValTokens = 0x64617461'00000003ull,    // synthetic: (0, i*(T+1) + t)
  kTrainOffset = 0x64617461'00000004ull,  // files, order 'random': (step, j)
  kValOffset = 0x64617461'00000005ull,    // files, order 'random': (i, dataset)
  kEpochOrder = 0x64617461'00010000ull,   // files, order 'epochs': + dataset; a = epoch
  kValOrder = 0x64617461'00020000ull,     // files, order 'epochs': + dataset; a = 0
};

constexpr std::int32_t kU16Magic = 20240520;
constexpr std::int32_t kU16Version = 1;
constexpr std::int64_t kU16HeaderBytes = 256 * 4;
// The fingerprint hashes this much of each end of a file's tokens (and of an index).
constexpr std::int64_t kFingerprintBytes = 1 << 20;

std::string quoted(const std::string& path) { return cat("'", path, "'"); }

[[noreturn]] void fail(const std::string& what) { throw Error(cat("data: ", what), kExitInput); }

// ---------------------------------------------------------------- synthetic

// Successor probabilities in eighths, by successor count k (index k-2).
constexpr int kEighths[3][4] = {{4, 4, 0, 0}, {4, 2, 2, 0}, {4, 2, 1, 1}};

class SyntheticSource final : public TokenSource {
 public:
  explicit SyntheticSource(DataSpec spec) : TokenSource(std::move(spec)) {
    const std::int64_t V = spec_.vocab;
    k_ = V < 4 ? int(V) : 4;
    // Cumulative eighths: choice c covers 3-bit values [cum_[c], cum_[c+1]).
    cum_[0] = 0;
    for (int c = 0; c < k_; ++c) cum_[c + 1] = cum_[c] + kEighths[k_ - 2][c];
    entropy_ = 0;
    for (int c = 0; c < k_; ++c) {
      const double p = kEighths[k_ - 2][c] / 8.0;
      entropy_ -= p * std::log(p);
    }
    // successors_: (V, k) distinct tokens per row, by rejection over hashed candidates.
    successors_.resize(std::size_t(V) * std::size_t(k_));
    for (std::int64_t v = 0; v < V; ++v) {
      std::int32_t* row = &successors_[std::size_t(v) * std::size_t(k_)];
      std::uint64_t attempt = 0;
      for (int c = 0; c < k_;) {
        const auto cand = std::int32_t(
            rng::below(std::uint64_t(V), spec_.seed, kSuccessors, std::uint64_t(v), attempt++));
        bool seen = false;
        for (int d = 0; d < c; ++d) seen = seen || row[d] == cand;
        if (!seen) row[c++] = cand;
      }
    }
    const std::string what = cat("synthetic ", spec_.vocab, " ", spec_.seq_len);
    fingerprint_ = fnv1a(what);
  }

  void sample(Split split, const Draw& draw, std::int32_t* out) const override {
    const std::uint64_t stream = split == Split::train ? kTrainTokens : kValTokens;
    const std::uint64_t a = split == Split::train ? std::uint64_t(draw.step) : 0;
    const std::uint64_t width = std::uint64_t(spec_.seq_len) + 1;
    const std::uint64_t base = std::uint64_t(draw.index) * width;
    const std::uint64_t seed = spec_.seed;
    auto prev = std::int32_t(rng::below(std::uint64_t(spec_.vocab), seed, stream, a, base));
    out[0] = prev;
    for (std::uint64_t t = 1; t < width; ++t) {
      const int bits = int(rng::draw(seed, stream, a, base + t) & 7u);  // exact eighths
      int c = 0;
      while (bits >= cum_[c + 1]) ++c;
      prev = successors_[std::size_t(prev) * std::size_t(k_) + std::size_t(c)];
      out[t] = prev;
    }
  }

  bool has_val() const override { return true; }
  std::optional<double> entropy_floor() const override { return entropy_; }

  std::string describe() const override {
    std::string probs;
    for (int c = 0; c < k_; ++c) probs += cat(c ? " " : "", kEighths[k_ - 2][c], "/8");
    char h[32];
    std::snprintf(h, sizeof h, "%.4f", entropy_);
    return cat("synthetic: order-1 Markov chain over vocab ", spec_.vocab, ", ", k_,
               " successors per token (p = ", probs, "), entropy floor ", h, " nats/token, seed ",
               spec_.seed);
  }

 private:
  int k_ = 4;
  int cum_[5] = {};
  double entropy_ = 0;
  std::vector<std::int32_t> successors_;
};

// ---------------------------------------------------------------- files

// A file mapped read-only (nothing mapped when it is empty), unmapped on destruction.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(cat("cannot open ", quoted(path), ": ", std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      fail(cat(quoted(path), " is not a regular file"));
    }
    size_ = std::int64_t(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, std::size_t(size_), PROT_READ, MAP_SHARED, fd, 0);
      const int err = errno;
      ::close(fd);
      if (p == MAP_FAILED) fail(cat("cannot map ", quoted(path), ": ", std::strerror(err)));
      data_ = static_cast<const unsigned char*>(p);
      // Windows are read in a shuffled order: no read-ahead of pages that will not be used.
      ::madvise(p, std::size_t(size_), MADV_RANDOM);
    } else {
      ::close(fd);
    }
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data_) ::munmap(const_cast<unsigned char*>(data_), std::size_t(size_));
  }
  const std::string& path() const { return path_; }
  std::int64_t size() const { return size_; }
  const unsigned char* data() const { return data_; }
  // madvise over the pages holding bytes [lo, hi).
  void advise(std::int64_t lo, std::int64_t hi, int advice) const {
    const std::int64_t page = ::sysconf(_SC_PAGESIZE), first = lo / page * page;
    if (data_ && hi > lo)
      ::madvise(const_cast<unsigned char*>(data_) + first, std::size_t(hi - first), advice);
  }

 private:
  std::string path_;
  std::int64_t size_ = 0;
  const unsigned char* data_ = nullptr;
};

std::int32_t le_i32(const unsigned char* p) {
  return std::int32_t(std::uint32_t(p[0]) | (std::uint32_t(p[1]) << 8) |
                      (std::uint32_t(p[2]) << 16) | (std::uint32_t(p[3]) << 24));
}

template <class U>
U load(const unsigned char* p) {
  U v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// f(U()) for U the type of dtype `code` (data/indexed.hpp), little-endian as every writer of
// these formats stores tokens on the machines ptrain runs on.
template <class F>
decltype(auto) with_dtype(int code, F&& f) {
  switch (code) {
    case indexed::kUint8:
      return f(std::uint8_t());
    case indexed::kInt8:
      return f(std::int8_t());
    case indexed::kInt16:
      return f(std::int16_t());
    case indexed::kUint16:
      return f(std::uint16_t());
    case indexed::kInt32:
      return f(std::int32_t());
    case indexed::kInt64:
      return f(std::int64_t());
    case indexed::kFloat32:
      return f(float());
    default:
      return f(double());
  }
}

// Whether v is an integer in [0, vocab).
template <class U>
bool is_token(U v, std::int64_t vocab) {
  if constexpr (std::is_floating_point_v<U>)
    return v >= 0 && double(v) < double(vocab) && v == std::floor(v);
  else
    return std::int64_t(v) >= 0 && std::int64_t(v) < vocab;  // no type here exceeds int64
}

// Token i of `p` as a double (integers up to 2^53 exactly: for messages).
double token_value(const unsigned char* p, int code, std::int64_t i) {
  return with_dtype(code, [&](auto u) {
    using U = decltype(u);
    return double(load<U>(p + i * std::int64_t(sizeof(U))));
  });
}

// The first of tokens [lo, hi) of `p` that is not an integer in [0, vocab), or -1.
std::int64_t first_bad_token(const unsigned char* p, int code, std::int64_t lo, std::int64_t hi,
                             std::int64_t vocab) {
  return with_dtype(code, [&](auto u) -> std::int64_t {
    using U = decltype(u);
    for (std::int64_t i = lo; i < hi; ++i)
      if (!is_token(load<U>(p + i * std::int64_t(sizeof(U))), vocab)) return i;
    return -1;
  });
}

// One dataset of a file source: its tokens (a mapped array of one dtype), the training and
// validation regions and their windows.
struct TokenFile {
  std::string path;   // data%path (the prefix of an indexed dataset)
  std::string shown;  // how the log names it
  std::unique_ptr<MappedFile> bin, idx;
  const unsigned char* tokens = nullptr;
  int code = indexed::kUint8;
  std::int64_t n = 0, n_train = 0, n_val = 0;
  std::int64_t windows = 0, val_windows = 0;  // of seq_len+1 tokens, sharing their ends
  std::int64_t documents = -1;                // indexed only

  void read(std::int64_t at, std::size_t count, std::int64_t vocab, std::int32_t* out) const {
    const bool ok = with_dtype(code, [&](auto u) {
      using U = decltype(u);
      bool all = true;
      for (std::size_t t = 0; t < count; ++t) {
        const U v = load<U>(tokens + (at + std::int64_t(t)) * std::int64_t(sizeof(U)));
        const bool in = is_token(v, vocab);  // checked on open: false only for a rewritten file
        all = all && in;
        out[t] = in ? std::int32_t(v) : 0;
      }
      return all;
    });
    if (ok) return;
    const std::int64_t bad = first_bad_token(tokens, code, at, at + std::int64_t(count), vocab);
    char value[40];
    std::snprintf(value, sizeof value, "%.17g", token_value(tokens, code, bad));
    throw Error(cat("data: ", quoted(bin->path()), ": token ", value, " at position ", bad,
                    " is not an integer in [0, model%vocab = ", vocab,
                    ") (the file changed after it was opened)"));
  }
};

void read_u16_header(TokenFile& f) {
  const MappedFile& m = *f.bin;
  const std::string file = quoted(m.path());
  if (m.size() < kU16HeaderBytes)
    fail(cat(file, " has ", m.size(), " bytes, too short for the llm.c header (", kU16HeaderBytes,
             " bytes)"));
  const unsigned char* h = m.data();
  const std::int32_t magic = le_i32(h), version = le_i32(h + 4), count = le_i32(h + 8);
  if (magic != kU16Magic)
    fail(cat(file, " is not an llm.c token file (header magic ", magic, ", expected ", kU16Magic,
             ")"));
  if (version != kU16Version)
    fail(cat(file, " has llm.c token file version ", version, ", expected ", kU16Version));
  const std::int64_t expect = kU16HeaderBytes + 2 * std::int64_t(count);
  if (count < 0 || expect != m.size())
    fail(cat(file, " header says ", count, " tokens (", expect,
             " bytes with the header) but the file has ", m.size(), " bytes"));
  f.tokens = h + kU16HeaderBytes;
  f.code = indexed::kUint16;
  f.n = count;
}

void open_indexed(TokenFile& f) {
  const std::string& prefix = f.path;
  for (const char* ext : {".bin", ".idx"})
    if (prefix.size() > 4 && prefix.compare(prefix.size() - 4, 4, ext) == 0) {
      struct stat st {};
      if (::stat((prefix + ".idx").c_str(), &st) != 0)
        fail(cat("data%path = ", quoted(prefix),
                 ": source 'indexed' takes the prefix of the two "
                 "files (",
                 quoted(prefix.substr(0, prefix.size() - 4)), " for ",
                 quoted(prefix.substr(0, prefix.size() - 4) + ".bin"), " and .idx)"));
    }
  f.idx = std::make_unique<MappedFile>(prefix + ".idx");
  f.bin = std::make_unique<MappedFile>(prefix + ".bin");
  const indexed::Index ix = indexed::parse_index(f.idx->data(), std::size_t(f.idx->size()),
                                                 f.bin->size(), f.idx->path(), f.bin->path());
  f.tokens = f.bin->data();
  f.code = ix.dtype;
  f.n = ix.tokens;
  f.documents = ix.documents;
}

class FileSource final : public TokenSource {
 public:
  FileSource(DataSpec spec, MPI_Comm comm) : TokenSource(std::move(spec)) {
    const std::int64_t T = spec_.seq_len, need = T + 1;
    // Every rank opens and checks the headers, then the ranks agree: a file one rank cannot
    // read stops them all with its message.
    mpi::agree_on(comm, [&] {
      for (const std::string& path : spec_.paths) {
        TokenFile f;
        f.path = path;
        if (path.empty()) fail(cat("data%source = '", spec_.source, "' needs a file in data%path"));
        if (spec_.source == "indexed") {
          open_indexed(f);
        } else {
          f.bin = std::make_unique<MappedFile>(path);
          if (spec_.source == "u16") {
            read_u16_header(f);
          } else {
            if (spec_.vocab < 256)
              fail(cat("source 'bytes' needs model%vocab >= 256 (a byte a token), got ",
                       spec_.vocab, " (reading ", quoted(path), ")"));
            f.tokens = f.bin->data();
            f.n = f.bin->size();
          }
        }
        f.n_val = std::int64_t(std::floor(double(f.n) * spec_.val_fraction));
        f.n_train = f.n - f.n_val;
        if (f.n_train < need)
          fail(cat(quoted(path), " has ", f.n, " tokens, needs at least seq_len+1 = ", need,
                   " in the training region (", f.n_train,
                   " after holding out val_fraction = ", spec_.val_fraction, ")"));
        if (spec_.val_fraction > 0 && f.n_val < need)
          fail(cat(quoted(path), " has ", f.n, " tokens, needs at least seq_len+1 = ", need,
                   " in the validation region (val_fraction = ", spec_.val_fraction, " gives ",
                   f.n_val, ")"));
        f.windows = (f.n_train - 1) / T;
        f.val_windows = f.n_val > 0 ? (f.n_val - 1) / T : 0;
        files_.push_back(std::move(f));
      }
    });
    check_tokens(comm);
    fingerprint_ = file_fingerprint();
  }

  void sample(Split split, const Draw& draw, std::int32_t* out) const override {
    const std::int64_t T = spec_.seq_len;
    PTRAIN_REQUIRE(draw.dataset >= 0 && draw.dataset < datasets(), "data: dataset ", draw.dataset,
                   " of ", datasets());
    const TokenFile& f = files_[std::size_t(draw.dataset)];
    const auto d = std::uint64_t(draw.dataset);
    const bool epochs = spec_.order == "epochs";
    std::int64_t offset;
    if (split == Split::train && epochs) {
      const auto W = std::uint64_t(f.windows), k = std::uint64_t(draw.k);
      offset = T * std::int64_t(rng::permute(k % W, W, spec_.seed, kEpochOrder + d, k / W));
    } else if (split == Split::train) {
      offset = std::int64_t(rng::below(std::uint64_t(f.n_train - T), spec_.seed, kTrainOffset,
                                       std::uint64_t(draw.step), std::uint64_t(draw.index)));
    } else {
      PTRAIN_REQUIRE(f.n_val > 0, "data: ", quoted(f.path),
                     " has no validation region (data%val_fraction = 0)");
      const auto i = std::uint64_t(draw.index);
      if (epochs) {
        const auto W = std::uint64_t(f.val_windows);
        offset = f.n_train + T * std::int64_t(rng::permute(i % W, W, spec_.seed, kValOrder + d, 0));
      } else {
        offset = f.n_train +
                 std::int64_t(rng::below(std::uint64_t(f.n_val - T), spec_.seed, kValOffset, i, d));
      }
    }
    f.read(offset, std::size_t(T + 1), spec_.vocab, out);
  }

  bool has_val() const override { return spec_.val_fraction > 0; }

  std::int64_t windows(int d) const override {
    return spec_.order == "epochs" ? files_.at(std::size_t(d)).windows : 0;
  }

  std::string describe() const override {
    std::string out = cat(spec_.source == "u16" ? "u16 (llm.c v1)" : spec_.source, ": ");
    for (std::size_t d = 0; d < files_.size(); ++d) {
      const TokenFile& f = files_[d];
      if (d > 0) out += "; ";
      if (files_.size() > 1) out += cat("weight ", spec_.weights[d], " ");
      out += cat(quoted(f.path), ", ", f.n, " tokens");
      if (f.documents >= 0)
        out += cat(" (", indexed::dtype_name(f.code), ") in ", f.documents, " documents");
      out += cat(": ", f.n_train, " training (", f.windows, " windows), ", f.n_val, " validation");
    }
    return cat(out, "; vocab ", spec_.vocab, ", seq_len ", spec_.seq_len, ", order '", spec_.order,
               "', seed ", spec_.seed);
  }

 private:
  // Every token of every file an integer in [0, vocab): each rank of `comm` scans its share and
  // the first bad token anywhere is every rank's error.
  void check_tokens(MPI_Comm comm) {
    const int R = mpi::size(comm), r = mpi::rank(comm);
    std::vector<std::int64_t> bad;
    for (const TokenFile& f : files_) {
      const std::int64_t lo = f.n * r / R, hi = f.n * (r + 1) / R;
      // Nothing to check where every value of the dtype is a token (bytes, most u16 files).
      const bool all = (f.code == indexed::kUint8 && spec_.vocab >= 256) ||
                       (f.code == indexed::kUint16 && spec_.vocab >= 65536);
      const std::int64_t bytes = indexed::dtype_bytes(f.code),
                         offset = f.tokens - f.bin->data();  // the header of a u16 file
      // The scan reads in order: read-ahead for it, then back to MADV_RANDOM for the windows.
      if (!all) f.bin->advise(offset + lo * bytes, offset + hi * bytes, MADV_SEQUENTIAL);
      const std::int64_t at = all ? -1 : first_bad_token(f.tokens, f.code, lo, hi, spec_.vocab);
      if (!all) f.bin->advise(offset + lo * bytes, offset + hi * bytes, MADV_RANDOM);
      bad.push_back(at < 0 ? std::numeric_limits<std::int64_t>::min() : -at);  // max = first
    }
    mpi::max(comm, bad);
    for (std::size_t d = 0; d < files_.size(); ++d) {
      if (bad[d] == std::numeric_limits<std::int64_t>::min()) continue;
      const TokenFile& f = files_[d];
      const std::int64_t at = -bad[d];
      char value[40];
      std::snprintf(value, sizeof value, "%.17g", token_value(f.tokens, f.code, at));
      throw Error(cat("data: ", quoted(f.bin->path()), ": token ", value, " at position ", at,
                      " is not an integer in [0, model%vocab = ", spec_.vocab, ")"),
                  kExitInput);
    }
  }

  std::uint64_t file_fingerprint() const {
    std::string what =
        cat(spec_.source, " ", spec_.order, " ", spec_.seq_len, " ", bits_of(spec_.val_fraction));
    for (double w : spec_.weights) what += cat(" ", bits_of(w));
    std::uint64_t h = fnv1a(what);
    auto ends = [&h](const unsigned char* p, std::int64_t n) {
      h = fnv1a(&n, sizeof n, h);
      const std::int64_t head = std::min(n, kFingerprintBytes);
      h = fnv1a(p, std::size_t(head), h);
      const std::int64_t tail = std::min(n - head, kFingerprintBytes);
      h = fnv1a(p + n - tail, std::size_t(tail), h);
    };
    for (const TokenFile& f : files_) {
      h = fnv1a(&f.code, sizeof f.code, h);
      ends(f.tokens, f.n * indexed::dtype_bytes(f.code));
      if (f.idx) ends(f.idx->data(), f.idx->size());
    }
    return h;
  }

  std::vector<TokenFile> files_;
};

std::unique_ptr<TokenSource> open_checked(const DataSpec& spec, MPI_Comm comm) {
  if (spec.vocab < 2 || spec.vocab > INT32_MAX)
    fail(cat("model%vocab = ", spec.vocab, " must be in [2, 2^31-1]"));
  if (spec.seq_len < 1) fail(cat("model%seq_len = ", spec.seq_len, " must be >= 1"));
  if (!(spec.val_fraction >= 0 && spec.val_fraction < 1))
    fail(cat("data%val_fraction = ", spec.val_fraction, " must be in [0, 1)"));
  if (spec.order != "epochs" && spec.order != "random")
    fail(cat("unknown data%order '", spec.order, "' (epochs or random)"));
  if (spec.source == "synthetic") return std::make_unique<SyntheticSource>(spec);
  if (spec.source != "bytes" && spec.source != "u16" && spec.source != "indexed")
    fail(cat("unknown data%source '", spec.source, "' (synthetic, bytes, u16 or indexed)"));
  if (spec.paths.empty())
    fail(cat("data%source = '", spec.source, "' needs data%path (the file to read)"));
  if (spec.weights.size() != spec.paths.size())
    fail(cat(spec.paths.size(), " data paths but ", spec.weights.size(), " weights"));
  for (double w : spec.weights)
    if (!(w > 0)) fail(cat("data%weights: every weight must be > 0, got ", w));
  return std::make_unique<FileSource>(spec, comm);
}

}  // namespace

DataSpec spec_from_config(const Config& config) {
  const auto& d = config.data;
  DataSpec spec;
  spec.source = d.source;
  spec.order = d.order;
  if (!d.path.empty()) {
    spec.paths = {d.path};
    spec.weights = {1.0};
  } else {
    double sum = 0;
    for (std::size_t i = 0; i < d.paths.size(); ++i)
      if (!d.paths[i].empty()) {
        spec.paths.push_back(d.paths[i]);
        spec.weights.push_back(i < d.weights.size() ? d.weights[i] : 0.0);
        sum += spec.weights.back();
      }
    for (double& w : spec.weights) w = sum > 0 ? w / sum : 0;
  }
  if (spec.source == "synthetic") spec.paths.clear(), spec.weights = {1.0};
  spec.vocab = config.model.vocab;
  spec.seq_len = config.model.seq_len;
  spec.seed = std::uint64_t(config.run.seed);
  spec.val_fraction = d.val_fraction;
  return spec;
}

std::unique_ptr<TokenSource> open_source(const DataSpec& spec, MPI_Comm comm) {
  // Whatever is wrong with the data source at open is the user's to fix, and every rank finds
  // it (FileSource agrees on what only some ranks see): exit code 2.
  try {
    return open_checked(spec, comm);
  } catch (const Error& e) {
    throw Error(e.what(), kExitInput);
  }
}

// Tijdeman's rule for the chairman assignment problem rather than Megatron's "largest deficit"
// (weight*g - count): the deficit rule leaves a dataset more than one sample off its share
// with three datasets (1.27 in test_data's blend test), while this one keeps every dataset
// within 1 - 1/(2k-2) samples of its share at every prefix. Sample g (1-based) goes, among the
// datasets whose deficit weight*g - count is at least 1/(2k-2), to the one whose next sample is due
// first ((count + 1 - 1/(2k-2)) / weight), ties to the lower index.
int next_dataset(const std::vector<double>& weights, const Position& at) {
  const std::size_t k = weights.size();
  if (k <= 1) return 0;
  const double slack = 1.0 / double(2 * k - 2), g = double(at.consumed + 1);
  int best = -1, deepest = 0;
  double due = 0, deficit_max = -1;
  for (std::size_t i = 0; i < k; ++i) {
    const double count = double(at.per_dataset[i]), deficit = weights[i] * g - count;
    if (deficit > deficit_max) deficit_max = deficit, deepest = int(i);
    if (deficit < slack - 1e-9) continue;
    const double when = (count + 1 - slack) / weights[i];
    if (best < 0 || when < due) best = int(i), due = when;
  }
  return best >= 0 ? best : deepest;  // some deficit is >= 1/k >= slack but for rounding
}

std::vector<Draw> take(const TokenSource& source, Position& at, std::int64_t step,
                       std::int64_t count) {
  const std::vector<double>& weights = source.spec().weights;
  at.per_dataset.resize(weights.size(), 0);
  std::vector<Draw> out(std::size_t(std::max<std::int64_t>(0, count)));
  for (std::int64_t j = 0; j < count; ++j) {
    const int d = next_dataset(weights, at);
    out[std::size_t(j)] = Draw{step, j, d, at.per_dataset[std::size_t(d)]};
    ++at.per_dataset[std::size_t(d)];
    ++at.consumed;
  }
  return out;
}

Position position_after(const TokenSource& source, std::int64_t consumed) {
  Position at;
  at.per_dataset.assign(std::size_t(source.datasets()), 0);
  if (source.datasets() == 1) {
    at.consumed = at.per_dataset[0] = consumed;
    return at;
  }
  while (at.consumed < consumed) {
    ++at.per_dataset[std::size_t(next_dataset(source.spec().weights, at))];
    ++at.consumed;
  }
  return at;
}

std::string describe_position(const TokenSource& source, const Position& at) {
  std::string out;
  for (int d = 0; d < source.datasets(); ++d) {
    const std::int64_t W = source.windows(d);
    if (W <= 0) return "";
    const std::int64_t k = d < int(at.per_dataset.size()) ? at.per_dataset[std::size_t(d)] : 0;
    char done[16];
    std::snprintf(done, sizeof done, "%.0f%%", 100.0 * double(k % W) / double(W));
    out += cat(d ? ", " : "", k / W + 1, " (", done, " done)");
  }
  return cat(source.datasets() > 1 ? "epochs " : "epoch ", out);
}

void fetch(const TokenSource& source, Split split, const Draw* draws, std::int64_t count,
           std::int32_t* inputs, std::int32_t* targets, const std::vector<int>& positions) {
  PTRAIN_REQUIRE(count >= 0, "data: fetch of ", count, " samples");
  PTRAIN_REQUIRE(
      split == Split::train || source.has_val(), "data: ",
      source.spec().paths.empty() ? std::string("the data") : quoted(source.spec().paths[0]),
      " has no validation region (data%val_fraction = 0)");
  const std::size_t T = std::size_t(source.spec().seq_len);
  for (int p : positions)
    PTRAIN_REQUIRE(p >= 0 && std::size_t(p) < T, "data: position ", p, " outside a sequence of ",
                   T);
  const std::size_t n = positions.empty() ? T : positions.size();
  std::vector<std::int32_t> tokens(T + 1);
  for (std::int64_t s = 0; s < count; ++s) {
    source.sample(split, draws[s], tokens.data());
    std::int32_t* in = inputs + std::size_t(s) * n;
    std::int32_t* tg = targets + std::size_t(s) * n;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t t = positions.empty() ? i : std::size_t(positions[i]);
      in[i] = tokens[t];
      tg[i] = tokens[t + 1];
    }
  }
}

}  // namespace ptrain::data
