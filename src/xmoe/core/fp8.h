#pragma once
// FP8 E4M3 (OCP "e4m3fn": bias 7, no infinities, 0x7f/0xff NaN, largest finite 448) on the host.
// Stored as u8 tensors: xmoe has no fp8 dtype, only the expert GEMMs read these bytes
// (model.moe.expert_dtype = fp8, docs/fp8.md). The conversion rounds to nearest even and
// saturates to +-448 like CUDA's __nv_cvt_float_to_fp8(..., __NV_SATFINITE, __NV_E4M3), so the
// CPU quantiser writes the bytes the GPU's writes.
#include <cmath>
#include <cstdint>

namespace xmoe::fp8 {

/// Largest finite e4m3 value.
constexpr float kE4m3Max = 448.f;
/// Elements per quantisation block: 1 x 128 for activations, 128 x 128 for weights
/// (DeepSeek-V3's recipe).
constexpr int64_t kBlock = 128;

/// f -> e4m3 bits: round to nearest even, saturate finite values to +-448, NaN to NaN.
inline uint8_t e4m3_from_float(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return 0x7f | sign;
  const float a = std::fabs(f);
  if (a >= kE4m3Max) return sign | 0x7e;   // satfinite (infinities included)
  constexpr float kMinNormal = 0.015625f;  // 2^-6
  if (a < kMinNormal) {
    // Subnormals: m / 8 * 2^-6, m in [0, 8]; m = 8 is the smallest normal, whose bits are 0x08.
    const auto m = static_cast<uint8_t>(std::nearbyint(a * 512.f));  // a / 2^-9, exact scaling
    return sign | m;
  }
  int e = 0;
  const float frac = std::frexp(a, &e);  // a = frac * 2^e, frac in [0.5, 1)
  // a = (1 + q / 8) * 2^(e - 1); q rounded to nearest even on the 3 mantissa bits.
  auto q = static_cast<int>(std::nearbyint((frac * 2.f - 1.f) * 8.f));
  int exponent = e - 1 + 7;
  if (q == 8) {
    q = 0;
    ++exponent;
  }
  if (exponent > 15 || (exponent == 15 && q == 7)) return sign | 0x7e;  // rounded past 448
  return static_cast<uint8_t>(sign | (exponent << 3) | q);
}

/// e4m3 bits -> f (exact).
inline float e4m3_to_float(uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.f : 1.f;
  const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
  if (exponent == 15 && mantissa == 7) return NAN;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(1.f + static_cast<float>(mantissa) / 8.f, exponent - 7);
}

/// A block's scale and its reciprocal from the block's largest magnitude: elements are stored
/// as x * inverse, read as q * scale. An all-zero block gets scale 1.
struct BlockScale {
  float scale = 1.f, inverse = 1.f;
};
inline BlockScale block_scale(float amax) {
  if (!(amax > 0.f) || std::isinf(amax)) return {};
  return {amax / kE4m3Max, kE4m3Max / amax};
}

}  // namespace xmoe::fp8
