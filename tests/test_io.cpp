// io/file.h: writers that check every call. Full disks are simulated with RLIMIT_FSIZE
// (file_size_limit.h): the failing write is a real one, and no test depends on the machine's disk.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "file_size_limit.h"
#include "testing.h"
#include "xmoe/core/error.h"
#include "xmoe/io/file.h"
#include "xmoe/io/safetensors.h"

using namespace xmoe;
using xmoe::testing::error_of;
using xmoe::testing::FileSizeLimit;
using xmoe::testing::TempDir;
namespace fs = std::filesystem;

namespace {

std::set<std::string> names_in(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

const std::string efbig = fmt::format("write failed ({})", std::strerror(EFBIG));

}  // namespace

TEST(WriteFileAtomic, ReplacesContent) {
  TempDir tmp;
  const std::string path = tmp / "config.yaml";
  io::write_file_atomic(path, "a: 1\n");
  io::write_file_atomic(path, "a: 2\n");
  EXPECT_EQ(io::read_file(path), "a: 2\n");
  EXPECT_EQ(names_in(tmp.str()), std::set<std::string>{"config.yaml"});
  EXPECT_CONTAINS(error_of([&] { io::write_file_atomic(tmp / "missing/x.yaml", "x"); }),
                  "[io] " + (tmp / "missing/x.yaml") + ": cannot open for writing");
}

TEST(WriteFileAtomic, FullDiskKeepsPreviousContentAndLeavesNoTmp) {
  TempDir tmp;
  const std::string path = tmp / "config.yaml", fresh = tmp / "new.yaml";
  io::write_file_atomic(path, "previous\n");
  std::string msg, msg_fresh;
  {
    FileSizeLimit limit(64);
    msg = error_of([&] { io::write_file_atomic(path, std::string(4096, 'x')); });
    msg_fresh = error_of([&] { io::write_file_atomic(fresh, std::string(4096, 'x')); });
  }
  EXPECT_CONTAINS(msg, "[io] " + path + ": " + efbig);
  EXPECT_CONTAINS(msg_fresh, "[io] " + fresh + ": " + efbig);
  EXPECT_EQ(io::read_file(path), "previous\n");
  EXPECT_EQ(names_in(tmp.str()), std::set<std::string>{"config.yaml"});  // no .tmp-<pid>
}

TEST(AppendFile, AppendsLinesAcrossReopens) {
  TempDir tmp;
  const std::string path = tmp / "metrics.jsonl";
  {
    io::AppendFile f(path);
    EXPECT_EQ(f.size(), 0);
    f.write_line(R"({"step":1})");
    f.write_line(R"({"step":2})");
    f.sync();
    EXPECT_EQ(f.size(), 22);
    io::AppendFile moved = std::move(f);
    moved.write_line(R"({"step":3})");
    moved.close();
    EXPECT_CONTAINS(error_of([&] { moved.write_line("x"); }), path + ": write after close");
  }
  io::AppendFile again(path);  // a resumed run appends
  EXPECT_EQ(again.size(), 33);
  again.write_line(R"({"step":4})");
  EXPECT_EQ(io::read_file(path), "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n{\"step\":4}\n");
  EXPECT_CONTAINS(error_of([&] { io::AppendFile(tmp / "missing/m.jsonl"); }),
                  "[io] " + (tmp / "missing/m.jsonl") + ": cannot open for appending (" +
                      std::strerror(ENOENT) + ")");
}

TEST(AppendFile, FullDiskLeavesNoPartialLine) {
  TempDir tmp;
  const std::string path = tmp / "metrics.jsonl";
  io::AppendFile f(path);
  f.write_line(R"({"step":1,"loss":2.5})");
  f.write_line(R"({"step":2,"loss":2.4})");
  const std::string before = io::read_file(path);
  ASSERT_EQ(f.size(), static_cast<int64_t>(before.size()));
  std::string msg;
  {
    // Room for part of the next line: the OS stores that part, then refuses the rest.
    FileSizeLimit limit(before.size() + 10);
    msg = error_of([&] { f.write_line(R"({"step":3,"loss":2.3,"tokens_per_s":12345})"); });
  }
  EXPECT_CONTAINS(msg, "[io] " + path + ": " + efbig);
  EXPECT_EQ(io::read_file(path), before);
  EXPECT_EQ(f.size(), static_cast<int64_t>(before.size()));
  // Once there is room again, logging goes on with whole lines.
  f.write_line(R"({"step":3})");
  EXPECT_EQ(io::read_file(path), before + "{\"step\":3}\n");
}

TEST(OutputFile, RemovedUnlessClosed) {
  TempDir tmp;
  {
    io::OutputFile f(tmp / "a.bin");
    f.write("partial");
  }  // e.g. an exception between writes
  EXPECT_FALSE(fs::exists(tmp / "a.bin"));
  io::OutputFile g(tmp / "b.bin", "b (final name)");
  g.write("whole");
  g.close();
  EXPECT_EQ(io::read_file(tmp / "b.bin"), "whole");
  EXPECT_CONTAINS(error_of([&] { g.write("more"); }), "[io] b (final name): write after close");
}

TEST(Safetensors, FullDiskRemovesTheFile) {
  TempDir tmp;
  const std::string path = tmp / "w.safetensors";
  io::TensorMap tensors;
  tensors["w"] = Tensor::zeros({4096});
  std::string msg;
  {
    FileSizeLimit limit(1024);
    msg = error_of([&] { io::save_safetensors(path, tensors); });
  }
  EXPECT_CONTAINS(msg, "[io] " + path + ": " + efbig);
  EXPECT_FALSE(fs::exists(path));
}

TEST(FreeBytes, NearestExistingParentAndTestHook) {
  TempDir tmp;
  const auto here = io::free_bytes(tmp.str());
  ASSERT_TRUE(here.has_value());
  EXPECT_TRUE(io::free_bytes(tmp / "not/yet/created").has_value());
  io::set_free_bytes_for_testing(1234);
  EXPECT_EQ(io::free_bytes(tmp.str()), 1234u);
  io::set_free_bytes_for_testing(std::nullopt);
  EXPECT_TRUE(io::free_bytes(tmp.str()).has_value());
}

TEST(FormatBytes, DecimalUnits) {
  EXPECT_EQ(io::format_bytes(0), "0 B");
  EXPECT_EQ(io::format_bytes(999), "999 B");
  EXPECT_EQ(io::format_bytes(1500), "1.5 kB");
  EXPECT_EQ(io::format_bytes(12'345'678), "12.3 MB");
  EXPECT_EQ(io::format_bytes(999'999), "1.0 MB");
  EXPECT_EQ(io::format_bytes(4'000'000'000), "4.0 GB");
}
