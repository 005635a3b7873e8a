// deck/parser.cpp — the namelist grammar (what gfortran's NAMELIST read accepts), --set
// overrides, and the schema defaults (read by the same grammar).
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "deck/deck.hpp"
#include "deck/detail.hpp"
#include "util/error.hpp"

namespace ptrain::deck {
namespace {

struct Location {
  int line = 0, col = 0;  // 1-based; line 0: not set
};

// Where the text being parsed came from, so errors say "file:line:col: " or "--set arg: ".
struct Origin {
  std::string file;    // a deck file: errors carry line and column
  std::string prefix;  // otherwise: errors start with this
  bool is_override = false;

  [[noreturn]] void fail(Location at, const std::string& message) const {
    if (!file.empty()) throw Error(cat(file, ":", at.line, ":", at.col, ": ", message), kExitInput);
    throw Error(prefix + message, kExitInput);
  }
};

bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; }
bool is_quote(char c) { return c == '\'' || c == '"'; }
// Characters that end an unquoted word (a name, number or logical).
bool ends_word(char c) {
  return is_blank(c) || c == '\n' || c == ',' || c == '/' || c == '!' || c == '=' || c == '(' ||
         c == ')' || is_quote(c) || c == '&';
}

std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

std::string trim(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && (is_blank(s[b]) || s[b] == '\n')) ++b;
  while (e > b && (is_blank(s[e - 1]) || s[e - 1] == '\n')) --e;
  return s.substr(b, e - b);
}

class Scanner {
 public:
  explicit Scanner(const std::string& text) : text_(text) {}
  struct State {
    std::size_t pos;
    int line, col;
  };

  bool eof() const { return pos_ >= text_.size(); }
  char peek() const { return eof() ? '\0' : text_[pos_]; }
  char get() {
    char c = text_[pos_++];
    if (c == '\n') {
      ++line_;
      col_ = 1;
    } else {
      ++col_;
    }
    return c;
  }
  Location where() const { return {line_, col_}; }
  State save() const { return {pos_, line_, col_}; }
  void restore(const State& s) {
    pos_ = s.pos;
    line_ = s.line;
    col_ = s.col;
  }
  void skip_line() {
    while (!eof() && peek() != '\n') get();
  }
  // Blanks, new lines and ! comments.
  void skip_space() {
    while (!eof()) {
      char c = peek();
      if (c == '!')
        skip_line();
      else if (is_blank(c) || c == '\n')
        get();
      else
        break;
    }
  }
  std::string word() {
    std::string w;
    while (!eof() && !ends_word(peek())) w += get();
    return w;
  }
  std::string rest_of_line() {
    std::string w;
    while (!eof() && peek() != '\n') w += get();
    return w;
  }

 private:
  const std::string& text_;
  std::size_t pos_ = 0;
  int line_ = 1, col_ = 1;
};

// One value as written: a null, an unquoted word, a quoted string (already decoded),
// or (for --set on a string key) a bare unquoted string.
struct RawValue {
  enum Kind { Null, Word, String, Bare } kind = Null;
  std::string text;
  Location at;
  std::int64_t repeat = 1;
};

std::string shown(const RawValue& v) {
  if (v.kind == RawValue::String || v.kind == RawValue::Bare) return "the string " + format_value(v.text);
  return "'" + v.text + "'";
}

