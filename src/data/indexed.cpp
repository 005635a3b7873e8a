// data/indexed.cpp — Megatron's index (.idx): checked parse, and the image ptrain-tokenize writes.
#include "data/indexed.hpp"

#include <cstring>
#include <limits>

#include "util/error.hpp"

namespace ptrain::data::indexed {

namespace {

std::uint64_t le_u64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int k = 7; k >= 0; --k) v = (v << 8) | p[k];
  return v;
}
std::int32_t le_i32(const unsigned char* p) {
  return std::int32_t(std::uint32_t(p[0]) | (std::uint32_t(p[1]) << 8) |
                      (std::uint32_t(p[2]) << 16) | (std::uint32_t(p[3]) << 24));
}
void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int k = 0; k < bytes; ++k) out.push_back(char((v >> (8 * k)) & 0xFF));
}

std::string quoted(const std::string& s) { return cat("'", s, "'"); }

}  // namespace

int dtype_bytes(int code) {
  switch (code) {
    case kUint8:
    case kInt8:
      return 1;
    case kInt16:
    case kUint16:
      return 2;
    case kInt32:
    case kFloat32:
      return 4;
    case kInt64:
    case kFloat64:
      return 8;
    default:
      return 0;
  }
}

const char* dtype_name(int code) {
  static const char* const names[] = {"unknown", "uint8",   "int8",    "int16", "int32",
                                      "int64",   "float64", "float32", "uint16"};
  return code >= 1 && code <= 8 ? names[code] : names[0];
}

int dtype_for_vocab(std::int64_t vocab) { return vocab < 65500 ? kUint16 : kInt32; }

Index parse_index(const unsigned char* data, std::size_t size, std::int64_t bin_bytes,
                  const std::string& idx_name, const std::string& bin_name) {
  const std::string idx = quoted(idx_name);
  auto fail = [&](const std::string& what) { throw Error(cat("data: ", what), kExitInput); };
  if (size < kHeaderBytes)
    fail(cat(idx, " has ", size, " bytes, too short for the header of a Megatron indexed dataset (",
             kHeaderBytes, " bytes)"));
  if (std::memcmp(data, kMagic, sizeof kMagic) != 0)
    fail(cat(idx,
             " is not a Megatron indexed dataset index (it does not begin with MMIDIDX\\0\\0)"));
  const std::uint64_t version = le_u64(data + 9);
  if (version != 1) fail(cat(idx, " has index version ", version, ", expected 1"));
  Index ix;
  ix.dtype = data[17];
  ix.token_bytes = dtype_bytes(ix.dtype);
  if (ix.token_bytes == 0)
    fail(cat(idx, " has dtype code ", ix.dtype,
             "; known codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, "
             "8 uint16"));
  const std::uint64_t S = le_u64(data + 18), D = le_u64(data + 26);
  // 20 bytes per sequence (length, pointer, at most one document index) and 8 per document
  // index must fit in the file: larger counts are refused before any arithmetic overflows.
  const std::uint64_t room = size - kHeaderBytes;
  if (S > room / 12 || D > room / 8 || 12 * S + 8 * D != room) {
    const bool modes = S <= room / 13 && D <= room / 8 && 13 * S + 8 * D == room && S > 0;
    if (modes)
      fail(cat(idx,
               " is a multimodal index (a mode byte per sequence), which ptrain does not read"));
    fail(cat(idx, " header says ", S, " sequences and a document index of ", D,
             " entries, which needs ", kHeaderBytes, " + 12*", S, " + 8*", D,
             " bytes, but the file has ", size, " bytes (truncated or not an index)"));
  }
  if (D < 1) fail(cat(idx, " has an empty document index (it must hold at least the leading 0)"));
  ix.sequences = std::int64_t(S);
  ix.documents = std::int64_t(D) - 1;
  const unsigned char* lengths = data + kHeaderBytes;
  const unsigned char* pointers = lengths + 4 * S;
  const unsigned char* documents = pointers + 8 * S;
  // Sequences back to back: pointer i is the bytes of the sequences before it.
  std::uint64_t at = 0;
  const std::uint64_t limit = std::uint64_t(std::numeric_limits<std::int64_t>::max());
  for (std::uint64_t i = 0; i < S; ++i) {
    const std::int32_t n = le_i32(lengths + 4 * i);
    if (n < 0) fail(cat(idx, ": sequence ", i, " has length ", n));
    const std::uint64_t p = le_u64(pointers + 8 * i);
    if (p != at)
      fail(cat(idx, ": sequence ", i, " starts at byte ", p, " of the data file, expected ", at,
               " (sequences must be stored back to back, as Megatron writes them)"));
    at += std::uint64_t(n) * std::uint64_t(ix.token_bytes);  // < 2^31 * 8 * 2^60: checked below
    if (at > limit) fail(cat(idx, ": the sequences hold more than 2^63 bytes"));
    ix.tokens += n;
  }
  if (bin_bytes < 0 || std::uint64_t(bin_bytes) != at)
    fail(cat(quoted(bin_name), " has ", bin_bytes, " bytes, but its index ", idx, " says ", S,
             " sequences of ", ix.tokens, " ", dtype_name(ix.dtype), " tokens (", at,
             " bytes): the two files do not belong together, or one is truncated"));
  std::uint64_t prev = 0;
  for (std::uint64_t d = 0; d < D; ++d) {
    const std::uint64_t v = le_u64(documents + 8 * d);
    if (d == 0 && v != 0) fail(cat(idx, ": the document index begins with ", v, ", expected 0"));
    if (v < prev || v > S)
      fail(cat(idx, ": document index entry ", d, " is ", v, ", expected ", prev, " to ", S,
               " (non-decreasing sequence indices)"));
    if (d > 0 && v == prev) ++ix.empty_documents;
    prev = v;
  }
  if (prev != S)
    fail(cat(idx, ": the document index ends at sequence ", prev, ", expected ", S,
             " (every sequence in a document)"));
  return ix;
}

std::string index_image(int dtype, const std::vector<std::int32_t>& lengths) {
  const int bytes = dtype_bytes(dtype);
  PTRAIN_REQUIRE(bytes > 0, "data: index_image: unknown dtype code ", dtype);
  std::string out(kMagic, sizeof kMagic);
  const std::uint64_t S = lengths.size();
  put_le(out, 1, 8);
  put_le(out, std::uint64_t(dtype), 1);
  put_le(out, S, 8);
  put_le(out, S + 1, 8);
  out.reserve(kHeaderBytes + 20 * S + 8);
  for (std::int32_t n : lengths) put_le(out, std::uint32_t(n), 4);
  std::uint64_t at = 0;
  for (std::int32_t n : lengths) {
    put_le(out, at, 8);
    at += std::uint64_t(n) * std::uint64_t(bytes);
  }
  for (std::uint64_t d = 0; d <= S; ++d) put_le(out, d, 8);
  return out;
}

}  // namespace ptrain::data::indexed
