#include "xmoe/moe/layer.h"

#include <algorithm>
#include <cmath>

#include "xmoe/core/profile.h"
#include "xmoe/moe/moe_ops.h"
#include "xmoe/ops/dispatch.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

MoELayer::MoELayer(const MoeConfig& config, int64_t d_model, std::string prefix, uint64_t seed,
                   float init_std, std::optional<float> down_std,
                   const parallel::Layout* layout)
    : cfg_(config),
      par_(layout ? *layout : parallel::Layout::single()),
      d_model_(d_model),
      prefix_(std::move(prefix)) {
  const MoeConfig& c = cfg_;
  XMOE_CHECK(c.num_experts >= 1, "[moe] moe.num_experts = {} must be >= 1", c.num_experts);
  XMOE_CHECK(c.top_k >= 1, "[moe] moe.top_k = {} must be >= 1", c.top_k);
  XMOE_CHECK(c.top_k <= c.num_experts, "[moe] moe.top_k = {} exceeds moe.num_experts = {}",
             c.top_k, c.num_experts);
  XMOE_CHECK(c.num_shared_experts >= 0, "[moe] moe.num_shared_experts = {} must be >= 0",
             c.num_shared_experts);
  XMOE_CHECK(d_model >= 1, "[moe] d_model = {} must be >= 1", d_model);
  XMOE_CHECK(par_.ep >= 1 && c.num_experts % par_.ep == 0,
             "[moe] moe.num_experts = {} is not divisible by parallel.ep = {}", c.num_experts,
             par_.ep);
  XMOE_CHECK(par_.ep == 1 || c.dispatch != "local",
             "[moe] moe.dispatch = 'local' holds every expert on one rank, but parallel.ep = {}; "
             "use 'all_to_all'",
             par_.ep);
  XMOE_CHECK(c.dispatch != "rbd" || c.impl == "pft",
             "[moe] moe.dispatch = 'rbd' needs moe.impl = 'pft', got '{}'", c.impl);
  const float dstd = down_std.value_or(init_std);

  order_ = make_order(c);  // first: an unknown moe.impl fails before any allocation
  // One process (world of size 1) makes no collective: the statistics are already global.
  auto stats = par_.world && par_.world->size() > 1 ? par_.world : nullptr;
  gate_ = make_gate({c, d_model, prefix_, seed, init_std, stats});
  make_dispatcher_(0);
  ExpertArgs ea;
  ea.prefix = prefix_;
  ea.num_experts = c.num_experts;
  ea.num_local = par_.local_experts(c.num_experts);
  ea.first_expert = par_.first_expert(c.num_experts);
  ea.d_model = d_model;
  ea.hidden = c.expert_hidden;
  ea.seed = seed;
  ea.init_std = init_std;
  ea.down_std = dstd;
  XMOE_CHECK(c.expert_grad_dtype == "f32" || c.expert_grad_dtype == "bf16",
             "[moe] moe.expert_grad_dtype = \"{}\" is not f32 or bf16", c.expert_grad_dtype);
  ea.grad_dtype = c.expert_grad_dtype == "bf16" ? DType::bf16 : DType::f32;
  ea.chunks = c.expert_chunks;
  experts_ = make_experts("swiglu", ea);
  if (c.num_shared_experts > 0)
    shared_ = std::make_unique<SharedExperts>(
        prefix_, d_model, static_cast<int64_t>(c.num_shared_experts) * c.expert_hidden, seed,
        init_std, dstd);
  pending_load_.assign(static_cast<size_t>(c.num_experts), 0);
  coactivation_ = CoactivationMatrix(c.num_experts);
}

MoELayer::~MoELayer() = default;

void MoELayer::make_dispatcher_(int ranks_per_node) {
  DispatchConfig dc;
  dc.algorithm = cfg_.dispatch;
  dc.num_experts = cfg_.num_experts;
  dc.ep_rank = par_.ep_rank;
  dc.ep_size = par_.ep;
  dc.group = par_.ep_group;
  dc.ranks_per_node = ranks_per_node;
  dispatcher_ = make_dispatcher(dc);
}

void MoELayer::set_ranks_per_node(int ranks_per_node) {
  release();
  make_dispatcher_(ranks_per_node);
}

