#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "testing.h"
#include "xmoe/core/error.h"
#include "xmoe/data/data_loader.h"
#include "xmoe/data/prepare.h"
#include "xmoe/data/token_file.h"
#include "xmoe/data/tokenizer.h"
#include "xmoe/io/file.h"

using namespace xmoe;
using xmoe::testing::error_of;
using xmoe::testing::TempDir;
using namespace xmoe::data;
namespace fs = std::filesystem;

namespace {

void write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A token file of `n` uint16 tokens with value i % mod.
std::string make_tokens(const TempDir& dir, int64_t n, int mod = 256,
                        const std::string& name = "tokens.bin") {
  std::string bytes;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t v = static_cast<uint16_t>(i % mod);
    bytes.append(reinterpret_cast<const char*>(&v), 2);
  }
  const std::string path = dir / name;
  write(path, bytes);
  return path;
}

// Every file of `dir` (name -> bytes): what a call must leave untouched.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::directory_iterator(dir))
    files[e.path().filename().string()] = io::read_file(e.path().string());
  return files;
}

// Collects what spdlog's default logger prints while alive.
class LogCapture {
 public:
  LogCapture() : previous_(spdlog::default_logger()) {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(text_);
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  }
  ~LogCapture() { spdlog::set_default_logger(previous_); }
  std::string text() const { return text_.str(); }

 private:
  std::shared_ptr<spdlog::logger> previous_;
  std::ostringstream text_;
};

DataConfig data_config(const std::string& corpus, const std::string& dir,
                       float val_fraction = 0.1f) {
  DataConfig d;
  d.corpus = corpus;
  d.dir = dir;
  d.val_fraction = val_fraction;
  return d;
}

}  // namespace

TEST(Data, ByteTokenizerRoundTrip) {
  const std::string text = "Hello, wörld!\n\x01\xff";
  const auto tokens = encode(text);
  ASSERT_EQ(tokens.size(), text.size());
  EXPECT_EQ(tokens[0], 'H');
  EXPECT_EQ(tokens.back(), 255);
  EXPECT_EQ(decode(tokens), text);
  const std::vector<int32_t> bad = {72, 300};
  EXPECT_CONTAINS(error_of([&] { decode(bad); }), "token 300 at position 1");
}

TEST(Data, PrepareSkipsBinaryFilesAndSymlinks) {
  TempDir tmp;
  const fs::path corpus = tmp.path() / "corpus";
  fs::create_directories(corpus);
  write((corpus / "b_second").string(), "second file\n%\nmore\n");
  write((corpus / "a_first").string(), "first file\n%\n");
  write((corpus / "a_first.dat").string(), "index");  // strfile index: skipped by name
  write((corpus / "blob").string(), std::string("bin\0ary", 7));
  fs::create_symlink(corpus / "a_first", corpus / "a_first.u8");
  fs::create_directories(corpus / "off");
  write((corpus / "off" / "nested").string(), "not read\n");

  const std::string out = tmp / "prepared";
  const PrepareResult r = prepare(corpus.string(), out, 0.25);
  ASSERT_EQ(r.files.size(), 2u);
  EXPECT_EQ(fs::path(r.files[0]).filename(), "a_first");
  EXPECT_EQ(fs::path(r.files[1]).filename(), "b_second");
  EXPECT_EQ(r.skipped.size(), 4u);

  const std::string text = "first file\n%\nsecond file\n%\nmore\n";
  const int64_t n = static_cast<int64_t>(text.size());
  EXPECT_EQ(r.val_tokens, static_cast<int64_t>(n * 0.25));
  EXPECT_EQ(r.train_tokens + r.val_tokens, n);

  const TokenFile train = TokenFile::open(out + "/train.bin");
  const TokenFile val = TokenFile::open(out + "/val.bin");
  EXPECT_EQ(train.vocab_size(), 256);
  std::string back;
  for (int64_t i = 0; i < train.size(); ++i) back += static_cast<char>(train[i]);
  for (int64_t i = 0; i < val.size(); ++i) back += static_cast<char>(val[i]);
  EXPECT_EQ(back, text);  // the split is a cut: the last tokens are validation

  const auto meta = nlohmann::json::parse(io::read_file(out + "/meta.json"));
  EXPECT_EQ(meta["vocab_size"], 256);
  EXPECT_EQ(meta["dtype"], "uint16");
  EXPECT_EQ(meta["train"]["tokens"], r.train_tokens);
  EXPECT_EQ(meta["val"]["crc32c"], io::crc32c_hex(io::file_crc32c(out + "/val.bin")));
  for (const auto& e : fs::directory_iterator(out))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();

  // Deterministic: preparing again gives the same bytes.
  prepare(corpus.string(), tmp / "again", 0.25);
  EXPECT_EQ(io::read_file(out + "/train.bin"), io::read_file(tmp / "again/train.bin"));

  // A single file works too.
  EXPECT_EQ(prepare((corpus / "a_first").string(), tmp / "one", 0.0).train_tokens, 13);
  EXPECT_CONTAINS(error_of([&] { prepare(tmp / "nope", out, 0.1); }), "nope");
}

