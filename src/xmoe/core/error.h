#pragma once
// Errors: every failure is an xmoe::Error whose message names the op or key and the bad value,
// e.g. "[config] moe.top_k = 9 exceeds moe.num_experts = 8". Library code never calls exit().
#include <fmt/format.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace xmoe {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// An allocation that the device (or the host) could not satisfy, or that XMOE_MEMORY_LIMIT's
/// cap refused. Thrown by the allocators before they count anything: once it has unwound, the
/// allocator's live bytes are what they were before the request. Benchmarks catch it to report
/// a shape that does not fit and go on.
class OutOfMemory : public Error {
 public:
  /// device: "cpu", "cuda:0"; bytes_free / bytes_total: of the device (cudaMemGetInfo, the
  /// host's physical memory, or the cap); live_bytes: the allocator's, when it refused; detail:
  /// appended to the message (the driver's words, the cache).
  OutOfMemory(std::string device, int64_t bytes_asked, int64_t bytes_free, int64_t bytes_total,
              int64_t live_bytes, const std::string& detail = "");
  const std::string& device() const { return device_; }
  int64_t bytes_asked() const { return bytes_asked_; }
  int64_t bytes_free() const { return bytes_free_; }
  int64_t bytes_total() const { return bytes_total_; }
  int64_t live_bytes() const { return live_bytes_; }

 private:
  std::string device_;
  int64_t bytes_asked_, bytes_free_, bytes_total_, live_bytes_;
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
