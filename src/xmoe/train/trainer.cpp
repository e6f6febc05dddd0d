#include "xmoe/train/trainer.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "xmoe/comm/nccl/nccl_group.h"
#include "xmoe/comm/watchdog.h"
#include "xmoe/core/allocator.h"
#include "xmoe/core/env.h"
#include "xmoe/core/timer.h"
#include "xmoe/data/data_loader.h"
#include "xmoe/data/prepare.h"
#include "xmoe/io/file.h"
#include "xmoe/model/transformer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/moe/placement.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/optim/clip.h"
#include "xmoe/optim/schedule.h"
#include "xmoe/parallel/grad_sync.h"
#include "xmoe/parallel/layout.h"
#include "xmoe/sched/grad_partition.h"
#include "xmoe/sched/pipeline_plan.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/checkpoint_writer.h"
#include "xmoe/train/flops.h"
#include "xmoe/train/progress.h"
#include "xmoe/train/run_folder.h"
#include "xmoe/train/state.h"
#include "xmoe/train/stop_signal.h"

namespace fs = std::filesystem;

namespace xmoe::train {

namespace {

/// Mean of a per-rank value over the world (every rank gets the same double).
double world_mean(comm::Group& world, double v) {
  if (world.size() == 1) return v;
  Tensor t = Tensor::from_vector<double>({v}, {1}, world.device());  // NCCL groups: on the GPU
  world.all_reduce(t);
  return t.item() / world.size();
}

/// A checkpoint vote (train/checkpoint.h): true on every rank when every rank passes `ok`.
bool vote(comm::Group& group, bool ok) {
  Tensor t = Tensor::from_vector<int32_t>({ok ? 1 : 0}, {1}, group.device());
  group.all_reduce(t, comm::ReduceOp::min);
  return t.to(Device::cpu()).data<int32_t>()[0] == 1;
}

/// A batch's ids and targets on `device` (the loader produces them on the host).
data::Batch on_device(data::Batch b, Device device) {
  if (device.is_cpu()) return b;
  b.inputs = b.inputs.to(device);
  b.targets = b.targets.to(device);
  return b;
}

double evaluate(model::Transformer& model, const data::DataLoader& loader, int batches,
                comm::Group& world) {
  const int64_t n = std::min<int64_t>(batches, loader.num_eval_batches());
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const data::Batch b = on_device(loader.eval_batch(i), model.device());
    total += model.evaluate_loss(b.inputs, b.targets);
  }
  return world_mean(world, total / static_cast<double>(n));
}

/// parallel.expert_placement = affinity: records which experts the next training batches pick
/// together (forward only), then permutes each MoE layer's experts over the nodes so that
/// co-chosen experts share a node (fewer pilots cross nodes under rbd). Weights, router columns,
/// balancing bias and AdamW moments move together: the model's function is unchanged.
void place_experts(model::Transformer& model, optim::AdamW& opt, const data::DataLoader& loader,
                   const parallel::Layout& layout, int batches, bool leader) {
  const int nodes = layout.ep_group->topology().num_nodes();
  if (nodes < 2) {
    if (leader) spdlog::info("expert placement: the experts are on one node; nothing to place");
    return;
  }
  const MoeConfig& moe_cfg = model.config().moe;
  if (moe_cfg.gate == "sigmoid" && moe_cfg.num_groups > 1) {
    if (leader)
      spdlog::warn(
          "expert placement skipped: group-limited routing (moe.num_groups = {}) ties "
          "experts to their groups",
          moe_cfg.num_groups);
    return;
  }
  const auto layers = model.moe_layers();
  // AdamW's moments move with their parameters' experts (each layer takes its own parameters'
  // riders). A Tensor shares its storage: the layer permutes the optimizer's m and v in place.
  std::vector<moe::ExpertRider> riders;
  for (size_t i = 0; i < opt.parameters().size(); ++i) {
    riders.push_back({opt.parameters()[i], opt.m(i)});
    riders.push_back({opt.parameters()[i], opt.v(i)});
  }
  for (moe::MoELayer* l : layers) l->set_record_coactivation(true);
  for (int i = 0; i < batches; ++i) {
    const data::Batch b =
        on_device(loader.batch_at(loader.position() + static_cast<uint64_t>(i)), model.device());
    model.evaluate_loss(b.inputs, b.targets);
  }
  for (moe::MoELayer* l : layers) {
    const moe::CoactivationMatrix c = l->global_coactivation();
    const int per_node = static_cast<int>(c.num_experts / nodes);
    std::vector<int> identity(static_cast<size_t>(c.num_experts));
    for (int e = 0; e < c.num_experts; ++e) identity[static_cast<size_t>(e)] = e;
    const std::vector<int> perm = moe::optimize_placement(c, nodes, per_node);
    if (leader)
      spdlog::info("expert placement {}: intra-node co-activation {} -> {}", l->prefix(),
                   moe::intra_node_coactivation(c, identity, per_node),
                   moe::intra_node_coactivation(c, perm, per_node));
    l->permute_experts(perm, riders);
    l->set_record_coactivation(false);
    l->reset_coactivation();
  }
  model.refresh_compute_weights();  // the experts' master weights moved
}

/// XMOE_INJECT_FAULT=<rank>:<step> makes that rank throw at that step: the test of how a job
/// stops when one process fails (docs/training.md).
void maybe_inject_fault(int rank, int step) {
  static const char* spec = env::text("XMOE_INJECT_FAULT");
  if (!spec) return;
  int fault_rank = -1, fault_step = -1;
  if (std::sscanf(spec, "%d:%d", &fault_rank, &fault_step) == 2 && fault_rank == rank &&
      fault_step == step)
    XMOE_FAIL("[train] injected fault on rank {} at step {} (XMOE_INJECT_FAULT={})", rank, step,
              spec);
}

/// XMOE_INJECT_HANG=<rank>:<step> makes that rank stop answering before that step (it sleeps
/// an hour): the test of the collective watchdog (parallel.collective_timeout_s).
void maybe_inject_hang(int rank, int step) {
  static const char* spec = env::text("XMOE_INJECT_HANG");
  if (!spec) return;
  int hang_rank = -1, hang_step = -1;
  if (std::sscanf(spec, "%d:%d", &hang_rank, &hang_step) == 2 && hang_rank == rank &&
      hang_step == step) {
    spdlog::warn("rank {}: injected hang before step {} (XMOE_INJECT_HANG={})", rank, step, spec);
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

/// parallel.collective_timeout_s on `world` (and the groups split from it) while alive; the
/// world group may outlive the run (comm::world()), so the watchdog goes with the run.
class WatchdogOnGroup {
 public:
  WatchdogOnGroup(comm::Group& group, double timeout_s) : group_(group) {
    if (timeout_s > 0 && group.size() > 1)
      group.set_watchdog(std::make_shared<comm::Watchdog>(timeout_s));
  }
  ~WatchdogOnGroup() { group_.set_watchdog(nullptr); }
  WatchdogOnGroup(const WatchdogOnGroup&) = delete;
  WatchdogOnGroup& operator=(const WatchdogOnGroup&) = delete;

 private:
  comm::Group& group_;
};

/// train.device: "cpu", "cuda:N", or "cuda" = cuda:0 for one process and, with several, the
/// rank's position among the ranks of its host (one rank per GPU), taken from `hosts` (the
/// group as detected, before any declared simulated nodes).
Device training_device(const TrainConfig& tc, comm::Group& hosts) {
  const Device d = parse_device(tc.device);
  if (d.is_cpu()) return d;
  XMOE_CHECK(cuda_available(),
             "[train] train.device = {}: no CUDA device is available (this xmoe was built without "
             "CUDA, or no GPU is visible)",
             tc.device);
  const int count = cuda_device_count();
  if (tc.device == "cuda" && hosts.size() > 1)
    return Device::cuda(hosts.topology().local_rank(hosts.rank()) % count);
  XMOE_CHECK(d.index < count, "[train] train.device = {}: only {} CUDA device(s) visible",
             tc.device, count);
  return d;
}

/// The group the layout splits. On the CPU: `world` itself. On CUDA: an NCCL group over
/// `world`'s ranks (and topology) on `device`, so that every collective of a step (dispatch,
/// gradient all-reduce, routing statistics, norms, evaluation, checkpoint barrier) moves device
/// tensors; also for one process, where it costs nothing per step. Without NCCL one process
/// keeps `world` (a size-1 group copies or does nothing); several are refused, since the MoE
/// dispatch cannot stage device rows through MPI.
std::shared_ptr<comm::Group> device_world(std::shared_ptr<comm::Group> world, Device device,
                                          const TrainConfig& tc) {
  if (device.is_cpu() || world->device() == device) return world;
  XMOE_CHECK(world->device().is_cpu(),
             "[train] train.device = {} selects {}, but the given world group ({}) moves tensors "
             "on {}",
             tc.device, device.str(), world->backend_name(), world->device().str());
  if (!comm::nccl::available()) {
    XMOE_CHECK(world->size() == 1,
               "[train] train.device = {} with {} processes needs NCCL (the collectives of a "
               "step move GPU tensors), but this xmoe was built without NCCL (XMOE_NCCL=OFF; see "
               "docs/cuda.md, \"NCCL backend\"); build with NCCL, run one process, or set "
               "train.device = cpu",
               tc.device, world->size());
    return world;
  }
  if (world->size() > 1) {
    // NCCL takes one device per rank. Every rank learns the verdict before any communicator
    // exists, so none waits alone in ncclCommInitRank.
    const comm::nccl::HostRanks host = comm::nccl::host_ranks(*world);
    const int devices = cuda_device_count();
    std::string mine;
    if (host.local_size > devices)
      mine = fmt::format(
          "this host runs {} ranks but has {} CUDA device(s); NCCL needs one device "
          "per rank (run at most one rank per GPU)",
          host.local_size, devices);
    else if (host.local_size > 1 && tc.device != "cuda")
      mine = fmt::format(
          "{} ranks on this host would all use {}; use train.device = cuda (each "
          "rank takes the device of its position on its host)",
          host.local_size, device.str());
    Tensor bad = Tensor::from_vector<int32_t>({mine.empty() ? 0 : 1}, {1});
    world->all_reduce(bad, comm::ReduceOp::max);
    XMOE_CHECK(
        bad.data<int32_t>()[0] == 0, "[train] train.device = {}: {}", tc.device,
        mine.empty() ? std::string("another rank cannot have a CUDA device of its own") : mine);
  }
  return comm::nccl::make_group(std::move(world), device.index);
}

/// When train() leaves by an exception, abandons the layout's NCCL communicators (ncclCommAbort)
/// before they are destroyed: one rank may fail alone while its peers wait for it in a
/// collective, and ncclCommDestroy or a stream sync in the groups' destructors would then wait
/// forever instead of reaching the MPI_Abort that stops the job (tools/xmoe/main.cpp).
class AbandonOnError {
 public:
  explicit AbandonOnError(const parallel::Layout& layout)
      : layout_(layout), exceptions_(std::uncaught_exceptions()) {}
  ~AbandonOnError() {
    if (std::uncaught_exceptions() <= exceptions_) return;
    for (const auto& g : {layout_.dp_group, layout_.ep_group, layout_.tp_replica_group,
                          layout_.tp_group, layout_.world})
      if (g) comm::nccl::abandon(*g);
  }
  AbandonOnError(const AbandonOnError&) = delete;
  AbandonOnError& operator=(const AbandonOnError&) = delete;

 private:
  const parallel::Layout& layout_;
  int exceptions_;
};

/// The experts keep what they derive from their weights (moe::Experts::keep_weights) from here
/// until drop() or the end of the scope, whichever comes first.
class ExpertWeightsKept {
 public:
  ExpertWeightsKept(const std::vector<moe::MoELayer*>& layers, bool keep)
      : layers_(keep ? layers : std::vector<moe::MoELayer*>{}) {
    for (moe::MoELayer* l : layers_) l->keep_expert_weights(true);
  }
  ~ExpertWeightsKept() { drop(); }
  void drop() {
    for (moe::MoELayer* l : layers_) l->keep_expert_weights(false);
    layers_.clear();
  }
  ExpertWeightsKept(const ExpertWeightsKept&) = delete;
  ExpertWeightsKept& operator=(const ExpertWeightsKept&) = delete;

 private:
  std::vector<moe::MoELayer*> layers_;
};

/// train.dtype: auto = bf16 on CUDA, f32 on the CPU.
DType compute_dtype(const TrainConfig& tc, Device device) {
  if (tc.dtype == "f32") return DType::f32;
  if (tc.dtype == "bf16") {
    XMOE_CHECK(device.is_cuda(), "[train] train.dtype = bf16 needs a CUDA device, got {}",
               device.str());
    return DType::bf16;
  }
  XMOE_CHECK(tc.dtype == "auto", "[config] train.dtype = {} is not auto, f32 or bf16", tc.dtype);
  return device.is_cuda() ? DType::bf16 : DType::f32;
}

/// The state of one training run. The steps of train() are its methods: open the run folder,
/// resume, train a step, log it, evaluate, save.
class Run {
 public:
  /// `save_group`: the ranks of the world on the host, for the checkpoint votes (which run on
  /// the writer thread with train.async_checkpoint, beside the step's collectives).
  Run(const Config& config, const TrainOptions& options, const parallel::Layout& layout,
      Device device, std::shared_ptr<comm::Group> save_group)
      : config_(config),
        tc_(config.train),
        options_(options),
        layout_(layout),
        device_(device),
        leader_(layout.world_rank == 0),
        save_group_(std::move(save_group)) {}

  /// Rank 0 takes the run folder (the lock; for a fresh run, the refusal to write over a run
  /// unless --overwrite) and the token files (prepared on first use). Others wait.
  void open_folder_and_data() {
    if (leader_) {
      lock_.emplace(tc_.out_dir);
      if (!options_.resume) start_fresh_run(tc_.out_dir, options_.overwrite);
      const std::vector<std::string> dirs = data_dirs();
      const std::vector<data::PreparedData> sets =
          config_.data.mix.empty()
              ? std::vector<data::PreparedData>{data::ensure_prepared(config_.data)}
              : data::prepared_mix(parse_data_mix(config_.data.mix));
      const data::PreparedData& d = sets.front();  // prepared_mix: all alike
      XMOE_CHECK(config_.model.vocab_size >= d.vocab_size,
                 "[train] model.vocab_size = {} is smaller than the vocabulary of {} {} ({} "
                 "tokens, {} tokenizer); set model.vocab_size to at least {}",
                 config_.model.vocab_size, config_.data.mix.empty() ? "data.dir" : "data.mix",
                 dirs.front(), d.vocab_size, d.tokenizer, d.vocab_size);
      // Read now: each checkpoint carries the tokenizer, even if the data folder goes away.
      tokenizer_kind_ = d.tokenizer;
      if (!d.tokenizer_file.empty())
        tokenizer_files_[fs::path(d.tokenizer_file).filename().string()] =
            io::read_file(d.tokenizer_file);
    }
    save_group_->barrier();  // unwatched: preparing a large corpus may take long
  }

  /// The prepared folders training reads: data.dir, or data.mix's folders in order.
  std::vector<std::string> data_dirs() const {
    if (config_.data.mix.empty()) return {config_.data.dir};
    std::vector<std::string> dirs;
    for (const DataMixEntry& e : parse_data_mix(config_.data.mix)) dirs.push_back(e.dir);
    return dirs;
  }

  void build() {
    base_live_bytes_ = memory_stats(device_).live_bytes;
    data::TokenFile::Options topt;
    topt.vocab_size = config_.model.vocab_size;
    topt.min_tokens = tc_.seq_len + 1;
    // data.mix: windows drawn from every folder's train.bin by weight; each folder's val.bin
    // evaluated on its own. The tp ranks of a group read the same micro-batches (each takes its
    // sequences).
    std::vector<data::TokenFile> train_files;
    std::vector<double> weights;
    const std::vector<DataMixEntry> mix = parse_data_mix(config_.data.mix);
    for (const std::string& dir : data_dirs()) {
      train_files.push_back(data::TokenFile::open((fs::path(dir) / "train.bin").string(), topt));
      val_loaders_.emplace_back(data::TokenFile::open((fs::path(dir) / "val.bin").string(), topt),
                                tc_.batch_size, tc_.seq_len, tc_.seed, layout_.data_rank(),
                                layout_.data_ranks());
      val_names_.push_back(dir);
      weights.push_back(mix.empty() ? 1.0 : mix[weights.size()].weight);
    }
    train_loader_.emplace(std::move(train_files), std::move(weights), tc_.batch_size, tc_.seq_len,
                          tc_.seed, layout_.data_rank(), layout_.data_ranks());

    // Built and initialised on the host (the same weights on any device), then moved.
    model_ = std::make_unique<model::Transformer>(config_.model, tc_.seed, &layout_);
    // train.offload_optimizer: the master weights go to pinned host memory (on the CPU they are
    // there already), parameter by parameter; AdamWConfig::from(tc_) makes the optimizer update
    // them on the host.
    model_->place(device_, compute_dtype(tc_, device_), tc_.offload_optimizer);
    params_ = model_->parameters();
    moe_layers_ = model_->moe_layers();
    configure_pipeline();
    // parallel.zero >= 1: AdamW holds moments only for the pieces of the buckets' shards this
    // rank owns (zero 0: every parameter whole, one piece each).
    grad_sync_ = std::make_unique<parallel::GradientSync>(
        params_, layout_, int64_t{config_.parallel.bucket_kib} << 10, config_.parallel.zero,
        dense_grad_pieces());
    std::vector<optim::AdamWPiece> pieces;
    for (const parallel::OwnedPiece& p : grad_sync_->owned_pieces())
      pieces.emplace_back(p.param, p.offset, p.count, Tensor(), p.shard_grad, p.master);
    opt_ = std::make_unique<optim::AdamW>(
        pieces, optim::AdamWConfig::for_run(tc_, grad_sync_->grads_final_after_backward()));
    // zero >= 1 with bf16 copies: the optimizer copied its pieces' f32 master weights; the
    // parameters keep only their bf16 copies (those of every rank, all-gathered each step).
    for (Parameter* p : params_)
      if (parallel::GradientSync::shards_master(*p, config_.parallel.zero))
        p->shard_master_weights();
    // zero 2: whole gradients exist only from their module's backward to their bucket's
    // reduce-scatter, the first step's too.
    if (config_.parallel.zero == 2)
      for (Parameter* p : params_) p->release_grad();
    result.optimizer_bytes = opt_->state_bytes();
    result.master_bytes = result.sharded_master_bytes = opt_->master_bytes();
    for (const Parameter* p : params_)
      if (!p->master_sharded) result.master_bytes += 4 * p->value.numel();
    result.offload_staging_bytes = opt_->staging_bytes();
    result.delayed_update_bytes = opt_->delayed_update_bytes();
    schedule_.emplace(optim::LrSchedule::from(tc_));
    tokens_per_step_ =
        static_cast<int64_t>(tc_.batch_size) * tc_.seq_len * tc_.grad_accum * layout_.data_ranks();
    result.out_dir = tc_.out_dir;
  }

  /// model.moe.pipeline: the chunks of every MoE layer (the same shape everywhere), logged.
  void configure_pipeline() {
    if (moe_layers_.empty()) return;
    const int64_t tokens = static_cast<int64_t>(tc_.batch_size) * tc_.seq_len /
                           (layout_.tp > 1 && layout_.ssmb ? layout_.tp : 1);
    const int ep_nodes = layout_.ep_group ? layout_.ep_group->topology().num_nodes() : 1;
    const auto bytes = static_cast<int64_t>(dtype_size(compute_dtype(tc_, device_)));
    const sched::PipelineChoice p =
        sched::resolve_pipeline(config_, tokens, layout_.ep, ep_nodes, bytes);
    for (moe::MoELayer* l : moe_layers_) l->set_pipeline(p.forward, p.backward);
    pipeline_backward_ = p.backward;
    if (leader_ && config_.model.moe.pipeline != "off") spdlog::info("{}", p.summary());
  }

  /// parallel.grad_partition = auto (several ranks): the dense gradients' buckets, one per piece
  /// of backward's modules (sched/grad_partition.h), logged; else none (fixed-size buckets).
  std::vector<std::vector<Parameter*>> dense_grad_pieces() {
    if (config_.parallel.grad_partition != "auto" || layout_.world_size == 1) return {};
    const std::vector<model::Transformer::BackwardModule> modules = model_->backward_modules();
    std::vector<sched::GradModule> sizes;
    for (const auto& m : modules) {
      sched::GradModule g{m.name, 0.0, 0};
      for (const Parameter* p : m.params)
        if (p->kind == ParamKind::dense) g.grad_bytes += 4 * p->value.numel();
      sizes.push_back(g);
    }
    sched::BackwardShape shape;
    shape.batch = tc_.batch_size;
    shape.seq_len = tc_.seq_len;
    shape.ep = layout_.ep;
    shape.tp = layout_.tp;
    shape.ssmb = layout_.ssmb;
    shape.elem_bytes = static_cast<int64_t>(dtype_size(compute_dtype(tc_, device_)));
    shape.pipeline_backward = pipeline_backward_;
    const bool ep_nodes = layout_.ep_group && layout_.ep_group->topology().num_nodes() > 1;
    shape.ep_link = ep_nodes ? comm::LinkClass::inter_node : comm::LinkClass::intra_node;
    const comm::LinkClass world_link = layout_.world->topology().num_nodes() > 1
                                           ? comm::LinkClass::inter_node
                                           : comm::LinkClass::intra_node;
    const sched::GradPartition g = sched::resolve_grad_partition(config_, sizes, shape, world_link);
    if (leader_) spdlog::info("{}", g.summary(sizes));
    std::vector<std::vector<Parameter*>> buckets;
    for (const sched::GradPiece& piece : g.pieces) {
      buckets.emplace_back();
      for (int m = piece.first; m <= piece.last; ++m)
        for (Parameter* p : modules[static_cast<size_t>(m)].params)
          if (p->kind == ParamKind::dense) buckets.back().push_back(p);
    }
    return buckets;
  }

  /// --resume: restores the latest checkpoint; returns its step.
  int resume() {
    const auto latest = latest_checkpoint(tc_.out_dir);
    XMOE_CHECK(latest.has_value(), "[train] --resume: no checkpoint in train.out_dir = {} ({})",
               tc_.out_dir, inspect_run_folder(tc_.out_dir).describe());
    const Checkpoint ckpt = load_checkpoint(*latest);
    const Config saved =
        load_config_string(ckpt.state.at("config").get<std::string>(), *latest + "/manifest.json");
    const std::vector<std::string> differ = config_differences(saved, config_, "model.");
    XMOE_CHECK(differ.empty(),
               "[train] --resume: the model of {} differs from the configured model in {} "
               "(checkpoint -> configured)",
               *latest, fmt::join(differ, "; "));
    restore_checkpoint_tensors(ckpt.tensors, params_, *opt_, moe_layers_, *latest);
    model_->refresh_compute_weights();
    const int step = ckpt.state.at("step").get<int>();
    XMOE_CHECK(step <= tc_.steps,
               "[train] --resume: {} is at step {}, past train.steps = {}; give a larger "
               "train.steps to continue (--set train.steps=N)",
               *latest, step, tc_.steps);
    train_loader_->set_position(ckpt.state.at("data_position").get<uint64_t>());
    result.last_checkpoint = *latest;
    if (leader_) {
      truncate_metrics(tc_.out_dir, step);
      if (step == tc_.steps)
        spdlog::info(
            "{} is at step {} = train.steps: nothing to train (to continue, give a "
            "larger train.steps: --set train.steps=N)",
            *latest, step);
      else
        spdlog::info("resumed from {} at step {}", *latest, step);
    }
    return step;
  }

  /// Once the run is known good to start (a resume restored): config.yaml, written
  /// atomically, and metrics.jsonl opened for appending.
  void write_config_and_open_metrics() {
    if (!leader_) return;
    io::write_file_atomic((fs::path(tc_.out_dir) / "config.yaml").string(), to_yaml(config_));
    metrics_.emplace((fs::path(tc_.out_dir) / "metrics.jsonl").string());
  }

  /// parallel.expert_placement = affinity (after a resume: the placement moves what it loaded).
  void place() {
    if (config_.parallel.expert_placement == "affinity")
      place_experts(*model_, *opt_, *train_loader_, layout_, config_.parallel.placement_batches,
                    leader_);
  }

  /// One optimizer step (grad_accum micro-batches); skipped, all ranks alike, when the loss or
  /// the gradient is not finite. Throws after train.max_bad_steps such steps in a row.
  StepMetrics step(int step) {
    Timer step_timer;
    reset_peak_memory(device_);
    maybe_inject_fault(layout_.world_rank, step);
    maybe_inject_hang(layout_.world_rank, step);
    opt_->forget_prefetched();  // a skipped step's
    model_->zero_grad();
    double loss = 0, aux = 0;
    std::vector<int64_t> load;
    // The micro-batches share the weights: the experts derive their FP8 copies once per step
    // (docs/fp8.md); dropped when the loop ends, before the update changes the weights.
    ExpertWeightsKept kept(moe_layers_, tc_.grad_accum > 1);
    for (int micro = 0; micro < tc_.grad_accum; ++micro) {
      const data::Batch b = on_device(train_loader_->next(), device_);
      loss += model_->forward_loss(b.inputs, b.targets) / tc_.grad_accum;
      aux += model_->aux_loss() / tc_.grad_accum;
      // The last micro-batch's backward hands on each module's finished gradients: overlapped,
      // the gradient sync starts their buckets' all-reduces (zero 2: reduce-scatters, freeing
      // them); the offloaded optimizer starts copying them to the host where no sync follows.
      const bool last = micro + 1 == tc_.grad_accum;
      const bool reduce = last && config_.parallel.overlap_grad_sync &&
                          (config_.parallel.zero == 2 || layout_.world_size > 1);
      const bool prefetch = last && tc_.offload_optimizer && tc_.offload_overlap &&
                            grad_sync_->grads_final_after_backward();
      model_->set_grads_ready(
          reduce || prefetch ? [this, reduce, prefetch](const std::vector<Parameter*>& ps) {
            if (reduce) grad_sync_->grads_ready(ps);
            if (prefetch) opt_->prefetch_grads(ps);
          } : model::Transformer::GradsReady());
      model_->backward(1.0f / static_cast<float>(tc_.grad_accum));
      for (const moe::MoELayer* layer : moe_layers_) {
        const auto& tpe = layer->expert_load();
        if (load.empty()) load.assign(tpe.size(), 0);
        for (size_t e = 0; e < tpe.size() && e < load.size(); ++e) load[e] += tpe[e];
      }
    }
    kept.drop();
    Timer sync_timer;
    grad_sync_->sync();
    const double grad_sync_seconds = sync_timer.seconds();
    StepMetrics m;
    m.grad_sync_seconds = grad_sync_seconds;
    m.step = step;
    m.loss = world_mean(*layout_.world, loss);
    m.aux_loss = aux;
    m.lr = schedule_->at(step - 1);
    m.grad_norm = std::sqrt(grad_sync_->global_grad_sum_squares());
    if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm)) {
      // Every rank sees the same global loss and norm, so all skip (or stop) together.
      m.skipped = true;
      ++bad_in_a_row_;
      if (leader_)
        spdlog::warn(
            "step {}: non-finite {} ({}); update skipped ({} in a row, limit {}); no "
            "checkpoint is saved until a step is finite again",
            step, std::isfinite(m.loss) ? "gradient norm" : "loss",
            std::isfinite(m.loss) ? m.grad_norm : m.loss, bad_in_a_row_, tc_.max_bad_steps);
      XMOE_CHECK(
          bad_in_a_row_ < tc_.max_bad_steps,
          "[train] {} consecutive steps with a non-finite loss or gradient (last at step "
          "{}); stopping. The last good checkpoint is {}",
          bad_in_a_row_, step,
          result.last_checkpoint.empty() ? std::string("(none yet)") : result.last_checkpoint);
    } else {
      bad_in_a_row_ = 0;
      // The clip factor rides on the update (no pass of its own over the gradients).
      if (grad_sync_->zero() == 2) opt_->set_piece_grads(grad_sync_->shard_grads());
      opt_->step(static_cast<float>(m.lr), optim::clip_factor(m.grad_norm, tc_.grad_clip));
      grad_sync_->gather_params();  // zero >= 1: every rank's updated shard to every replica
      for (moe::MoELayer* layer : moe_layers_) layer->update_routing_bias();
    }
    // zero 2: no gradient is held between steps (the next backward makes them again).
    opt_->set_piece_grads({});
    grad_sync_->release_shards();
    result.gradient_bytes = grad_sync_->gradient_bytes();
    const MemoryStats mem = memory_stats(device_);
    result.peak_step_bytes = std::max(result.peak_step_bytes, mem.peak_bytes - base_live_bytes_);
    result.steady_bytes = mem.live_bytes - base_live_bytes_;
    if (!load.empty()) {
      m.max_expert_load = *std::max_element(load.begin(), load.end());
      m.min_expert_load = *std::min_element(load.begin(), load.end());
    }
    m.seconds = step_timer.seconds();
    m.tokens_per_s = static_cast<double>(tokens_per_step_) / m.seconds;
    if (device_.is_cuda())
      m.mfu = mfu(config_.model, tc_.seq_len, m.tokens_per_s, layout_.world_size);
    result.steps.push_back(m);
    return m;
  }

  /// A metrics.jsonl line (rank 0; every write checked).
  void log(const StepMetrics& m) {
    if (!metrics_) return;
    nlohmann::json line{{"step", m.step},
                        {"loss", m.loss},
                        {"aux_loss", m.aux_loss},
                        {"lr", m.lr},
                        {"grad_norm", m.grad_norm},
                        {"tokens_per_s", m.tokens_per_s},
                        {"max_expert_load", m.max_expert_load},
                        {"min_expert_load", m.min_expert_load},
                        {"skipped", m.skipped}};
    if (device_.is_cuda()) line["mfu"] = m.mfu;
    metrics_->write_line(line.dump());
  }

  /// The validation loss: with data.mix, each folder's and their mean weighted as training
  /// draws them (the loss expected on the mixture).
  double evaluate_and_log(int step) {
    EvalMetrics e;
    e.step = step;
    for (size_t i = 0; i < val_loaders_.size(); ++i) {
      const double v = evaluate(*model_, val_loaders_[i], tc_.eval_batches, *layout_.world);
      e.val_loss += train_loader_->weights()[i] * v;
      if (val_loaders_.size() > 1) e.set_losses.push_back(v);
    }
    result.evals.push_back(e);
    if (metrics_) {
      nlohmann::json line{{"step", step}, {"val_loss", e.val_loss}};
      for (size_t i = 0; i < e.set_losses.size(); ++i)
        line["val_loss_sets"][val_names_[i]] = e.set_losses[i];
      metrics_->write_line(line.dump());
    }
    return e.val_loss;
  }

  /// Saves checkpoint step-N, unless the last step was not finite (the weights it would save
  /// are not known to be good): "the last good checkpoint" is always one saved after a finite
  /// step. Then train.keep_checkpoints removes the oldest. With train.async_checkpoint it only
  /// starts the save (collect_save() finishes it). Returns whether it saved (or started).
  bool save(int step) {
    if (bad_in_a_row_ > 0) {
      if (leader_)
        spdlog::warn(
            "step {}: checkpoint not saved (the step was not finite); the last good "
            "checkpoint stays {}",
            step, result.last_checkpoint.empty() ? "(none yet)" : result.last_checkpoint);
      return false;
    }
    // One save at a time: the previous one ends (and counts) before this one starts; unless
    // its failure stops the run (train.on_save_error = stop), this one is tried all the same.
    if (writer_.pending() && !collect_save() && !result.save_error.empty()) return false;
    nlohmann::json state;
    state["config"] = to_yaml(config_);
    state["step"] = step;
    state["data_position"] = train_loader_->position();
    state["seed"] = tc_.seed;
    // The tokenizer travels in the checkpoint (generate and export read it there).
    state["tokenizer"] = {{"kind", tokenizer_kind_}};
    if (!tokenizer_files_.empty()) state["tokenizer"]["file"] = tokenizer_files_.begin()->first;
    state["layout"] = {{"world", layout_.world_size},
                       {"ep", layout_.ep},
                       {"dp", layout_.dp},
                       {"tp", layout_.tp},
                       {"ssmb", layout_.ssmb}};
    const std::string dir = (fs::path(tc_.out_dir) / fmt::format("step-{}", step)).string();
    // A delayed update lands first: the checkpoint holds every step's update (the resumed run
    // continues as the uninterrupted one, which flushes here too).
    opt_->finish();
    // The collective parts (ZeRO's moment gathers, tensor-parallel gathers) on this thread.
    const TensorMap opt_state = optimizer_state(*opt_, *grad_sync_);
    TensorMap tensors = checkpoint_tensors(params_, opt_state, moe_layers_, layout_);
    if (metrics_) metrics_->sync();  // the log on disk reaches at least the checkpoint
    auto write = [dir, state = std::move(state), rank = layout_.world_rank,
                  world = layout_.world_size, group = save_group_, out_dir = tc_.out_dir,
                  keep = leader_ ? tc_.keep_checkpoints : 0,
                  files = tokenizer_files_](const TensorMap& t) {
      save_checkpoint(
          dir, t, state, rank, world, [&group](bool ok) { return vote(*group, ok); }, files);
      // Every rank has passed the save's last vote: the new checkpoint is complete.
      if (keep > 0) remove_old_checkpoints(out_dir, keep);
    };
    if (tc_.async_checkpoint) {
      writer_.start(dir, host_copy(tensors), std::move(write));
      return true;
    }
    try {
      write(tensors);
    } catch (const Error& e) {
      return on_save_error(e);
    }
    result.last_checkpoint = dir;
    last_save_error_.clear();
    return true;
  }

  /// Waits for the save in flight (train.async_checkpoint) and takes its outcome: true when
  /// it completed (or none was in flight), false after on_save_error.
  bool collect_save() {
    try {
      const std::string dir = writer_.collect();
      if (!dir.empty()) {
        result.last_checkpoint = dir;
        last_save_error_.clear();
      }
      return true;
    } catch (const Error& e) {
      return on_save_error(e);
    }
  }

  /// A failed save (the same error on every rank: the save votes). train.on_save_error =
  /// continue: a warning, and training goes on; stop: the run ends after this step.
  bool on_save_error(const Error& e) {
    last_save_error_ = e.what();
    if (tc_.on_save_error == "continue") {
      if (leader_)
        spdlog::warn(
            "{} Training continues (train.on_save_error = continue); the next save tries "
            "again.",
            e.what());
      return false;
    }
    result.save_error = e.what();
    return false;
  }

  /// The stop signal any rank received (the largest number) and whether every rank's save in
  /// flight has ended, the same on every rank: one all-reduce of two numbers per step, so that
  /// all ranks enter the collective save (or collect the async one) together.
  std::pair<int, bool> agreed_signal_and_save_done() {
    const int mine = stop_signal_received();
    const bool writing = writer_.pending() && !writer_.finished();
    comm::Group& world = *layout_.world;
    if (world.size() == 1) return {mine, !writing};
    Tensor t = Tensor::from_vector<double>({static_cast<double>(mine), writing ? 1.0 : 0.0}, {2},
                                           world.device());
    world.all_reduce(t, comm::ReduceOp::max);
    const Tensor h = t.to(Device::cpu());
    return {static_cast<int>(h.data<double>()[0]), h.data<double>()[1] == 0};
  }

  /// After a stop signal: a checkpoint of `step` (unless `saved` already, or the step was not
  /// finite) and the line that says so.
  void stop_on_signal(int signal, int step, bool saved) {
    if (!saved) saved = save(step);
    if (saved && writer_.pending()) saved = collect_save();
    result.stop_signal = signal;
    if (!leader_) return;
    if (saved)
      spdlog::warn("received {} at step {}: saved {}, stopping", signal_name(signal), step,
                   fs::path(result.last_checkpoint).filename().string());
    else
      spdlog::warn(
          "received {} at step {}: no checkpoint saved (the step was not finite; the last good "
          "checkpoint is {}), stopping",
          signal_name(signal), step,
          result.last_checkpoint.empty() ? "(none yet)" : result.last_checkpoint);
  }

  /// After the last step: a final save that failed under train.on_save_error = continue has
  /// no later save to try again, so the run ends as with stop.
  void final_save_must_have_succeeded() {
    if (result.save_error.empty() && !last_save_error_.empty())
      result.save_error = last_save_error_ + " It was the final save (no later one to try again).";
  }

  bool leader() const { return leader_; }
  /// Publishes the last delayed update (train.offload_delayed_update_from): the trained
  /// weights include every step's.
  void finish_update() { opt_->finish(); }

  TrainResult result;

 private:
  const Config& config_;
  const TrainConfig& tc_;
  const TrainOptions& options_;
  const parallel::Layout& layout_;
  const Device device_;
  const bool leader_;
  std::optional<RunLock> lock_;  // rank 0 holds the run folder while the run lives
  std::optional<data::DataLoader> train_loader_;
  std::vector<data::DataLoader> val_loaders_;  // one per folder of data_dirs()
  std::vector<std::string> val_names_;
  std::string tokenizer_kind_ = "byte";                 // rank 0 only
  std::map<std::string, std::string> tokenizer_files_;  // rank 0: name -> bytes (none for byte)
  std::unique_ptr<model::Transformer> model_;
  std::vector<Parameter*> params_;
  std::vector<moe::MoELayer*> moe_layers_;
  std::unique_ptr<optim::AdamW> opt_;
  std::optional<optim::LrSchedule> schedule_;
  std::unique_ptr<parallel::GradientSync> grad_sync_;
  int pipeline_backward_ = 1;  ///< the MoE layers' backward chunks (configure_pipeline)
  std::optional<io::AppendFile> metrics_;
  std::shared_ptr<comm::Group> save_group_;
  int64_t tokens_per_step_ = 0;
  int64_t base_live_bytes_ = 0;  // live on the device before the run built anything
  int bad_in_a_row_ = 0;
  std::string last_save_error_;  // the latest save's error; cleared by a save that completes
  CheckpointWriter writer_;      // train.async_checkpoint; declared last: joined first
};

}  // namespace

