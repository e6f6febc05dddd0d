#pragma once
// Reading a corpus without holding it: the files of several paths, each read in pieces of
// bounded size. A text file is one document; a `.jsonl` file holds one document per line (the
// string under a text field).
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace xmoe::data {

/// Lists the text files of `corpus_path`: the file itself, or the regular files directly inside
/// a folder in sorted name order, skipping symlinks, sub-folders, `*.dat` index files and any
/// file containing a NUL byte (binary).
std::vector<std::string> list_corpus_files(const std::string& corpus_path,
                                           std::vector<std::string>* skipped = nullptr);
/// list_corpus_files() of each path in turn (files and folders, in the order given).
std::vector<std::string> list_corpus(const std::vector<std::string>& paths,
                                     std::vector<std::string>* skipped = nullptr);

/// A piece of one document.
struct TextPiece {
  std::string text;
  bool ends_document = false;  ///< the last piece of its document
};

/// Reads one corpus file in pieces. A text file gives pieces of at most `chunk_bytes`, cut after
/// a line end where the piece has one (else before a UTF-8 character), the last one ending the
/// document. A `.jsonl` file gives one piece per non-empty line: the string under `text_field`;
/// a line that is not a JSON object with that string field is an error naming the file and line.
class DocumentReader {
 public:
  DocumentReader(std::string path, std::string text_field, size_t chunk_bytes);
  /// The next piece; false at the end of the file.
  bool next(TextPiece& piece);
  int64_t bytes_read() const { return bytes_read_; }  ///< bytes of the file consumed so far
  bool is_jsonl() const { return jsonl_; }

 private:
  bool next_text(TextPiece& piece);
  bool next_json(TextPiece& piece);

  std::string path_, text_field_;
  size_t chunk_bytes_;
  bool jsonl_;
  std::ifstream in_;
  std::string carry_;  // text read past the last cut, for the next piece
  bool eof_ = false;
  int64_t line_ = 0;
  int64_t bytes_read_ = 0;
};

}  // namespace xmoe::data
