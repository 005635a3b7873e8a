// ptrain-test: np=1 labels=quick timeout=120
// gfortran as the oracle of the namelist grammar: a Fortran program generated from the
// schema table declares every group as a NAMELIST, reads decks with READ(nml=...) and
// prints every value or its error; the deck parser must return exactly the same values, and
// refuse (with file:line:col) what gfortran refuses. Hand-written cases, then 600 decks
// from a seeded generator in both directions. Skipped when gfortran is not installed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "deck/deck.hpp"
#include "util/error.hpp"

using namespace ptrain;

namespace {

std::string fortran_literal(const deck::Value& v) {
  switch (static_cast<deck::KeyType>(v.index())) {
    case deck::KeyType::Int:
      return std::to_string(std::get<std::int64_t>(v)) + "_int64";
    case deck::KeyType::Real: {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.17e_real64", std::get<double>(v));
      return buf;
    }
    case deck::KeyType::Bool:
      return std::get<bool>(v) ? ".true." : ".false.";
    case deck::KeyType::Str: {
      std::string out = "'";
      for (char c : std::get<std::string>(v))
        out += c == '\'' ? std::string("''") : std::string(1, c);
      return out + "'";
    }
  }
  return "";
}

// For every deck named on its command line, "==deck", then one subroutine per group (so
// equal key names in two groups cannot clash): declare the keys, set the schema defaults,
// READ the namelist, print "!error &group: message" when gfortran refuses it, "!eof &group"
// when it meets the end of the file (the group is missing, or not closed), and the
// "group%key(i)=value" lines. Integers print as I0, reals as their 64 bits (exact),
// logicals as T/F, strings in [].
std::string fortran_program() {
  const Config d = deck::defaults();
  const auto& specs = deck::key_specs();
  std::ostringstream f;
  f << "program deck_oracle\n  implicit none\n  character(len=4096) :: zz_path\n  integer :: zz_k\n"
    << "  do zz_k = 1, command_argument_count()\n"
    << "    call get_command_argument(zz_k, zz_path)\n    write(*,'(A)') '==deck'\n";
  for (const auto& g : deck::group_specs()) f << "    call read_" << g.name << "(trim(zz_path))\n";
  f << "  end do\nend program deck_oracle\n\n";
  for (const auto& g : deck::group_specs()) {
    f << "subroutine read_" << g.name << "(zz_path)\n"
      << "  use iso_fortran_env, only: int64, real64\n  implicit none\n"
      << "  character(len=*), intent(in) :: zz_path\n"
      << "  integer :: zz_u, zz_ios, zz_i\n  character(len=512) :: zz_msg\n";
    std::string names;
    for (int k : g.keys) {
      const deck::KeySpec& s = specs[static_cast<std::size_t>(k)];
      const char* type = s.type == deck::KeyType::Int    ? "integer(int64)"
                         : s.type == deck::KeyType::Real ? "real(real64)"
                         : s.type == deck::KeyType::Bool ? "logical"
                                                         : "character(len=256)";
      f << "  " << type << " :: " << s.key;
      if (s.extent > 0) f << "(" << s.extent << ")";
      f << "\n";
      names += (names.empty() ? "" : ", ") + s.key;
    }
    f << "  namelist /" << g.name << "/ " << names << "\n";
    for (int k : g.keys) {
      const deck::KeySpec& s = specs[static_cast<std::size_t>(k)];
      for (int i = 0; i < s.size(); ++i)
        f << "  " << s.key << (s.extent > 0 ? cat("(", i + 1, ")") : "") << " = "
          << fortran_literal(s.get(d, i)) << "\n";
    }
    f << "  open(newunit=zz_u, file=zz_path, status='old', action='read')\n"
      << "  read(zz_u, nml=" << g.name << ", iostat=zz_ios, iomsg=zz_msg)\n"
      << "  close(zz_u)\n"
      << "  if (zz_ios > 0) then\n"
      << "    write(*,'(A)') '!error &" << g.name << ": ' // trim(zz_msg)\n"
      << "    return\n  end if\n"
      << "  if (zz_ios < 0) write(*,'(A)') '!eof &" << g.name << "'\n";
    for (int k : g.keys) {
      const deck::KeySpec& s = specs[static_cast<std::size_t>(k)];
      std::string var = s.key, loop_end;
      std::string head = "'" + s.name() + "='", fmt = "A,";  // write(*,'(fmt...)') head, value
      if (s.extent > 0) {
        f << "  do zz_i = 1, " << s.extent << "\n";
        var += "(zz_i)";
        head = "'" + s.name() + "(', zz_i, ')='";
        fmt = "A,I0,A,";
        loop_end = "  end do\n";
      }
      switch (s.type) {
        case deck::KeyType::Int:
          f << "  write(*,'(" << fmt << "I0)') " << head << ", " << var << "\n";
          break;
        case deck::KeyType::Real:
          f << "  write(*,'(" << fmt << "I0)') " << head << ", transfer(" << var << ", 0_int64)\n";
          break;
        case deck::KeyType::Bool:
          f << "  write(*,'(" << fmt << "L1)') " << head << ", " << var << "\n";
          break;
        case deck::KeyType::Str:
          f << "  write(*,'(" << fmt << "A)') " << head << ", '[' // trim(" << var << ") // ']'\n";
          break;
      }
      f << loop_end;
    }
    f << "end subroutine read_" << g.name << "\n\n";
  }
  return f.str();
}

// Our parser's values in the oracle's output format.
std::map<std::string, std::string> our_values(const Config& c) {
  std::map<std::string, std::string> out;
  for (const deck::KeySpec& s : deck::key_specs()) {
    for (int i = 0; i < s.size(); ++i) {
      std::string label = s.extent > 0 ? cat(s.name(), "(", i + 1, ")") : s.name();
      deck::Value v = s.get(c, i);
      switch (s.type) {
        case deck::KeyType::Int:
          out[label] = std::to_string(std::get<std::int64_t>(v));
          break;
        case deck::KeyType::Real: {
          double x = std::get<double>(v);
          std::int64_t bits;
          std::memcpy(&bits, &x, sizeof bits);
          out[label] = std::to_string(bits);
          break;
        }
        case deck::KeyType::Bool:
          out[label] = std::get<bool>(v) ? "T" : "F";
          break;
        case deck::KeyType::Str: {
          std::string str = std::get<std::string>(v);
          while (!str.empty() && str.back() == ' ') str.pop_back();  // Fortran's trim()
          out[label] = "[" + str + "]";
          break;
        }
      }
    }
  }
  return out;
}

// Whether gfortran's READ finds the header of group `g` in `text`, as libgfortran's
// find_nml_name looks for it: '!' comments out the rest of a line; '&' or '$', then the
// name compared character by character (a mismatch eats that character), then a separator.
bool gfortran_finds_group(const std::string& text, const std::string& g) {
  std::size_t i = 0;
  auto next = [&]() -> int { return i < text.size() ? static_cast<unsigned char>(text[i++]) : -1; };
  while (true) {
    int c = next();
    if (c == -1) return false;
    if (c == '!') {
      while (c != -1 && c != '\n') c = next();
      continue;
    }
    if (c != '&' && c != '$') continue;
    std::size_t k = 0;
    for (; k < g.size(); ++k) {
      c = next();
      if (c == -1 || std::tolower(c) != g[k]) break;
    }
    if (k < g.size()) continue;
    c = next();
    if (c != -1 && std::strchr(" \t\r\n,/;!", c)) return true;
    if (c != -1) --i;
  }
}

class DeckFortran : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system("gfortran --version > /dev/null 2>&1") != 0) return;
    char tmpl[] = "/tmp/ptrain_deck_fortran_XXXXXX";
    if (!mkdtemp(tmpl)) return;
    dir_ = tmpl;
    std::ofstream(dir_ + "/oracle.f90") << fortran_program();
    std::string cmd =
        "cd " + dir_ +
        " && gfortran -ffree-line-length-none -o oracle oracle.f90 > compile.log 2>&1";
    compiled_ = std::system(cmd.c_str()) == 0;
  }
  static void TearDownTestSuite() {
    if (!dir_.empty()) std::system(("rm -rf " + dir_).c_str());
  }
  void SetUp() override {
    if (dir_.empty()) GTEST_SKIP() << "gfortran not found: the namelist oracle is skipped";
    ASSERT_TRUE(compiled_) << "the generated Fortran oracle does not compile; see " << dir_
                           << "/compile.log";
  }

  // What gfortran made of one deck.
  struct Verdict {
    std::string error;                          // "&group: message" when it refused the deck
    std::vector<std::string> eof;               // groups where it met the end of the file
    std::map<std::string, std::string> values;  // label -> value otherwise
  };

  // Writes a deck for the oracle, with one more line end: after the last '/' gfortran may
  // read on (a logical word looks ahead for an '=') and report the end of the file even
  // though the group was complete; ptrain does not need the line end.
  static std::string write_deck(const std::string& name, const std::string& deck) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << deck << "\n";
    return path;
  }

  // Runs the oracle over the deck files `paths`, as few times as it takes: libgfortran
  // crashes on some malformed decks (a line end inside an index), which counts as refusing
  // that deck; the oracle then goes on with the next one.
  static std::vector<Verdict> run_oracle(const std::vector<std::string>& paths) {
    std::vector<Verdict> out;
    while (out.size() < paths.size()) {
      std::string cmd = dir_ + "/oracle";
      for (std::size_t i = out.size(); i < paths.size(); ++i) cmd += " " + paths[i];
      std::FILE* p = popen((cmd + " 2>/dev/null").c_str(), "r");
      if (!p) {
        ADD_FAILURE() << "cannot run " << cmd;
        break;
      }
      std::string all;
      char buf[65536];
      std::size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) all.append(buf, n);
      bool crashed = pclose(p) != 0;
      std::size_t first = out.size();
      std::istringstream lines(all);
      std::string l;
      while (std::getline(lines, l)) {
        if (l == "==deck") {
          out.emplace_back();
        } else if (out.size() == first) {
          ADD_FAILURE() << "oracle: " << l;
        } else if (l.rfind("!error ", 0) == 0) {
          if (out.back().error.empty()) out.back().error = l.substr(7);
        } else if (l.rfind("!eof &", 0) == 0) {
          out.back().eof.push_back(l.substr(6));
        } else if (std::size_t eq = l.find('='); eq != std::string::npos) {
          out.back().values[l.substr(0, eq)] = l.substr(eq + 1);
        }
      }
      if (crashed) {
        if (out.size() == first) out.emplace_back();
        out.back().error = "gfortran crashed";
      }
    }
    return out;
  }

  // Whether gfortran refused the deck: an error, or the end of the file inside a group it
  // found (gfortran reports that as it reports a missing group: end of file).
  static bool refused(const Verdict& v, const std::string& deck) {
    if (!v.error.empty()) return true;
    for (const std::string& g : v.eof)
      if (gfortran_finds_group(deck, g)) return true;
    return false;
  }

  // Runs the oracle on `deck`, which gfortran must read; returns label -> value.
  std::map<std::string, std::string> oracle(const std::string& deck) {
    Verdict v = run_oracle({write_deck("deck.nml", deck)})[0];
    EXPECT_FALSE(refused(v, deck)) << "gfortran could not read the deck (" << v.error << "):\n"
                                   << deck;
    return v.values;
  }

  void expect_same(const std::string& deck) {
    std::map<std::string, std::string> want = oracle(deck);
    std::map<std::string, std::string> got = our_values(deck::parse_text(deck, "deck.nml"));
    ASSERT_EQ(want.size(), got.size()) << deck;
    for (const auto& [label, value] : want)
      EXPECT_EQ(got[label], value) << label << " in deck:\n" << deck;
  }

  // gfortran refuses the deck, and so does the parser, naming file:line (`where`, when given:
  // "deck.nml:1:14:").
  void expect_both_reject(const std::string& deck, const std::string& where = "deck.nml:") {
    EXPECT_TRUE(refused(run_oracle({write_deck("deck.nml", deck)})[0], deck))
        << "gfortran reads this deck:\n"
        << deck;
    try {
      deck::parse_text(deck, "deck.nml");
      ADD_FAILURE() << "ptrain reads this deck:\n" << deck;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(where, 0), 0u) << e.what();
    }
  }

  static std::string dir_;
  static bool compiled_;
};
std::string DeckFortran::dir_;
bool DeckFortran::compiled_ = false;

