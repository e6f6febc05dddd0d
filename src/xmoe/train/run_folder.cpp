#include "xmoe/train/run_folder.h"

#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "xmoe/core/error.h"
#include "xmoe/io/file.h"
#include "xmoe/train/checkpoint.h"

namespace xmoe::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kConfigFile = "config.yaml";
constexpr const char* kMetricsFile = "metrics.jsonl";

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown-host";
  return buf;
}

/// True unless `pid` is certainly gone (kill(pid, 0) answers ESRCH).
bool process_may_live(long pid) {
  if (pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH;
}

/// Creates `dir` (and parents) with an error that names train.out_dir and the OS's reason.
void create_run_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  XMOE_CHECK(!ec, "[train] train.out_dir = {}: cannot create the run folder ({})", dir,
             ec.message());
  XMOE_CHECK(fs::is_directory(dir), "[train] train.out_dir = {} exists and is not a folder", dir);
  XMOE_CHECK(::access(dir.c_str(), W_OK) == 0,
             "[train] train.out_dir = {}: the run folder is not writable ({})", dir,
             std::strerror(errno));
}

}  // namespace

// ---- contents -----------------------------------------------------------------------------

std::string RunFolderContents::describe() const {
  std::vector<std::string> parts;
  if (has_config) parts.emplace_back(kConfigFile);
  if (has_metrics) parts.emplace_back(kMetricsFile);
  if (checkpoints.size() == 1)
    parts.push_back("checkpoint " + checkpoints.front());
  else if (!checkpoints.empty())
    parts.push_back(fmt::format("{} checkpoints ({} ... {})", checkpoints.size(),
                                checkpoints.front(), checkpoints.back()));
  return parts.empty() ? "nothing of a run" : fmt::format("{}", fmt::join(parts, ", "));
}

RunFolderContents inspect_run_folder(const std::string& dir) {
  RunFolderContents c;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return c;
  c.has_config = fs::exists(fs::path(dir) / kConfigFile);
  c.has_metrics = fs::exists(fs::path(dir) / kMetricsFile);
  static const std::regex pattern(R"(step-(\d+)(\.old)?)");
  std::vector<std::pair<uint64_t, std::string>> found;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && std::regex_match(name, m, pattern))
      found.emplace_back(std::stoull(m[1].str()), name);
  }
  std::sort(found.begin(), found.end());
  for (auto& [step, name] : found) c.checkpoints.push_back(std::move(name));
  return c;
}

void remove_old_checkpoints(const std::string& dir, int keep) {
  const RunFolderContents c = inspect_run_folder(dir);  // by step, step-N before step-N.old
  auto step_of = [](const std::string& name) { return std::stoull(name.substr(5)); };
  std::vector<uint64_t> steps;
  for (const std::string& name : c.checkpoints)
    if (steps.empty() || steps.back() != step_of(name)) steps.push_back(step_of(name));
  if (steps.size() <= static_cast<size_t>(keep)) return;
  const uint64_t oldest_kept = steps[steps.size() - static_cast<size_t>(keep)];
  for (const std::string& name : c.checkpoints) {
    if (step_of(name) >= oldest_kept) continue;
    std::error_code ec;
    fs::remove_all(fs::path(dir) / name, ec);
    XMOE_CHECK(!ec, "[train] train.keep_checkpoints = {}: cannot delete {} ({})", keep,
               (fs::path(dir) / name).string(), ec.message());
  }
}

// ---- lock ---------------------------------------------------------------------------------

RunLock::RunLock(const std::string& dir) : path_((fs::path(dir) / kRunLockFile).string()) {
  create_run_dir(dir);
  const std::string me = fmt::format("{} {}\n", host_name(), static_cast<long>(::getpid()));
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      const bool ok = ::write(fd, me.data(), me.size()) == static_cast<ssize_t>(me.size());
      ::close(fd);
      if (!ok) {
        ::unlink(path_.c_str());
        XMOE_FAIL("[train] {}: cannot write the run lock ({})", path_, std::strerror(errno));
      }
      return;
    }
    XMOE_CHECK(errno == EEXIST, "[train] {}: cannot create the run lock ({})", path_,
               std::strerror(errno));
    std::string host;
    long pid = -1;
    std::istringstream(io::read_file(path_)) >> host >> pid;
    const bool here = host == host_name();
    XMOE_CHECK(here && !process_may_live(pid),
               "[train] {} is in use by another trainer (host {}, pid {}). Wait for it to end; "
               "if that process is gone{}, delete {} and start again",
               dir, host.empty() ? "?" : host, pid,
               here ? "" : " (it ran on another host, which xmoe cannot check)", path_);
    spdlog::warn("{}: taking over the lock of pid {} on {}, which no longer runs", dir, pid, host);
    ::unlink(path_.c_str());
  }
  XMOE_FAIL("[train] {}: another trainer took the run lock at the same moment", path_);
}

