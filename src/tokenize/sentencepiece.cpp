// tokenize/sentencepiece.cpp — a SentencePiece model through libsentencepiece.
#include <sentencepiece_processor.h>

#include "tokenize/tokenizer.hpp"
#include "util/error.hpp"

namespace ptrain::tokenize {

namespace {

class SentencePiece final : public Tokenizer {
 public:
  explicit SentencePiece(const std::string& path) : path_(path) {
    const auto status = sp_.Load(path);
    if (!status.ok())
      throw Error(cat("'", path, "': not a SentencePiece model (", status.ToString(), ")"),
                  kExitInput);
  }

  void encode(std::string_view text, std::vector<std::int32_t>& out) override {
    ids_.clear();
    const auto status = sp_.Encode(text, &ids_);
    if (!status.ok()) throw Error(cat("SentencePiece: ", status.ToString()), kExitInput);
    out.insert(out.end(), ids_.begin(), ids_.end());
  }
  std::int64_t vocab() const override { return sp_.GetPieceSize(); }
  std::int32_t eod() const override { return sp_.eos_id(); }
  std::string describe() const override {
    return cat("SentencePiece '", path_, "', vocab ", vocab());
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
  std::vector<int> ids_;
};

}  // namespace

std::unique_ptr<Tokenizer> sentencepiece(const std::string& model) {
  return std::make_unique<SentencePiece>(model);
}

}  // namespace ptrain::tokenize
