// Rotary position embedding in place on x (B, S, H, hd), rotate-half pairs (j, j + hd/2):
//   y[j] = x[j] cos - x[j + hd/2] sin,  y[j + hd/2] = x[j + hd/2] cos + x[j] sin
// (sin negated for the inverse, which is the backward). One thread per pair, or per 8 pairs
// with 16-byte accesses where hd/2 % 8 == 0 and the pointers are aligned (the same math).
#include "xmoe/backend/cuda/common.cuh"

namespace xmoe::cuda {

namespace {

template <class T>
__global__ void rope_kernel(T* x, const float* cos_table, const float* sin_table, int64_t seq,
                            int64_t heads, int64_t half, int64_t pairs, float sign) {
  XMOE_GRID_STRIDE(p, pairs) {
    const int64_t j = p % half;
    const int64_t row_head = p / half;           // (b * S + s) * H + h
    const int64_t s = (row_head / heads) % seq;  // position inside its sequence
    T* x1 = x + row_head * 2 * half + j;
    T* x2 = x1 + half;
    const float c = cos_table[s * half + j], sn = sign * sin_table[s * half + j];
    const float a = to_float(*x1), b = to_float(*x2);
    *x1 = from_float<T>(a * c - b * sn);
    *x2 = from_float<T>(b * c + a * sn);
  }
}

// 8 pairs per thread (half % 8 == 0, 16-byte aligned): the same math as rope_kernel with
// 16-byte accesses; p8 counts groups of 8 pairs.
template <class T>
__global__ void rope_vec_kernel(T* x, const float* cos_table, const float* sin_table, int64_t seq,
                                int64_t heads, int64_t half, int64_t groups, float sign) {
  const int64_t half8 = half / 8;
  XMOE_GRID_STRIDE(p8, groups) {
    const int64_t row_head = p8 / half8;  // (b * S + s) * H + h
    const int64_t j = (p8 - row_head * half8) * 8;
    const int64_t s = (row_head / heads) % seq;
    T* x1 = x + row_head * 2 * half + j;
    T* x2 = x1 + half;
    float a[8], b[8], c[8], sn[8], y1[8], y2[8];
    load8(a, x1);
    load8(b, x2);
    load8(c, cos_table + s * half + j);
    load8(sn, sin_table + s * half + j);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float se = sign * sn[e];
      y1[e] = a[e] * c[e] - b[e] * se;
      y2[e] = b[e] * c[e] + a[e] * se;
    }
    store8(x1, y1);
    store8(x2, y2);
  }
}

}  // namespace

void rope_apply(void* x, DType dt, const float* cos_table, const float* sin_table, int64_t batch,
                int64_t seq, int64_t heads, int64_t head_dim, bool inverse, Stream stream) {
  const int64_t half = head_dim / 2;
  const int64_t pairs = batch * seq * heads * half;
  if (pairs == 0) return;
  dispatch_float(dt, "rope", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const float sign = inverse ? -1.f : 1.f;
    if (half % 8 == 0 && aligned16({x, cos_table, sin_table})) {
      rope_vec_kernel<T><<<grid_for(pairs / 8), kBlock, 0, stream>>>(
          static_cast<T*>(x), cos_table, sin_table, seq, heads, half, pairs / 8, sign);
    } else {
      rope_kernel<T><<<grid_for(pairs), kBlock, 0, stream>>>(
          static_cast<T*>(x), cos_table, sin_table, seq, heads, half, pairs, sign);
    }
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
