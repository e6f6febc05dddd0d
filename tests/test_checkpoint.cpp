#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "file_size_limit.h"
#include "testing.h"
#include "xmoe/core/error.h"
#include "xmoe/io/file.h"
#include "xmoe/io/safetensors.h"
#include "xmoe/train/checkpoint.h"

using namespace xmoe;
using xmoe::testing::error_of;
using xmoe::testing::FileSizeLimit;
using xmoe::testing::TempDir;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

io::TensorMap sample_tensors() {
  io::TensorMap m;
  m["w"] = Tensor::from_vector<float>({1.5f, -2.f, 3.25f, 0.f, 1e-3f, 7.f}, {2, 3});
  m["h"] = Tensor::from_vector<float>({1.f, 2.f, 3.f, 4.f}, {4}).to(DType::bf16);
  m["idx"] = Tensor::from_vector<int32_t>({-1, 2, 3}, {3});
  m["steps"] = Tensor::from_vector<int64_t>({1LL << 40}, {1});
  m["mask"] = Tensor::from_vector<uint8_t>({0, 1, 255}, {3, 1});
  m["scalar"] = Tensor::from_vector<float>({42.f}, {});
  m["empty"] = Tensor::zeros({0, 4});
  return m;
}

void expect_same(const io::TensorMap& a, const io::TensorMap& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(b.count(name));
    const Tensor& u = b.at(name);
    EXPECT_EQ(t.shape(), u.shape());
    EXPECT_EQ(t.dtype(), u.dtype());
    if (t.nbytes() > 0) {
      EXPECT_EQ(0, std::memcmp(t.raw(), u.raw(), t.nbytes()));
    }
  }
}

std::string slurp(const std::string& p) {
  return io::read_file(p);
}
void dump(const std::string& p, const std::string& s) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << s;
}

// A hand-made safetensors file: header JSON then `data` bytes.
void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  dump(path, out + header + data);
}

}  // namespace

TEST(Safetensors, RoundTrip) {
  TempDir tmp;
  const auto tensors = sample_tensors();
  io::save_safetensors(tmp / "a.safetensors", tensors, {{"step", "7"}});
  const auto f = io::load_safetensors(tmp / "a.safetensors");
  expect_same(tensors, f.tensors);
  EXPECT_EQ(f.metadata.at("step"), "7");
  // Header: 8-byte length, aligned JSON with the spec's dtype names.
  const std::string bytes = slurp(tmp / "a.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const json h = json::parse(bytes.substr(8, n));
  EXPECT_EQ(h["h"]["dtype"], "BF16");
  EXPECT_EQ(h["idx"]["dtype"], "I32");
  EXPECT_EQ(h["mask"]["shape"], json::array({3, 1}));
}

TEST(Safetensors, ValidationErrorsNameFileAndTensor) {
  TempDir tmp;
  const std::string p = tmp / "bad.safetensors";
  write_raw(p, R"({"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", std::string(4, 0));
  EXPECT_CONTAINS(error_of([&] { io::load_safetensors(p); }),
                  "tensor 'x' has unsupported dtype 'F16'");
  EXPECT_CONTAINS(error_of([&] { io::load_safetensors(p); }), p);

  write_raw(p, R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,12]}})", std::string(12, 0));
  EXPECT_CONTAINS(error_of([&] { io::load_safetensors(p); }),
                  "tensor 'x': shape [2] of F32 needs 8 bytes but data_offsets span 12");

  write_raw(p, R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(4, 0));
  EXPECT_CONTAINS(error_of([&] { io::load_safetensors(p); }),
                  "tensor 'x': data_offsets [0, 8] outside the 4-byte data section");

  write_raw(
      p,
      R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      std::string(12, 0));
  EXPECT_CONTAINS(error_of([&] { io::load_safetensors(p); }), "overlaps");

  write_raw(p, R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, 0));
  EXPECT_CONTAINS(error_of([&] { io::load_safetensors(p); }), "belong to no tensor");

  write_raw(p, R"({"x":{"dtype":"F32","shape":[1]}})", "");
  EXPECT_CONTAINS(error_of([&] { io::load_safetensors(p); }),
                  "tensor 'x' needs dtype, shape and data_offsets");

  write_raw(p, "{not json", "");
  EXPECT_CONTAINS(error_of([&] { io::load_safetensors(p); }), "not valid JSON");

  // Header length beyond the file.
  std::string big(8, '\0');
  big[0] = static_cast<char>(0xff);
  big[1] = static_cast<char>(0xff);
  dump(p, big + "{}");
  EXPECT_CONTAINS(error_of([&] { io::load_safetensors(p); }),
                  "header length 65535 runs past the end");

  // Truncating a good file.
  io::save_safetensors(p, sample_tensors());
  const std::string good = slurp(p);
  dump(p, good.substr(0, good.size() - 3));
  EXPECT_CONTAINS(error_of([&] { io::load_safetensors(p); }), "outside the");
  dump(p, good.substr(0, 5));
  EXPECT_CONTAINS(error_of([&] { io::load_safetensors(p); }), "too short");
}

