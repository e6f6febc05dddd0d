// Row gather and deterministic row scatter-add (also the embedding's forward and backward).
//
// scatter_add_rows: out[index[i]] += w[i] * src[i]. Atomics would make the f32 sum depend on
// thread timing, so the entries are grouped by destination row instead:
//   1. keys[i] = index[i] (n_out for an index out of range), vals[i] = i
//   2. stable radix sort of (key, i) over the bits of n_out (CUB): within a destination row the
//      entries stay in increasing i
//   3. offsets[r] = first sorted position with key >= r (binary search, r = 0..n_out)
//   4. one block per destination row adds its entries in sorted order, one thread per column:
//      the same order as the CPU loop, whatever the launch configuration.
// gather_sum_rows is the same sum when each output row names its (at most 32) source rows, as
// the MoE layout's slot_to_row does: one warp per output row ranks its rows by index and adds
// them in that order, so no sort and no workspace, and the bits equal the scatter's.
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>

#include "xmoe/backend/cuda/common.cuh"

namespace xmoe::cuda {

namespace {

constexpr int kWarps = kBlock / 32;

// One warp per row. W: the element type moved (uint4 = 16 bytes when rows allow it, else the
// dtype's own); width in W.
template <class W>
__global__ void gather_rows_kernel(W* out, const W* x, const int32_t* index, int64_t m,
                                   int64_t n_rows, int64_t width) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); i < m;
       i += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t r = index[i];
    W* o = out + i * width;
    if (r >= 0 && r < n_rows) {
      const W* in = x + r * width;
      for (int64_t c = lane; c < width; c += 32) o[c] = in[c];
    } else {
      for (int64_t c = lane; c < width; c += 32) o[c] = W{};
    }
  }
}

// One warp per output row t: lane j < k holds source row slots[t * k + j] (none when outside
// [0, n_src)); the rows are ranked by index (lane order breaks ties) so lane q holds the q-th
// smallest, then added in that order in f32, then addend's row where it is not null. VEC: 8
// columns per access (d % 8 == 0, 16-byte aligned rows).
template <class O, class S, class W, bool VEC>
__global__ void gather_sum_rows_kernel(O* out, const S* src, const W* weight, const O* addend,
                                       const int32_t* slots, int64_t n_out, int k, int64_t n_src,
                                       int64_t d) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); t < n_out;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int32_t r = lane < k ? slots[t * k + lane] : -1;
    const bool valid = r >= 0 && r < n_src;
    const uint32_t key = valid ? static_cast<uint32_t>(r) : 0xffffffffu;
    const float w = valid && weight ? to_float(weight[r]) : 1.0f;
    int rank = 0;
    for (int j = 0; j < k; ++j) {
      const uint32_t kj = __shfl_sync(kAll, key, j);
      rank += kj < key || (kj == key && j < lane);
    }
    const int count = __popc(__ballot_sync(kAll, valid));
    int32_t sorted_row = 0;  // lane q < count: the q-th smallest row and its weight
    float sorted_w = 0.f;
    for (int j = 0; j < k; ++j) {
      const int rj = __shfl_sync(kAll, rank, j);
      const int32_t row_j = __shfl_sync(kAll, r, j);
      const float w_j = __shfl_sync(kAll, w, j);
      if (rj == lane) sorted_row = row_j, sorted_w = w_j;
    }
    // Every lane runs every column pass (the shuffles need the whole warp); lanes past d idle.
    O* o = out + t * d;
    if constexpr (VEC) {
      for (int64_t c0 = 0; c0 < d; c0 += 8 * 32) {
        const int64_t c = c0 + 8 * lane;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int q = 0; q < count; ++q) {
          const int64_t row = __shfl_sync(kAll, sorted_row, q);
          const float wq = __shfl_sync(kAll, sorted_w, q);
          if (c < d) {
            float v[8];
            load8(v, src + row * d + c);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] += wq * v[e];
          }
        }
        if (c < d && addend) {
          float v[8];
          load8(v, addend + t * d + c);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] += v[e];
        }
        if (c < d) store8(o + c, acc);
      }
    } else {
      for (int64_t c0 = 0; c0 < d; c0 += 32) {
        const int64_t c = c0 + lane;
        float acc = 0.f;
        for (int q = 0; q < count; ++q) {
          const int64_t row = __shfl_sync(kAll, sorted_row, q);
          const float wq = __shfl_sync(kAll, sorted_w, q);
          if (c < d) acc += wq * to_float(src[row * d + c]);
        }
        if (c < d && addend) acc += to_float(addend[t * d + c]);
        if (c < d) o[c] = from_float<O>(acc);
      }
    }
  }
}

