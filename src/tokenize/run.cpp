// tokenize/run.cpp — ptrain-tokenize's driver: arguments, the files' ranks, tokenizing into
// part files, the collective write of the dataset.
#include "tokenize/run.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "data/indexed.hpp"
#include "tokenize/json.hpp"
#include "tokenize/tokenizer.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/memory.hpp"
#include "util/mpi.hpp"
#include "util/timer.hpp"

namespace ptrain::tokenize {

namespace {

const char* kUsage =
    "usage: ptrain-tokenize --output PREFIX (--gpt2-encoder encoder.json --gpt2-merges vocab.bpe\n"
    "                       | --sentencepiece MODEL) [options] FILE...\n"
    "  Writes PREFIX.bin and PREFIX.idx, a Megatron indexed dataset (ptrain: data%source =\n"
    "  'indexed', data%path = 'PREFIX'). FILE: *.jsonl or *.json, a JSON object per line with the\n"
    "  document in a string member; any other file is one document. Run it under mpirun to\n"
    "  tokenize files on several ranks.\n"
    "  --gpt2-encoder FILE     GPT-2's encoder.json (with --gpt2-merges: byte-level BPE)\n"
    "  --gpt2-merges FILE      GPT-2's vocab.bpe\n"
    "  --sentencepiece FILE    a SentencePiece model\n"
    "  --json-key KEY          the member holding the text in JSON lines (default text)\n"
    "  --eod ID                the end-of-document id appended to every document (default: the\n"
    "                          tokenizer's <|endoftext|> or </s>)\n"
    "  --overwrite             replace an existing PREFIX.bin and PREFIX.idx\n"
    "  --help                  print this help\n";

struct Options {
  std::string output, encoder, merges, model, json_key = "text";
  std::int64_t eod = -1;  // -1: the tokenizer's
  bool overwrite = false, help = false;
  std::vector<std::string> inputs;
};

[[noreturn]] void usage_error(const std::string& what) {
  throw Error(cat("ptrain-tokenize: ", what, " (--help for usage)"), kExitInput);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      o.help = true;
    } else if (a == "--output") {
      o.output = value();
    } else if (a == "--gpt2-encoder") {
      o.encoder = value();
    } else if (a == "--gpt2-merges") {
      o.merges = value();
    } else if (a == "--sentencepiece") {
      o.model = value();
    } else if (a == "--json-key") {
      o.json_key = value();
    } else if (a == "--eod") {
      const std::string v = value();
      char* end = nullptr;
      errno = 0;
      o.eod = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || errno != 0 || o.eod < 0)
        usage_error(cat("--eod '", v, "' is not an id (an integer >= 0)"));
    } else if (a == "--overwrite") {
      o.overwrite = true;
    } else if (a.rfind("--", 0) == 0) {
      usage_error(cat("unknown option ", a));
    } else {
      o.inputs.push_back(a);
    }
  }
  if (o.help) return o;
  if (o.output.empty()) usage_error("--output PREFIX is missing");
  const bool gpt2 = !o.encoder.empty() || !o.merges.empty();
  if (gpt2 == !o.model.empty())
    usage_error("give one tokenizer: --gpt2-encoder and --gpt2-merges, or --sentencepiece");
  if (gpt2 && (o.encoder.empty() || o.merges.empty()))
    usage_error("GPT-2's BPE needs both --gpt2-encoder and --gpt2-merges");
  if (o.inputs.empty()) usage_error("no input files");
  return o;
}

bool json_lines(const std::string& path) {
  for (const char* ext : {".jsonl", ".json"}) {
    const std::size_t n = std::strlen(ext);
    if (path.size() > n && path.compare(path.size() - n, n, ext) == 0) return true;
  }
  return false;
}

// What one rank made of its files.
struct Part {
  std::vector<std::int64_t> tokens, documents;  // per input file (0 for others' files)
  std::vector<std::int32_t> lengths;            // of its documents, its files in input order
  std::int64_t text_bytes = 0;
};

