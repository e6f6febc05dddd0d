#pragma once
// The training loop: data → model forward/backward → gradient clipping → AdamW → routing-bias
// update, with a live progress line, periodic validation, JSON-lines metrics and atomic
// checkpoints that resume bit for bit on the CPU.
#include <functional>
#include <string>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"

namespace xmoe::train {

/// Exit code of `xmoe train` when a checkpoint save failed and train.on_save_error = stop
/// (EX_TEMPFAIL of sysexits.h: free space, then --resume).
inline constexpr int kExitSaveFailed = 75;

struct StepMetrics {
  int step = 0;         ///< 1-based step just finished
  double loss = 0;      ///< mean cross-entropy over the global batch (nats/token)
  double aux_loss = 0;  ///< weighted MoE auxiliary losses
  double lr = 0;
  double grad_norm = 0;  ///< global norm before clipping
  double tokens_per_s = 0;
  double seconds = 0;  ///< wall time of this step
  /// Seconds the step waited after backward for the gradient sync (the exposed sync: what
  /// parallel.overlap_grad_sync and parallel.grad_partition hide is not in it). Host time: on
  /// CPU ranks the wait itself; on CUDA what the host spent queueing and staging
  double grad_sync_seconds = 0;
  double mfu = 0;               ///< model FLOPs utilisation on CUDA (train/flops.h); 0 on the CPU
  int64_t max_expert_load = 0;  ///< over all MoE layers, tokens routed to the busiest expert
  int64_t min_expert_load = 0;
  bool skipped = false;  ///< non-finite loss or gradient: no update was made
};

struct EvalMetrics {
  int step = 0;
  double val_loss = 0;  ///< with data.mix: the folders' losses weighted by data.mix's weights
  std::vector<double> set_losses;  ///< data.mix: each folder's, in data.mix's order
};

struct TrainOptions {
  bool resume = false;     ///< continue from the latest checkpoint of train.out_dir
  bool overwrite = false;  ///< start over in a train.out_dir that holds a run (deletes it)
  bool progress = true;    ///< print the live progress line
  /// Stop (with a checkpoint) after this step; -1 = train.steps. 0 on a fresh run: save the
  /// initial weights as step-0 and stop.
  int stop_after = -1;
  /// The processes to train on; null = comm::world() (MPI under mpirun/srun, else one process).
  std::shared_ptr<comm::Group> world;
};

struct TrainResult {
  int first_step = 0;  ///< step the run started from (0, or the resumed checkpoint's)
  int last_step = 0;
  double seconds = 0;
  std::vector<StepMetrics> steps;
  std::vector<EvalMetrics> evals;
  std::string out_dir;
  std::string last_checkpoint;
  /// SIGTERM/SIGINT that stopped the run after last_step (train/stop_signal.h); 0 = none
  int stop_signal = 0;
  /// A checkpoint save failed with train.on_save_error = stop: its message; the run stopped
  /// after that step. Empty otherwise.
  std::string save_error;
  /// Seconds the training loop waited for checkpoint saves: the whole save when synchronous;
  /// with train.async_checkpoint the collectives and the host copy, plus any wait for the
  /// previous save and the final one (bench_checkpoint measures it).
  double save_seconds = 0;
  int64_t optimizer_bytes = 0;  ///< AdamW moment bytes held by this rank (parallel.zero divides)
  /// f32 master weight bytes held by this rank (with bf16 copies parallel.zero divides them),
  /// and of them those that the optimizer's pieces hold (Parameter::master_sharded: the
  /// parameters themselves keep only their bf16 copies)
  int64_t master_bytes = 0, sharded_master_bytes = 0;
  /// Gradient bytes this rank holds between steps, after the last one (zero 2: the shards)
  int64_t gradient_bytes = 0;
  /// The allocator's measure of the run on its device (train/memory_model.h predicts both):
  /// the most bytes live inside any step, and the bytes live after the last step, each above
  /// what was live before the run built its model.
  int64_t peak_step_bytes = 0;
  int64_t steady_bytes = 0;
  /// train.offload_optimizer: host bytes the gradients and bf16 copies travel through between
  /// the device and the host update (0 without offload)
  int64_t offload_staging_bytes = 0;
  /// train.offload_delayed_update_from: bytes of the twins the delayed update writes (and, on
  /// the CPU, of the f32 copies forward reads instead of the master weights)
  int64_t delayed_update_bytes = 0;
};

/// Trains `config` (already validated; for a resume, train::resume_config's). Prepares the
/// corpus into data.dir on first use. All ranks must pass the same config (checked). The run
/// folder rules are those of train/run_folder.h.
TrainResult train(const Config& config, const TrainOptions& options = {});

}  // namespace xmoe::train
