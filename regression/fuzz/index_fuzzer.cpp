// regression/fuzz/index_fuzzer.cpp — libFuzzer target for the reader of Megatron's index
// (data/indexed.hpp, parse_index). The input: 8 bytes, the data file's size (little-endian),
// then the index image. Findings: any crash or undefined behaviour (ASan, UBSan), a read past
// the image (ASan: the image is copied into a buffer of exactly its size), and any broken
// promise: an error is ptrain::Error with exit code 2 in one line naming the index or data
// file; an index it accepts adds up (its sequences fill the data file exactly, a document
// count below the index's length).
// `index_fuzzer --write-seeds DIR` writes the seed corpus (run.sh does) and exits: the images
// ptrain-tokenize writes (index_image) for a few dtypes and sequence lengths.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "data/indexed.hpp"
#include "util/error.hpp"

namespace {

using namespace ptrain;
namespace ix = ptrain::data::indexed;

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "index_fuzzer: %s\n", what.c_str());
  std::abort();
}

std::string input_of(std::int64_t bin_bytes, const std::string& image) {
  std::string out;
  for (int k = 0; k < 8; ++k) out.push_back(char((std::uint64_t(bin_bytes) >> (8 * k)) & 0xFF));
  return out + image;
}

void write_seeds(const std::string& dir) {
  int n = 0;
  const std::vector<std::vector<std::int32_t>> lengths = {{}, {1}, {0}, {3, 0, 5}, {7, 1, 1, 9}};
  for (int dtype = 1; dtype <= 8; ++dtype)
    for (const auto& l : lengths) {
      std::int64_t tokens = 0;
      for (auto x : l) tokens += x;
      std::ofstream f(cat(dir, "/seed", n++), std::ios::binary);
      const std::string in = input_of(tokens * ix::dtype_bytes(dtype), ix::index_image(dtype, l));
      f.write(in.data(), std::streamsize(in.size()));
      if (!f) finding("--write-seeds: cannot write into " + dir);
    }
  std::printf("index_fuzzer: %d seeds in %s\n", n, dir.c_str());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  for (int i = 1; i + 1 < *argc; ++i)
    if (std::strcmp((*argv)[i], "--write-seeds") == 0) {
      write_seeds((*argv)[i + 1]);
      std::exit(0);
    }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 8) return 0;
  std::uint64_t bin = 0;
  for (int k = 7; k >= 0; --k) bin = (bin << 8) | data[k];
  // The image alone, in a buffer of its own size: ASan sees any read past it.
  std::vector<unsigned char> image(data + 8, data + size);
  const unsigned char* p = image.empty() ? nullptr : image.data();
  try {
    const ix::Index x = ix::parse_index(p, image.size(), std::int64_t(bin), "f.idx", "f.bin");
    if (x.token_bytes != ix::dtype_bytes(x.dtype) || x.token_bytes == 0)
      finding(cat("accepted dtype ", x.dtype, " with ", x.token_bytes, " bytes a token"));
    if (std::uint64_t(x.tokens) * std::uint64_t(x.token_bytes) != bin)
      finding(cat("accepted ", x.tokens, " tokens of ", x.token_bytes, " bytes for a data file of ",
                  bin, " bytes"));
    if (x.sequences < 0 || x.documents < 0 || x.empty_documents > x.documents ||
        ix::kHeaderBytes + 12 * std::uint64_t(x.sequences) + 8 * std::uint64_t(x.documents) + 8 !=
            image.size())
      finding(cat("accepted ", x.sequences, " sequences and ", x.documents, " documents in ",
                  image.size(), " bytes"));
  } catch (const Error& e) {
    const std::string m = e.what();
    if (e.exit_code() != kExitInput) finding(cat("exit code ", e.exit_code(), ": ", m));
    if (m.find('\n') != std::string::npos) finding("a message of more than one line: " + m);
    if (m.find("'f.idx'") == std::string::npos && m.find("'f.bin'") == std::string::npos)
      finding("a message naming neither file: " + m);
  }
  return 0;
}
