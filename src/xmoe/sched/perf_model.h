#pragma once
// A profile: the fitted performance models of one machine (sched/linear_model.h) and the
// machine they were measured on, as `xmoe profile` writes it (JSON, docs/profile.md) and the
// scheduler and planner read it. Collectives have one model per link class (intra-node,
// inter-node of the declared topology); the experts' grouped GEMMs one per kind and shape;
// gathering and scattering rows one each.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "xmoe/comm/topology.h"
#include "xmoe/sched/linear_model.h"

namespace xmoe::sched {

/// What a model times. x is bytes for collectives and row moves, FLOPs for GEMMs:
///   all_to_all_v    bytes one rank sends in all (1/ranks of it to each rank, itself included)
///   all_gather      bytes of the gathered tensor (every rank gives 1/ranks of it)
///   reduce_scatter  bytes of the tensor each rank reduces (each keeps 1/ranks of the sum)
///   all_reduce      bytes of the tensor
///   gemm_forward          y[rows, out] = x[rows, in] @ w[g]    (ops::grouped_matmul)
///   gemm_backward_data    dx[rows, in] = dy[rows, out] @ w[g]^T (trans_w)
///   gemm_backward_weight  dw[g] = x_g^T @ dy_g  (ops::grouped_matmul_weight_grad)
///                   all three: 2 * rows * in * out FLOPs, rows split evenly over `groups`
///   gather_rows     bytes of the rows gathered (ops::gather_rows)
///   scatter_rows    bytes of the rows scatter-added with a weight (ops::scatter_add_rows)
///   attention_forward   causal self-attention (ops::attention) of `pairs` (sequence, head)
///                       pairs of seq_len × head_dim: 4 * pairs * seq_len^2 * head_dim FLOPs
///                       (the whole square; the causal kernel does about half)
///   attention_backward  ops::attention_backward, the same FLOPs count
///   adamw           bytes of the f32 parameter, gradient and two moments (16 per element) one
///                   ops::adamw_step updates
enum class Task : uint8_t {
  all_to_all_v,
  all_gather,
  reduce_scatter,
  all_reduce,
  gemm_forward,
  gemm_backward_data,
  gemm_backward_weight,
  gather_rows,
  scatter_rows,
  attention_forward,
  attention_backward,
  adamw,
  quantize_rows_fp8,  ///< FP8 row quantisation (1 x 128 blocks): bytes read and written
};
inline constexpr int kNumTasks = 13;

std::string_view task_name(Task task);
/// The task called `name`; throws naming the known tasks.
Task parse_task(std::string_view name);
bool is_collective(Task task);
bool is_gemm(Task task);
bool is_attention(Task task);
/// "byte" or "flop".
std::string_view task_unit(Task task);
/// "intra_node" / "inter_node".
std::string_view link_name(comm::LinkClass link);

/// One fitted model and what it was measured on.
struct TaskModel {
  Task task = Task::all_reduce;
  comm::LinkClass link = comm::LinkClass::intra_node;  ///< collectives only
  int ranks = 1;                                       ///< ranks of the group (1: compute)
  int64_t in = 0, out = 0, groups = 0;                 ///< GEMMs: w [groups, in, out]
  int64_t head_dim = 0, seq_len = 0;                   ///< attention
  int64_t width = 0;                                   ///< row tasks: elements per row
  /// "f32", "bf16"; GEMMs on FP8 operands (xmoe profile --fp8): "fp8"
  std::string dtype;
  LinearModel fit;
  std::vector<double> x, t;                  ///< the fitted samples (t in seconds)
  std::vector<double> heldout_x, heldout_t;  ///< samples between them, not fitted
  /// Median |predicted - measured| / measured over the held-out samples (NaN when none).
  double heldout_error() const;
};

/// Where the models were measured.
struct Machine {
  std::string device;       ///< "cpu", "cuda"
  std::string device_name;  ///< CPU model or GPU name
  std::string host;
  std::string backend;  ///< the collectives' backend: "single", "mpi", "nccl"
  int world_size = 1;
  int ranks_per_node = 1;  ///< declared (--ranks-per-node) or detected
  int nodes = 1;
  std::string date;  ///< UTC, ISO 8601
  std::string xmoe_version;
};

/// How each size was timed.
struct Measurement {
  std::string statistic = "median";  ///< over repetitions: "median" or "min"
  int warmup = 0, repetitions = 0;
};

struct Profile {
  Machine machine;
  Measurement measurement;
  std::vector<TaskModel> models;

  /// The collective model for `task` over `link`, or nullptr.
  const TaskModel* find(Task task, comm::LinkClass link) const;
  /// Predicted seconds of a collective moving `bytes` (as Task defines them) over `link`, for
  /// a group of the measured size. Throws naming the file's missing model.
  double predict_collective(Task task, comm::LinkClass link, double bytes) const;
  /// The dispatch (or combine) of `bytes_per_rank` routed bytes: one all_to_all_v.
  double predict_dispatch(double bytes_per_rank, comm::LinkClass link) const {
    return predict_collective(Task::all_to_all_v, link, bytes_per_rank);
  }
  /// Predicted seconds of one grouped GEMM kind over `rows` rows of width `in` into `out`
  /// columns: the model of that shape, else of the measured shape nearest in log(in) and
  /// log(out), at 2 * rows * in * out FLOPs. `fp8`: among the models of FP8 operands (dtype
  /// "fp8"), else among the others.
  double predict_gemm(Task kind, int64_t rows, int64_t in, int64_t out, bool fp8 = false) const;
  /// Whether the profile has FP8 GEMM models of `kind`.
  bool has_fp8_gemm(Task kind) const;
  /// Predicted seconds of quantising rows to FP8 that read and write `bytes` in all; nullopt
  /// without a model.
  std::optional<double> predict_quantize_fp8(double bytes) const;
  /// Predicted seconds of gather_rows or scatter_rows moving `bytes`.
  double predict_rows(Task task, double bytes) const;
  /// Predicted seconds of attention_forward or attention_backward over `pairs` (sequence, head)
  /// pairs: the model of that shape, else of the measured one nearest in log(head_dim) and
  /// log(seq_len). nullopt when the profile has none (profiles before these tasks).
  std::optional<double> predict_attention(Task kind, int64_t pairs, int64_t head_dim,
                                          int64_t seq_len) const;
  /// Predicted seconds of one AdamW step over `elements` f32 parameters; nullopt without a model.
  std::optional<double> predict_adamw(int64_t elements) const;
  /// Median relative error over every held-out sample of every model (NaN when none).
  double heldout_error() const;
};

/// The models as a text table, one line each: task, link, ranks, shape, alpha (µs), beta
/// (ns/byte or ms/GFLOP) and the rate it means (GB/s, GFLOP/s), R², points, held-out error.
std::string profile_table(const Profile& profile);

/// The profile as JSON text (docs/profile.md describes the format).
std::string profile_to_json(const Profile& profile);
/// Parses and validates a profile; `source` (the file) is named in every error, with the key:
/// "[profile] p.json: models[2].fit.beta is missing".
Profile profile_from_json(std::string_view text, const std::string& source);
/// Writes atomically (a crash leaves the previous file).
void save_profile(const Profile& profile, const std::string& path);
Profile load_profile(const std::string& path);

}  // namespace xmoe::sched