TEST(Checkpoint, RoundTrip) {
  TempDir tmp;
  const auto tensors = sample_tensors();
  const json state = {{"step", 200}, {"config", "model:\n  d_model: 256\n"}, {"data_position", 17}};
  const std::string dir = tmp / "step-200";
  train::save_checkpoint(dir, tensors, state);
  const train::Checkpoint ck = train::load_checkpoint(dir);
  EXPECT_EQ(ck.state, state);
  EXPECT_EQ(ck.world, 1);
  expect_same(tensors, ck.tensors);
  EXPECT_TRUE(fs::exists(dir + "/manifest.json"));
  EXPECT_TRUE(fs::exists(dir + "/model-rank0.safetensors"));
  for (const auto& e : fs::directory_iterator(tmp.str()))
    EXPECT_EQ(e.path().filename(), "step-200") << "left behind: " << e.path();
  const json m = json::parse(slurp(dir + "/manifest.json"));
  EXPECT_EQ(m["files"][0]["crc32c"],
            io::crc32c_hex(io::file_crc32c(dir + "/model-rank0.safetensors")));
}

TEST(Checkpoint, CorruptionIsRefused) {
  TempDir tmp;
  const std::string dir = tmp / "step-10";
  const std::string file = dir + "/model-rank0.safetensors";
  train::save_checkpoint(dir, sample_tensors(), {{"step", 10}});
  const std::string good = slurp(file);

  dump(file, good.substr(0, good.size() - 1));
  EXPECT_CONTAINS(
      error_of([&] { train::load_checkpoint(dir); }),
      "[checkpoint] " + file + ": " + std::to_string(good.size() - 1) + " bytes, manifest says");

  std::string flipped = good;
  flipped[flipped.size() - 5] ^= 0x10;
  dump(file, flipped);
  EXPECT_CONTAINS(error_of([&] { train::load_checkpoint(dir); }),
                  "[checkpoint] " + file + ": checksum mismatch (file corrupt)");

  fs::remove(file);
  EXPECT_CONTAINS(error_of([&] { train::load_checkpoint(dir); }), file + ": file missing");

  dump(file, good);
  EXPECT_NO_THROW(train::load_checkpoint(dir));
  dump(dir + "/manifest.json", "{\"format\": ");
  EXPECT_CONTAINS(error_of([&] { train::load_checkpoint(dir); }), "manifest is not valid JSON");
  fs::remove(dir + "/manifest.json");
  EXPECT_CONTAINS(error_of([&] { train::load_checkpoint(dir); }),
                  dir + "/manifest.json: manifest missing");
  EXPECT_CONTAINS(error_of([&] { train::load_checkpoint(tmp / "step-99"); }), "no such checkpoint");
}

TEST(Checkpoint, OverwriteReplacesAtomically) {
  TempDir tmp;
  const std::string dir = tmp / "step-5";
  train::save_checkpoint(dir, sample_tensors(), {{"v", 1}});
  io::TensorMap other;
  other["only"] = Tensor::from_vector<float>({9.f}, {1});
  train::save_checkpoint(dir + "/", other, {{"v", 2}});  // trailing slash: same folder
  const auto ck = train::load_checkpoint(dir);
  EXPECT_EQ(ck.state["v"], 2);
  expect_same(other, ck.tensors);
  EXPECT_FALSE(fs::exists(dir + ".old"));
  EXPECT_FALSE(fs::exists(train::checkpoint_tmp_dir(dir)));
}

