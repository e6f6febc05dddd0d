#include "xmoe/data/prepare.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <thread>

#include "xmoe/core/error.h"
#include "xmoe/data/token_file.h"
#include "xmoe/data/tokenizer.h"
#include "xmoe/io/file.h"

namespace xmoe::data {

namespace fs = std::filesystem;

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

// The name of a tokenizer's copy in a prepared folder.
std::string tokenizer_copy_name(const std::string& kind) {
  return kind == "sentencepiece" ? "tokenizer.model" : "tokenizer.json";
}

/// Work for one tokenising thread: consecutive pieces of the corpus, encoded in one call.
struct WorkItem {
  std::vector<TextPiece> pieces;
  size_t bytes = 0;
  std::vector<uint32_t> tokens;
};

/// The corpus as a sequence of work items of about chunk_bytes, file after file.
class CorpusStream {
 public:
  CorpusStream(const std::vector<std::string>& files, const PrepareOptions& o)
      : files_(files), o_(o) {}

  /// Fills `item` with up to chunk_bytes of text; false when the corpus is exhausted.
  bool next(WorkItem& item) {
    item = WorkItem{};
    TextPiece piece;
    while (item.bytes < o_.chunk_bytes) {
      if (!reader_) {
        if (file_ == files_.size()) break;
        reader_.emplace(files_[file_++], o_.text_field, o_.chunk_bytes);
      }
      const int64_t before = reader_->bytes_read();
      if (!reader_->next(piece)) {
        reader_.reset();
        continue;
      }
      bytes_ += reader_->bytes_read() - before;
      if (piece.ends_document) ++documents_;
      item.bytes += piece.text.size();
      const bool full_chunk = !piece.ends_document;  // a text file's piece of ~chunk_bytes
      item.pieces.push_back(std::move(piece));
      if (full_chunk) break;
    }
    return !item.pieces.empty();
  }
  int64_t bytes() const { return bytes_; }
  int64_t documents() const { return documents_; }

 private:
  const std::vector<std::string>& files_;
  const PrepareOptions& o_;
  size_t file_ = 0;
  std::optional<DocumentReader> reader_;
  int64_t bytes_ = 0, documents_ = 0;
};

void encode_item(const Tokenizer& tok, WorkItem& item) {
  std::vector<std::string> texts;
  texts.reserve(item.pieces.size());
  for (TextPiece& p : item.pieces) texts.push_back(std::move(p.text));
  std::vector<std::vector<uint32_t>> ids = tok.encode_batch(texts);
  size_t n = 0;
  for (const auto& v : ids) n += v.size() + 1;
  // One piece (a text file's chunk): its ids are the tokens, not copied.
  if (ids.size() == 1) ids[0].reserve(n);
  if (ids.size() == 1) item.tokens = std::move(ids[0]);
  item.tokens.reserve(n);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids.size() > 1) item.tokens.insert(item.tokens.end(), ids[i].begin(), ids[i].end());
    // An empty document adds nothing, not even its end.
    const bool empty_document = texts[i].empty() && (i == 0 || item.pieces[i - 1].ends_document);
    if (item.pieces[i].ends_document && tok.eos_id() >= 0 && !empty_document)
      item.tokens.push_back(static_cast<uint32_t>(tok.eos_id()));
  }
  item.pieces.clear();
}

/// Writes tokens as little-endian uint16 or uint32 (x86-64/aarch64 hosts are little-endian),
/// checking each against the vocabulary.
class TokenWriter {
 public:
  TokenWriter(const std::string& path, const std::string& name, TokenDType dtype, int64_t vocab)
      : out_(path, name), dtype_(dtype), vocab_(vocab), name_(name) {}
  void write(const std::vector<uint32_t>& tokens) {
    for (uint32_t t : tokens)
      XMOE_CHECK(static_cast<int64_t>(t) < vocab_,
                 "[data] the tokenizer gave id {} at token {}, outside its vocabulary ({})", t,
                 count_, vocab_);
    if (dtype_ == TokenDType::u32) {
      out_.write(tokens.data(), tokens.size() * 4);
    } else {
      narrow_.assign(tokens.begin(), tokens.end());
      out_.write(narrow_.data(), narrow_.size() * 2);
    }
    count_ += static_cast<int64_t>(tokens.size());
  }
  void close() { out_.close(); }
  int64_t count() const { return count_; }