TEST(Data, TruncatedFile) {
  TempDir tmp;
  write(tmp / "train.bin", std::string(1001, 'a'));
  EXPECT_CONTAINS(error_of([&] { TokenFile::open(tmp / "train.bin"); }),
                  "[data] train.bin: 1001 bytes is not a whole number of uint16 tokens "
                  "(truncated file?)");
  TokenFile::Options o;
  o.dtype = TokenDType::u32;
  write(tmp / "train.bin", std::string(1002, 'a'));
  EXPECT_CONTAINS(error_of([&] { TokenFile::open(tmp / "train.bin", o); }), "uint32");
}

TEST(Data, OutOfRangeToken) {
  TempDir tmp;
  const std::string path = make_tokens(tmp, 100, 300, "small.bin");
  TokenFile::Options o;
  o.vocab_size = 256;
  EXPECT_CONTAINS(error_of([&] { TokenFile::open(make_tokens(tmp, 1000, 300, "big.bin"), o); }),
                  "token 256 at offset 256 is >= vocab_size 256");
  o.vocab_size = 300;
  EXPECT_EQ(TokenFile::open(path, o).size(), 100);
  o.min_tokens = 101;
  EXPECT_CONTAINS(error_of([&] { TokenFile::open(path, o); }), "100 tokens, need at least 101");
}

