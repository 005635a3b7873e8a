// deck/schema.cpp — the runtime table of groups and keys, generated from deck/schema.def,
// with typed accessors into Config; value formatting in deck syntax.
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "deck/deck.hpp"
#include "deck/detail.hpp"
#include "util/error.hpp"

namespace ptrain::deck {
namespace {

// Longest string value: longer ones are mistakes, and would be copied into every log line
// and checkpoint.
constexpr std::size_t kMaxStringLength = 4096;

struct NoLimit {};
template <class T>
struct Below {
  T value;
};

Bound bound(NoLimit) { return {}; }

template <class T>
Bound bound(T v) {
  static_assert(std::is_arithmetic_v<T>,
                "schema bounds are numbers, PTRAIN_BELOW(x) or PTRAIN_NOLIMIT");
  Bound b;
  b.limited = true;
  b.integral = std::is_integral_v<T>;
  b.as_real = static_cast<double>(v);
  if constexpr (std::is_integral_v<T>) b.as_int = static_cast<std::int64_t>(v);
  return b;
}

template <class T>
Bound bound(Below<T> v) {
  Bound b = bound(v.value);
  b.below = true;
  return b;
}

template <class T>
constexpr KeyType key_type() {
  if constexpr (std::is_same_v<T, std::int64_t>)
    return KeyType::Int;
  else if constexpr (std::is_same_v<T, double>)
    return KeyType::Real;
  else if constexpr (std::is_same_v<T, bool>)
    return KeyType::Bool;
  else
    return KeyType::Str;
}

std::vector<std::string> split_choices(const std::string& text) {
  std::vector<std::string> out;
  if (text.empty()) return out;
  std::size_t begin = 0;
  while (true) {
    std::size_t bar = text.find('|', begin);
    out.push_back(text.substr(begin, bar == std::string::npos ? std::string::npos : bar - begin));
    if (bar == std::string::npos) break;
    begin = bar + 1;
  }
  return out;
}

// One key: the Config field is (config.*group).*field; T is the element type.
template <class T, int Extent, class G, class F>
KeySpec make_key(G Config::*group, F G::*field, const char* g, const char* k, const char* def,
                 Bound lo, Bound hi, const char* choices, const char* doc) {
  KeySpec s;
  s.group = g;
  s.key = k;
  s.type = key_type<T>();
  s.extent = Extent;
  s.default_text = def;
  s.lo = lo;
  s.hi = hi;
  s.choices = split_choices(choices);
  s.doc = doc;
  s.get = [group, field](const Config& c, int i) -> Value {
    const F& f = (c.*group).*field;
    if constexpr (Extent == 0) {
      return Value(std::in_place_type<T>, f);
    } else {
      return Value(std::in_place_type<T>, T(f.at(static_cast<std::size_t>(i))));
    }
  };
  s.set = [group, field](Config& c, int i, const Value& v) {
    F& f = (c.*group).*field;
    if constexpr (Extent == 0) {
      f = std::get<T>(v);
    } else {
      if (f.size() != static_cast<std::size_t>(Extent)) f.resize(Extent);
      f.at(static_cast<std::size_t>(i)) = std::get<T>(v);
    }
  };
  return s;
}

struct Tables {
  std::vector<KeySpec> keys;
  std::vector<GroupSpec> groups;
};

// Schema consistency that the compiler cannot check.
void check_table(const Tables& t) {
  for (const KeySpec& s : t.keys) {
    bool numeric = s.type == KeyType::Int || s.type == KeyType::Real;
    if (!numeric && (s.lo.limited || s.hi.limited))
      throw Error(cat("schema.def: ", s.name(), " has bounds but is not INT or REAL"));
    if (s.type == KeyType::Int &&
        ((s.lo.limited && !s.lo.integral) || (s.hi.limited && !s.hi.integral)))
      throw Error(cat("schema.def: ", s.name(), " is INT but has a non-integer bound"));
    if (s.type != KeyType::Str && !s.choices.empty())
      throw Error(cat("schema.def: ", s.name(), " has choices but is not STR"));
    if (s.extent < 0) throw Error(cat("schema.def: ", s.name(), " has a negative extent"));
    if (s.lo.below)
      throw Error(cat("schema.def: ", s.name(), " has PTRAIN_BELOW as its lower bound"));
  }
}

Tables build_tables() {
  Tables t;
#define PTRAIN_NOLIMIT \
  NoLimit {}
#define PTRAIN_BELOW(x) \
  Below<decltype(x)> { x }
#define PTRAIN_GROUP_BEGIN(g, doc) t.groups.push_back(GroupSpec{#g, doc, {}});
#define PTRAIN_KEY(g, k, TYPE, EXTENT, def, lo, hi, choices, doc)                                \
  t.groups.back().keys.push_back(static_cast<int>(t.keys.size()));                               \
  t.keys.push_back(make_key<deck_types::TYPE, EXTENT>(&Config::g, &Config::g##_group::k, #g, #k, \
                                                      def, bound(lo), bound(hi), choices, doc));
#define PTRAIN_GROUP_END(g)
#include "deck/schema.def"
#undef PTRAIN_GROUP_BEGIN
#undef PTRAIN_KEY
#undef PTRAIN_GROUP_END
#undef PTRAIN_NOLIMIT
#undef PTRAIN_BELOW
  check_table(t);
  return t;
}

const Tables& tables() {
  static const Tables t = build_tables();
  return t;
}

std::string format_real(double x) {
  if (x != x) return "NaN";
  if (x > 1.7976931348623157e308) return "Infinity";
  if (x < -1.7976931348623157e308) return "-Infinity";
  char buf[40];
  // The fewest significant digits that read back to the same bits.
  int digits = 1;
  for (; digits < 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*e", digits - 1, x);
    double back = std::strtod(buf, nullptr);
    if (std::memcmp(&back, &x, sizeof x) == 0) break;
  }
  // %g would write 100 as 1e+02: keep whole numbers below 1e16 in plain notation.
  std::snprintf(buf, sizeof buf, "%.*e", digits - 1, x);
  int exponent = std::atoi(std::strchr(buf, 'e') + 1);
  if (exponent >= 0 && exponent <= 15 && exponent + 1 > digits) digits = exponent + 1;
  std::snprintf(buf, sizeof buf, "%.*g", digits, x);
  std::string s = buf;
  if (s.find_first_of(".e") == std::string::npos) s += ".0";  // keep it visibly a real
  return s;
}

}  // namespace

const std::vector<KeySpec>& key_specs() { return tables().keys; }
const std::vector<GroupSpec>& group_specs() { return tables().groups; }

std::string format_value(const Value& value) {
  switch (static_cast<KeyType>(value.index())) {
    case KeyType::Int:
      return std::to_string(std::get<std::int64_t>(value));
    case KeyType::Real:
      return format_real(std::get<double>(value));
    case KeyType::Bool:
      return std::get<bool>(value) ? ".true." : ".false.";
    case KeyType::Str: {
      std::string out = "'";
      for (char c : std::get<std::string>(value)) {
        if (c == '\'') out += '\'';
        out += c;
      }
      return out + "'";
    }
  }
  return "";
}

std::string value_text(const Config& config, const KeySpec& spec) {
  // Runs of one value as the namelist repeat r*c ("5, 3, 62*0"), as gfortran reads them.
  std::string out;
  for (int i = 0; i < spec.size();) {
    const std::string v = format_value(spec.get(config, i));
    int run = 1;
    while (i + run < spec.size() && format_value(spec.get(config, i + run)) == v) ++run;
    out += (out.empty() ? "" : ", ") + (run > 1 ? cat(run, "*", v) : v);
    i += run;
  }
  return out;
}

bool same_values(const Config& a, const Config& b) {
  for (const KeySpec& s : key_specs()) {
    for (int i = 0; i < s.size(); ++i) {
      Value x = s.get(a, i), y = s.get(b, i);
      if (s.type == KeyType::Real) {
        double dx = std::get<double>(x), dy = std::get<double>(y);
        if (std::memcmp(&dx, &dy, sizeof dx) != 0) return false;
      } else if (x != y) {
        return false;
      }
    }
  }
  return true;
}

namespace detail {

std::string element_name(const KeySpec& spec, int element) {
  if (spec.extent == 0) return spec.name();
  return cat(spec.name(), "(", element + 1, ")");
}

namespace {
std::string show_bound(const KeySpec& spec, const Bound& b) {
  return spec.type == KeyType::Int ? std::to_string(b.as_int) : format_value(b.as_real);
}

bool is_control(char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; }

std::string hex_byte(char c) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(static_cast<unsigned char>(c)));
  return buf;
}

// The first "&name" or "$name" of a group in `text` followed by a separator, which is where
// gfortran would start reading that group even inside a string; or "".
std::string group_mark(const std::string& text) {
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '&' && text[i] != '$') continue;
    for (const GroupSpec& g : group_specs()) {
      std::size_t end = i + 1 + g.name.size();
      if (end >= text.size() || !std::strchr(" \t\r\n,/;!", text[end])) continue;
      std::string word = text.substr(i + 1, g.name.size());
      for (char& c : word) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (word == g.name) return text.substr(i, end - i);
    }
  }
  return "";
}

}  // namespace

