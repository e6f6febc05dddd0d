#pragma once
// Tokenizers behind one interface: the byte tokenizer (built in, vocabulary 256), SentencePiece
// models (`*.model`, through libsentencepiece) and Hugging Face tokenizer.json files (through
// Python's `tokenizers` package, run as a helper process: data/hf_tokenizer.cpp).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace xmoe::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// "byte", "sentencepiece" or "hf" (meta.json's tokenizer.kind).
  virtual std::string name() const = 0;
  virtual int64_t vocab_size() const = 0;
  /// The end-of-document id written between documents; -1 when the tokenizer has none.
  virtual int64_t eos_id() const = 0;
  virtual int64_t bos_id() const = 0;            ///< -1 when none
  virtual int64_t unk_id() const { return -1; }  ///< -1 when none
  /// The vocabulary's text for `id` (SentencePiece: its piece, e.g. "</s>"); "" where the
  /// tokenizer names no pieces.
  virtual std::string piece(int64_t /*id*/) const { return ""; }
  virtual std::vector<uint32_t> encode(std::string_view text) const = 0;
  /// Encodes several texts; the default loops, the HF helper takes them in one round trip.
  /// Safe to call from several threads at once.
  virtual std::vector<std::vector<uint32_t>> encode_batch(
      const std::vector<std::string>& texts) const;
  /// Throws "[tokenizer] token 300 at position 4 is outside the vocabulary (256)".
  virtual std::string decode(std::span<const uint32_t> ids) const = 0;
  /// The file it was loaded from ("" for the byte tokenizer).
  virtual std::string file() const { return ""; }
};

/// Byte-level tokenizer: token = byte value, vocabulary 256, lossless for any input. All 256 ids
/// are bytes, so it has no end-of-document id: documents are concatenated.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int kVocabSize = 256;
  std::string name() const override { return "byte"; }
  int64_t vocab_size() const override { return kVocabSize; }
  int64_t eos_id() const override { return -1; }
  int64_t bos_id() const override { return -1; }
  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const uint32_t> ids) const override;
  /// The same tokenizer for Hugging Face's fast tokenizer (tokenizer.json): a BPE without
  /// merges over GPT-2's byte-to-character alphabet, token = byte value, so its encode and
  /// decode give exactly xmoe's ids and bytes.
  static std::string hf_tokenizer_json();
};

/// The tokenizer in `path`, by its name: "" or "byte" = the byte tokenizer, `*.model` =
/// SentencePiece, `*.json` = Hugging Face tokenizer.json. Errors name the path and what is wrong
/// (a missing file, an unknown kind, SentencePiece not built in, python3 without `tokenizers`).
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

/// The kind load_tokenizer() gives `path` ("byte", "sentencepiece", "hf"), without loading it.
std::string tokenizer_kind(const std::string& path);

/// Loads a SentencePiece model (data/sentencepiece/; "[tokenizer] ... built without
/// SentencePiece" where libsentencepiece was missing at configure time).
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path);
/// Whether this build links libsentencepiece (XMOE_SENTENCEPIECE).
bool sentencepiece_available();

struct SentencePieceTrainOptions {
  std::vector<std::string> corpus;  ///< text/JSONL files and folders (as for prepare)
  std::string out;                  ///< the model file to write (`*.model`)
  int vocab_size = 0;
  std::string model_type = "bpe";   ///< "bpe" or "unigram"
  std::string text_field = "text";  ///< of `.jsonl` lines
};
/// Trains a SentencePiece model with the library's trainer (SentencePieceTrainer) on the lines
/// of the corpus and writes it to `out` (temporary name, then renamed).
void train_sentencepiece(const SentencePieceTrainOptions& options);

/// Loads a Hugging Face tokenizer.json through the helper process (data/hf_tokenizer.cpp).
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path);

// The byte tokenizer as free functions (ids as uint16, as the byte token files hold them).
std::vector<uint16_t> encode(std::string_view text);
std::string decode(std::span<const uint16_t> tokens);
std::string decode(std::span<const int32_t> tokens);

}  // namespace xmoe::data
