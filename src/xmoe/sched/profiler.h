#pragma once
// Measures the performance models of sched/perf_model.h on the machine at hand: each task over
// a geometric sweep of sizes (warm-up, repetitions, median), fitted by sched/linear_model.h,
// plus held-out sizes between the swept ones that measure how well the fit predicts.
// `xmoe profile` runs it; docs/profile.md describes the sweeps and the timing.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/core/device.h"
#include "xmoe/sched/perf_model.h"

namespace xmoe::sched {

/// A grouped GEMM's weight shape: w [groups, in, out].
struct GemmShape {
  int64_t in = 0, out = 0;
};
/// "INxOUT", e.g. "1024x512"; throws naming `key` (the flag) and the bad text.
GemmShape parse_gemm_shape(std::string_view text, std::string_view key);
/// Causal attention's shape: head width and sequence length.
struct AttentionShape {
  int64_t head_dim = 0, seq_len = 0;
};
/// "HEAD_DIMxSEQ_LEN", e.g. "64x2048"; throws naming `key` and the bad text.
AttentionShape parse_attention_shape(std::string_view text, std::string_view key);
/// The attention of the preset the device usually trains: tiny's (64x128) on the CPU,
/// moe-1b's (64x2048) on CUDA; --quick: 32x64.
std::vector<AttentionShape> default_attention_shapes(Device device, bool quick);
/// The experts' projections of the preset the device usually trains: on the CPU tiny's
/// (d 256, f 128: gate_up 256x256, down 128x256), on CUDA moe-1b's (d 1024, f 256: 1024x512,
/// 256x1024); --quick: one small shape.
std::vector<GemmShape> default_gemm_shapes(Device device, bool quick);

struct ProfileProgress {
  int done = 0, total = 0;
  std::string label;  ///< the size just measured: "all_reduce intra_node 1 MiB"
};

struct ProfileOptions {
  /// Smaller sweeps and fewer repetitions (seconds instead of minutes; for tests and a first
  /// look).
  bool quick = false;
  std::vector<GemmShape> gemm_shapes;            ///< empty: default_gemm_shapes
  std::vector<AttentionShape> attention_shapes;  ///< empty: default_attention_shapes
  int64_t gemm_groups = 8;                       ///< experts per grouped GEMM (rows split evenly)
  int64_t row_width = 256;  ///< elements per row for gather_rows / scatter_rows
  /// Also the FP8 experts' GEMMs (model.moe.expert_dtype = fp8: forward and data gradient on
  /// quantised operands) and the FP8 row quantiser, for `xmoe plan` of an FP8 config.
  bool fp8 = false;
  /// Per size, over the repetitions: "median" (the typical time; the default) or "min" (the
  /// machine's best, robust to other processes descheduling a rank on a shared machine).
  std::string statistic = "median";
  /// Called on every rank after each measured size.
  std::function<void(const ProfileProgress&)> progress;
};

/// Measures and fits every model on `world` (collective: every rank calls it) with tensors on
/// `device` (the device `world` moves tensors on, or any device for a one-rank world).
/// Collectives run per link class: intra-node over the ranks of each node (all nodes at
/// once), inter-node over the ranks of the same position on each node, skipped where such a
/// group has one rank. Each repetition starts after a barrier of the group and ends with a
/// device synchronisation; its time is the maximum over all ranks; a size's time is the median
/// (or minimum) over repetitions. Every rank returns the same profile.
Profile run_profile(const std::shared_ptr<comm::Group>& world, Device device,
                    const ProfileOptions& options);

}  // namespace xmoe::sched
