#pragma once
// Byte-level tokenizer: token = byte value, vocabulary 256. Lossless for any input.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace xmoe::data {

class ByteTokenizer {
 public:
  static constexpr int kVocabSize = 256;
  static int vocab_size() { return kVocabSize; }
  static std::vector<uint16_t> encode(std::string_view text);
  /// Throws "[tokenizer] token 300 at position 4 is outside the byte vocabulary (256)".
  static std::string decode(std::span<const uint16_t> tokens);
  static std::string decode(std::span<const int32_t> tokens);
  /// The same tokenizer for Hugging Face's fast tokenizer (tokenizer.json): a BPE without
  /// merges over GPT-2's byte-to-character alphabet, token = byte value, so its encode and
  /// decode give exactly xmoe's ids and bytes.
  static std::string hf_tokenizer_json();
};

inline std::vector<uint16_t> encode(std::string_view text) {
  return ByteTokenizer::encode(text);
}
inline std::string decode(std::span<const uint16_t> t) {
  return ByteTokenizer::decode(t);
}
inline std::string decode(std::span<const int32_t> t) {
  return ByteTokenizer::decode(t);
}

}  // namespace xmoe::data