std::string read_string(Scanner& s, const Origin& o) {
  Location at = s.where();
  char quote = s.get();
  std::string out;
  while (true) {
    if (s.eof() || s.peek() == '\n') o.fail(at, "unterminated string (a string must end on the line it starts)");
    char c = s.get();
    if (c == quote) {
      if (s.peek() != quote) break;
      s.get();  // a doubled quote stands for one
    }
    out += c;
  }
  return out;
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

// Parses [+-]digits into an int64; false when not an integer or out of range.
bool parse_int(const std::string& text, std::int64_t& out) {
  std::size_t i = (!text.empty() && (text[0] == '+' || text[0] == '-')) ? 1 : 0;
  if (!all_digits(text.substr(i))) return false;
  errno = 0;
  long long v = std::strtoll(text.c_str(), nullptr, 10);
  if (errno == ERANGE) return false;
  out = v;
  return true;
}

// Fortran real literals: 1.0  3e-4  1.0d-3  1.D0  .5  -2.  7 (an integer is a real too).
bool parse_real(const std::string& text, double& out) {
  std::size_t i = 0, n = text.size();
  if (i < n && (text[i] == '+' || text[i] == '-')) ++i;
  std::size_t mantissa_digits = 0;
  while (i < n && std::isdigit(static_cast<unsigned char>(text[i]))) ++i, ++mantissa_digits;
  if (i < n && text[i] == '.') {
    ++i;
    while (i < n && std::isdigit(static_cast<unsigned char>(text[i]))) ++i, ++mantissa_digits;
  }
  if (mantissa_digits == 0) return false;
  std::string c_text = text.substr(0, i);
  if (i < n) {
    char e = text[i];
    if (e != 'e' && e != 'E' && e != 'd' && e != 'D') return false;
    ++i;
    std::size_t sign = (i < n && (text[i] == '+' || text[i] == '-')) ? 1 : 0;
    if (!all_digits(text.substr(i + sign))) return false;
    c_text += 'e' + text.substr(i);
  }
  double v = std::strtod(c_text.c_str(), nullptr);
  if (!std::isfinite(v)) return false;
  out = v;
  return true;
}

// gfortran's logicals: an optional '.', then t or f, then anything (.true., T, false, .t).
bool parse_logical(const std::string& text, bool& out) {
  std::size_t i = (!text.empty() && text[0] == '.') ? 1 : 0;
  if (i >= text.size()) return false;
  char c = text[i];
  if (c == 't' || c == 'T') {
    out = true;
    return true;
  }
  if (c == 'f' || c == 'F') {
    out = false;
    return true;
  }
  return false;
}

// The values after 'key =': up to '/', '&', the end, or the next 'name =' / 'name('.
std::vector<RawValue> scan_values(Scanner& s, const Origin& o) {
  std::vector<RawValue> out;
  bool need_value = true;  // a comma now marks a null value
  while (true) {
    s.skip_space();
    if (s.eof()) break;
    char c = s.peek();
    if (c == '/' || c == '&') break;
    Location at = s.where();
    if (c == ',') {
      s.get();
      if (need_value) out.push_back(RawValue{RawValue::Null, "", at, 1});
      need_value = true;
      continue;
    }
    RawValue v;
    v.at = at;
    if (is_quote(c)) {
      v.kind = RawValue::String;
      v.text = read_string(s, o);
    } else {
      Scanner::State before = s.save();
      std::string w = s.word();
      if (w.empty()) o.fail(at, cat("unexpected '", c, "'"));
      Scanner::State after = s.save();
      s.skip_space();
      bool is_next_name = !s.eof() && (s.peek() == '=' || s.peek() == '(');
      if (is_next_name) {
        s.restore(before);
        break;
      }
      s.restore(after);
      std::size_t star = w.find('*');
      if (star != std::string::npos && all_digits(w.substr(0, star))) {
        // r*value, r*'string' or r* (r null values)
        if (!parse_int(w.substr(0, star), v.repeat) || v.repeat < 1 || v.repeat > 1000000000)
          o.fail(at, cat("bad repeat count in '", w, "'"));
        std::string rest = w.substr(star + 1);
        if (!rest.empty()) {
          v.kind = RawValue::Word;
          v.text = rest;
        } else if (is_quote(s.peek())) {
          v.kind = RawValue::String;
          v.text = read_string(s, o);
        } else {
          v.kind = RawValue::Null;
        }
      } else {
        v.kind = RawValue::Word;
        v.text = w;
      }
    }
    if (!s.eof()) {
      char n = s.peek();
      if (!(is_blank(n) || n == '\n' || n == ',' || n == '/' || n == '!'))
        o.fail(s.where(), cat("expected ',' or a blank after ", shown(v), ", got '", n, "'"));
    }
    out.push_back(v);
    need_value = false;
  }
  return out;
}

Value convert(const KeySpec& spec, const RawValue& v, const Origin& o) {
  bool word = v.kind == RawValue::Word;
  switch (spec.type) {
    case KeyType::Int: {
      std::int64_t x = 0;
      if (!word || !parse_int(v.text, x)) {
        bool too_big = word && all_digits(v.text.substr((v.text[0] == '+' || v.text[0] == '-') ? 1 : 0));
        o.fail(v.at, cat("expected an integer for ", spec.name(), ", got ", shown(v),
                         too_big ? " (beyond the 64-bit range)" : ""));
      }
      return Value(std::in_place_type<std::int64_t>, x);
    }
    case KeyType::Real: {
      double x = 0;
      if (!word || !parse_real(v.text, x))
        o.fail(v.at, cat("expected a real number for ", spec.name(), ", got ", shown(v)));
      return Value(std::in_place_type<double>, x);
    }
    case KeyType::Bool: {
      bool x = false;
      if (!word || !parse_logical(v.text, x))
        o.fail(v.at, cat("expected a logical (.true. or .false.) for ", spec.name(), ", got ", shown(v)));
      return Value(std::in_place_type<bool>, x);
    }
    case KeyType::Str:
      if (word)
        o.fail(v.at, cat("expected a quoted string for ", spec.name(), ", got ", v.text,
                         " (write it as ", format_value(v.text), ")"));
      return Value(std::in_place_type<std::string>, v.text);
  }
  return Value();
}

// Range and choices of one element's value.
void check_value(const KeySpec& spec, int element, const Value& value, const Origin& o, Location at) {
  std::string why = detail::value_error(spec, element, value);
  if (!why.empty()) o.fail(at, why);
}

// Which elements of which keys one source (the file, or the --set list) has assigned.
struct Tracker {
  std::vector<std::vector<Location>> set_at;
  Tracker() {
    for (const KeySpec& s : key_specs()) set_at.emplace_back(static_cast<std::size_t>(s.size()));
  }
};

// Assigns values to elements start, start+1, ... (1-based) of key `k`.
// A duplicate is reported at the key name (key_at).
void assign(int k, Location key_at, std::int64_t start, const std::vector<RawValue>& values,
            Config& config, Tracker& tracker, const Origin& o) {
  const KeySpec& spec = key_specs()[static_cast<std::size_t>(k)];
  std::size_t n = values.size();
  while (n > 0 && values[n - 1].kind == RawValue::Null) --n;  // trailing nulls change nothing
  std::int64_t pos = start;
  for (std::size_t i = 0; i < n; ++i) {
    const RawValue& v = values[i];
    if (v.kind == RawValue::Null) {
      pos += v.repeat;
      continue;
    }
    if (pos + v.repeat - 1 > spec.size()) {
      if (spec.extent == 0)
        o.fail(v.at, cat("too many values for ", spec.name(), " (it is a scalar)"));
      o.fail(v.at, cat("too many values for ", spec.name(), " (it has ", spec.extent, " elements)"));
    }
    Value x = convert(spec, v, o);
    for (std::int64_t r = 0; r < v.repeat; ++r, ++pos) {
      int element = static_cast<int>(pos - 1);
      Location& first = tracker.set_at[static_cast<std::size_t>(k)][static_cast<std::size_t>(element)];
      if (first.line != 0)
        o.fail(key_at, cat("duplicate key ", detail::element_name(spec, element),
                         o.is_override ? " (already set by an earlier --set)"
                                       : cat(" (first set at line ", first.line, ")")));
      check_value(spec, element, x, o, v.at);
      first = o.is_override ? Location{-1, -1} : v.at;
      spec.set(config, element, x);
    }
  }
}

// Levenshtein distance, for "did you mean" hints.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// " (did you mean 'x'?)" for the closest candidate within distance 2, else "".
std::string suggest(const std::string& name, const std::vector<std::string>& candidates,
                    const std::string& sigil) {
  std::string l = lower(name), best;
  std::size_t best_d = 3;
  for (const std::string& c : candidates) {
    std::size_t d = edit_distance(l, c);
    if (d < best_d && d < l.size()) best_d = d, best = c;
  }
  return best.empty() ? "" : cat(" (did you mean '", sigil, best, "'?)");
}

int find_group(const std::string& name, const Origin& o, Location at) {
  const auto& groups = group_specs();
  std::vector<std::string> names;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].name == lower(name)) return static_cast<int>(g);
    names.push_back(groups[g].name);
  }
  o.fail(at, cat("unknown group '&", name, "'", suggest(name, names, "&")));
}