TEST(Checkpoint, LatestIgnoresTmpAndIncomplete) {
  TempDir tmp;
  EXPECT_FALSE(train::latest_checkpoint(tmp.str()).has_value());
  EXPECT_FALSE(train::latest_checkpoint(tmp / "missing").has_value());
  train::save_checkpoint(tmp / "step-100", sample_tensors(), {{"step", 100}});
  train::save_checkpoint(tmp / "step-20", sample_tensors(), {{"step", 20}});
  // A crashed save: tmp folder with a complete-looking manifest; and a step folder without one.
  fs::create_directories(tmp / "step-300.tmp-0badf00d");
  dump(tmp / "step-300.tmp-0badf00d/manifest.json", "{}");
  fs::create_directories(tmp / "step-400");
  fs::create_directories(tmp / "notes");
  // A step too large for uint64 (std::stoull threw out_of_range): not a checkpoint.
  fs::create_directories(tmp / "step-99999999999999999999999");
  dump(tmp / "step-99999999999999999999999/manifest.json", "{}");
  EXPECT_EQ(train::latest_checkpoint(tmp.str()), tmp / "step-100");

  // A crash between the two renames of an overwrite leaves only step-N.old: still found.
  fs::rename(tmp / "step-100", tmp / "step-100.old");
  EXPECT_EQ(train::latest_checkpoint(tmp.str()), tmp / "step-100.old");
  // The next save of step-100 cleans it up.
  train::save_checkpoint(tmp / "step-100", sample_tensors(), {{"step", 100}});
  EXPECT_FALSE(fs::exists(tmp / "step-100.old"));
  EXPECT_EQ(train::latest_checkpoint(tmp.str()), tmp / "step-100");
  // A stale tmp folder of the same checkpoint is replaced, not reused.
  fs::create_directories(train::checkpoint_tmp_dir(tmp / "step-500"));
  dump(train::checkpoint_tmp_dir(tmp / "step-500") + "/junk", "x");
  train::save_checkpoint(tmp / "step-500", sample_tensors(), {{"step", 500}});
  EXPECT_FALSE(fs::exists(tmp / "step-500/junk"));
  EXPECT_EQ(train::latest_checkpoint(tmp.str()), tmp / "step-500");
}

TEST(Checkpoint, MultiRankProtocol) {
  // Two "ranks" run the protocol in turn with a barrier that does nothing (single process):
  // the shard and commit steps are exercised the way a real multi-rank save would run them.
  TempDir tmp;
  const std::string dir = tmp / "step-1";
  const std::string t = train::checkpoint_tmp_dir(dir);
  fs::create_directories(t);
  io::TensorMap r0, r1;
  r0["shared"] = Tensor::from_vector<float>({1.f, 2.f}, {2});
  r0["expert.0"] = Tensor::from_vector<float>({3.f}, {1});
  r1["shared"] = Tensor::from_vector<float>({1.f, 2.f}, {2});
  r1["expert.1"] = Tensor::from_vector<float>({4.f}, {1});
  train::write_checkpoint_shard(t, r0, 0);
  EXPECT_CONTAINS(error_of([&] { train::commit_checkpoint(t, dir, {}, 2); }),
                  "rank 1 did not write its file");
  train::write_checkpoint_shard(t, r1, 1);
  train::commit_checkpoint(t, dir, {{"world", 2}}, 2);
  const auto ck = train::load_checkpoint(dir);
  EXPECT_EQ(ck.world, 2);
  EXPECT_EQ(ck.tensors.size(), 3u);
  EXPECT_EQ(train::load_checkpoint_rank(dir, 1).tensors.count("expert.0"), 0u);
  EXPECT_CONTAINS(error_of([&] { train::save_checkpoint(dir, r0, {}, 0, 2); }), "needs a vote");
}

namespace {

// Names in `dir` that a failed save must not leave: `*.tmp-*` and `*.old`.
std::vector<std::string> leftovers(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.find(".tmp-") != std::string::npos || name.ends_with(".old")) out.push_back(name);
  }
  return out;
}

