// tokenize/gpt2.cpp — GPT-2's byte-level BPE: PCRE2 for the pre-tokenizer, merges over ids.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <limits>
#include <unordered_map>

#include "tokenize/json.hpp"
#include "tokenize/tokenizer.hpp"
#include "util/error.hpp"

namespace ptrain::tokenize {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(cat("cannot read '", path, "'"), kExitInput);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) throw Error(cat("cannot read '", path, "'"), kExitInput);
  return s;
}

namespace {

// GPT-2's pre-tokenizer (openai/gpt-2 src/encoder.py).
constexpr const char* kPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode: the printable Latin-1 bytes stand for themselves, the others for
// 256, 257, ... in byte order; as UTF-8.
std::vector<std::string> byte_symbols() {
  std::vector<int> code(256, -1);
  for (int b = 0; b < 256; ++b)
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))
      code[std::size_t(b)] = b;
  int next = 256;
  for (int b = 0; b < 256; ++b)
    if (code[std::size_t(b)] < 0) code[std::size_t(b)] = next++;
  std::vector<std::string> out;
  for (int c : code) {
    std::string s;
    if (c < 0x80) {
      s.push_back(char(c));
    } else {
      s.push_back(char(0xC0 | (c >> 6)));
      s.push_back(char(0x80 | (c & 0x3F)));
    }
    out.push_back(s);
  }
  return out;
}

std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
  return (std::uint64_t(std::uint32_t(a)) << 32) | std::uint32_t(b);
}

