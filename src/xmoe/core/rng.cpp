#include "xmoe/core/rng.h"

#include <cmath>

namespace xmoe {

namespace {

constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

inline float to_unit(uint32_t x) {
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f);
}

}  // namespace

std::array<uint32_t, 4> Philox::block(uint64_t seed, uint64_t stream, uint64_t counter) {
  uint32_t c[4] = {static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32),
                   static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c[0], hi0, lo0);
    mulhilo(kMul1, c[2], hi1, lo1);
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {c[0], c[1], c[2], c[3]};
}

float Philox::uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return to_unit(block(seed, stream, index)[0]);
}

float Philox::normal(uint64_t seed, uint64_t stream, uint64_t index) {
  const auto b = block(seed, stream, index);
  // u1 in (0, 1] so log() is finite.
  const float u1 = (static_cast<float>(b[0] >> 8) + 1.0f) * (1.0f / 16777216.0f);
  const float u2 = to_unit(b[1]);
  return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.283185307179586f * u2);
}

uint64_t stream_id(std::string_view name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

void fill_normal(Tensor& t, uint64_t seed, uint64_t stream, float std, float mean,
                 uint64_t offset) {
  XMOE_CHECK(t.is_cpu() && t.dtype() == DType::f32, "[fill_normal] needs an f32 CPU tensor, got {}",
             t.str());
  float* p = t.data<float>();
  const int64_t n = t.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i)
    p[i] = mean + std * Philox::normal(seed, stream, offset + static_cast<uint64_t>(i));
}

void fill_uniform(Tensor& t, uint64_t seed, uint64_t stream, float lo, float hi, uint64_t offset) {
  XMOE_CHECK(t.is_cpu() && t.dtype() == DType::f32,
             "[fill_uniform] needs an f32 CPU tensor, got {}", t.str());
  float* p = t.data<float>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i)
    p[i] = lo + (hi - lo) * Philox::uniform(seed, stream, offset + static_cast<uint64_t>(i));
}

uint64_t Rng::below(uint64_t n) {
  XMOE_CHECK(n > 0, "[rng] below(0)");
  const auto b = Philox::block(seed_, stream_, offset_++);
  const uint64_t x = (static_cast<uint64_t>(b[0]) << 32) | b[1];
  return x % n;
}

}  // namespace xmoe
