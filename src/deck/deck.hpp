// deck/deck.hpp — the input deck: read a Fortran-namelist file, apply --set overrides,
// validate across fields, echo the resolved deck. Everything is generated from
// deck/schema.def. Every error is one line thrown as Error(message, kExitInput).
#pragma once
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

#include "deck/config.hpp"
#include "util/precision.hpp"

namespace ptrain::deck {

// Rank 0 reads `path`, applies `overrides` ("group%key=value"), validates for
// `world_size` ranks and broadcasts the echoed deck, which every rank parses: all ranks
// return the identical Config (its deck_keys counts the file's keys, not the echo's). On an
// error every rank throws the same Error (exit code 2).
// With `machine_file` (ptrain --machine FILE) its &machine group replaces the deck's first
// (read_machine).
Config load(MPI_Comm comm, const std::string& path, const std::vector<std::string>& overrides,
            int world_size, const std::string& machine_file = "");

// The &machine group of file `path` (ptrain --calibrate writes one) into config.machine, every
// key the file leaves out at its default. Errors (exit 2) name the file: unreadable, no &machine
// group, or any namelist error in it.
void read_machine(Config& config, const std::string& path);

// The warning the driver logs when the deck file assigns no key at all (config.deck_keys == 0,
// e.g. an empty file: the run is every default, 100 steps): "deck FILE sets no keys: every
// value [but the N --set override(s)] is the default (ptrain --help-deck lists them)";
// "" when the deck sets a key or its count is unknown (-1).
std::string no_keys_warning(const Config& config, std::size_t n_overrides);

// Parse deck text (errors name `filename`), then apply overrides. No cross-field validation.
// config.deck_keys = the number of keys the text assigns (the overrides are not counted).
Config parse_text(const std::string& text, const std::string& filename,
                  const std::vector<std::string>& overrides = {});
// parse_text of a file's contents; config.deck_path = path.
Config parse_file(const std::string& path, const std::vector<std::string>& overrides = {});

// Every key at its schema default (deck_path "<defaults>").
Config defaults();

// Cross-field checks for a run on `world_size` ranks; resolves parallel%dp = -1.
void validate(Config& config, int world_size);

// The precision policy of a validated deck (util/precision.hpp): model%dtype is the compute
// type; masters are fp32 for a bf16 model, else the model's; gradients and the wire follow
// parallel%grad_dtype.
PrecisionPolicy precision_policy(const Config& config);

// The resolved deck in namelist syntax, every group and key in schema order; keys equal
// to their default carry "! default". parse_text(echo(c), ...) gives back c exactly.
std::string echo(const Config& config);

// One group of the resolved deck, as echo writes it ("\n&machine\n ... /\n").
std::string echo_group(const Config& config, const std::string& group);

// Markdown reference of every group and key (for the README and `ptrain --help-deck`).
std::string help_deck();

// --- introspection (tests, tools) -------------------------------------------------
enum class KeyType { Int, Real, Bool, Str };
using Value = std::variant<std::int64_t, double, bool, std::string>;  // index = KeyType

struct Bound {
  bool limited = false;
  bool integral = false;  // written as an integer literal in schema.def
  bool below = false;     // an upper bound written PTRAIN_BELOW(x): values stay under x
  std::int64_t as_int = 0;
  double as_real = 0;
};

struct KeySpec {
  std::string group, key;  // lower case
  KeyType type = KeyType::Int;
  int extent = 0;                    // 0: scalar, n: array of exactly n
  std::string default_text;          // deck syntax, as written in schema.def
  Bound lo, hi;                      // inclusive (hi unless hi.below), INT and REAL only
  std::vector<std::string> choices;  // allowed STR values; empty: any
  std::string doc;
  std::function<Value(const Config&, int element)> get;  // element 0-based (0 for scalars)
  std::function<void(Config&, int element, const Value&)> set;

  int size() const { return extent == 0 ? 1 : extent; }
  std::string name() const { return group + "%" + key; }
};

struct GroupSpec {
  std::string name, doc;
  std::vector<int> keys;  // indices into key_specs(), schema order
};

const std::vector<KeySpec>& key_specs();
const std::vector<GroupSpec>& group_specs();

// One value in deck syntax ("3", "0.0003", ".true.", "'it''s'"); reals round-trip exactly.
std::string format_value(const Value& value);
// All of a key's values in deck syntax, comma separated.
std::string value_text(const Config& config, const KeySpec& spec);
// Every schema key equal (reals bit for bit); deck_path is not compared.
bool same_values(const Config& a, const Config& b);

}  // namespace ptrain::deck
