#include "xmoe/moe/layer.h"

#include <cmath>

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
  const float dstd = down_std.value_or(init_std);

  order_ = make_order(c);  // first: an unknown moe.impl fails before any allocation
  // One process (world of size 1) makes no collective: the statistics are already global.
  auto stats = par_.world && par_.world->size() > 1 ? par_.world : nullptr;
  gate_ = make_gate({c, d_model, prefix_, seed, init_std, stats});
  DispatchConfig dc;
  dc.algorithm = c.dispatch;
  dc.num_experts = c.num_experts;
  dc.ep_rank = par_.ep_rank;
  dc.ep_size = par_.ep;
  dc.group = par_.ep_group;
  dispatcher_ = make_dispatcher(dc);
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
  experts_ = make_experts("swiglu", ea);
  if (c.num_shared_experts > 0)
    shared_ = std::make_unique<SharedExperts>(
        prefix_, d_model, static_cast<int64_t>(c.num_shared_experts) * c.expert_hidden, seed,
        init_std, dstd);
  pending_load_.assign(static_cast<size_t>(c.num_experts), 0);
}

MoELayer::~MoELayer() = default;

template <class Body> void MoELayer::run_stage(StageContext& ctx, Stage stage, Body&& body) {
  ctx.enter(stage, When::before);
  hooks_.run(ctx);
  body();
  ctx.enter(stage, When::after);
  hooks_.run(ctx);
}

Tensor MoELayer::forward(const Tensor& x_in, int64_t seq_len) {
  check_dtype(x_in, DType::f32, "moe", "x");
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

  StageContext ctx(prefix_, Phase::forward);
  ctx.set("x", x_in);
  run_stage(ctx, Stage::gate, [&] {
    GateOutput g = gate_->forward(ctx.get("x"), seq_len, fixed_idx);
    aux_ = g.aux;
    ctx.set("topk_idx", g.topk_idx);
    ctx.set("topk_weight", g.topk_weight);
    ctx.set_scalar("aux_loss", aux_.weighted);
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
  tokens_per_expert_ = layout.tokens_per_expert;
  load_ = layout.load;
  dropped_ = layout.dropped;
  for (size_t e = 0; e < load_.size(); ++e) pending_load_[e] += load_[e];

  run_stage(ctx, Stage::dispatch, [&] {
    DispatchResult r = dispatcher_->dispatch(ctx.get("rows"), layout.group_sizes);
    handle_ = std::move(r.handle);
    ctx.set("expert_in", r.rows);
  });
  run_stage(ctx, Stage::expert, [&] {
    ctx.set("expert_out", experts_->forward(ctx.get("expert_in"), handle_.recv_tokens_per_expert));
  });
  run_stage(ctx, Stage::combine, [&] {
    ctx.set("rows_out", dispatcher_->combine(ctx.get("expert_out"), handle_));
  });
  run_stage(ctx, Stage::iorder, [&] {
    Tensor y = iorder_.forward(ctx.get("rows_out"), ctx.get("combine_weights"), layout);
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
  StageContext ctx(prefix_, Phase::backward);
  ctx.set("d_y", dy);
  if (shared_) {
    run_stage(ctx, Stage::shared, [&] { ctx.set("d_x_shared", shared_->backward(ctx.get("d_y"))); });
  }
  run_stage(ctx, Stage::iorder, [&] {
    IOrder::Grads g = iorder_.backward(ctx.get("d_y"));
    ctx.set("d_rows_out", g.d_rows);
    ctx.set("d_combine_weights", g.d_combine_weights);
  });
  iorder_.release();
  run_stage(ctx, Stage::combine, [&] {
    ctx.set("d_expert_out", dispatcher_->combine_backward(ctx.get("d_rows_out"), handle_));
  });
  run_stage(ctx, Stage::expert, [&] {
    ctx.set("d_expert_in", experts_->backward(ctx.get("d_expert_out")));
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
    if (gate_output_replaced_) dw = Tensor::zeros(dw.shape());
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
  // Only the sigmoid gate has a bias; every rank has the same gate, so all skip or all reduce.
  if (gate_->routing_bias() != nullptr && par_.world && par_.world->size() > 1) {
    Tensor load = Tensor::from_vector(pending_load_, {static_cast<int64_t>(pending_load_.size())});
    par_.world->all_reduce(load);  // i64, exact: the global load of the step
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