namespace {
/// Profiler region of a stage: "moe.<stage>.fwd|bwd" (string literals: ProfileScope keeps them).
const char* stage_region(Stage stage, Phase phase) {
  static constexpr const char* names[2][kNumStages] = {
      {"moe.gate.fwd", "moe.order.fwd", "moe.dispatch.fwd", "moe.expert.fwd", "moe.combine.fwd",
       "moe.iorder.fwd", "moe.shared.fwd"},
      {"moe.gate.bwd", "moe.order.bwd", "moe.dispatch.bwd", "moe.expert.bwd", "moe.combine.bwd",
       "moe.iorder.bwd", "moe.shared.bwd"}};
  return names[phase == Phase::forward ? 0 : 1][static_cast<int>(stage)];
}
}  // namespace

template <class Body> void MoELayer::run_stage(StageContext& ctx, Stage stage, Body&& body) {
  ctx.enter(stage, When::before);
  hooks_.run(ctx);
  {
    ProfileScope scope(stage_region(stage, ctx.phase()), device_);  // the stage, not its hooks
    body();
  }
  ctx.enter(stage, When::after);
  hooks_.run(ctx);
}

Tensor MoELayer::forward(const Tensor& x_in, int64_t seq_len) {
  // Activations: f32, or bf16 on CUDA (parameters stay f32; see docs/moe.md, "On CUDA").
  xmoe::ops::check_float("moe", "x", x_in);
  check_shape(x_in, {-1, d_model_}, "moe", "x");
  const int64_t T = x_in.size(0);
  XMOE_CHECK(seq_len >= 1 && T % seq_len == 0,
             "[moe] {} tokens are not a multiple of seq_len = {}", T, seq_len);
  Tensor fixed_idx;
  if (frozen_routing_ && last_topk_idx_.defined()) {
    XMOE_CHECK(last_topk_idx_.size(0) == T,
               "[moe] frozen routing holds {} tokens but x has {}", last_topk_idx_.size(0), T);
    fixed_idx = last_topk_idx_;
  }

  device_ = x_in.device();
  ProfileScope scope("moe.fwd", device_);
  StageContext ctx(prefix_, Phase::forward);
  ctx.set("x", x_in);
  run_stage(ctx, Stage::gate, [&] {
    // The router runs in f32 whatever the activations' dtype (routing is precision-sensitive),
    // unless moe.router_dtype = bf16; it casts x for its GEMMs and keeps x as it is.
    GateOutput g = gate_->forward(ctx.get("x"), seq_len, fixed_idx);
    aux_ = g.aux;
    ctx.set("topk_idx", g.topk_idx);
    ctx.set("topk_weight", g.topk_weight);
    // Read only for hooks: on CUDA the value stays on the device until someone asks.
    if (!hooks_.empty()) ctx.set_scalar("aux_loss", aux_.weighted());
  });
  gate_output_replaced_ = ctx.was_replaced("topk_idx") || ctx.was_replaced("topk_weight");

  run_stage(ctx, Stage::order, [&] {
    ctx.set("rows", order_->forward(ctx.get("x"), ctx.get("topk_idx"), ctx.get("topk_weight")));
    const TokenLayout& l = order_->layout();
    ctx.set("token_ids", l.token_ids);
    ctx.set("expert_ids", l.expert_ids);
    ctx.set("combine_weights", l.combine_weights);
    ctx.set("slot_to_row", l.slot_to_row);
    if (!hooks_.empty())
      ctx.set("tokens_per_expert",
              Tensor::from_vector(l.tokens_per_expert, {static_cast<int64_t>(l.num_experts)}));
  });
  const TokenLayout& layout = order_->layout();
  last_topk_idx_ = ctx.get("topk_idx");
  if (record_coactivation_) record_coactivation_pairs(last_topk_idx_);
  // rbd applies the combine weights and sums per (token, node) inside combine (dispatch.h).
  const bool reduces = dispatcher_->reduces_in_combine();
  tokens_per_expert_ = layout.tokens_per_expert;
  load_ = layout.load;
  dropped_ = layout.dropped;
  for (size_t e = 0; e < load_.size(); ++e) pending_load_[e] += load_[e];

  run_stage(ctx, Stage::dispatch, [&] {
    DispatchResult r =
        reduces ? dispatcher_->dispatch(ctx.get("rows"), layout.group_sizes,
                                        RowInfo{layout.token_ids, ctx.get("combine_weights"), T})
                : dispatcher_->dispatch(ctx.get("rows"), layout.group_sizes);
    handle_ = std::move(r.handle);
    ctx.set("expert_in", r.rows);
  });
  run_stage(ctx, Stage::expert, [&] {
    // The experts' input is the order stage's gather of x when dispatch moved nothing (same
    // storage): keep x (the router holds it anyway) and the PFT indices instead of the rows
    // [N, d], which go once h is made, and gather them again where backward needs them.
    Tensor rows = ctx.get("expert_in");
    const bool regather = hooks_.empty() && rows.raw() == ctx.get("rows").raw();
    experts_->set_input_regather(
        regather ? std::function<Tensor()>([this, x = ctx.get("x")] { return order_->gather(x); })
                 : nullptr);
    if (regather) {
      ctx.erase("expert_in");
      ctx.erase("rows");
    }
    ctx.set("expert_out", experts_->forward(std::move(rows), handle_.recv_tokens_per_expert));
  });
  run_stage(ctx, Stage::combine, [&] {
    ctx.set("rows_out", dispatcher_->combine(ctx.get("expert_out"), handle_));
  });
  run_stage(ctx, Stage::iorder, [&] {
    Tensor y;
    if (reduces) {  // rows_out: weighted partial sums [G, d] of tokens handle_.group_tokens
      y = Tensor::zeros({T, d_model_}, x_in.dtype(), x_in.device());
      xmoe::ops::scatter_add_rows(y, ctx.get("rows_out"), handle_.group_tokens);
    } else {
      y = iorder_.forward(ctx.get("rows_out"), ctx.get("combine_weights"), layout);
    }
    ctx.set("y_routed", y);
    ctx.set("y", y);
  });
  if (shared_) {
    run_stage(ctx, Stage::shared, [&] {
      Tensor ys = shared_->forward(ctx.get("x"));
      ctx.set("y_shared", ys);
      ctx.set("y", xmoe::ops::add(ctx.get("y"), ys));
    });
  }
  have_forward_ = true;
  return ctx.get("y");
}

