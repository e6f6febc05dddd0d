// Causal self-attention with grouped-query heads, flash-style: nothing of size S x S is stored.
//
// Forward: a block of kWarps warps takes kWarps consecutive query rows of one (batch, head), one
// row per warp. Keys and values stream through shared memory in tiles of 32; lane j scores key
// j0 + j against its warp's query, the warp keeps an online softmax (running max m, sum l) and
// each lane accumulates the output dims lane, lane + 32, ... (head_dim <= 256: 8 per lane).
// Only lse = m + log l is saved for backward.
//
// Backward (no atomics, deterministic):
//   1. D_i = dout_i . out_i for every query row (one warp per row).
//   2. dq: same tiling as the forward; p_ij = exp(scale q_i.k_j - lse_i),
//      ds_ij = p_ij (dout_i.v_j - D_i) scale, dq_i = sum_j ds_ij k_j.
//   3. dk, dv: a warp per key row j of a kv head; query rows of every head of its group stream
//      through shared memory in tiles of 32: dv_j = sum p_ij dout_i, dk_j = sum ds_ij q_i.
// Math is f32 (storage f32 or bf16). bf16 goes to cuDNN's fused attention where the build has
// it and it takes the shape (cudnn/attention.cpp), else with head_dim 64 or 128 to the
// tensor-core kernels of flash_attention.cu; these take f32 (the CPU-parity path) and the rest.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "xmoe/backend/cuda/common.cuh"
#include "xmoe/core/env.h"

