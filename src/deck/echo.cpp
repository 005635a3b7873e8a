// deck/echo.cpp — the resolved deck as namelist text, and the deck reference in Markdown,
// both generated from the schema table.
#include <algorithm>
#include <string>
#include <vector>

#include "deck/deck.hpp"
#include "util/error.hpp"

namespace ptrain::deck {
namespace {

bool at_default(const Config& config, const KeySpec& spec) {
  static const Config d = defaults();
  for (int i = 0; i < spec.size(); ++i) {
    Value a = spec.get(config, i), b = spec.get(d, i);
    if (format_value(a) != format_value(b)) return false;  // exact: reals print round-trip
  }
  return true;
}

const char* type_name(KeyType t) {
  switch (t) {
    case KeyType::Int:
      return "integer";
    case KeyType::Real:
      return "real";
    case KeyType::Bool:
      return "logical";
    case KeyType::Str:
      return "string";
  }
  return "";
}

std::string show_bound(const KeySpec& spec, const Bound& b) {
  return spec.type == KeyType::Int ? std::to_string(b.as_int) : format_value(b.as_real);
}

std::string allowed(const KeySpec& spec) {
  if (!spec.choices.empty()) {
    std::string out;
    for (std::size_t i = 0; i < spec.choices.size(); ++i)
      out += (i ? ", " : "") + std::string("`") + format_value(spec.choices[i]) + "`";
    return out;
  }
  if (spec.type == KeyType::Bool) return "`.true.`, `.false.`";
  if (spec.lo.limited && spec.hi.limited)
    return cat(show_bound(spec, spec.lo), spec.hi.below ? " to below " : " to ",
               show_bound(spec, spec.hi));
  if (spec.lo.limited) return cat(">= ", show_bound(spec, spec.lo));
  if (spec.hi.limited) return cat(spec.hi.below ? "< " : "<= ", show_bound(spec, spec.hi));
  return "any";
}

// Markdown table cells may not hold a bare '|'.
std::string cell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

namespace {
// The groups of `only` (every group when empty) in namelist syntax.
std::string echo_groups(const Config& config, const std::string& only) {
  std::string out;
  const auto& specs = key_specs();
  for (const GroupSpec& g : group_specs()) {
    if (!only.empty() && g.name != only) continue;
    std::size_t width = 0;
    for (int k : g.keys) width = std::max(width, specs[static_cast<std::size_t>(k)].key.size());
    std::vector<std::string> lines;
    std::size_t line_width = 0;
    for (int k : g.keys) {
      const KeySpec& s = specs[static_cast<std::size_t>(k)];
      lines.push_back("    " + s.key + std::string(width - s.key.size(), ' ') + " = " +
                      value_text(config, s));
      line_width = std::max(line_width, lines.back().size());
    }
    out += "\n&" + g.name + "\n";
    for (std::size_t i = 0; i < lines.size(); ++i) {
      std::string line = lines[i];
      if (at_default(config, specs[static_cast<std::size_t>(g.keys[i])]))
        line += std::string(line_width - line.size(), ' ') + "  ! default";
      out += line + "\n";
    }
    out += "/\n";
  }
  return out;
}
}  // namespace

std::string echo(const Config& config) {
  std::string out = "! ptrain deck, resolved";
  if (!config.deck_path.empty()) {
    std::string path = config.deck_path;
    std::replace(path.begin(), path.end(), '\n', ' ');  // the comment must stay one line
    out += " (read from " + path + ")";
  }
  out += ". \"! default\" marks keys at their default.\n";
  return out + echo_groups(config, "");
}

std::string echo_group(const Config& config, const std::string& group) {
  return echo_groups(config, group);
}

std::string help_deck() {
  std::string out =
      "# ptrain deck reference\n\n"
      "A deck is a Fortran namelist file, read as gfortran's NAMELIST read reads it: groups\n"
      "`&name ... /` (or `$name ... $end`), items `key = value` separated by commas or new lines,\n"
      "`!` comments, strings in quotes (a string may go on over a line end, which is dropped),\n"
      "logicals `.true.`/`.false.`, reals `3e-4`, `1.0d-3` or `1.5-3`, arrays `key = 1, 2`,\n"
      "elements and sections `key(2) = 5`, `key(2:3) = 5, 6`, repeat counts `3*0`, null values\n"
      "`key = , 2`. Where gfortran would quietly skip a value it cannot read, ptrain stops with\n"
      "an error; it also refuses unknown groups, a key or group given twice, unquoted strings,\n"
      "reals that are not finite, and control characters or more than 4096 characters in a\n"
      "string. Every key is optional. Command-line `--set group%key=value` overrides the file.\n"
      "The run writes the resolved deck to `out_dir/deck.nml`.\n";
  const auto& specs = key_specs();
  for (const GroupSpec& g : group_specs()) {
    out += "\n## &" + g.name + "\n\n" + cell(g.doc) + "\n\n";
    out += "| key | type | default | allowed | description |\n|---|---|---|---|---|\n";
    for (int k : g.keys) {
      const KeySpec& s = specs[static_cast<std::size_t>(k)];
      std::string type = type_name(s.type);
      if (s.extent > 0) type += cat("(", s.extent, ")");
      out += cat("| `", s.key, "` | ", type, " | `", cell(s.default_text), "` | ", cell(allowed(s)),
                 " | ", cell(s.doc), " |\n");
    }
  }
  return out;
}

}  // namespace ptrain::deck
