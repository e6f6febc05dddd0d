#include "xmoe/plan/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>

#include "xmoe/core/error.h"
#include "xmoe/train/flops.h"

namespace xmoe::plan {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) out.push_back(i);
  return out;
}

std::string gib(int64_t bytes) {
  return fmt::format("{:.1f}", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
}

/// The step's peak fits a GPU of `cl` and the offloaded state the hosts.
bool memory_fits(const train::MemoryModel& m, const Cluster& cl) {
  return static_cast<double>(m.peak_bytes) <=
             cl.usable_memory * static_cast<double>(cl.gpu_memory) &&
         static_cast<double>(m.host_bytes * cl.gpus_per_node) <=
             cl.usable_host_memory * static_cast<double>(cl.host_memory);
}

bool ranked_before(const Candidate& a, const Candidate& b) {
  if (a.fits != b.fits) return a.fits;
  if (a.fits) return a.tokens_per_s > b.tokens_per_s;
  return a.memory.peak_bytes < b.memory.peak_bytes;
}

}  // namespace

Candidate evaluate_layout(const Config& base, const PlanLayout& layout, const Rates& rates,
                          const PlanOptions& o, const train::MemoryModel* memory) {
  const Cluster& cl = rates.cluster();
  Candidate c;
  c.layout = layout;
  c.world = cl.world();
  c.config = layout.apply(base, cl.device);
  validate(c.config);
  c.memory = memory ? *memory
                    : train::predict_memory(c.config,
                                            {.world = c.world, .load_imbalance = o.load_imbalance});
  c.time = predict_step_time(
      c.config, c.memory, rates,
      {.world = c.world, .load_imbalance = o.load_imbalance, .moe_chunks = layout.moe_chunks});
  const int data_ranks = c.world / layout.tp;
  c.tokens_per_step = static_cast<double>(data_ranks) * layout.micro_batch * layout.grad_accum *
                      c.config.train.seq_len;
  c.tokens_per_s = c.tokens_per_step / c.time.total;
  if (cl.peak_flops > 0)
    c.mfu = train::training_flops_per_token(c.config.model, c.config.train.seq_len) *
            c.tokens_per_s / (cl.peak_flops * c.world);
  c.fits = memory_fits(c.memory, cl);
  return c;
}

std::string PlanLayout::str() const {
  std::string s = fmt::format("tp {}{} ep {}", tp, tp > 1 ? (ssmb ? " ssmb" : " rep") : "", ep);
  if (ep > 1) s += dispatch == "rbd" ? " rbd" : " a2a";
  s += fmt::format(" z{}{}{}{}", zero, offload ? (offload_overlap ? " off" : " off:rings") : "",
                   expert_grad_dtype == "bf16" ? " eg16" : "",
                   adam_moments_dtype == "bf16" ? " m16" : "");
  if (!recompute.empty()) {
    std::string r;
    for (const std::string& n : recompute) r += (r.empty() ? "" : ",") + n;
    s += " rc:" + r;
  }
  s += fmt::format(" mb {}", micro_batch);
  if (grad_accum > 1) s += fmt::format(" ga {}", grad_accum);
  if (moe_chunks > 1) s += fmt::format(" r {}", moe_chunks);
  return s;
}

Config PlanLayout::apply(Config c, const std::string& device) const {
  c.parallel.tp = tp;
  c.parallel.ep = ep;
  c.parallel.ssmb = ssmb;
  c.parallel.zero = zero;
  c.model.moe.dispatch = dispatch;
  c.model.moe.expert_grad_dtype = expert_grad_dtype;
  c.train.adam_moments_dtype = adam_moments_dtype;
  c.model.moe.pipeline = moe_chunks > 1 ? std::to_string(moe_chunks) : "off";
  c.model.moe.pipeline_backward = "same";
  c.model.recompute = recompute;
  c.train.offload_optimizer = offload;
  c.train.offload_overlap = offload_overlap;
  c.train.batch_size = micro_batch;
  c.train.grad_accum = grad_accum;
  c.train.device = device;
  return c;
}

