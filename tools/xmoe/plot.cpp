#include "plot.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <filesystem>
#include <sstream>

#include "xmoe/core/error.h"
#include "xmoe/io/file.h"

namespace xmoe::cli {

namespace fs = std::filesystem;

namespace {

constexpr const char* kHelper = "xmoe_plot.py";
// The helper's exit statuses for bad input and a failed `import matplotlib` (xmoe_plot.py).
constexpr int kBadInput = 2;
constexpr int kNoMatplotlib = 3;
// The child's status when python3 cannot be started (the shell's convention).
constexpr int kNoInterpreter = 127;

struct ChildResult {
  int status = 0;      ///< exit status
  std::string output;  ///< stdout and stderr together
};

/// Runs argv without a shell and collects its output.
ChildResult run_child(const std::vector<std::string>& args) {
  int pipe_fds[2];
  XMOE_CHECK(pipe(pipe_fds) == 0, "[plot] pipe failed");
  const pid_t pid = fork();
  XMOE_CHECK(pid >= 0, "[plot] fork failed");
  if (pid == 0) {
    dup2(pipe_fds[1], STDOUT_FILENO);
    dup2(pipe_fds[1], STDERR_FILENO);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    _exit(kNoInterpreter);
  }
  close(pipe_fds[1]);
  ChildResult r;
  std::array<char, 4096> buf;
  for (ssize_t n; (n = read(pipe_fds[0], buf.data(), buf.size())) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    r.output.append(buf.data(), static_cast<size_t>(n));
  }
  close(pipe_fds[0]);
  int wstatus = 0;
  while (waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  r.status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
  return r;
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace

std::vector<std::string> plot_run(const std::string& run_dir, std::string out_dir,
                                  const std::vector<std::string>& compare_dirs) {
  const auto metrics_of = [](const std::string& dir) {
    const fs::path metrics = fs::path(dir) / "metrics.jsonl";
    XMOE_CHECK(fs::is_regular_file(metrics),
               "[plot] {} has no metrics.jsonl: give the run folder of xmoe train (its "
               "train.out_dir)",
               dir);
    return metrics.string();
  };
  const std::string metrics = metrics_of(run_dir);
  if (out_dir.empty()) out_dir = (fs::path(run_dir) / "plots").string();
  std::vector<std::string> args{"python3", io::find_helper_script(kHelper, "plot", "plotting"),
                                metrics, out_dir};
  if (!compare_dirs.empty()) {
    args.push_back("--compare");
    for (const std::string& dir : compare_dirs) args.push_back(metrics_of(dir));
  }
  const ChildResult r = run_child(args);
  XMOE_CHECK(r.status != kNoInterpreter,
             "[plot] python3 was not found on PATH; xmoe plot needs Python 3 with matplotlib "
             "(bash scripts/install-deps.sh installs both)");
  XMOE_CHECK(r.status != kBadInput && r.status != kNoMatplotlib, "[plot] {}", trimmed(r.output));
  XMOE_CHECK(r.status == 0, "[plot] the plotting helper failed (exit status {}): {}", r.status,
             trimmed(r.output));
  std::vector<std::string> files;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);)
    if (!line.empty()) files.push_back(line);
  return files;
}

}  // namespace xmoe::cli
