#include "xmoe/data/prepare.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>

#include "xmoe/core/error.h"
#include "xmoe/data/token_file.h"
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

namespace {

constexpr const char* kTokenFiles[] = {"train.bin", "val.bin", "meta.json"};

// True for anything under that name, a dangling symlink included: it is not ours to replace.
bool present(const fs::path& p) {
  std::error_code ec;
  return fs::symlink_status(p, ec).type() != fs::file_type::not_found;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

}  // namespace

PrepareResult prepare(const std::string& corpus_path, const std::string& out_dir,
                      double val_fraction, bool overwrite) {
  XMOE_CHECK(val_fraction >= 0 && val_fraction < 1, "[data] val_fraction = {:g} is outside [0, 1)",
             val_fraction);
  PrepareResult result;
  result.files = list_corpus_files(corpus_path, &result.skipped);
  std::vector<std::string> found;
  for (const char* name : kTokenFiles)
    if (present(fs::path(out_dir) / name)) found.push_back(name);
  XMOE_CHECK(overwrite || found.empty(),
             "[data] {} already holds {}; xmoe prepare will not write over them: pass "
             "--overwrite (xmoe prepare) to replace them, or choose another folder",
             out_dir, join(found));
  std::string text;
  for (const std::string& f : result.files) text += io::read_file(f);
  XMOE_CHECK(!text.empty(), "[data] corpus {} holds no text (0 bytes in {} file{})", corpus_path,
             result.files.size(), result.files.size() == 1 ? "" : "s");
  const std::vector<uint16_t> tokens = ByteTokenizer::encode(text);
  const auto n = static_cast<int64_t>(tokens.size());
  result.val_tokens = static_cast<int64_t>(static_cast<double>(n) * val_fraction);
  result.train_tokens = n - result.val_tokens;
  XMOE_CHECK(val_fraction == 0 || result.val_tokens > 0,
             "[data] corpus {} has only {} tokens: val_fraction = {:g} leaves the validation "
             "split empty (it needs at least {:.0f} tokens); add text or set val_fraction to 0",
             corpus_path, n, val_fraction, std::ceil(1 / val_fraction));

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  XMOE_CHECK(!ec, "[data] cannot create {}: {}", out_dir, ec.message());
  const std::string train = (fs::path(out_dir) / "train.bin").string();
  const std::string val = (fs::path(out_dir) / "val.bin").string();
  const std::string meta_path = (fs::path(out_dir) / "meta.json").string();
  // Overwriting: the old meta.json goes first, so that an interrupted run leaves token files
  // without meta.json (refused by ensure_prepared) rather than a meta.json describing others.
  if (overwrite && present(meta_path)) {
    fs::remove(meta_path, ec);
    XMOE_CHECK(!ec, "[data] cannot remove {}: {}", meta_path, ec.message());
    io::fsync_path(out_dir);
  }
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
  io::write_file_atomic(meta_path, meta.dump(2) + "\n");
  return result;
}

PreparedData ensure_prepared(const DataConfig& data) {
  const fs::path dir(data.dir);
  const bool train = present(dir / "train.bin"), val = present(dir / "val.bin");
  const bool meta = present(dir / "meta.json");
  PreparedData out;

  if (!train && !val && !meta) {
    spdlog::info("preparing corpus {} into {}", data.corpus, data.dir);
    const PrepareResult r = prepare(data.corpus, data.dir, data.val_fraction);
    spdlog::info("prepared {} train / {} validation tokens from {} files", r.train_tokens,
                 r.val_tokens, r.files.size());
    out.prepared = true;
    out.source = data.corpus;
    out.train_tokens = r.train_tokens;
    out.val_tokens = r.val_tokens;
    out.vocab_size = ByteTokenizer::kVocabSize;
    out.dtype = "uint16";
    return out;
  }

  // Something is there: it is the user's, so nothing below writes to the folder.
  const std::string redo = fmt::format(
      "prepare again with `xmoe prepare --corpus {} --out {} --overwrite`, or set data.dir to an "
      "empty folder",
      data.corpus, data.dir);
  XMOE_CHECK(train || val,
             "[data] data.dir {} holds meta.json but neither train.bin nor val.bin; xmoe will not "
             "prepare over it: {}",
             data.dir, redo);
  XMOE_CHECK(train && val,
             "[data] data.dir {} holds {} but no {}; xmoe will not prepare over it: {}", data.dir,
             train ? "train.bin" : "val.bin", train ? "val.bin" : "train.bin", redo);
  XMOE_CHECK(meta,
             "[data] data.dir {} holds train.bin and val.bin but no meta.json; xmoe will not "
             "prepare over them. If they are your tokens, write {} with the fields vocab_size "
             "(e.g. 256) and dtype (uint16 or uint32); otherwise {}",
             data.dir, (dir / "meta.json").string(), redo);

  const std::string meta_path = (dir / "meta.json").string();
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(io::read_file(meta_path));
  } catch (const nlohmann::json::exception& e) {
    XMOE_FAIL("[data] {}: invalid JSON ({})", meta_path, e.what());
  }
  XMOE_CHECK(m.is_object(), "[data] {}: expected a JSON object with vocab_size and dtype",
             meta_path);
  XMOE_CHECK(m.contains("vocab_size") && m["vocab_size"].is_number_integer() &&
                 m["vocab_size"].get<int64_t>() > 0,
             "[data] {}: vocab_size is {}; it must be a positive integer", meta_path,
             m.contains("vocab_size") ? m["vocab_size"].dump() : "missing");
  XMOE_CHECK(m.contains("dtype") && (m["dtype"] == "uint16" || m["dtype"] == "uint32"),
             "[data] {}: dtype is {}; it must be \"uint16\" or \"uint32\"", meta_path,
             m.contains("dtype") ? m["dtype"].dump() : "missing");
  out.vocab_size = m["vocab_size"].get<int64_t>();
  out.dtype = m["dtype"].get<std::string>();
  const int64_t width = parse_token_dtype(out.dtype) == TokenDType::u16 ? 2 : 4;
  // Counted from the sizes, which a meta.json written by hand may not give; TokenFile::open
  // checks each file in full later.
  auto tokens_in = [&](const char* name) {
    std::error_code ec;
    const auto bytes = fs::file_size(dir / name, ec);
    XMOE_CHECK(!ec, "[data] {}: cannot read its size ({})", (dir / name).string(), ec.message());
    return static_cast<int64_t>(bytes) / width;
  };
  out.train_tokens = tokens_in("train.bin");
  out.val_tokens = tokens_in("val.bin");
  if (m.contains("source") && m["source"].is_string()) out.source = m["source"].get<std::string>();

  if (out.source.empty())
    spdlog::info(
        "using the token files in {} (meta.json names no source corpus; data.corpus {} "
        "is not read)",
        data.dir, data.corpus);
  else if (out.source != data.corpus)
    spdlog::info(
        "using the token files in {}: they came from {}, not data.corpus {} (prepared "
        "folders are never re-prepared)",
        data.dir, out.source, data.corpus);
  return out;
}

}  // namespace xmoe::data
