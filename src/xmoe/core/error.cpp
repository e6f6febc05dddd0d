#include "xmoe/core/error.h"

#include <utility>

namespace xmoe {

namespace {

std::string gib(int64_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1ull << 30));
}

}  // namespace

OutOfMemory::OutOfMemory(std::string device, int64_t bytes_asked, int64_t bytes_free,
                         int64_t bytes_total, int64_t live_bytes, const std::string& detail)
    : Error(fmt::format("[{} allocator] out of memory: asked {} bytes ({}), {} bytes free ({}) of "
                        "{} ({}) on {}, {} bytes ({}) live in xmoe's tensors{}",
                        device, bytes_asked, gib(bytes_asked), bytes_free, gib(bytes_free),
                        bytes_total, gib(bytes_total), device, live_bytes, gib(live_bytes),
                        detail)),
      device_(std::move(device)),
      bytes_asked_(bytes_asked),
      bytes_free_(bytes_free),
      bytes_total_(bytes_total),
      live_bytes_(live_bytes) {}

void throw_error(const char* /*file*/, int /*line*/, const std::string& message) {
  throw Error(message);
}

}  // namespace xmoe