TEST(Data, ChecksumMismatchIsDetected) {
  TempDir tmp;
  write(tmp / "c.txt", std::string(400, 'x'));
  prepare(tmp / "c.txt", tmp / "p", 0.1);
  std::fstream f(tmp / "p/train.bin", std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(10);
  f.put('y');
  f.close();
  EXPECT_CONTAINS(error_of([&] { TokenFile::open(tmp / "p/train.bin"); }), "checksum");
}

TEST(Data, LoaderIsDeterministicAndRankSliced) {
  TempDir tmp;
  const TokenFile file = TokenFile::open(make_tokens(tmp, 5000, 251));
  const int64_t B = 4, T = 16;
  DataLoader one(file, 2 * B, T, 7);
  DataLoader r0(file, B, T, 7, 0, 2), r1(file, B, T, 7, 1, 2);
  for (int step = 0; step < 3; ++step) {
    const Batch g = one.next(), a = r0.next(), b = r1.next();
    ASSERT_EQ(g.inputs.shape(), (Shape{2 * B, T}));
    ASSERT_EQ(g.inputs.dtype(), DType::i32);
    std::vector<int32_t> cat = a.inputs.to_vector<int32_t>();
    const auto bi = b.inputs.to_vector<int32_t>();
    cat.insert(cat.end(), bi.begin(), bi.end());
    EXPECT_EQ(g.inputs.to_vector<int32_t>(), cat);
    // targets are inputs shifted by one token (here: value + 1 mod 251)
    const auto in = g.inputs.to_vector<int32_t>(), tg = g.targets.to_vector<int32_t>();
    for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(tg[i], (in[i] + 1) % 251);
  }
  // Same seed, same batches; another seed, other batches.
  DataLoader again(file, 2 * B, T, 7), other(file, 2 * B, T, 8);
  EXPECT_EQ(again.next().inputs.to_vector<int32_t>(), one.batch_at(0).inputs.to_vector<int32_t>());
  EXPECT_NE(other.next().inputs.to_vector<int32_t>(), one.batch_at(0).inputs.to_vector<int32_t>());
  // Windows stay inside the file.
  for (uint64_t g = 0; g < 1000; ++g) {
    const int64_t s = one.window_start(g);
    EXPECT_TRUE(s >= 0 && s + T + 1 <= file.size());
  }
}

TEST(Data, PositionSaveRestore) {
  TempDir tmp;
  const TokenFile file = TokenFile::open(make_tokens(tmp, 3000, 256));
  DataLoader a(file, 3, 8, 11);
  for (int i = 0; i < 5; ++i) a.next();
  const uint64_t saved = a.position();
  EXPECT_EQ(saved, 5u);
  const auto expect6 = a.next().inputs.to_vector<int32_t>();
  const auto expect7 = a.next().inputs.to_vector<int32_t>();
  DataLoader b(file, 3, 8, 11);
  b.set_position(saved);
  EXPECT_EQ(b.next().inputs.to_vector<int32_t>(), expect6);
  EXPECT_EQ(b.next().inputs.to_vector<int32_t>(), expect7);
  EXPECT_EQ(b.position(), 7u);
}

TEST(Data, EvalWindowsAreFixed) {
  TempDir tmp;
  const TokenFile file = TokenFile::open(make_tokens(tmp, 1000, 256));
  DataLoader one(file, 4, 10, 1), r0(file, 2, 10, 99, 0, 2), r1(file, 2, 10, 99, 1, 2);
  const auto first = one.eval_batch(0).inputs.to_vector<int32_t>();
  EXPECT_EQ(one.eval_batch(0).inputs.to_vector<int32_t>(), first);  // same every eval
  EXPECT_EQ(first[0], 0);
  EXPECT_EQ(first[10], 10);  // window 1 starts at T
  EXPECT_EQ(one.num_eval_batches(), (999 / 10) / 4);
  // Rank slicing and seed independence hold for eval too.
  auto cat = r0.eval_batch(3).inputs.to_vector<int32_t>();
  const auto b = r1.eval_batch(3).inputs.to_vector<int32_t>();
  cat.insert(cat.end(), b.begin(), b.end());
  EXPECT_EQ(one.eval_batch(3).inputs.to_vector<int32_t>(), cat);
}

TEST(Data, LoaderNeedsEnoughTokens) {
  TempDir tmp;
  const TokenFile file = TokenFile::open(make_tokens(tmp, 16, 256));
  EXPECT_CONTAINS(error_of([&] { DataLoader(file, 1, 16, 0); }), "need at least seq_len + 1 = 17");
  EXPECT_NO_THROW(DataLoader(file, 1, 15, 0).next());
}

TEST(Data, DefaultCorpusListsOnlyTextFiles) {
  const std::string corpus = "/usr/share/games/fortunes";
  if (!fs::is_directory(corpus)) GTEST_SKIP() << corpus << " not installed (Debian: fortunes)";
  std::vector<std::string> skipped;
  const auto files = list_corpus_files(corpus, &skipped);
  EXPECT_FALSE(files.empty());
  for (const std::string& f : files) {
    EXPECT_NE(fs::path(f).extension(), ".dat") << f;
    EXPECT_FALSE(fs::is_symlink(f)) << f;
  }
}

// ---- data folders are never written over (issue 38) -------------------------------------

TEST(Data, PrepareRefusesToWriteOverTokenFiles) {
  TempDir tmp;
  write(tmp / "a.txt", std::string(200, 'a'));
  write(tmp / "b.txt", std::string(300, 'b'));
  const std::string out = tmp / "prepared";
  prepare(tmp / "a.txt", out, 0.1);
  const auto before = snapshot(out);

  const std::string e = error_of([&] { prepare(tmp / "b.txt", out, 0.1); });
  EXPECT_CONTAINS(e, out);
  EXPECT_CONTAINS(e, "train.bin, val.bin, meta.json");
  EXPECT_CONTAINS(e, "--overwrite");
  EXPECT_CONTAINS(e, "another folder");
  EXPECT_EQ(snapshot(out), before);

  // Any one of the three is enough to refuse, and the error lists just what is there.
  const std::string only_meta = tmp / "only_meta";
  fs::create_directories(only_meta);
  write(only_meta + "/meta.json", "{}");
  const std::string e2 = error_of([&] { prepare(tmp / "b.txt", only_meta, 0.1); });
  EXPECT_CONTAINS(e2, only_meta + " already holds meta.json;");
  EXPECT_EQ(io::read_file(only_meta + "/meta.json"), "{}");
  EXPECT_FALSE(fs::exists(only_meta + "/train.bin"));
}

TEST(Data, PrepareWithOverwriteReplacesTheTokens) {
  TempDir tmp;
  write(tmp / "a.txt", std::string(200, 'a'));
  write(tmp / "b.txt", std::string(300, 'b'));
  const std::string out = tmp / "prepared";
  prepare(tmp / "a.txt", out, 0.1);
  const PrepareResult r = prepare(tmp / "b.txt", out, 0.1, /*overwrite=*/true);
  EXPECT_EQ(r.train_tokens + r.val_tokens, 300);
  const TokenFile train = TokenFile::open(out + "/train.bin");  // meta.json's CRC matches
  EXPECT_EQ(train.size(), 270);
  EXPECT_EQ(train[0], static_cast<uint32_t>('b'));
  const auto meta = nlohmann::json::parse(io::read_file(out + "/meta.json"));
  EXPECT_EQ(meta["source"], tmp / "b.txt");
  EXPECT_EQ(meta["val"]["tokens"], 30);
  for (const auto& e : fs::directory_iterator(out))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
}

TEST(Data, PrepareRefusesAnEmptyCorpus) {
  TempDir tmp;
  const fs::path corpus = tmp.path() / "corpus";
  fs::create_directories(corpus);
  write((corpus / "one.txt").string(), "");
  write((corpus / "two.txt").string(), "");
  EXPECT_CONTAINS(
      error_of([&] { prepare(corpus.string(), tmp / "out", 0.1); }),
      fmt::format("[data] corpus {} holds no text (0 bytes in 2 files)", corpus.string()));
  EXPECT_CONTAINS(error_of([&] { prepare((corpus / "one.txt").string(), tmp / "out", 0.0); }),
                  "holds no text (0 bytes in 1 file)");
  EXPECT_FALSE(fs::exists(tmp / "out"));  // nothing written, not even the folder
}

TEST(Data, PrepareRefusesAnEmptyValidationSplit) {
  TempDir tmp;
  write(tmp / "short.txt", "ten bytes!");
  const std::string e = error_of([&] { prepare(tmp / "short.txt", tmp / "out", 0.05); });
  EXPECT_CONTAINS(e, tmp / "short.txt");
  EXPECT_CONTAINS(e, "has only 10 tokens");
  EXPECT_CONTAINS(e, "val_fraction = 0.05 leaves the validation split empty");
  EXPECT_CONTAINS(e, "at least 20 tokens");
  EXPECT_FALSE(fs::exists(tmp / "out"));
  // No validation split asked for: 10 tokens are fine.
  EXPECT_EQ(prepare(tmp / "short.txt", tmp / "out", 0.0).train_tokens, 10);
}

TEST(Data, EnsurePreparedPreparesAnEmptyFolderOnce) {
  TempDir tmp;
  write(tmp / "c.txt", std::string(400, 'x'));
  const DataConfig d = data_config(tmp / "c.txt", tmp / "data", 0.25f);
  const PreparedData first = ensure_prepared(d);
  EXPECT_TRUE(first.prepared);
  EXPECT_EQ(first.source, tmp / "c.txt");
  EXPECT_EQ(first.train_tokens, 300);
  EXPECT_EQ(first.val_tokens, 100);
  EXPECT_EQ(first.vocab_size, 256);
  EXPECT_EQ(first.dtype, "uint16");

  const auto before = snapshot(tmp / "data");
  const PreparedData again = ensure_prepared(d);
  EXPECT_FALSE(again.prepared);
  EXPECT_EQ(again.train_tokens, 300);
  EXPECT_EQ(again.val_tokens, 100);
  EXPECT_EQ(snapshot(tmp / "data"), before);

  // An existing empty folder is prepared into too.
  fs::create_directories(tmp / "empty");
  EXPECT_TRUE(ensure_prepared(data_config(tmp / "c.txt", tmp / "empty")).prepared);
}

TEST(Data, EnsurePreparedUsesAForeignFolderAsIs) {
  TempDir tmp;
  write(tmp / "corpus.txt", std::string(1000, 'z'));  // must not be read
  const std::string dir = tmp / "theirs";
  fs::create_directories(dir);
  // Someone else's uint32 tokens, with a hand-written meta.json naming another source.
  std::string train, val;
  for (uint32_t i = 0; i < 50; ++i) train.append(reinterpret_cast<const char*>(&i), 4);
  for (uint32_t i = 0; i < 7; ++i) val.append(reinterpret_cast<const char*>(&i), 4);
  write(dir + "/train.bin", train);
  write(dir + "/val.bin", val);
  write(dir + "/meta.json", R"({"vocab_size": 300, "dtype": "uint32", "source": "webtext"})");
  const auto before = snapshot(dir);

  PreparedData r;
  {
    LogCapture log;
    r = ensure_prepared(data_config(tmp / "corpus.txt", dir));
    EXPECT_CONTAINS(log.text(), "came from webtext");
    EXPECT_CONTAINS(log.text(), dir);
  }
  EXPECT_FALSE(r.prepared);
  EXPECT_EQ(r.source, "webtext");
  EXPECT_EQ(r.train_tokens, 50);
  EXPECT_EQ(r.val_tokens, 7);
  EXPECT_EQ(r.vocab_size, 300);
  EXPECT_EQ(r.dtype, "uint32");
  EXPECT_EQ(snapshot(dir), before);  // same files, same bytes

  // No "source" at all is fine too.
  write(dir + "/meta.json", R"({"vocab_size": 300, "dtype": "uint32"})");
  const auto before2 = snapshot(dir);
  LogCapture log;
  EXPECT_EQ(ensure_prepared(data_config(tmp / "corpus.txt", dir)).source, "");
  EXPECT_CONTAINS(log.text(), "names no source corpus");
  EXPECT_EQ(snapshot(dir), before2);
}

TEST(Data, EnsurePreparedRefusesTokenFilesWithoutMeta) {
  TempDir tmp;
  write(tmp / "corpus.txt", std::string(1000, 'z'));
  const std::string dir = tmp / "tokens";
  fs::create_directories(dir);
  write(dir + "/train.bin", "abcdefgh");
  write(dir + "/val.bin", "ijkl");
  const auto before = snapshot(dir);
  const std::string e = error_of([&] { ensure_prepared(data_config(tmp / "corpus.txt", dir)); });
  EXPECT_CONTAINS(e, dir + " holds train.bin and val.bin but no meta.json");
  EXPECT_CONTAINS(e, "will not prepare over them");
  EXPECT_CONTAINS(e, "vocab_size");
  EXPECT_CONTAINS(e, "dtype (uint16 or uint32)");
  EXPECT_CONTAINS(e, "--overwrite");
  EXPECT_EQ(snapshot(dir), before);  // no meta.json appeared, the tokens are untouched
}

TEST(Data, EnsurePreparedRefusesAPartialFolder) {
  TempDir tmp;
  write(tmp / "corpus.txt", std::string(1000, 'z'));
  const std::string dir = tmp / "partial";
  fs::create_directories(dir);
  auto err = [&] {
    return error_of([&] { ensure_prepared(data_config(tmp / "corpus.txt", dir)); });
  };

  write(dir + "/train.bin", "abcd");
  std::string e = err();
  EXPECT_CONTAINS(e, dir + " holds train.bin but no val.bin");
  EXPECT_EQ(snapshot(dir).size(), 1u);

  fs::remove(dir + "/train.bin");
  write(dir + "/val.bin", "abcd");
  EXPECT_CONTAINS(err(), dir + " holds val.bin but no train.bin");

  fs::remove(dir + "/val.bin");
  write(dir + "/meta.json", "{}");
  e = err();
  EXPECT_CONTAINS(e, dir + " holds meta.json but neither train.bin nor val.bin");
  EXPECT_EQ(snapshot(dir), (std::map<std::string, std::string>{{"meta.json", "{}"}}));
}

TEST(Data, EnsurePreparedChecksMetaJson) {
  TempDir tmp;
  const std::string dir = tmp / "d";
  fs::create_directories(dir);
  write(dir + "/train.bin", "abcd");
  write(dir + "/val.bin", "ab");
  const DataConfig d = data_config(tmp / "nothing.txt", dir);
  const std::string meta = dir + "/meta.json";

  write(meta, "{not json");
  std::string e = error_of([&] { ensure_prepared(d); });
  EXPECT_CONTAINS(e, meta);
  EXPECT_CONTAINS(e, "invalid JSON");
  write(meta, R"({"dtype": "uint16"})");
  e = error_of([&] { ensure_prepared(d); });
  EXPECT_CONTAINS(e, meta + ": vocab_size is missing");
  write(meta, R"({"vocab_size": "big", "dtype": "uint16"})");
  EXPECT_CONTAINS(error_of([&] { ensure_prepared(d); }), "vocab_size is \"big\"");
  write(meta, R"({"vocab_size": 256})");
  EXPECT_CONTAINS(error_of([&] { ensure_prepared(d); }), meta + ": dtype is missing");
  write(meta, R"({"vocab_size": 256, "dtype": "int8"})");
  EXPECT_CONTAINS(error_of([&] { ensure_prepared(d); }), meta + ": dtype is \"int8\"");
  write(meta, R"({"vocab_size": 256, "dtype": "uint16"})");
  EXPECT_EQ(ensure_prepared(d).train_tokens, 2);
}

namespace {

std::vector<uint32_t> read_ids(const std::string& path) {
  TokenFile::Options o;
  o.min_tokens = 0;
  const TokenFile f = TokenFile::open(path, o);
  std::vector<uint32_t> ids(static_cast<size_t>(f.size()));
  for (int64_t i = 0; i < f.size(); ++i) ids[static_cast<size_t>(i)] = f[i];
  return ids;
}

// train.bin then val.bin of a prepared folder: the whole corpus's ids.
std::vector<uint32_t> prepared_ids(const std::string& dir) {
  std::vector<uint32_t> ids = read_ids(dir + "/train.bin");
  const std::vector<uint32_t> val = read_ids(dir + "/val.bin");
  ids.insert(ids.end(), val.begin(), val.end());
  return ids;
}

// A few kB of fixed English-like text, one sentence a line.
std::string fixed_corpus() {
  const char* words[] = {"the", "model", "routes", "each",   "token",   "to",     "experts",
                         "and", "a",     "gate",   "learns", "which",   "of",     "them",
                         "is",  "best",  "for",    "sparse", "mixture", "layers", "train"};
  std::string text;
  uint32_t x = 12345;
  for (int line = 0; line < 400; ++line) {
    for (int w = 0; w < 12; ++w) {
      x = x * 1103515245u + 12345u;
      text += words[(x >> 16) % 21];
      text += w == 11 ? ".\n" : " ";
    }
  }
  return text;
}

// Peak resident memory growth (bytes) of `fn`: the kernel's high-water mark is reset first
// (clear_refs 5), so earlier tests in this process do not hide it.
int64_t peak_rss_growth(const std::function<void()>& fn) {
  auto field = [](const char* key) {
    std::ifstream in("/proc/self/status");
    for (std::string line; std::getline(in, line);)
      if (line.rfind(key, 0) == 0) return int64_t{std::stoll(line.substr(std::strlen(key)))} * 1024;
    return int64_t{-1};
  };
  std::ofstream("/proc/self/clear_refs") << "5";
  const int64_t before = field("VmRSS:");
  fn();
  return field("VmHWM:") - before;
}

}  // namespace

TEST(Data, PrepareIsTheSameForAnyWorkersAndChunks) {
  TempDir tmp;
  fs::create_directories(tmp.path() / "books");
  write(tmp / "books/a.txt", "first file\nwith lines\n");
  write(tmp / "books/b.txt", "second, no newline at the end");
  write(tmp / "c.txt", "a third file, given on its own");
  PrepareOptions o;
  o.corpus = {tmp / "books", tmp / "c.txt"};
  o.val_fraction = 0.1;
  o.out_dir = tmp / "one";
  o.workers = 1;
  const PrepareResult r = prepare(o);
  EXPECT_EQ(r.files.size(), 3u);
  EXPECT_EQ(r.documents, 3);
  EXPECT_EQ(r.dtype, "uint16");
  o.out_dir = tmp / "many";
  o.workers = 3;
  o.chunk_bytes = 5;  // pieces cut at line ends and between characters
  prepare(o);
  const std::vector<uint32_t> ids = prepared_ids(tmp / "one");
  EXPECT_EQ(ids, prepared_ids(tmp / "many"));
  // The byte tokenizer has no end-of-document id: the files' bytes, concatenated.
  const std::string all = io::read_file(tmp / "books/a.txt") + io::read_file(tmp / "books/b.txt") +
                          io::read_file(tmp / "c.txt");
  EXPECT_EQ(ids, std::vector<uint32_t>(all.begin(), all.end()));
}

TEST(Data, PrepareReadsJsonlAndNamesBadLines) {
  TempDir tmp;
  write(tmp / "docs.jsonl", "{\"text\": \"caf\\u00e9\", \"id\": 1}\n\n{\"text\": \"two\"}\n");
  PrepareOptions o;
  o.corpus = {tmp / "docs.jsonl"};
  o.out_dir = tmp / "out";
  o.val_fraction = 0;
  const PrepareResult r = prepare(o);
  EXPECT_EQ(r.documents, 2);
  EXPECT_EQ(prepared_ids(tmp / "out"),
            (std::vector<uint32_t>{'c', 'a', 'f', 0xc3, 0xa9, 't', 'w', 'o'}));

  o.overwrite = true;
  o.text_field = "body";
  EXPECT_CONTAINS(error_of([&] { prepare(o); }),
                  fmt::format("[data] {}:1: no string field \"body\"", tmp / "docs.jsonl"));
  write(tmp / "bad.jsonl", "{\"text\": \"ok\"}\nnot json\n");
  o.corpus = {tmp / "bad.jsonl"};
  o.text_field = "text";
  EXPECT_CONTAINS(error_of([&] { prepare(o); }),
                  fmt::format("[data] {}:2: not a JSON line", tmp / "bad.jsonl"));
}

TEST(Data, PrepareKeepsMemoryFlat) {
  TempDir tmp;
  // 48 MB of text, prepared in 256 kB chunks by 2 workers: the text and its tokens (3x the
  // text as uint16) would take ~150 MB held whole; the chunks in flight take a few MB.
  const int64_t mb = 48;
  {
    std::ofstream out(tmp / "big.txt", std::ios::binary);
    const std::string block = fixed_corpus();
    for (int64_t written = 0; written < mb << 20; written += static_cast<int64_t>(block.size()))
      out << block;
  }
  PrepareOptions o;
  o.corpus = {tmp / "big.txt"};
  o.out_dir = tmp / "out";
  o.chunk_bytes = 256 << 10;
  o.workers = 2;
  PrepareResult r;
  const int64_t growth = peak_rss_growth([&] { r = prepare(o); });
  std::printf("[prepare] %.1f MB in %.2f s (%.1f MB/s), peak RSS growth %.1f MB\n", r.bytes / 1e6,
              r.seconds, r.bytes / 1e6 / r.seconds, growth / 1e6);
  EXPECT_GE(r.bytes, mb << 20);
  EXPECT_EQ(r.train_tokens + r.val_tokens, r.bytes);
  EXPECT_LT(growth, 16 << 20);
}

TEST(Data, Uint32TokensRoundTrip) {
  TempDir tmp;
  const std::vector<uint32_t> ids = {0, 65535, 65536, 70000, 123456, 7};
  write(tmp / "train.bin", std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
  write(tmp / "meta.json", R"({"vocab_size": 200000, "dtype": "uint32"})");
  EXPECT_EQ(read_ids(tmp / "train.bin"), ids);
  std::vector<int32_t> out(3);
  TokenFile::open(tmp / "train.bin").read(2, 3, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{65536, 70000, 123456}));
  // A vocabulary too small for the ids is named.
  write(tmp / "meta.json", R"({"vocab_size": 100000, "dtype": "uint32"})");
  EXPECT_CONTAINS(error_of([&] { TokenFile::open(tmp / "train.bin"); }),
                  "token 123456 at offset 4 is >= vocab_size 100000");
}

TEST(Data, TokenizerKindsAndErrors) {
  EXPECT_EQ(load_tokenizer("")->name(), "byte");
  EXPECT_EQ(tokenizer_kind("x/tok.model"), "sentencepiece");
  EXPECT_EQ(tokenizer_kind("x/tokenizer.json"), "hf");
  EXPECT_CONTAINS(error_of([] { tokenizer_kind("vocab.txt"); }),
                  "[tokenizer] vocab.txt: unknown tokenizer kind");
  EXPECT_CONTAINS(error_of([] { load_tokenizer("/nonexistent/tok.model"); }),
                  "[tokenizer] /nonexistent/tok.model: no such file");
  TempDir tmp;
  write(tmp / "broken.model", "not a model");
  if (sentencepiece_available())
    EXPECT_CONTAINS(error_of([&] { load_tokenizer(tmp / "broken.model"); }),
                    "not a SentencePiece model");
  else
    EXPECT_CONTAINS(error_of([&] { load_tokenizer(tmp / "broken.model"); }),
                    "built without SentencePiece");
}

TEST(Data, SentencePieceTrainPrepareAndDecode) {
  if (!sentencepiece_available()) GTEST_SKIP() << "built without libsentencepiece";
  TempDir tmp;
  write(tmp / "corpus.txt", fixed_corpus());
  SentencePieceTrainOptions t;
  t.corpus = {tmp / "corpus.txt"};
  t.out = tmp / "tok.model";
  t.vocab_size = 400;
  train_sentencepiece(t);
  const auto tok = load_tokenizer(tmp / "tok.model");
  EXPECT_EQ(tok->name(), "sentencepiece");
  EXPECT_EQ(tok->vocab_size(), 400);
  EXPECT_EQ(tok->eos_id(), 2);
  const std::string text = "the gate routes each token to experts";
  const std::vector<uint32_t> ids = tok->encode(text);
  EXPECT_LT(ids.size(), text.size() / 2);  // merges learnt: far fewer ids than bytes
  EXPECT_EQ(tok->decode(ids), text);

  // Two JSONL documents, each followed by the end-of-document id.
  write(tmp / "d.jsonl", "{\"text\": \"the model\"}\n{\"text\": \"sparse layers\"}\n");
  PrepareOptions o;
  o.corpus = {tmp / "d.jsonl"};
  o.out_dir = tmp / "out";
  o.val_fraction = 0;
  o.tokenizer = tmp / "tok.model";
  prepare(o);
  std::vector<uint32_t> want = tok->encode("the model");
  want.push_back(2);
  for (uint32_t id : tok->encode("sparse layers")) want.push_back(id);
  want.push_back(2);
  EXPECT_EQ(prepared_ids(tmp / "out"), want);
  // The folder carries the tokenizer, and says so.
  EXPECT_EQ(prepared_tokenizer(tmp / "out"), tmp / "out/tokenizer.model");
  EXPECT_EQ(io::read_file(tmp / "out/tokenizer.model"), io::read_file(tmp / "tok.model"));
  const auto meta = nlohmann::json::parse(io::read_file(tmp / "out/meta.json"));
  EXPECT_EQ(meta["tokenizer"]["kind"], "sentencepiece");
  EXPECT_EQ(meta["vocab_size"], 400);
  const PreparedData d = ensure_prepared(data_config("unused", tmp / "out"));
  EXPECT_EQ(d.tokenizer, "sentencepiece");
  EXPECT_EQ(d.vocab_size, 400);
}

// meta.json values of the wrong type (tests/fuzz/fuzz_token_file found the vocab_size one: a
// number past int64 was converted with undefined behaviour); each is an Error naming meta.json.
TEST(FuzzFindings, MetaJsonValuesOfTheWrongTypeAreRefused) {
  TempDir tmp;
  const std::string path = make_tokens(tmp, 100, 300, "train.bin");
  const std::string meta = tmp / "meta.json";
  auto error_with = [&](const std::string& text) {
    write(meta, text);
    return error_of([&] { TokenFile::open(path); });
  };
  EXPECT_CONTAINS(error_with(R"({"dtype": "uint16", "vocab_size": 184467440737095516155})"),
                  meta + ": vocab_size = 1.844674407370955e+20 is not an integer token count");
  EXPECT_CONTAINS(error_with(R"({"vocab_size": 18446744073709551615})"),
                  "vocab_size = 18446744073709551615 is not an integer");
  EXPECT_CONTAINS(error_with(R"({"dtype": 5})"), meta + ": dtype = 5 is not a string");
  EXPECT_CONTAINS(error_with(R"({"dtype": "int8"})"),
                  meta + ": dtype = 'int8' is not uint16 or uint32");
  EXPECT_CONTAINS(error_with(R"({"train": {"file": ["train.bin"]}})"),
                  meta + ": train.file = [\"train.bin\"] is not a string");
  EXPECT_CONTAINS(error_with(R"({"train": {"file": "train.bin", "crc32c": 12}})"),
                  meta + ": crc32c of train.bin = 12 is not a string");
  write(meta, R"({"dtype": "uint16", "vocab_size": 300})");
  EXPECT_EQ(TokenFile::open(path).size(), 100);
}

// Weighted mixing (data.mix): two files whose tokens tell them apart (A: 0..99, B: 100..199).
TEST(DataMix, WindowsFollowTheWeightsDeterministically) {
  TempDir tmp;
  std::string b_bytes;
  for (int64_t i = 0; i < 3000; ++i) {
    const uint16_t v = static_cast<uint16_t>(100 + i % 100);
    b_bytes.append(reinterpret_cast<const char*>(&v), 2);
  }
  write(tmp / "b.bin", b_bytes);
  const TokenFile a = TokenFile::open(make_tokens(tmp, 5000, 100, "a.bin"));
  const TokenFile b = TokenFile::open(tmp / "b.bin");
  const int64_t B = 8, T = 16;
  DataLoader mix({a, b}, {0.7, 0.3}, B, T, 3);
  EXPECT_NEAR(mix.weights()[0], 0.7, 1e-12);

  // Realised proportions over 4000 batches (32000 windows; the binomial standard deviation of
  // the share is 0.0026), and every window's tokens come from the file it names.
  int64_t from_b = 0, windows = 0;
  for (int s = 0; s < 4000; ++s) {
    const Batch batch = mix.next();
    const auto in = batch.inputs.to_vector<int32_t>();
    for (int64_t i = 0; i < B; ++i, ++windows) {
      const int file = mix.window_file(static_cast<uint64_t>(s * B + i));
      from_b += file;
      const int32_t first = in[static_cast<size_t>(i * T)];
      ASSERT_EQ(first >= 100, file == 1) << "window " << s * B + i;
    }
  }
  EXPECT_NEAR(static_cast<double>(from_b) / static_cast<double>(windows), 0.3, 0.01);

  // Weights 1:3 (unnormalised) give a share of 0.75.
  DataLoader quarter({a, b}, {1.0, 3.0}, B, T, 3);
  int64_t q = 0;
  for (uint64_t g = 0; g < 20000; ++g) q += quarter.window_file(g);
  EXPECT_NEAR(static_cast<double>(q) / 20000.0, 0.75, 0.015);

  // The same seed gives the same batches; another seed others.
  DataLoader again({a, b}, {0.7, 0.3}, B, T, 3), other({a, b}, {0.7, 0.3}, B, T, 4);
  EXPECT_EQ(again.batch_at(17).inputs.to_vector<int32_t>(),
            mix.batch_at(17).inputs.to_vector<int32_t>());
  EXPECT_NE(other.batch_at(17).inputs.to_vector<int32_t>(),
            mix.batch_at(17).inputs.to_vector<int32_t>());
  // One file with any weight is the plain loader.
  DataLoader plain(a, B, T, 3), weighted(std::vector<TokenFile>{a}, {2.5}, B, T, 3);
  EXPECT_EQ(plain.batch_at(5).inputs.to_vector<int32_t>(),
            weighted.batch_at(5).inputs.to_vector<int32_t>());
}

// The window starts for seed 1234, 100000 tokens, seq 64: bench/peers/train_torch.py draws the
// same (tests/scripts/torch_peer_tokens.sh pins these numbers too).
TEST(Data, WindowStartsArePinned) {
  TempDir tmp;
  const TokenFile file = TokenFile::open(make_tokens(tmp, 100000, 256));
  DataLoader loader(file, 1, 64, 1234);
  std::vector<int64_t> starts;
  for (uint64_t g = 0; g < 4; ++g) starts.push_back(loader.window_start(g));
  EXPECT_EQ(starts, (std::vector<int64_t>{16428, 64818, 20349, 96369}));
}

TEST(DataMix, ResumesFromThePositionAndSplitsOverRanks) {
  TempDir tmp;
  const TokenFile a = TokenFile::open(make_tokens(tmp, 4000, 100, "a.bin"));
  const TokenFile b = TokenFile::open(make_tokens(tmp, 2500, 250, "b.bin"));
  const int64_t B = 3, T = 8;
  DataLoader straight({a, b}, {0.5, 0.5}, 2 * B, T, 9);
  std::vector<std::vector<int32_t>> want;
  for (int s = 0; s < 6; ++s) want.push_back(straight.next().inputs.to_vector<int32_t>());

  // Resume: a loader set to position 3 continues with batches 3, 4, 5.
  DataLoader resumed({a, b}, {0.5, 0.5}, 2 * B, T, 9);
  resumed.set_position(3);
  for (int s = 3; s < 6; ++s) EXPECT_EQ(resumed.next().inputs.to_vector<int32_t>(), want[s]);

  // Two data-parallel ranks: each its own B windows of the global batch, together the whole.
  DataLoader r0({a, b}, {0.5, 0.5}, B, T, 9, 0, 2), r1({a, b}, {0.5, 0.5}, B, T, 9, 1, 2);
  for (int s = 0; s < 6; ++s) {
    std::vector<int32_t> cat = r0.next().inputs.to_vector<int32_t>();
    const auto second = r1.next().inputs.to_vector<int32_t>();
    cat.insert(cat.end(), second.begin(), second.end());
    EXPECT_EQ(cat, want[s]) << "step " << s;
  }
}

TEST(DataMix, BadMixesAreRefusedByName) {
  TempDir tmp;
  const TokenFile a = TokenFile::open(make_tokens(tmp, 100, 100, "a.bin"));
  const TokenFile small = TokenFile::open(make_tokens(tmp, 10, 100, "small.bin"));
  EXPECT_CONTAINS(error_of([&] {
                    DataLoader({a, a}, {1.0}, 1, 8, 0);
                  }),
                  "2 token files and 1 weights");
  EXPECT_CONTAINS(error_of([&] {
                    DataLoader({a, a}, {1.0, 0.0}, 1, 8, 0);
                  }),
                  "weight 0 is not a finite positive number");
  EXPECT_CONTAINS(error_of([&] {
                    DataLoader({a, small}, {1.0, 1.0}, 1, 16, 0);
                  }),
                  "small.bin: 10 tokens, need at least seq_len + 1 = 17");
  DataLoader mix({a, a}, {1.0, 1.0}, 1, 8, 0);
  EXPECT_CONTAINS(error_of([&] { mix.eval_batch(0); }), "this loader mixes 2");

  // data.mix entries.
  EXPECT_CONTAINS(error_of([&] { parse_data_mix({"data/a"}); }),
                  "data.mix entry 'data/a' has no weight");
  EXPECT_CONTAINS(error_of([&] { parse_data_mix({"data/a:-1"}); }),
                  "weight '-1' is not a finite positive number");
  EXPECT_CONTAINS(error_of([&] { parse_data_mix({"data/a:x"}); }), "weight 'x'");
  EXPECT_CONTAINS(error_of([&] { parse_data_mix({":0.5"}); }), "names no folder");
  EXPECT_CONTAINS(error_of([&] { parse_data_mix({"d:1", "d:2"}); }), "data.mix lists d twice");
  const auto parsed = parse_data_mix({"/x/y:z/a:0.7", " b : 0.3 "});
  ASSERT_EQ(parsed.size(), 2u);
  EXPECT_EQ(parsed[0].dir, "/x/y:z/a");
  EXPECT_EQ(parsed[0].weight, 0.7);
  EXPECT_EQ(parsed[1].dir, "b");
  Config c;
  c.data.mix = {"data/a:0"};
  EXPECT_CONTAINS(error_of([&] { validate(c); }), "data.mix entry 'data/a:0'");

  // Folders: unprepared, or prepared with other tokenizers.
  write(tmp / "corpus.txt", std::string(2000, 'x') + "\n");
  prepare(tmp / "corpus.txt", tmp / "p1", 0.1);
  prepare(tmp / "corpus.txt", tmp / "p2", 0.1);
  EXPECT_EQ(prepared_mix({{tmp / "p1", 1}, {tmp / "p2", 1}}).size(), 2u);
  EXPECT_CONTAINS(error_of([&] {
                    prepared_mix({{tmp / "p1", 1}, {tmp / "none", 1}});
                  }),
                  "data.mix entry " + (tmp / "none") + " lacks train.bin, val.bin, meta.json");
  nlohmann::json meta = nlohmann::json::parse(io::read_file(tmp / "p2/meta.json"));
  meta["vocab_size"] = 300;
  write(tmp / "p2/meta.json", meta.dump());
  const std::string e = error_of([&] { prepared_mix({{tmp / "p1", 1}, {tmp / "p2", 1}}); });
  EXPECT_CONTAINS(e, "[data] data.mix: " + (tmp / "p1") + " (byte tokenizer, vocab_size 256) and " +
                         (tmp / "p2") +
                         " (byte tokenizer, vocab_size 300) differ in their "
                         "vocabulary sizes");
}