 private:
  io::OutputFile out_;
  TokenDType dtype_;
  int64_t vocab_;
  std::string name_;
  std::vector<uint16_t> narrow_;
  int64_t count_ = 0;
};

/// "\r[prepare] 12.3 MB, 4.56M tokens, 7.8 MB/s" on stderr, at most twice a second.
class ProgressLine {
 public:
  explicit ProgressLine(bool on) : on_(on), start_(Clock::now()), last_(start_) {}
  void update(int64_t bytes, int64_t tokens, bool final = false) {
    if (!on_) return;
    const auto now = Clock::now();
    if (!final && now - last_ < std::chrono::milliseconds(500)) return;
    last_ = now;
    const double s = std::max(1e-9, std::chrono::duration<double>(now - start_).count());
    std::fprintf(stderr, "\r[prepare] %.1f MB, %.2fM tokens, %.1f MB/s%s", bytes / 1e6,
                 tokens / 1e6, bytes / 1e6 / s, final ? "\n" : "");
    std::fflush(stderr);
  }

 private:
  using Clock = std::chrono::steady_clock;
  bool on_;
  Clock::time_point start_, last_;
};

/// Temporary files removed unless released: an interrupted prepare leaves none behind.
struct TempFiles {
  std::vector<std::string> paths;
  ~TempFiles() {
    std::error_code ec;
    for (const std::string& p : paths) fs::remove(p, ec);
  }
};

// Copies the last `count` tokens of `from` (which holds `total`) into `to`, then cuts them off
// `from`; both files are fsynced.
void split_tail(const std::string& from, const std::string& to, int64_t total, int64_t count,
                int64_t width, const std::string& name) {
  std::ifstream in(from, std::ios::binary);
  XMOE_CHECK(in, "[data] {}: cannot reopen", from);
  in.seekg((total - count) * width);
  io::OutputFile out(to, name);
  std::vector<char> buf(1 << 20);
  for (int64_t left = count * width; left > 0;) {
    const auto n = static_cast<std::streamsize>(std::min<int64_t>(left, 1 << 20));
    in.read(buf.data(), n);
    XMOE_CHECK(in.gcount() == n, "[data] {}: short read", from);
    out.write(buf.data(), static_cast<size_t>(n));
    left -= n;
  }
  out.close();
  std::error_code ec;
  fs::resize_file(from, static_cast<uintmax_t>((total - count) * width), ec);
  XMOE_CHECK(!ec, "[data] {}: cannot truncate ({})", from, ec.message());
  io::fsync_path(from);
}

}  // namespace

