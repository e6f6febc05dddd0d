// SentencePiece models through libsentencepiece (Debian: libsentencepiece-dev).
#include "xmoe/data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <thread>
#include <unordered_map>

#include "xmoe/core/error.h"
#include "xmoe/data/corpus.h"
#include "xmoe/io/file.h"

namespace xmoe::data {

namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(std::string path) : path_(std::move(path)) {
    const auto status = sp_.Load(path_);
    XMOE_CHECK(status.ok(), "[tokenizer] {}: not a SentencePiece model ({})", path_,
               status.ToString());
  }
  std::string name() const override { return "sentencepiece"; }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int64_t eos_id() const override { return sp_.eos_id(); }
  int64_t bos_id() const override { return sp_.bos_id(); }
  int64_t unk_id() const override { return sp_.unk_id(); }
  std::string piece(int64_t id) const override {
    XMOE_CHECK(id >= 0 && id < sp_.GetPieceSize(), "[tokenizer] {}: no piece {} (vocabulary {})",
               path_, id, sp_.GetPieceSize());
    return sp_.IdToPiece(static_cast<int>(id));
  }
  std::string file() const override { return path_; }

  // SentencePieceProcessor's Encode and Decode are const: threads may share it. Line by line,
  // as spm_encode does: SentencePiece turns a line end into a word boundary either way, and
  // its encoder's time and memory grow faster than linearly with the length of one input.
  std::vector<uint32_t> encode(std::string_view text) const override {
    std::vector<uint32_t> out;
    std::vector<int> ids;
    while (!text.empty()) {
      const size_t eol = text.find('\n');
      const std::string_view line = text.substr(0, eol);
      text = eol == std::string_view::npos ? std::string_view() : text.substr(eol + 1);
      const auto status = sp_.Encode(line, &ids);
      XMOE_CHECK(status.ok(), "[tokenizer] {}: encode failed ({})", path_, status.ToString());
      out.insert(out.end(), ids.begin(), ids.end());
    }
    return out;
  }

  std::string decode(std::span<const uint32_t> ids) const override {
    std::vector<int> v;
    v.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      XMOE_CHECK(ids[i] < static_cast<uint32_t>(sp_.GetPieceSize()),
                 "[tokenizer] token {} at position {} is outside the vocabulary ({})", ids[i], i,
                 sp_.GetPieceSize());
      v.push_back(static_cast<int>(ids[i]));
    }
    std::string text;
    const auto status = sp_.Decode(v, &text);
    XMOE_CHECK(status.ok(), "[tokenizer] {}: decode failed ({})", path_, status.ToString());
    return text;
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

/// The corpus's non-empty lines, file after file, for the trainer.
class CorpusLines final : public sentencepiece::SentenceIterator {
 public:
  static constexpr size_t kMaxSentence = 4000;
  CorpusLines(std::vector<std::string> files, std::string text_field)
      : files_(std::move(files)), text_field_(std::move(text_field)) {
    advance();
  }
  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void advance() {
    for (;;) {
      const size_t eol = piece_.text.find('\n', pos_);
      if (pos_ < piece_.text.size()) {
        size_t end = eol == std::string::npos ? piece_.text.size() : eol;
        size_t next = end + 1;
        // The trainer drops sentences over its max_sentence_length (4192 bytes): a longer line
        // is cut after a space.
        if (end - pos_ > kMaxSentence) {
          const size_t space = piece_.text.rfind(' ', pos_ + kMaxSentence - 1);
          end = next = space != std::string::npos && space > pos_ ? space + 1 : pos_ + kMaxSentence;
        }
        line_.assign(piece_.text, pos_, end - pos_);
        pos_ = next;
        if (!line_.empty()) return;
        continue;
      }
      pos_ = 0;
      piece_.text.clear();
      if (reader_ && reader_->next(piece_)) continue;
      if (next_file_ == files_.size()) {
        done_ = true;
        return;
      }
      reader_.emplace(files_[next_file_++], text_field_, 1 << 20);
    }
  }

  std::vector<std::string> files_;
  std::string text_field_;
  size_t next_file_ = 0;
  std::optional<DocumentReader> reader_;
  TextPiece piece_;
  size_t pos_ = 0;
  std::string line_;
  bool done_ = false;
};

}  // namespace

bool sentencepiece_available() {
  return true;
}

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

void train_sentencepiece(const SentencePieceTrainOptions& o) {
  XMOE_CHECK(o.vocab_size > 0, "[tokenizer train] --vocab = {} must be positive", o.vocab_size);
  XMOE_CHECK(o.model_type == "bpe" || o.model_type == "unigram",
             "[tokenizer train] --model-type = {} (expected bpe or unigram)", o.model_type);
  XMOE_CHECK(!o.out.empty(), "[tokenizer train] --out names no file");
  CorpusLines lines(list_corpus(o.corpus), o.text_field);
  // The library writes <prefix>.model and <prefix>.vocab; xmoe keeps the serialized model only.
  std::string model;
  const std::unordered_map<std::string, std::string> args = {
      {"vocab_size", std::to_string(o.vocab_size)},
      {"model_type", o.model_type},
      // Every byte stays representable: characters outside the pieces fall back to bytes.
      {"byte_fallback", "true"},
      {"character_coverage", "1.0"},
      {"input_sentence_size", "5000000"},
      {"shuffle_input_sentence", "true"},
      {"num_threads", std::to_string(std::max(1u, std::thread::hardware_concurrency()))},
  };
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &lines, &model);
  XMOE_CHECK(status.ok(), "[tokenizer train] SentencePiece: {}", status.ToString());
  std::error_code ec;
  const auto parent = std::filesystem::path(o.out).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  io::write_file_atomic(o.out, model);
}

}  // namespace xmoe::data
