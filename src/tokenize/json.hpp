// tokenize/json.hpp — the JSON ptrain-tokenize reads: GPT-2's encoder.json (an object of
// token strings to ids) and JSON lines (an object per line, the document in a string member).
// A complete reader of RFC 8259 values (objects, arrays, strings with every escape, \u
// surrogate pairs to UTF-8, numbers, literals); a lone surrogate or raw control character in a
// string is an error. Errors throw ptrain::Error naming the byte offset.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ptrain::tokenize::json {

// The string member `key` of the object `text` holds (UTF-8); nullopt when it has none (a
// member of another type is an error).
std::optional<std::string> string_member(std::string_view text, std::string_view key);

// An object whose members are all integers, in file order.
std::vector<std::pair<std::string, std::int64_t>> integer_object(std::string_view text);

}  // namespace ptrain::tokenize::json
