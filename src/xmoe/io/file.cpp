#include "xmoe/io/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>
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

// Writes all of `data`, retrying short writes; 0 or the errno of the call that failed. A write
// that fills the disk writes what fits and fails on the next call, which reports why.
int write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, std::min(size, size_t{1} << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return 0;
}

std::atomic<int64_t> free_bytes_override{-1};

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
    OutputFile f(tmp, path);
    f.write(contents);
    f.close();
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    XMOE_FAIL("[io] {}: rename from {} failed ({})", path, tmp, ec.message());
  }
  const fs::path parent = fs::path(path).parent_path();
  fsync_path(parent.empty() ? "." : parent.string());
}

std::optional<uint64_t> free_bytes(const std::string& path) {
  namespace fs = std::filesystem;
  if (const int64_t o = free_bytes_override.load(); o >= 0) return static_cast<uint64_t>(o);
  std::error_code ec;
  fs::path p = fs::absolute(path.empty() ? "." : path, ec);
  if (ec) return std::nullopt;
  while (!fs::exists(p, ec)) {
    if (p == p.parent_path()) return std::nullopt;
    p = p.parent_path();
  }
  const fs::space_info info = fs::space(p, ec);
  if (ec || info.available == static_cast<uintmax_t>(-1)) return std::nullopt;
  return static_cast<uint64_t>(info.available);
}

void set_free_bytes_for_testing(std::optional<uint64_t> bytes) {
  free_bytes_override.store(bytes ? static_cast<int64_t>(*bytes) : -1);
}

std::string format_bytes(uint64_t bytes) {
  if (bytes < 1000) return fmt::format("{} B", bytes);
  static const char* const units[] = {"kB", "MB", "GB", "TB", "PB", "EB"};
  double v = static_cast<double>(bytes) / 1000;
  int u = 0;
  while (v >= 999.95 && u < 5) {
    v /= 1000;
    ++u;
  }
  return fmt::format("{:.1f} {}", v, units[u]);
}

// ---- OutputFile ----

OutputFile::OutputFile(std::string path, std::string name)
    : path_(std::move(path)), name_(name.empty() ? path_ : std::move(name)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  XMOE_CHECK(fd_ >= 0, "[io] {}: cannot open for writing ({})", name_, errno_str());
}

OutputFile::~OutputFile() {
  if (fd_ < 0) return;  // closed, or already removed by fail()
  ::close(fd_);
  ::unlink(path_.c_str());
}

void OutputFile::fail(const char* what, int err) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(path_.c_str());
  XMOE_FAIL("[io] {}: {} failed ({})", name_, what, std::strerror(err));
}

void OutputFile::write(const void* data, size_t size) {
  XMOE_CHECK(fd_ >= 0, "[io] {}: write after close", name_);
  if (const int err = write_all(fd_, data, size)) fail("write", err);
}

void OutputFile::close(bool sync) {
  XMOE_CHECK(fd_ >= 0, "[io] {}: closed twice", name_);
  if (sync && ::fsync(fd_) != 0) fail("fsync", errno);
  const int rc = ::close(fd_);
  const int err = errno;
  fd_ = -1;
  if (rc != 0) {
    ::unlink(path_.c_str());
    XMOE_FAIL("[io] {}: close failed ({})", name_, std::strerror(err));
  }
}

// ---- AppendFile ----

AppendFile::AppendFile(const std::string& path) : path_(path) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
  XMOE_CHECK(fd_ >= 0, "[io] {}: cannot open for appending ({})", path_, errno_str());
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    XMOE_FAIL("[io] {}: fstat failed ({})", path_, std::strerror(err));
  }
  size_ = static_cast<int64_t>(st.st_size);
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) ::close(fd_);
}

AppendFile::AppendFile(AppendFile&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      size_(std::exchange(other.size_, 0)) {}

AppendFile& AppendFile::operator=(AppendFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void AppendFile::write_line(std::string_view line) {
  XMOE_CHECK(fd_ >= 0, "[io] {}: write after close", path_);
  std::string buf;
  buf.reserve(line.size() + 1);
  buf.append(line).push_back('\n');
  const int err = write_all(fd_, buf.data(), buf.size());
  if (err == 0) {
    size_ += static_cast<int64_t>(buf.size());
    return;
  }
  // Part of the line may be on disk; cut it off so the log stays whole lines.
  if (::ftruncate(fd_, size_) != 0)
    XMOE_FAIL("[io] {}: write failed ({}), and removing the partial line failed too ({})", path_,
              std::strerror(err), errno_str());
  XMOE_FAIL("[io] {}: write failed ({})", path_, std::strerror(err));
}

void AppendFile::sync() {
  XMOE_CHECK(fd_ >= 0, "[io] {}: sync after close", path_);
  XMOE_CHECK(::fsync(fd_) == 0, "[io] {}: fsync failed ({})", path_, errno_str());
}

void AppendFile::close() {
  XMOE_CHECK(fd_ >= 0, "[io] {}: closed twice", path_);
  const int rc = ::close(std::exchange(fd_, -1));
  XMOE_CHECK(rc == 0, "[io] {}: close failed ({})", path_, errno_str());
}

std::string find_helper_script(const char* name, const char* tag, const char* description) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  std::vector<fs::path> tried;
  if (!ec) tried.push_back(exe.parent_path() / name);
  tried.push_back(fs::path(XMOE_SOURCE_DIR) / "tools" / "xmoe" / name);
  for (const fs::path& p : tried)
    if (fs::is_regular_file(p)) return p.string();
  XMOE_FAIL("[{}] the {} helper {} is missing (looked in {}); rebuild xmoe", tag, description, name,
            tried.front().parent_path().string());
}

}  // namespace xmoe::io
