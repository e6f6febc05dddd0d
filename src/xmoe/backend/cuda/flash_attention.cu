// Causal self-attention on tensor cores (bf16 in, f32 accumulation): FlashAttention-2 style,
// written for sm_80+ `mma.sync.m16n8k16` with `ldmatrix` and `cp.async` double buffering.
// Layouts as the CUDA-core kernels of attention.cu: q/out/dout (B, S, H, hd), k/v (B, S, Hkv, hd),
// lse (B, H, S) in natural-log units. Nothing of size S x S touches device memory.
//
// A block is 4 warps; a warp owns 16 rows of the block's 64-row tile, the other operand streams
// through shared memory in tiles of 64 rows (two buffers: the copy of tile t+1 overlaps the math
// of tile t).
//   forward  (block = 64 queries of one head): S = Q K^T, online softmax, O += P V.
//   dk, dv   (block = 64 keys of one kv head; every query head of its group and every query tile
//             that sees the keys streams by): S^T = K Q^T, P^T = exp(S^T - lse),
//             dP^T = V dO^T, dS^T = P^T (dP^T - D), dV += P^T dO, dK += dS^T Q.
//   dq       (block = 64 queries of one head): S = Q K^T, P, dP = dO V^T, dS, dQ += dS K.
// Splitting dq from dk/dv recomputes S and dP once more (7 matrix products where atomics would
// need 5) but keeps backward free of atomics: every result is summed in a fixed order, so runs
// are bitwise repeatable, like every other xmoe kernel.
#include "xmoe/backend/cuda/common.cuh"

namespace xmoe::cuda {

namespace {

constexpr int kRows = 64;  // rows of a tile (queries or keys)
constexpr int kWarps = 4;  // 16 rows per warp
constexpr int kThreads = 32 * kWarps;
constexpr int kPad = 8;  // bf16 per smem row beyond head_dim: 16 B, so ldmatrix rows hit
                         // distinct banks
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct FlashDims {
  int seq, heads, kv_heads;
  float scale_log2;  // softmax scale * log2(e): scores go straight into exp2
  float scale;
  bool causal;
};

// ---- PTX wrappers --------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_bytes = 0 fills the 16 bytes with zeros.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c (16x8 f32) += a (16x16 bf16, row) * b (16x8 bf16, col).
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---- tiles -----------------------------------------------------------------------------------
// Fragment layouts of m16n8k16 (g = lane / 4, t = lane % 4):
//   A 16x16: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16x8:  b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C 16x8:  c0 c1 (g, 2t..2t+1), c2 c3 (g+8, 2t..2t+1)

template <int HD>
struct Tile {
  static constexpr int kLd = HD + kPad;  // bf16 per smem row
  static constexpr int kElems = kRows * kLd;
};

// Query rows per warp, in m16 tiles: a B fragment read from shared memory feeds MT products.
// Two halve the shared-memory traffic per product (which bounds these kernels) where the
// registers allow it (head_dim 64); head_dim 128 keeps one.
template <int HD>
constexpr int kMTiles = HD <= 64 ? 2 : 1;
template <int HD>
constexpr int kQueryRows = 16 * kMTiles<HD>* kWarps;  // per block

// Copies rows r0 .. r0 + ROWS of head `h` of a (B, S, heads, HD) tensor into a smem tile; rows
// past `seq` become zeros.
template <int HD, int ROWS = kRows>
__device__ __forceinline__ void load_tile_async(bf16_t* tile, const bf16_t* src, int b, int r0,
                                                int h, int seq, int heads) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  for (int c = threadIdx.x; c < ROWS * kChunks; c += kThreads) {
    const int rr = c / kChunks, cc = c % kChunks, r = r0 + rr;
    const bool in = r < seq;
    const bf16_t* g =
        src + ((static_cast<int64_t>(b) * seq + (in ? r : 0)) * heads + h) * HD + cc * 8;
    cp_async_16(tile + rr * Tile<HD>::kLd + cc * 8, g, in ? 16 : 0);
  }
}

// A fragment of rows m0 .. m0+15, cols k0 .. k0+15 of a row-major smem tile.
template <int HD>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16_t* tile, int m0, int k0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4(a, tile + (m0 + (lane & 15)) * Tile<HD>::kLd + k0 + (lane >> 4) * 8);
}
// B fragments of two n-tiles (n0 .. n0+15) x k0 .. k0+15 from a tile stored n-major (rows = n,
// cols = k, e.g. K for Q K^T): b[0], b[1] for n0 .. n0+7 and b[2], b[3] for n0+8 .. n0+15.
template <int HD>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const bf16_t* tile, int n0, int k0) {
  const int lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
  ldmatrix_x4(b, tile + (n0 + r + ((mi >> 1) << 3)) * Tile<HD>::kLd + k0 + (mi & 1) * 8);
}
// The same from a tile stored k-major (rows = k, cols = n, e.g. V for P V).
template <int HD>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const bf16_t* tile, int k0, int n0) {
  const int lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
  ldmatrix_x4_trans(b, tile + (k0 + r + (mi & 1) * 8) * Tile<HD>::kLd + n0 + (mi >> 1) * 8);
}