Tensor MoELayer::backward(const Tensor& dy) {
  XMOE_CHECK(have_forward_, "[moe] backward without a forward (or called twice)");
  check_shape(dy, {order_->layout().num_tokens, d_model_}, "moe backward", "dy");
  device_ = dy.device();
  ProfileScope scope("moe.bwd", device_);
  StageContext ctx(prefix_, Phase::backward);
  ctx.set("d_y", dy);
  if (shared_) {
    run_stage(ctx, Stage::shared, [&] { ctx.set("d_x_shared", shared_->backward(ctx.get("d_y"))); });
  }
  const bool reduces = dispatcher_->reduces_in_combine();
  run_stage(ctx, Stage::iorder, [&] {
    if (reduces) {  // d(partial sums) [G, d]; d_combine_weights come from combine_backward
      ctx.set("d_rows_out", xmoe::ops::gather_rows(ctx.get("d_y"), handle_.group_tokens));
      return;
    }
    IOrder::Grads g = iorder_.backward(ctx.get("d_y"));
    ctx.set("d_rows_out", g.d_rows);
    ctx.set("d_combine_weights", g.d_combine_weights);
  });
  iorder_.release();
  run_stage(ctx, Stage::combine, [&] {
    ctx.set("d_expert_out", dispatcher_->combine_backward(ctx.get("d_rows_out"), handle_));
    if (reduces) ctx.set("d_combine_weights", dispatcher_->combine_weights_grad(handle_));
  });
  run_stage(ctx, Stage::expert, [&] {
    // With no hook to read them later, the experts hold the only reference to their output
    // gradient (and the rows it came from) and free it mid-backward: [N, d] less at the peak.
    Tensor d_out = ctx.get("d_expert_out");
    if (hooks_.empty()) {
      ctx.erase("d_expert_out");
      ctx.erase("d_rows_out");
    }
    ctx.set("d_expert_in", experts_->backward(std::move(d_out)));
  });
  experts_->release();
  run_stage(ctx, Stage::dispatch, [&] {
    ctx.set("d_rows", dispatcher_->dispatch_backward(ctx.get("d_expert_in"), handle_));
  });
  run_stage(ctx, Stage::order, [&] {
    Order::Grads g = order_->backward(ctx.get("d_rows"), ctx.get("d_combine_weights"));
    ctx.set("d_x_routed", g.dx);
    ctx.set("d_topk_weight", g.d_topk_weight);
  });
  run_stage(ctx, Stage::gate, [&] {
    // Weights a hook replaced are constants: only the aux losses reach the router then.
    Tensor dw = ctx.get("d_topk_weight");
    if (gate_output_replaced_) dw = Tensor::zeros(dw.shape(), dw.dtype(), dw.device());
    gate_->set_aux_grad_scale(aux_grad_scale_);
    ctx.set("d_x_gate", gate_->backward(dw));
  });
  Tensor dx = ctx.get("d_x_routed");
  xmoe::ops::add_(dx, ctx.get("d_x_gate"));
  if (shared_) xmoe::ops::add_(dx, ctx.get("d_x_shared"));
  have_forward_ = false;  // trained on: its load stays in the pending bias update
  release();
  return dx;
}

