#pragma once
// FSMoE's adaptive gradient partitioning (parallel.grad_partition = auto): the dense gradients'
// all-reduce split into pieces sized from the fitted performance models (sched/perf_model.h) so
// that each piece runs while backward still computes. docs/pipeline.md derives it.
//
// Backward finishes modules in order (the LM head, the final norm, the blocks from the last, the
// embedding: model::Transformer::backward_modules). Module m finishes g_m bytes of dense
// gradients and, while it runs, leaves the links idle for w_m seconds: its compute, without the
// time its MoE layer's dispatch and combine hold the links. The gradient channel runs its pieces
// in order and only while the links are idle, so on the clock of idle link time module m is done
// at R_m = w_0 + ... + w_m and backward at R_{M-1}. A piece of modules [a, b] starts at
// max(R_b, the end of the piece before) and takes α + β·bytes (the all-reduce model). The
// partition minimises the end of the last piece, i.e. the exposed time (that end − R_{M-1}), and
// then the number of pieces, by dynamic programming (O(M³)): the earliest end of k pieces
// covering modules 0..b is min over a of max(end of k − 1 pieces covering 0..a−1, R_b) +
// α + β·g(a..b) (an earlier end of a prefix never delays what follows).
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/sched/linear_model.h"
#include "xmoe/sched/perf_model.h"

namespace xmoe::sched {

/// What the partition knows of one module of backward.
struct GradModule {
  std::string name;
  double idle_seconds = 0;  ///< w_m: link-idle backward compute
  int64_t grad_bytes = 0;   ///< g_m: dense gradient bytes it finishes (f32, as they are packed)
};

/// One all-reduce: modules [first, last] in backward order, on the idle clock.
struct GradPiece {
  int first = 0, last = 0;
  int64_t bytes = 0;
  double start = 0, end = 0;  ///< predicted seconds after backward starts
};

struct GradPartition {
  std::vector<GradPiece> pieces;
  double backward_seconds = 0;  ///< R_{M-1}
  /// Predicted seconds the sync adds after backward: with these pieces, and with one
  /// all-reduce of everything after backward (α + β·Σg; 0 without a model).
  double exposed_seconds = 0, exposed_unpartitioned = 0;
  std::string source;  ///< the profile, or why the default was taken
  /// One line for the log: the pieces (modules, KiB) and the predicted exposed time.
  std::string summary(std::span<const GradModule> modules) const;
};

/// The partition minimising the exposed time under `all_reduce` (seconds over bytes). Modules
/// without gradients are folded into their neighbours' pieces; none at all: no pieces.
GradPartition partition_gradients(std::span<const GradModule> modules,
                                  const LinearModel& all_reduce);
/// The default without a profile: one piece per module that has gradients, each started as soon
/// as backward finishes it (no timing predicted).
GradPartition partition_per_module(std::span<const GradModule> modules);
/// `pieces`' start and end on the idle clock, and the exposed times, under `all_reduce`.
void predict_pieces(GradPartition& partition, std::span<const GradModule> modules,
                    const LinearModel& all_reduce);

/// What the backward-time prediction needs of the run (per rank).
struct BackwardShape {
  int64_t batch = 1, seq_len = 1;  ///< this rank's micro-batch
  int ep = 1, tp = 1;
  bool ssmb = true;
  int64_t elem_bytes = 4;     ///< activations (4 f32, 2 bf16)
  int pipeline_backward = 1;  ///< the MoE layer's backward chunks (model.moe.pipeline)
  comm::LinkClass ep_link = comm::LinkClass::intra_node;
};
/// Predicted link-idle backward seconds of each module, in backward order (the LM head unless
/// tied, the final norm, blocks from the last, the embedding), from the profile's GEMM,
/// attention and row models; an MoE layer counts its pipelined time less the time its
/// exchanges hold the links. Throws naming a model the profile lacks.
std::vector<double> predict_backward_idle(const Profile& profile, const ModelConfig& model,
                                          const BackwardShape& shape);

/// parallel.grad_partition = auto for a run: `modules` (names and bytes, in backward order)
/// timed from the profile (model.moe.pipeline_profile, else <train.out_dir>/profile.json when it
/// exists) and partitioned under its all-reduce model over `world_link`; without a profile, or
/// one that lacks a model, partition_per_module (source says why).
GradPartition resolve_grad_partition(const Config& config, std::vector<GradModule> modules,
                                     const BackwardShape& shape, comm::LinkClass world_link);

}  // namespace xmoe::sched