// One block per padded row (g, r): row offsets[g] + r of src, or zeros past the group's rows.
// W: the element type moved (uint4 = 16 bytes when rows allow it, else the dtype's own).
template <class W>
__global__ void pad_groups_kernel(W* dst, const W* src, const int64_t* offsets, int64_t groups,
                                  int64_t cap, int64_t width) {
  for (int64_t i = blockIdx.x; i < groups * cap; i += gridDim.x) {
    const int64_t g = i / cap, r = i % cap;
    const int64_t begin = offsets[g], rows = offsets[g + 1] - begin;
    W* out = dst + i * width;
    if (r < rows) {
      const W* in = src + (begin + r) * width;
      for (int64_t c = threadIdx.x; c < width; c += blockDim.x) out[c] = in[c];
    } else {
      for (int64_t c = threadIdx.x; c < width; c += blockDim.x) out[c] = W{};
    }
  }
}

__global__ void find_bad_index_kernel(unsigned long long* first_bad, const int32_t* index,
                                      int64_t n, int64_t limit, bool allow_negative) {
  XMOE_GRID_STRIDE(i, n) {
    const int32_t v = index[i];
    if (v >= limit || (v < 0 && !allow_negative))
      atomicMin(first_bad, static_cast<unsigned long long>(i));  // the minimum: deterministic
  }
}

__global__ void scatter_keys_kernel(uint32_t* keys, int32_t* vals, const int32_t* index, int64_t m,
                                    int64_t n_out) {
  XMOE_GRID_STRIDE(i, m) {
    const int32_t v = index[i];
    keys[i] = (v >= 0 && v < n_out) ? static_cast<uint32_t>(v) : static_cast<uint32_t>(n_out);
    vals[i] = static_cast<int32_t>(i);
  }
}

__global__ void segment_offsets_kernel(int32_t* offsets, const uint32_t* keys, int64_t m,
                                       int64_t n_out) {
  XMOE_GRID_STRIDE(r, n_out + 1) {
    int64_t lo = 0, hi = m;  // first position with keys[pos] >= r
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (keys[mid] < static_cast<uint32_t>(r))
        lo = mid + 1;
      else
        hi = mid;
    }
    offsets[r] = static_cast<int32_t>(lo);
  }
}

template <class O, class S, class W>
__global__ void scatter_rows_kernel(O* out, const S* src, const W* weight, const int32_t* order,
                                    const int32_t* offsets, int64_t n_out, int64_t d) {
  for (int64_t r = blockIdx.x; r < n_out; r += gridDim.x) {
    const int32_t begin = offsets[r], end = offsets[r + 1];
    if (begin == end) continue;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      float acc = to_float(out[r * d + c]);
      for (int32_t e = begin; e < end; ++e) {
        const int64_t i = order[e];
        const float w = weight ? to_float(weight[i]) : 1.0f;
        acc += w * to_float(src[i * d + c]);
      }
      out[r * d + c] = from_float<O>(acc);
    }
  }
}

int key_bits(int64_t n_out) {  // bits that hold keys 0..n_out
  int bits = 1;
  while (bits < 32 && (static_cast<int64_t>(1) << bits) <= n_out) ++bits;
  return bits;
}

