#pragma once
// A read-only, memory-mapped flat token file (train.bin / val.bin: little-endian uint16 or
// uint32, nanoGPT convention), validated once on open.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace xmoe::data {

enum class TokenDType : uint8_t { u16, u32 };

/// "uint16" / "uint32" <-> TokenDType (the names meta.json uses).
std::string token_dtype_name(TokenDType t);
TokenDType parse_token_dtype(const std::string& name);

class TokenFile {
 public:
  struct Options {
    std::optional<TokenDType> dtype;    ///< default: meta.json next to the file, else uint16
    std::optional<int64_t> vocab_size;  ///< default: meta.json's vocab_size, else no check
    int64_t min_tokens = 1;             ///< e.g. seq_len + 1 for training windows
    bool verify_checksum = true;        ///< compare with meta.json's crc32c when it lists one
  };

  TokenFile() = default;
  /// Maps `path` and validates it: size a whole number of tokens, every token < vocab_size
  /// (the error names the offset and the value), at least min_tokens tokens, and the CRC-32C
  /// recorded in meta.json (if any).
  static TokenFile open(const std::string& path, const Options& options);
  static TokenFile open(const std::string& path) { return open(path, Options{}); }

  int64_t size() const { return size_; }  ///< tokens
  TokenDType dtype() const { return dtype_; }
  int64_t vocab_size() const { return vocab_size_; }  ///< -1 if unknown
  const std::string& path() const { return path_; }
  uint32_t operator[](int64_t i) const;
  /// Copies tokens [begin, begin + n) into out as int32.
  void read(int64_t begin, int64_t n, int32_t* out) const;

 private:
  struct Mapping;
  std::shared_ptr<const Mapping> map_;
  const unsigned char* data_ = nullptr;
  int64_t size_ = 0;
  int64_t vocab_size_ = -1;
  TokenDType dtype_ = TokenDType::u16;
  std::string path_;
};

}  // namespace xmoe::data
