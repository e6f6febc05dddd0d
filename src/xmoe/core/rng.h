#pragma once
// Counter-based RNG (Philox-4x32-10, Salmon et al. 2011). A value depends only on
// (seed, stream, index), never on how many processes or threads produced it, so a parameter
// initialised on 1 rank or sharded over 8 gets the same numbers, on the CPU or the GPU.
#include <array>
#include <cstdint>

#include "xmoe/core/tensor.h"

namespace xmoe {

struct Philox {
  /// Four 32-bit random words for counter (c0, c1, c2, c3) under key (k0, k1).
  static std::array<uint32_t, 4> block(uint64_t seed, uint64_t stream, uint64_t counter);
  /// Uniform in [0, 1) for element `index` of `stream`.
  static float uniform(uint64_t seed, uint64_t stream, uint64_t index);
  /// Standard normal for element `index` of `stream` (Box-Muller on one Philox block).
  static float normal(uint64_t seed, uint64_t stream, uint64_t index);
};

/// Stable 64-bit id for a named stream (FNV-1a), e.g. a parameter's name.
uint64_t stream_id(std::string_view name);

/// Fills an f32 CPU tensor: element i = mean + std * normal(seed, stream, offset + i).
void fill_normal(Tensor& t, uint64_t seed, uint64_t stream, float std, float mean = 0.f,
                 uint64_t offset = 0);
/// Fills an f32 CPU tensor with uniform values in [lo, hi).
void fill_uniform(Tensor& t, uint64_t seed, uint64_t stream, float lo, float hi,
                  uint64_t offset = 0);

/// Sequential generator for sampling and data order; its whole state is (seed, stream, offset),
/// which checkpoints save.
class Rng {
 public:
  Rng(uint64_t seed = 0, uint64_t stream = 0, uint64_t offset = 0)
      : seed_(seed), stream_(stream), offset_(offset) {}
  float uniform() { return Philox::uniform(seed_, stream_, offset_++); }
  float normal() { return Philox::normal(seed_, stream_, offset_++); }
  /// Uniform integer in [0, n).
  uint64_t below(uint64_t n);
  uint64_t seed() const { return seed_; }
  uint64_t stream() const { return stream_; }
  uint64_t offset() const { return offset_; }

 private:
  uint64_t seed_, stream_, offset_;
};

}  // namespace xmoe
