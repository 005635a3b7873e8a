// regression/fuzz/deck_fuzzer.cpp — libFuzzer target for the deck reader.
// The input is deck text; after a NUL byte, new-line separated --set arguments. Findings:
// any crash or undefined behaviour (ASan, UBSan), and any broken promise of deck/deck.hpp:
// errors are ptrain::Error with exit code 2 and a one-line message without raw control
// bytes, and a deck that reads and validates echoes to text that reads back to it.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "deck/deck.hpp"
#include "util/error.hpp"

namespace {

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "deck_fuzzer: %s\n", what.c_str());
  std::abort();
}

void check_error(const ptrain::Error& e) {
  if (e.exit_code() != ptrain::kExitInput)
    finding(ptrain::cat("exit code ", e.exit_code(), ": ", e.what()));
  for (char c : std::string(e.what()))
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      finding(ptrain::cat("raw control byte in: ", e.what()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string input(reinterpret_cast<const char*>(data), size);
  std::size_t nul = input.find('\0');
  std::string text = input.substr(0, nul);
  std::vector<std::string> overrides;
  if (nul != std::string::npos) {
    std::string rest = input.substr(nul + 1);
    for (std::size_t begin = 0; begin <= rest.size();) {
      std::size_t end = rest.find('\n', begin);
      if (end == std::string::npos) end = rest.size();
      overrides.push_back(rest.substr(begin, end - begin));
      begin = end + 1;
    }
  }
  ptrain::Config config;
  try {
    config = ptrain::deck::parse_text(text, "fuzz.nml", overrides);
    ptrain::deck::validate(config, 1 + static_cast<int>(size % 8));
  } catch (const ptrain::Error& e) {
    check_error(e);
    return 0;
  }
  // What was read survives the echo (out_dir/deck.nml, and how load() sends it to every rank).
  const std::string echoed = ptrain::deck::echo(config);
  try {
    ptrain::Config back = ptrain::deck::parse_text(echoed, config.deck_path);
    if (!ptrain::deck::same_values(config, back))
      finding("the echo reads back to other values:\n" + echoed);
    if (ptrain::deck::echo(back) != echoed) finding("the echo of the echo differs:\n" + echoed);
  } catch (const ptrain::Error& e) {
    finding(ptrain::cat("the echo does not read back (", e.what(), "):\n", echoed));
  }
  return 0;
}
