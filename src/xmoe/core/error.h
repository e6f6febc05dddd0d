#pragma once
// Errors: every failure is an xmoe::Error whose message names the op or key and the bad value,
// e.g. "[config] moe.top_k = 9 exceeds moe.num_experts = 8". Library code never calls exit().
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace xmoe {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_error(const char* file, int line, const std::string& message);

}  // namespace xmoe

/// XMOE_CHECK(cond, "[op] fmt {}", args...): throws xmoe::Error with the formatted message.
#define XMOE_CHECK(cond, ...)                                              \
  do {                                                                     \
    if (!(cond)) [[unlikely]]                                              \
      ::xmoe::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
  } while (0)

#define XMOE_FAIL(...) ::xmoe::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__))