class Gpt2 final : public Tokenizer {
 public:
  Gpt2(const std::string& encoder_path, const std::string& merges_path) {
    const std::string where = cat("'", encoder_path, "'");
    std::unordered_map<std::string, std::int32_t> ids;
    try {
      for (auto& [token, id] : json::integer_object(read_file(encoder_path))) {
        if (id < 0 || id > std::numeric_limits<std::int32_t>::max())
          throw Error(cat("id ", id, " of '", token, "' is out of range"));
        ids[token] = std::int32_t(id);
        vocab_ = std::max<std::int64_t>(vocab_, id + 1);
      }
    } catch (const Error& e) {
      throw Error(cat(where, ": ", e.what(), " (expected GPT-2's encoder.json)"), kExitInput);
    }
    const auto symbols = byte_symbols();
    for (int b = 0; b < 256; ++b) {
      auto it = ids.find(symbols[std::size_t(b)]);
      if (it == ids.end())
        throw Error(cat(where, " has no token for byte ", b, " (GPT-2's byte symbol '",
                        symbols[std::size_t(b)], "'): not a byte-level BPE vocabulary"),
                    kExitInput);
      byte_id_[b] = it->second;
    }
    auto eod = ids.find("<|endoftext|>");
    eod_ = eod == ids.end() ? -1 : eod->second;
    // vocab.bpe: "#version: ..." then a merge "A B" a line; rank = its place among them. A
    // later line of the same pair wins, as in encoder.py's dict.
    const std::string text = read_file(merges_path);
    std::int32_t rank = 0;
    std::size_t line_no = 0;
    for (std::size_t begin = 0; begin < text.size();) {
      std::size_t end = text.find('\n', begin);
      if (end == std::string::npos) end = text.size();
      std::string line = text.substr(begin, end - begin);
      begin = end + 1;
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
      const std::size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos)
        throw Error(cat("'", merges_path, "' line ", line_no,
                        ": expected two symbols and a blank (GPT-2's vocab.bpe)"),
                    kExitInput);
      const std::string a = line.substr(0, space), b = line.substr(space + 1);
      auto ia = ids.find(a), ib = ids.find(b), iab = ids.find(a + b);
      if (ia == ids.end() || ib == ids.end() || iab == ids.end())
        throw Error(cat("'", merges_path, "' line ", line_no, ": the merge '", line, "' uses ",
                        iab == ids.end() ? "or makes " : "", "a token not in ", where),
                    kExitInput);
      merges_[pair_key(ia->second, ib->second)] = {rank++, iab->second};
    }
    int code = 0;
    PCRE2_SIZE offset = 0;
    re_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPattern), PCRE2_ZERO_TERMINATED,
                        PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
    if (!re_) throw Error(cat("GPT-2 pattern: PCRE2 error ", code, " at ", offset));
    pcre2_jit_compile(re_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when absent
    match_ = pcre2_match_data_create_from_pattern(re_, nullptr);
    description_ = cat("GPT-2 byte-level BPE (", where, ", ", rank, " merges from '", merges_path,
                       "'), vocab ", vocab_);
  }
  ~Gpt2() override {
    pcre2_match_data_free(match_);
    pcre2_code_free(re_);
  }
  Gpt2(const Gpt2&) = delete;
  Gpt2& operator=(const Gpt2&) = delete;

  void encode(std::string_view text, std::vector<std::int32_t>& out) override {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    PCRE2_SIZE at = 0;
    std::uint32_t options = 0;  // the first match checks the whole text is UTF-8
    while (at < text.size()) {
      const int rc = pcre2_match(re_, subject, text.size(), at, options, match_, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(rc, message, sizeof message);
        throw Error(cat("not valid UTF-8 text (", reinterpret_cast<const char*>(message),
                        ", at byte ", pcre2_get_startchar(match_), ")"),
                    kExitInput);
      }
      options = PCRE2_NO_UTF_CHECK;
      const PCRE2_SIZE* v = pcre2_get_ovector_pointer(match_);
      if (v[1] <= v[0]) break;  // every alternative takes a character: not reached
      bpe(text.substr(v[0], v[1] - v[0]), out);
      at = v[1];
    }
  }

  std::int64_t vocab() const override { return vocab_; }
  std::int32_t eod() const override { return eod_; }
  std::string describe() const override { return description_; }

 private:
  // The ids of one piece: its bytes' symbols merged, lowest rank first (cached: pieces repeat).
  void bpe(std::string_view piece, std::vector<std::int32_t>& out) {
    auto hit = cache_.find(std::string(piece));
    if (hit != cache_.end()) {
      out.insert(out.end(), hit->second.begin(), hit->second.end());
      return;
    }
    std::vector<std::int32_t> word, next;
    for (unsigned char c : piece) word.push_back(byte_id_[c]);
    while (word.size() > 1) {
      std::int32_t best = std::numeric_limits<std::int32_t>::max(), merged = -1, first = 0,
                   second = 0;
      for (std::size_t i = 0; i + 1 < word.size(); ++i) {
        auto m = merges_.find(pair_key(word[i], word[i + 1]));
        if (m != merges_.end() && m->second.first < best)
          best = m->second.first, merged = m->second.second, first = word[i], second = word[i + 1];
      }
      if (merged < 0) break;
      next.clear();
      for (std::size_t i = 0; i < word.size(); ++i) {
        if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
          next.push_back(merged);
          ++i;
        } else {
          next.push_back(word[i]);
        }
      }
      word.swap(next);
    }
    out.insert(out.end(), word.begin(), word.end());
    if (cache_.size() < kCacheEntries) cache_.emplace(std::string(piece), std::move(word));
  }

  static constexpr std::size_t kCacheEntries = 1 << 20;
  std::int64_t vocab_ = 0;
  std::int32_t eod_ = -1;
  std::int32_t byte_id_[256] = {};
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, std::int32_t>> merges_;  // rank, id
  std::unordered_map<std::string, std::vector<std::int32_t>> cache_;
  pcre2_code* re_ = nullptr;
  pcre2_match_data* match_ = nullptr;
  std::string description_;
};

}  // namespace

std::unique_ptr<Tokenizer> gpt2_bpe(const std::string& encoder_json, const std::string& merges) {
  return std::make_unique<Gpt2>(encoder_json, merges);
}

}  // namespace ptrain::tokenize