int find_key(int g, const std::string& name, const Origin& o, Location at) {
  const GroupSpec& group = group_specs()[static_cast<std::size_t>(g)];
  std::vector<std::string> names;
  for (int k : group.keys) {
    const std::string& key = key_specs()[static_cast<std::size_t>(k)].key;
    if (key == lower(name)) return k;
    names.push_back(key);
  }
  o.fail(at, cat("unknown key '", name, "' in &", group.name, suggest(name, names, "")));
}

// "(i)" after a key name: the 1-based element to start at.
std::int64_t read_index(Scanner& s, const KeySpec& spec, const Origin& o) {
  Location paren = s.where();
  s.get();
  if (spec.extent == 0) o.fail(paren, cat(spec.name(), " is a scalar and takes no array index"));
  while (is_blank(s.peek())) s.get();
  Location at = s.where();
  std::string text;
  while (!s.eof() && s.peek() != ')' && s.peek() != '\n' && s.peek() != '=') text += s.get();
  text = trim(text);
  std::int64_t index = 0;
  if (s.peek() != ')' || !parse_int(text, index) || index < 1 || index > spec.extent)
    o.fail(at, cat("bad array index (", text, ") for ", spec.name(), ": expected an integer in 1..",
                   spec.extent));
  s.get();
  return index;
}

