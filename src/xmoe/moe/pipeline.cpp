#include "xmoe/moe/pipeline.h"

#include <algorithm>

#include "xmoe/core/error.h"

namespace xmoe::moe {

ChunkBounds even_chunks(int64_t local_experts, int chunks) {
  XMOE_CHECK(local_experts >= 1 && chunks >= 1,
             "[moe pipeline] {} chunks of {} local experts: both must be >= 1", chunks,
             local_experts);
  const int64_t r = std::min<int64_t>(chunks, local_experts);
  ChunkBounds b(static_cast<size_t>(r) + 1);
  for (int64_t c = 0; c <= r; ++c) b[c] = c * local_experts / r;
  return b;
}

int default_pipeline_chunks(int ep) {
  return ep > 1 ? 2 : 1;
}

Tensor run_pipeline(ChunkedPass& pass, const ChunkBounds& bounds,
                    const std::function<Tensor(int, Tensor)>& compute) {
  const int chunks = static_cast<int>(bounds.size()) - 1;
  pass.start_in(0);
  for (int c = 0; c < chunks; ++c) {
    if (c + 1 < chunks) pass.start_in(c + 1);
    Tensor in = pass.wait_in(c);
    pass.start_out(c, compute(c, std::move(in)));
  }
  return pass.finish();
}

}  // namespace xmoe::moe