// Tokenizes this rank's files into `part_path` (tokens of `bytes` each), recording counts.
void tokenize_files(const Options& o, const std::vector<int>& owner, int rank, Tokenizer& tok,
                    std::int32_t eod, int bytes, const std::string& part_path, Part& p) {
  std::FILE* out = std::fopen(part_path.c_str(), "wb");
  if (!out) throw Error(cat("cannot create '", part_path, "': ", std::strerror(errno)), kExitInput);
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(out, std::fclose);
  std::vector<std::int32_t> ids;
  std::vector<unsigned char> raw;
  auto document = [&](std::size_t f, std::string_view text) {
    ids.clear();
    tok.encode(text, ids);
    ids.push_back(eod);
    if (ids.size() > std::size_t(std::numeric_limits<std::int32_t>::max()))
      throw Error(cat("a document of ", ids.size(), " tokens (Megatron's index holds int32)"));
    raw.resize(ids.size() * std::size_t(bytes));
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::uint32_t v = std::uint32_t(ids[i]);  // < vocab: fits the dtype, little-endian
      for (int k = 0; k < bytes; ++k)
        raw[i * std::size_t(bytes) + std::size_t(k)] = (v >> (8 * k)) & 0xFF;
    }
    if (std::fwrite(raw.data(), 1, raw.size(), out) != raw.size())
      throw Error(cat("cannot write '", part_path, "': ", std::strerror(errno)));
    p.lengths.push_back(std::int32_t(ids.size()));
    p.tokens[f] += std::int64_t(ids.size());
    ++p.documents[f];
  };
  for (std::size_t f = 0; f < o.inputs.size(); ++f) {
    if (owner[f] != rank) continue;
    const std::string& path = o.inputs[f];
    if (!json_lines(path)) {
      const std::string text = read_file(path);
      p.text_bytes += std::int64_t(text.size());
      try {
        document(f, text);
      } catch (const Error& e) {
        throw Error(cat("'", path, "': ", e.what()), kExitInput);
      }
      continue;
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error(cat("cannot read '", path, "'"), kExitInput);
    std::string line;
    for (std::int64_t line_no = 1; std::getline(in, line); ++line_no) {
      p.text_bytes += std::int64_t(line.size()) + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      try {
        const auto text = json::string_member(line, o.json_key);
        if (!text) throw Error(cat("no string member '", o.json_key, "' (--json-key)"));
        document(f, *text);
      } catch (const Error& e) {
        throw Error(cat("'", path, "' line ", line_no, ": ", e.what()), kExitInput);
      }
    }
    if (in.bad()) throw Error(cat("cannot read '", path, "'"), kExitInput);
  }
  if (std::fflush(out) != 0)
    throw Error(cat("cannot write '", part_path, "': ", std::strerror(errno)));
}

// Rank 0's checks of the inputs and the output before any work: the input files' sizes.
std::vector<std::int64_t> check_files(const Options& o, MPI_Comm comm) {
  std::vector<std::int64_t> sizes(o.inputs.size(), 0);
  std::string error;
  if (mpi::rank(comm) == 0) {
    for (std::size_t f = 0; f < o.inputs.size() && error.empty(); ++f) {
      struct stat st {};
      if (::stat(o.inputs[f].c_str(), &st) != 0)
        error = cat("cannot read '", o.inputs[f], "': ", std::strerror(errno));
      else if (!S_ISREG(st.st_mode))
        error = cat("'", o.inputs[f], "' is not a regular file");
      else
        sizes[f] = std::int64_t(st.st_size);
    }
    for (const char* ext : {".bin", ".idx"}) {
      struct stat st {};
      if (error.empty() && !o.overwrite && ::stat((o.output + ext).c_str(), &st) == 0)
        error = cat("'", o.output, ext, "' exists; choose another --output or add --overwrite");
    }
    const std::size_t slash = o.output.rfind('/');
    const std::string folder = slash == std::string::npos ? "." : o.output.substr(0, slash + 1);
    if (error.empty() && ::access(folder.c_str(), W_OK) != 0)
      error =
          cat("cannot write into '", folder, "' (--output ", o.output, "): ", std::strerror(errno));
  }
  mpi::agree(comm, error.empty() ? "" : cat("ptrain-tokenize: ", error), kExitInput);
  MPI_Bcast(sizes.data(), int(sizes.size()), MPI_INT64_T, 0, comm);
  return sizes;
}

// Each file to a rank: the largest first, each to the least loaded rank (ties: the lowest).
std::vector<int> assign(const std::vector<std::int64_t>& sizes, int ranks) {
  std::vector<std::size_t> order(sizes.size());
  for (std::size_t f = 0; f < order.size(); ++f) order[f] = f;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return sizes[a] > sizes[b]; });
  std::vector<std::int64_t> load(std::size_t(ranks), 0);
  std::vector<int> owner(sizes.size(), 0);
  for (std::size_t f : order) {
    const int r = int(std::min_element(load.begin(), load.end()) - load.begin());
    owner[f] = r;
    load[std::size_t(r)] += sizes[f] + 1;  // empty files count
  }
  return owner;
}

