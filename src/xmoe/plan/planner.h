#pragma once
// `xmoe plan` (docs/plan.md): every parallel layout of a model on a cluster, its per-GPU memory
// (train/memory_model.h) and step time (plan/step_time.h), ranked by predicted tokens/s among
// those that fit; the chosen one as a config `xmoe train --config` runs. And the largest model
// of a family that fits a cluster (X-MoE's question).
#include <string>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/plan/cluster.h"
#include "xmoe/plan/step_time.h"
#include "xmoe/train/memory_model.h"

namespace xmoe::plan {

/// One parallel layout of a run (world = data ranks × tp; the MoE world = dp × ep).
struct PlanLayout {
  int tp = 1, ep = 1;
  bool ssmb = true;
  std::string dispatch = "auto";  ///< model.moe.dispatch: auto (ep = 1), all_to_all, rbd
  int zero = 0;
  bool offload = false;
  /// train.offload_overlap: offloaded gradients start during backward (whole host buffers); false
  /// ("off:rings"; one process, zero < 2, else it makes no difference): they travel through two
  /// group-sized host buffers during the update, 2-4 bytes per parameter less host memory.
  bool offload_overlap = true;
  std::string expert_grad_dtype = "f32";   ///< model.moe.expert_grad_dtype
  std::string adam_moments_dtype = "f32";  ///< train.adam_moments_dtype
  std::vector<std::string> recompute;
  int micro_batch = 1;  ///< train.batch_size: sequences per micro-batch of a tp group
  int grad_accum = 1;
  /// MoE chunks r of the pipelined layer each way (model.moe.pipeline: off for 1, else r).
  int moe_chunks = 1;

  /// "tp 2 ssmb ep 4 a2a z1 eg16 m16 rc:moe mb 2" (the table's first column).
  std::string str() const;
  /// `base` with this layout's keys set.
  Config apply(Config base, const std::string& device) const;
};

struct Candidate {
  PlanLayout layout;
  Config config;
  train::MemoryModel memory;
  StepTime time;
  int world = 1;
  double tokens_per_step = 0;
  double tokens_per_s = 0;
  double mfu = 0;  ///< against the cluster's peak_flops (0 when it declares none)
  bool fits = false;
};

struct PlanOptions {
  /// Sequences per optimizer step over all data ranks; 0: one micro-batch per data rank.
  /// Layouts whose data ranks × micro-batch do not divide it are skipped.
  int global_batch = 0;
  /// Sequences per micro-batch of one tp rank to try (train.batch_size = this × tp).
  std::vector<int> micro_batches = {1, 2, 4};
  std::vector<std::vector<std::string>> recompute_choices = {
      {}, {"attention_core"}, {"moe", "router"}, {"attention", "ffn", "moe", "router"}};
  std::vector<int> zero_choices = {0, 1, 2};
  /// model.moe.expert_grad_dtype: bf16 halves the largest gradients (Megatron-Core's default).
  std::vector<std::string> expert_grad_choices = {"f32", "bf16"};
  /// train.adam_moments_dtype: bf16 halves the moments (DeepSeek-V3's choice); a layout gets
  /// bf16 moments only where it does not fit with f32 ones (listed before bf16).
  std::vector<std::string> moments_choices = {"f32", "bf16"};
  /// model.moe.pipeline with expert parallelism: r chunks each way, those up to E / ep (a chunk
  /// holds at least one expert of each rank).
  std::vector<int> moe_chunk_choices = {1, 2, 4, 8};
  bool offload = true;  ///< try train.offload_optimizer (CUDA clusters)
  double load_imbalance = 1.25;
};

struct Plan {
  Cluster cluster;
  std::vector<Candidate> candidates;  ///< ranked: those that fit by tokens/s, then the rest
  int layouts = 0;                    ///< valid layouts evaluated
  int fitting = 0;
};

/// `layout` of `base` on `rates.cluster()`: its config, memory (`memory` when the caller has
/// modelled it), step time, tokens/s and whether it fits. Throws when the config refuses it.
Candidate evaluate_layout(const Config& base, const PlanLayout& layout, const Rates& rates,
                          const PlanOptions& options = {},
                          const train::MemoryModel* memory = nullptr);

/// Every valid layout of `base`'s model on `rates.cluster()`, timed and ranked.
Plan make_plan(const Config& base, const Rates& rates, const PlanOptions& options = {});

/// The table: layout, peak memory per GPU, step time, tokens/s, MFU; the `top` best that fit.
std::string plan_table(const Plan& plan, int top);
/// The chosen layout's config as YAML, with a comment header naming the prediction.
std::string chosen_yaml(const Candidate& chosen, const Cluster& cluster);

/// The model `base` scaled: `layers` layers (first_dense_layers kept) and `experts` experts.
Config scaled_model(const Config& base, int layers, int experts);

struct LargestModel {
  int layers = 0, experts = 0;
  int64_t parameters = 0;  ///< total
  Candidate best;          ///< its fastest layout that fits
};
/// The largest model (total parameters) of `base` scaled over `layer_choices` ×
/// `expert_choices` that fits `rates.cluster()` in one of `options`' layouts, with its fastest
/// layout. Throws when none fits.
LargestModel largest_model(const Config& base, const Rates& rates,
                           const std::vector<int>& layer_choices,
                           const std::vector<int>& expert_choices, const PlanOptions& options);

}  // namespace xmoe::plan
