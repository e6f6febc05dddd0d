#include "xmoe/train/trainer.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "xmoe/core/timer.h"
#include "xmoe/data/data_loader.h"
#include "xmoe/data/prepare.h"
#include "xmoe/model/transformer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/ops/ops.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/optim/clip.h"
#include "xmoe/optim/schedule.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/progress.h"

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

/// The sigmoid gate's balancing bias is state, not a parameter: it is saved under this name.
std::string bias_name(const moe::MoELayer& layer) { return layer.prefix() + ".router.bias"; }

/// Everything a checkpoint holds besides the config: model and optimizer tensors + counters.
std::map<std::string, Tensor> snapshot_tensors(const std::vector<Parameter*>& params,
                                               const optim::AdamW& opt,
                                               const std::vector<moe::MoELayer*>& moe_layers) {
  std::map<std::string, Tensor> out;
  for (const Parameter* p : params) out.emplace(p->name, p->value);
  opt.export_state(out);
  for (moe::MoELayer* layer : moe_layers)
    if (const Tensor* bias = layer->gate().routing_bias()) out.emplace(bias_name(*layer), *bias);
  return out;
}

void restore_tensors(const std::map<std::string, Tensor>& tensors,
                     const std::vector<Parameter*>& params, optim::AdamW& opt,
                     const std::vector<moe::MoELayer*>& moe_layers, const std::string& dir) {
  for (Parameter* p : params) {
    auto it = tensors.find(p->name);
    XMOE_CHECK(it != tensors.end(), "[checkpoint] {} has no tensor '{}'", dir, p->name);
    XMOE_CHECK(it->second.shape() == p->value.shape(),
               "[checkpoint] {}: '{}' has shape {} but the model expects {}", dir, p->name,
               shape_str(it->second.shape()), shape_str(p->value.shape()));
    p->value.copy_from(it->second);
  }
  opt.import_state(tensors);
  for (moe::MoELayer* layer : moe_layers) {
    if (Tensor* bias = layer->gate().routing_bias()) {
      auto it = tensors.find(bias_name(*layer));
      XMOE_CHECK(it != tensors.end(), "[checkpoint] {} has no tensor '{}'", dir, bias_name(*layer));
      bias->copy_from(it->second);
    }
  }
}

/// True when two configs describe the same model (training and data settings may differ).
bool same_model(const Config& a, Config b) {
  b.train = a.train;
  b.data = a.data;
  b.parallel = a.parallel;
  return a == b;
}

double evaluate(model::Transformer& model, const data::DataLoader& loader, int batches) {
  const int64_t n = std::min<int64_t>(batches, loader.num_eval_batches());
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const data::Batch b = loader.eval_batch(i);
    total += model.evaluate_loss(b.inputs, b.targets);
  }
  return total / static_cast<double>(n);
}

}  // namespace