// --- generated decks ------------------------------------------------------------------
// A seeded generator writes decks over the whole grammar (quoting, continuation, repeats,
// nulls, exponents, case, comments, separators, indices and sections, $-groups), valid ones
// and mutated ones; gfortran and ptrain read each.

class DeckGenerator {
 public:
  explicit DeckGenerator(std::uint64_t seed) : rng_(seed) {}

  std::string deck() {
    std::string out = pick({"", "", "! a generated deck\n", "notes before the groups\n"});
    std::vector<int> groups;
    for (std::size_t g = 0; g < deck::group_specs().size(); ++g) groups.push_back(int(g));
    shuffle(groups);
    groups.resize(1 + below(4));
    for (int g : groups)
      out += group(deck::group_specs()[std::size_t(g)]) + pick({"\n", "\n\n", "\n! between\n"});
    for (int m = below(3); m > 0; --m) mutate(out);
    if (out.empty() || out.back() != '\n') out += '\n';
    return out;
  }

 private:
  std::mt19937_64 rng_;

  int below(int n) { return int(rng_() % std::uint64_t(n)); }
  bool percent(int p) { return below(100) < p; }
  std::string pick(std::initializer_list<const char*> options) {
    return *(options.begin() + below(int(options.size())));
  }
  template <class V>
  void shuffle(V& v) {
    for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[std::size_t(below(int(i)))]);
  }
  std::string cased(const std::string& s) {
    std::string out = s;
    int how = below(4);
    for (char& c : out)
      if (how == 1 || (how == 2 && percent(50)))
        c = char(std::toupper(static_cast<unsigned char>(c)));
    return out;
  }

  std::string group(const deck::GroupSpec& g) {
    std::string out = (percent(20) ? "$" : "&") + cased(g.name) + pick({" ", "\n  ", "\n", "\t"});
    std::vector<int> keys = g.keys;
    shuffle(keys);
    keys.resize(std::size_t(1 + below(std::min<int>(4, int(keys.size())))));
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (i) out += separator();
      out += item(deck::key_specs()[std::size_t(keys[i])]);
    }
    return out + pick({" /", "\n/", "\n&end", " $end", "\n&END", ",\n/", " /  ! done"});
  }

  std::string separator() {
    return pick({", ", ",", " ", "\n  ", ",\n  ", "  ! a comment\n  ", "\n\n  ",
                 "\n  ! a comment line\n  ", "; ", " ,\n  "});
  }

  std::string item(const deck::KeySpec& s) {
    std::string name = cased(s.key);
    if (s.extent == 0) return name + pick({" = ", "=", " =", "= ", " =\n  "}) + value(s, 0);
    // An array: whole, from an index, or a section; values separated, repeated or null.
    int first = 0, count = s.extent;
    int form = below(4);
    if (form == 1) {
      first = below(s.extent);
      count = s.extent - first;
      name += cat("(", first + 1, ")");
    } else if (form == 2) {
      first = below(s.extent);
      int last = first + below(s.extent - first);
      count = last - first + 1;
      name += cat("(", first + 1, ":", last + 1, ")");
    }
    std::string out = name + pick({" = ", "=", " =\n  "});
    int n = 1 + below(count);
    for (int i = 0; i < n;) {
      if (i) out += pick({", ", ",", " ", ",\n  ", "; "});
      int left = n - i;
      if (left > 1 && percent(20)) {
        int r = 2 + below(left - 1);
        out += cat(r, "*", percent(20) ? "" : value(s, first + i));
        i += r;
      } else if (percent(10)) {
        out += i + 1 < n ? "" : value(s, first + i);  // a null between two commas
        ++i;
      } else {
        out += value(s, first + i);
        ++i;
      }
    }
    return out;
  }

  std::string value(const deck::KeySpec& s, int element) {
    switch (s.type) {
      case deck::KeyType::Int:
        return int_text(s);
      case deck::KeyType::Real:
        return real_text(s);
      case deck::KeyType::Bool:
        return pick({".true.", ".false.", "T", "F", "t", "f", ".t.", ".F.", "true", "False",
                     ".TRUE.", ".tomato", "1*T"});
      case deck::KeyType::Str:
        return string_text(s, element);
    }
    return "";
  }

  std::string int_text(const deck::KeySpec& s) {
    std::int64_t lo = s.lo.limited ? s.lo.as_int : -100;
    std::int64_t hi = s.hi.limited ? std::min<std::int64_t>(s.hi.as_int, lo + 5000) : lo + 5000;
    std::int64_t v = lo + std::int64_t(rng_() % std::uint64_t(hi - lo + 1));
    std::string text = std::to_string(v);
    switch (below(6)) {
      case 0:
        return v >= 0 ? "+" + text : text;
      case 1:
        return v >= 0 ? "00" + text : text;
      case 2:
        return "1*" + text;
      default:
        return text;
    }
  }

  std::string real_text(const deck::KeySpec& s) {
    for (int attempt = 0;; ++attempt) {
      std::string digits = std::to_string(below(100000));
      std::size_t dot = std::size_t(below(int(digits.size()) + 1));
      std::string mantissa = digits.substr(0, dot) + "." + digits.substr(dot);
      if (percent(10)) mantissa = digits;
      int e = below(9) - 6;
      std::string exp = e < 0 ? cat("-", -e) : cat(percent(50) ? "+" : "", e);
      std::string text;
      switch (below(7)) {
        case 0:
          text = mantissa;
          break;
        case 1:
          text = mantissa + "e" + exp;
          break;
        case 2:
          text = mantissa + pick({"d", "D", "E", "q"}) + exp;
          break;
        default:
          text = mantissa + (exp[0] == '-' || exp[0] == '+' ? exp : "+" + exp);
          break;
      }
      std::string c_text = text;
      for (char& c : c_text)
        if (c == 'd' || c == 'D' || c == 'q') c = 'e';
      if (std::isdigit(static_cast<unsigned char>(text.back())) &&
          text.find_first_of("eEdDq") == std::string::npos &&
          text.find_first_of("+-", 1) != std::string::npos)
        c_text.insert(text.find_first_of("+-", 1), "e");
      double v = std::strtod(c_text.c_str(), nullptr);
      bool in = (!s.lo.limited || v >= s.lo.as_real) &&
                (!s.hi.limited || (s.hi.below ? v < s.hi.as_real : v <= s.hi.as_real));
      if (in || attempt > 20) return percent(10) ? "1*" + text : text;
    }
  }

  std::string string_text(const deck::KeySpec& s, int element) {
    // Free text for keys without choices (no '&' or '$': gfortran would take "&run" inside
    // a string for the start of a group).
    std::string body;
    bool free = s.choices.empty() || percent(3);
    if (free) {
      static const char alphabet[] = "abcXYZ019 _-.,/=!*()'\"";
      for (int n = below(12); n > 0; --n) body += alphabet[below(int(sizeof alphabet) - 1)];
    } else {
      body = s.choices[std::size_t(element + below(int(s.choices.size()))) % s.choices.size()];
    }
    char quote = percent(70) ? '\'' : '"';
    std::string out(1, quote);
    for (std::size_t i = 0; i < body.size(); ++i) {
      if (body[i] == quote) out += quote;
      out += body[i];
      if (percent(3))
        out += free ? pick({"\n", "\r\n", "\n   "}) : pick({"\n", "\r\n"});  // continued
    }
    return out + quote;
  }

  // One change to the text, often one gfortran refuses.
  void mutate(std::string& text) {
    if (text.empty()) return;
    auto at = [&](const std::string& what) -> std::size_t {
      std::vector<std::size_t> hits;
      for (std::size_t i = text.find(what); i != std::string::npos; i = text.find(what, i + 1))
        hits.push_back(i);
      return hits.empty() ? std::string::npos : hits[std::size_t(below(int(hits.size())))];
    };
    std::size_t i;
    switch (below(18)) {
      case 0:  // a comment where the value should be
        if ((i = at("= ")) != std::string::npos) text.insert(i + 1, " ! where the value was\n ");
        break;
      case 1:  // a blank before an index
        if ((i = at("(")) != std::string::npos && i > 0 &&
            std::isalpha(static_cast<unsigned char>(text[i - 1])))
          text.insert(i, " ");
        break;
      case 2:  // null values past the end
        if ((i = at(" /")) != std::string::npos)
          text.insert(i, pick({",,,", ", 2*", ", 6*", ",,", ", 1*"}));
        break;
      case 3:  // a quote lost: the string runs on
        if ((i = at("'")) != std::string::npos) text.erase(i, 1);
        break;
      case 4:  // an exponent changed
        if ((i = text.find_first_of("eEdD", std::size_t(below(int(text.size()))))) !=
                std::string::npos &&
            i > 0 && std::isdigit(static_cast<unsigned char>(text[i - 1])))
          text.replace(i, 1, pick({"", "q", "x", "e+", "e-.", ".0e"}));
        break;
      case 5:  // the group not closed
        if ((i = at("/")) != std::string::npos) text.erase(i, 1);
        break;
      case 6:  // a bad index or section
        if ((i = at("(")) != std::string::npos)
          text.insert(i + 1, pick({"0", "6", "3:2,", "::2,", "-1", " 2 ", ":"}));
        break;
      case 7:  // ';' for ','
        if ((i = at(",")) != std::string::npos) text[i] = ';';
        break;
      case 8:  // a value gfortran takes but ptrain refuses
        if ((i = at("= ")) != std::string::npos)
          text.insert(i + 2, pick({"inf, ", "NaN ", "1e999, ", "123 ", "'a\x01'"}));
        break;
      case 9:  // a key given twice, or misspelled
        if ((i = at("\n")) != std::string::npos)
          text.insert(i, pick({", seed = 7", " stepz = 1", ", name = 'x'"}));
        break;
      case 10:  // an unknown group, or '&' where a name should be
        text.insert(0, pick({"&modle n_layer = 2 /\n", "&run /\n", "& run /\n", "$end\n"}));
        break;
      case 11:  // a comment glued to a name
        if ((i = at(" = ")) != std::string::npos) text.insert(i, "! a comment\n");
        break;
      case 12:  // garbage for a value
        if ((i = at("= ")) != std::string::npos)
          text.insert(i + 2, pick({"abc ", "1.2.3 ", "--5 ", ".e3 ", "2*3*4 "}));
        break;
      case 13:  // CR LF line ends
        for (i = text.find('\n'); i != std::string::npos; i = text.find('\n', i + 2))
          text.insert(i, "\r");
        break;
      case 14:  // tabs for blanks
        for (char& c : text)
          if (c == ' ' && percent(30)) c = '\t';
        break;
      case 15:  // two lines made one
        if ((i = at("\n")) != std::string::npos && i + 1 < text.size()) text[i] = ' ';
        break;
      case 16:  // an index or substring after a scalar key
        if ((i = at(" = ")) != std::string::npos) text.insert(i, pick({"(1)", "(1:2)"}));
        break;
      default:  // a line end somewhere
        text.insert(std::size_t(below(int(text.size()))), "\n");
    }
  }
};