void parse_group(Scanner& s, int g, Location group_at, Config& config, Tracker& tracker,
                 const Origin& o) {
  const std::string& gname = group_specs()[static_cast<std::size_t>(g)].name;
  auto unterminated = [&] {
    o.fail(group_at, cat("unterminated group &", gname, " (the file ends before its closing '/')"));
  };
  while (true) {
    s.skip_space();
    if (s.eof()) unterminated();
    Location at = s.where();
    char c = s.peek();
    if (c == '/') {
      s.get();
      return;
    }
    if (c == ',') {
      s.get();
      continue;
    }
    if (c == '&') {
      s.get();
      std::string name = s.word();
      if (lower(name) == "end") return;
      o.fail(at, cat("&", gname, " is not closed before '&", name, "' (missing '/')"));
    }
    if (is_quote(c)) o.fail(at, cat("expected a key name in &", gname, ", got a string"));
    std::string name = s.word();
    if (name.empty()) o.fail(at, cat("expected a key name in &", gname, ", got '", c, "'"));
    int k = find_key(g, name, o, at);
    const KeySpec& spec = key_specs()[static_cast<std::size_t>(k)];
    while (is_blank(s.peek())) s.get();
    std::int64_t start = 1;
    if (s.peek() == '(') start = read_index(s, spec, o);
    s.skip_space();
    if (s.eof()) unterminated();
    if (s.peek() != '=') o.fail(s.where(), cat("expected '=' after '", name, "'"));
    s.get();
    assign(k, at, start, scan_values(s, o), config, tracker, o);
  }
}

void parse_deck(const std::string& text, Config& config, const Origin& o) {
  Scanner s(text);
  Tracker tracker;
  std::vector<Location> group_at(group_specs().size());
  while (true) {
    // Outside groups everything but '&' is ignored, as gfortran does; '!' comments a line.
    while (!s.eof() && s.peek() != '&') {
      if (s.peek() == '!')
        s.skip_line();
      else
        s.get();
    }
    if (s.eof()) break;
    Location at = s.where();
    s.get();
    std::string name = s.word();
    if (name.empty()) o.fail(at, "expected a group name after '&'");
    if (lower(name) == "end") o.fail(at, "'&end' outside a group");
    int g = find_group(name, o, at);
    Location& first = group_at[static_cast<std::size_t>(g)];
    if (first.line != 0)
      o.fail(at, cat("duplicate group &", group_specs()[static_cast<std::size_t>(g)].name,
                     " (first at line ", first.line, ")"));
    first = at;
    parse_group(s, g, at, config, tracker, o);
  }
}

