#include "xmoe/io/file.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "xmoe/core/error.h"

namespace xmoe::io {

namespace {

// Slicing-by-8 tables for the reflected Castagnoli polynomial 0x82F63B78.
struct Crc32cTables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Crc32cTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};

const Crc32cTables& tables() {
  static const Crc32cTables tables;
  return tables;
}

std::string errno_str() {
  return std::strerror(errno);
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto& t = tables().t;
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  while (size >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);  // little-endian hosts only (x86-64, aarch64)
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
          t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    size -= 8;
  }
  while (size--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
  return ~crc;
}

uint32_t file_crc32c(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  XMOE_CHECK(in, "[io] {}: cannot open for reading ({})", path, errno_str());
  std::vector<char> buf(1 << 20);
  uint32_t crc = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    crc = crc32c(buf.data(), static_cast<size_t>(in.gcount()), crc);
  }
  XMOE_CHECK(in.eof(), "[io] {}: read error", path);
  return crc;
}

std::string crc32c_hex(uint32_t crc) {
  return fmt::format("{:08x}", crc);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  XMOE_CHECK(in, "[io] {}: cannot open for reading ({})", path, errno_str());
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  XMOE_CHECK(!in.bad(), "[io] {}: read error", path);
  return s;
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  XMOE_CHECK(fd >= 0, "[io] {}: cannot open for fsync ({})", path, errno_str());
  const int rc = ::fsync(fd);
  const int err = rc != 0 ? errno : 0;
  ::close(fd);
  // Some filesystems refuse fsync on folders (EINVAL); that is not a data error.
  XMOE_CHECK(rc == 0 || err == EINVAL, "[io] {}: fsync failed ({})", path, std::strerror(err));
}

void write_file_atomic(const std::string& path, std::string_view contents) {
  namespace fs = std::filesystem;
  const std::string tmp = fmt::format("{}.tmp-{}", path, ::getpid());
  {
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    XMOE_CHECK(f, "[io] {}: cannot open for writing ({})", tmp, errno_str());
    const size_t n = std::fwrite(contents.data(), 1, contents.size(), f);
    const bool ok = n == contents.size() && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
    std::fclose(f);
    if (!ok) {
      std::error_code ec;
      fs::remove(tmp, ec);
      XMOE_FAIL("[io] {}: write failed ({})", tmp, errno_str());
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  XMOE_CHECK(!ec, "[io] rename {} -> {} failed: {}", tmp, path, ec.message());
  const fs::path parent = fs::path(path).parent_path();
  fsync_path(parent.empty() ? "." : parent.string());
}

}  // namespace xmoe::io
