#pragma once
// Small file helpers shared by data preparation, safetensors and checkpoints: CRC32C checksums,
// whole-file reads, fsync, and write-to-temp-then-rename so a crash never leaves a half file
// under the final name.
#include <cstddef>
#include <cstdint>
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
/// Writes `path.tmp-<pid>`, fsyncs it, renames it to `path` and fsyncs the folder.
void write_file_atomic(const std::string& path, std::string_view contents);
/// fsync of a file or a folder (a folder's fsync makes renames inside it durable).
void fsync_path(const std::string& path);

}  // namespace xmoe::io
