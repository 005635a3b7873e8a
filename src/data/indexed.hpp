// data/indexed.hpp — Megatron-LM's indexed dataset: PREFIX.idx describes the token sequences
// stored back to back in PREFIX.bin (megatron/core/datasets/indexed_dataset.py). The index,
// all integers little-endian:
//   9 bytes   "MMIDIDX\0\0"
//   uint64    version, 1
//   uint8     dtype code of the tokens in .bin: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
//             6 float64, 7 float32, 8 uint16
//   uint64    S, the sequence count
//   uint64    D, the document index count (documents + 1)
//   int32[S]  sequence lengths, in tokens
//   int64[S]  sequence pointers, byte offsets into .bin
//   int64[D]  document index: 0, then the sequence index at which each document ends (S last)
// Megatron writes the sequences in order with no gaps, and so does ptrain-tokenize: the .bin is
// then every document's tokens (each ending with its end-of-document token) concatenated, which
// is how the GPT dataset reads it. parse_index checks every field; a multimodal index (a mode
// byte per sequence after the document index) is refused.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ptrain::data::indexed {

inline constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr std::size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;
inline constexpr int kUint8 = 1, kInt8 = 2, kInt16 = 3, kInt32 = 4, kInt64 = 5, kFloat64 = 6,
                     kFloat32 = 7, kUint16 = 8;

// Bytes per token of a dtype code, 0 for an unknown code.
int dtype_bytes(int code);
// "uint16", ...; "unknown" for an unknown code.
const char* dtype_name(int code);
// The code Megatron chooses for a vocabulary (DType.optimal_dtype): uint16 below 65500, else
// int32.
int dtype_for_vocab(std::int64_t vocab);

// What an index says, after every check.
struct Index {
  int dtype = 0;               // code
  int token_bytes = 0;         // dtype_bytes(dtype)
  std::int64_t sequences = 0;  // S
  std::int64_t documents = 0;  // D - 1
  std::int64_t tokens = 0;     // sum of the sequence lengths
  std::int64_t empty_documents = 0;
};

// Checks an index image of `size` bytes against a data file of `bin_bytes` bytes. Throws
// Error (exit code kExitInput) in one line naming `idx_name` (or `bin_name`) and what is wrong.
// Reads nothing past data + size; needs no alignment.
Index parse_index(const unsigned char* data, std::size_t size, std::int64_t bin_bytes,
                  const std::string& idx_name, const std::string& bin_name);

// The index image of sequences with these lengths, stored back to back, one document each.
std::string index_image(int dtype, const std::vector<std::int32_t>& lengths);

}  // namespace ptrain::data::indexed
