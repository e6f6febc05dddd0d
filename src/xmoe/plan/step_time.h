#pragma once
// The predicted time of one training step per rank (docs/plan.md, "Step time"): compute from
// the layers' shapes (GEMMs through the fitted GEMM models or the cluster's FLOP rate,
// attention scores as GEMMs, elementwise work as bytes streamed), communication from α-β
// models per link class (the profile's, else the cluster's links), the gradient sync, the
// parameter gathers of zero and the optimizer.
//
// Overlap rules (each a "hidden: ..." term of the breakdown):
// - MoE pipeline (model.moe.pipeline = r > 1, ep > 1): each MoE layer's Dispatch, Expert and
//   Combine take FSMoE's t(r) (sched/pipeline_plan.h, on these rates) instead of their chunks'
//   stages in series; the difference is hidden, and the chunks' extra start-ups (r GEMMs and
//   exchanges of N/r rows for one of N) are a term of their own.
// - Gradient sync in backward (grad_sync_overlaps_backward: parallel.overlap_grad_sync, every
//   zero level): the last micro-batch's backward hides the sync except the bucket
//   holding the embedding, whose gradient backward finishes last, up to that backward's compute
//   less what the MoE pipeline hides in it.
// - Offload copies in backward (offload_copies_overlap_backward: train.offload_overlap where no
//   sync follows backward): the same rule for the gradients' copies to the host.
// Nothing else overlaps: dispatch and combine wait for their rows, zero's parameter gather and
// the optimizer follow the sync.
#include <optional>
#include <string>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/plan/cluster.h"
#include "xmoe/sched/perf_model.h"
#include "xmoe/train/memory_model.h"

namespace xmoe::plan {

/// A group of `ranks` ranks over `nodes` nodes, ranks / nodes on each.
struct GroupSpan {
  int ranks = 1, nodes = 1;
};
/// The span of a group of `size` members placed `stride` world ranks apart, ranks filling
/// nodes of `ranks_per_node` in order (the layout of parallel/layout.h).
GroupSpan group_span(int size, int stride, int ranks_per_node);

/// Whether `config`'s gradient sync starts during backward (parallel.overlap_grad_sync): the one
/// place where the zero levels that overlap are named (today 2).
bool grad_sync_overlaps_backward(const Config& config);
/// Whether the offloaded optimizer's gradient copies start during backward
/// (train.offload_overlap): one process, parallel.zero < 2 (no sync changes them after it).
bool offload_copies_overlap_backward(const Config& config, int world);
/// Communication of `seconds` that starts piece by piece as backward finishes gradients: all but
/// its `tail` (what backward finishes last) hides, up to `budget` seconds of backward compute.
double hidden_behind_backward(double seconds, double tail, double budget);

/// The rates a step is timed with: a profile's fitted models where given (GEMMs, streaming
/// bytes, collectives per link class), else the cluster's declared rates.
class Rates {
 public:
  explicit Rates(Cluster cluster, std::optional<sched::Profile> profile = std::nullopt);
  const Cluster& cluster() const { return cluster_; }
  bool profiled() const { return profile_.has_value(); }
  /// One GEMM (sched::Task gemm kinds): x[rows, in] @ w[in, out]. `fp8`: on FP8 operands (the
  /// profile's FP8 models, else the cluster's FP8 rate; require_fp8 says whether there is one).
  double gemm(sched::Task kind, int64_t rows, int64_t in, int64_t out, bool fp8 = false) const;
  /// Throws unless FP8 GEMMs can be timed: the profile has FP8 models (xmoe profile --fp8) or,
  /// without a profile, the cluster declares fp8_tflops.
  void require_fp8() const;
  /// Quantising rows to FP8 that read and write `bytes` in all: the profile's model, else
  /// streaming them.
  double quantize_fp8(double bytes) const;
  /// Elementwise work that reads and writes `bytes` in all.
  double stream(double bytes) const;
  /// Bytes one AdamW element streams: the gradient read (4), the master weight read and written
  /// (8), m and v read and written (16 f32, 8 bf16).
  static double adamw_bytes_per_element(bool moments_bf16) { return moments_bf16 ? 20 : 28; }
  /// Causal attention (sched::Task attention kinds) of `pairs` (sequence, head) pairs: the
  /// profile's model, else the cluster's FLOP rate on the causal half of the square (backward:
  /// 2.5 times forward's FLOPs).
  double attention(sched::Task kind, int64_t pairs, int64_t head_dim, int64_t seq_len) const;
  /// AdamW over `elements` f32 parameters: the profile's model, else streaming the bytes an
  /// element reads and writes (adamw_bytes_per_element). bf16 moments (train.adam_moments_dtype)
  /// scale the profile's f32-moment model by their share of the bytes.
  double adamw(int64_t elements, bool moments_bf16 = false) const;
  /// One collective (bytes as sched::Task defines them) over `span`: on one node over the
  /// intra-node link; over several, the intra-node part then the inter-node part (all_reduce,
  /// all_gather, reduce_scatter: hierarchical), or both links at once (all_to_all_v).
  double collective(sched::Task task, GroupSpan span, double bytes) const;
  /// An all_to_all_v whose `bytes` are split into those to ranks of this node and to others.
  double all_to_all(GroupSpan span, double intra_bytes, double inter_bytes) const;

 private:
  /// α (s per step) and bandwidth (bytes/s) of `task` over `link`: the profile's model
  /// unfolded from the group it was measured on, else the cluster's link.
  Link link(sched::Task task, comm::LinkClass link) const;
  Cluster cluster_;
  std::optional<sched::Profile> profile_;
};

/// One named part of the step and its seconds.
struct TimeTerm {
  std::string name;
  double seconds = 0;
};

struct StepTime {
  double compute = 0;        ///< forward + backward + recompute, all micro-batches
  double communication = 0;  ///< tp collectives, dispatch/combine, gradient sync, zero gathers
  double optimizer = 0;      ///< AdamW, clipping, offload transfers
  double hidden = 0;         ///< communication hidden behind compute (the overlap rules)
  double total = 0;
  std::vector<TimeTerm> terms;
};

struct StepTimeOptions {
  int world = 1;
  /// The busiest rank's expert rows over the mean (as train::MemoryModelOptions).
  double load_imbalance = 1.25;
  /// MoE chunks r of the pipelined layer each way (1: not pipelined; at most E / ep are made),
  /// as model.moe.pipeline sets them.
  int moe_chunks = 1;
};

/// The non-zero terms: " attention fwd+bwd 0.1024; dense FFN fwd+bwd 0.0666; ..." (seconds).
std::string time_terms(const StepTime& time);

/// The step time of `config` on rank 0 of `options.world` ranks, whose memory model is
/// `memory` (it gives the gradient bytes per sync group and the optimizer's elements).
StepTime predict_step_time(const Config& config, const train::MemoryModel& memory,
                           const Rates& rates, const StepTimeOptions& options);

}  // namespace xmoe::plan
