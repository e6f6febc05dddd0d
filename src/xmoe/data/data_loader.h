#pragma once
// Deterministic batches of random training windows, sharded over data-parallel ranks.
//
// Global batch s holds world*B windows; window g = s*world*B + j (j < world*B) starts at
// Philox(seed, stream "data.train", g) mod (N - T). Rank r takes windows [r*B, (r+1)*B), so the
// global batch, and thus training, is the same for any world size with the same world*B.
// The loader's whole state is `position` (global batches consumed).
#include <cstdint>

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

  /// This rank's part of global batch position(), then advances position by one.
  Batch next();
  /// This rank's part of global batch `position` (does not move the loader).
  Batch batch_at(uint64_t position) const;
  /// Start offset of window `global_index` (for tests and inspection).
  int64_t window_start(uint64_t global_index) const;

  uint64_t position() const { return position_; }
  void set_position(uint64_t position) { position_ = position; }

  /// Evaluation: batch i of the fixed, non-overlapping windows [k*T, k*T + T + 1) of the file,
  /// the same on every call. Global eval batch i holds windows [i*world*B, (i+1)*world*B),
  /// wrapping around the file; rank r takes its B of them.
  Batch eval_batch(int64_t i) const;
  /// Number of eval batches before the windows wrap around (at least 1).
  int64_t num_eval_batches() const;

  int64_t batch_size() const { return batch_size_; }
  int64_t seq_len() const { return seq_len_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  const TokenFile& file() const { return file_; }

 private:
  Batch gather(const int64_t* starts) const;

  TokenFile file_;
  int64_t batch_size_, seq_len_;
  uint64_t seed_;
  int rank_, world_;
  uint64_t position_ = 0;
};

}  // namespace xmoe::data
