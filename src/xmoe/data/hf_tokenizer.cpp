// Hugging Face tokenizer.json through Python's `tokenizers` package: there is no C++ library of
// it in Debian, so one helper process (tools/xmoe/xmoe_tokenizer.py) per tokenizer answers encode
// and decode requests over a socket pair (its protocol is in the helper's docstring).
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>

#include "xmoe/core/error.h"
#include "xmoe/data/tokenizer.h"
#include "xmoe/io/file.h"

namespace xmoe::data {

namespace {

constexpr const char* kHelper = "xmoe_tokenizer.py";
// The helper's exit statuses (xmoe_tokenizer.py) and the shell's for a missing interpreter.
constexpr int kBadFile = 2;
constexpr int kNoTokenizers = 3;
constexpr int kNoInterpreter = 127;

class HfTokenizer final : public Tokenizer {
 public:
  explicit HfTokenizer(std::string path) : path_(std::move(path)) { start(); }
  ~HfTokenizer() override {
    if (fd_ >= 0) ::close(fd_);  // the helper sees the end of its input and exits
    if (err_fd_ >= 0) ::close(err_fd_);
    if (pid_ > 0) {
      int status = 0;
      while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
    }
  }

  std::string name() const override { return "hf"; }
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eos_id() const override { return eos_id_; }
  int64_t bos_id() const override { return bos_id_; }
  std::string file() const override { return path_; }

  std::vector<uint32_t> encode(std::string_view text) const override {
    return std::move(encode_batch({std::string(text)})[0]);
  }

  std::vector<std::vector<uint32_t>> encode_batch(
      const std::vector<std::string>& texts) const override {
    std::string request = "E";
    append(request, static_cast<uint32_t>(texts.size()));
    for (const std::string& t : texts) {
      append(request, static_cast<uint64_t>(t.size()));
      request += t;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    send_all(request);
    std::vector<std::vector<uint32_t>> out(texts.size());
    for (auto& ids : out) {
      ids.resize(receive<uint64_t>());
      receive_bytes(ids.data(), ids.size() * 4);
    }
    return out;
  }

  std::string decode(std::span<const uint32_t> ids) const override {
    for (size_t i = 0; i < ids.size(); ++i)
      XMOE_CHECK(ids[i] < vocab_size_,
                 "[tokenizer] token {} at position {} is outside the vocabulary ({})", ids[i], i,
                 vocab_size_);
    std::string request = "D";
    append(request, static_cast<uint64_t>(ids.size()));
    request.append(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
    std::lock_guard<std::mutex> lock(mutex_);
    send_all(request);
    std::string text(receive<uint64_t>(), '\0');
    receive_bytes(text.data(), text.size());
    return text;
  }

 private:
  template <typename T>
  static void append(std::string& s, T v) {
    s.append(reinterpret_cast<const char*>(&v), sizeof v);
  }

  void start() {
    const std::string helper =
        io::find_helper_script(kHelper, "tokenizer", "Hugging Face tokenizer");
    int sv[2], err[2];
    XMOE_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0,
               "[tokenizer] socketpair failed ({})", std::strerror(errno));
    XMOE_CHECK(::pipe2(err, O_CLOEXEC) == 0, "[tokenizer] pipe failed ({})", std::strerror(errno));
    pid_ = ::fork();
    XMOE_CHECK(pid_ >= 0, "[tokenizer] fork failed ({})", std::strerror(errno));
    if (pid_ == 0) {
      ::dup2(sv[1], STDIN_FILENO);
      ::dup2(sv[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      const char* argv[] = {"python3", helper.c_str(), path_.c_str(), nullptr};
      ::execvp(argv[0], const_cast<char* const*>(argv));
      ::_exit(kNoInterpreter);
    }
    ::close(sv[1]);
    ::close(err[1]);
    fd_ = sv[0];
    err_fd_ = err[0];
    // The first line: {"vocab_size": ..., "eos_id": ..., "bos_id": ...}.
    std::string line;
    for (char c = '\0'; c != '\n';) {
      if (::read(fd_, &c, 1) != 1) fail_started();
      if (c != '\n') line += c;
    }
    const nlohmann::json info = nlohmann::json::parse(line);
    vocab_size_ = info.at("vocab_size").get<int64_t>();
    eos_id_ = info.at("eos_id").get<int64_t>();
    bos_id_ = info.at("bos_id").get<int64_t>();
  }

  // The helper ended: its exit status and message say why.
  [[noreturn]] void fail_started() const {
    std::string message;
    char buf[4096];
    for (ssize_t n; (n = ::read(err_fd_, buf, sizeof buf)) > 0;) message.append(buf, n);
    while (!message.empty() && message.back() == '\n') message.pop_back();
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    XMOE_CHECK(code != kNoInterpreter,
               "[tokenizer] {}: python3 was not found on PATH; Hugging Face tokenizers need "
               "Python 3 with the `tokenizers` package (bash scripts/install-deps.sh installs it)",
               path_);
    XMOE_CHECK(code != kNoTokenizers && code != kBadFile, "[tokenizer] {}: {}", path_, message);
    XMOE_FAIL("[tokenizer] {}: the tokenizer helper stopped (exit status {}): {}", path_, code,
              message);
  }

  void send_all(const std::string& data) const {
    for (size_t done = 0; done < data.size();) {
      const ssize_t n = ::send(fd_, data.data() + done, data.size() - done, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail_started();
      done += static_cast<size_t>(n);
    }
  }

  void receive_bytes(void* out, size_t size) const {
    auto* p = static_cast<char*>(out);
    for (size_t done = 0; done < size;) {
      const ssize_t n = ::read(fd_, p + done, size - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail_started();
      done += static_cast<size_t>(n);
    }
  }

  template <typename T>
  T receive() const {
    T v;
    receive_bytes(&v, sizeof v);
    return v;
  }

  std::string path_;
  mutable pid_t pid_ = -1;
  int fd_ = -1, err_fd_ = -1;
  int64_t vocab_size_ = 0, eos_id_ = -1, bos_id_ = -1;
  mutable std::mutex mutex_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path) {
  return std::make_unique<HfTokenizer>(path);
}

}  // namespace xmoe::data
