#pragma once
// Small helpers shared by the unit tests.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "xmoe/core/error.h"

namespace xmoe::testing {

/// The message of the xmoe::Error that `f` throws (fails the test if it throws nothing).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an xmoe::Error";
  return "";
}

/// A fresh folder per test (named after the test and the process), removed afterwards.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "xmoe_test") {
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("{}_{}_{}", tag,
                        ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                        static_cast<long>(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

/// Writes `count` short English proverbs to `file`, proverb (i * stride) % 4 at position i: a
/// corpus the training tests prepare and learn in seconds.
inline void write_proverbs(const std::filesystem::path& file, int count, int stride = 1) {
  static const char* const lines[] = {
      "the quick brown fox jumps over the lazy dog. ", "a stitch in time saves nine. ",
      "all that glitters is not gold. ", "the early bird catches the worm. "};
  std::ofstream text(file);
  for (int i = 0; i < count; ++i) text << lines[(i * stride) % 4];
}

}  // namespace xmoe::testing

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)