// free_bytes answers `bytes` while alive.
struct FakeFreeBytes {
  explicit FakeFreeBytes(uint64_t bytes) { io::set_free_bytes_for_testing(bytes); }
  ~FakeFreeBytes() { io::set_free_bytes_for_testing(std::nullopt); }
};

const std::string efbig = fmt::format("write failed ({})", std::strerror(EFBIG));

}  // namespace

TEST(Checkpoint, FullDiskRemovesTmpAndKeepsPreviousCheckpoint) {
  TempDir tmp;
  const std::string prev = tmp / "step-100", next = tmp / "step-200";
  train::save_checkpoint(prev, sample_tensors(), {{"step", 100}});
  io::TensorMap big;
  big["w"] = Tensor::zeros({64 * 1024});  // 262 kB, far over the 16 kB limit
  std::string msg, msg_overwrite, msg_rank1;
  {
    FileSizeLimit limit(16 * 1024);
    msg = error_of([&] { train::save_checkpoint(next, big, {{"step", 200}}); });
    msg_overwrite = error_of([&] { train::save_checkpoint(prev, big, {{"step", 100}}); });
    // Rank 1 of 2 whose write fails after rank 0 created the tmp folder: it removes the folder.
    fs::create_directories(train::checkpoint_tmp_dir(next));
    msg_rank1 =
        error_of([&] { train::save_checkpoint(next, big, {}, 1, 2, [](bool ok) { return ok; }); });
  }
  EXPECT_CONTAINS(msg, "[checkpoint] saving " + next + " failed: [io] " +
                           train::checkpoint_tmp_dir(next) + "/model-rank0.safetensors: " + efbig);
  EXPECT_CONTAINS(msg, "it needs about 262.1 kB, ");
  EXPECT_CONTAINS(msg, " free on that filesystem. The previous checkpoints are intact.");
  EXPECT_CONTAINS(msg_overwrite, "[checkpoint] saving " + prev + " failed: ");
  EXPECT_CONTAINS(msg_rank1, "model-rank1.safetensors: " + efbig);
  EXPECT_CONTAINS(msg_rank1, "it needs about 524.3 kB");  // world 2 x this rank's share
  EXPECT_EQ(leftovers(tmp.str()), std::vector<std::string>{});
  EXPECT_FALSE(fs::exists(next));
  EXPECT_EQ(train::latest_checkpoint(tmp.str()), prev);
  const train::Checkpoint ck = train::load_checkpoint(prev);
  EXPECT_EQ(ck.state["step"], 100);
  expect_same(sample_tensors(), ck.tensors);
}

TEST(Checkpoint, FailedCommitKeepsPreviousCheckpoint) {
  // The shard fits but the manifest does not: the failure is in the commit step.
  TempDir tmp;
  const std::string dir = tmp / "step-5";
  train::save_checkpoint(dir, sample_tensors(), {{"v", 1}});
  const json huge = {{"v", 2}, {"config", std::string(64 * 1024, 'c')}};
  std::string msg;
  {
    FileSizeLimit limit(16 * 1024);
    msg = error_of([&] { train::save_checkpoint(dir, sample_tensors(), huge); });
  }
  EXPECT_CONTAINS(msg, "[checkpoint] saving " + dir + " failed: [io] " +
                           train::checkpoint_tmp_dir(dir) + "/manifest.json: " + efbig);
  EXPECT_EQ(leftovers(tmp.str()), std::vector<std::string>{});
  EXPECT_EQ(train::load_checkpoint(dir).state["v"], 1);
  EXPECT_EQ(train::latest_checkpoint(tmp.str()), dir);
}

