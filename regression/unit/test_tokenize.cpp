// ptrain-test: np=1 labels=quick timeout=60
// ptrain-tokenize's pieces: the JSON reader, GPT-2's BPE on a small hand-made vocabulary (the
// pre-tokenizer's pieces, merge order, every occurrence of a pair at once), and the errors of
// its files and of text that is not UTF-8. GPT-2's real vocabulary against an independent
// implementation is regression/cli/tokenize.sh.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "tokenize/json.hpp"
#include "tokenize/tokenizer.hpp"
#include "util/error.hpp"

using namespace ptrain;
using namespace ptrain::tokenize;

namespace {

// The 256 byte symbols of GPT-2 (bytes_to_unicode), written out again here: printable Latin-1
// stands for itself, the rest for U+0100 onwards in byte order.
std::vector<std::string> symbols() {
  std::vector<std::string> out(256);
  int next = 0x100;
  for (int b = 0; b < 256; ++b) {
    const bool self = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int c = self ? b : next++;
    out[std::size_t(b)] = c < 0x80 ? std::string(1, char(c))
                                   : std::string{char(0xC0 | (c >> 6)), char(0x80 | (c & 0x3F))};
  }
  return out;
}

std::string escaped(const std::string& s) {
  std::string out;
  for (char c : s) out += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return out;
}

// A vocabulary: the byte symbols (byte b is id b), then each merge's result (256 on), then
// <|endoftext|>; its files.
struct Vocab {
  std::string dir = cat("/tmp/ptrain_test_tokenize_", ::getpid());
  std::string encoder = dir + "/encoder.json", merges = dir + "/vocab.bpe";
  explicit Vocab(const std::vector<std::pair<std::string, std::string>>& pairs,
                 bool endoftext = true) {
    std::system(cat("mkdir -p ", dir).c_str());
    const auto sym = symbols();
    std::vector<std::string> tokens(sym.begin(), sym.end());
    std::ofstream m(merges);
    m << "#version: 0.2\n";
    for (const auto& [a, b] : pairs) {
      tokens.push_back(a + b);
      m << a << ' ' << b << '\n';
    }
    if (endoftext) tokens.push_back("<|endoftext|>");
    std::ofstream e(encoder);
    e << '{';
    for (std::size_t i = 0; i < tokens.size(); ++i)
      e << (i ? ", " : "") << '"' << escaped(tokens[i]) << "\": " << i;
    e << "}\n";
  }
  ~Vocab() { std::system(cat("rm -rf ", dir).c_str()); }
};

std::vector<std::int32_t> encode(Tokenizer& t, const std::string& text) {
  std::vector<std::int32_t> out;
  t.encode(text, out);
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(TokenizeJson, StringMembersAndIntegerObjects) {
  EXPECT_EQ(
      json::string_member(
          R"({"id": 3, "text": "a\"b\\c\n\u00e9\ud83d\ude00", "x": [1, {"y": null}]})", "text"),
      std::string("a\"b\\c\n\xc3\xa9\xf0\x9f\x98\x80"));
  EXPECT_FALSE(json::string_member(R"({"id": 3})", "text").has_value());
  EXPECT_EQ(json::string_member(R"(  {"text": ""}  )", "text"), std::string());
  const auto o = json::integer_object(R"({"a": 0, "\u0120t": 12, "": -3})");
  ASSERT_EQ(o.size(), 3u);
  EXPECT_EQ(o[1].first, "\xc4\xa0t");
  EXPECT_EQ(o[1].second, 12);
  EXPECT_EQ(o[2].second, -3);
  for (const char* bad : {R"({"text": "a)", R"({"text": 1})", R"({"text": "\ud800"})",
                          R"({"text": "\udc00"})", R"({"text": "\q"})", R"({"text": "a"} x)",
                          R"({"text" "a"})", R"({"a": 01, "text": "x"})", "{\"text\": \"\x01\"}",
                          R"({"a": [1, 2,], "text": "x"})", R"({"a": tru, "text": "x"})", "[]"})
    EXPECT_THROW(json::string_member(bad, "text"), Error) << bad;
  EXPECT_NE(error_of([] { json::integer_object(R"({"a": 1.5})"); }).find("expected an integer"),
            std::string::npos);
  std::string deep(10000, '[');
  EXPECT_NE(
      error_of([&] { json::string_member("{\"a\": " + deep, "text"); }).find("nested too deeply"),
      std::string::npos);
}