Plan make_plan(const Config& base, const Rates& rates, const PlanOptions& o) {
  const Cluster& cl = rates.cluster();
  const int world = cl.world(), g = cl.gpus_per_node;
  const int experts = base.model.moe.num_experts;
  // Refused here, once, rather than by every layout below (where an error means "does not fit").
  if (base.model.moe.expert_dtype == "fp8") rates.require_fp8();
  Plan plan;
  plan.cluster = cl;
  std::map<std::tuple<int, int, bool, int, int, size_t, size_t, size_t, int, int>,
           train::MemoryModel>
      memories;
  // Index of "f32" among the moment choices (their count when absent).
  const size_t f32_moments =
      static_cast<size_t>(std::find(o.moments_choices.begin(), o.moments_choices.end(), "f32") -
                          o.moments_choices.begin());
  for (int tp : divisors(world)) {
    if (tp > 1 && (tp > g || g % tp != 0)) continue;  // a tp group stays inside a node
    for (bool ssmb : tp > 1 ? std::vector<bool>{true, false} : std::vector<bool>{true}) {
      const int moe_world = ssmb ? world : world / tp;
      for (int ep : divisors(moe_world)) {
        if (experts % ep != 0) continue;
        const GroupSpan span = group_span(ep, ssmb ? 1 : tp, g);
        std::vector<std::string> dispatches = {"auto"};
        if (ep > 1) dispatches = {"all_to_all"};
        if (ep > 1 && span.nodes > 1) dispatches.push_back("rbd");
        std::vector<int> chunk_choices;
        for (int r : o.moe_chunk_choices)
          if (r == 1 || (ep > 1 && r <= experts / ep)) chunk_choices.push_back(r);
        for (int zero : o.zero_choices)
          // 0: no offload; 1: offload, gradients starting in backward; 2: offload, gradients
          // through group-sized buffers (differs only for one process below zero 2).
          for (int offload : {0, 1, 2}) {
            if (offload > 0 && (!o.offload || cl.device != "cuda")) continue;
            if (offload == 2 && (world > 1 || zero == 2)) continue;
            for (size_t rc = 0; rc < o.recompute_choices.size(); ++rc)
              for (size_t eg = 0; eg < o.expert_grad_choices.size(); ++eg)
                for (size_t mo = 0; mo < o.moments_choices.size(); ++mo)
                  for (int per_rank : o.micro_batches) {
                    const int mb = per_rank * tp, data_ranks = world / tp;
                    int accum = 1;
                    if (o.global_batch > 0) {
                      if (o.global_batch % (data_ranks * mb) != 0) continue;
                      accum = o.global_batch / (data_ranks * mb);
                    }
                    for (const std::string& dispatch : dispatches)
                      for (int chunks : chunk_choices) {
                        PlanLayout l{.tp = tp,
                                     .ep = ep,
                                     .ssmb = ssmb,
                                     .dispatch = dispatch,
                                     .zero = zero,
                                     .offload = offload > 0,
                                     .offload_overlap = offload != 2,
                                     .expert_grad_dtype = o.expert_grad_choices[eg],
                                     .adam_moments_dtype = o.moments_choices[mo],
                                     .recompute = o.recompute_choices[rc],
                                     .micro_batch = mb,
                                     .grad_accum = accum,
                                     .moe_chunks = chunks};
                        // Memory depends on neither the dispatch nor the accumulation: model it
                        // once.
                        const auto key =
                            std::make_tuple(tp, ep, ssmb, zero, offload, rc, eg, mo, mb, chunks);
                        // bf16 moments are a lever to fit, not to gain speed: tried only where
                        // the same layout with f32 moments (enumerated before) does not fit.
                        if (l.adam_moments_dtype == "bf16" && f32_moments < mo) {
                          auto f32_key = key;
                          std::get<7>(f32_key) = f32_moments;
                          const auto f32_it = memories.find(f32_key);
                          if (f32_it != memories.end() && memory_fits(f32_it->second, cl)) continue;
                        }
                        const auto it = memories.find(key);
                        std::optional<Candidate> c;
                        try {
                          c = evaluate_layout(base, l, rates, o,
                                              it == memories.end() ? nullptr : &it->second);
                        } catch (const Error&) {
                          continue;  // the config refuses the layout (validate, the memory model)
                        }
                        if (it == memories.end()) memories.emplace(key, c->memory);
                        ++plan.layouts;
                        plan.fitting += c->fits;
                        plan.candidates.push_back(std::move(*c));
                      }
                  }
          }
      }
    }
  }
  std::stable_sort(plan.candidates.begin(), plan.candidates.end(), ranked_before);
  return plan;
}

