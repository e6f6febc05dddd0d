#include "xmoe/data/corpus.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "xmoe/core/error.h"

namespace xmoe::data {

namespace fs = std::filesystem;

namespace {

// Whether the file holds a NUL byte, read in blocks so a large file is never held whole.
bool holds_nul(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  XMOE_CHECK(in, "[data] {}: cannot open for reading", p.string());
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto n = static_cast<size_t>(in.gcount());
    if (std::find(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(n), '\0') !=
        buf.begin() + static_cast<std::ptrdiff_t>(n))
      return true;
  }
  return false;
}

}  // namespace

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
    } else if (holds_nul(p)) {
      skip(p, "binary");
    } else {
      files.push_back(p.string());
    }
  }
  XMOE_CHECK(!files.empty(), "[data] corpus {} contains no text files", corpus_path);
  return files;
}

std::vector<std::string> list_corpus(const std::vector<std::string>& paths,
                                     std::vector<std::string>* skipped) {
  XMOE_CHECK(!paths.empty(), "[data] no corpus given");
  std::vector<std::string> files;
  for (const std::string& p : paths) {
    const std::vector<std::string> f = list_corpus_files(p, skipped);
    files.insert(files.end(), f.begin(), f.end());
  }
  return files;
}

DocumentReader::DocumentReader(std::string path, std::string text_field, size_t chunk_bytes)
    : path_(std::move(path)),
      text_field_(std::move(text_field)),
      chunk_bytes_(std::max<size_t>(chunk_bytes, 4)),
      jsonl_(fs::path(path_).extension() == ".jsonl"),
      in_(path_, std::ios::binary) {
  XMOE_CHECK(in_, "[data] {}: cannot open for reading", path_);
}

bool DocumentReader::next(TextPiece& piece) {
  return jsonl_ ? next_json(piece) : next_text(piece);
}

bool DocumentReader::next_text(TextPiece& piece) {
  if (eof_ && carry_.empty()) return false;
  std::string buf = std::move(carry_);
  carry_.clear();
  if (!eof_ && buf.size() < chunk_bytes_) {
    const size_t have = buf.size();
    buf.resize(chunk_bytes_);
    in_.read(buf.data() + have, static_cast<std::streamsize>(chunk_bytes_ - have));
    const auto got = static_cast<size_t>(in_.gcount());
    buf.resize(have + got);
    bytes_read_ += static_cast<int64_t>(got);
    if (!in_) {
      XMOE_CHECK(in_.eof(), "[data] {}: read error", path_);
      eof_ = true;
    }
  }
  if (!eof_) {
    // Cut after the last line end that a non-space follows (a pre-token boundary of byte-level
    // BPE patterns), else after the last line end; with none, before the last UTF-8 lead byte.
    size_t cut = buf.rfind('\n');
    for (size_t at = cut; at != std::string::npos && at > 0; at = buf.rfind('\n', at - 1)) {
      if (at + 1 < buf.size() && !std::isspace(static_cast<unsigned char>(buf[at + 1]))) {
        cut = at;
        break;
      }
    }
    if (cut != std::string::npos) {
      ++cut;
    } else {
      cut = buf.size();
      while (cut > 1 && (static_cast<unsigned char>(buf[cut - 1]) & 0xC0) == 0x80) --cut;
      if (static_cast<unsigned char>(buf[cut - 1]) >= 0xC0) --cut;
      if (cut == 0) cut = buf.size();
    }
    carry_.assign(buf, cut, std::string::npos);
    buf.resize(cut);
  }
  piece.text = std::move(buf);
  piece.ends_document = eof_ && carry_.empty();
  return true;
}

bool DocumentReader::next_json(TextPiece& piece) {
  std::string line;
  while (std::getline(in_, line)) {
    ++line_;
    bytes_read_ += static_cast<int64_t>(line.size()) + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      XMOE_FAIL("[data] {}:{}: not a JSON line ({})", path_, line_, e.what());
    }
    XMOE_CHECK(j.is_object() && j.contains(text_field_) && j[text_field_].is_string(),
               "[data] {}:{}: no string field \"{}\" (--text-field names the field that holds "
               "the text)",
               path_, line_, text_field_);
    piece.text = j[text_field_].get<std::string>();
    piece.ends_document = true;
    return true;
  }
  XMOE_CHECK(in_.eof(), "[data] {}: read error", path_);
  return false;
}

}  // namespace xmoe::data
