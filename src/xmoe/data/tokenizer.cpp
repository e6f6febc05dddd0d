#include "xmoe/data/tokenizer.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "xmoe/core/error.h"

namespace xmoe::data {

std::vector<std::vector<uint32_t>> Tokenizer::encode_batch(
    const std::vector<std::string>& texts) const {
  std::vector<std::vector<uint32_t>> out;
  out.reserve(texts.size());
  for (const std::string& t : texts) out.push_back(encode(t));
  return out;
}

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> out(text.size());
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
               "[tokenizer] token {} at position {} is outside the vocabulary ({})", t, i,
               ByteTokenizer::kVocabSize);
    out[i] = static_cast<char>(static_cast<unsigned char>(t));
  }
  return out;
}

/// GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, the other 68
/// bytes for U+0100.. in byte order, so every byte is one visible character.
std::vector<uint32_t> byte_characters() {
  std::vector<uint32_t> chars(256, 0);
  const auto printable = [](int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  };
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) chars[b] = printable(b) ? static_cast<uint32_t>(b) : next++;
  return chars;
}

std::string utf8(uint32_t c) {
  std::string s;
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xC0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  }
  return s;
}

}  // namespace

std::string ByteTokenizer::hf_tokenizer_json() {
  using nlohmann::json;
  const std::vector<uint32_t> chars = byte_characters();
  json vocab = json::object();
  for (int b = 0; b < kVocabSize; ++b) vocab[utf8(chars[b])] = b;
  // No regex split and no prefix space: the text's bytes map one to one onto tokens.
  const json byte_level = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", false},
                           {"use_regex", false}};
  const json doc = {{"version", "1.0"},
                    {"truncation", nullptr},
                    {"padding", nullptr},
                    {"added_tokens", json::array()},
                    {"normalizer", nullptr},
                    {"pre_tokenizer", byte_level},
                    {"post_processor", nullptr},
                    {"decoder", byte_level},
                    {"model",
                     {{"type", "BPE"},
                      {"dropout", nullptr},
                      {"unk_token", nullptr},
                      {"continuing_subword_prefix", nullptr},
                      {"end_of_word_suffix", nullptr},
                      {"fuse_unk", false},
                      {"byte_fallback", false},
                      {"ignore_merges", false},
                      {"vocab", vocab},
                      {"merges", json::array()}}}};
  return doc.dump(2) + "\n";
}

std::string ByteTokenizer::decode(std::span<const uint32_t> ids) const {
  return decode_impl(ids);
}

std::vector<uint16_t> encode(std::string_view text) {
  std::vector<uint16_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}
std::string decode(std::span<const uint16_t> tokens) {
  return decode_impl(tokens);
}
std::string decode(std::span<const int32_t> tokens) {
  return decode_impl(tokens);
}

std::string tokenizer_kind(const std::string& path) {
  if (path.empty() || path == "byte") return "byte";
  const std::string ext = std::filesystem::path(path).extension().string();
  if (ext == ".model") return "sentencepiece";
  if (ext == ".json") return "hf";
  XMOE_FAIL(
      "[tokenizer] {}: unknown tokenizer kind (expected a SentencePiece .model file, a Hugging "
      "Face tokenizer.json, or \"byte\")",
      path);
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  const std::string kind = tokenizer_kind(path);
  if (kind == "byte") return std::make_unique<ByteTokenizer>();
  XMOE_CHECK(std::filesystem::is_regular_file(path), "[tokenizer] {}: no such file", path);
  if (kind == "sentencepiece") return load_sentencepiece(path);
  return load_hf_tokenizer(path);
}

}  // namespace xmoe::data