void MoELayer::release() {
  if (have_forward_)  // forward-only (evaluation): take its load back out of the pending update
    for (size_t e = 0; e < load_.size(); ++e) pending_load_[e] -= load_[e];
  gate_->release();
  order_->release();
  experts_->release();
  iorder_.release();
  if (shared_) shared_->release();
  handle_ = {};
  have_forward_ = false;
}

void MoELayer::update_routing_bias() {
  ProfileScope scope("moe.update_bias", device_);
  // Only the sigmoid gate has a bias; every rank has the same gate, so all skip or all reduce.
  if (gate_->routing_bias() != nullptr && par_.world && par_.world->size() > 1) {
    // On the world's device (an NCCL world moves CUDA tensors); i64, exact: the step's load.
    Tensor load = Tensor::from_vector(pending_load_, {static_cast<int64_t>(pending_load_.size())},
                                      par_.world->device());
    par_.world->all_reduce(load);
    pending_load_ = load.to_vector<int64_t>();
  }
  gate_->update_bias(pending_load_);
  std::fill(pending_load_.begin(), pending_load_.end(), 0);
}

void MoELayer::collect_parameters(std::vector<Parameter*>& out) {
  gate_->collect_parameters(out);
  experts_->collect_parameters(out);
  if (shared_) shared_->collect_parameters(out);
}

}  // namespace xmoe::moe

// ---- Expert placement ---------------------------------------------------------------------------