namespace xmoe::cuda {

namespace {

constexpr int kWarps = 4;  // rows per block, one per warp
constexpr int kTile = 32;  // rows per shared-memory tile, one per lane
constexpr int kDims = 8;   // head dims per lane: head_dim <= 32 * kDims
static_assert(32 * kDims == kAttentionMaxHeadDim);
constexpr int kThreads = kWarps * 32;

struct Dims {
  int seq, heads, kv_heads, hd;
  float scale;
  bool causal;
};

// Offset of row i, head h of a (B, S, heads, hd) tensor.
__device__ __forceinline__ int64_t row_offset(int b, int i, int h, int seq, int heads, int hd) {
  return ((static_cast<int64_t>(b) * seq + i) * heads + h) * hd;
}

// Loads rows r0 .. r0 + kTile of head h of a (B, S, heads, hd) tensor into a (kTile, ld) f32
// tile (rows past the end are zero).
template <class T>
__device__ __forceinline__ void load_tile(float* tile, int ld, const T* src, int b, int r0, int h,
                                          int seq, int heads, int hd) {
  for (int e = threadIdx.x; e < kTile * hd; e += blockDim.x) {
    const int rr = e / hd, d = e - rr * hd, r = r0 + rr;
    tile[rr * ld + d] = r < seq ? to_float(src[row_offset(b, r, h, seq, heads, hd) + d]) : 0.f;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(T* out, float* lse, const T* q, const T* k, const T* v, Dims p) {
  extern __shared__ float smem[];
  const int hd = p.hd, ld = hd + 1;  // +1: lane j reads row j of the K tile without conflicts
  float* ks = smem;                  // (kTile, ld)
  float* vs = ks + kTile * ld;       // (kTile, hd)
  float* qs = vs + kTile * hd;       // (kWarps, hd)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
  const int kvh = h / (p.heads / p.kv_heads);
  const int i0 = blockIdx.y * kWarps, i = i0 + warp;
  const bool active = i < p.seq;

  float* qw = qs + warp * hd;  // this warp's query row, pre-scaled
  for (int d = lane; d < hd; d += 32)
    qw[d] = active ? to_float(q[row_offset(b, i, h, p.seq, p.heads, hd) + d]) * p.scale : 0.f;

  float o[kDims];
#pragma unroll
  for (int t = 0; t < kDims; ++t) o[t] = 0.f;
  float m = -INFINITY, l = 0.f;
  const int key_end = p.causal ? min(p.seq, i0 + kWarps) : p.seq;  // keys this block needs
  for (int j0 = 0; j0 < key_end; j0 += kTile) {
    __syncthreads();  // the previous tile is consumed (and qw is written)
    load_tile(ks, ld, k, b, j0, kvh, p.seq, p.kv_heads, hd);
    load_tile(vs, hd, v, b, j0, kvh, p.seq, p.kv_heads, hd);
    __syncthreads();
    const int j = j0 + lane;
    float s = 0.f;
    for (int d = 0; d < hd; ++d) s += qw[d] * ks[lane * ld + d];
    const bool valid = j < p.seq && (!p.causal || j <= i);
    s = valid ? s : -INFINITY;
    const float m_new = fmaxf(m, warp_max(s));
    // Key 0 is valid for every row, so m_new is finite after the first tile; the guard keeps
    // exp(-inf - -inf) out of the sums all the same.
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    const float pj = valid ? expf(s - m_use) : 0.f;
    const float corr = expf(m - m_use);
    l = l * corr + warp_sum(pj);
#pragma unroll
    for (int t = 0; t < kDims; ++t) o[t] *= corr;
    for (int jj = 0; jj < kTile; ++jj) {
      const float pb = __shfl_sync(kFullMask, pj, jj);
#pragma unroll
      for (int t = 0; t < kDims; ++t) {
        const int d = lane + 32 * t;
        if (d < hd) o[t] += pb * vs[jj * hd + d];
      }
    }
    m = m_new;
  }
  if (active) {
    const float inv = 1.0f / l;
    const int64_t off = row_offset(b, i, h, p.seq, p.heads, hd);
#pragma unroll
    for (int t = 0; t < kDims; ++t) {
      const int d = lane + 32 * t;
      if (d < hd) out[off + d] = from_float<T>(o[t] * inv);
    }
    if (lane == 0) lse[(static_cast<int64_t>(b) * p.heads + h) * p.seq + i] = m + logf(l);
  }
}

// D (B, H, S) = dout . out per query row; one warp per row of the (B, S, H) layout.
template <class T>
__global__ void attention_dot_kernel(float* dsum, const T* out, const T* dout, int64_t rows,
                                     Dims p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       r < rows; r += warps) {
    float s = 0.f;
    for (int d = lane; d < p.hd; d += 32)
      s += to_float(out[r * p.hd + d]) * to_float(dout[r * p.hd + d]);
    s = warp_sum(s);
    if (lane == 0) {
      const int64_t h = r % p.heads, bi = r / p.heads, i = bi % p.seq, b = bi / p.seq;
      dsum[(b * p.heads + h) * p.seq + i] = s;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(T* dq, const T* q, const T* k, const T* v, const float* lse,
                        const float* dsum, const T* dout, Dims p) {
  extern __shared__ float smem[];
  const int hd = p.hd, ld = hd + 1;
  float* ks = smem;               // (kTile, ld)
  float* vs = ks + kTile * ld;    // (kTile, ld): lane j reads row j for dout . v_j
  float* qs = vs + kTile * ld;    // (kWarps, hd)
  float* dos = qs + kWarps * hd;  // (kWarps, hd)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
  const int kvh = h / (p.heads / p.kv_heads);
  const int i0 = blockIdx.y * kWarps, i = i0 + warp;
  const bool active = i < p.seq;
  const int64_t qoff = row_offset(b, active ? i : 0, h, p.seq, p.heads, hd);
  float* qw = qs + warp * hd;
  float* dow = dos + warp * hd;
  for (int d = lane; d < hd; d += 32) {
    qw[d] = active ? to_float(q[qoff + d]) : 0.f;
    dow[d] = active ? to_float(dout[qoff + d]) : 0.f;
  }
  const int64_t stat = (static_cast<int64_t>(b) * p.heads + h) * p.seq + (active ? i : 0);
  const float li = lse[stat], di = dsum[stat];

  float acc[kDims];
#pragma unroll
  for (int t = 0; t < kDims; ++t) acc[t] = 0.f;
  const int key_end = p.causal ? min(p.seq, i0 + kWarps) : p.seq;
  for (int j0 = 0; j0 < key_end; j0 += kTile) {
    __syncthreads();
    load_tile(ks, ld, k, b, j0, kvh, p.seq, p.kv_heads, hd);
    load_tile(vs, ld, v, b, j0, kvh, p.seq, p.kv_heads, hd);
    __syncthreads();
    const int j = j0 + lane;
    float s = 0.f, dp = 0.f;
    for (int d = 0; d < hd; ++d) {
      s += qw[d] * ks[lane * ld + d];
      dp += dow[d] * vs[lane * ld + d];
    }
    const bool valid = active && j < p.seq && (!p.causal || j <= i);
    const float pij = valid ? expf(p.scale * s - li) : 0.f;
    const float ds = pij * (dp - di) * p.scale;
    for (int jj = 0; jj < kTile; ++jj) {
      const float dsb = __shfl_sync(kFullMask, ds, jj);
#pragma unroll
      for (int t = 0; t < kDims; ++t) {
        const int d = lane + 32 * t;
        if (d < hd) acc[t] += dsb * ks[jj * ld + d];
      }
    }
  }
  if (active) {
#pragma unroll
    for (int t = 0; t < kDims; ++t) {
      const int d = lane + 32 * t;
      if (d < hd) dq[qoff + d] = from_float<T>(acc[t]);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(T* dk, T* dv, const T* q, const T* k, const T* v, const float* lse,
                          const float* dsum, const T* dout, Dims p) {
  extern __shared__ float smem[];
  const int hd = p.hd, ld = hd + 1;
  float* qt = smem;              // (kTile, ld) query rows
  float* dot = qt + kTile * ld;  // (kTile, ld) their dout rows
  float* kw = dot + kTile * ld;  // (kWarps, hd)
  float* vw = kw + kWarps * hd;  // (kWarps, hd)
  float* lt = vw + kWarps * hd;  // (kTile) lse of the tile's rows
  float* dt = lt + kTile;        // (kTile) D of the tile's rows
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.x / p.kv_heads, kvh = blockIdx.x % p.kv_heads;
  const int group = p.heads / p.kv_heads;
  const int j0 = blockIdx.y * kWarps, j = j0 + warp;
  const bool active = j < p.seq;
  const int64_t koff = row_offset(b, active ? j : 0, kvh, p.seq, p.kv_heads, hd);
  float* kr = kw + warp * hd;
  float* vr = vw + warp * hd;
  for (int d = lane; d < hd; d += 32) {
    kr[d] = active ? to_float(k[koff + d]) : 0.f;
    vr[d] = active ? to_float(v[koff + d]) : 0.f;
  }
  float dk_acc[kDims], dv_acc[kDims];
#pragma unroll
  for (int t = 0; t < kDims; ++t) dk_acc[t] = dv_acc[t] = 0.f;

  const int query_begin = p.causal ? j0 : 0;  // with a causal mask only rows i >= j see key j
  for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
    const int64_t stat_base = (static_cast<int64_t>(b) * p.heads + h) * p.seq;
    for (int r0 = query_begin; r0 < p.seq; r0 += kTile) {
      __syncthreads();
      load_tile(qt, ld, q, b, r0, h, p.seq, p.heads, hd);
      load_tile(dot, ld, dout, b, r0, h, p.seq, p.heads, hd);
      if (threadIdx.x < kTile) {
        const int r = r0 + threadIdx.x;
        lt[threadIdx.x] = r < p.seq ? lse[stat_base + r] : 0.f;
        dt[threadIdx.x] = r < p.seq ? dsum[stat_base + r] : 0.f;
      }
      __syncthreads();
      const int i = r0 + lane;
      float s = 0.f, dp = 0.f;
      for (int d = 0; d < hd; ++d) {
        s += qt[lane * ld + d] * kr[d];
        dp += dot[lane * ld + d] * vr[d];
      }
      const bool valid = active && i < p.seq && (!p.causal || i >= j);
      const float pij = valid ? expf(p.scale * s - lt[lane]) : 0.f;
      const float ds = pij * (dp - dt[lane]) * p.scale;
      for (int ii = 0; ii < kTile; ++ii) {
        const float pb = __shfl_sync(kFullMask, pij, ii);
        const float dsb = __shfl_sync(kFullMask, ds, ii);
#pragma unroll
        for (int t = 0; t < kDims; ++t) {
          const int d = lane + 32 * t;
          if (d < hd) {
            dv_acc[t] += pb * dot[ii * ld + d];
            dk_acc[t] += dsb * qt[ii * ld + d];
          }
        }
      }
    }
  }
  if (active) {
#pragma unroll
    for (int t = 0; t < kDims; ++t) {
      const int d = lane + 32 * t;
      if (d < hd) {
        dk[koff + d] = from_float<T>(dk_acc[t]);
        dv[koff + d] = from_float<T>(dv_acc[t]);
      }
    }
  }
}

Dims make_dims(int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
               bool causal) {
  if (head_dim < 1 || head_dim > kAttentionMaxHeadDim)
    fail("[attention] head_dim must be in [1, 256] for the CUDA kernels");
  if (seq >= (int64_t{1} << 30) || heads >= (int64_t{1} << 20))
    fail("[attention] sequence or head count too large for the CUDA kernels");
  return {static_cast<int>(seq),
          static_cast<int>(heads),
          static_cast<int>(kv_heads),
          static_cast<int>(head_dim),
          scale,
          causal};
}

// Grid: x = (batch, head) pairs, y = blocks of kWarps rows.
dim3 grid_of(int64_t pairs, int64_t seq) {
  const int64_t row_blocks = (seq + kWarps - 1) / kWarps;
  if (pairs >= (int64_t{1} << 31) || row_blocks > 65535)
    fail("[attention] batch * heads or sequence length too large for the CUDA grid");
  return dim3(static_cast<unsigned>(pairs), static_cast<unsigned>(row_blocks));
}

// Dynamic shared memory above 48 KiB must be opted into per kernel.
template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(bytes)));
}

AttentionBackend backend_from_env() {
  return env::choice("XMOE_ATTENTION") == "native" ? AttentionBackend::native
                                                   : AttentionBackend::cudnn;
}

std::atomic<AttentionBackend>& backend_setting() {
  static std::atomic<AttentionBackend> backend{backend_from_env()};
  return backend;
}

// cuDNN takes bf16 with head_dim a multiple of 8 up to 128 (its fused kernels' limit).
bool cudnn_candidate(DType dt, int64_t head_dim) {
  return attention_backend() == AttentionBackend::cudnn && dt == DType::bf16 && head_dim % 8 == 0 &&
         head_dim <= 128 && cudnn_attention_available();
}

CudnnAttentionShape cudnn_shape(int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                                int64_t head_dim, float scale, bool causal) {
  return CudnnAttentionShape{batch, seq, heads, kv_heads, head_dim, scale, causal};
}

// The scale the ops pass (1 / sqrt(head_dim)): workspace queries come before the call.
float default_scale(int64_t head_dim) {
  return 1.0f / std::sqrt(static_cast<float>(head_dim));
}

}  // namespace

AttentionBackend attention_backend() {
  return backend_setting().load();
}
void set_attention_backend(AttentionBackend backend) {
  backend_setting().store(backend);
}

const char* attention_impl(DType dt, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, bool causal) {
  size_t bytes = 0;
  if (cudnn_candidate(dt, head_dim) &&
      cudnn_attention_forward_ready(
          cudnn_shape(batch, seq, heads, kv_heads, head_dim, default_scale(head_dim), causal),
          &bytes))
    return "cudnn";
  return flash_attention_supported(dt, head_dim) ? "flash" : "cuda-core";
}

size_t attention_forward_workspace_bytes(DType dt, int64_t batch, int64_t seq, int64_t heads,
                                         int64_t kv_heads, int64_t head_dim, bool causal) {
  size_t bytes = 0;
  if (batch * seq * heads > 0 && cudnn_candidate(dt, head_dim))
    cudnn_attention_forward_ready(
        cudnn_shape(batch, seq, heads, kv_heads, head_dim, default_scale(head_dim), causal),
        &bytes);
  return bytes;
}

void attention_forward(void* out, float* lse, const void* q, const void* k, const void* v, DType dt,
                       int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, float scale, bool causal, void* workspace, Stream stream) {
  if (batch * seq * heads == 0) return;
  if (cudnn_candidate(dt, head_dim) && aligned16({out, q, k, v})) {
    const CudnnAttentionShape shape =
        cudnn_shape(batch, seq, heads, kv_heads, head_dim, scale, causal);
    size_t bytes = 0;
    if (cudnn_attention_forward_ready(shape, &bytes) && (bytes == 0 || workspace != nullptr))
      return cudnn_attention_forward(shape, out, lse, q, k, v, workspace, stream);
  }
  if (flash_attention_supported(dt, head_dim) && aligned16({out, q, k, v}))
    return flash_attention_forward(out, lse, q, k, v, batch, seq, heads, kv_heads, head_dim, scale,
                                   causal, stream);
  const Dims p = make_dims(seq, heads, kv_heads, head_dim, scale, causal);
  const size_t smem = sizeof(float) * (kTile * (p.hd + 1) + kTile * p.hd + kWarps * p.hd);
  dispatch_float(dt, "attention", [&](auto tag) {
    using T = typename decltype(tag)::type;
    allow_smem(attention_forward_kernel<T>, smem);
    attention_forward_kernel<T><<<grid_of(batch * heads, seq), kThreads, smem, stream>>>(
        static_cast<T*>(out), lse, static_cast<const T*>(q), static_cast<const T*>(k),
        static_cast<const T*>(v), p);
    CUDA_CHECK_LAUNCH();
  });
}

size_t attention_backward_workspace_bytes(DType dt, int64_t batch, int64_t seq, int64_t heads,
                                          int64_t kv_heads, int64_t head_dim, bool causal) {
  const size_t native = static_cast<size_t>(batch * heads * seq) * sizeof(float);  // D (B, H, S)
  size_t bytes = 0;
  if (batch * seq * heads > 0 && cudnn_candidate(dt, head_dim) &&
      cudnn_attention_backward_ready(
          cudnn_shape(batch, seq, heads, kv_heads, head_dim, default_scale(head_dim), causal),
          &bytes))
    return std::max(native, bytes);
  return native;
}

void attention_backward(void* dq, void* dk, void* dv, const void* q, const void* k, const void* v,
                        const void* out, const float* lse, const void* dout, DType dt,
                        int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, float scale, bool causal, void* workspace,
                        Stream stream) {
  if (batch * seq * heads == 0) return;
  if (cudnn_candidate(dt, head_dim) && aligned16({dq, dk, dv, q, k, v, out, dout})) {
    const CudnnAttentionShape shape =
        cudnn_shape(batch, seq, heads, kv_heads, head_dim, scale, causal);
    size_t bytes = 0;
    if (cudnn_attention_backward_ready(shape, &bytes) && (bytes == 0 || workspace != nullptr))
      return cudnn_attention_backward(shape, dq, dk, dv, q, k, v, out, lse, dout, workspace,
                                      stream);
  }
  if (flash_attention_supported(dt, head_dim) && aligned16({dq, dk, dv, q, k, v, out, dout}))
    return flash_attention_backward(dq, dk, dv, q, k, v, out, lse, dout, batch, seq, heads,
                                    kv_heads, head_dim, scale, causal, workspace, stream);
  const Dims p = make_dims(seq, heads, kv_heads, head_dim, scale, causal);
  auto* dsum = static_cast<float*>(workspace);  // D (B, H, S)
  const int64_t rows = batch * seq * heads;
  const size_t smem_dq = sizeof(float) * (2 * kTile * (p.hd + 1) + 2 * kWarps * p.hd);
  const size_t smem_dkdv = sizeof(float) * (2 * kTile * (p.hd + 1) + 2 * kWarps * p.hd + 2 * kTile);
  dispatch_float(dt, "attention_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* tq = static_cast<const T*>(q);
    const T* tk = static_cast<const T*>(k);
    const T* tv = static_cast<const T*>(v);
    const T* tdout = static_cast<const T*>(dout);
    attention_dot_kernel<T><<<grid_for(rows, kBlock / 32), kBlock, 0, stream>>>(
        dsum, static_cast<const T*>(out), tdout, rows, p);
    CUDA_CHECK_LAUNCH();
    allow_smem(attention_dq_kernel<T>, smem_dq);
    attention_dq_kernel<T><<<grid_of(batch * heads, seq), kThreads, smem_dq, stream>>>(
        static_cast<T*>(dq), tq, tk, tv, lse, dsum, tdout, p);
    CUDA_CHECK_LAUNCH();
    allow_smem(attention_dkdv_kernel<T>, smem_dkdv);
    attention_dkdv_kernel<T><<<grid_of(batch * kv_heads, seq), kThreads, smem_dkdv, stream>>>(
        static_cast<T*>(dk), static_cast<T*>(dv), tq, tk, tv, lse, dsum, tdout, p);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
