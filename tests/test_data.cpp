#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "xmoe/core/error.h"
#include "xmoe/data/data_loader.h"
#include "xmoe/data/prepare.h"
#include "xmoe/data/token_file.h"
#include "xmoe/data/tokenizer.h"
#include "xmoe/io/file.h"

#include "testing.h"

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
