#pragma once
// The number of chunks of the pipelined MoE layer (model.moe.pipeline = auto), chosen from the
// fitted performance models of `xmoe profile` (sched/perf_model.h) with FSMoE's pipeline
// formula. docs/pipeline.md derives it; moe/pipeline.h runs the chunks.
//
// Per chunk of n = N / r rows (N: the rows a rank routes, T·k), over the ep group's link:
//   forward   d = a2a(n·d·b)                                       dispatch
//             e = gemm_fwd(n, d, 2f) + gemm_fwd(n, f, d)           the experts, with the two
//                 + 2 gather(n·d·b)                                permutations (compute side)
//             c = a2a(n·d·b)                                       combine
//   backward  d, c the same; e = the four backward GEMMs (data and weight of both projections)
//             and the two permutations
// and the layer, with one communication channel (dispatch and combine share it) beside compute:
//   t(r) = d + e + c + (r - 1) · max(d + c, e)
// (r (d + c) + e when communication bounds it, d + r e + c when compute does). r = 1 is the
// unpipelined layer; the choice is the r in [1, max_chunks] with the least t(r).
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "xmoe/comm/topology.h"
#include "xmoe/config/config.h"
#include "xmoe/sched/perf_model.h"

namespace xmoe::sched {

/// What the formula needs of one MoE layer on one rank.
struct PipelineShape {
  int64_t rows = 0;  ///< N: (token, expert) rows this rank routes (tokens · top_k)
  int64_t d_model = 0, expert_hidden = 0;
  int64_t local_experts = 1;  ///< E / ep: at most this many chunks
  int ep = 1;
  int64_t elem_bytes = 4;  ///< of the activations (4 f32, 2 bf16)
  /// model.moe.expert_dtype = fp8: the experts' forward and data-gradient GEMMs on FP8 operands
  /// (the profile's FP8 models), their weight gradient in bf16.
  bool fp8 = false;
  comm::LinkClass link = comm::LinkClass::intra_node;  ///< of the ep group's widest link
};

/// Predicted seconds of one chunk's stages.
struct ChunkTimes {
  double dispatch = 0, experts = 0, combine = 0;
};

/// What the stages are timed with: the profile's fitted models (the trainer's auto), or a
/// planner's rates (plan/step_time.h: a cluster's declared rates, and its links for an ep group
/// placed over nodes).
struct ChunkRates {
  /// One GEMM (Task::gemm_* kinds) of x[rows, in] @ w[in, out], on FP8 operands where `fp8`.
  std::function<double(Task, int64_t rows, int64_t in, int64_t out, bool fp8)> gemm;
  /// A permutation of rows (gather_rows) moving `bytes`.
  std::function<double(double bytes)> permute;
  /// One all_to_all_v over the ep group of `bytes` a rank.
  std::function<double(double bytes)> exchange;
};
/// The profile's models, the exchange over `link` (predict_dispatch). Each throws naming a
/// missing model when called.
ChunkRates profile_chunk_rates(const Profile& profile, comm::LinkClass link);

/// Per-chunk stage times for r chunks, forward or backward. With ep = 1 there is no exchange
/// (d = c = 0).
ChunkTimes predict_chunk(const ChunkRates& rates, const PipelineShape& shape, int chunks,
                         bool backward);
/// The same from a profile (throws naming the missing model).
ChunkTimes predict_chunk(const Profile& profile, const PipelineShape& shape, int chunks,
                         bool backward);
/// t(r) of the formula above.
double predict_pipelined(const ChunkTimes& chunk, int chunks);

struct PipelineChoice {
  int forward = 1, backward = 1;
  /// Predicted seconds for r = 1..max (empty without a profile).
  std::vector<double> forward_seconds, backward_seconds;
  std::string source;  ///< the profile file, or why the default was taken
  /// One line for the log: the choice, the predicted times and the speed-up over r = 1.
  std::string summary() const;
};

/// Without a profile (nullptr) the default: 2 chunks each way when ep > 1, else 1.
PipelineChoice choose_pipeline(const Profile* profile, const PipelineShape& shape,
                               int max_chunks = 8);

/// The profile a run's schedule reads: model.moe.pipeline_profile, else
/// <train.out_dir>/profile.json when it exists, else "" (none).
std::string run_profile_path(const Config& config);

/// model.moe.pipeline and pipeline_backward resolved for a run: fixed counts as given, auto from
/// the profile (model.moe.pipeline_profile, else <train.out_dir>/profile.json when it exists,
/// else the default). tokens: per rank at the MoE layer; ep_nodes: nodes the ep group spans.
PipelineChoice resolve_pipeline(const Config& config, int64_t tokens, int ep, int ep_nodes,
                                int64_t elem_bytes);

}  // namespace xmoe::sched
