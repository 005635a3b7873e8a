// deck/detail.hpp — internals shared by the deck's .cpp files (not for other modules).
#pragma once
#include <string>

#include "deck/deck.hpp"

namespace ptrain::deck::detail {

// "group%key", or "group%key(i)" (1-based) for an array element.
std::string element_name(const KeySpec& spec, int element);

// Why one element's value breaks its key's range or choices ("parallel%zero = 5 is out
// of range: must be in [0, 3]"), or "" when it is allowed.
std::string value_error(const KeySpec& spec, int element, const Value& value);

// `text` with control characters written as \xNN, so a message never carries raw bytes
// from a deck to the terminal (and stays on one line).
std::string printable(const std::string& text);

// `text` cut to a length that fits in a one-line message.
std::string excerpt(const std::string& text);

}  // namespace ptrain::deck::detail