// acc[MT][16 x 64] = A_w[16 MT x HD] * B^T where B is a 64 x HD tile stored n-major (rows = n).
// The A rows are the warp's rows a_row0 .. a_row0 + 16 MT of `a_tile`.
template <int HD, int MT>
__device__ __forceinline__ void mm_rows_by_tile(float (&acc)[MT][kRows / 8][4],
                                                const bf16_t* a_tile, int a_row0,
                                                const bf16_t* b_tile) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n)
      acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) load_a<HD>(a[m], a_tile, a_row0 + 16 * m, kk * 16);
#pragma unroll
    for (int nn = 0; nn < kRows / 16; ++nn) {
      uint32_t b[4];
      load_b_nk<HD>(b, b_tile, nn * 16, kk * 16);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma(acc[m][2 * nn], a[m], b[0], b[1]);
        mma(acc[m][2 * nn + 1], a[m], b[2], b[3]);
      }
    }
  }
}

// out[MT][16 x HD] += P[MT][16 x 64] (f32 accumulators, rounded to bf16) * B where B is a 64 x HD
// tile stored k-major (rows = the 64 of P's columns).
template <int HD, int MT>
__device__ __forceinline__ void mm_acc_by_tile(float (&out)[MT][HD / 8][4],
                                               const float (&p)[MT][kRows / 8][4],
                                               const bf16_t* b_tile) {
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) {
    // The accumulators of n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk.
    uint32_t a[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      a[m][0] = pack_bf16(p[m][2 * kk][0], p[m][2 * kk][1]);
      a[m][1] = pack_bf16(p[m][2 * kk][2], p[m][2 * kk][3]);
      a[m][2] = pack_bf16(p[m][2 * kk + 1][0], p[m][2 * kk + 1][1]);
      a[m][3] = pack_bf16(p[m][2 * kk + 1][2], p[m][2 * kk + 1][3]);
    }
#pragma unroll
    for (int nd = 0; nd < HD / 16; ++nd) {
      uint32_t b[4];
      load_b_kn<HD>(b, b_tile, kk * 16, nd * 16);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma(out[m][2 * nd], a[m], b[0], b[1]);
        mma(out[m][2 * nd + 1], a[m], b[2], b[3]);
      }
    }
  }
}

// Writes a warp's 16 x HD accumulators (times `scale`) as bf16 rows row0 .. row0+15 of head h.
template <int HD>
__device__ __forceinline__ void store_rows(bf16_t* dst, const float (&acc)[HD / 8][4], float s0,
                                           float s1, int b, int row0, int h, int seq, int heads) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + g + half * 8;
    if (r >= seq) continue;
    const float s = half ? s1 : s0;
    bf16_t* row = dst + ((static_cast<int64_t>(b) * seq + r) * heads + h) * HD;
#pragma unroll
    for (int nd = 0; nd < HD / 8; ++nd)
      *reinterpret_cast<uint32_t*>(row + nd * 8 + 2 * t) =
          pack_bf16(acc[nd][2 * half] * s, acc[nd][2 * half + 1] * s);
  }
}

