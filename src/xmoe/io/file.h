#pragma once
// Small file helpers shared by data preparation, safetensors, checkpoints and the trainer's logs:
// CRC32C checksums, whole-file reads, fsync, write-to-temp-then-rename so a crash never leaves a
// half file under the final name, and writers that check every call. Every failed write throws
// "[io] <file>: <what> failed (<strerror>)" and leaves no partial file or partial line behind.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace xmoe::io {

/// CRC-32C (Castagnoli), continuing from `crc` (0 to start).
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
/// CRC-32C of a whole file, read in chunks.
uint32_t file_crc32c(const std::string& path);
/// "%08x" form used in manifests and meta.json.
std::string crc32c_hex(uint32_t crc);

/// Reads a whole file; throws "[io] <path>: ..." on failure.
std::string read_file(const std::string& path);
/// Writes `path.tmp-<pid>`, fsyncs it, renames it to `path` and fsyncs the folder. On failure
/// the temporary file is removed, `path` keeps its previous content, and the Error names `path`
/// and the OS reason.
void write_file_atomic(const std::string& path, std::string_view contents);
/// fsync of a file or a folder (a folder's fsync makes renames inside it durable).
void fsync_path(const std::string& path);

/// Bytes available to this user on the filesystem holding `path` (or its nearest existing
/// parent, so it works for a file or folder not yet created); nullopt if the OS cannot say.
std::optional<uint64_t> free_bytes(const std::string& path);
/// Test hook: while set, free_bytes returns `bytes` for every path (nullopt restores the real
/// answer). Lets tests reach "disk full" checks without filling a disk.
void set_free_bytes_for_testing(std::optional<uint64_t> bytes);
/// "512 B", "1.5 kB", "12.3 MB", "4.0 GB" (decimal units), for messages.
std::string format_bytes(uint64_t bytes);

/// The path of xmoe's Python helper `name` (e.g. "xmoe_plot.py"): next to the running executable
/// (the build copies it there), else in the source tree's tools/xmoe/ (binaries outside bin/,
/// such as tests). Throws "[<tag>] the <description> helper <name> is missing (looked in ...)".
std::string find_helper_script(const char* name, const char* tag, const char* description);

/// A file being written from scratch (created or truncated). Every call checks the OS's answer
/// and throws "[io] <name>: write failed (<strerror>)". Unless close() succeeded, the destructor
/// (reached by an exception too) removes the file: a failed write leaves nothing under `path`.
class OutputFile {
 public:
  /// Opens `path` for writing; `name` is the file errors name (defaults to `path`; a temporary
  /// file's writer names the final file).
  explicit OutputFile(std::string path, std::string name = {});
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  void write(const void* data, size_t size);
  void write(std::string_view s) { write(s.data(), s.size()); }
  /// fsyncs (if `sync`) and closes, checking both: ENOSPC and quota errors on NFS may surface
  /// only here. On failure the file is removed and an Error thrown.
  void close(bool sync = true);
  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void fail(const char* what, int err);

  std::string path_, name_;
  int fd_ = -1;
};

/// An append-only log (JSON lines): each write_line hands one whole line to the OS, so what is
/// on disk survives a crash of this process. A write that fails (disk full, quota, file size
/// limit) truncates the file back to its size before that line and throws: the file never ends
/// in a partial line.
class AppendFile {
 public:
  /// Opens `path` for appending, creating the file (not its folder); throws if it cannot.
  explicit AppendFile(const std::string& path);
  ~AppendFile();  ///< closes; an error there is ignored (call close() to see it)
  AppendFile(AppendFile&& other) noexcept;
  AppendFile& operator=(AppendFile&& other) noexcept;
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;

  /// Appends `line` and '\n' (the line should not contain '\n').
  void write_line(std::string_view line);
  /// fsync: the lines written so far survive a crash of the machine, not only of the process.
  void sync();
  /// Closes the file, checking for errors; later calls other than size() and path() throw.
  void close();
  /// Bytes in the file (what was there at open plus the lines written since).
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

}  // namespace xmoe::io