TrainResult train(const Config& config, const TrainOptions& options) {
  const TrainConfig& tc = config.train;
  XMOE_CHECK(tc.device == "cpu",
             "[train] train.device = {} is not available yet: this build trains on the CPU",
             tc.device);
  ensure_prepared_data(config.data);

  data::TokenFile::Options topt;
  topt.vocab_size = config.model.vocab_size;
  topt.min_tokens = tc.seq_len + 1;
  data::DataLoader train_loader(data::TokenFile::open((fs::path(config.data.dir) / "train.bin").string(), topt),
                                tc.batch_size, tc.seq_len, tc.seed);
  data::DataLoader val_loader(data::TokenFile::open((fs::path(config.data.dir) / "val.bin").string(), topt),
                              tc.batch_size, tc.seq_len, tc.seed);

  model::Transformer model(config.model, tc.seed);
  const std::vector<Parameter*> params = model.parameters();
  const std::vector<moe::MoELayer*> moe_layers = model.moe_layers();
  optim::AdamW opt(params, optim::AdamWConfig::from(tc));
  const optim::LrSchedule schedule = optim::LrSchedule::from(tc);

  TrainResult result;
  result.out_dir = tc.out_dir;
  fs::create_directories(tc.out_dir);
  {
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
    restore_tensors(ckpt.tensors, params, opt, moe_layers, *latest);
    step = ckpt.state.at("step").get<int>();
    train_loader.set_position(ckpt.state.at("data_position").get<uint64_t>());
    spdlog::info("resumed from {} at step {}", *latest, step);
  }
  result.first_step = step;
  const int last = options.stop_after >= 0 ? std::min(options.stop_after, tc.steps) : tc.steps;

  std::ofstream metrics(fs::path(tc.out_dir) / "metrics.jsonl", std::ios::app);
  auto save = [&](int at_step) {
    nlohmann::json state;
    state["config"] = to_yaml(config);
    state["step"] = at_step;
    state["data_position"] = train_loader.position();
    state["seed"] = tc.seed;
    state["layout"] = {{"world", 1}, {"ep", 1}, {"dp", 1}};
    const std::string dir = (fs::path(tc.out_dir) / fmt::format("step-{}", at_step)).string();
    save_checkpoint(dir, snapshot_tensors(params, opt, moe_layers), state);
    result.last_checkpoint = dir;
  };

  Progress progress(options.progress, step, last);
  const int64_t tokens_per_step =
      static_cast<int64_t>(tc.batch_size) * tc.seq_len * tc.grad_accum;
  int bad_in_a_row = 0;
  Timer run_timer;
  while (step < last) {
    Timer step_timer;
    model.zero_grad();
    double loss = 0, aux = 0;
    std::vector<int64_t> load;
    for (int micro = 0; micro < tc.grad_accum; ++micro) {
      const data::Batch b = train_loader.next();
      loss += model.forward_loss(b.inputs, b.targets) / tc.grad_accum;
      aux += model.aux_loss() / tc.grad_accum;
      model.backward(1.0f / static_cast<float>(tc.grad_accum));
      for (const moe::MoELayer* layer : moe_layers) {
        const auto& tpe = layer->tokens_per_expert();
        if (load.empty()) load.assign(tpe.size(), 0);
        for (size_t e = 0; e < tpe.size() && e < load.size(); ++e) load[e] += tpe[e];
      }
    }
    ++step;
    StepMetrics m;
    m.step = step;
    m.loss = loss;
    m.aux_loss = aux;
    m.lr = schedule.at(step - 1);
    m.grad_norm = optim::clip_grad_norm(params, tc.grad_clip);
    if (!std::isfinite(loss) || !std::isfinite(m.grad_norm)) {
      m.skipped = true;
      ++bad_in_a_row;
      spdlog::warn("step {}: non-finite {} ({}); update skipped ({} in a row, limit {})", step,
                   std::isfinite(loss) ? "gradient norm" : "loss",
                   std::isfinite(loss) ? m.grad_norm : loss, bad_in_a_row, tc.max_bad_steps);
      XMOE_CHECK(bad_in_a_row < tc.max_bad_steps,
                 "[train] {} consecutive steps with a non-finite loss or gradient (last at step "
                 "{}); stopping. The last good checkpoint is {}",
                 bad_in_a_row, step,
                 result.last_checkpoint.empty() ? std::string("(none yet)") : result.last_checkpoint);
    } else {
      bad_in_a_row = 0;
      opt.step(static_cast<float>(m.lr));
      for (moe::MoELayer* layer : moe_layers) layer->update_routing_bias();
    }
    if (!load.empty()) {
      m.max_expert_load = *std::max_element(load.begin(), load.end());
      m.min_expert_load = *std::min_element(load.begin(), load.end());
    }
    m.seconds = step_timer.seconds();
    m.tokens_per_s = static_cast<double>(tokens_per_step) / m.seconds;
    result.steps.push_back(m);
    metrics << nlohmann::json{{"step", m.step},       {"loss", m.loss},
                              {"aux_loss", m.aux_loss}, {"lr", m.lr},
                              {"grad_norm", m.grad_norm}, {"tokens_per_s", m.tokens_per_s},
                              {"max_expert_load", m.max_expert_load},
                              {"min_expert_load", m.min_expert_load},
                              {"skipped", m.skipped}}
                   .dump()
            << "\n";
    progress.on_step(m, step % tc.log_every == 0 || step == last);

    if (tc.eval_every > 0 && (step % tc.eval_every == 0 || step == last)) {
      const double val = evaluate(model, val_loader, tc.eval_batches);
      result.evals.push_back({step, val});
      metrics << nlohmann::json{{"step", step}, {"val_loss", val}}.dump() << "\n";
      progress.on_eval(step, val);
    }
    metrics.flush();
    if ((tc.save_every > 0 && step % tc.save_every == 0) || step == last) save(step);
  }
  result.last_step = step;
  result.seconds = run_timer.seconds();
  progress.finish(result.seconds);
  return result;
}

}  // namespace xmoe::train