// Whether (row i, col j) of a score tile counts.
__device__ __forceinline__ bool visible(int i, int j, const FlashDims& p) {
  return j < p.seq && i < p.seq && (!p.causal || j <= i);
}

// Starts the copy of the next K/V tile (rows j_next ..) into buffer buf ^ 1, if there is one,
// then waits for tile `buf` (whose copy was started one step earlier) and for every warp.
// buf ^ 1 was last read in the previous step, which ended at a barrier.
template <int HD>
__device__ __forceinline__ void next_kv_tile(bf16_t* ks, bf16_t* vs, const bf16_t* k,
                                             const bf16_t* v, int buf, bool more, int b, int j_next,
                                             int kvh, const FlashDims& p) {
  if (more) {
    load_tile_async<HD>(ks + (buf ^ 1) * Tile<HD>::kElems, k, b, j_next, kvh, p.seq, p.kv_heads);
    load_tile_async<HD>(vs + (buf ^ 1) * Tile<HD>::kElems, v, b, j_next, kvh, p.seq, p.kv_heads);
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
}

// ---- forward ---------------------------------------------------------------------------------

// Online softmax of one m16 tile's scores (already in log2 units, masked to -inf) against the
// running max m and partial sums l of rows g and g + 8; rescales o and turns s into P.
template <int HD>
__device__ __forceinline__ void online_softmax(float (&s)[kRows / 8][4], float (&o)[HD / 8][4],
                                               float& m0, float& m1, float& l0, float& l1) {
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int n = 0; n < kRows / 8; ++n) {
    mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
    mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
  }
  // The four lanes of a quad hold one row.
  mx0 = fmaxf(mx0, __shfl_xor_sync(kFullMask, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(kFullMask, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(kFullMask, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(kFullMask, mx1, 2));
  const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  // A row with no visible key so far keeps m = -inf; exp2(-inf - 0) = 0 keeps it empty.
  const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
  const float c0 = exp2f(m0 - mu0), c1 = exp2f(m1 - mu1);
  m0 = mn0;
  m1 = mn1;
  float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
  for (int n = 0; n < kRows / 8; ++n) {
    s[n][0] = exp2f(s[n][0] - mu0);
    s[n][1] = exp2f(s[n][1] - mu0);
    s[n][2] = exp2f(s[n][2] - mu1);
    s[n][3] = exp2f(s[n][3] - mu1);
    sum0 += s[n][0] + s[n][1];
    sum1 += s[n][2] + s[n][3];
  }
  l0 = l0 * c0 + sum0;  // per-lane partial sums; the quad adds them at the end
  l1 = l1 * c1 + sum1;
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    o[n][0] *= c0;
    o[n][1] *= c0;
    o[n][2] *= c1;
    o[n][3] *= c1;
  }
}

template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k, const bf16_t* v,
                         FlashDims p) {
  constexpr int MT = kMTiles<HD>, BQ = kQueryRows<HD>;
  constexpr int kQElems = BQ * Tile<HD>::kLd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t* qs = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* ks = qs + kQElems;               // [2] tiles
  bf16_t* vs = ks + 2 * Tile<HD>::kElems;  // [2] tiles
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // Heavy (late, causal) query tiles first: they finish last otherwise.
  const int qtile = gridDim.x - 1 - blockIdx.x;
  const int b = blockIdx.y / p.heads, h = blockIdx.y % p.heads;
  const int kvh = h / (p.heads / p.kv_heads);
  const int i0 = qtile * BQ, wrow = warp * 16 * MT;

  load_tile_async<HD, BQ>(qs, q, b, i0, h, p.seq, p.heads);
  load_tile_async<HD>(ks, k, b, 0, kvh, p.seq, p.kv_heads);
  load_tile_async<HD>(vs, v, b, 0, kvh, p.seq, p.kv_heads);
  cp_async_commit();

  float o[MT][HD / 8][4];
  float m[MT][2], l[MT][2];  // rows g and g + 8 of each m-tile
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }

  const int key_end = p.causal ? min(p.seq, i0 + BQ) : p.seq;
  const int tiles = (key_end + kRows - 1) / kRows;
  for (int tile = 0; tile < tiles; ++tile) {
    const int buf = tile & 1, j0 = tile * kRows;
    next_kv_tile<HD>(ks, vs, k, v, buf, tile + 1 < tiles, b, j0 + kRows, kvh, p);
    const bf16_t* kt = ks + buf * Tile<HD>::kElems;
    const bf16_t* vt = vs + buf * Tile<HD>::kElems;

    float s[MT][kRows / 8][4];
    mm_rows_by_tile<HD, MT>(s, qs, wrow, kt);
    const bool masked = (p.causal && j0 + kRows > i0) || j0 + kRows > p.seq;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int r0 = i0 + wrow + 16 * mt + g;
#pragma unroll
      for (int n = 0; n < kRows / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mt][n][e] * p.scale_log2;
          if (masked && !visible(r0 + (e >> 1) * 8, j0 + n * 8 + 2 * t + (e & 1), p)) x = -INFINITY;
          s[mt][n][e] = x;
        }
      online_softmax<HD>(s[mt], o[mt], m[mt][0], m[mt][1], l[mt][0], l[mt][1]);
    }
    mm_acc_by_tile<HD, MT>(o, s, vt);
    __syncthreads();  // every warp is done with `buf` before the next prefetch overwrites it
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float l0 = l[mt][0], l1 = l[mt][1];
    l0 += __shfl_xor_sync(kFullMask, l0, 1);
    l0 += __shfl_xor_sync(kFullMask, l0, 2);
    l1 += __shfl_xor_sync(kFullMask, l1, 1);
    l1 += __shfl_xor_sync(kFullMask, l1, 2);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    const int row0 = i0 + wrow + 16 * mt;
    store_rows<HD>(out, o[mt], inv0, inv1, b, row0, h, p.seq, p.heads);
    if (t == 0) {
      float* row_lse = lse + (static_cast<int64_t>(b) * p.heads + h) * p.seq;
      if (row0 + g < p.seq) row_lse[row0 + g] = (m[mt][0] + log2f(l0)) * kLn2;
      if (row0 + g + 8 < p.seq) row_lse[row0 + g + 8] = (m[mt][1] + log2f(l1)) * kLn2;
    }
  }
}