TEST(Checkpoint, NotEnoughFreeSpaceFailsBeforeWriting) {
  TempDir tmp;
  const std::string prev = tmp / "step-1", next = tmp / "step-2";
  train::save_checkpoint(prev, sample_tensors(), {{"step", 1}});
  io::TensorMap t;
  t["w"] = Tensor::zeros({1000});  // 4000 bytes
  std::string msg, msg_world2;
  {
    FakeFreeBytes free(900);
    msg = error_of([&] { train::save_checkpoint(next, t, {{"step", 2}}); });
    msg_world2 = error_of([&] {
      train::save_checkpoint(next, t, {{"step", 2}}, 0, 2, [](bool ok) { return ok; });
    });
  }
  EXPECT_CONTAINS(msg, "[checkpoint] saving " + next +
                           " failed: not enough free space; it needs about 4.0 kB, 900 B free on "
                           "that filesystem. The previous checkpoints are intact.");
  EXPECT_CONTAINS(msg_world2, "it needs about 8.0 kB, 900 B free");
  // Nothing was written: the run folder holds the previous checkpoint alone.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(tmp.str())) names.push_back(e.path().filename());
  EXPECT_EQ(names, std::vector<std::string>{"step-1"});
  EXPECT_EQ(train::latest_checkpoint(tmp.str()), prev);
  {
    FakeFreeBytes free(4000);  // exactly enough
    train::save_checkpoint(next, t, {{"step", 2}});
  }
  EXPECT_EQ(train::latest_checkpoint(tmp.str()), next);
}

// A rank whose part of the save succeeded learns from the vote that another rank's failed: it
// fails too, with the same message form, and removes the temporary folder; the previous
// checkpoint stays the newest. (Rank 0 of 2 here; the vote says "no" at the second phase, after
// rank 0 wrote its file.)
TEST(Checkpoint, AnotherRanksFailureFailsTheSaveHere) {
  TempDir tmp;
  const std::string prev = tmp / "step-1", next = tmp / "step-2";
  train::save_checkpoint(prev, sample_tensors(), {{"step", 1}});
  int votes = 0;
  const std::string msg = error_of([&] {
    train::save_checkpoint(next, sample_tensors(), {{"step", 2}}, 0, 2, [&](bool ok) {
      ++votes;
      return ok && votes < 2;
    });
  });
  EXPECT_EQ(votes, 2);  // no third phase (the commit) after a failed vote
  EXPECT_CONTAINS(msg, "[checkpoint] saving " + next +
                           " failed: another rank's part of the save failed; it needs about ");
  EXPECT_CONTAINS(msg, "The previous checkpoints are intact.");
  EXPECT_EQ(leftovers(tmp.str()), std::vector<std::string>{});
  EXPECT_FALSE(fs::exists(next));
  EXPECT_EQ(train::latest_checkpoint(tmp.str()), prev);
}

// Manifests whose values have the wrong JSON type (found by tests/fuzz/fuzz_checkpoint's
// harness): each ends in an Error naming the manifest, not in a JSON exception.
TEST(FuzzFindings, ManifestValuesOfTheWrongTypeAreRefused) {
  TempDir tmp;
  const std::string dir = tmp / "step-1";
  train::save_checkpoint(dir, sample_tensors(), {{"step", 1}});
  json good = json::parse(slurp(dir + "/manifest.json"));
  const std::string manifest = dir + "/manifest.json";
  auto error_with = [&](const std::function<void(json&)>& edit) {
    json m = good;
    edit(m);
    dump(manifest, m.dump());
    return error_of([&] { train::load_checkpoint(dir); });
  };
  EXPECT_CONTAINS(error_with([](json& m) { m["format"] = 5; }),
                  manifest + ": not an xmoe checkpoint manifest");
  EXPECT_CONTAINS(error_with([](json& m) { m["version"] = "one"; }),
                  manifest + ": format version \"one\" is not supported");
  EXPECT_CONTAINS(error_with([](json& m) { m["world"] = -1; }),
                  manifest + ": manifest lists 1 files for world -1");
  EXPECT_CONTAINS(error_with([](json& m) { m["files"][0]["name"] = 7; }),
                  manifest + ": malformed files entry");
  EXPECT_CONTAINS(error_with([](json& m) { m["files"][0]["bytes"] = "216"; }),
                  "malformed files entry");
  EXPECT_CONTAINS(error_with([](json& m) { m["files"][0]["crc32c"] = 0; }),
                  "malformed files entry");
  EXPECT_CONTAINS(error_with([](json& m) { m["files"][0]["rank"] = 3; }), "a rank below world 1");
  dump(manifest, good.dump());
  EXPECT_NO_THROW(train::load_checkpoint(dir));
}