RunLock::~RunLock() {
  ::unlink(path_.c_str());
}

// ---- fresh runs ---------------------------------------------------------------------------

void start_fresh_run(const std::string& dir, bool overwrite) {
  const RunFolderContents c = inspect_run_folder(dir);
  if (!c.holds_run()) return;
  XMOE_CHECK(overwrite,
             "[train] train.out_dir = {} already holds a run ({}). Continue it with --resume, "
             "start it over with --overwrite (deletes those files), or train into another "
             "folder with --set train.out_dir=...",
             dir, c.describe());
  spdlog::warn("--overwrite: deleting the run in {} ({})", dir, c.describe());
  auto remove = [&](const fs::path& p) {
    std::error_code ec;
    fs::remove_all(p, ec);
    XMOE_CHECK(!ec, "[train] --overwrite: cannot delete {} ({})", p.string(), ec.message());
  };
  remove(fs::path(dir) / kConfigFile);
  remove(fs::path(dir) / kMetricsFile);
  for (const std::string& name : c.checkpoints) remove(fs::path(dir) / name);
  // Leftovers of saves that crashed: step-N.tmp-XXXXXXXX.
  std::error_code ec;
  static const std::regex tmp(R"(step-\d+\.tmp-[0-9a-f]+)");
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (std::regex_match(entry.path().filename().string(), tmp)) remove(entry.path());
}

void truncate_metrics(const std::string& dir, int step) {
  const fs::path path = fs::path(dir) / kMetricsFile;
  if (!fs::exists(path)) return;
  std::istringstream in(io::read_file(path.string()));
  std::string kept, line;
  int dropped = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    // Unreadable lines (a crash mid-line) go too: they belong to the lost steps. The step is
    // compared unnarrowed: 4294967297 read as an int would be 1, and kept.
    const bool logged_by_then =
        j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
        (j["step"].is_number_unsigned() ? j["step"].get<uint64_t>() <= uint64_t(std::max(step, 0))
                                        : j["step"].get<int64_t>() <= step);
    if (logged_by_then) {
      kept += line + "\n";
    } else {
      ++dropped;
    }
  }
  if (dropped == 0) return;
  io::write_file_atomic(path.string(), kept);
  spdlog::info("{}: dropped {} line(s) logged after step {} (the run resumes from there)",
               path.string(), dropped, step);
}

// ---- resume -------------------------------------------------------------------------------

