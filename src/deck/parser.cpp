// deck/parser.cpp — the namelist grammar as gfortran's NAMELIST read implements it, --set
// overrides, and the schema defaults (read by the same grammar).
//
// The reading follows libgfortran's io/list_read.c step by step (eat_spaces,
// eat_separator, finish_separator, nml_read_obj, nml_get_obj_data keep its names), because
// where blanks, commas, line ends and comments may go, and when they make a null value, is
// defined by that code rather than by a grammar. Where gfortran quietly skips what it
// cannot read (a lone sign, a value glued to the next name, '=?') ptrain refuses; it also
// refuses unknown groups, a key or group given twice, unquoted strings and reals that are
// not finite, and it never reads what gfortran refuses.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "deck/deck.hpp"
#include "deck/detail.hpp"
#include "util/error.hpp"

namespace ptrain::deck {
namespace {

constexpr int kEof = -1;
// gfortran's largest repeat count (list_read.c MAX_REPEAT).
constexpr std::int64_t kMaxRepeat = 200000000;
// A logical written t... or f... may be this long before gfortran gives up on it
// (read_logical looks 63 characters ahead for an '=' that would make it a name).
constexpr std::size_t kMaxLogicalWord = 64;

struct Location {
  int line = 0, col = 0;  // 1-based; line 0: not set
};

// Where the text being parsed came from, so errors say "file:line:col: " or "--set arg: ".
struct Origin {
  std::string file;    // a deck file: errors carry line and column
  std::string prefix;  // otherwise: errors start with this
  bool is_override = false;

