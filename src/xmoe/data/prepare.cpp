#include "xmoe/data/prepare.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>

#include "xmoe/core/error.h"
#include "xmoe/data/tokenizer.h"
#include "xmoe/io/file.h"

namespace xmoe::data {

namespace fs = std::filesystem;

std::vector<std::string> list_corpus_files(const std::string& corpus_path,
                                           std::vector<std::string>* skipped) {
  std::error_code ec;
  const auto st = fs::status(corpus_path, ec);
  XMOE_CHECK(!ec && fs::exists(st), "[data] corpus {} does not exist", corpus_path);
  if (fs::is_regular_file(st)) return {corpus_path};
  XMOE_CHECK(fs::is_directory(st), "[data] corpus {} is neither a file nor a folder", corpus_path);

  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(corpus_path)) entries.push_back(e.path());
  std::sort(entries.begin(), entries.end());
  std::vector<std::string> files;
  auto skip = [&](const fs::path& p, const char* why) {
    if (skipped) skipped->push_back(fmt::format("{} ({})", p.string(), why));
  };
  for (const fs::path& p : entries) {
    const auto s = fs::symlink_status(p);
    if (fs::is_symlink(s)) {
      skip(p, "symlink");
    } else if (!fs::is_regular_file(s)) {
      skip(p, "not a regular file");
    } else if (p.extension() == ".dat") {
      skip(p, "index file");
    } else if (io::read_file(p.string()).find('\0') != std::string::npos) {
      skip(p, "binary");
    } else {
      files.push_back(p.string());
    }
  }
  XMOE_CHECK(!files.empty(), "[data] corpus {} contains no text files", corpus_path);
  return files;
}

namespace {

// Writes tokens as little-endian uint16 (x86-64/aarch64 hosts are little-endian).
void write_tokens(const std::string& path, const uint16_t* tokens, size_t n) {
  io::write_file_atomic(path, std::string_view(reinterpret_cast<const char*>(tokens), n * 2));
}

}  // namespace

PrepareResult prepare(const std::string& corpus_path, const std::string& out_dir,
                      double val_fraction) {
  XMOE_CHECK(val_fraction >= 0 && val_fraction < 1, "[data] val_fraction = {} is outside [0, 1)",
             val_fraction);
  PrepareResult result;
  result.files = list_corpus_files(corpus_path, &result.skipped);
  std::string text;
  for (const std::string& f : result.files) text += io::read_file(f);
  const std::vector<uint16_t> tokens = ByteTokenizer::encode(text);
  const auto n = static_cast<int64_t>(tokens.size());
  result.val_tokens = static_cast<int64_t>(static_cast<double>(n) * val_fraction);
  result.train_tokens = n - result.val_tokens;

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  XMOE_CHECK(!ec, "[data] cannot create {}: {}", out_dir, ec.message());
  const std::string train = (fs::path(out_dir) / "train.bin").string();
  const std::string val = (fs::path(out_dir) / "val.bin").string();
  write_tokens(train, tokens.data(), static_cast<size_t>(result.train_tokens));
  write_tokens(val, tokens.data() + result.train_tokens, static_cast<size_t>(result.val_tokens));

  nlohmann::json meta = {
      {"vocab_size", ByteTokenizer::kVocabSize},
      {"dtype", "uint16"},
      {"tokenizer", "byte"},
      {"source", corpus_path},
      {"files", result.files},
      {"val_fraction", val_fraction},
      {"train",
       {{"file", "train.bin"},
        {"tokens", result.train_tokens},
        {"crc32c", io::crc32c_hex(io::file_crc32c(train))}}},
      {"val",
       {{"file", "val.bin"},
        {"tokens", result.val_tokens},
        {"crc32c", io::crc32c_hex(io::file_crc32c(val))}}},
  };
  io::write_file_atomic((fs::path(out_dir) / "meta.json").string(), meta.dump(2) + "\n");
  return result;
}

}  // namespace xmoe::data
