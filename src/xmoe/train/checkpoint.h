#pragma once
// Checkpoints: a folder `step-N/` holding one safetensors file per rank and a manifest.json
// with the trainer's state and every file's size and CRC-32C. A checkpoint is built in
// `<dir>.tmp-XXXXXXXX/` and renamed into place, so a folder named `dir` is always complete.
//
// Multi-rank protocol (save_checkpoint with world > 1 and a vote, `all_ok`):
//   1. every rank measures the free space; rank 0 removes a stale tmp folder and, if the save
//      fits, creates it;                                             vote
//   2. every rank r writes model-rank{r}.safetensors into it;        vote
//   3. rank 0 checksums the rank files, writes manifest.json, fsyncs and renames;  vote
// A vote is a collective that tells every rank whether all passed their phase, so a failure on
// one rank (a full disk while writing its file) fails the save on every rank alike.
// The tmp folder's name is derived from `dir` alone, so all ranks agree on it without talking.
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "xmoe/core/tensor.h"

namespace xmoe::train {

inline constexpr int kCheckpointFormatVersion = 1;

/// Name of rank r's tensor file inside a checkpoint folder.
std::string checkpoint_rank_file(int rank);
/// The temporary folder a save of `dir` builds in: `<dir>.tmp-<crc32c(dir) in hex>`.
std::string checkpoint_tmp_dir(const std::string& dir);

/// Saves `tensors` (this rank's shard) and `manifest_extra` (stored under "state": config YAML,
/// step, data position, RNG state, layout) as checkpoint `dir`. If `dir` exists it is replaced:
/// renamed to `<dir>.old`, the new one renamed in, then the old one deleted.
/// With world > 1 every rank calls this with the same dir, and `all_ok(mine)` must be a
/// collective that returns true when every rank passed true (see the protocol above); with
/// world == 1 it may be empty.
/// A save that fails on any rank (a full disk, a quota, an I/O error) removes the tmp folder and
/// throws "[checkpoint] saving <dir> failed: <reason>; it needs about <bytes>, <bytes> free on
/// that filesystem. The previous checkpoints are intact." on every rank (needed = this rank's
/// tensor bytes x world; the reason on other ranks: "another rank's part of the save failed"); the
/// previous `dir`, if any, is kept. If io::free_bytes shows less than needed, it fails that way
/// before writing anything. A failure after the new checkpoint has its name (fsync of the run
/// folder, removing `<dir>.old`) throws "[checkpoint] <dir> is saved, but ...".
/// `files` (name -> bytes: the run's tokenizer) are written by rank 0 beside the tensor files and
/// listed, with their sizes and CRC-32C, under the manifest's "extra_files" (which checkpoints
/// without them lack; load_checkpoint verifies them when listed).
void save_checkpoint(const std::string& dir, const std::map<std::string, Tensor>& tensors,
                     const nlohmann::json& manifest_extra, int rank = 0, int world = 1,
                     const std::function<bool(bool)>& all_ok = {},
                     const std::map<std::string, std::string>& files = {});

/// Step 2 of the protocol alone: writes rank `rank`'s file into `tmp_dir`.
void write_checkpoint_shard(const std::string& tmp_dir,
                            const std::map<std::string, Tensor>& tensors, int rank);
/// Step 3 alone (rank 0): checks all `world` rank files exist, writes the manifest, renames.
void commit_checkpoint(const std::string& tmp_dir, const std::string& dir,
                       const nlohmann::json& manifest_extra, int world,
                       const std::map<std::string, std::string>& files = {});

struct Checkpoint {
  nlohmann::json state;                   ///< the manifest_extra given to save_checkpoint
  std::map<std::string, Tensor> tensors;  ///< all ranks' tensors (CPU)
  nlohmann::json manifest;                ///< the whole manifest (format, world, files)
  int world = 1;                          ///< number of rank files it was saved with
};

/// Loads and verifies a checkpoint: manifest present and well-formed, every listed file present
/// with the recorded size and CRC-32C, every file a valid safetensors file. Tensors of all ranks
/// are merged by name; a name in several rank files (a replicated parameter) must hold identical
/// bytes. Any problem throws "[checkpoint] <dir>/<file>: <what is wrong>".
Checkpoint load_checkpoint(const std::string& dir);
/// Loads only rank `rank`'s tensors (after verifying the whole checkpoint's manifest and files).
Checkpoint load_checkpoint_rank(const std::string& dir, int rank);

/// The `step-N` folder of `run_dir` with the highest N that has a manifest.json; `.tmp-*`
/// folders are ignored. If a crash happened between the two renames of an overwrite, only
/// `step-N.old` exists; it is complete and is returned in place of `step-N`.
std::optional<std::string> latest_checkpoint(const std::string& run_dir);

/// The tokenizer a checkpoint's run trained with, for generate and export: the copy inside the
/// checkpoint folder `dir` (state "tokenizer"), "" for the byte tokenizer. A checkpoint saved
/// before checkpoints carried it: the copy in its data folder (data.dir, or the first folder of
/// data.mix), "" when that folder names none. A checkpoint that names a tokenizer of another
/// kind than byte but holds no file of it is an error.
std::string checkpoint_tokenizer(const std::string& dir, const Checkpoint& checkpoint);

}  // namespace xmoe::train