// Messages of the places where ptrain is stricter than gfortran on purpose.
bool deliberately_stricter(const std::string& message) {
  for (const char* why :
       {"unknown group", "expected a group name after", "outside a group", "duplicate group",
        "duplicate key", "is out of range", "is not one of", "(beyond the range of a double)",
        "(infinities and NaNs are not allowed)", "expected a quoted string", "control character",
        "characters long", "a blank separates two numbers", "gfortran would", "gfortran misreads",
        "takes no"})
    if (message.find(why) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_F(DeckFortran, GeneratedDecksReadTheSameBothWays) {
  // What gfortran reads, ptrain reads to the same values (or refuses on purpose, see
  // deliberately_stricter); what gfortran refuses, ptrain refuses with file:line:col.
  constexpr int kDecks = 600;
  DeckGenerator gen(20240611);
  std::vector<std::string> decks, paths;
  for (int i = 0; i < kDecks; ++i) {
    decks.push_back(gen.deck());
    paths.push_back(write_deck(cat("gen", i, ".nml"), decks.back()));
  }
  std::vector<Verdict> verdicts = run_oracle(paths);
  ASSERT_EQ(verdicts.size(), decks.size());
  int same = 0, both_refuse = 0, stricter = 0;
  for (std::size_t i = 0; i < decks.size(); ++i) {
    const std::string& deck = decks[i];
    std::string ours;
    std::map<std::string, std::string> got;
    try {
      got = our_values(deck::parse_text(deck, "deck.nml"));
    } catch (const Error& e) {
      ours = e.what();
    }
    if (refused(verdicts[i], deck)) {
      EXPECT_FALSE(ours.empty()) << "gfortran refuses (" << verdicts[i].error
                                 << "), ptrain reads deck " << i << ":\n"
                                 << deck;
      bool located =
          ours.rfind("deck.nml:", 0) == 0 && std::isdigit(static_cast<unsigned char>(ours[9]));
      EXPECT_TRUE(ours.empty() || located) << ours;
      ++both_refuse;
    } else if (!ours.empty()) {
      EXPECT_TRUE(deliberately_stricter(ours))
          << "gfortran reads, ptrain refuses deck " << i << ": " << ours << "\n"
          << deck;
      ++stricter;
    } else {
      for (const auto& [label, value] : verdicts[i].values)
        EXPECT_EQ(got[label], value) << label << " in deck " << i << ":\n" << deck;
      ++same;
    }
  }
  std::printf(
      "%d decks: %d read to the same values, %d refused by both, %d refused by ptrain only (on "
      "purpose)\n",
      kDecks, same, both_refuse, stricter);
  // The generator must exercise both directions.
  EXPECT_GE(same, kDecks / 4);
  EXPECT_GE(both_refuse, kDecks / 10);
}

TEST_F(DeckFortran, DefaultsAgree) { expect_same("! no groups at all\n"); }

TEST_F(DeckFortran, F90nmlOutput) {
  expect_same(
      "&run\n    name = 'f90nml'\n    seed = 42\n    trace = .true.\n/\n\n"
      "&model\n    n_layer = 4\n    d_model = 256\n    dtype = 'fp32'\n    capacity_factor = "
      "1.5\n/\n\n"
      "&parallel\n    order = 'd', 't', 'c', 'e', 'p'\n    bucket_mb = 0.001\n/\n\n"
      "&train\n    lr = 0.0003\n    eps = 1e-08\n    beta2 = 0.999\n/\n");
}

TEST_F(DeckFortran, UppercaseAndFortranReals) {
  expect_same(
      "&MODEL\n  N_LAYER = 8, D_MODEL = 64\n  DTYPE = 'fp64'\n/\n"
      "&TRAIN LR = 1.0D-3, MIN_LR = 1.D0, BETA1=.5, WEIGHT_DECAY = 2\n"
      "  BETA2 = +9.5E-1, EPS = 3e-4, CLIP = 2., OPTIMIZER = \"sgd\" /\n"
      "&Backend Peak_Gflops = 1.5e+3 , blas_threads=+3 /\n");
  expect_same(
      "&model capacity_factor = -0. /\n&data val_fraction = 1e-1 /\n&backend peak_gflops = 7 /\n");
  expect_same(
      "&train lr = 0.1000000000000000055511151231257827, eps = 2.2250738585072014d-308 /\n");
}

TEST_F(DeckFortran, EndTerminatorCommentsAndTextOutsideGroups) {
  expect_same(
      "This deck is read by gfortran and by ptrain.\n"
      "Lines outside groups are ignored.\n"
      "&run ! the run\n"
      "  steps = 7   ! seven\n"
      "\n"
      "  name = 'x!y/z' , out_dir = \"a/b\"\n"
      "&end\n"
      "more text\n"
      "&data source = 'bytes', path = 'input.txt', val_fraction = 0.25 /\n");
}

TEST_F(DeckFortran, Logicals) {
  const char* forms[][4] = {{".true.", ".false.", "T", "F"},
                            {".t.", ".f.", "true", "false"},
                            {".TRUE.", "f", "t", ".FALSE."},
                            {".tomato", ".fig", "Tuesday", "F"}};
  for (auto& f : forms)
    expect_same(cat("&run trace = ", f[0], " /\n&parallel sequence_parallel = ", f[1],
                    ", strict_topology = ", f[2], " /\n&checkpoint save_final = ", f[3], " /\n"));
}

TEST_F(DeckFortran, Strings) {
  expect_same(
      "&run name = 'it''s', out_dir = \"say \"\"hi\"\"\" /\n"
      "&model init_from = \"a'b\" /\n"
      "&checkpoint dir = '', restart = 'latest' /\n");
}

TEST_F(DeckFortran, IntegersAndSigns) {
  expect_same("&run seed = +42, steps = 0, log_every = 1*5 /\n&parallel dp = -1, tp = +2 /\n");
  expect_same("&parallel dp = 4 /\n&run seed = 9223372036854775807 /\n");
}

TEST_F(DeckFortran, Arrays) {
  expect_same("&parallel order = 'p' 'd' 'e' 'c' 't' /\n");
  expect_same("&parallel order = 'p',\n   'd', 'e',\n   'c', 't' /\n");
  expect_same("&parallel order(2) = 'd' /\n");
  expect_same("&parallel order(4) = 'c', 'c' /\n");
  expect_same("&parallel order = 2*'t', 3*'c' /\n");
  expect_same("&parallel order = , 'p', , 'e' /\n");
  expect_same("&parallel order = 2*, 'd' /\n");
  expect_same("&parallel order(1) = 'd', order(5) = 't' /\n");
  expect_same("&parallel order = 'p',,,,, /\n");
}

TEST_F(DeckFortran, NullsSeparatorsAndGroupOrder) {
  expect_same("&model n_layer=2,d_model=64,n_head=8/\n");
  expect_same("&model n_layer = 6, d_model = , n_head = 2 /\n");
  expect_same("&train micro_batch=2 / &model n_layer=3 / &run steps=1 /\n");
  expect_same("&backend\n\tdevice = 'cpu'\n\tblas_threads = 2\n/\n&run\n\ttrace = T\n/\n");
  expect_same("&model\r\n  n_layer = 2\r\n  dtype = 'fp64'\r\n/\r\n");
}

TEST_F(DeckFortran, StringsContinuedOverLines) {
  expect_same("&run name = 'abc\ndef' /\n");
  expect_same(
      "&run name = 'ab\r\n  cd', out_dir = \"x\n!y\" /\n&model init_from = 'it''\n''s' /\n");
  expect_same("&parallel order = 'p', 'd\n', 'e' /\n");
}

TEST_F(DeckFortran, RealsWithoutExponentLetter) {
  expect_same("&train lr = 1.5-3, min_lr = 1.5+3 /\n");
  expect_same(
      "&train eps = 15-3, clip = .5+1, weight_decay = 2q-1, beta1 = 1*5.-1, beta2 = 9.5D-1 /\n");
  expect_same("&train lr = 1.5-400, eps = 4.9-324 /\n");
}

TEST_F(DeckFortran, DollarGroups) {
  expect_same("$run steps = 5 $end\n");
  expect_same(
      "$RUN steps = 5 /\n$model n_layer = 2 &end\n&train lr = 1e-3 $END\n&data val_samples = 3 "
      "&endgroup\n");
}

TEST_F(DeckFortran, ArraySections) {
  expect_same("&parallel order(2:3) = 'd', 'd' /\n");
  expect_same("&parallel order(:) = 'p', 'p' /\n");
  expect_same("&parallel order(4:) = 'c', 'c', sequence_parallel = T /\n");
  expect_same("&parallel order(1:5:2) = 'd', 'd', 't' /\n");
  expect_same("&parallel order(5:1:-1) = 't', 't' /\n");
  expect_same("&parallel order( +2 ) = 'p' /\n");
  expect_same("&parallel order(2:3) = 'd',,, /\n");
}

TEST_F(DeckFortran, NullsCommentsAndSeparators) {
  expect_same("&run steps = ,, seed = 5 /\n&parallel order = 't', 4*, /\n");
  expect_same("&run steps = ! c\n seed = 5 /\n&parallel order = 'p' ! c\n 'd' /\n");
  expect_same("&run steps =\n ! c\n 5, log_every = 1*\n,\n seed = 2 /\n");
  expect_same("&run steps = 5; seed = 3 /\n&parallel order = 'p';; 'd' /\n");
  expect_same("&parallel order = 'p',,,,,, /\n&run , , steps = 5 /\n");
  expect_same("&run steps\n= 5, seed ! c\n = 6 /\n");
}

TEST_F(DeckFortran, GroupNamesInsideStrings) {
  // gfortran starts reading a group wherever '&name' or '$name' and a separator stand, in
  // strings too; elsewhere in a string they are text.
  expect_same("&model init_from = 'R&D/$data.bin/&run' /\n&run steps = 3 /\n");
  expect_both_reject("&model init_from = 'x &run y' /\n&run steps = 3 /\n");
  expect_both_reject("&run name = 'a &model\nx' /\n&model n_layer = 2 /\n");
}

TEST_F(DeckFortran, WhatGfortranRejects) {
  expect_both_reject("&parallel order (1) = 'c' /\n");
  expect_both_reject("&run steps = 2* /\n");
  expect_both_reject("&parallel order = 't', 5* /\n");
  expect_both_reject("&run steps = ,,, /\n");
  expect_both_reject("&parallel order = 'p',,,,,,, /\n");
  expect_both_reject("&parallel order(1:2) = 'p', 'p', 'p' /\n");
  expect_both_reject("&run steps = ! the steps\n 5 /\n");
  expect_both_reject("&run name = ! c\n 'x' /\n");
  expect_both_reject("&parallel order = 'p', ! c\n 'd' /\n");
  expect_both_reject("&run steps! c\n = 5 /\n");
  expect_both_reject("&train lr = 1.5e /\n");
  expect_both_reject("&train lr = 1.5- /\n");
  expect_both_reject("&train lr = 1.5-3.0 /\n");
  expect_both_reject("&run steps = 15-3 /\n");
  expect_both_reject("&run trace = 1 /\n");
  expect_both_reject("&run name = 'a'x /\n");
  expect_both_reject("&run steps = 5 &en\n");
  expect_both_reject("&run ,,, steps = 5 /\n");
}

TEST_F(DeckFortran, CommentRightAfterEquals) {
  // gfortran takes a comment right after '=' (or ',') for the end of the key's values: alone,
  // a null (the default stays); with a value on the next line, a refusal ("End of file" when
  // '/' follows on its own line, "Cannot match namelist object name" before another key),
  // which ptrain reports where the comment is, on the line of the '=', not at the value.
  expect_same("&run steps = ! c\n/\n");
  expect_same("&run steps = ! c\n name = 'x' /\n");
  expect_both_reject("&run steps = ! c\n 5\n/\n", "deck.nml:1:14:");
  expect_both_reject("&run steps = ! c\n\n 5\n name = 'x' /\n", "deck.nml:1:14:");
  expect_both_reject("&parallel\n order = 'p', ! c\n 'd'\n/\n", "deck.nml:2:15:");
}

TEST_F(DeckFortran, ExampleDecks) {
  // Every deck shipped in input/ reads the same in gfortran.
  std::string dir = PTRAIN_SOURCE_DIR "/input";
  std::FILE* ls = popen(("ls " + dir + "/*.nml 2>/dev/null").c_str(), "r");
  ASSERT_TRUE(ls);
  char line[4096];
  while (std::fgets(line, sizeof line, ls)) {
    std::string path = line;
    while (!path.empty() && path.back() == '\n') path.pop_back();
    std::ifstream f(path, std::ios::binary);
    std::stringstream text;
    text << f.rdbuf();
    SCOPED_TRACE(path);
    expect_same(text.str());
  }
  pclose(ls);
}

TEST_F(DeckFortran, OracleSeesTheDeck) {
  // The oracle itself reads values (so agreement above is not two defaults agreeing).
  auto out = oracle(
      "&model n_layer = 7 /\n&train lr = 1.0d-3 /\n&parallel order(3) = 'p' /\n&run name='it''s' "
      "/\n");
  EXPECT_EQ(out["model%n_layer"], "7");
  double lr = 1.0e-3;
  std::int64_t bits;
  std::memcpy(&bits, &lr, sizeof bits);
  EXPECT_EQ(out["train%lr"], std::to_string(bits));
  EXPECT_EQ(out["parallel%order(3)"], "[p]");
  EXPECT_EQ(out["run%name"], "[it's]");
  EXPECT_EQ(out["model%d_model"], "128");
  EXPECT_EQ(out.size(), our_values(deck::defaults()).size());
}
