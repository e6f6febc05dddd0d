#include "xmoe/train/checkpoint.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <regex>

#include "xmoe/config/config.h"
#include "xmoe/data/prepare.h"
#include "xmoe/io/file.h"
#include "xmoe/io/safetensors.h"

namespace xmoe::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kManifest = "manifest.json";
constexpr const char* kFormat = "xmoe-checkpoint";

std::string join(const std::string& dir, const std::string& name) {
  return (fs::path(dir) / name).string();
}

void remove_all_or_throw(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  XMOE_CHECK(!ec, "[checkpoint] cannot remove {}: {}", path, ec.message());
}

void rename_or_throw(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  XMOE_CHECK(!ec, "[checkpoint] cannot rename {} -> {}: {}", from, to, ec.message());
}

std::string parent_of(const std::string& dir) {
  const fs::path p = fs::path(dir).lexically_normal().parent_path();
  return p.empty() ? "." : p.string();
}

// "runs/x/step-200/" -> "runs/x/step-200", so tmp and .old names are siblings, not children.
std::string strip_slash(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

json read_manifest(const std::string& dir) {
  const std::string path = join(dir, kManifest);
  XMOE_CHECK(fs::is_directory(dir), "[checkpoint] {}: no such checkpoint folder", dir);
  XMOE_CHECK(fs::is_regular_file(path),
             "[checkpoint] {}: manifest missing (incomplete or not a checkpoint)", path);
  json m;
  try {
    m = json::parse(io::read_file(path));
  } catch (const json::exception& e) {
    XMOE_FAIL("[checkpoint] {}: manifest is not valid JSON ({})", path, e.what());
  }
  // Compared as JSON values: a format or version of another type is a mismatch, not a throw.
  XMOE_CHECK(m.is_object() && m.contains("format") && m["format"] == kFormat,
             "[checkpoint] {}: not an xmoe checkpoint manifest (format != '{}')", path, kFormat);
  XMOE_CHECK(m.contains("version") && m["version"] == kCheckpointFormatVersion,
             "[checkpoint] {}: format version {} is not supported (this build reads {})", path,
             m.contains("version") ? m["version"].dump() : "(none)", kCheckpointFormatVersion);
  XMOE_CHECK(m.contains("files") && m["files"].is_array() && m.contains("world") &&
                 m["world"].is_number_integer() && m.contains("state"),
             "[checkpoint] {}: manifest lacks files, world or state", path);
  XMOE_CHECK(m["world"].get<int64_t>() >= 1 && m["files"].size() == m["world"].get<uint64_t>(),
             "[checkpoint] {}: manifest lists {} files for world {}", path, m["files"].size(),
             m["world"].dump());
  return m;
}

// Checks one listed file's entry (name, bytes, crc32c, rank < world), presence, size and
// checksum.
void verify_file(const std::string& dir, const json& entry, int world) {
  XMOE_CHECK(entry.is_object() && entry.contains("name") && entry["name"].is_string() &&
                 entry.contains("bytes") && entry["bytes"].is_number_unsigned() &&
                 entry.contains("crc32c") && entry["crc32c"].is_string() &&
                 (!entry.contains("rank") ||
                  (entry["rank"].is_number_integer() && entry["rank"].get<int64_t>() >= 0 &&
                   entry["rank"].get<int64_t>() < world)),
             "[checkpoint] {}: malformed files entry {} (needs a string name and crc32c, a byte "
             "count and a rank below world {})",
             join(dir, kManifest), entry.dump(), world);
  const std::string name = entry["name"].get<std::string>();
  XMOE_CHECK(name.find('/') == std::string::npos && name != ".." && name != ".",
             "[checkpoint] {}: file name '{}' is not a plain name", join(dir, kManifest), name);
  const std::string path = join(dir, name);
  XMOE_CHECK(fs::is_regular_file(path), "[checkpoint] {}: file missing", path);
  const uint64_t want = entry["bytes"].get<uint64_t>(), have = fs::file_size(path);
  XMOE_CHECK(have == want, "[checkpoint] {}: {} bytes, manifest says {} (truncated or altered)",
             path, have, want);
  XMOE_CHECK(io::crc32c_hex(io::file_crc32c(path)) == entry["crc32c"].get<std::string>(),
             "[checkpoint] {}: checksum mismatch (file corrupt)", path);
}

}  // namespace