TrainResult train(const Config& config, const TrainOptions& options) {
  const TrainConfig& tc = config.train;
  XMOE_CHECK(!tc.offload_optimizer || parse_device(tc.device).is_cpu() ||
                 config.parallel.expert_placement == "none",
             "[train] train.offload_optimizer with train.device = {}: parallel.expert_placement = "
             "{} would permute host master weights over a device (NCCL) group; use "
             "parallel.expert_placement = none",
             tc.device, config.parallel.expert_placement);
  XMOE_CHECK(!(options.resume && options.overwrite),
             "[train] --resume continues the run in {} and --overwrite deletes it: give one",
             tc.out_dir);
  auto world_group = options.world ? options.world : comm::world();
  const std::shared_ptr<comm::Group> host_world = world_group;
  check_ranks_agree(*world_group, config);
  const Device device = training_device(tc, *world_group);
  if (config.parallel.ranks_per_node > 0)
    world_group = world_group->with_declared_nodes(config.parallel.ranks_per_node);
  world_group = device_world(std::move(world_group), device, tc);
  // Every collective of the layout's groups is watched; the checkpoint votes and the wait for
  // data preparation (save group, split before the watchdog) are not: they wait for one
  // rank's file work, which may take long.
  const std::shared_ptr<comm::Group> save_group = host_world->split(0, host_world->rank());
  const WatchdogOnGroup watchdog(*world_group, config.parallel.collective_timeout_s);
  // Every group of the run lives in `layout` (and in the model's copies of it) and goes when
  // train() returns: before comm::finalize(), in the same order on every rank.
  const parallel::Layout layout = parallel::Layout::create(
      world_group, config.parallel.ep, config.parallel.tp, config.parallel.ssmb);
  const AbandonOnError abandon_on_error(layout);
  const StopSignalHandlers stop_handlers;

  // The checkpoint votes go over a communicator of their own on the host: with
  // train.async_checkpoint they run on the writer thread beside the step's collectives.
  Run run(config, options, layout, device, save_group);
  run.open_folder_and_data();
  run.build();
  int step = options.resume ? run.resume() : 0;
  run.place();
  run.write_config_and_open_metrics();
  run.result.first_step = step;
  const int last = options.stop_after >= 0 ? std::min(options.stop_after, tc.steps) : tc.steps;

  // --stop-after 0 on a fresh run: the initial weights as checkpoint step-0 (a peer framework
  // can start from them: bench/peers/train_torch.py --init).
  if (last == 0 && step == 0) run.save(0);
  Progress progress(options.progress && run.leader(), step, last);
  Timer run_timer;
  while (step < last) {
    const StepMetrics m = run.step(++step);
    run.log(m);
    progress.on_step(m, step % tc.log_every == 0 || step == last);
    if (tc.eval_every > 0 && (step % tc.eval_every == 0 || step == last))
      progress.on_eval(step, run.evaluate_and_log(step));
    Timer save_timer;
    const bool saved =
        ((tc.save_every > 0 && step % tc.save_every == 0) || step == last) && run.save(step);
    const auto [signal, save_done] = run.agreed_signal_and_save_done();
    // An async save that ended everywhere is collected now, by every rank at this step: its
    // error surfaces here, as a synchronous save's would have at its step.
    if (save_done) run.collect_save();
    run.result.save_seconds += save_timer.seconds();
    if (!run.result.save_error.empty()) break;
    if (signal) {
      run.stop_on_signal(signal, step, saved);
      break;
    }
  }
  run.finish_update();
  // The final save (and any still in flight) completes before the run returns.
  Timer final_save_timer;
  run.collect_save();
  run.result.save_seconds += final_save_timer.seconds();
  if (step == last && run.result.stop_signal == 0) run.final_save_must_have_succeeded();
  if (!run.result.save_error.empty() && run.leader())
    spdlog::error("{} Stopping (train.on_save_error = stop); the newest complete checkpoint is {}",
                  run.result.save_error,
                  run.result.last_checkpoint.empty() ? "(none)" : run.result.last_checkpoint);
  run.result.last_step = step;
  run.result.seconds = run_timer.seconds();
  progress.finish(run.result.seconds);
  return std::move(run.result);
}

}  // namespace xmoe::train
