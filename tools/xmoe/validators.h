#pragma once
// CLI11 validators shared by the commands of tools/xmoe.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <limits>
#include <string>

namespace xmoe::cli {

/// A whole number in [lo, hi], checked with a message in plain words (CLI11's own range check
/// prints the double limits of the type).
inline CLI::Validator whole_number(long long lo, long long hi) {
  const std::string desc = hi == std::numeric_limits<long long>::max()
                               ? fmt::format("INT >= {}", lo)
                               : fmt::format("INT in [{}, {}]", lo, hi);
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        long long v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec != std::errc() || end != s.data() + s.size())
          return fmt::format("'{}' is not a whole number", s);
        if (v < lo) return fmt::format("{} is below the smallest allowed value, {}", v, lo);
        if (v > hi) return fmt::format("{} is above the largest allowed value, {}", v, hi);
        return "";
      },
      desc);
}
inline CLI::Validator at_least(long long lo) {
  return whole_number(lo, std::numeric_limits<long long>::max());
}

}  // namespace xmoe::cli
