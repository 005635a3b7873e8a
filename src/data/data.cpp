// data/data.cpp — the synthetic Markov source, the bytes / u16 file sources, fetch.
#include "data/data.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "data/rng.hpp"
#include "util/error.hpp"

namespace ptrain::data {

namespace {

// rng streams of the data module; each use of randomness has its own.
enum Stream : std::uint64_t {
  kSuccessors = 0x64617461'00000001ull,   // synthetic: successor table, (v, attempt)
  kTrainTokens = 0x64617461'00000002ull,  // synthetic: (step, j*(T+1) + t)
  kValTokens = 0x64617461'00000003ull,    // synthetic: (0, i*(T+1) + t)
  kTrainOffset = 0x64617461'00000004ull,  // files: (step, j)
  kValOffset = 0x64617461'00000005ull,    // files: (i, 0)
};

constexpr std::int32_t kU16Magic = 20240520;
constexpr std::int32_t kU16Version = 1;
constexpr std::int64_t kU16HeaderInts = 256;
constexpr std::int64_t kU16HeaderBytes = kU16HeaderInts * 4;

std::string quoted(const std::string& path) { return cat("'", path, "'"); }

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
  }

  void sample(Split split, std::int64_t step, std::int64_t index,
              std::int32_t* out) const override {
    const std::uint64_t stream = split == Split::train ? kTrainTokens : kValTokens;
    const std::uint64_t a = split == Split::train ? std::uint64_t(step) : 0;
    const std::uint64_t width = std::uint64_t(spec_.seq_len) + 1;
    const std::uint64_t base = std::uint64_t(index) * width;
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

// An open read-only file descriptor, closed on destruction.
class File {
 public:
  explicit File(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw Error(cat("data: cannot open ", quoted(path), ": ", std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw Error(cat("data: ", quoted(path), " is not a regular file"));
    }
    size_ = std::int64_t(st.st_size);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() { ::close(fd_); }

  std::int64_t size() const { return size_; }

  // Reads exactly n bytes at offset; any shortfall is an error (the file changed under us).
  void read_at(std::int64_t offset, std::size_t n, unsigned char* out) const {
    std::size_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(fd_, out + done, n - done, off_t(offset) + off_t(done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        throw Error(cat("data: reading ", n, " bytes at byte ", offset, " of ", quoted(path_),
                        " failed: ", got < 0 ? std::strerror(errno) : "unexpected end of file"));
      done += std::size_t(got);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  std::int64_t size_ = 0;
};

std::int32_t le_i32(const unsigned char* p) {
  return std::int32_t(std::uint32_t(p[0]) | (std::uint32_t(p[1]) << 8) |
                      (std::uint32_t(p[2]) << 16) | (std::uint32_t(p[3]) << 24));
}

// bytes (token_bytes 1) and u16 (token_bytes 2, llm.c header) files.
class FileSource final : public TokenSource {
 public:
  FileSource(DataSpec spec, int token_bytes)
      : TokenSource(std::move(spec)), file_(spec_.path), token_bytes_(token_bytes) {
    const std::string& path = spec_.path;
    if (token_bytes_ == 1) {
      PTRAIN_REQUIRE(spec_.vocab >= 256,
                     "data: source 'bytes' needs model%vocab >= 256 (a byte a token), got ",
                     spec_.vocab, " (reading ", quoted(path), ")");
      header_bytes_ = 0;
      n_tokens_ = file_.size();
    } else {
      read_u16_header();
    }
    n_val_ = std::int64_t(std::floor(double(n_tokens_) * spec_.val_fraction));
    n_train_ = n_tokens_ - n_val_;
    const std::int64_t need = spec_.seq_len + 1;
    PTRAIN_REQUIRE(n_train_ >= need, "data: ", quoted(path), " has ", n_tokens_,
                   " tokens, needs at least seq_len+1 = ", need, " in the training region (",
                   n_train_, " after holding out val_fraction = ", spec_.val_fraction, ")");
    PTRAIN_REQUIRE(spec_.val_fraction <= 0 || n_val_ >= need, "data: ", quoted(path), " has ",
                   n_tokens_, " tokens, needs at least seq_len+1 = ", need,
                   " in the validation region (val_fraction = ", spec_.val_fraction, " gives ",
                   n_val_, ")");
    if (token_bytes_ == 2) check_u16_tokens();
  }

  void sample(Split split, std::int64_t step, std::int64_t index,
              std::int32_t* out) const override {
    const std::int64_t T = spec_.seq_len;
    std::int64_t offset;
    if (split == Split::train) {
      offset = std::int64_t(rng::below(std::uint64_t(n_train_ - T), spec_.seed, kTrainOffset,
                                       std::uint64_t(step), std::uint64_t(index)));
    } else {
      PTRAIN_REQUIRE(n_val_ > 0, "data: ", quoted(spec_.path),
                     " has no validation region (data%val_fraction = 0)");
      offset = n_train_ + std::int64_t(rng::below(std::uint64_t(n_val_ - T), spec_.seed, kValOffset,
                                                  std::uint64_t(index)));
    }
    const std::size_t n = std::size_t(T + 1);
    std::vector<unsigned char> raw(n * std::size_t(token_bytes_));
    file_.read_at(header_bytes_ + offset * token_bytes_, raw.size(), raw.data());
    if (token_bytes_ == 1) {
      for (std::size_t t = 0; t < n; ++t) out[t] = raw[t];
    } else {
      // Checked again here: a file rewritten during the run must not feed tokens >= vocab.
      for (std::size_t t = 0; t < n; ++t) {
        out[t] = raw[2 * t] | (raw[2 * t + 1] << 8);
        PTRAIN_REQUIRE(out[t] < spec_.vocab, "data: ", quoted(spec_.path), ": token ", out[t],
                       " at position ", offset + std::int64_t(t),
                       " is >= model%vocab = ", spec_.vocab,
                       " (the file changed after it was opened)");
      }
    }
  }

  bool has_val() const override { return n_val_ > 0; }

  std::string describe() const override {
    return cat(token_bytes_ == 1 ? "bytes" : "u16 (llm.c v1)", ": ", quoted(spec_.path), ", ",
               n_tokens_, " tokens: ", n_train_, " training, ", n_val_, " validation; vocab ",
               spec_.vocab, ", seq_len ", spec_.seq_len, ", seed ", spec_.seed);
  }

 private:
  void read_u16_header() {
    const std::string& path = spec_.path;
    PTRAIN_REQUIRE(file_.size() >= kU16HeaderBytes, "data: ", quoted(path), " has ", file_.size(),
                   " bytes, too short for the llm.c header (", kU16HeaderBytes, " bytes)");
    unsigned char h[kU16HeaderBytes];
    file_.read_at(0, sizeof h, h);
    const std::int32_t magic = le_i32(h), version = le_i32(h + 4), count = le_i32(h + 8);
    PTRAIN_REQUIRE(magic == kU16Magic, "data: ", quoted(path),
                   " is not an llm.c token file (header magic ", magic, ", expected ", kU16Magic,
                   ")");
    PTRAIN_REQUIRE(version == kU16Version, "data: ", quoted(path), " has llm.c token file version ",
                   version, ", expected ", kU16Version);
    const std::int64_t expect = kU16HeaderBytes + 2 * std::int64_t(count);
    PTRAIN_REQUIRE(count >= 0 && expect == file_.size(), "data: ", quoted(path), " header says ",
                   count, " tokens (", expect, " bytes with the header) but the file has ",
                   file_.size(), " bytes");
    header_bytes_ = kU16HeaderBytes;
    n_tokens_ = count;
  }

  // Streams the whole token array once, in chunks, for the first token >= vocab.
  void check_u16_tokens() const {
    constexpr std::int64_t kChunk = 1 << 20;
    std::vector<unsigned char> raw(std::size_t(2 * kChunk));
    for (std::int64_t first = 0; first < n_tokens_; first += kChunk) {
      const std::int64_t n = std::min(kChunk, n_tokens_ - first);
      file_.read_at(header_bytes_ + 2 * first, std::size_t(2 * n), raw.data());
      for (std::int64_t t = 0; t < n; ++t) {
        const std::int64_t token = raw[2 * t] | (raw[2 * t + 1] << 8);
        PTRAIN_REQUIRE(token < spec_.vocab, "data: ", quoted(spec_.path), ": token ", token,
                       " at position ", first + t, " is >= model%vocab = ", spec_.vocab);
      }
    }
  }

  File file_;
  int token_bytes_ = 1;
  std::int64_t header_bytes_ = 0, n_tokens_ = 0, n_train_ = 0, n_val_ = 0;
};

}  // namespace

DataSpec spec_from_config(const Config& config) {
  DataSpec spec;
  spec.source = config.data.source;
  spec.path = config.data.path;
  spec.vocab = config.model.vocab;
  spec.seq_len = config.model.seq_len;
  spec.seed = std::uint64_t(config.run.seed);
  spec.val_fraction = config.data.val_fraction;
  return spec;
}

namespace {

std::unique_ptr<TokenSource> open_checked(const DataSpec& spec) {
  PTRAIN_REQUIRE(spec.vocab >= 2 && spec.vocab <= INT32_MAX, "data: model%vocab = ", spec.vocab,
                 " must be in [2, 2^31-1]");
  PTRAIN_REQUIRE(spec.seq_len >= 1, "data: model%seq_len = ", spec.seq_len, " must be >= 1");
  PTRAIN_REQUIRE(spec.val_fraction >= 0 && spec.val_fraction < 1,
                 "data: data%val_fraction = ", spec.val_fraction, " must be in [0, 1)");
  if (spec.source == "synthetic") return std::make_unique<SyntheticSource>(spec);
  if (spec.source == "bytes" || spec.source == "u16") {
    PTRAIN_REQUIRE(!spec.path.empty(), "data: data%source = '", spec.source,
                   "' needs data%path (the file to read)");
    return std::make_unique<FileSource>(spec, spec.source == "bytes" ? 1 : 2);
  }
  throw Error(cat("data: unknown data%source '", spec.source, "' (synthetic, bytes or u16)"));
}

}  // namespace

std::unique_ptr<TokenSource> open_source(const DataSpec& spec) {
  // Whatever is wrong with the data source at open is the user's to fix (and every rank
  // finds the same): exit code 2.
  try {
    return open_checked(spec);
  } catch (const Error& e) {
    throw Error(e.what(), kExitInput);
  }
}

void fetch(const TokenSource& source, Split split, std::int64_t step, std::int64_t first_sample,
           std::int64_t count, std::int32_t* inputs, std::int32_t* targets,
           const std::vector<int>& positions) {
  PTRAIN_REQUIRE(first_sample >= 0 && count >= 0 && step >= 0, "data: fetch of samples [",
                 first_sample, ", ", first_sample + count, ") of step ", step, " is out of range");
  PTRAIN_REQUIRE(split == Split::train || source.has_val(), "data: ", quoted(source.spec().path),
                 " has no validation region (data%val_fraction = 0)");
  const std::size_t T = std::size_t(source.spec().seq_len);
  for (int p : positions)
    PTRAIN_REQUIRE(p >= 0 && std::size_t(p) < T, "data: position ", p, " outside a sequence of ",
                   T);
  const std::size_t n = positions.empty() ? T : positions.size();
  std::vector<std::int32_t> tokens(T + 1);
  for (std::int64_t s = 0; s < count; ++s) {
    source.sample(split, step, first_sample + s, tokens.data());
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
