#pragma once
// The memory model of a training step, per rank (docs/training.md, "Bytes per parameter"):
// what each byte a rank holds is for, predicted from the config alone (no model is built), so
// that `xmoe config show` prints it and a planner can rank layouts that no machine here holds.
//
//   between steps: parameters (f32 master; with bf16 copies zero 1/2's shards) + bf16 compute
//                  copies (CUDA bf16) + gradients (whole, or zero 2's shards) + AdamW moments
//                  (whole, or zero 1/2's shards) + state
//   peak of a step: that + the whole gradients (zero 2 frees them after the sync) +
//                  max(activations saved for backward + backward's largest working set,
//                      the gradient sync's and zero's communication buffers)
//
// Activations come from each module's own formula (Attention::activation_bytes_for, ...,
// MoELayer::activation_bytes_for); the parameters and the gradient buckets follow the model's
// parameter order and GradientSync::bucket_plan, so the zero shards are those the run makes.
// Tensor parallelism (parallel.tp, parallel.ssmb) gives the per-rank shapes: the tp shards of
// the attention and dense FFN matrices, their buckets over the tp-replica group, the tokens
// each module holds. Optimizer offload (train.offload_optimizer) moves the master weights and
// the moments off a CUDA device into host terms (MemoryTerm::host) and adds the host staging.
#include <cstdint>
#include <string>
#include <vector>

#include "xmoe/config/config.h"

namespace xmoe::train {

struct MemoryModelOptions {
  /// ranks: world = data ranks × parallel.tp; the MoE layers' ranks (the world with SSMB, else
  /// world / tp) = dp × parallel.ep
  int world = 1;
  int rank = 0;  ///< whose shards (rank 0 of a group holds the most elements: padding is last)
  /// With parallel.ep > 1, the busiest rank's experts receive this many times the expected
  /// T·k rows (routing is data-dependent; 1 = perfectly balanced).
  double load_imbalance = 1.25;
};

/// One line of the table: a component and its bytes on this rank.
struct MemoryTerm {
  std::string name;
  int64_t bytes = 0;
  bool steady = false;  ///< held between steps (else only inside a step)
  /// In pinned host memory (offload on CUDA), not on the device: counted in host_bytes only.
  bool host = false;
};

struct MemoryModel {
  int world = 1, tp = 1, dp = 1, ep = 1, zero = 0;
  bool ssmb = true;
  bool cuda = false;
  bool bf16_compute = false;
  bool offload = false;         ///< train.offload_optimizer
  bool moments_bf16 = false;    ///< train.adam_moments_dtype = bf16
  bool delayed_update = false;  ///< train.offload_delayed_update_from >= 0 (with offload)
  /// Parameter elements this rank holds (dense ones, its tp shards and its ep share of the
  /// experts).
  int64_t parameters = 0;
  std::vector<MemoryTerm> terms;
  /// Saved activations of each layer (one micro-batch), index = layer.
  std::vector<int64_t> layer_saved;
  /// f32 master weights (on the host with offload on CUDA); zero >= 1 shards those of the
  /// parameters read through bf16 copies (parallel::GradientSync::shards_master)
  int64_t parameter_bytes = 0;
  int64_t compute_copy_bytes = 0;
  /// Offload on CUDA (and the delayed update on the CPU): the device's f32 copies of the
  /// weights forward reads in f32.
  int64_t device_f32_bytes = 0;
  /// train.offload_delayed_update_from: the twins the delayed update writes while forward reads
  /// the others, 2 bytes per bf16 compute-copy element and 4 per f32-copy element.
  int64_t delayed_update_bytes = 0;
  /// Offload: the host buffers the gradients and bf16 copies travel through (AdamW's).
  int64_t staging_bytes = 0;
  int64_t gradient_bytes = 0;  ///< between steps (zero 2: the shards only)
  int64_t whole_gradient_bytes = 0;
  /// whole_gradient_bytes by the group that syncs them (a planner times each sync): dense ones
  /// over the world, the experts' over their dp group, tensor-parallel ones over the
  /// tp-replica group.
  int64_t dense_gradient_bytes = 0, expert_gradient_bytes = 0, tensor_gradient_bytes = 0;
  /// zero >= 1: the parameter bytes the all-gather after the update assembles, by group (4 an
  /// element, 2 for the bf16 copies of master-sharded parameters); 0 at zero 0
  int64_t dense_gather_bytes = 0, expert_gather_bytes = 0, tensor_gather_bytes = 0;
  /// Parameter elements whose AdamW update this rank runs (its zero shards, else all it holds).
  int64_t owned_parameters = 0;
  int64_t optimizer_bytes = 0;        ///< AdamW m and v, 8 or 4 (bf16) bytes per owned element
                                      ///< (on the host with offload)
  int64_t activation_peak_bytes = 0;  ///< saved activations + backward's working set at its peak
  int64_t comm_bytes = 0;             ///< the largest gradient-sync / zero gather buffers
  int64_t steady_bytes = 0;           ///< live between steps (on the device)
  int64_t peak_bytes = 0;             ///< the most live inside a step (on the device)
  /// Offload on CUDA: pinned host bytes (master weights, moments, staging); else 0.
  int64_t host_bytes = 0;
  /// Attention backward's scratch per layer, inside the backward working set: on CUDA asked
  /// of cuDNN where a GPU is present (attention_workspace_asked), else the native kernel's
  /// B·H·S floats, which cuDNN's workspace can exceed many times.
  int64_t attention_workspace_bytes = 0;
  bool attention_workspace_asked = false;
};

/// The model of `config` (its train.device, train.dtype, train.offload_optimizer, parallel.tp,
/// parallel.ssmb, parallel.ep, parallel.zero) on rank `options.rank` of `options.world` ranks.
/// Throws "[memory] ..." when the layout is impossible (world not a multiple of parallel.tp,
/// the MoE layers' ranks not of parallel.ep).
MemoryModel predict_memory(const Config& config, const MemoryModelOptions& options = {});

/// The fewest ranks `config`'s parallel layout allows: parallel.tp and parallel.ep both divide
/// the world with SSMB; without it, ep divides world / tp.
int smallest_world(const Config& config);

/// The table `xmoe config show` prints: component, bytes, bytes per parameter held here.
std::string memory_table(const MemoryModel& model);

}  // namespace xmoe::train
