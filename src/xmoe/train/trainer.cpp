#include "xmoe/train/trainer.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "xmoe/backend/device_api.h"
#include "xmoe/comm/nccl/nccl_group.h"
#include "xmoe/core/timer.h"
#include "xmoe/data/data_loader.h"
#include "xmoe/data/prepare.h"
#include "xmoe/model/transformer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/moe/placement.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/optim/clip.h"
#include "xmoe/optim/schedule.h"
#include "xmoe/parallel/grad_sync.h"
#include "xmoe/parallel/layout.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/flops.h"
#include "xmoe/train/progress.h"
#include "xmoe/train/state.h"

namespace fs = std::filesystem;

namespace xmoe::train {

void ensure_prepared_data(const DataConfig& data) {
  const fs::path dir(data.dir);
  if (fs::exists(dir / "train.bin") && fs::exists(dir / "val.bin") && fs::exists(dir / "meta.json"))
    return;
  spdlog::info("preparing corpus {} into {}", data.corpus, data.dir);
  const auto r = data::prepare(data.corpus, data.dir, data.val_fraction);
  spdlog::info("prepared {} train / {} validation tokens from {} files", r.train_tokens,
               r.val_tokens, r.files.size());
}

namespace {

/// True when two configs describe the same model (training, data and layout may differ).
bool same_model(const Config& a, Config b) {
  b.train = a.train;
  b.data = a.data;
  b.parallel = a.parallel;
  return a == b;
}

/// Mean of a per-rank value over the world (every rank gets the same double).
double world_mean(comm::Group& world, double v) {
  if (world.size() == 1) return v;
  Tensor t = Tensor::from_vector<double>({v}, {1}, world.device());  // NCCL groups: on the GPU
  world.all_reduce(t);
  return t.item() / world.size();
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
      spdlog::warn("expert placement skipped: group-limited routing (moe.num_groups = {}) ties "
                   "experts to their groups", moe_cfg.num_groups);
    return;
  }
  const auto layers = model.moe_layers();
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
    moe::apply_placement(*l, perm, &opt);
    l->set_record_coactivation(false);
    l->reset_coactivation();
  }
  model.refresh_compute_weights();  // the experts' master weights moved
}

/// XMOE_INJECT_FAULT=<rank>:<step> makes that rank throw at that step: the test of how a job
/// stops when one process fails (docs/training.md).
void maybe_inject_fault(int rank, int step) {
  static const char* spec = std::getenv("XMOE_INJECT_FAULT");
  if (!spec) return;
  int fault_rank = -1, fault_step = -1;
  if (std::sscanf(spec, "%d:%d", &fault_rank, &fault_step) == 2 && fault_rank == rank &&
      fault_step == step)
    XMOE_FAIL("[train] injected fault on rank {} at step {} (XMOE_INJECT_FAULT={})", rank, step,
              spec);
}

/// train.device: "cpu", "cuda:N", or "cuda" = cuda:0 for one process and, with several, the
/// rank's position among the ranks of its host (one rank per GPU), taken from `hosts` (the
/// group as detected, before any declared simulated nodes).
Device training_device(const TrainConfig& tc, comm::Group& hosts) {
  const Device d = parse_device(tc.device);
  if (d.is_cpu()) return d;
  XMOE_CHECK(backend::cuda_available(),
             "[train] train.device = {}: no CUDA device is available (this xmoe was built without "
             "CUDA, or no GPU is visible)",
             tc.device);
  const int count = backend::cuda_device_count();
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
    const int devices = backend::cuda_device_count();
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
    for (const auto& g : {layout_.dp_group, layout_.ep_group, layout_.world})
      if (g) comm::nccl::abandon(*g);
  }
  AbandonOnError(const AbandonOnError&) = delete;
  AbandonOnError& operator=(const AbandonOnError&) = delete;

 private:
  const parallel::Layout& layout_;
  int exceptions_;
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

}  // namespace

