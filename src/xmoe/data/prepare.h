#pragma once
// Turns raw text into token files (nanoGPT convention): <out_dir>/train.bin and val.bin as flat
// little-endian uint16 tokens (uint32 where the vocabulary exceeds 65536), and meta.json
// describing them. The corpus is streamed: read in pieces, tokenised by parallel workers, written
// in corpus order as it goes, so memory stays flat whatever the corpus size. The tokenizer's
// end-of-document id (if it has one) follows each document: each text file, each JSONL line.
//
// What a data folder is promised (issue 38, "never lose a user's work"):
// - prepare() never writes over train.bin, val.bin or meta.json unless asked to (`overwrite`,
//   `xmoe prepare --overwrite`); the error lists the files it found.
// - Each file is written to a temporary name and renamed; meta.json is written last (and, when
//   overwriting, removed first), so a folder with a meta.json holds complete token files.
// - ensure_prepared() (what training calls) prepares only into a folder holding none of the
//   three files. A folder with train.bin, val.bin and meta.json is used as it is, whatever corpus
//   it came from: token files the user brought win over data.corpus. A folder with some token
//   files but not all three is refused, never prepared over.
// - A corpus with no text, or too little text for a non-empty validation split, is refused
//   instead of writing empty token files.
#include <cstdint>
#include <string>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/data/corpus.h"

namespace xmoe::data {

struct PrepareOptions {
  std::vector<std::string> corpus;  ///< text/JSONL files and folders of them, in order
  std::string out_dir;
  double val_fraction = 0.05;
  bool overwrite = false;
  std::string tokenizer;            ///< "" = byte; `*.model` SentencePiece; `*.json` Hugging Face
  std::string text_field = "text";  ///< the field of a `.jsonl` line that holds the text
  int workers = 0;                  ///< tokenising threads; 0 = the machine's cores
  size_t chunk_bytes = 4 << 20;     ///< text per work item (a text file is cut at line ends)
  bool progress = false;            ///< a progress line on stderr (MB, tokens, MB/s)
};

struct PrepareResult {
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  int64_t documents = 0;             ///< documents read (text files and JSONL lines)
  int64_t bytes = 0;                 ///< corpus bytes read
  double seconds = 0;                ///< wall time of reading, tokenising and writing
  int64_t vocab_size = 0;            ///< the tokenizer's
  std::string dtype;                 ///< "uint16" or "uint32"
  std::vector<std::string> files;    ///< corpus files read, in order
  std::vector<std::string> skipped;  ///< "path (reason)" for each entry left out
};

/// Tokenises the corpus and writes train.bin, val.bin, meta.json (vocab_size, dtype, the
/// tokenizer, token counts, source, file list, CRC-32C of each bin) and, for a tokenizer from a
/// file, a copy of it (tokenizer.model / tokenizer.json). The last `val_fraction` of the tokens
/// is the validation split. Throws, writing nothing, when out_dir already holds any of the files
/// and `overwrite` is false, when the corpus holds no text, or when val_fraction > 0 leaves the
/// validation split empty. Each file is written to a temporary name and renamed, meta.json last.
PrepareResult prepare(const PrepareOptions& options);
/// The byte tokenizer on one file or folder.
PrepareResult prepare(const std::string& corpus_path, const std::string& out_dir,
                      double val_fraction, bool overwrite = false);

/// The tokenizer a prepared folder was made with: "" for the byte tokenizer (or a meta.json that
/// names none), else the path of its copy in the folder. Throws when meta.json names a tokenizer
/// file the folder lacks.
std::string prepared_tokenizer(const std::string& data_dir);

/// What ensure_prepared() found or did.
struct PreparedData {
  bool prepared = false;     ///< true: this call tokenised data.corpus into data.dir
  std::string source;        ///< the corpus the tokens came from (meta.json's "source"; "" if none)
  int64_t train_tokens = 0;  ///< tokens in train.bin
  int64_t val_tokens = 0;    ///< tokens in val.bin
  int64_t vocab_size = 0;    ///< meta.json's vocab_size
  std::string dtype;         ///< meta.json's dtype: "uint16" or "uint32"
  std::string tokenizer = "byte";  ///< meta.json's tokenizer kind
  std::string tokenizer_file;      ///< its copy in the folder (prepared_tokenizer(); "" = byte)
};

/// Makes sure data.dir holds train.bin, val.bin and meta.json. All three present: they are used
/// as they are (meta.json must parse and give vocab_size and dtype; a "source" other than
/// data.corpus is logged, not re-prepared). None of them: prepares data.corpus into data.dir.
/// Anything in between (token files without meta.json, one of the two token files, meta.json
/// alone) is an error naming the folder and what is missing; nothing is written.
PreparedData ensure_prepared(const DataConfig& data);

/// data.mix's folders, each holding train.bin, val.bin and meta.json (a folder lacking any is an
/// error naming the entry; nothing is prepared), all made with one tokenizer: the same kind,
/// vocab_size and tokenizer file. Folders that differ are an error naming both.
std::vector<PreparedData> prepared_mix(const std::vector<DataMixEntry>& mix);

}  // namespace xmoe::data