std::string checkpoint_rank_file(int rank) {
  return fmt::format("model-rank{}.safetensors", rank);
}

std::string checkpoint_tmp_dir(const std::string& dir) {
  const std::string d = strip_slash(dir);
  return d + ".tmp-" + io::crc32c_hex(io::crc32c(d.data(), d.size()));
}

void write_checkpoint_shard(const std::string& tmp_dir,
                            const std::map<std::string, Tensor>& tensors, int rank) {
  XMOE_CHECK(fs::is_directory(tmp_dir), "[checkpoint] {}: tmp folder does not exist", tmp_dir);
  const std::string path = join(tmp_dir, checkpoint_rank_file(rank));
  io::save_safetensors(path, tensors, {{"format", kFormat}, {"rank", std::to_string(rank)}});
}

namespace {

// commit_checkpoint's work; sets `in_place` once the new checkpoint has its final name, after
// which a failure (fsync, removing `.old`) no longer threatens it.
void commit_impl(const std::string& tmp_dir, const std::string& dir_in, const json& manifest_extra,
                 int world, const std::map<std::string, std::string>& extra, bool& in_place) {
  const std::string dir = strip_slash(dir_in);
  json files = json::array();
  for (int r = 0; r < world; ++r) {
    const std::string name = checkpoint_rank_file(r), path = join(tmp_dir, name);
    XMOE_CHECK(fs::is_regular_file(path),
               "[checkpoint] {}: rank {} did not write its file (world {})", path, r, world);
    files.push_back({{"name", name},
                     {"rank", r},
                     {"bytes", fs::file_size(path)},
                     {"crc32c", io::crc32c_hex(io::file_crc32c(path))}});
  }
  json manifest = {{"format", kFormat},
                   {"version", kCheckpointFormatVersion},
                   {"world", world},
                   {"files", files},
                   {"state", manifest_extra}};
  for (const auto& [name, bytes] : extra) {
    XMOE_CHECK(name.find('/') == std::string::npos && name != kManifest &&
                   name.rfind("model-rank", 0) != 0,
               "[checkpoint] extra file name '{}' is not a plain name of its own", name);
    const std::string path = join(tmp_dir, name);
    io::write_file_atomic(path, bytes);
    manifest["extra_files"].push_back(
        {{"name", name},
         {"bytes", bytes.size()},
         {"crc32c", io::crc32c_hex(io::crc32c(bytes.data(), bytes.size()))}});
  }
  io::write_file_atomic(join(tmp_dir, kManifest), manifest.dump(2) + "\n");
  io::fsync_path(tmp_dir);

  // Replace: dir -> dir.old, tmp -> dir, delete dir.old. At every instant either `dir` is absent
  // or it is a complete checkpoint.
  const std::string old = dir + ".old";
  const bool had_old = fs::exists(dir);
  if (had_old) {
    remove_all_or_throw(old);
    rename_or_throw(dir, old);
  }
  std::error_code ec;
  fs::rename(tmp_dir, dir, ec);
  if (ec) {
    std::error_code ignored;
    if (had_old) fs::rename(old, dir, ignored);  // the previous checkpoint back under its name
    XMOE_FAIL("[checkpoint] cannot rename {} -> {}: {}", tmp_dir, dir, ec.message());
  }
  in_place = true;
  io::fsync_path(parent_of(dir));
  remove_all_or_throw(old);  // also a `.old` left by a save that crashed between the renames
}

uint64_t shard_bytes(const std::map<std::string, Tensor>& tensors) {
  uint64_t n = 0;
  for (const auto& [name, t] : tensors) n += t.defined() ? t.nbytes() : 0;
  return n;
}

}  // namespace

void commit_checkpoint(const std::string& tmp_dir, const std::string& dir,
                       const json& manifest_extra, int world,
                       const std::map<std::string, std::string>& files) {
  bool in_place = false;
  commit_impl(tmp_dir, dir, manifest_extra, world, files, in_place);
}