std::vector<std::string> config_differences(const Config& a, const Config& b,
                                            const std::string& prefix) {
  std::vector<std::string> out;
  for (const ConfigKeyInfo& k : config_keys()) {
    if (k.name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string va = config_get(a, k.name), vb = config_get(b, k.name);
    if (va != vb) out.push_back(fmt::format("{}: {} -> {}", k.name, va, vb));
  }
  return out;
}

ResumeConfig resume_config(const Config& given, const std::vector<std::string>& overrides,
                           bool given_names_model) {
  const std::string& dir = given.train.out_dir;
  const auto latest = latest_checkpoint(dir);
  XMOE_CHECK(latest.has_value(),
             "[train] --resume: no checkpoint in train.out_dir = {} ({}). Give the run's folder "
             "with --set train.out_dir=...",
             dir, fs::is_directory(dir) ? inspect_run_folder(dir).describe() : "no such folder");
  ResumeConfig r;
  r.checkpoint = *latest;
  // The manifest alone (the tensors are read, and every file verified, when training starts).
  const std::string manifest = *latest + "/manifest.json";
  const nlohmann::json m = nlohmann::json::parse(io::read_file(manifest), nullptr, false);
  XMOE_CHECK(m.is_object() && m.contains("state") && m["state"].contains("config") &&
                 m["state"]["config"].is_string(),
             "[train] --resume: {} holds no config (not an xmoe checkpoint manifest?)", manifest);
  const Config saved = load_config_string(m["state"]["config"].get<std::string>(), manifest);
  r.config = saved;
  r.config.train.out_dir = dir;  // where the run is now, whatever its old name
  for (const std::string& o : overrides) apply_override(r.config, o);
  validate(r.config);

  const std::vector<std::string> model = config_differences(saved, r.config, "model.");
  XMOE_CHECK(model.empty(),
             "[train] --resume: the run in {} has another model; these keys differ (run -> "
             "now): {}. A model cannot change within a run: train it into another folder",
             dir, fmt::join(model, "; "));
  Config saved_here = saved;
  saved_here.train.out_dir = dir;
  r.changes = config_differences(saved_here, r.config);
  const std::vector<std::string> given_model =
      given_names_model ? config_differences(saved, given, "model.") : std::vector<std::string>{};
  XMOE_CHECK(given_model.empty(),
             "[train] --resume: the run in {} has another model than --preset/--config "
             "describe; these keys differ (run -> given): {}",
             dir, fmt::join(given_model, "; "));
  r.ignored = config_differences(r.config, given);
  return r;
}

// ---- ranks agree --------------------------------------------------------------------------

namespace {

/// A 64-bit FNV-1a hash: equal texts give equal hashes on every host.
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

void check_ranks_agree(comm::Group& world, const Config& config) {
  if (world.size() == 1) return;
  const std::string version = fmt::format("xmoe {}", XMOE_VERSION);
  const std::string text = version + "\n" + to_yaml(config);
  // Hashes as two int32 halves (any dtype travels; the groups move bytes).
  const uint64_t h = fnv1a(text);
  Tensor mine = Tensor::from_vector<int32_t>(
      {static_cast<int32_t>(h & 0xffffffffu), static_cast<int32_t>(h >> 32)}, {1, 2});
  const std::vector<int32_t> hashes = world.all_gather(mine).to_vector<int32_t>();
  bool all_equal = true;
  for (int r = 1; r < world.size(); ++r)
    all_equal = all_equal && hashes[2 * r] == hashes[0] && hashes[2 * r + 1] == hashes[1];
  if (all_equal) return;

  // Every rank reads rank 0's text and finds the first key (table order) it differs in:
  // -2 the version, -1 nothing; the indices are gathered so every rank names the same ranks.
  Tensor len = Tensor::from_vector<int64_t>({static_cast<int64_t>(text.size())}, {1});
  world.broadcast(len, 0);
  const int64_t n = len.to_vector<int64_t>()[0];
  Tensor bytes = Tensor::zeros({n}, DType::u8);
  if (world.rank() == 0) std::memcpy(bytes.raw(), text.data(), text.size());
  world.broadcast(bytes, 0);
  const std::string root(static_cast<const char*>(bytes.raw()), static_cast<size_t>(n));
  const size_t newline = root.find('\n');
  int32_t first = -1;
  std::string detail;
  if (root.substr(0, newline) != version) {
    first = -2;
    detail = fmt::format("rank 0 runs {}, rank {} runs {}", root.substr(0, newline), world.rank(),
                         version);
  } else {
    const Config root_config = load_config_string(root.substr(newline + 1), "rank 0's config");
    const auto& keys = config_keys();
    for (size_t i = 0; i < keys.size() && first < 0; ++i) {
      const std::string a = config_get(root_config, keys[i].name);
      const std::string b = config_get(config, keys[i].name);
      if (a != b) {
        first = static_cast<int32_t>(i);
        detail = fmt::format("{} = {} on rank 0, {} on rank {}", keys[i].name, a, b, world.rank());
      }
    }
  }
  const std::vector<int32_t> firsts =
      world.all_gather(Tensor::from_vector<int32_t>({first}, {1})).to_vector<int32_t>();
  std::vector<std::string> differ;
  for (int r = 1; r < world.size(); ++r) {
    if (firsts[static_cast<size_t>(r)] == -1) continue;
    const int32_t k = firsts[static_cast<size_t>(r)];
    differ.push_back(fmt::format("rank {} ({})", r,
                                 k == -2 ? std::string("another xmoe version")
                                         : config_keys()[static_cast<size_t>(k)].name));
  }
  XMOE_FAIL(
      "[train] the ranks were started with different configs: {} differ from rank 0{}. "
      "Start every rank with the same command and the same xmoe binary",
      fmt::join(differ, ", "), detail.empty() ? "" : fmt::format(" ({})", detail));
}

}  // namespace xmoe::train
