#pragma once
// Turns raw text into token files (nanoGPT convention): <out_dir>/train.bin and val.bin as flat
// little-endian uint16 byte tokens, and meta.json describing them.
#include <cstdint>
#include <string>
#include <vector>

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
/// `val_fraction` of the tokens is the validation split. Each file is written to a temporary
/// name and renamed, meta.json last.
PrepareResult prepare(const std::string& corpus_path, const std::string& out_dir,
                      double val_fraction);

}  // namespace xmoe::data