TrainResult train(const Config& config, const TrainOptions& options) {
  const TrainConfig& tc = config.train;
  XMOE_CHECK(config.parallel.tp == 1,
             "[train] parallel.tp = {}: tensor parallelism (sequence-sharded MoE blocks) is not "
             "implemented yet; use parallel.tp = 1",
             config.parallel.tp);
  auto world_group = options.world ? options.world : comm::world();
  const Device device = training_device(tc, *world_group);
  if (config.parallel.ranks_per_node > 0)
    world_group = world_group->with_declared_nodes(config.parallel.ranks_per_node);
  world_group = device_world(std::move(world_group), device, tc);
  // Every group of the run lives in `layout` (and in the model's copies of it) and goes when
  // train() returns: before comm::finalize(), in the same order on every rank.
  const parallel::Layout layout = parallel::Layout::create(world_group, config.parallel.ep);
  const AbandonOnError abandon_on_error(layout);
  comm::Group& world = *layout.world;
  const bool leader = layout.world_rank == 0;

  if (leader) ensure_prepared_data(config.data);
  world.barrier();

  data::TokenFile::Options topt;
  topt.vocab_size = config.model.vocab_size;
  topt.min_tokens = tc.seq_len + 1;
  const fs::path data_dir(config.data.dir);
  data::DataLoader train_loader(data::TokenFile::open((data_dir / "train.bin").string(), topt),
                                tc.batch_size, tc.seq_len, tc.seed, layout.world_rank,
                                layout.world_size);
  data::DataLoader val_loader(data::TokenFile::open((data_dir / "val.bin").string(), topt),
                              tc.batch_size, tc.seq_len, tc.seed, layout.world_rank,
                              layout.world_size);

  // Built and initialised on the host (the same weights on any device), then moved.
  model::Transformer model(config.model, tc.seed, &layout);
  model.to(device);
  model.set_compute_dtype(compute_dtype(tc, device));
  const std::vector<Parameter*> params = model.parameters();
  const std::vector<moe::MoELayer*> moe_layers = model.moe_layers();
  optim::AdamW opt(params, optim::AdamWConfig::from(tc));
  const optim::LrSchedule schedule = optim::LrSchedule::from(tc);
  parallel::GradientSync grad_sync(params, layout);

  TrainResult result;
  result.out_dir = tc.out_dir;
  if (leader) {
    fs::create_directories(tc.out_dir);
    std::ofstream(fs::path(tc.out_dir) / "config.yaml") << to_yaml(config);
  }

  int step = 0;
  if (options.resume) {
    const auto latest = latest_checkpoint(tc.out_dir);
    XMOE_CHECK(latest.has_value(), "[train] --resume: no checkpoint in {}", tc.out_dir);
    const Checkpoint ckpt = load_checkpoint(*latest);
    const Config saved = load_config_string(ckpt.state.at("config").get<std::string>(),
                                            *latest + "/manifest.json");
    XMOE_CHECK(same_model(saved, config),
               "[train] --resume: the model in {} differs from the configured model", *latest);
    restore_checkpoint_tensors(ckpt.tensors, params, opt, moe_layers, *latest);
    model.refresh_compute_weights();
    step = ckpt.state.at("step").get<int>();
    train_loader.set_position(ckpt.state.at("data_position").get<uint64_t>());
    if (leader) spdlog::info("resumed from {} at step {}", *latest, step);
  }
  if (config.parallel.expert_placement == "affinity")
    place_experts(model, opt, train_loader, layout, config.parallel.placement_batches, leader);
  result.first_step = step;
  const int last = options.stop_after >= 0 ? std::min(options.stop_after, tc.steps) : tc.steps;

  std::ofstream metrics;
  if (leader) metrics.open(fs::path(tc.out_dir) / "metrics.jsonl", std::ios::app);
  auto save = [&](int at_step) {
    nlohmann::json state;
    state["config"] = to_yaml(config);
    state["step"] = at_step;
    state["data_position"] = train_loader.position();
    state["seed"] = tc.seed;
    state["layout"] = {{"world", layout.world_size}, {"ep", layout.ep}, {"dp", layout.dp}};
    const std::string dir = (fs::path(tc.out_dir) / fmt::format("step-{}", at_step)).string();
    save_checkpoint(dir, checkpoint_tensors(params, opt, moe_layers, layout), state,
                    layout.world_rank, layout.world_size, [&] { world.barrier(); });
    result.last_checkpoint = dir;
  };

  Progress progress(options.progress && leader, step, last);
  const int64_t tokens_per_step = static_cast<int64_t>(tc.batch_size) * tc.seq_len *
                                  tc.grad_accum * layout.world_size;
  int bad_in_a_row = 0;
  Timer run_timer;
  while (step < last) {
    Timer step_timer;
    maybe_inject_fault(layout.world_rank, step + 1);
    model.zero_grad();
    double loss = 0, aux = 0;
    std::vector<int64_t> load;
    for (int micro = 0; micro < tc.grad_accum; ++micro) {
      const data::Batch b = on_device(train_loader.next(), device);
      loss += model.forward_loss(b.inputs, b.targets) / tc.grad_accum;
      aux += model.aux_loss() / tc.grad_accum;
      model.backward(1.0f / static_cast<float>(tc.grad_accum));
      for (const moe::MoELayer* layer : moe_layers) {
        const auto& tpe = layer->expert_load();
        if (load.empty()) load.assign(tpe.size(), 0);
        for (size_t e = 0; e < tpe.size() && e < load.size(); ++e) load[e] += tpe[e];
      }
    }
    grad_sync.sync();
    ++step;
    StepMetrics m;
    m.step = step;
    m.loss = world_mean(world, loss);
    m.aux_loss = aux;
    m.lr = schedule.at(step - 1);
    m.grad_norm = std::sqrt(grad_sync.global_grad_sum_squares());
    if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm)) {
      // Every rank sees the same global loss and norm, so all skip (or stop) together.
      m.skipped = true;
      ++bad_in_a_row;
      if (leader)
        spdlog::warn("step {}: non-finite {} ({}); update skipped ({} in a row, limit {})", step,
                     std::isfinite(m.loss) ? "gradient norm" : "loss",
                     std::isfinite(m.loss) ? m.grad_norm : m.loss, bad_in_a_row, tc.max_bad_steps);
      XMOE_CHECK(bad_in_a_row < tc.max_bad_steps,
                 "[train] {} consecutive steps with a non-finite loss or gradient (last at step "
                 "{}); stopping. The last good checkpoint is {}",
                 bad_in_a_row, step,
                 result.last_checkpoint.empty() ? std::string("(none yet)") : result.last_checkpoint);
    } else {
      bad_in_a_row = 0;
      // The clip factor rides on the update (no pass of its own over the gradients).
      opt.step(static_cast<float>(m.lr), optim::clip_factor(m.grad_norm, tc.grad_clip));
      for (moe::MoELayer* layer : moe_layers) layer->update_routing_bias();
    }
    if (!load.empty()) {
      m.max_expert_load = *std::max_element(load.begin(), load.end());
      m.min_expert_load = *std::min_element(load.begin(), load.end());
    }
    m.seconds = step_timer.seconds();
    m.tokens_per_s = static_cast<double>(tokens_per_step) / m.seconds;
    if (device.is_cuda())
      m.mfu = mfu(config.model, tc.seq_len, m.tokens_per_s, layout.world_size);
    result.steps.push_back(m);
    if (leader) {
      nlohmann::json line{{"step", m.step},           {"loss", m.loss},
                          {"aux_loss", m.aux_loss},   {"lr", m.lr},
                          {"grad_norm", m.grad_norm}, {"tokens_per_s", m.tokens_per_s},
                          {"max_expert_load", m.max_expert_load},
                          {"min_expert_load", m.min_expert_load},
                          {"skipped", m.skipped}};
      if (device.is_cuda()) line["mfu"] = m.mfu;
      metrics << line.dump() << "\n";
    }
    progress.on_step(m, step % tc.log_every == 0 || step == last);

    if (tc.eval_every > 0 && (step % tc.eval_every == 0 || step == last)) {
      const double val = evaluate(model, val_loader, tc.eval_batches, world);
      result.evals.push_back({step, val});
      if (leader) metrics << nlohmann::json{{"step", step}, {"val_loss", val}}.dump() << "\n";
      progress.on_eval(step, val);
    }
    if (leader) metrics.flush();
    if ((tc.save_every > 0 && step % tc.save_every == 0) || step == last) save(step);
  }
  result.last_step = step;
  result.seconds = run_timer.seconds();
  progress.finish(result.seconds);
  return result;
}

}  // namespace xmoe::train