TEST(TokenizeGpt2, PiecesMergeInRankOrderEveryOccurrenceAtOnce) {
  const std::string G = "\xc4\xa0";  // GPT-2's symbol for a blank
  // Merges (ids from 256 on): 256 "b c", 257 "a b", 258 "a a", 259 "Ġ c", 260 "aa aa".
  Vocab v({{"b", "c"}, {"a", "b"}, {"a", "a"}, {G, "c"}, {"aa", "aa"}});
  auto t = gpt2_bpe(v.encoder, v.merges);
  EXPECT_EQ(t->vocab(), 262);
  EXPECT_EQ(t->eod(), 261);
  EXPECT_EQ(encode(*t, "abc"), (std::vector<std::int32_t>{'a', 256})) << "b c ranks first";
  EXPECT_EQ(encode(*t, "aaaaa"), (std::vector<std::int32_t>{260, 'a'}))
      << "a a merged everywhere at once, then aa aa";
  // The pre-tokenizer: a letter run takes its leading blank; digits, punctuation and blank runs
  // are pieces of their own; contractions split off; a blank run before a word leaves it one
  // blank; merges never cross pieces.
  EXPECT_EQ(encode(*t, " c"), (std::vector<std::int32_t>{259}));
  EXPECT_EQ(encode(*t, "c c"), (std::vector<std::int32_t>{'c', 259}));
  const auto two_blanks = encode(*t, "a  c");
  ASSERT_EQ(two_blanks.size(), 3u);
  EXPECT_EQ(two_blanks[2], 259) << "the last blank of a run goes with the word";
  const auto pieces = encode(*t, "it's 42!?");
  EXPECT_EQ(pieces.size(), std::string("it's 42!?").size()) << "no merge applies: a byte each";
  EXPECT_EQ(encode(*t, "\xc3\xa9"), (std::vector<std::int32_t>{0xC3, 0xA9})) << "bytes of é";
  EXPECT_EQ(encode(*t, "<|endoftext|>").size(), 13u) << "special tokens are text";
  // Not UTF-8.
  EXPECT_NE(error_of([&] { encode(*t, "ok \xff bad"); }).find("not valid UTF-8"),
            std::string::npos);
}

TEST(TokenizeGpt2, BadFilesAreNamed) {
  Vocab v({{"a", "b"}}, false);
  EXPECT_EQ(gpt2_bpe(v.encoder, v.merges)->eod(), -1) << "no <|endoftext|>";
  {
    std::ofstream m(v.merges, std::ios::app);
    m << "a b c\n";
  }
  EXPECT_NE(
      error_of([&] { gpt2_bpe(v.encoder, v.merges); }).find("vocab.bpe' line 3: expected two"),
      std::string::npos);
  {
    std::ofstream m(v.merges);
    m << "#version: 0.2\nx yz\n";
  }
  EXPECT_NE(error_of([&] { gpt2_bpe(v.encoder, v.merges); }).find("a token not in"),
            std::string::npos);
  {
    std::ofstream e(v.encoder);
    e << R"({"a": 0})";
  }
  EXPECT_NE(error_of([&] { gpt2_bpe(v.encoder, v.merges); }).find("has no token for byte 0"),
            std::string::npos);
  {
    std::ofstream e(v.encoder);
    e << R"({"a": 0,})";
  }
  const std::string e = error_of([&] { gpt2_bpe(v.encoder, v.merges); });
  EXPECT_NE(e.find("encoder.json': JSON:"), std::string::npos) << e;
  EXPECT_NE(error_of([&] { gpt2_bpe(v.dir + "/none.json", v.merges); }).find("cannot read"),
            std::string::npos);
}