size_t align256(size_t b) {
  return (b + 255) / 256 * 256;
}

struct ScatterLayout {
  size_t keys_in, keys_out, vals_in, vals_out, offsets, temp, temp_bytes, total;
};

ScatterLayout scatter_layout(int64_t m, int64_t n_out) {
  ScatterLayout l{};
  size_t temp_bytes = 0;
  if (m > 0) {
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, temp_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
        static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(m),
        0, key_bits(n_out)));
  }
  const size_t mk = align256(static_cast<size_t>(m) * 4);
  l.keys_in = 0;
  l.keys_out = l.keys_in + mk;
  l.vals_in = l.keys_out + mk;
  l.vals_out = l.vals_in + mk;
  l.offsets = l.vals_out + mk;
  l.temp = l.offsets + align256(static_cast<size_t>(n_out + 1) * 4);
  l.temp_bytes = temp_bytes;
  l.total = l.temp + align256(temp_bytes);
  return l;
}

}  // namespace

void pad_groups(void* dst, const void* src, DType dt, const int64_t* offsets, int64_t groups,
                int64_t cap, int64_t d, Stream stream) {
  if (groups * cap * d == 0) return;
  const int64_t bytes = d * static_cast<int64_t>(dtype_size(dt));
  const unsigned grid = grid_for(groups * cap, 1);
  if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    pad_groups_kernel<uint4><<<grid, 128, 0, stream>>>(
        static_cast<uint4*>(dst), static_cast<const uint4*>(src), offsets, groups, cap, bytes / 16);
  } else {
    dispatch_float(dt, "pad_groups", [&](auto tag) {
      using T = typename decltype(tag)::type;
      pad_groups_kernel<T><<<grid, 128, 0, stream>>>(
          static_cast<T*>(dst), static_cast<const T*>(src), offsets, groups, cap, d);
    });
  }
  CUDA_CHECK_LAUNCH();
}

void gather_rows(void* out, const void* x, DType dt, const int32_t* index, int64_t m,
                 int64_t n_rows, int64_t d, Stream stream) {
  if (m == 0 || d == 0) return;
  const int64_t bytes = d * static_cast<int64_t>(dtype_size(dt));
  const unsigned grid = grid_for(m, kWarps);
  if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    gather_rows_kernel<uint4><<<grid, kBlock, 0, stream>>>(
        static_cast<uint4*>(out), static_cast<const uint4*>(x), index, m, n_rows, bytes / 16);
  } else {
    dispatch_float(dt, "gather_rows", [&](auto tag) {
      using T = typename decltype(tag)::type;
      gather_rows_kernel<T><<<grid, kBlock, 0, stream>>>(
          static_cast<T*>(out), static_cast<const T*>(x), index, m, n_rows, d);
    });
  }
  CUDA_CHECK_LAUNCH();
}

namespace {
// The (output, source, weight) dtype triple of the summing row kernels; f(out, src, weight) gets
// typed pointers (weight may be null, typed f32 then).
template <class F>
void dispatch_sum_types(void* out, DType out_dt, const void* src, DType src_dt, const void* weight,
                        DType weight_dt, const char* op, F&& f) {
  dispatch_float(out_dt, op, [&](auto otag) {
    using O = typename decltype(otag)::type;
    dispatch_float(src_dt, op, [&](auto stag) {
      using S = typename decltype(stag)::type;
      dispatch_float(weight ? weight_dt : DType::f32, op, [&](auto wtag) {
        using W = typename decltype(wtag)::type;
        f(static_cast<O*>(out), static_cast<const S*>(src), static_cast<const W*>(weight));
      });
    });
  });
}
}  // namespace