std::string plan_table(const Plan& plan, int top) {
  const Cluster& cl = plan.cluster;
  std::string s = fmt::format("# {}\n", describe(cl));
  s += fmt::format("# {} layouts, {} fit in {:.0f}% of {} GiB per GPU\n", plan.layouts,
                   plan.fitting, 100 * cl.usable_memory, gib(cl.gpu_memory));
  s += fmt::format("{:<4} {:<66} {:>9} {:>9} {:>10} {:>12} {:>6}\n", "rank", "layout", "mem GiB",
                   "host GiB", "step s", "tokens/s", "MFU");
  int shown = 0;
  for (const Candidate& c : plan.candidates) {
    if (!c.fits || shown >= top) break;
    ++shown;
    s += fmt::format("{:<4} {:<66} {:>9} {:>9} {:>10.4g} {:>12.4g} {:>6}\n", shown, c.layout.str(),
                     gib(c.memory.peak_bytes),
                     c.memory.host_bytes > 0 ? gib(c.memory.host_bytes) : "-", c.time.total,
                     c.tokens_per_s, c.mfu > 0 ? fmt::format("{:.1f}%", 100 * c.mfu) : "-");
  }
  if (shown == 0) {
    s += "# no layout fits; the smallest peaks:\n";
    for (size_t i = 0; i < plan.candidates.size() && i < static_cast<size_t>(top); ++i)
      s += fmt::format("     {:<66} {:>9}\n", plan.candidates[i].layout.str(),
                       gib(plan.candidates[i].memory.peak_bytes));
  }
  return s;
}

std::string chosen_yaml(const Candidate& c, const Cluster& cluster) {
  std::string s = fmt::format(
      "# chosen by `xmoe plan` for {} ({} ranks): {}\n"
      "# predicted: {} GiB peak per GPU, {:.4g} s per step, {:.4g} tokens/s\n"
      "# run it on {} ranks, e.g. mpirun -np {} xmoe train --config <this file>\n",
      cluster.name, c.world, c.layout.str(), gib(c.memory.peak_bytes), c.time.total, c.tokens_per_s,
      c.world, c.world);
  return s + to_yaml(c.config);
}

Config scaled_model(const Config& base, int layers, int experts) {
  Config c = base;
  c.model.num_layers = layers;
  c.model.moe.num_experts = experts;
  return c;
}

LargestModel largest_model(const Config& base, const Rates& rates,
                           const std::vector<int>& layer_choices,
                           const std::vector<int>& expert_choices, const PlanOptions& o) {
  std::vector<LargestModel> models;
  for (int layers : layer_choices)
    for (int experts : expert_choices) {
      LargestModel m{
          layers, experts, count_parameters(scaled_model(base, layers, experts).model).total, {}};
      models.push_back(m);
    }
  std::sort(models.begin(), models.end(), [](const LargestModel& a, const LargestModel& b) {
    return a.parameters > b.parameters;
  });
  // A smaller micro-batch never takes more memory: the first model (largest first) that fits
  // at the smallest one gets the full plan. (Neither zero 2 nor more recompute is always
  // smaller: zero 2 holds the whole gradients inside the step, recompute adds working sets.)
  PlanOptions least = o;
  least.micro_batches = {*std::min_element(o.micro_batches.begin(), o.micro_batches.end())};
  for (LargestModel& m : models) {
    const Config c = scaled_model(base, m.layers, m.experts);
    if (make_plan(c, rates, least).fitting == 0) continue;
    const Plan full = make_plan(c, rates, o);
    XMOE_CHECK(full.fitting > 0, "[plan] internal: no fitting layout in the full plan");
    m.best = full.candidates.front();
    return m;
  }
  XMOE_FAIL("[plan] no model of {} layers x {} experts choices fits {}", layer_choices.size(),
            expert_choices.size(), describe(rates.cluster()));
}

}  // namespace xmoe::plan