// The ranks' part files into `path` at their files' offsets (MPI-IO); "" or this rank's error.
std::string write_data(const std::string& path, const std::string& part_path, MPI_Comm comm,
                       const std::vector<int>& owner, const std::vector<std::int64_t>& tokens,
                       int bytes) {
  MPI_File fh;
  int rc = MPI_File_open(comm, path.c_str(), MPI_MODE_CREATE | MPI_MODE_WRONLY, MPI_INFO_NULL, &fh);
  if (rc != MPI_SUCCESS) return cat("cannot create '", path, "' (MPI_File_open)");
  std::string error;
  rc = MPI_File_set_size(fh, 0);  // collective: a file left by an earlier attempt is emptied
  if (rc != MPI_SUCCESS) error = cat("cannot truncate '", path, "'");
  std::ifstream in(part_path, std::ios::binary);
  std::vector<char> buf(std::size_t(64) << 20);
  MPI_Offset at = 0;
  const int me = mpi::rank(comm);
  for (std::size_t f = 0; f < tokens.size(); ++f) {
    const std::int64_t n = tokens[f] * bytes;
    if (owner[f] == me && error.empty()) {
      for (std::int64_t done = 0; done < n && error.empty();) {
        const auto chunk = std::size_t(std::min<std::int64_t>(n - done, std::int64_t(buf.size())));
        if (!in.read(buf.data(), std::streamsize(chunk)))
          error = cat("cannot read back '", part_path, "'");
        else if (MPI_File_write_at(fh, at + done, buf.data(), int(chunk), MPI_BYTE,
                                   MPI_STATUS_IGNORE) != MPI_SUCCESS)
          error = cat("cannot write '", path, "' (MPI_File_write_at)");
        done += std::int64_t(chunk);
      }
    }
    at += n;
  }
  if (MPI_File_close(&fh) != MPI_SUCCESS && error.empty())
    error = cat("cannot close '", path, "' (MPI_File_close)");
  return error;
}

std::string mb_per_s(double bytes, double seconds) {
  char v[32];
  std::snprintf(v, sizeof v, "%.2f MB/s", seconds > 0 ? bytes / seconds / 1e6 : 0.0);
  return v;
}
std::string fixed_seconds(double seconds) {
  char v[32];
  std::snprintf(v, sizeof v, "%.2f", seconds);
  return v;
}

}  // namespace

