#pragma once
// The pipelined MoE layer (FSMoE; model.moe.pipeline, docs/pipeline.md): Dispatch, Expert and
// Combine split into r chunks of local experts, so that the exchange of one chunk overlaps the
// experts of another. Chunks follow expert boundaries (every rank's local experts
// [b_c, b_{c+1})), so each expert's rows stay together: its grouped GEMMs are the same calls
// as unchunked, and the outputs and gradients are bitwise those of the unchunked layer.
#include <functional>

#include "xmoe/moe/dispatch.h"

namespace xmoe::moe {

/// r chunks of `local_experts` experts, as even as whole experts allow: bounds [r' + 1] with
/// r' = min(r, local_experts) (a chunk holds at least one expert).
ChunkBounds even_chunks(int64_t local_experts, int chunks);

/// The chunks model.moe.pipeline = auto takes without a profile (sched/pipeline_plan.h): 2 with
/// ep > 1 (about half of the smaller of exchange and compute hidden, whatever they are), else 1.
int default_pipeline_chunks(int ep);

/// Runs `pass` over its chunks: the exchange in of chunk c + 1 starts before the compute of
/// chunk c, whose exchange back starts right after it; returns pass.finish().
/// compute(c, rows) -> the chunk's result rows.
Tensor run_pipeline(ChunkedPass& pass, const ChunkBounds& bounds,
                    const std::function<Tensor(int, Tensor)>& compute);

}  // namespace xmoe::moe
