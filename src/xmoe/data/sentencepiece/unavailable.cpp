// A build without libsentencepiece (XMOE_SENTENCEPIECE off): SentencePiece models are refused
// with the way to get them.
#include "xmoe/core/error.h"
#include "xmoe/data/tokenizer.h"

namespace xmoe::data {

namespace {
constexpr const char* kMissing =
    "xmoe was built without SentencePiece: install libsentencepiece-dev (bash "
    "scripts/install-deps.sh) and configure the build again";
}

bool sentencepiece_available() {
  return false;
}

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path) {
  XMOE_FAIL("[tokenizer] {}: {}", path, kMissing);
}

void train_sentencepiece(const SentencePieceTrainOptions& options) {
  XMOE_FAIL("[tokenizer train] {}: {}", options.out, kMissing);
}

}  // namespace xmoe::data
