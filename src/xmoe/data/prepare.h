#pragma once
// Turns raw text into token files (nanoGPT convention): <out_dir>/train.bin and val.bin as flat
// little-endian uint16 byte tokens, and meta.json describing them.
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

namespace xmoe::data {

struct PrepareResult {
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  std::vector<std::string> files;    ///< text files read, in order
  std::vector<std::string> skipped;  ///< "path (reason)" for each entry left out
};

/// Lists the text files of `corpus_path`: the file itself, or the regular files directly inside
/// a folder in sorted name order, skipping symlinks, sub-folders, `*.dat` index files and any
/// file containing a NUL byte (binary).
std::vector<std::string> list_corpus_files(const std::string& corpus_path,
                                           std::vector<std::string>* skipped = nullptr);

/// Tokenises the corpus with the byte tokenizer and writes train.bin, val.bin and meta.json
/// (vocab_size, dtype, token counts, source, file list, CRC-32C of each bin). The last
/// `val_fraction` of the tokens is the validation split. Throws, writing nothing, when out_dir
/// already holds any of the three files and `overwrite` is false, when the corpus holds no
/// text, or when val_fraction > 0 leaves the validation split empty. Each file is written to a
/// temporary name and renamed, meta.json last.
PrepareResult prepare(const std::string& corpus_path, const std::string& out_dir,
                      double val_fraction, bool overwrite = false);

/// What ensure_prepared() found or did.
struct PreparedData {
  bool prepared = false;     ///< true: this call tokenised data.corpus into data.dir
  std::string source;        ///< the corpus the tokens came from (meta.json's "source"; "" if none)
  int64_t train_tokens = 0;  ///< tokens in train.bin
  int64_t val_tokens = 0;    ///< tokens in val.bin
  int64_t vocab_size = 0;    ///< meta.json's vocab_size
  std::string dtype;         ///< meta.json's dtype: "uint16" or "uint32"
};

/// Makes sure data.dir holds train.bin, val.bin and meta.json. All three present: they are used
/// as they are (meta.json must parse and give vocab_size and dtype; a "source" other than
/// data.corpus is logged, not re-prepared). None of them: prepares data.corpus into data.dir.
/// Anything in between (token files without meta.json, one of the two token files, meta.json
/// alone) is an error naming the folder and what is missing; nothing is written.
PreparedData ensure_prepared(const DataConfig& data);

}  // namespace xmoe::data