std::string value_error(const KeySpec& spec, int element, const Value& value) {
  bool low = false, high = false;
  if (spec.type == KeyType::Int) {
    std::int64_t x = std::get<std::int64_t>(value);
    low = spec.lo.limited && x < spec.lo.as_int;
    high = spec.hi.limited && (spec.hi.below ? x >= spec.hi.as_int : x > spec.hi.as_int);
  } else if (spec.type == KeyType::Real) {
    double x = std::get<double>(value);
    low = spec.lo.limited && x < spec.lo.as_real;
    high = spec.hi.limited && (spec.hi.below ? x >= spec.hi.as_real : x > spec.hi.as_real);
  }
  if (low || high) {
    std::string range;
    if (spec.lo.limited && spec.hi.limited)
      range = cat("must be in [", show_bound(spec, spec.lo), ", ", show_bound(spec, spec.hi),
                  spec.hi.below ? ")" : "]");
    else if (spec.lo.limited)
      range = cat("must be >= ", show_bound(spec, spec.lo));
    else
      range = cat("must be ", spec.hi.below ? "< " : "<= ", show_bound(spec, spec.hi));
    return cat(element_name(spec, element), " = ", format_value(value),
               " is out of range: ", range);
  }
  if (spec.type != KeyType::Str) return "";
  const std::string& x = std::get<std::string>(value);
  if (x.size() > kMaxStringLength)
    return cat(element_name(spec, element), " is ", x.size(), " characters long (at most ",
               kMaxStringLength, " are allowed)");
  for (char c : x)
    if (is_control(c) && c != '\t')
      return cat(element_name(spec, element), " = ", format_value(excerpt(x)),
                 " contains the control character ", hex_byte(c), " (not allowed in a string)");
  std::string group = group_mark(x);
  if (!group.empty())
    return cat(element_name(spec, element), " = ", format_value(excerpt(x)), " contains '", group,
               "', which gfortran would take for the start of a group");
  if (!spec.choices.empty()) {
    for (const std::string& choice : spec.choices)
      if (x == choice) return "";
    std::string list;
    for (std::size_t i = 0; i < spec.choices.size(); ++i)
      list += (i ? ", " : "") + format_value(spec.choices[i]);
    return cat(element_name(spec, element), " = ", format_value(excerpt(x)), " is not one of ",
               list);
  }
  return "";
}

std::string printable(const std::string& text) {
  std::string out;
  for (char c : text) out += is_control(c) ? hex_byte(c) : std::string(1, c);
  return out;
}

std::string excerpt(const std::string& text) {
  constexpr std::size_t kLength = 80;
  return text.size() <= kLength ? text : text.substr(0, kLength - 3) + "...";
}

}  // namespace detail

}  // namespace ptrain::deck