int run(int argc, char** argv, MPI_Comm comm) {
  const Options o = parse(argc, argv);
  if (o.help) {
    log::info(kUsage);
    return kExitOk;
  }
  const int rank = mpi::rank(comm), ranks = mpi::size(comm);
  const double t0 = wall_seconds();
  std::unique_ptr<Tokenizer> tok;
  mpi::agree_on(comm, [&] {
    tok = o.model.empty() ? gpt2_bpe(o.encoder, o.merges) : sentencepiece(o.model);
  });
  const std::int64_t eod = o.eod >= 0 ? o.eod : tok->eod();
  if (eod < 0 || eod >= tok->vocab())
    throw Error(cat("ptrain-tokenize: ",
                    eod < 0 ? std::string("the tokenizer has no end-of-document token")
                            : cat("--eod ", eod, " is not below the vocabulary of ", tok->vocab()),
                    "; give --eod ID"),
                kExitInput);
  const int dtype = data::indexed::dtype_for_vocab(tok->vocab());
  const int bytes = data::indexed::dtype_bytes(dtype);
  const std::vector<std::int64_t> sizes = check_files(o, comm);
  const std::vector<int> owner = assign(sizes, ranks);
  const std::size_t F = o.inputs.size();

  // 1. Tokenize this rank's files into its part file.
  const std::string part_path = cat(o.output, ".bin.part", rank, ".tmp");
  const std::string bin_tmp = o.output + ".bin.tmp", idx_tmp = o.output + ".idx.tmp";
  auto remove_temporaries = [&] {
    std::remove(part_path.c_str());
    if (rank == 0) std::remove(bin_tmp.c_str()), std::remove(idx_tmp.c_str());
  };
  Part part;
  part.tokens.assign(F, 0);
  part.documents.assign(F, 0);
  const double t1 = wall_seconds();
  try {
    mpi::agree_on(comm, [&] {
      tokenize_files(o, owner, rank, *tok, std::int32_t(eod), bytes, part_path, part);
    });
  } catch (const Error&) {
    remove_temporaries();
    throw;
  }
  const double tokenized = wall_seconds() - t1;
  std::vector<std::int64_t> tokens = part.tokens, documents = part.documents;
  std::vector<std::int64_t> counts = {part.text_bytes};
  mpi::sum(comm, tokens);
  mpi::sum(comm, documents);
  mpi::sum(comm, counts);
  std::vector<std::int64_t> slowest = {std::int64_t(tokenized * 1e6)};
  mpi::max(comm, slowest);

  // 2. The data file, every rank writing its files; then the index, from rank 0.
  const double t2 = wall_seconds();
  std::string error = write_data(bin_tmp, part_path, comm, owner, tokens, bytes);
  std::remove(part_path.c_str());
  try {
    mpi::agree(comm, error);
  } catch (const Error&) {
    remove_temporaries();
    throw;
  }
  const int mine = int(part.lengths.size());
  std::vector<int> per_rank(static_cast<std::size_t>(ranks), 0), displs(per_rank);
  MPI_Gather(&mine, 1, MPI_INT, per_rank.data(), 1, MPI_INT, 0, comm);
  std::vector<std::int32_t> gathered;
  std::int64_t all_documents = 0, all_tokens = 0;
  for (std::size_t f = 0; f < F; ++f) all_documents += documents[f], all_tokens += tokens[f];
  if (rank == 0) {
    for (int r = 1; r < ranks; ++r)
      displs[std::size_t(r)] = displs[std::size_t(r - 1)] + per_rank[std::size_t(r - 1)];
    gathered.resize(std::size_t(all_documents));
  }
  MPI_Gatherv(part.lengths.data(), mine, MPI_INT32_T, gathered.data(), per_rank.data(),
              displs.data(), MPI_INT32_T, 0, comm);
  if (rank == 0) {
    // Each rank's lengths are its files' in input order: take them file by file.
    std::vector<std::int32_t> lengths;
    lengths.reserve(gathered.size());
    std::vector<int> cursor = displs;
    for (std::size_t f = 0; f < F; ++f) {
      int& c = cursor[std::size_t(owner[f])];
      lengths.insert(lengths.end(), gathered.begin() + c, gathered.begin() + c + documents[f]);
      c += int(documents[f]);
    }
    try {
      const std::string image = data::indexed::index_image(dtype, lengths);
      std::ofstream idx(idx_tmp, std::ios::binary | std::ios::trunc);
      if (!idx.write(image.data(), std::streamsize(image.size())).flush())
        throw Error(cat("cannot write '", idx_tmp, "'"));
      idx.close();
      data::indexed::parse_index(reinterpret_cast<const unsigned char*>(image.data()), image.size(),
                                 all_tokens * bytes, idx_tmp, bin_tmp);
      struct stat st {};
      if (::stat(bin_tmp.c_str(), &st) != 0 || std::int64_t(st.st_size) != all_tokens * bytes)
        throw Error(
            cat("'", bin_tmp, "' does not hold the ", all_tokens * bytes, " bytes written"));
      // Both whole before either replaces anything; the data file first.
      if (std::rename(bin_tmp.c_str(), (o.output + ".bin").c_str()) != 0 ||
          std::rename(idx_tmp.c_str(), (o.output + ".idx").c_str()) != 0)
        throw Error(cat("cannot rename into '", o.output, ".bin/.idx': ", std::strerror(errno)));
    } catch (const Error& e) {
      error = e.what();
    }
  }
  try {
    mpi::agree(comm, error.empty() ? "" : cat("ptrain-tokenize: ", error));
  } catch (const Error&) {
    remove_temporaries();
    throw;
  }
  const double written = wall_seconds() - t2, total = wall_seconds() - t0;
  const double text = double(counts[0]), tok_seconds = double(slowest[0]) / 1e6;
  log::info(cat("ptrain-tokenize: ", F, F == 1 ? " file, " : " files, ", all_documents,
                " documents, ", all_tokens, " tokens (", data::indexed::dtype_name(dtype),
                ", end of document ", eod, ") from ", format_bytes(text), " of text with ",
                tok->describe()));
  log::info(cat("ptrain-tokenize: tokenized in ", fixed_seconds(tok_seconds), " s (",
                mb_per_s(text, tok_seconds), " on ", ranks, ranks == 1 ? " rank" : " ranks",
                "), written in ", fixed_seconds(written), " s; ", mb_per_s(text, total),
                " overall; wrote ", o.output, ".bin and ", o.output, ".idx"));
  return kExitOk;
}

}  // namespace ptrain::tokenize
