#include "xmoe/data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "xmoe/core/error.h"
#include "xmoe/io/file.h"

namespace xmoe::data {

namespace fs = std::filesystem;

std::string token_dtype_name(TokenDType t) {
  return t == TokenDType::u16 ? "uint16" : "uint32";
}

TokenDType parse_token_dtype(const std::string& name) {
  if (name == "uint16") return TokenDType::u16;
  if (name == "uint32") return TokenDType::u32;
  XMOE_FAIL("[data] unknown token dtype '{}' (expected uint16 or uint32)", name);
}

struct TokenFile::Mapping {
  void* addr = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (addr) ::munmap(addr, bytes);
  }
};

namespace {

// meta.json's string `key` of `object` (named `where` in errors), or nullopt when absent.
std::optional<std::string> meta_string(const nlohmann::json& object, const char* key,
                                       const std::string& where, const fs::path& meta_path) {
  if (!object.contains(key)) return std::nullopt;
  XMOE_CHECK(object[key].is_string(), "[data] {}: {} = {} is not a string", meta_path.string(),
             where, object[key].dump());
  return object[key].get<std::string>();
}

// The meta.json entry ("train" / "val") describing `path`, if meta.json lists it.
nlohmann::json meta_entry(const nlohmann::json& meta, const std::string& filename,
                          const fs::path& meta_path) {
  for (const std::string split : {"train", "val"})
    if (meta.contains(split) && meta[split].is_object() &&
        meta_string(meta[split], "file", split + ".file", meta_path) == filename)
      return meta[split];
  return nullptr;
}

// meta.json's vocab_size: an integer that fits int64, or -1 (no check) when absent.
int64_t meta_vocab_size(const nlohmann::json& meta, const fs::path& meta_path) {
  if (!meta.contains("vocab_size")) return -1;
  const nlohmann::json& v = meta["vocab_size"];
  XMOE_CHECK(v.is_number_integer() &&
                 (!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t{INT64_MAX}),
             "[data] {}: vocab_size = {} is not an integer token count", meta_path.string(),
             v.dump());
  return v.get<int64_t>();
}

}  // namespace

TokenFile TokenFile::open(const std::string& path, const Options& options) {
  const std::string name = fs::path(path).filename().string();
  nlohmann::json meta;
  const fs::path meta_path = fs::path(path).parent_path() / "meta.json";
  if (fs::is_regular_file(meta_path)) {
    try {
      meta = nlohmann::json::parse(io::read_file(meta_path.string()));
    } catch (const nlohmann::json::exception& e) {
      XMOE_FAIL("[data] {}: invalid JSON ({})", meta_path.string(), e.what());
    }
  }

  if (!meta.is_object()) meta = nlohmann::json::object();

  TokenFile f;
  f.path_ = path;
  const std::optional<std::string> meta_dtype = meta_string(meta, "dtype", "dtype", meta_path);
  XMOE_CHECK(!meta_dtype || *meta_dtype == token_dtype_name(TokenDType::u16) ||
                 *meta_dtype == token_dtype_name(TokenDType::u32),
             "[data] {}: dtype = '{}' is not uint16 or uint32", meta_path.string(), *meta_dtype);
  f.dtype_ = options.dtype ? *options.dtype
             : meta_dtype  ? parse_token_dtype(*meta_dtype)
                           : TokenDType::u16;
  f.vocab_size_ = options.vocab_size ? *options.vocab_size : meta_vocab_size(meta, meta_path);
  const size_t elem = f.dtype_ == TokenDType::u16 ? 2 : 4;

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  XMOE_CHECK(fd >= 0, "[data] {}: cannot open ({})", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    XMOE_FAIL("[data] {}: cannot stat ({})", path, std::strerror(errno));
  }
  const auto bytes = static_cast<size_t>(st.st_size);
  if (bytes % elem != 0) {
    ::close(fd);
    XMOE_FAIL("[data] {}: {} bytes is not a whole number of {} tokens (truncated file?)", name,
              bytes, token_dtype_name(f.dtype_));
  }
  auto mapping = std::make_shared<Mapping>();
  if (bytes > 0) {
    void* addr = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    XMOE_CHECK(addr != MAP_FAILED, "[data] {}: mmap failed ({})", path, std::strerror(err));
    mapping->addr = addr;
    mapping->bytes = bytes;
  } else {
    ::close(fd);
  }
  f.map_ = mapping;
  f.data_ = static_cast<const unsigned char*>(mapping->addr);
  f.size_ = static_cast<int64_t>(bytes / elem);

  XMOE_CHECK(f.size_ >= options.min_tokens,
             "[data] {}: {} tokens, need at least {} (seq_len + 1); prepare a larger corpus or "
             "lower train.seq_len",
             path, f.size_, options.min_tokens);
  const nlohmann::json entry = meta_entry(meta, name, meta_path);
  const std::optional<std::string> want_crc =
      entry.is_object() ? meta_string(entry, "crc32c", "crc32c of " + name, meta_path)
                        : std::nullopt;
  if (options.verify_checksum && want_crc) {
    const std::string have = io::crc32c_hex(io::crc32c(f.data_, bytes));
    XMOE_CHECK(have == *want_crc,
               "[data] {}: checksum {} differs from meta.json's {} (file changed or corrupt; "
               "run prepare again)",
               path, have, *want_crc);
  }
  if (f.vocab_size_ > 0) {
    for (int64_t i = 0; i < f.size_; ++i) {
      const uint32_t t = f[i];
      XMOE_CHECK(static_cast<int64_t>(t) < f.vocab_size_,
                 "[data] {}: token {} at offset {} is >= vocab_size {}", path, t, i, f.vocab_size_);
    }
  }
  return f;
}

uint32_t TokenFile::operator[](int64_t i) const {
  if (dtype_ == TokenDType::u16) {
    uint16_t v;
    std::memcpy(&v, data_ + 2 * i, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, data_ + 4 * i, 4);
  return v;
}

void TokenFile::read(int64_t begin, int64_t n, int32_t* out) const {
  XMOE_CHECK(begin >= 0 && n >= 0 && begin + n <= size_,
             "[data] {}: read of tokens [{}, {}) outside the file's {} tokens", path_, begin,
             begin + n, size_);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>((*this)[begin + i]);
}

}  // namespace xmoe::data
