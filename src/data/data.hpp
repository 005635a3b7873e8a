// data/data.hpp — token sources and layout-invariant sampling (docs/ARCHITECTURE.md, "One training
// step").
//
// Sample j of training step s is a pure function of (seed, s, j): the same whatever the
// rank count or micro-batch size. A rank fetches a contiguous slice [first, first+count)
// of the global batch; validation sample i is a pure function of (seed, i) (a fixed set).
//
// Sources (DataSpec::source):
//   synthetic  order-1 Markov chain over the vocabulary. Token v has k = min(4, vocab)
//              distinct successors (chosen by hashing (seed, v)) with probabilities
//              1/2, 1/4, 1/8, 1/8 (k = 3: 1/2, 1/4, 1/4; k = 2: 1/2, 1/2); the first token
//              of a sample is uniform and is never a target, so every predicted position
//              has conditional entropy H = -sum p ln p (vocab >= 4: 1.75 ln 2 = 1.2130 nats),
//              the loss floor. Validation uses another stream of the same chain.
//   bytes      any file, one byte a token (vocab >= 256).
//   u16        llm.c token file: 256 int32 header (magic 20240520, version 1, token count)
//              then little-endian uint16 tokens; every token is checked < vocab on open.
//   For files, the last floor(n * val_fraction) tokens are the validation region. Training
//   sample (s, j) is the seq_len+1 tokens at offset draw(seed, s, j) mod (n_train - seq_len);
//   validation sample i at its own offset in the validation region. Files are read by
//   offset (pread), never loaded whole.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "deck/config.hpp"

namespace ptrain::data {

struct DataSpec {
  std::string source = "synthetic";  // synthetic | bytes | u16
  std::string path;                  // file for bytes / u16
  std::int64_t vocab = 256, seq_len = 64;
  std::uint64_t seed = 1234;
  double val_fraction = 0.1;  // tail of the file held out (files only)
};

// config.data.*, config.model.vocab / seq_len, config.run.seed.
DataSpec spec_from_config(const Config& config);

enum class Split { train, val };

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  const DataSpec& spec() const { return spec_; }
  // Writes the seq_len+1 tokens of one sample to out. For Split::val, step is ignored and
  // index is the validation sample. Thread-safe (const, no shared file offset).
  virtual void sample(Split split, std::int64_t step, std::int64_t index,
                      std::int32_t* out) const = 0;
  virtual bool has_val() const = 0;  // false for a file with val_fraction 0
  virtual std::optional<double> entropy_floor() const { return std::nullopt; }  // nats/token
  virtual std::string describe() const = 0;  // one line for the log

 protected:
  explicit TokenSource(DataSpec spec) : spec_(std::move(spec)) {}
  DataSpec spec_;
};

// Opens and validates the source; throws ptrain::Error (one line naming the file, exit
// code 2: the data is the user's input).
std::unique_ptr<TokenSource> open_source(const DataSpec& spec);

// Samples first_sample .. first_sample+count-1 of `step` (train) or of the validation set
// (val; step ignored): inputs = tokens[0, T), targets = tokens[1, T]. Both (count, T), host.
// With `positions` only those of each sample (a context-parallel rank's share of the
// same samples): inputs(s, i) = tokens[positions[i]], targets(s, i) = tokens[positions[i]+1],
// both (count, positions.size()).
void fetch(const TokenSource& source, Split split, std::int64_t step, std::int64_t first_sample,
           std::int64_t count, std::int32_t* inputs, std::int32_t* targets,
           const std::vector<int>& positions = {});

}  // namespace ptrain::data
