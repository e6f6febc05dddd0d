#pragma once
// The CUDA device model seen from host code: one current stream per device, the caching
// allocator's extra counters and cache control. Plain header (no CUDA or fmt headers), so both
// the C++ compiler and nvcc can include it, and a build without CUDA links stubs of these
// functions (backend/cuda_stub/) that throw.
#include <cstdint>

struct CUstream_st;

namespace xmoe::cuda {

/// A CUDA stream; the same type as cudaStream_t.
using Stream = CUstream_st*;

/// The current stream of `device`: a non-blocking stream created on first use. Every op on a
/// tensor of that device is queued on it, so ops on one device run in order without host syncs.
Stream current_stream(int device);
/// Replaces the current stream of `device` (e.g. with a communication stream). The caller owns
/// `stream`; memory freed while it is current returns to its own free list (see docs/cuda.md).
void set_current_stream(int device, Stream stream);
/// Makes `device` the calling thread's CUDA device and returns its current stream. The ops call
/// this before they launch on a tensor of that device.
Stream activate(int device);

/// Counters of the caching allocator of one device, beside core's live/peak MemoryStats.
struct CacheStats {
  int64_t reserved_bytes = 0;  ///< device memory held from cudaMalloc (in use + cached)
  int64_t cached_bytes = 0;    ///< reserved bytes in free lists, ready for reuse
  int64_t num_mallocs = 0;     ///< cudaMalloc calls since start
  int64_t num_frees = 0;       ///< cudaFree calls since start (empty_cache, out-of-memory retry)
};
CacheStats cache_stats(int device);
/// Returns every cached (free) block of `device` to the driver; blocks in use stay.
void empty_cache(int device);

}  // namespace xmoe::cuda
