#include "xmoe/data/data_loader.h"

#include <algorithm>
#include <vector>

#include "xmoe/core/rng.h"

namespace xmoe::data {

DataLoader::DataLoader(TokenFile file, int64_t batch_size, int64_t seq_len, uint64_t seed, int rank,
                       int world)
    : file_(std::move(file)),
      batch_size_(batch_size),
      seq_len_(seq_len),
      seed_(seed),
      rank_(rank),
      world_(world) {
  XMOE_CHECK(batch_size >= 1 && seq_len >= 1,
             "[data] batch_size = {} and seq_len = {} must be positive", batch_size, seq_len);
  XMOE_CHECK(world >= 1 && rank >= 0 && rank < world, "[data] rank {} outside world {}", rank,
             world);
  XMOE_CHECK(file_.size() >= seq_len + 1, "[data] {}: {} tokens, need at least seq_len + 1 = {}",
             file_.path(), file_.size(), seq_len + 1);
}

int64_t DataLoader::window_start(uint64_t global_index) const {
  static const uint64_t stream = stream_id("data.train");
  const auto b = Philox::block(seed_, stream, global_index);
  const uint64_t x = (static_cast<uint64_t>(b[0]) << 32) | b[1];
  // N - T valid starts: a window reads T + 1 tokens (inputs and shifted targets).
  return static_cast<int64_t>(x % static_cast<uint64_t>(file_.size() - seq_len_));
}

Batch DataLoader::gather(const int64_t* starts) const {
  Batch b{Tensor::empty({batch_size_, seq_len_}, DType::i32),
          Tensor::empty({batch_size_, seq_len_}, DType::i32)};
  int32_t* in = b.inputs.data<int32_t>();
  int32_t* tg = b.targets.data<int32_t>();
  std::vector<int32_t> buf(static_cast<size_t>(seq_len_ + 1));
  for (int64_t i = 0; i < batch_size_; ++i) {
    file_.read(starts[i], seq_len_ + 1, buf.data());
    std::copy(buf.begin(), buf.end() - 1, in + i * seq_len_);
    std::copy(buf.begin() + 1, buf.end(), tg + i * seq_len_);
  }
  return b;
}

Batch DataLoader::batch_at(uint64_t position) const {
  const uint64_t global_b = static_cast<uint64_t>(world_) * batch_size_;
  const uint64_t first = position * global_b + static_cast<uint64_t>(rank_) * batch_size_;
  std::vector<int64_t> starts(static_cast<size_t>(batch_size_));
  for (int64_t i = 0; i < batch_size_; ++i) starts[i] = window_start(first + i);
  return gather(starts.data());
}

Batch DataLoader::next() {
  return batch_at(position_++);
}

int64_t DataLoader::num_eval_batches() const {
  const int64_t windows = (file_.size() - 1) / seq_len_;
  const int64_t global_b = world_ * batch_size_;
  return std::max<int64_t>(1, windows / global_b);
}

Batch DataLoader::eval_batch(int64_t i) const {
  XMOE_CHECK(i >= 0, "[data] eval batch {} < 0", i);
  const int64_t windows = (file_.size() - 1) / seq_len_;  // >= 1 by the constructor's check
  const int64_t first = (i * world_ + rank_) * batch_size_;
  std::vector<int64_t> starts(static_cast<size_t>(batch_size_));
  for (int64_t j = 0; j < batch_size_; ++j) starts[j] = ((first + j) % windows) * seq_len_;
  return gather(starts.data());
}

}  // namespace xmoe::data