  [[noreturn]] void fail(Location at, const std::string& message) const {
    if (!file.empty())
      throw Error(detail::printable(cat(file, ":", at.line, ":", at.col, ": ", message)),
                  kExitInput);
    throw Error(detail::printable(prefix + message), kExitInput);
  }
};

bool is_quote(int c) { return c == '\'' || c == '"'; }
bool is_digit(int c) { return c >= '0' && c <= '9'; }
bool is_letter(int c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
// What ends a value in namelist input (list_read.c is_separator, namelist mode).
bool is_separator(int c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == ',' || c == '/' || c == ';' ||
         c == '!';
}
// What ends a name: the separators and the characters that have a meaning after a name.
bool ends_word(int c) {
  return c == kEof || is_separator(c) || c == '=' || c == '(' || c == ')' || is_quote(c) ||
         c == '&' || c == '$';
}

std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

std::string trim(const std::string& s) {
  auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
  std::size_t b = 0, e = s.size();
  while (b < e && blank(s[b])) ++b;
  while (e > b && blank(s[e - 1])) --e;
  return s.substr(b, e - b);
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!is_digit(c)) return false;
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

// A real as gfortran's read_real takes it: [sign] digits with at most one '.', then an
// exponent written with e, d or q (1.0d-3) or with the sign alone (1.5-3). `why` says
// what is wrong with a well-formed real ptrain does not take.
bool parse_real(const std::string& text, double& out, std::string& why) {
  std::size_t i = 0, n = text.size();
  std::string c_text;
  if (i < n && (text[i] == '+' || text[i] == '-')) c_text += text[i++];
  std::string rest = lower(text.substr(i));
  if (rest == "inf" || rest == "infinity" || rest == "nan" ||
      (rest.rfind("nan(", 0) == 0 && rest.back() == ')')) {
    why = "infinities and NaNs are not allowed";
    return false;
  }
  bool seen_dp = false, digits = false;
  for (; i < n && (is_digit(text[i]) || text[i] == '.'); ++i) {
    if (text[i] == '.') {
      if (seen_dp) return false;
      seen_dp = true;
    } else {
      digits = true;
    }
    c_text += text[i];
  }
  if (!digits) return false;  // gfortran fails to convert "." too
  if (i < n) {
    char e = static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
    if (e == 'e' || e == 'd' || e == 'q')
      ++i;
    else if (e != '+' && e != '-')
      return false;
    c_text += 'e';
    if (i < n && (text[i] == '+' || text[i] == '-')) c_text += text[i++];
    if (!all_digits(text.substr(i))) return false;
    c_text += text.substr(i);
  }
  double v = std::strtod(c_text.c_str(), nullptr);
  if (!std::isfinite(v)) {
    why = "beyond the range of a double";
    return false;
  }
  out = v;
  return true;
}

// gfortran's logicals: '.' and t or f, then anything (.true., .tomato); or t or f alone or
// followed by a word that is not a name (T, true, false): read_logical takes an '=' from
// the third character on for the end of a name.
bool parse_logical(const std::string& text, bool& out) {
  if (text.empty()) return false;
  bool dotted = text[0] == '.';
  std::size_t i = dotted ? 1 : 0;
  if (i >= text.size()) return false;
  char c = static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
  if (c != 't' && c != 'f') return false;
  if (!dotted && (text.find('=', 2) != std::string::npos || text.size() > kMaxLogicalWord))
    return false;
  out = c == 't';
  return true;
}

class Scanner {
 public:
  explicit Scanner(const std::string& text) : text_(text) {}
  struct State {
    std::size_t pos;
    int line, col;
    bool at_eol;
  };

  // The next character, kEof at the end. Like gfortran's next_char it records whether
  // that character ends a line (at_eol), which decides what a separator means.
  int next() {
    prev_ = save();
    if (pos_ >= text_.size()) {
      at_eol_ = true;
      return kEof;
    }
    int c = static_cast<unsigned char>(text_[pos_++]);
    if (c == '\n') {
      ++line_;
      col_ = 1;
    } else {
      ++col_;
    }
    at_eol_ = c == '\n';
    return c;
  }
  // Steps back over what next() returned; at_eol stays (as after unget_char).
  void unget() {
    bool eol = at_eol_;
    restore(prev_);
    at_eol_ = eol;
  }
  int peek() const { return pos_ < text_.size() ? static_cast<unsigned char>(text_[pos_]) : kEof; }
  bool at_eol() const { return at_eol_; }
  Location where() const { return {line_, col_}; }
  State save() const { return {pos_, line_, col_, at_eol_}; }
  void restore(const State& s) {
    pos_ = s.pos;
    line_ = s.line;
    col_ = s.col;
    at_eol_ = s.at_eol;
  }
  // The text from `from` to here.
  std::string since(const State& from) const { return text_.substr(from.pos, pos_ - from.pos); }

 private:
  const std::string& text_;
  std::size_t pos_ = 0;
  int line_ = 1, col_ = 1;
  bool at_eol_ = false;
  State prev_{0, 1, 1, false};
};

// The elements one key assignment may fill: all of the key, from an index to its end
// (gfortran's reading of key(i)), or a section key(lo:hi:step).
struct Target {
  const KeySpec* spec = nullptr;
  std::vector<int> elements;  // 0-based, in assignment order
  std::string section;        // "(1:2)" for a section, else ""

  std::string too_many() const {
    if (!section.empty())
      return cat("too many values for ", spec->name(), section, " (the section has ",
                 elements.size(), " elements)");
    if (spec->extent == 0) return cat("too many values for ", spec->name(), " (it is a scalar)");
    return cat("too many values for ", spec->name(), " (it has ", spec->extent, " elements)");
  }
};

struct Assigned {
  int element;
  Value value;
  Location at;
};

// How reading a key's values ended, for the message when a value follows anyway.
struct Values {
  std::vector<Assigned> items;
  bool after_comment = false;  // a comment stood where the next value should be
  Location comment_at;         // where that comment starts (the line of the '=' or ',')
};

std::string shown_string(const std::string& s) {
  return "the string " + format_value(detail::excerpt(s));
}

// The character-level reading of one deck, --set value or default text.
class Reader {
 public:
  Reader(const std::string& text, const Origin& o) : s(text), o_(o) {}

  Scanner s;
  bool comma_flag = false, input_complete = false;  // as list_read.c's dtp->u.p fields

  int eat_spaces() {
    int c;
    do c = s.next();
    while (c == ' ' || c == '\t' || c == '\r');
    s.unget();
    return c;
  }
  void eat_line() {
    int c;
    do c = s.next();
    while (c != kEof && c != '\n');
  }
  // One separator: a comma (or ';'), a '/', a comment, or a line end with the blank and
  // comment lines after it.
  void eat_separator() {
    eat_spaces();
    comma_flag = false;
    int c = s.next();
    switch (c) {
      case kEof:
        return;
      case ',':
      case ';':
        comma_flag = true;
        eat_spaces();
        return;
      case '/':
        input_complete = true;
        return;
      case '\n':
        do {
          c = s.next();
          if (c == kEof) return;
          if (c == '!') {
            eat_line();
            c = '\n';
          }
        } while (c == '\n' || c == '\r' || c == ' ' || c == '\t');
        s.unget();
        return;
      case '!':
        eat_line();
        return;
      default:
        s.unget();
    }
  }
  // The rest of a separator that a line end interrupted: blank and comment lines, and a
  // comma when the last separator had none.
  void finish_separator() {
    while (true) {
      eat_spaces();
      int c = s.next();
      switch (c) {
        case kEof:
          return;
        case ',':
          if (comma_flag) {
            s.unget();
            return;
          }
          c = eat_spaces();
          if (c == '\n') continue;
          return;
        case '/':
          input_complete = true;
          return;
        case '\n':
          continue;
        case '!':
          eat_line();
          continue;
        default:
          s.unget();
          return;
      }
    }
  }

  // A name or unquoted word: up to the next separator or punctuation.
  std::string word() {
    std::string w;
    while (!ends_word(s.peek())) w += static_cast<char>(s.next());
    return w;
  }
  // The rest of the text (for messages).
  std::string rest() {
    std::string t;
    while (s.peek() != kEof) t += static_cast<char>(s.next());
    return t;
  }
  // From here to the next separator, without moving.
  std::string token_ahead() {
    Scanner::State at = s.save();
    int c;
    while ((c = s.next()) != kEof && !is_separator(c)) {
    }
    if (c != kEof) s.unget();
    std::string t = s.since(at);
    s.restore(at);
    return t;
  }
  // A key name as nml_get_obj_data reads it: up to a blank, '=', '(' or '%', passing over
  // separators inside it ("ste,ps" and "save_<line end>final" are names to gfortran).
  std::string key_name() {
    std::string name;
    for (int c = s.peek(); c != kEof && c != '=' && c != ' ' && c != '\t' && c != '(' && c != '%';
         c = s.peek()) {
      s.next();
      if (!is_separator(c)) name += static_cast<char>(c);
    }
    return name;
  }
  // After a key name: one separator (blanks and a comma, or line ends and comment lines),
  // then the character that should be '='; kEof when a '/' ended the group instead.
  int after_name(Location& at) {
    eat_separator();
    if (!input_complete && s.at_eol()) finish_separator();
    at = s.where();
    int c = s.next();
    return input_complete ? kEof : c;
  }
  // Whether the next key starts here, as gfortran would read one (a name, then '=' or an
  // index): a key's values may end early, and then a name stands where a value could.
  bool name_follows() {
    if (!is_letter(s.peek())) return false;
    Scanner::State start = s.save();
    bool comma = comma_flag, complete = input_complete;
    key_name();
    Location at;
    bool yes = s.peek() == '(' || after_name(at) == '=';
    s.restore(start);
    comma_flag = comma;
    input_complete = complete;
    return yes;
  }

  // read_logical's look-ahead at a word that starts with t or f: it is the next name when
  // an '=' comes in it (from its third character on) or right after the separator that
  // ends it.
  bool logical_is_name() {
    Scanner::State start = s.save();
    bool comma = comma_flag, complete = input_complete;
    s.next();
    bool yes = false;
    if (!is_separator(s.next())) {
      for (std::size_t i = 2; i < kMaxLogicalWord + 1; ++i) {
        int c = s.next();
        if (c == kEof || is_separator(c)) {
          s.unget();
          eat_separator();
          yes = s.next() == '=';
          break;
        }
        if (c == '=') {
          yes = true;
          break;
        }
      }
    }
    s.restore(start);
    comma_flag = comma;
    input_complete = complete;
    return yes;
  }

  // A quoted string (the opening quote already read) as read_character reads it: a
  // doubled quote stands for one; a line end (and a CR) inside is dropped.
  std::string quoted(int quote, Location at) {
    std::string out;
    while (true) {
      int c = s.next();
      if (c == kEof) o_.fail(at, "unterminated string (no closing quote)");
      if (c == quote) {
        if (s.peek() != quote) break;
        s.next();
      } else if (c == '\n' || c == '\r') {
        continue;
      }
      out += static_cast<char>(c);
    }
    int c = s.peek();
    if (c != kEof && !is_separator(c))
      o_.fail(s.where(), cat("expected ',' or a blank after ", shown_string(out), ", got '",
                             static_cast<char>(c), "'"));
    return out;
  }

  // nml_read_obj: the values after 'key =' for the target's elements.
  Values read_values(const Target& t) {
    Values out;
    std::int64_t repeat = 0;
    Item held;
    eat_spaces();
    for (int element : t.elements) {
      if (--repeat <= 0) {
        if (input_complete) return out;
        if (s.at_eol()) finish_separator();
        if (input_complete) return out;
        held = read_item(*t.spec);
        out.after_comment = held.comment;
        out.comment_at = held.at;
        if (held.stop) return out;
        repeat = held.repeat;
      }
      if (!held.null) out.items.push_back({element, held.value, held.at});
    }
    if (repeat > 1) o_.fail(held.at, t.too_many());
    return out;
  }

 private:
  // One value, a null, or the end of the list (stop: a name, '&', a comment or the end of
  // the text stands where the value would be).
  struct Item {
    bool stop = false, null = true, comment = false;
    std::int64_t repeat = 1;
    Value value;
    Location at;
  };

  static Item null_item(Location at, std::int64_t repeat = 1) {
    Item i;
    i.at = at;
    i.repeat = repeat;
    return i;
  }
  static Item stop_item(bool comment = false, Location at = {}) {
    Item i;
    i.stop = true;
    i.comment = comment;
    i.at = at;
    return i;
  }

  Item read_item(const KeySpec& spec) {
    return spec.type == KeyType::Str ? read_string(spec) : read_word(spec);
  }

  // read_character: a quoted string, r*'string', a null, or the end of the list.
  Item read_string(const KeySpec& spec) {
    Location at = s.where();
    Scanner::State start = s.save();
    int c = s.next();
    if (c == kEof) return stop_item();
    if (is_separator(c) && c != '!') {  // read_character takes '!' for the next name
      s.unget();
      eat_separator();
      return null_item(at);
    }
    if (!is_digit(c) && !is_quote(c)) {
      s.unget();
      if (c == '!') return stop_item(true, at);
      if (c == '&' || c == '$' || name_follows()) return stop_item();
      unquoted(spec, at);
    }
    std::int64_t repeat = 1;
    if (is_digit(c)) {
      std::string digits(1, static_cast<char>(c));
      while (is_digit(s.peek())) digits += static_cast<char>(s.next());
      if (s.next() != '*') {  // digits alone are an unquoted string
        s.restore(start);
        unquoted(spec, at);
      }
      repeat = repeat_count(digits, at);
      c = s.next();
      if (c == kEof) return stop_item();
      if (is_separator(c) && c != '!') {
        s.unget();
        eat_separator();
        return null_item(at, repeat);
      }
      if (!is_quote(c)) {
        s.restore(start);
        unquoted(spec, at);
      }
    }
    s.unget();
    Location quote_at = s.where();
    s.next();
    Item item = null_item(at, repeat);
    item.null = false;
    item.value = Value(std::in_place_type<std::string>, quoted(c, quote_at));
    eat_separator();
    return item;
  }

  // read_integer, read_real, read_logical: [r*]word up to the next separator.
  Item read_word(const KeySpec& spec) {
    Location at = s.where();
    int c = s.next();
    if (c == kEof) return stop_item();
    if (is_separator(c)) {
      s.unget();
      eat_separator();
      Item item = null_item(at);
      item.comment = c == '!';
      return item;
    }
    s.unget();
    bool logical = spec.type == KeyType::Bool && (c == 't' || c == 'T' || c == 'f' || c == 'F');
    if (c == '&' || c == '$' || (logical ? logical_is_name() : name_follows())) return stop_item();
    if (is_quote(c)) {
      s.next();
      std::string text = quoted(c, at);
      o_.fail(at, cat("expected ", type_words(spec.type), " for ", spec.name(), ", got ",
                      shown_string(text)));
    }
    std::string token = token_ahead(), body = token;
    std::int64_t repeat = 1;
    std::size_t star = token.find('*');
    if (star != std::string::npos && all_digits(token.substr(0, star))) {
      repeat = repeat_count(token.substr(0, star), at);
      body = token.substr(star + 1);
    }
    for (std::size_t i = 0; i < token.size(); ++i) s.next();
    if (body.empty()) {
      eat_separator();
      return null_item(at, repeat);
    }
    Item item = null_item(at, repeat);
    item.null = false;
    item.value = convert(spec, token, body, at);
    eat_separator();
    return item;
  }

  Value convert(const KeySpec& spec, const std::string& token, const std::string& body,
                Location at) {
    std::string why;
    switch (spec.type) {
      case KeyType::Int: {
        std::int64_t x = 0;
        if (parse_int(body, x)) return Value(std::in_place_type<std::int64_t>, x);
        if (all_digits(body.substr((body[0] == '+' || body[0] == '-') ? 1 : 0)))
          why = "beyond the 64-bit range";
        break;
      }
      case KeyType::Real: {
        double x = 0;
        if (parse_real(body, x, why)) return Value(std::in_place_type<double>, x);
        break;
      }
      case KeyType::Bool: {
        bool x = false;
        if (parse_logical(body, x)) return Value(std::in_place_type<bool>, x);
        break;
      }
      case KeyType::Str:
        break;
    }
    glued_value(spec, token, at);
    o_.fail(at, cat("expected ", type_words(spec.type), " for ", spec.name(), ", got '",
                    detail::excerpt(token), "'", why.empty() ? "" : cat(" (", why, ")")));
  }

  // A value with punctuation glued to it ("4)"): say where the value should have ended.
  void glued_value(const KeySpec& spec, const std::string& token, Location at) {
    std::size_t k = token.find_first_of("()='\"&$");
    if (k == 0 || k == std::string::npos) return;
    std::string head = token.substr(0, k), why;
    double r;
    bool b;
    std::int64_t i;
    bool valid = spec.type == KeyType::Int    ? parse_int(head, i)
                 : spec.type == KeyType::Real ? parse_real(head, r, why)
                                              : parse_logical(head, b);
    if (valid)
      o_.fail({at.line, at.col + static_cast<int>(k)},
              cat("expected ',' or a blank after '", head, "', got '", token[k], "'"));
  }

  [[noreturn]] void unquoted(const KeySpec& spec, Location at) {
    std::string w = detail::excerpt(token_ahead());
    if (w.empty()) w = std::string(1, static_cast<char>(s.peek()));
    o_.fail(at, cat("expected a quoted string for ", spec.name(), ", got ", w, " (write it as ",
                    format_value(w), ")"));
  }

  std::int64_t repeat_count(const std::string& digits, Location at) {
    std::int64_t r = 0;
    if (!parse_int(digits, r) || r < 1 || r > kMaxRepeat)
      o_.fail(at, cat("bad repeat count in '", digits, "*'"));
    return r;
  }

  static const char* type_words(KeyType t) {
    switch (t) {
      case KeyType::Int:
        return "an integer";
      case KeyType::Real:
        return "a real number";
      case KeyType::Bool:
        return "a logical (.true. or .false.)";
      case KeyType::Str:
        return "a quoted string";
    }
    return "";
  }

  const Origin& o_;
};

// Whether a token at a key-name position is really one more value for `previous`.
bool is_value_for(const KeySpec& previous, int c, const std::string& word) {
  if (c == ',' || is_quote(c) || is_digit(c) || c == '+' || c == '-' || c == '.' || c == '*')
    return true;
  std::string why;
  double r;
  bool b;
  return previous.type == KeyType::Bool   ? parse_logical(word, b)
         : previous.type == KeyType::Real ? parse_real(word, r, why) || !why.empty()
                                          : false;
}

// Range and choices of one element's value.
void check_value(const KeySpec& spec, int element, const Value& value, const Origin& o,
                 Location at) {
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

// Sets the values read for key `k`. A duplicate is reported at the key name (key_at).
void assign(int k, Location key_at, const std::vector<Assigned>& items, Config& config,
            Tracker& tracker, const Origin& o) {
  const KeySpec& spec = key_specs()[static_cast<std::size_t>(k)];
  for (const Assigned& a : items) {
    Location& first =
        tracker.set_at[static_cast<std::size_t>(k)][static_cast<std::size_t>(a.element)];
    if (first.line != 0)
      o.fail(key_at, cat("duplicate key ", detail::element_name(spec, a.element),
                         o.is_override ? " (already set by an earlier --set)"
                                       : cat(" (first set at line ", first.line, ")")));
    check_value(spec, a.element, a.value, o, a.at);
    first = o.is_override ? Location{-1, -1} : a.at;
    spec.set(config, a.element, a.value);
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
  o.fail(at, cat("unknown group '&", detail::excerpt(name), "'", suggest(name, names, "&")));
}

// The key `name` of group g, or -1.
int key_index(int g, const std::string& name) {
  for (int k : group_specs()[static_cast<std::size_t>(g)].keys)
    if (key_specs()[static_cast<std::size_t>(k)].key == lower(name)) return k;
  return -1;
}

int find_key(int g, const std::string& name, const Origin& o, Location at) {
  const GroupSpec& group = group_specs()[static_cast<std::size_t>(g)];
  std::vector<std::string> names;
  for (int k : group.keys) {
    const std::string& key = key_specs()[static_cast<std::size_t>(k)].key;
    if (key == lower(name)) return k;
    names.push_back(key);
  }
  o.fail(at, cat("unknown key '", detail::excerpt(name), "' in &", group.name,
                 suggest(name, names, "")));
}

Target whole(const KeySpec& spec) {
  Target t;
  t.spec = &spec;
  for (int i = 0; i < spec.size(); ++i) t.elements.push_back(i);
  return t;
}

// What follows '(' after a key name (nml_parse_qualifier): i (elements i to the end, as
// gfortran reads it), or a section lo:hi:step with lo, hi and step optional as in Fortran
// (but not hi alone before a step). Blanks may surround the numbers.
Target read_index(Reader& r, const KeySpec& spec, Location paren, const Origin& o) {
  if (spec.extent == 0) o.fail(paren, cat(spec.name(), " is a scalar and takes no array index"));
  while (r.s.peek() == ' ' || r.s.peek() == '\t') r.s.next();
  Location at = r.s.where();
  Scanner::State start = r.s.save();
  std::string text;
  for (int c = r.s.peek(); c != kEof && c != ')' && c != '\n' && c != '='; c = r.s.peek())
    text += static_cast<char>(r.s.next());
  r.s.restore(start);
  auto bad = [&]() {
    o.fail(at, cat("bad array index (", trim(text), ") for ", spec.name(),
                   ": expected i, lo:hi or lo:hi:step within 1..", spec.extent));
  };
  std::int64_t field[3] = {0, 0, 0};
  bool given[3] = {false, false, false};
  int fields = 0;
  while (true) {
    auto skip_blanks = [&] {
      while (r.s.peek() == ' ' || r.s.peek() == '\t') r.s.next();
    };
    skip_blanks();
    std::string number;
    if (r.s.peek() == '+' || r.s.peek() == '-') number += static_cast<char>(r.s.next());
    while (is_digit(r.s.peek())) number += static_cast<char>(r.s.next());
    skip_blanks();
    if (!number.empty() && (is_digit(r.s.peek()) || r.s.peek() == '+' || r.s.peek() == '-'))
      o.fail(at,
             cat("bad array index (", trim(text), ") for ", spec.name(),
                 ": a blank separates two numbers (gfortran would read a section; write lo:hi)"));
    if (!number.empty() && !parse_int(number, field[fields])) bad();
    given[fields] = !number.empty();
    ++fields;
    int c = r.s.next();
    if (c == ')') break;
    if (c == '\n' || c == '\r')
      o.fail(at,
             cat("bad array index for ", spec.name(),
                 ": it goes on over a line end (gfortran misreads that); write it on one line"));
    if (c != ':' || fields == 3) bad();
  }
  Target t;
  t.spec = &spec;
  std::int64_t lo = 1, hi = spec.extent, step = 1;
  if (fields == 1) {
    if (!given[0]) bad();
    lo = field[0];
  } else {
    if ((fields == 3 && (!given[1] || !given[2]))) bad();
    if (given[0]) lo = field[0];
    if (given[1]) hi = field[1];
    if (fields == 3) step = field[2];
    t.section = "(" + trim(text) + ")";
  }
  if (lo < 1 || lo > spec.extent || hi < 1 || hi > spec.extent || step == 0 || (hi - lo) * step < 0)
    bad();
  for (std::int64_t i = lo; step > 0 ? i <= hi : i >= hi; i += step)
    t.elements.push_back(static_cast<int>(i - 1));
  return t;
}

// After a key name (and its index), '='.
void expect_equals(Reader& r, const std::string& name, const Origin& o) {
  Location at;
  int c = r.after_name(at);
  if (c == '=') return;
  std::string hint = c == '(' ? " (an array index follows the name without a blank)" : "";
  o.fail(at, cat("expected '=' after '", detail::excerpt(name), "'", hint));
}

// nml_get_obj_data, repeated: the items of one group up to its '/' or &end.
void parse_group(Reader& r, int g, Location group_at, Config& config, Tracker& tracker,
                 const Origin& o) {
  const std::string& gname = group_specs()[static_cast<std::size_t>(g)].name;
  auto unterminated = [&] {
    o.fail(group_at, cat("unterminated group &", gname, " (the file ends before its closing '/')"));
  };
  bool after_key = false;  // a key was read, and its values could run on
  Target target;
  Values values;
  r.comma_flag = r.input_complete = false;
  r.eat_separator();
  while (!r.input_complete) {
    r.eat_separator();
    if (r.input_complete) return;
    if (r.s.at_eol()) r.finish_separator();
    if (r.input_complete) return;
    Location at = r.s.where();
    int c = r.s.next();
    if (c == kEof) unterminated();
    if (c == '/') return;
    if (c == '&' || c == '$') {
      std::string name = r.word();
      if (lower(name).rfind("end", 0) == 0) return;
      o.fail(at, cat("&", gname, " is not closed before '", static_cast<char>(c),
                     detail::excerpt(name), "' (missing '/')"));
    }
    r.s.unget();
    Scanner::State name_at = r.s.save();
    std::string name = r.key_name();
    const bool at_end = r.s.peek() == kEof;  // a value, then '/' on the next line, reads so
    int k = at_end ? -1 : key_index(g, name);
    if (k < 0) {  // say what it is instead
      r.s.restore(name_at);
      if (after_key && is_value_for(*target.spec, c, r.word())) {
        // Reported where the comment is, on the line of the '=': that is what to change.
        if (values.after_comment)
          o.fail(values.comment_at,
                 cat("a comment right after '=' or ',' ends the values of ", target.spec->name(),
                     " (gfortran reads no value after it, not even the one at ", at.line, ":",
                     at.col, "): move the comment after the value"));
        o.fail(at, target.too_many());
      }
      if (at_end) unterminated();
      if (is_quote(c)) o.fail(at, cat("expected a key name in &", gname, ", got a string"));
      if (name.empty())
        o.fail(at, cat("expected a key name in &", gname, ", got '", static_cast<char>(c), "'"));
      k = find_key(g, name, o, at);
    }
    const KeySpec& spec = key_specs()[static_cast<std::size_t>(k)];
    target = whole(spec);
    if (r.s.peek() == '(') {
      Location paren = r.s.where();
      r.s.next();
      target = read_index(r, spec, paren, o);
      if (r.s.peek() == '(')
        o.fail(r.s.where(),
               cat(spec.name(), " takes no second index (a substring of each element)"));
    }
    expect_equals(r, name, o);
    values = r.read_values(target);
    assign(k, at, values.items, config, tracker, o);
    after_key = true;
  }
}

// Where gfortran's READ of group `name` starts: libgfortran's find_nml_name scans the text
// for '&' or '$', the name, then a separator, taking no notice of strings or values; only
// '!' hides the rest of a line from it. {0, 0} when it finds none.
Location gfortran_header(const std::string& text, const std::string& name) {
  Scanner s(text);
  while (true) {
    Location at = s.where();
    int c = s.next();
    if (c == kEof) return {};
    if (c == '!') {
      while (c != kEof && c != '\n') c = s.next();
      continue;
    }
    if (c != '&' && c != '$') continue;
    std::size_t k = 0;
    for (; k < name.size(); ++k) {
      c = s.next();
      if (c == kEof || std::tolower(c) != name[k]) break;
    }
    if (k == name.size() && is_separator(s.peek())) return at;
  }
}

// Each group must start where gfortran starts reading it, or the two would read different
// values from the same deck.
void check_headers(const std::string& text, const std::vector<Location>& group_at,
                   const Origin& o) {
  for (std::size_t g = 0; g < group_at.size(); ++g) {
    const std::string& name = group_specs()[g].name;
    Location ours = group_at[g], theirs = gfortran_header(text, name);
    if (ours.line == theirs.line && ours.col == theirs.col) continue;
    bool earlier = theirs.line != 0 && (ours.line == 0 || theirs.line < ours.line ||
                                        (theirs.line == ours.line && theirs.col < ours.col));
    if (earlier)
      o.fail(theirs, cat("gfortran would start reading &", name, " here (it takes '&", name,
                         "' inside a string or value for the group)"));
    o.fail(ours, cat("gfortran would not find this &", name,
                     ": a '!' in a string before it hides the rest of the line; start the group on "
                     "a new line"));
  }
}

// Returns how many keys the text assigns (any element of them).
int parse_deck(const std::string& text, Config& config, const Origin& o) {
  Reader r(text, o);
  Tracker tracker;
  std::vector<Location> group_at(group_specs().size());
  while (true) {
    // Outside groups everything but '&' and '$' is ignored, as gfortran does; '!' comments a line.
    Location at = r.s.where();
    int c = r.s.next();
    if (c == kEof) break;
    if (c == '!') r.eat_line();
    if (c != '&' && c != '$') continue;
    std::string name = r.word();
    if (name.empty()) o.fail(at, cat("expected a group name after '", static_cast<char>(c), "'"));
    if (lower(name) == "end") o.fail(at, cat("'", static_cast<char>(c), "end' outside a group"));
    int g = find_group(name, o, at);
    Location& first = group_at[static_cast<std::size_t>(g)];
    if (first.line != 0)
      o.fail(at, cat("duplicate group &", group_specs()[static_cast<std::size_t>(g)].name,
                     " (first at line ", first.line, ")"));
    first = at;
    // gfortran takes '&run' as the group only when a separator follows the name.
    if (!is_separator(r.s.peek()) && r.s.peek() != kEof)
      o.fail(r.s.where(), cat("expected a blank or a new line after '", static_cast<char>(c), name,
                              "', got '", static_cast<char>(r.s.peek()), "'"));
    parse_group(r, g, at, config, tracker, o);
  }
  check_headers(text, group_at, o);
  int keys = 0;
  for (const auto& elements : tracker.set_at)
    keys += std::any_of(elements.begin(), elements.end(),
                        [](const Location& where) { return where.line != 0; });
  return keys;
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
  Target target = whole(spec);
  if (!index_text.empty()) {
    Reader ir(index_text, o);
    ir.s.next();
    target = read_index(ir, spec, none, o);
    if (!trim(ir.rest()).empty()) o.fail(none, "expected '=' after the array index");
  }
  std::string rhs = arg.substr(eq + 1);
  std::string value_text = trim(rhs);
  Values values;
  if (spec.type == KeyType::Str && (value_text.empty() || !is_quote(value_text[0]))) {
    // A bare string: the whole text, or comma-separated elements of an array.
    std::vector<std::string> parts;
    if (spec.extent == 0) {
      parts.push_back(value_text);
    } else {
      std::size_t begin = 0;
      while (true) {
        std::size_t comma = value_text.find(',', begin);
        parts.push_back(
            trim(value_text.substr(begin, comma == std::string::npos ? comma : comma - begin)));
        if (comma == std::string::npos) break;
        begin = comma + 1;
      }
    }
    if (parts.size() > target.elements.size()) o.fail(none, target.too_many());
    for (std::size_t i = 0; i < parts.size(); ++i)
      if (spec.extent == 0 || !parts[i].empty())
        values.items.push_back(
            {target.elements[i], Value(std::in_place_type<std::string>, parts[i]), none});
  } else {
    Reader r(rhs, o);
    values = r.read_values(target);
    r.eat_separator();
    if (r.input_complete) o.fail(none, "unexpected '/' in the value");
    if (r.s.at_eol()) r.finish_separator();
    int c = r.s.peek();
    if (c != kEof) {
      Scanner::State at = r.s.save();
      bool is_name = r.name_follows();
      if (!is_name && is_value_for(spec, c, r.word())) o.fail(none, target.too_many());
      r.s.restore(at);
      o.fail(none, cat("unexpected '", detail::excerpt(trim(r.rest())), "' in the value"));
    }
  }
  if (values.items.empty()) o.fail(none, "no value given");
  assign(k, none, values.items, config, tracker, o);
}

Config build_defaults() {
  Config config;
  Tracker tracker;
  const auto& specs = key_specs();
  for (std::size_t k = 0; k < specs.size(); ++k) {
    const KeySpec& spec = specs[k];
    Origin o;
    o.prefix = cat("schema.def: default of ", spec.name(), ": ");
    Reader r(spec.default_text, o);
    Values values = r.read_values(whole(spec));
    r.eat_separator();
    if (r.s.peek() != kEof || r.input_complete)
      o.fail({}, cat("unexpected '", spec.default_text, "'"));
    assign(static_cast<int>(k), {}, values.items, config, tracker, o);
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
  config.deck_keys = parse_deck(text, config, o);
  Tracker tracker;
  for (const std::string& arg : overrides) apply_override(arg, config, tracker);
  config.deck_path = filename;
  return config;
}

Config parse_file(const std::string& path, const std::vector<std::string>& overrides) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f)
    throw Error(detail::printable(cat("cannot open deck '", path, "': ", std::strerror(errno))),
                kExitInput);
  std::string text;
  char buf[65536];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  bool failed = std::ferror(f) != 0;
  int err = errno;
  std::fclose(f);
  if (failed)
    throw Error(detail::printable(cat("cannot read deck '", path, "': ", std::strerror(err))),
                kExitInput);
  return parse_text(text, path, overrides);
}

}  // namespace ptrain::deck
