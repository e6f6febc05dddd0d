#pragma once
// What every fuzz target shares: a private scratch folder for parsers that take a path, and the
// rule that a bad input may only end in an xmoe::Error (any other exception escapes, and
// libFuzzer reports it as a crash with the input that caused it).
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "xmoe/core/error.h"

namespace xmoe::fuzz {

inline void quiet_logs() {
  spdlog::set_level(spdlog::level::off);
}

/// This process's scratch folder, removed at exit.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    std::string tmpl = (std::filesystem::temp_directory_path() / "xmoe-fuzz-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    std::atexit([] { std::filesystem::remove_all(scratch_dir()); });
    return std::filesystem::path(tmpl);
  }();
  return dir;
}

inline void write_bytes(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) std::abort();
}

template <typename Parse>
void expect_clean_error(Parse&& parse) {
  try {
    parse();
  } catch (const xmoe::Error&) {
  }
}

}  // namespace xmoe::fuzz