void apply_override(const std::string& arg, Config& config, Tracker& tracker) {
  Origin o;
  o.prefix = cat("--set ", arg, ": ");
  o.is_override = true;
  Location none;
  std::size_t eq = arg.find('=');
  std::size_t pct = arg.find('%');
  if (eq == std::string::npos || pct == std::string::npos || pct > eq)
    o.fail(none, "expected group%key=value");
  std::string group = trim(arg.substr(0, pct));
  std::string lhs = trim(arg.substr(pct + 1, eq - pct - 1));
  std::string key = lhs, index_text;
  std::size_t paren = lhs.find('(');
  if (paren != std::string::npos) {
    key = trim(lhs.substr(0, paren));
    index_text = lhs.substr(paren);
  }
  int g = find_group(group, o, none);
  int k = find_key(g, key, o, none);
  const KeySpec& spec = key_specs()[static_cast<std::size_t>(k)];
  std::int64_t start = 1;
  if (!index_text.empty()) {
    Scanner is(index_text);
    start = read_index(is, spec, o);
    if (!trim(is.rest_of_line()).empty()) o.fail(none, "expected '=' after the array index");
  }
  std::string rhs = arg.substr(eq + 1);
  std::vector<RawValue> values;
  std::string value_text = trim(rhs);
  if (spec.type == KeyType::Str && (value_text.empty() || !is_quote(value_text[0]))) {
    // A bare string: the whole text, or comma-separated elements of an array.
    std::vector<std::string> parts;
    if (spec.extent == 0) {
      parts.push_back(value_text);
    } else {
      std::size_t begin = 0;
      while (true) {
        std::size_t comma = value_text.find(',', begin);
        parts.push_back(trim(value_text.substr(begin, comma == std::string::npos ? comma : comma - begin)));
        if (comma == std::string::npos) break;
        begin = comma + 1;
      }
    }
    for (const std::string& p : parts)
      values.push_back(RawValue{spec.extent > 0 && p.empty() ? RawValue::Null : RawValue::Bare, p, none, 1});
  } else {
    Scanner s(rhs);
    values = scan_values(s, o);
    s.skip_space();
    if (!s.eof()) o.fail(none, cat("unexpected '", trim(s.rest_of_line()), "' in the value"));
  }
  bool any = false;
  for (const RawValue& v : values) any = any || v.kind != RawValue::Null;
  if (!any) o.fail(none, "no value given");
  assign(k, none, start, values, config, tracker, o);
}

Config build_defaults() {
  Config config;
  Tracker tracker;
  const auto& specs = key_specs();
  for (std::size_t k = 0; k < specs.size(); ++k) {
    const KeySpec& spec = specs[k];
    Origin o;
    o.prefix = cat("schema.def: default of ", spec.name(), ": ");
    Scanner s(spec.default_text);
    std::vector<RawValue> values = scan_values(s, o);
    s.skip_space();
    if (!s.eof()) o.fail({}, cat("unexpected '", s.rest_of_line(), "'"));
    assign(static_cast<int>(k), {}, 1, values, config, tracker, o);
    for (const Location& at : tracker.set_at[k])
      if (at.line == 0) o.fail({}, cat("gives fewer than ", spec.size(), " values"));
  }
  config.deck_path = "<defaults>";
  return config;
}

}  // namespace

Config defaults() {
  static const Config d = build_defaults();
  return d;
}

Config parse_text(const std::string& text, const std::string& filename,
                  const std::vector<std::string>& overrides) {
  Config config = defaults();
  Origin o;
  o.file = filename.empty() ? "<deck>" : filename;
  parse_deck(text, config, o);
  Tracker tracker;
  for (const std::string& arg : overrides) apply_override(arg, config, tracker);
  config.deck_path = filename;
  return config;
}

Config parse_file(const std::string& path, const std::vector<std::string>& overrides) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw Error(cat("cannot open deck '", path, "': ", std::strerror(errno)), kExitInput);
  std::string text;
  char buf[65536];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  bool failed = std::ferror(f) != 0;
  int err = errno;
  std::fclose(f);
  if (failed) throw Error(cat("cannot read deck '", path, "': ", std::strerror(err)), kExitInput);
  return parse_text(text, path, overrides);
}

}  // namespace ptrain::deck