namespace xmoe::moe {

void MoELayer::record_coactivation_pairs(const Tensor& topk_idx) {
  const std::vector<int32_t> idx = topk_idx.to_vector<int32_t>();
  const int64_t k = topk_idx.size(1);
  for (size_t t = 0; t + k <= idx.size(); t += static_cast<size_t>(k))
    coactivation_.add_token(std::span<const int32_t>(idx.data() + t, static_cast<size_t>(k)));
}

CoactivationMatrix MoELayer::global_coactivation() const {
  CoactivationMatrix out = coactivation_;
  if (par_.world && par_.world->size() > 1) {
    Tensor t = Tensor::from_vector(out.counts, {static_cast<int64_t>(out.counts.size())},
                                   par_.world->device());
    par_.world->all_reduce(t);  // i64: exact
    out.counts = t.to_vector<int64_t>();
  }
  return out;
}

void MoELayer::reset_coactivation() { coactivation_ = CoactivationMatrix(cfg_.num_experts); }

namespace {

/// Throws unless perm is a permutation of [0, E).
void check_permutation(const std::vector<int>& perm, int64_t E) {
  XMOE_CHECK(static_cast<int64_t>(perm.size()) == E,
             "[moe permute_experts] permutation of {} entries for {} experts", perm.size(), E);
  std::vector<char> seen(static_cast<size_t>(E), 0);
  for (int p : perm) {
    XMOE_CHECK(p >= 0 && p < E && !seen[p],
               "[moe permute_experts] not a permutation of [0, {}): {} repeated or out of range",
               E, p);
    seen[p] = 1;
  }
}

template <class T> std::vector<T> permuted(const std::vector<T>& v, const std::vector<int>& perm) {
  std::vector<T> out(v.size());
  for (size_t s = 0; s < perm.size(); ++s) out[s] = v[static_cast<size_t>(perm[s])];
  return out;
}

}  // namespace

void MoELayer::permute_tensor(Tensor& t, const std::vector<int>& perm, bool sharded, int axis) {
  if (t.dtype() == DType::bf16) {  // bf16 gradients (moe.expert_grad_dtype): through f32, exact
    Tensor t32 = xmoe::ops::cast(t, DType::f32);
    permute_tensor(t32, perm, sharded, axis);
    t.copy_from(xmoe::ops::cast(t32, DType::bf16));
    return;
  }
  const int64_t E = cfg_.num_experts;
  if (axis == 1) {  // [r, E] (or [E]): columns
    XMOE_CHECK(t.dtype() == DType::f32 && t.size(-1) == E,
               "[moe permute_experts] expected f32 [..., {}], got {}", E, t.str());
    const int64_t rows = t.numel() / E;
    std::vector<float> v = t.to_vector<float>(), out(v.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t s = 0; s < E; ++s) out[r * E + s] = v[r * E + perm[s]];
    t.copy_from(Tensor::from_vector(out, t.shape(), t.device()));
    return;
  }
  // Expert rows [E_local, ...]: the full [E, ...] tensor, permuted, then this rank's slice.
  const int64_t El = t.size(0), inner = t.numel() / std::max<int64_t>(El, 1);
  Tensor flat = t.reshape({El, inner});
  Tensor full = sharded && par_.ep > 1 ? par_.ep_group->all_gather(flat) : flat.clone();
  XMOE_CHECK(full.size(0) == E, "[moe permute_experts] gathered {} expert rows, expected {}",
             full.size(0), E);
  const int64_t first = sharded ? par_.first_expert(E) : 0;
  std::vector<int32_t> rows(static_cast<size_t>(El));
  for (int64_t i = 0; i < El; ++i) rows[i] = perm[first + i];
  flat.copy_from(xmoe::ops::gather_rows(full, Tensor::from_vector(rows, {El}, t.device())));
}

namespace {

struct Permutable {
  Parameter* param;
  int axis;  // 0: expert rows (sharded over ep), 1: expert columns of a router tensor
};

std::vector<Permutable> permutable_parameters(Gate& gate, Experts& experts) {
  std::vector<Permutable> out;
  std::vector<Parameter*> ps;
  gate.collect_parameters(ps);
  auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (Parameter* p : ps) {
    const bool cols = ends_with(p->name, ".router.expert_embeddings") ||
                      (ends_with(p->name, ".router.weight") && gate.name() != "xmoe");
    if (cols) out.push_back({p, 1});
  }
  ps.clear();
  experts.collect_parameters(ps);
  for (Parameter* p : ps) out.push_back({p, 0});
  return out;
}

}  // namespace

void MoELayer::permute_experts(const std::vector<int>& perm) {
  const int64_t E = cfg_.num_experts;
  check_permutation(perm, E);
  if (gate_->name() == "sigmoid" && cfg_.num_groups > 1) {
    const int64_t gs = E / cfg_.num_groups;
    for (int64_t s = 0; s < E; ++s)
      XMOE_CHECK(perm[s] / gs == perm[s - s % gs] / gs,
                 "[moe permute_experts] the sigmoid gate routes within {} groups of {} experts; "
                 "the permutation splits a group (slot {} takes expert {})",
                 cfg_.num_groups, gs, s, perm[s]);
  }
  release();
  for (const Permutable& p : permutable_parameters(*gate_, *experts_)) {
    permute_tensor(p.param->value, perm, p.axis == 0, p.axis);
    if (p.param->grad.defined()) permute_tensor(p.param->grad, perm, p.axis == 0, p.axis);
  }
  if (Tensor* b = gate_->routing_bias()) permute_tensor(*b, perm, false, 1);
  pending_load_ = permuted(pending_load_, perm);
  if (!load_.empty()) load_ = permuted(load_, perm);
  if (!tokens_per_expert_.empty()) tokens_per_expert_ = permuted(tokens_per_expert_, perm);
  CoactivationMatrix c(E);
  for (int64_t a = 0; a < E; ++a)
    for (int64_t b = 0; b < E; ++b) c.at(a, b) = coactivation_.at(perm[a], perm[b]);
  coactivation_ = std::move(c);
  if (last_topk_idx_.defined()) {  // frozen routing keeps choosing the same (moved) experts
    std::vector<int32_t> inv(static_cast<size_t>(E));
    for (int64_t s = 0; s < E; ++s) inv[perm[s]] = static_cast<int32_t>(s);
    std::vector<int32_t> idx = last_topk_idx_.to_vector<int32_t>();
    for (int32_t& e : idx) e = inv[e];
    last_topk_idx_ = Tensor::from_vector(idx, last_topk_idx_.shape(), last_topk_idx_.device());
  }
}

void MoELayer::permute_parameter_state(std::map<std::string, Tensor>& state,
                                       const std::vector<int>& perm,
                                       const std::vector<std::string>& suffixes) {
  check_permutation(perm, cfg_.num_experts);
  for (const Permutable& p : permutable_parameters(*gate_, *experts_))
    for (const std::string& suffix : suffixes) {
      auto it = state.find(p.param->name + suffix);
      if (it == state.end()) continue;
      XMOE_CHECK(it->second.shape() == p.param->value.shape(),
                 "[moe permute_parameter_state] {} is {}, the parameter is {}", it->first,
                 it->second.str(), p.param->value.str());
      permute_tensor(it->second, perm, p.axis == 0, p.axis);
    }
}

}  // namespace xmoe::moe