PrepareResult prepare(const PrepareOptions& o) {
  XMOE_CHECK(o.val_fraction >= 0 && o.val_fraction < 1,
             "[data] val_fraction = {:g} is outside [0, 1)", o.val_fraction);
  XMOE_CHECK(o.chunk_bytes > 0, "[data] chunk_bytes must be positive");
  const auto start = std::chrono::steady_clock::now();
  const std::string source = join(o.corpus);
  PrepareResult result;
  result.files = list_corpus(o.corpus, &result.skipped);
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(o.tokenizer);
  const std::string kind = tok->name();
  std::vector<std::string> names(std::begin(kTokenFiles), std::end(kTokenFiles));
  if (kind != "byte") names.push_back(tokenizer_copy_name(kind));
  std::vector<std::string> found;
  for (const std::string& name : names)
    if (present(fs::path(o.out_dir) / name)) found.push_back(name);
  XMOE_CHECK(o.overwrite || found.empty(),
             "[data] {} already holds {}; xmoe prepare will not write over them: pass "
             "--overwrite (xmoe prepare) to replace them, or choose another folder",
             o.out_dir, join(found));

  std::error_code ec;
  // A refused corpus leaves nothing behind, not even the folder this call made.
  struct MadeFolder {
    std::string path;
    bool done = false;
    ~MadeFolder() {
      std::error_code e;
      if (!done && !path.empty()) fs::remove(path, e);  // only when empty
    }
  } made_folder{present(o.out_dir) ? "" : o.out_dir};
  fs::create_directories(o.out_dir, ec);
  XMOE_CHECK(!ec, "[data] cannot create {}: {}", o.out_dir, ec.message());
  const fs::path dir(o.out_dir);
  const std::string train = (dir / "train.bin").string(), val = (dir / "val.bin").string();
  const std::string meta_path = (dir / "meta.json").string();
  const std::string suffix = fmt::format(".tmp-{}", ::getpid());
  TempFiles temps{{train + suffix, val + suffix}};

  result.vocab_size = tok->vocab_size();
  const TokenDType dtype = result.vocab_size <= 65536 ? TokenDType::u16 : TokenDType::u32;
  result.dtype = token_dtype_name(dtype);
  const int64_t width = dtype == TokenDType::u16 ? 2 : 4;
  const int workers = o.workers > 0
                          ? o.workers
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  // Rounds of `workers` items: read in corpus order, tokenise in parallel, write in order. At
  // most `workers` chunks of text and their tokens are held at once.
  TokenWriter writer(train + suffix, train, dtype, result.vocab_size);
  CorpusStream stream(result.files, o);
  ProgressLine progress(o.progress);
  std::vector<WorkItem> items(static_cast<size_t>(workers));
  for (bool more = true; more;) {
    size_t n = 0;
    while (n < items.size() && (more = stream.next(items[n]))) ++n;
    std::vector<std::exception_ptr> errors(n);
    // OpenMP's threads persist across rounds, so each keeps its malloc arena: memory stays flat.
#pragma omp parallel for num_threads(workers) schedule(static, 1)
    for (size_t i = 0; i < n; ++i) {
      try {
        encode_item(*tok, items[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
    for (size_t i = 0; i < n; ++i) {
      if (errors[i]) std::rethrow_exception(errors[i]);
      writer.write(items[i].tokens);
      items[i].tokens = {};
    }
    progress.update(stream.bytes(), writer.count());
  }
  writer.close();
  progress.update(stream.bytes(), writer.count(), /*final=*/true);
  result.bytes = stream.bytes();
  result.documents = stream.documents();

  const int64_t n = writer.count();
  XMOE_CHECK(n > 0, "[data] corpus {} holds no text ({} bytes in {} file{})", source, result.bytes,
             result.files.size(), result.files.size() == 1 ? "" : "s");
  result.val_tokens = static_cast<int64_t>(static_cast<double>(n) * o.val_fraction);
  result.train_tokens = n - result.val_tokens;
  XMOE_CHECK(o.val_fraction == 0 || result.val_tokens > 0,
             "[data] corpus {} has only {} tokens: val_fraction = {:g} leaves the validation "
             "split empty (it needs at least {:.0f} tokens); add text or set val_fraction to 0",
             source, n, o.val_fraction, std::ceil(1 / o.val_fraction));
  split_tail(train + suffix, val + suffix, n, result.val_tokens, width, val);

  // Overwriting: the old meta.json goes first, so that an interrupted run leaves token files
  // without meta.json (refused by ensure_prepared) rather than a meta.json describing others.
  if (o.overwrite && present(meta_path)) {
    fs::remove(meta_path, ec);
    XMOE_CHECK(!ec, "[data] cannot remove {}: {}", meta_path, ec.message());
    io::fsync_path(o.out_dir);
  }
  fs::rename(train + suffix, train);
  fs::rename(val + suffix, val);
  io::fsync_path(o.out_dir);
  nlohmann::json tokenizer = {{"kind", kind},
                              {"vocab_size", result.vocab_size},
                              {"eos_id", tok->eos_id()},
                              {"bos_id", tok->bos_id()}};
  if (kind != "byte") {
    const std::string copy = tokenizer_copy_name(kind);
    io::write_file_atomic((dir / copy).string(), io::read_file(o.tokenizer));
    tokenizer["file"] = copy;
    tokenizer["source"] = fs::absolute(o.tokenizer).lexically_normal().string();
  }
  const nlohmann::json meta = {
      {"vocab_size", result.vocab_size},
      {"dtype", result.dtype},
      {"tokenizer", tokenizer},
      {"source", source},
      {"files", result.files},
      {"text_field", o.text_field},
      {"documents", result.documents},
      {"val_fraction", o.val_fraction},
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
  made_folder.done = true;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

PrepareResult prepare(const std::string& corpus_path, const std::string& out_dir,
                      double val_fraction, bool overwrite) {
  PrepareOptions o;
  o.corpus = {corpus_path};
  o.out_dir = out_dir;
  o.val_fraction = val_fraction;
  o.overwrite = overwrite;
  return prepare(o);
}

namespace {

nlohmann::json read_meta(const std::string& meta_path) {
  try {
    return nlohmann::json::parse(io::read_file(meta_path));
  } catch (const nlohmann::json::exception& e) {
    XMOE_FAIL("[data] {}: invalid JSON ({})", meta_path, e.what());
  }
}

// meta.json's tokenizer kind: the object's "kind", or the old string form ("byte").
std::string tokenizer_kind_of(const nlohmann::json& m) {
  if (!m.contains("tokenizer")) return "byte";
  const nlohmann::json& t = m["tokenizer"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("kind") && t["kind"].is_string())
    return t["kind"].get<std::string>();
  return "byte";
}

}  // namespace

std::string prepared_tokenizer(const std::string& data_dir) {
  const fs::path meta_path = fs::path(data_dir) / "meta.json";
  if (!fs::is_regular_file(meta_path)) return "";
  const nlohmann::json m = read_meta(meta_path.string());
  if (!m.is_object() || tokenizer_kind_of(m) == "byte") return "";
  const nlohmann::json& t = m["tokenizer"];
  XMOE_CHECK(t.is_object() && t.contains("file") && t["file"].is_string(),
             "[data] {}: tokenizer {} names no file", meta_path.string(), t.dump());
  const fs::path file = fs::path(data_dir) / t["file"].get<std::string>();
  XMOE_CHECK(fs::is_regular_file(file),
             "[data] {}: the tokenizer file {} is missing (prepare the data again)",
             meta_path.string(), file.string());
  return file.string();
}

namespace {

// meta.json of a folder holding train.bin and val.bin: vocabulary, dtype, tokenizer, token
// counts and source.
PreparedData read_prepared_meta(const fs::path& dir) {
  PreparedData out;
  const std::string meta_path = (dir / "meta.json").string();
  const nlohmann::json m = read_meta(meta_path);
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
  out.tokenizer = tokenizer_kind_of(m);
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

  out.tokenizer_file = prepared_tokenizer(dir.string());
  return out;
}

}  // namespace

PreparedData ensure_prepared(const DataConfig& data) {
  const fs::path dir(data.dir);
  const bool train = present(dir / "train.bin"), val = present(dir / "val.bin");
  const bool meta = present(dir / "meta.json");

  if (!train && !val && !meta) {
    PreparedData out;
    spdlog::info("preparing corpus {} into {}", data.corpus, data.dir);
    const PrepareResult r = prepare(data.corpus, data.dir, data.val_fraction);
    spdlog::info("prepared {} train / {} validation tokens from {} files", r.train_tokens,
                 r.val_tokens, r.files.size());
    out.prepared = true;
    out.source = data.corpus;
    out.train_tokens = r.train_tokens;
    out.val_tokens = r.val_tokens;
    out.vocab_size = r.vocab_size;
    out.dtype = r.dtype;
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

  PreparedData out = read_prepared_meta(dir);

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

namespace xmoe::data {

std::vector<PreparedData> prepared_mix(const std::vector<DataMixEntry>& mix) {
  std::vector<PreparedData> sets;
  for (const DataMixEntry& e : mix) {
    const fs::path dir(e.dir);
    std::vector<std::string> missing;
    for (const char* f : {"train.bin", "val.bin", "meta.json"})
      if (!present(dir / f)) missing.push_back(f);
    XMOE_CHECK(missing.empty(),
               "[data] data.mix entry {} lacks {}: each folder of a mix must be prepared first "
               "(`xmoe prepare --corpus ... --out {}`)",
               e.dir, fmt::join(missing, ", "), e.dir);
    sets.push_back(read_prepared_meta(dir));
    const PreparedData& a = sets.front();
    const PreparedData& b = sets.back();
    // Same kind, vocabulary and tokenizer file bytes: the ids mean the same in every set.
    const std::string why = a.tokenizer != b.tokenizer     ? "tokenizer kinds"
                            : a.vocab_size != b.vocab_size ? "vocabulary sizes"
                            : !a.tokenizer_file.empty() && io::read_file(a.tokenizer_file) !=
                                                               io::read_file(b.tokenizer_file)
                                ? "tokenizer files"
                                : "";
    XMOE_CHECK(why.empty(),
               "[data] data.mix: {} ({} tokenizer{}, vocab_size {}) and {} ({} tokenizer{}, "
               "vocab_size {}) differ in their {}; a mix needs folders prepared with one "
               "tokenizer",
               mix.front().dir, a.tokenizer, a.tokenizer_file.empty() ? "" : " " + a.tokenizer_file,
               a.vocab_size, e.dir, b.tokenizer,
               b.tokenizer_file.empty() ? "" : " " + b.tokenizer_file, b.vocab_size, why);
  }
  return sets;
}

}  // namespace xmoe::data
