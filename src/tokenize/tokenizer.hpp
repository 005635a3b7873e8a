// tokenize/tokenizer.hpp — text to token ids for ptrain-tokenize:
//   gpt2           GPT-2's byte-level BPE from its encoder.json and vocab.bpe: the text split by
//                  GPT-2's pattern 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
//                  \s+(?!\S)|\s+ (PCRE2, Unicode properties), each piece's UTF-8 bytes mapped to
//                  GPT-2's byte symbols and merged pair by pair, lowest merge rank first, every
//                  occurrence of the pair at once (as openai/gpt-2's encoder.py does). Special
//                  tokens in the text are text.
//   sentencepiece  a SentencePiece model (libsentencepiece), as spm_encode --output_format=id.
// Errors throw ptrain::Error with exit code 2 naming the file.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ptrain::tokenize {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Appends the ids of `text` (UTF-8; an error otherwise) to `out`.
  virtual void encode(std::string_view text, std::vector<std::int32_t>& out) = 0;
  virtual std::int64_t vocab() const = 0;  // ids are below it
  // The end-of-document id: GPT-2's <|endoftext|>, the model's </s>; -1 when it has none.
  virtual std::int32_t eod() const = 0;
  virtual std::string describe() const = 0;  // one line
};

std::unique_ptr<Tokenizer> gpt2_bpe(const std::string& encoder_json, const std::string& merges);
std::unique_ptr<Tokenizer> sentencepiece(const std::string& model);

// The bytes of a file; throws Error (exit code 2) naming it when it cannot be read.
std::string read_file(const std::string& path);

}  // namespace ptrain::tokenize
