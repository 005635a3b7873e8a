// data/data.hpp — token sources, the order of training samples, blends (docs/ARCHITECTURE.md,
// "Data").
//
// Every training sample is named the same way on every grid: sample j of step s is the
// (consumed + j)-th sample of the stream, where `consumed` counts the samples of the steps
// before (a Position, kept in checkpoints). Which dataset of a blend it comes from and which
// window of that dataset it is are pure functions of the position and the seed, so any rank
// computes any sample, and a restart on any grid (any dp, any micro-batch) continues with
// exactly the samples an uninterrupted run would have drawn. A rank fetches a contiguous slice
// of the global batch; validation sample i of dataset d is a pure function of (seed, d, i).
//
// Sources (DataSpec::source):
//   synthetic  order-1 Markov chain over the vocabulary. Token v has k = min(4, vocab)
//              distinct successors (chosen by hashing (seed, v)) with probabilities
//              1/2, 1/4, 1/8, 1/8 (k = 3: 1/2, 1/4, 1/4; k = 2: 1/2, 1/2); the first token
//              of a sample is uniform and is never a target, so every predicted position
//              has conditional entropy H = -sum p ln p (vocab >= 4: 1.75 ln 2 = 1.2130 nats),
//              the loss floor. An endless process: sample (s, j) is drawn from (seed, s, j)
//              whatever data%order says. Validation uses another stream of the same chain.
//   bytes      any file, one byte a token (vocab >= 256).
//   u16        llm.c token file: 256 int32 header (magic 20240520, version 1, token count)
//              then little-endian uint16 tokens.
//   indexed    Megatron-LM's indexed dataset PREFIX.bin + PREFIX.idx (data/indexed.hpp): its
//              documents concatenated in file order, each with the end-of-document token
//              its writer appended, as Megatron's GPT dataset reads them.
// Files are memory-mapped, never read whole; every token is checked < vocab (and integral, for
// float dtypes) on open, the scan shared by the ranks that open the source. The last
// floor(n * val_fraction) tokens of a file are its validation region, the rest its training
// region.
//
// Order of a file's training samples (DataSpec::order):
//   epochs  the training region cut into W = floor((n_train - 1) / seq_len) windows of
//           seq_len+1 tokens (window w starts at token w*seq_len: the last token of one is the
//           first of the next, as in Megatron's GPT dataset); the k-th sample drawn from the
//           dataset is window perm_e(k mod W) of epoch e = k / W, perm_e a permutation of the W
//           windows that is a pure function of (seed, dataset, e) (rng::permute). Every window
//           is drawn once per epoch. Validation sample i is window perm(i mod Wv) of the
//           validation region's Wv windows.
//   random  the draw of earlier versions: sample (s, j) starts at a token offset drawn from
//           (seed, s, j) in [0, n_train - seq_len), with replacement; validation sample i at an
//           offset drawn from (seed, i).
// Blends (several paths, with weights): sample g (from 1) comes, among the datasets at least
// 1/(2k-2) behind weight*g, from the one whose next sample is due first (next_dataset), so
// every prefix of the stream holds each of the k datasets within one sample of its share;
// each dataset then has its own epochs.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "deck/config.hpp"

namespace ptrain::data {

struct DataSpec {
  std::string source = "synthetic";  // synthetic | bytes | u16 | indexed
  std::vector<std::string> paths;    // one file (indexed: prefix) per dataset; none if synthetic
  std::vector<double> weights;       // one per path, summing to 1
  std::string order = "epochs";      // epochs | random
  std::int64_t vocab = 256, seq_len = 64;
  std::uint64_t seed = 1234;
  double val_fraction = 0.1;  // tail of each file held out (files only)
};

// config.data.*, config.model.vocab / seq_len, config.run.seed; data%path is a blend of one.
DataSpec spec_from_config(const Config& config);

enum class Split { train, val };

// One sample, as every grid names it. Training: sample `index` (j) of step `step`, the
// `k`-th sample drawn from dataset `dataset`. Validation: sample `index` of dataset `dataset`.
struct Draw {
  std::int64_t step = 0, index = 0;
  int dataset = 0;
  std::int64_t k = 0;
};

// Where the training stream is: samples drawn so far, and how many from each dataset (they sum
// to `consumed`). A checkpoint keeps it.
struct Position {
  std::int64_t consumed = 0;
  std::vector<std::int64_t> per_dataset;
};

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  const DataSpec& spec() const { return spec_; }
  int datasets() const { return int(spec_.weights.size()); }
  // Writes the seq_len+1 tokens of one sample to out (for Split::val only index and dataset
  // count). Thread-safe (const).
  virtual void sample(Split split, const Draw& draw, std::int32_t* out) const = 0;
  virtual bool has_val() const = 0;  // false for files with val_fraction 0
  // Training windows of dataset d with order 'epochs' (the epoch length in samples); 0 when
  // the source has no epochs (synthetic, order 'random').
  virtual std::int64_t windows(int d) const { return 0; }
  virtual std::optional<double> entropy_floor() const { return std::nullopt; }  // nats/token
  virtual std::string describe() const = 0;  // one line for the log
  // What the samples are made from: the source, order, seq_len, val_fraction, weights and each
  // file's token count with a hash of its first and last MiB (and the whole index of an
  // indexed dataset), so a restart can tell it reads other data. Not the file names.
  std::uint64_t fingerprint() const { return fingerprint_; }

 protected:
  explicit TokenSource(DataSpec spec) : spec_(std::move(spec)) {}
  DataSpec spec_;
  std::uint64_t fingerprint_ = 0;
};

// Opens and validates the source on every rank of `comm` (the ranks that will read it; they
// share the scan of the tokens): throws ptrain::Error (one line naming the file, exit code 2:
// the data is the user's input), the same on every rank.
std::unique_ptr<TokenSource> open_source(const DataSpec& spec, MPI_Comm comm = MPI_COMM_SELF);

// The dataset of the next sample after `at` (Tijdeman's rule; data.cpp says why not Megatron's).
int next_dataset(const std::vector<double>& weights, const Position& at);
// The draws of the `count` samples of step `step` from `at`, which moves past them.
std::vector<Draw> take(const TokenSource& source, Position& at, std::int64_t step,
                       std::int64_t count);
// The position after `consumed` samples from the start (the blend replayed).
Position position_after(const TokenSource& source, std::int64_t consumed);
// "epoch 3 (41% done)", for a blend "epochs 3 (41% done), 1 (7% done)"; "" without epochs.
std::string describe_position(const TokenSource& source, const Position& at);

// The samples `draws[0, count)`: inputs = tokens[0, T), targets = tokens[1, T], both
// (count, T), host. With `positions` only those of each sample (a context-parallel rank's
// share of the same samples): inputs(s, i) = tokens[positions[i]], targets(s, i) =
// tokens[positions[i]+1], both (count, positions.size()).
void fetch(const TokenSource& source, Split split, const Draw* draws, std::int64_t count,
           std::int32_t* inputs, std::int32_t* targets, const std::vector<int>& positions = {});

}  // namespace ptrain::data