void gather_sum_rows(void* out, DType out_dt, const void* src, DType src_dt, const int32_t* slots,
                     const void* weight, DType weight_dt, const void* addend, int64_t n_out,
                     int64_t k, int64_t n_src, int64_t d, Stream stream) {
  if (n_out == 0 || d == 0) return;
  if (k < 1 || k > 32) fail("[gather_sum_rows] k (source rows per output row) outside 1..32");
  const bool vec = d % 8 == 0 && aligned16({out, src, addend});
  const unsigned grid = grid_for(n_out, kWarps);
  const int kk = static_cast<int>(k);
  dispatch_sum_types(out, out_dt, src, src_dt, weight, weight_dt, "gather_sum_rows",
                     [&](auto* o, auto* s, auto* w) {
                       using O = std::remove_pointer_t<decltype(o)>;
                       using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
                       using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
                       const auto* a = static_cast<const O*>(addend);
                       if (vec) {
                         gather_sum_rows_kernel<O, S, W, true>
                             <<<grid, kBlock, 0, stream>>>(o, s, w, a, slots, n_out, kk, n_src, d);
                       } else {
                         gather_sum_rows_kernel<O, S, W, false>
                             <<<grid, kBlock, 0, stream>>>(o, s, w, a, slots, n_out, kk, n_src, d);
                       }
                       CUDA_CHECK_LAUNCH();
                     });
}

void find_bad_index(int64_t* first_bad, const int32_t* index, int64_t n, int64_t limit,
                    bool allow_negative, Stream stream) {
  // All ones = -1 as int64 = "none"; as unsigned it is the identity of atomicMin.
  CUDA_CHECK(cudaMemsetAsync(first_bad, 0xff, sizeof(int64_t), stream));
  if (n == 0) return;
  find_bad_index_kernel<<<grid_for(n), kBlock, 0, stream>>>(
      reinterpret_cast<unsigned long long*>(first_bad), index, n, limit, allow_negative);
  CUDA_CHECK_LAUNCH();
}

size_t scatter_add_rows_workspace_bytes(int64_t m, int64_t n_out) {
  return scatter_layout(m, n_out).total;
}

void scatter_add_rows(void* out, DType out_dt, const void* src, DType src_dt, const int32_t* index,
                      const void* weight, DType weight_dt, int64_t m, int64_t n_out, int64_t d,
                      void* workspace, size_t workspace_bytes, Stream stream) {
  if (m == 0 || d == 0 || n_out == 0) return;
  if (m >= (int64_t{1} << 31) || n_out >= (int64_t{1} << 31))
    fail("[scatter_add_rows] more than 2^31 rows");
  const ScatterLayout l = scatter_layout(m, n_out);
  if (workspace_bytes < l.total) fail("[scatter_add_rows] workspace too small");
  char* ws = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<uint32_t*>(ws + l.keys_in);
  auto* keys_out = reinterpret_cast<uint32_t*>(ws + l.keys_out);
  auto* vals_in = reinterpret_cast<int32_t*>(ws + l.vals_in);
  auto* vals_out = reinterpret_cast<int32_t*>(ws + l.vals_out);
  auto* offsets = reinterpret_cast<int32_t*>(ws + l.offsets);

  scatter_keys_kernel<<<grid_for(m), kBlock, 0, stream>>>(keys_in, vals_in, index, m, n_out);
  CUDA_CHECK_LAUNCH();
  size_t temp_bytes = l.temp_bytes;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws + l.temp, temp_bytes, keys_in, keys_out, vals_in,
                                             vals_out, static_cast<int>(m), 0, key_bits(n_out),
                                             stream));
  segment_offsets_kernel<<<grid_for(n_out + 1), kBlock, 0, stream>>>(offsets, keys_out, m, n_out);
  CUDA_CHECK_LAUNCH();

  dispatch_sum_types(out, out_dt, src, src_dt, weight, weight_dt, "scatter_add_rows",
                     [&](auto* o, auto* s, auto* w) {
                       scatter_rows_kernel<<<grid_for(n_out, 1), kBlock, 0, stream>>>(
                           o, s, w, vals_out, offsets, n_out, d);
                       CUDA_CHECK_LAUNCH();
                     });
}

}  // namespace xmoe::cuda