// ---- backward --------------------------------------------------------------------------------

// D (B, H, S) = dout . out per query row, in f32; one warp per row, 16-byte loads.
template <int HD>
__global__ void flash_dot_kernel(float* dsum, const bf16_t* out, const bf16_t* dout, int64_t rows,
                                 int seq, int heads) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (r >= rows) return;
  float s = 0.f;
  for (int c = lane; c < HD / 8; c += 32) {
    const uint4 a = reinterpret_cast<const uint4*>(out + r * HD)[c];
    const uint4 d = reinterpret_cast<const uint4*>(dout + r * HD)[c];
    const auto* av = reinterpret_cast<const __nv_bfloat162*>(&a);
    const auto* dv = reinterpret_cast<const __nv_bfloat162*>(&d);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 x = __bfloat1622float2(av[e]), y = __bfloat1622float2(dv[e]);
      s += x.x * y.x + x.y * y.y;
    }
  }
  s = warp_sum(s);
  if (lane == 0) {
    const int64_t h = r % heads, bi = r / heads, i = bi % seq, b = bi / seq;
    dsum[(b * heads + h) * seq + i] = s;
  }
}

template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_dkdv_kernel(bf16_t* dk, bf16_t* dv, const bf16_t* q, const bf16_t* k, const bf16_t* v,
                      const float* lse, const float* dsum, const bf16_t* dout, FlashDims p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t* ks = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* vs = ks + Tile<HD>::kElems;
  bf16_t* qs = vs + Tile<HD>::kElems;                                  // [2]
  bf16_t* dos = qs + 2 * Tile<HD>::kElems;                             // [2]
  float* lses = reinterpret_cast<float*>(dos + 2 * Tile<HD>::kElems);  // [2][64], log2 units
  float* ds_ = lses + 2 * kRows;                                       // [2][64]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ktile = blockIdx.x;  // causal: early keys see the most queries, so they go first
  const int b = blockIdx.y / p.kv_heads, kvh = blockIdx.y % p.kv_heads;
  const int group = p.heads / p.kv_heads;
  const int j0 = ktile * kRows, wrow = warp * 16;
  const int rj0 = j0 + wrow + g;  // this lane's key rows: rj0 and rj0 + 8

  load_tile_async<HD>(ks, k, b, j0, kvh, p.seq, p.kv_heads);
  load_tile_async<HD>(vs, v, b, j0, kvh, p.seq, p.kv_heads);

  const int first = p.causal ? j0 / kRows : 0;  // the first query tile that sees these keys
  const int qtiles = (p.seq + kRows - 1) / kRows;
  const int per_head = qtiles - first;
  const int steps = per_head * group;
  // Step s: head kvh * group + s / per_head, query tile first + s % per_head.
  auto issue = [&](int s, int buf) {
    const int h = kvh * group + s / per_head, i0 = (first + s % per_head) * kRows;
    load_tile_async<HD>(qs + buf * Tile<HD>::kElems, q, b, i0, h, p.seq, p.heads);
    load_tile_async<HD>(dos + buf * Tile<HD>::kElems, dout, b, i0, h, p.seq, p.heads);
    const int64_t stat = (static_cast<int64_t>(b) * p.heads + h) * p.seq;
    if (threadIdx.x < kRows) {  // small: plain loads, ordered by the barrier before use
      const int i = i0 + threadIdx.x;
      lses[buf * kRows + threadIdx.x] = i < p.seq ? lse[stat + i] * kLog2e : 0.f;
      ds_[buf * kRows + threadIdx.x] = i < p.seq ? dsum[stat + i] : 0.f;
    }
  };
  if (steps > 0) issue(0, 0);
  cp_async_commit();

  float dka[1][HD / 8][4], dva[1][HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[0][n][e] = dva[0][n][e] = 0.f;

  for (int s = 0; s < steps; ++s) {
    const int buf = s & 1;
    const int i0 = (first + s % per_head) * kRows;
    if (s + 1 < steps) {
      // The other buffer's last readers (step s - 1) passed the barrier that ended their step.
      issue(s + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16_t* qt = qs + buf * Tile<HD>::kElems;
    const bf16_t* dot = dos + buf * Tile<HD>::kElems;
    const float* lt = lses + buf * kRows;
    const float* dt = ds_ + buf * kRows;

    // S^T -> P^T and dP^T -> dS^T, rows = keys, cols = queries.
    float sp[1][kRows / 8][4], dp[1][kRows / 8][4];
    mm_rows_by_tile<HD, 1>(sp, ks, wrow, qt);
    mm_rows_by_tile<HD, 1>(dp, vs, wrow, dot);
    const bool masked = (p.causal && i0 < j0 + kRows) || i0 + kRows > p.seq || j0 + kRows > p.seq;
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = n * 8 + 2 * t + (e & 1);  // query column within the tile
        float pv = exp2f(sp[0][n][e] * p.scale_log2 - lt[c]);
        if (masked && !visible(i0 + c, rj0 + (e >> 1) * 8, p)) pv = 0.f;
        sp[0][n][e] = pv;
        dp[0][n][e] = pv * (dp[0][n][e] - dt[c]);
      }
    }
    mm_acc_by_tile<HD, 1>(dva, sp, dot);
    mm_acc_by_tile<HD, 1>(dka, dp, qt);
    __syncthreads();
  }
  store_rows<HD>(dk, dka[0], p.scale, p.scale, b, j0 + wrow, kvh, p.seq, p.kv_heads);
  store_rows<HD>(dv, dva[0], 1.f, 1.f, b, j0 + wrow, kvh, p.seq, p.kv_heads);
}

template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_dq_kernel(bf16_t* dq, const bf16_t* q, const bf16_t* k, const bf16_t* v, const float* lse,
                    const float* dsum, const bf16_t* dout, FlashDims p) {
  constexpr int MT = kMTiles<HD>, BQ = kQueryRows<HD>;
  constexpr int kQElems = BQ * Tile<HD>::kLd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t* qs = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* dos = qs + kQElems;
  bf16_t* ks = dos + kQElems;              // [2]
  bf16_t* vs = ks + 2 * Tile<HD>::kElems;  // [2]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int qtile = gridDim.x - 1 - blockIdx.x;
  const int b = blockIdx.y / p.heads, h = blockIdx.y % p.heads;
  const int kvh = h / (p.heads / p.kv_heads);
  const int i0 = qtile * BQ, wrow = warp * 16 * MT;

  load_tile_async<HD, BQ>(qs, q, b, i0, h, p.seq, p.heads);
  load_tile_async<HD, BQ>(dos, dout, b, i0, h, p.seq, p.heads);
  load_tile_async<HD>(ks, k, b, 0, kvh, p.seq, p.kv_heads);
  load_tile_async<HD>(vs, v, b, 0, kvh, p.seq, p.kv_heads);
  cp_async_commit();
  const int64_t stat = (static_cast<int64_t>(b) * p.heads + h) * p.seq;
  float lse2[MT][2], dd[MT][2];  // rows g and g + 8 of each m-tile
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = i0 + wrow + 16 * mt + g + 8 * hf;
      lse2[mt][hf] = r < p.seq ? lse[stat + r] * kLog2e : 0.f;
      dd[mt][hf] = r < p.seq ? dsum[stat + r] : 0.f;
    }

  float dqa[MT][HD / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
      dqa[mt][n][0] = dqa[mt][n][1] = dqa[mt][n][2] = dqa[mt][n][3] = 0.f;

  const int key_end = p.causal ? min(p.seq, i0 + BQ) : p.seq;
  const int tiles = (key_end + kRows - 1) / kRows;
  for (int tile = 0; tile < tiles; ++tile) {
    const int buf = tile & 1, j0 = tile * kRows;
    next_kv_tile<HD>(ks, vs, k, v, buf, tile + 1 < tiles, b, j0 + kRows, kvh, p);
    const bf16_t* kt = ks + buf * Tile<HD>::kElems;
    const bf16_t* vt = vs + buf * Tile<HD>::kElems;

    float sp[MT][kRows / 8][4], dp[MT][kRows / 8][4];
    mm_rows_by_tile<HD, MT>(sp, qs, wrow, kt);
    mm_rows_by_tile<HD, MT>(dp, dos, wrow, vt);
    const bool masked = (p.causal && j0 + kRows > i0) || j0 + kRows > p.seq || i0 + BQ > p.seq;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < kRows / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hf = e >> 1;
          const int i = i0 + wrow + 16 * mt + g + 8 * hf, j = j0 + n * 8 + 2 * t + (e & 1);
          float pv = exp2f(sp[mt][n][e] * p.scale_log2 - lse2[mt][hf]);
          if (masked && !visible(i, j, p)) pv = 0.f;
          dp[mt][n][e] = pv * (dp[mt][n][e] - dd[mt][hf]);
        }
    mm_acc_by_tile<HD, MT>(dqa, dp, kt);
    __syncthreads();
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    store_rows<HD>(dq, dqa[mt], p.scale, p.scale, b, i0 + wrow + 16 * mt, h, p.seq, p.heads);
}

template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(bytes)));
}