void save_checkpoint(const std::string& dir_in, const std::map<std::string, Tensor>& tensors,
                     const json& manifest_extra, int rank, int world,
                     const std::function<bool(bool)>& all_ok,
                     const std::map<std::string, std::string>& files) {
  XMOE_CHECK(world >= 1 && rank >= 0 && rank < world, "[checkpoint] rank {} outside world {}", rank,
             world);
  XMOE_CHECK(world == 1 || all_ok,
             "[checkpoint] save with world {} needs a vote (all_ok) to coordinate the ranks",
             world);
  const std::string dir = strip_slash(dir_in);
  const std::string tmp = checkpoint_tmp_dir(dir);
  const std::string parent = parent_of(dir);
  // Every rank writes into the same folder (rank 0 checksums all files), so the save needs about
  // world times this rank's share.
  uint64_t needed = shard_bytes(tensors) * static_cast<uint64_t>(world);
  for (const auto& [name, bytes] : files) needed += bytes.size();
  bool in_place = false;
  std::string failure;  // this rank's reason, if a phase failed here
  // One phase of the protocol on this rank, then the vote: every rank learns whether all
  // passed, so all fail together and none waits for a rank that gave up.
  auto phase = [&](const std::function<void()>& work) {
    if (failure.empty()) {
      try {
        work();
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    const bool all = all_ok ? all_ok(failure.empty()) : failure.empty();
    if (all) return true;
    if (failure.empty()) failure = "another rank's part of the save failed";
    return false;
  };
  // Measured before the first vote, while no rank of this save has written anything.
  const std::optional<uint64_t> free_before = io::free_bytes(parent);
  const bool ok = phase([&] {
                    XMOE_CHECK(!free_before || *free_before >= needed, "not enough free space");
                    if (rank != 0) return;
                    std::error_code ec;
                    fs::create_directories(parent, ec);
                    XMOE_CHECK(!ec, "[checkpoint] cannot create {}: {}", parent, ec.message());
                    remove_all_or_throw(tmp);  // leftover of a crashed save
                    fs::create_directory(tmp, ec);
                    XMOE_CHECK(!ec, "[checkpoint] cannot create {}: {}", tmp, ec.message());
                  }) &&
                  phase([&] { write_checkpoint_shard(tmp, tensors, rank); }) && phase([&] {
                    if (rank == 0) commit_impl(tmp, dir, manifest_extra, world, files, in_place);
                  });
  if (ok) return;
  if (in_place)
    XMOE_FAIL("[checkpoint] {} is saved, but finishing the save failed: {}", dir, failure);
  // Every rank has voted: none writes into the folder any more, so any may remove it (a removal
  // racing with another rank's is harmless). A full disk is not kept full by a half checkpoint.
  std::error_code ignored;
  for (int i = 0; i < 3 && fs::exists(tmp, ignored); ++i) fs::remove_all(tmp, ignored);
  const std::optional<uint64_t> free = io::free_bytes(parent);
  XMOE_FAIL(
      "[checkpoint] saving {} failed: {}; it needs about {}, {} free on that filesystem. The "
      "previous checkpoints are intact.",
      dir, failure, io::format_bytes(needed),
      free ? io::format_bytes(*free) : std::string("an unknown amount"));
}

namespace {

Checkpoint load_impl(const std::string& dir_in, int only_rank) {
  const std::string dir = strip_slash(dir_in);
  Checkpoint ck;
  ck.manifest = read_manifest(dir);
  ck.world = ck.manifest["world"].get<int>();
  ck.state = ck.manifest["state"];
  XMOE_CHECK(only_rank < ck.world, "[checkpoint] {}: rank {} requested, saved with world {}", dir,
             only_rank, ck.world);
  for (const json& entry : ck.manifest["files"]) verify_file(dir, entry, ck.world);
  if (ck.manifest.contains("extra_files")) {
    XMOE_CHECK(ck.manifest["extra_files"].is_array(), "[checkpoint] {}: extra_files is not a list",
               join(dir, kManifest));
    for (const json& entry : ck.manifest["extra_files"]) verify_file(dir, entry, ck.world);
  }
  for (const json& entry : ck.manifest["files"]) {
    const int r = entry.value("rank", 0);
    if (only_rank >= 0 && r != only_rank) continue;
    const std::string path = join(dir, entry["name"].get<std::string>());
    io::SafetensorsFile f;
    try {
      f = io::load_safetensors(path);
    } catch (const Error& e) {
      XMOE_FAIL("[checkpoint] {}: invalid tensor file: {}", path, e.what());
    }
    for (auto& [name, t] : f.tensors) {
      auto it = ck.tensors.find(name);
      if (it == ck.tensors.end()) {
        ck.tensors.emplace(name, std::move(t));
        continue;
      }
      // A replicated tensor saved by several ranks: the copies must agree.
      const Tensor& a = it->second;
      XMOE_CHECK(a.dtype() == t.dtype() && a.shape() == t.shape() &&
                     (a.nbytes() == 0 || std::memcmp(a.raw(), t.raw(), a.nbytes()) == 0),
                 "[checkpoint] {}: tensor '{}' differs from the copy in another rank's file", path,
                 name);
    }
  }
  return ck;
}

}  // namespace

Checkpoint load_checkpoint(const std::string& dir) {
  return load_impl(dir, -1);
}

Checkpoint load_checkpoint_rank(const std::string& dir, int rank) {
  XMOE_CHECK(rank >= 0, "[checkpoint] {}: rank {} < 0", dir, rank);
  return load_impl(dir, rank);
}

std::string checkpoint_tokenizer(const std::string& dir_in, const Checkpoint& checkpoint) {
  const std::string dir = strip_slash(dir_in);
  const json& state = checkpoint.state;
  if (state.contains("tokenizer")) {
    const json& t = state["tokenizer"];
    XMOE_CHECK(t.is_object() && t.contains("kind") && t["kind"].is_string(),
               "[checkpoint] {}: tokenizer {} names no kind", join(dir, kManifest), t.dump());
    if (t["kind"] == "byte") return "";
    XMOE_CHECK(t.contains("file") && t["file"].is_string(),
               "[checkpoint] {}: the {} tokenizer names no file", join(dir, kManifest),
               t["kind"].get<std::string>());
    const std::string name = t["file"].get<std::string>();
    bool listed = false;
    if (checkpoint.manifest.contains("extra_files"))
      for (const json& e : checkpoint.manifest["extra_files"])
        listed |= e.value("name", "") == name;
    XMOE_CHECK(listed && name.find('/') == std::string::npos,
               "[checkpoint] {}: tokenizer file '{}' is not among the checkpoint's files",
               join(dir, kManifest), name);
    return join(dir, name);
  }
  // Saved before checkpoints carried the tokenizer: the data folder's copy.
  XMOE_CHECK(state.contains("config") && state["config"].is_string(), "[checkpoint] {}: no config",
             join(dir, kManifest));
  const Config config =
      load_config_string(state["config"].get<std::string>(), join(dir, kManifest));
  const std::vector<DataMixEntry> mix = parse_data_mix(config.data.mix);
  const std::string data_dir = mix.empty() ? config.data.dir : mix.front().dir;
  // Without the folder, only a byte-vocabulary model can safely assume the byte tokenizer.
  XMOE_CHECK(
      fs::is_regular_file(fs::path(data_dir) / "meta.json") || config.model.vocab_size <= 256,
      "[checkpoint] {} carries no tokenizer (saved by an older xmoe, or imported) and its data "
      "folder {} is gone; give the tokenizer file (--tokenizer)",
      dir, data_dir);
  return data::prepared_tokenizer(data_dir);
}

std::optional<std::string> latest_checkpoint(const std::string& run_dir) {
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) return std::nullopt;
  // At most 18 digits: a longer step is no checkpoint of ours, and would overflow stoull.
  static const std::regex pattern(R"(step-(\d{1,18})(\.old)?)");
  // step -> (path, is_old); a complete `step-N` wins over `step-N.old`.
  std::map<uint64_t, std::pair<std::string, bool>> found;
  for (const auto& entry : fs::directory_iterator(run_dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, m, pattern)) continue;
    if (!entry.is_directory() || !fs::is_regular_file(entry.path() / kManifest)) continue;
    const uint64_t step = std::stoull(m[1].str());
    const bool is_old = m[2].matched;
    if (is_old && fs::exists(fs::path(run_dir) / fmt::format("step-{}", m[1].str()))) continue;
    auto it = found.find(step);
    if (it == found.end() || (it->second.second && !is_old))
      found[step] = {entry.path().string(), is_old};
  }
  if (found.empty()) return std::nullopt;
  return found.rbegin()->second.first;
}

}  // namespace xmoe::train
