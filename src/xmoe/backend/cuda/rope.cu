// Rotary position embedding in place on x (B, S, H, hd), rotate-half pairs (j, j + hd/2):
//   y[j] = x[j] cos - x[j + hd/2] sin,  y[j + hd/2] = x[j + hd/2] cos + x[j] sin
// (sin negated for the inverse, which is the backward). One thread per pair.
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

}  // namespace

void rope_apply(void* x, DType dt, const float* cos_table, const float* sin_table, int64_t batch,
                int64_t seq, int64_t heads, int64_t head_dim, bool inverse, Stream stream) {
  const int64_t half = head_dim / 2;
  const int64_t pairs = batch * seq * heads * half;
  if (pairs == 0) return;
  dispatch_float(dt, "rope", [&](auto tag) {
    using T = typename decltype(tag)::type;
    rope_kernel<T><<<grid_for(pairs), kBlock, 0, stream>>>(
        static_cast<T*>(x), cos_table, sin_table, seq, heads, half, pairs, inverse ? -1.f : 1.f);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