FlashDims flash_dims(int64_t seq, int64_t heads, int64_t kv_heads, float scale, bool causal) {
  return {static_cast<int>(seq),
          static_cast<int>(heads),
          static_cast<int>(kv_heads),
          scale * kLog2e,
          scale,
          causal};
}

dim3 flash_grid(int64_t seq, int64_t rows_per_block, int64_t pairs) {
  if (pairs > 65535) fail("[attention] batch * heads exceeds 65535, the CUDA grid's y limit");
  return dim3(static_cast<unsigned>((seq + rows_per_block - 1) / rows_per_block),
              static_cast<unsigned>(pairs));
}

template <int HD>
void forward_hd(bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k, const bf16_t* v,
                int64_t batch, const FlashDims& p, Stream stream) {
  const size_t smem = sizeof(bf16_t) * (kQueryRows<HD> * Tile<HD>::kLd + 4 * Tile<HD>::kElems);
  allow_smem(flash_forward_kernel<HD>, smem);
  flash_forward_kernel<HD>
      <<<flash_grid(p.seq, kQueryRows<HD>, batch * p.heads), kThreads, smem, stream>>>(out, lse, q,
                                                                                       k, v, p);
  CUDA_CHECK_LAUNCH();
}

template <int HD>
void backward_hd(bf16_t* dq, bf16_t* dk, bf16_t* dv, const bf16_t* q, const bf16_t* k,
                 const bf16_t* v, const bf16_t* out, const float* lse, const bf16_t* dout,
                 float* dsum, int64_t batch, const FlashDims& p, Stream stream) {
  const int64_t rows = batch * p.seq * p.heads;
  constexpr int kDotWarps = 8;
  flash_dot_kernel<HD>
      <<<static_cast<unsigned>((rows + kDotWarps - 1) / kDotWarps), 32 * kDotWarps, 0, stream>>>(
          dsum, out, dout, rows, p.seq, p.heads);
  CUDA_CHECK_LAUNCH();
  const size_t smem_kv = sizeof(bf16_t) * 6 * Tile<HD>::kElems + sizeof(float) * 4 * kRows;
  allow_smem(flash_dkdv_kernel<HD>, smem_kv);
  flash_dkdv_kernel<HD>
      <<<flash_grid(p.seq, kRows, batch * p.kv_heads), kThreads, smem_kv, stream>>>(
          dk, dv, q, k, v, lse, dsum, dout, p);
  CUDA_CHECK_LAUNCH();
  const size_t smem_q =
      sizeof(bf16_t) * (2 * kQueryRows<HD> * Tile<HD>::kLd + 4 * Tile<HD>::kElems);
  allow_smem(flash_dq_kernel<HD>, smem_q);
  flash_dq_kernel<HD>
      <<<flash_grid(p.seq, kQueryRows<HD>, batch * p.heads), kThreads, smem_q, stream>>>(
          dq, q, k, v, lse, dsum, dout, p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool flash_attention_supported(DType dt, int64_t head_dim) {
  return dt == DType::bf16 && (head_dim == 64 || head_dim == 128);
}

void flash_attention_forward(void* out, float* lse, const void* q, const void* k, const void* v,
                             int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, float scale, bool causal, Stream stream) {
  if (batch * seq * heads == 0) return;
  const FlashDims p = flash_dims(seq, heads, kv_heads, scale, causal);
  auto* o = static_cast<bf16_t*>(out);
  const auto* tq = static_cast<const bf16_t*>(q);
  const auto* tk = static_cast<const bf16_t*>(k);
  const auto* tv = static_cast<const bf16_t*>(v);
  if (head_dim == 64)
    forward_hd<64>(o, lse, tq, tk, tv, batch, p, stream);
  else if (head_dim == 128)
    forward_hd<128>(o, lse, tq, tk, tv, batch, p, stream);
  else
    fail("[attention] the tensor-core kernels take head_dim 64 or 128");
}

void flash_attention_backward(void* dq, void* dk, void* dv, const void* q, const void* k,
                              const void* v, const void* out, const float* lse, const void* dout,
                              int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, float scale, bool causal, void* workspace,
                              Stream stream) {
  if (batch * seq * heads == 0) return;
  const FlashDims p = flash_dims(seq, heads, kv_heads, scale, causal);
  auto* tdq = static_cast<bf16_t*>(dq);
  auto* tdk = static_cast<bf16_t*>(dk);
  auto* tdv = static_cast<bf16_t*>(dv);
  const auto* tq = static_cast<const bf16_t*>(q);
  const auto* tk = static_cast<const bf16_t*>(k);
  const auto* tv = static_cast<const bf16_t*>(v);
  const auto* to = static_cast<const bf16_t*>(out);
  const auto* tdo = static_cast<const bf16_t*>(dout);
  auto* dsum = static_cast<float*>(workspace);
  if (head_dim == 64)
    backward_hd<64>(tdq, tdk, tdv, tq, tk, tv, to, lse, tdo, dsum, batch, p, stream);
  else if (head_dim == 128)
    backward_hd<128>(tdq, tdk, tdv, tq, tk, tv, to, lse, tdo, dsum, batch, p, stream);
  else
    fail("[attention] the tensor-core kernels take head_dim 64 or 128");
}

}  // namespace xmoe::cuda
