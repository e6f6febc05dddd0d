#include "xmoe/data/data_loader.h"

#include <algorithm>
#include <cmath>

#include "xmoe/core/rng.h"

namespace xmoe::data {

namespace {

std::vector<TokenFile> one_file(TokenFile file) {
  std::vector<TokenFile> v;
  v.push_back(std::move(file));
  return v;
}

}  // namespace

DataLoader::DataLoader(TokenFile file, int64_t batch_size, int64_t seq_len, uint64_t seed, int rank,
                       int world)
    : DataLoader(one_file(std::move(file)), {1.0}, batch_size, seq_len, seed, rank, world) {}

DataLoader::DataLoader(std::vector<TokenFile> files, std::vector<double> weights,
                       int64_t batch_size, int64_t seq_len, uint64_t seed, int rank, int world)
    : files_(std::move(files)),
      weights_(std::move(weights)),
      batch_size_(batch_size),
      seq_len_(seq_len),
      seed_(seed),
      rank_(rank),
      world_(world) {
  XMOE_CHECK(batch_size >= 1 && seq_len >= 1,
             "[data] batch_size = {} and seq_len = {} must be positive", batch_size, seq_len);
  XMOE_CHECK(world >= 1 && rank >= 0 && rank < world, "[data] rank {} outside world {}", rank,
             world);
  XMOE_CHECK(!files_.empty() && files_.size() == weights_.size(),
             "[data] {} token files and {} weights: give one weight per file", files_.size(),
             weights_.size());
  double total = 0;
  for (size_t i = 0; i < files_.size(); ++i) {
    XMOE_CHECK(std::isfinite(weights_[i]) && weights_[i] > 0,
               "[data] {}: weight {} is not a finite positive number", files_[i].path(),
               weights_[i]);
    XMOE_CHECK(files_[i].size() >= seq_len + 1,
               "[data] {}: {} tokens, need at least seq_len + 1 = {}", files_[i].path(),
               files_[i].size(), seq_len + 1);
    total += weights_[i];
  }
  double sum = 0;
  for (double& w : weights_) {
    w /= total;
    sum += w;
    cumulative_.push_back(sum);
  }
  cumulative_.back() = 1.0;  // rounding must not leave a sliver that picks no file
}

int DataLoader::window_file(uint64_t global_index) const {
  if (files_.size() == 1) return 0;
  static const uint64_t stream = stream_id("data.train");
  const auto b = Philox::block(seed_, stream, global_index);
  // 53 random bits: a uniform double in [0, 1), exact on every platform.
  const uint64_t x = (static_cast<uint64_t>(b[2]) << 32) | b[3];
  const double u = static_cast<double>(x >> 11) * 0x1.0p-53;
  const auto it = std::upper_bound(cumulative_.begin(), cumulative_.end(), u);
  return static_cast<int>(std::min<std::ptrdiff_t>(it - cumulative_.begin(),
                                                   static_cast<std::ptrdiff_t>(files_.size()) - 1));
}

int64_t DataLoader::window_start(uint64_t global_index) const {
  static const uint64_t stream = stream_id("data.train");
  const auto b = Philox::block(seed_, stream, global_index);
  const uint64_t x = (static_cast<uint64_t>(b[0]) << 32) | b[1];
  // N - T valid starts: a window reads T + 1 tokens (inputs and shifted targets).
  const TokenFile& file = files_[static_cast<size_t>(window_file(global_index))];
  return static_cast<int64_t>(x % static_cast<uint64_t>(file.size() - seq_len_));
}

Batch DataLoader::gather(const int* files, const int64_t* starts) const {
  Batch b{Tensor::empty({batch_size_, seq_len_}, DType::i32),
          Tensor::empty({batch_size_, seq_len_}, DType::i32)};
  int32_t* in = b.inputs.data<int32_t>();
  int32_t* tg = b.targets.data<int32_t>();
  std::vector<int32_t> buf(static_cast<size_t>(seq_len_ + 1));
  for (int64_t i = 0; i < batch_size_; ++i) {
    files_[static_cast<size_t>(files[i])].read(starts[i], seq_len_ + 1, buf.data());
    std::copy(buf.begin(), buf.end() - 1, in + i * seq_len_);
    std::copy(buf.begin() + 1, buf.end(), tg + i * seq_len_);
  }
  return b;
}

Batch DataLoader::batch_at(uint64_t position) const {
  const uint64_t global_b = static_cast<uint64_t>(world_) * batch_size_;
  const uint64_t first = position * global_b + static_cast<uint64_t>(rank_) * batch_size_;
  std::vector<int> files(static_cast<size_t>(batch_size_));
  std::vector<int64_t> starts(static_cast<size_t>(batch_size_));
  for (int64_t i = 0; i < batch_size_; ++i) {
    files[i] = window_file(first + i);
    starts[i] = window_start(first + i);
  }
  return gather(files.data(), starts.data());
}

Batch DataLoader::next() {
  return batch_at(position_++);
}

int64_t DataLoader::num_eval_batches() const {
  XMOE_CHECK(files_.size() == 1, "[data] evaluation reads one token file, this loader mixes {}",
             files_.size());
  const int64_t windows = (file().size() - 1) / seq_len_;
  const int64_t global_b = world_ * batch_size_;
  return std::max<int64_t>(1, windows / global_b);
}

Batch DataLoader::eval_batch(int64_t i) const {
  XMOE_CHECK(i >= 0, "[data] eval batch {} < 0", i);
  XMOE_CHECK(files_.size() == 1, "[data] evaluation reads one token file, this loader mixes {}",
             files_.size());
  const int64_t windows = (file().size() - 1) / seq_len_;  // >= 1 by the constructor's check
  const int64_t first = (i * world_ + rank_) * batch_size_;
  std::vector<int> files(static_cast<size_t>(batch_size_), 0);
  std::vector<int64_t> starts(static_cast<size_t>(batch_size_));
  for (int64_t j = 0; j < batch_size_; ++j) starts[j] = ((first + j) % windows) * seq_len_;
  return gather(files.data(), starts.data());
}

}  // namespace xmoe::data
