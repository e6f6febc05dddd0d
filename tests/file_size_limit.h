#pragma once
// A full disk on demand, for tests: RLIMIT_FSIZE makes a write past the limit fail with EFBIG,
// the way ENOSPC fails it, without filling any real disk.
#include <sys/resource.h>

#include <csignal>

namespace xmoe::testing {

/// While alive, no file of this process may grow past `bytes`: the write that crosses the
/// limit stores what fits and the next fails with EFBIG ("File too large"). SIGXFSZ, which
/// would kill the process, is ignored meanwhile. The previous limit is restored on destruction.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &old_);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit lim = old_;
    lim.rlim_cur = old_.rlim_max == RLIM_INFINITY || bytes < old_.rlim_max ? bytes : old_.rlim_max;
    ::setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit old_{};
  void (*old_handler_)(int) = SIG_DFL;
};

}  // namespace xmoe::testing
