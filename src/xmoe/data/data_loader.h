#pragma once
// Deterministic batches of random training windows, sharded over data-parallel ranks.
//
// Global batch s holds world*B windows; window g = s*world*B + j (j < world*B) starts at
// Philox(seed, stream "data.train", g) mod (N - T). Rank r takes windows [r*B, (r+1)*B), so the
// global batch, and thus training, is the same for any world size with the same world*B.
// The loader's whole state is `position` (global batches consumed).
//
// Weighted mixing (data.mix): with several token files, window g first picks its file from the
// same Philox block's other two words (file i with probability weight_i / sum of weights), then
// its start in that file as above. Each window depends on (seed, g) alone, so mixing keeps the
// properties above: deterministic, resumable from `position`, the same for any world size.
#include <cstdint>
#include <vector>

#include "xmoe/core/tensor.h"
#include "xmoe/data/token_file.h"

namespace xmoe::data {

struct Batch {
  Tensor inputs;   ///< int32 [B, T] on the CPU
  Tensor targets;  ///< int32 [B, T]: inputs shifted left by one token
};

class DataLoader {
 public:
  /// `file` must hold at least seq_len + 1 tokens.
  DataLoader(TokenFile file, int64_t batch_size, int64_t seq_len, uint64_t seed, int rank = 0,
             int world = 1);
  /// Windows drawn from several files in proportion to `weights` (positive, one per file; each
  /// file must hold at least seq_len + 1 tokens). One file gives exactly the loader above.
  DataLoader(std::vector<TokenFile> files, std::vector<double> weights, int64_t batch_size,
             int64_t seq_len, uint64_t seed, int rank = 0, int world = 1);

  /// This rank's part of global batch position(), then advances position by one.
  Batch next();
  /// This rank's part of global batch `position` (does not move the loader).
  Batch batch_at(uint64_t position) const;
  /// Start offset of window `global_index` in its file (for tests and inspection).
  int64_t window_start(uint64_t global_index) const;
  /// The file (index into files()) window `global_index` is drawn from.
  int window_file(uint64_t global_index) const;

  uint64_t position() const { return position_; }
  void set_position(uint64_t position) { position_ = position; }

  /// Evaluation (one file only: a mix evaluates each file with a loader of its own): batch i of
  /// the fixed, non-overlapping windows [k*T, k*T + T + 1) of the file,
  /// the same on every call. Global eval batch i holds windows [i*world*B, (i+1)*world*B),
  /// wrapping around the file; rank r takes its B of them.
  Batch eval_batch(int64_t i) const;
  /// Number of eval batches before the windows wrap around (at least 1).
  int64_t num_eval_batches() const;

  int64_t batch_size() const { return batch_size_; }
  int64_t seq_len() const { return seq_len_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  const TokenFile& file() const { return files_.front(); }
  const std::vector<TokenFile>& files() const { return files_; }
  /// The weights normalised to sum to 1.
  const std::vector<double>& weights() const { return weights_; }

 private:
  Batch gather(const int* files, const int64_t* starts) const;

  std::vector<TokenFile> files_;
  std::vector<double> weights_;
  std::vector<double> cumulative_;  // cumulative_[i] = weights_[0] + ... + weights_[i]
  int64_t batch_size_, seq_len_;
  uint64_t seed_;
  int rank_, world_;
  uint64_t position_ = 0;
};

}  // namespace xmoe::data
