// tokenize/json.cpp — a recursive-descent JSON reader (RFC 8259), enough for what
// ptrain-tokenize reads and strict about the rest.
#include "tokenize/json.hpp"

#include <cerrno>
#include <cstdlib>

#include "util/error.hpp"

namespace ptrain::tokenize::json {

namespace {

constexpr int kMaxDepth = 512;  // nesting beyond this is refused, not a stack overflow

class Reader {
 public:
  explicit Reader(std::string_view text) : s_(text) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(cat(what, " at byte ", at_));
  }

  void space() {
    while (at_ < s_.size() &&
           (s_[at_] == ' ' || s_[at_] == '\t' || s_[at_] == '\n' || s_[at_] == '\r'))
      ++at_;
  }
  bool done() {
    space();
    return at_ == s_.size();
  }
  void expect(char c) {
    space();
    if (at_ >= s_.size() || s_[at_] != c) fail(cat("JSON: expected '", c, "'"));
    ++at_;
  }
  bool peek(char c) {
    space();
    return at_ < s_.size() && s_[at_] == c;
  }

  // A string, its escapes decoded to UTF-8.
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (at_ >= s_.size()) fail("JSON: unterminated string");
      const auto c = static_cast<unsigned char>(s_[at_++]);
      if (c == '"') return out;
      if (c < 0x20) fail("JSON: raw control character in a string");
      if (c != '\\') {
        out.push_back(char(c));
        continue;
      }
      if (at_ >= s_.size()) fail("JSON: unterminated escape");
      const char e = s_[at_++];
      // The one-character escapes, then \u.
      static constexpr char kFrom[] = "\"\\/bfnrt", kTo[] = "\"\\/\b\f\n\r\t";
      if (const char* k = std::char_traits<char>::find(kFrom, 8, e)) {
        out.push_back(kTo[k - kFrom]);
        continue;
      }
      if (e != 'u') fail(cat("JSON: unknown escape \\", e));
      std::uint32_t cp = hex4();
      if (cp >= 0xD800 && cp < 0xDC00) {
        if (at_ + 1 >= s_.size() || s_[at_] != '\\' || s_[at_ + 1] != 'u')
          fail("JSON: lone high surrogate");
        at_ += 2;
        const std::uint32_t low = hex4();
        if (low < 0xDC00 || low >= 0xE000) fail("JSON: high surrogate without a low one");
        cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
      } else if (cp >= 0xDC00 && cp < 0xE000) {
        fail("JSON: lone low surrogate");
      }
      utf8(cp, out);
    }
  }

  // An integer (a number without fraction or exponent).
  std::int64_t integer() {
    space();
    const std::size_t begin = at_;
    number();
    const std::string text(s_.substr(begin, at_ - begin));
    if (text.find_first_of(".eE") != std::string::npos) fail("JSON: expected an integer");
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    if (errno != 0) fail("JSON: integer out of range");
    return std::int64_t(v);
  }

  // Skips any value.
  void value(int depth = 0) {
    if (depth > kMaxDepth) fail("JSON: nested too deeply");
    space();
    if (at_ >= s_.size()) fail("JSON: expected a value");
    const char c = s_[at_];
    if (c == '"') {
      string();
    } else if (c == '{') {
      ++at_;
      if (peek('}')) {
        ++at_;
        return;
      }
      do {
        string();
        expect(':');
        value(depth + 1);
      } while (comma());
      expect('}');
    } else if (c == '[') {
      ++at_;
      if (peek(']')) {
        ++at_;
        return;
      }
      do value(depth + 1);
      while (comma());
      expect(']');
    } else if (c == 't' || c == 'f' || c == 'n') {
      for (const char* word : {"true", "false", "null"})
        if (s_.substr(at_, std::char_traits<char>::length(word)) == word) {
          at_ += std::char_traits<char>::length(word);
          return;
        }
      fail("JSON: unknown literal");
    } else {
      number();
    }
  }

  bool comma() {
    if (!peek(',')) return false;
    ++at_;
    return true;
  }

 private:
  std::uint32_t hex4() {
    if (at_ + 4 > s_.size()) fail("JSON: short \\u escape");
    std::uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[at_++];
      v <<= 4;
      if (h >= '0' && h <= '9')
        v |= std::uint32_t(h - '0');
      else if (h >= 'a' && h <= 'f')
        v |= std::uint32_t(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F')
        v |= std::uint32_t(h - 'A' + 10);
      else
        fail("JSON: bad hex digit in \\u escape");
    }
    return v;
  }
  static void utf8(std::uint32_t cp, std::string& out) {
    if (cp < 0x80) {
      out.push_back(char(cp));
    } else if (cp < 0x800) {
      out.push_back(char(0xC0 | (cp >> 6)));
      out.push_back(char(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(char(0xE0 | (cp >> 12)));
      out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(char(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(char(0xF0 | (cp >> 18)));
      out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(char(0x80 | (cp & 0x3F)));
    }
  }
  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
  void number() {
    const std::size_t begin = at_;
    auto digits = [&] {
      const std::size_t d = at_;
      while (at_ < s_.size() && s_[at_] >= '0' && s_[at_] <= '9') ++at_;
      return at_ - d;
    };
    if (at_ < s_.size() && s_[at_] == '-') ++at_;
    const std::size_t int_at = at_;
    const std::size_t n = digits();
    if (n == 0 || (n > 1 && s_[int_at] == '0')) fail("JSON: bad number");
    if (at_ < s_.size() && s_[at_] == '.') {
      ++at_;
      if (digits() == 0) fail("JSON: bad number");
    }
    if (at_ < s_.size() && (s_[at_] == 'e' || s_[at_] == 'E')) {
      ++at_;
      if (at_ < s_.size() && (s_[at_] == '+' || s_[at_] == '-')) ++at_;
      if (digits() == 0) fail("JSON: bad number");
    }
    if (at_ == begin) fail("JSON: expected a value");
  }

  std::string_view s_;
  std::size_t at_ = 0;
};

}  // namespace

std::optional<std::string> string_member(std::string_view text, std::string_view key) {
  Reader r(text);
  std::optional<std::string> found;
  r.expect('{');
  if (!r.peek('}')) {
    do {
      const std::string name = r.string();
      r.expect(':');
      if (name == key) {
        if (!r.peek('"')) r.fail(cat("JSON: member '", name, "' is not a string"));
        found = r.string();
      } else {
        r.value();
      }
    } while (r.comma());
  }
  r.expect('}');
  if (!r.done()) r.fail("JSON: more after the object");
  return found;
}

std::vector<std::pair<std::string, std::int64_t>> integer_object(std::string_view text) {
  Reader r(text);
  std::vector<std::pair<std::string, std::int64_t>> out;
  r.expect('{');
  if (!r.peek('}')) {
    do {
      std::string name = r.string();
      r.expect(':');
      out.emplace_back(std::move(name), r.integer());
    } while (r.comma());
  }
  r.expect('}');
  if (!r.done()) r.fail("JSON: more after the object");
  return out;
}

}  // namespace ptrain::tokenize::json
