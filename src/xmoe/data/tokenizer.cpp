#include "xmoe/data/tokenizer.h"

#include "xmoe/core/error.h"

namespace xmoe::data {

std::vector<uint16_t> ByteTokenizer::encode(std::string_view text) {
  std::vector<uint16_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

namespace {

template <typename T>
std::string decode_impl(std::span<const T> tokens) {
  std::string out(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t t = tokens[i];
    XMOE_CHECK(t >= 0 && t < ByteTokenizer::kVocabSize,
               "[tokenizer] token {} at position {} is outside the byte vocabulary ({})", t, i,
               ByteTokenizer::kVocabSize);
    out[i] = static_cast<char>(static_cast<unsigned char>(t));
  }
  return out;
}

}  // namespace

std::string ByteTokenizer::decode(std::span<const uint16_t> tokens) {
  return decode_impl(tokens);
}
std::string ByteTokenizer::decode(std::span<const int32_t> tokens) {
  return decode_impl(tokens);
}

}  // namespace xmoe::data
