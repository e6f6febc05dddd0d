#include "xmoe/moe/layer.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>

#include "xmoe/core/profile.h"
#include "xmoe/moe/padded.h"
#include "xmoe/moe/pipeline.h"
#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

MoELayer::MoELayer(const MoeConfig& config, int64_t d_model, std::string prefix, uint64_t seed,
                   float init_std, std::optional<float> down_std, LayerGroups groups)
    : cfg_(config),
      groups_(std::move(groups)),
      ep_size_(groups_.ep ? groups_.ep->size() : 1),
      ep_rank_(groups_.ep ? groups_.ep->rank() : 0),
      d_model_(d_model),
      prefix_(std::move(prefix)) {
  const MoeConfig& c = cfg_;
  XMOE_CHECK(c.num_experts >= 1, "[moe] moe.num_experts = {} must be >= 1", c.num_experts);
  XMOE_CHECK(c.top_k >= 1, "[moe] moe.top_k = {} must be >= 1", c.top_k);
  XMOE_CHECK(c.top_k <= c.num_experts, "[moe] moe.top_k = {} exceeds moe.num_experts = {}", c.top_k,
             c.num_experts);
  XMOE_CHECK(c.num_shared_experts >= 0, "[moe] moe.num_shared_experts = {} must be >= 0",
             c.num_shared_experts);
  XMOE_CHECK(d_model >= 1, "[moe] d_model = {} must be >= 1", d_model);
  XMOE_CHECK(c.num_experts % ep_size_ == 0,
             "[moe] moe.num_experts = {} is not divisible by parallel.ep = {}", c.num_experts,
             ep_size_);
  XMOE_CHECK(ep_size_ == 1 || c.dispatch != "local",
             "[moe] moe.dispatch = 'local' holds every expert on one rank, but parallel.ep = {}; "
             "use 'all_to_all'",
             ep_size_);
  XMOE_CHECK(c.dispatch != "rbd" || c.impl == "pft",
             "[moe] moe.dispatch = 'rbd' needs moe.impl = 'pft', got '{}'", c.impl);
  const float dstd = down_std.value_or(init_std);

  order_ = make_order(c);  // first: an unknown moe.impl fails before any allocation
  // One process (world of size 1) makes no collective: the statistics are already global.
  auto stats = groups_.world && groups_.world->size() > 1 ? groups_.world : nullptr;
  gate_ = make_gate({c, d_model, prefix_, seed, init_std, stats});
  make_dispatcher_(0);
  ExpertArgs ea;
  ea.prefix = prefix_;
  ea.num_experts = c.num_experts;
  ea.num_local = c.num_experts / ep_size_;
  ea.first_expert = ep_rank_ * ea.num_local;
  ea.d_model = d_model;
  ea.hidden = c.expert_hidden;
  ea.seed = seed;
  ea.init_std = init_std;
  ea.down_std = dstd;
  XMOE_CHECK(c.expert_grad_dtype == "f32" || c.expert_grad_dtype == "bf16",
             "[moe] moe.expert_grad_dtype = \"{}\" is not f32 or bf16", c.expert_grad_dtype);
  ea.grad_dtype = c.expert_grad_dtype == "bf16" ? DType::bf16 : DType::f32;
  ea.chunks = c.expert_chunks;
  XMOE_CHECK(c.expert_dtype == "bf16" || c.expert_dtype == "fp8",
             "[moe] moe.expert_dtype = \"{}\" is not bf16 or fp8", c.expert_dtype);
  ea.fp8 = c.expert_dtype == "fp8";
  experts_ = make_experts("swiglu", ea);
  XMOE_CHECK(
      c.shared_overlap == "off" || c.shared_overlap == "routing" || c.shared_overlap == "all",
      "[moe] moe.shared_overlap = \"{}\" is not off, routing or all", c.shared_overlap);
  shared_routing_only_ = c.shared_overlap == "routing";
  if (c.num_shared_experts > 0)
    shared_ = std::make_unique<SharedExperts>(
        prefix_, d_model, static_cast<int64_t>(c.num_shared_experts) * c.expert_hidden, seed,
        init_std, dstd);
  pending_load_.assign(static_cast<size_t>(c.num_experts), 0);
  coactivation_ = CoactivationMatrix(c.num_experts);
}

MoELayer::~MoELayer() = default;

SideStream* MoELayer::shared_side() {
  if (cfg_.shared_overlap == "off" || !device_.is_cuda()) return nullptr;
  if (!shared_side_ || shared_side_->device() != device_)
    shared_side_ = SideStream::for_device(device_);
  return shared_side_.get();
}

void MoELayer::make_dispatcher_(int ranks_per_node) {
  DispatchConfig dc;
  dc.algorithm = cfg_.dispatch;
  dc.num_experts = cfg_.num_experts;
  dc.ep_rank = ep_rank_;
  dc.ep_size = ep_size_;
  dc.group = groups_.ep;
  dc.ranks_per_node = ranks_per_node;
  dispatcher_ = make_dispatcher(dc);
}

void MoELayer::set_ranks_per_node(int ranks_per_node) {
  release();
  make_dispatcher_(ranks_per_node);
  if (pipeline_fwd_ > 1 || pipeline_bwd_ > 1) set_pipeline(pipeline_fwd_, pipeline_bwd_);
}

void MoELayer::set_pipeline(int forward_chunks, int backward_chunks) {
  XMOE_CHECK(forward_chunks >= 1 && backward_chunks >= 1,
             "[moe] model.moe.pipeline: {} forward and {} backward chunks; both must be >= 1",
             forward_chunks, backward_chunks);
  XMOE_CHECK((forward_chunks == 1 && backward_chunks == 1) || dispatcher_->pipelines(),
             "[moe] model.moe.pipeline: moe.dispatch = '{}' does not pipeline (local, all_to_all "
             "and rbd do)",
             dispatcher_->name());
  pipeline_fwd_ = forward_chunks;
  pipeline_bwd_ = backward_chunks;
}

namespace {

/// Runs a stage under its profiler region ("moe.<stage>.fwd|bwd", a string literal: ProfileScope
/// keeps it); the hooks on its output run outside, so the region times the stage alone.
template <class Body>
auto timed(const char* region, Device device, Body&& body) {
  ProfileScope scope(region, device);
  return body();
}

/// model.moe.pipeline's chunk count for the memory formula; auto as it resolves without a
/// profile.
int64_t pipeline_chunks_for(const std::string& value, int ep) {
  const int n = parse_pipeline_chunks(value, "model.moe.pipeline");
  return n == 0 ? default_pipeline_chunks(ep) : n;
}

/// Moves a boundary's tensor out to the stage that reads it: the layer keeps no reference once
/// that stage is done, so the tensor goes as soon as nothing else holds it.
Tensor take(Tensor& t) {
  return std::exchange(t, Tensor());
}

}  // namespace

Tensor MoELayer::forward(const Tensor& x_in, int64_t seq_len) {
  // Activations: f32, or bf16 on CUDA (parameters stay f32; see docs/moe.md, "On CUDA").
  xmoe::ops::check_float("moe", "x", x_in);
  check_shape(x_in, {-1, d_model_}, "moe", "x");
  const int64_t T = x_in.size(0);
  XMOE_CHECK(seq_len >= 1 && T % seq_len == 0, "[moe] {} tokens are not a multiple of seq_len = {}",
             T, seq_len);
  Tensor fixed_idx;
  if (frozen_routing_ && last_topk_idx_.defined()) {
    XMOE_CHECK(last_topk_idx_.size(0) == T, "[moe] frozen routing holds {} tokens but x has {}",
               last_topk_idx_.size(0), T);
    fixed_idx = last_topk_idx_;
  }

  device_ = x_in.device();
  ProfileScope scope("moe.fwd", device_);
  LayerIn in{x_in};
  hooks_.run(in);

  // The shared experts read only x: queued first, on a side stream where there is one, they run
  // beside the routed path and join it before the sum (their hook runs there, in stage order).
  SideStream* side = shared_ ? shared_side() : nullptr;
  SharedOut sh;
  if (shared_) {
    sh = timed("moe.shared.fwd", device_, [&] {
      const SideStream::Scope on_side(side);
      return SharedOut{shared_->forward(in.x)};
    });
  }

  GateOut g = timed("moe.gate.fwd", device_, [&] {
    // The router runs in f32 whatever the activations' dtype (routing is precision-sensitive),
    // unless moe.router_dtype = bf16; it casts x for its GEMMs and keeps x as it is.
    GateOutput out = gate_->forward(in.x, seq_len, fixed_idx);
    aux_ = std::move(out.aux);
    return GateOut{std::move(out.topk_idx), std::move(out.topk_weight), &aux_};
  });
  gate_output_replaced_ = hooks_.run(g);

  const int64_t num_local = cfg_.num_experts / ep_size_;
  const bool pipelined =
      pipeline_fwd_ > 1 && num_local > 1 && !hooks_.has<DispatchOut>() && !hooks_.has<ExpertOut>();
  // Experts that read x through the PFT indices (FP8: the quantiser gathers) get no rows when
  // nothing else would read them: dispatch moves none, no pipelining, no hook on the rows.
  const bool experts_gather = experts_->fuses_gather() && !dispatcher_->moves_rows() &&
                              !pipelined && pipeline_bwd_ == 1 && !hooks_.has<OrderOut>() &&
                              !hooks_.has<DispatchOut>();
  OrderOut o = timed("moe.order.fwd", device_, [&] {
    order_->plan(in.x, g.topk_idx, g.topk_weight);
    const TokenLayout& l = order_->layout();
    Tensor rows = experts_gather && !l.padded ? Tensor() : order_->gather(in.x);
    return OrderOut{std::move(rows), l.combine_weights, &l};
  });
  const bool rows_replaced = hooks_.run(o);
  const TokenLayout& layout = order_->layout();
  const bool rows_gathered_by_experts = !o.rows.defined();
  last_topk_idx_ = g.topk_idx;
  if (record_coactivation_) record_coactivation_pairs(last_topk_idx_);
  // rbd applies the combine weights and sums per (token, node) inside combine (dispatch.h).
  const bool reduces = dispatcher_->reduces_in_combine();
  tokens_per_expert_ = layout.tokens_per_expert;
  load_ = layout.load;
  dropped_ = layout.dropped;
  for (size_t e = 0; e < load_.size(); ++e) pending_load_[e] += load_[e];

  CombineOut c;
  if (pipelined) {
    if (side && shared_routing_only_) side->join();
    // Dispatch, Expert and Combine chunk by chunk (moe/pipeline.h); no regather: each chunk's
    // experts keep their own rows.
    c = timed("moe.pipeline.fwd", device_, [&] {
      handle_ = dispatcher_->plan(o.rows, layout.group_sizes,
                                  RowInfo{layout.token_ids, o.combine_weights, T});
      const ChunkBounds bounds = even_chunks(num_local, pipeline_fwd_);
      std::unique_ptr<ChunkedPass> pass = dispatcher_->forward_pass(take(o.rows), handle_, bounds);
      experts_->begin_forward(handle_.recv_tokens_per_expert);
      return CombineOut{run_pipeline(*pass, bounds, [&](int k, Tensor rows) {
        return experts_->forward_part(std::move(rows), bounds[k], bounds[k + 1]);
      })};
    });
  } else {
    DispatchOut dsp = timed("moe.dispatch.fwd", device_, [&] {
      DispatchResult r =
          reduces ? dispatcher_->dispatch(o.rows, layout.group_sizes,
                                          RowInfo{layout.token_ids, o.combine_weights, T})
                  : dispatcher_->dispatch(o.rows, layout.group_sizes);
      handle_ = std::move(r.handle);
      return DispatchOut{std::move(r.rows), handle_.recv_tokens_per_expert};
    });
    const bool expert_in_replaced = hooks_.run(dsp);
    // The experts' input is the order stage's gather of x when dispatch moved nothing (same
    // storage) and no hook replaced it: keep x (the router holds it anyway) and the PFT indices
    // instead of the rows [N, d], which go once h is made, and gather them again where backward
    // needs them.
    // moe.keep_expert_rows keeps them instead (FP8 experts gather x themselves: none to keep).
    const bool keep_rows = cfg_.keep_expert_rows && !experts_->fuses_gather();
    const bool regather =
        rows_gathered_by_experts || (!keep_rows && !rows_replaced && !expert_in_replaced &&
                                     dsp.expert_in.raw() == o.rows.raw() && pipeline_bwd_ == 1);
    o.rows = Tensor();  // dispatched: the experts hold what they need
    if (side && shared_routing_only_) side->join();

    ExpertOut e = timed("moe.expert.fwd", device_, [&] {
      experts_->set_input_regather(
          regather ? std::function<Tensor()>([this, x = in.x] { return order_->gather(x); })
                   : nullptr);
      if (rows_gathered_by_experts)
        return ExpertOut{
            experts_->forward_gathered(in.x, layout.token_ids, handle_.recv_tokens_per_expert)};
      return ExpertOut{experts_->forward(take(dsp.expert_in), handle_.recv_tokens_per_expert)};
    });
    hooks_.run(e);

    c = timed("moe.combine.fwd", device_,
              [&] { return CombineOut{dispatcher_->combine(take(e.expert_out), handle_)}; });
  }
  hooks_.run(c);

  // y = routed + shared in the I-Order's pass, where no hook looks at either alone.
  const bool shared_in_iorder =
      shared_ && !reduces && !hooks_.has<IOrderOut>() && !hooks_.has<SharedOut>();
  if (shared_in_iorder && side) side->join();
  IOrderOut io = timed("moe.iorder.fwd", device_, [&] {
    if (reduces) {  // rows_out: weighted partial sums [G, d] of tokens handle_.group_tokens
      Tensor y = Tensor::zeros({T, d_model_}, x_in.dtype(), x_in.device());
      xmoe::ops::scatter_add_rows(y, take(c.rows_out), handle_.group_tokens);
      return IOrderOut{std::move(y)};
    }
    // The I-Order keeps the only reference to rows_out, so its backward can overwrite them.
    return IOrderOut{iorder_.forward(take(c.rows_out), take(o.combine_weights), layout,
                                     shared_in_iorder ? take(sh.y) : Tensor())};
  });
  hooks_.run(io);
  have_forward_ = true;
  if (!shared_ || shared_in_iorder) return io.y;

  if (side) side->join();
  hooks_.run(sh);
  // In place where nothing else holds y: the fused pass's peak.
  if (!io.y.sole_owner()) return xmoe::ops::add(io.y, sh.y);
  xmoe::ops::add_(io.y, sh.y);
  return io.y;
}

Tensor MoELayer::backward(const Tensor& dy) {
  XMOE_CHECK(have_forward_, "[moe] backward without a forward (or called twice)");
  check_shape(dy, {order_->layout().num_tokens, d_model_}, "moe backward", "dy");
  device_ = dy.device();
  ProfileScope scope("moe.bwd", device_);
  LayerOutGrad out{dy};
  hooks_.run(out);

  // Beside the routed backward on the side stream, joined before dx is summed; a hook on their
  // gradient sees it at once, in stage order.
  SideStream* side = shared_ ? shared_side() : nullptr;
  SharedGrad sg;
  if (shared_) {
    sg = timed("moe.shared.bwd", device_, [&] {
      const SideStream::Scope on_side(side);
      return SharedGrad{shared_->backward(out.d_y)};
    });
    if (side && hooks_.has<SharedGrad>()) side->join();
    hooks_.run(sg);
  }
  const bool reduces = dispatcher_->reduces_in_combine();
  const int64_t num_local = cfg_.num_experts / ep_size_;
  const bool pipelined =
      pipeline_bwd_ > 1 && num_local > 1 && !hooks_.has<CombineGrad>() && !hooks_.has<ExpertGrad>();
  // FP8 experts read their output gradient in FP8: the I-Order's pass writes it too where the
  // rows reach the experts as they leave it (one rank, unpipelined) and no hook looks between.
  const bool fp8_grad_in_iorder = experts_->reads_fp8_output_grad() && !reduces && ep_size_ == 1 &&
                                  !pipelined && !hooks_.has<IOrderGrad>() &&
                                  !hooks_.has<CombineGrad>();
  xmoe::ops::Fp8Rows d_out_fp8;
  IOrderGrad ig = timed("moe.iorder.bwd", device_, [&] {
    if (reduces)  // d(partial sums) [G, d]; d_combine_weights come from combine_backward
      return IOrderGrad{xmoe::ops::gather_rows(out.d_y, handle_.group_tokens), Tensor()};
    IOrder::Grads gr = iorder_.backward(
        out.d_y, fp8_grad_in_iorder ? std::span<const int64_t>(handle_.recv_tokens_per_expert)
                                    : std::span<const int64_t>());
    d_out_fp8 = std::move(gr.d_rows_fp8);
    return IOrderGrad{std::move(gr.d_rows), std::move(gr.d_combine_weights)};
  });
  hooks_.run(ig);
  iorder_.release();

  CombineGrad cg;
  DispatchGrad dg;
  if (pipelined) {
    if (side && shared_routing_only_) side->join();
    // Combine, Expert and Dispatch backward chunk by chunk (moe/pipeline.h).
    dg = timed("moe.pipeline.bwd", device_, [&] {
      const ChunkBounds bounds = even_chunks(num_local, pipeline_bwd_);
      std::unique_ptr<ChunkedPass> pass =
          dispatcher_->backward_pass(take(ig.d_rows_out), handle_, bounds);
      return DispatchGrad{run_pipeline(*pass, bounds, [&](int k, Tensor d_out) {
        return experts_->backward_part(std::move(d_out), bounds[k], bounds[k + 1]);
      })};
    });
    cg.d_combine_weights =
        reduces ? dispatcher_->combine_weights_grad(handle_) : take(ig.d_combine_weights);
    experts_->release();
  } else {
    const void* d_rows_out = ig.d_rows_out.raw();
    cg = timed("moe.combine.bwd", device_, [&] {
      Tensor d_out = dispatcher_->combine_backward(take(ig.d_rows_out), handle_);
      Tensor d_cw =
          reduces ? dispatcher_->combine_weights_grad(handle_) : take(ig.d_combine_weights);
      return CombineGrad{std::move(d_out), std::move(d_cw)};
    });
    hooks_.run(cg);
    if (side && shared_routing_only_) side->join();

    ExpertGrad eg = timed("moe.expert.bwd", device_, [&] {
      // The experts get the only reference to their output gradient (and the rows it came from)
      // and free it mid-backward: [N, d] less at the peak.
      if (d_out_fp8.data.defined() && cg.d_expert_out.raw() == d_rows_out)
        return ExpertGrad{experts_->backward(take(cg.d_expert_out), std::move(d_out_fp8))};
      d_out_fp8 = {};
      return ExpertGrad{experts_->backward(take(cg.d_expert_out))};
    });
    hooks_.run(eg);
    experts_->release();

    dg = timed("moe.dispatch.bwd", device_, [&] {
      return DispatchGrad{dispatcher_->dispatch_backward(take(eg.d_expert_in), handle_)};
    });
  }
  hooks_.run(dg);

  // dx = the order's + the shared experts' in the order's pass, where no hook looks at either.
  const bool shared_in_order = shared_ && !hooks_.has<OrderGrad>() && !hooks_.has<SharedGrad>();
  if (shared_in_order && side) side->join();
  OrderGrad og = timed("moe.order.bwd", device_, [&] {
    Order::Grads gr = order_->backward(take(dg.d_rows), take(cg.d_combine_weights),
                                       shared_in_order ? take(sg.d_x) : Tensor());
    return OrderGrad{std::move(gr.dx), std::move(gr.d_topk_weight)};
  });
  hooks_.run(og);

  Tensor dx = take(og.d_x);
  // The shared experts' dx before the gate's, as the fused pass adds it; freed once added.
  if (shared_ && !shared_in_order) {
    if (side) side->join();
    xmoe::ops::add_(dx, take(sg.d_x));
  }
  // The gate adds its dx into the order's (in its GEMM) unless a hook looks at it alone.
  const bool gate_adds = !hooks_.has<GateGrad>();
  GateGrad gg = timed("moe.gate.bwd", device_, [&] {
    // Weights a hook replaced are constants: only the aux losses reach the router then.
    Tensor dw = take(og.d_topk_weight);
    if (gate_output_replaced_) dw = Tensor::zeros(dw.shape(), dw.dtype(), dw.device());
    gate_->set_aux_grad_scale(aux_grad_scale_, aux_grad_device_scale_);
    if (!gate_adds) return GateGrad{gate_->backward(dw)};
    gate_->backward_add(dw, dx);
    return GateGrad{};
  });
  if (!gate_adds) {
    hooks_.run(gg);
    xmoe::ops::add_(dx, gg.d_x);
  }
  have_forward_ = false;  // trained on: its load stays in the pending bias update
  release();
  return dx;
}

ActivationBytes MoELayer::activation_bytes_for(const MoeConfig& c, int64_t d, int64_t tokens,
                                               int ep, DType dtype, LayerRecompute rc,
                                               double load_imbalance, bool weights_kept) {
  const bool recompute = rc.experts;
  const auto cb = static_cast<int64_t>(dtype_size(dtype));
  const int64_t f = c.expert_hidden, sf = static_cast<int64_t>(c.num_shared_experts) * f;
  const int64_t pairs = tokens * c.top_k;
  const int64_t n = c.impl == "padded"
                        ? static_cast<int64_t>(c.num_experts) *
                              padded_capacity(c.capacity_factor, tokens, c.top_k, c.num_experts)
                        : pairs;
  // Rows this rank's experts get: all of its own with one ep rank, else the busiest share.
  const int64_t recv =
      ep > 1 ? static_cast<int64_t>(static_cast<double>(n) * load_imbalance + 0.5) : n;
  const int64_t x = tokens * d * cb, layout = 12 * n + 4 * pairs;
  const int64_t h = recv * 2 * f * cb, in_rows = recv * d * cb, out = n * d * cb;
  const int64_t shared_h = tokens * 2 * sf * cb;
  // The pipelined layer (docs/pipeline.md, "Memory"), in the chunks even_chunks makes.
  const int64_t local = std::max<int64_t>(1, c.num_experts / std::max(ep, 1));
  const int64_t fwd_chunks = std::min<int64_t>(pipeline_chunks_for(c.pipeline, ep), local);
  const int64_t bwd_chunks =
      c.pipeline_backward == "same"
          ? fwd_chunks
          : std::min<int64_t>(pipeline_chunks_for(c.pipeline_backward, ep), local);
  // expert_dtype = fp8 (docs/fp8.md): the quantised weights, both layouts, from forward to
  // backward; each GEMM's quantised rows for its duration (the largest: dh, [N, 2f]).
  const bool fp8 = c.expert_dtype == "fp8";
  // The experts keep their input rows unless one rank's dispatch moved nothing and neither pass
  // is chunked (then backward gathers them again from x), or moe.keep_expert_rows asks (FP8
  // experts then still gather x in their quantiser: no rows to keep).
  const bool keeps_rows =
      ep > 1 || fwd_chunks > 1 || bwd_chunks > 1 || (c.keep_expert_rows && !fp8);
  const auto blocks = [](int64_t v) { return (v + 127) / 128; };
  const int64_t fp8_weights = fp8 ? local * (2 * d * 2 * f + 8 * blocks(d) * blocks(2 * f)) +
                                        local * (2 * f * d + 8 * blocks(f) * blocks(d))
                                  : 0;
  // Where the FP8 kernel does not run (f32 compute: the CPU), each GEMM dequantises its operands
  // into the compute dtype first.
  const int64_t fp8_dequantised =
      fp8 && dtype == DType::f32 ? recv * 2 * f * 4 + local * d * 2 * f * 4 : 0;
  const int64_t dh_q = fp8 ? recv * (2 * f + 4 * blocks(2 * f)) : 0;  // dh's FP8 rows
  // d_out's FP8 rows, written by the I-Order's backward where the rows do not move (MoELayer::
  // backward) and held through the experts' data-gradient GEMMs
  const bool dout_q_in_iorder = fp8 && ep == 1 && bwd_chunks == 1 && c.dispatch != "rbd";
  const int64_t dout_q = dout_q_in_iorder ? recv * (d + 4 * blocks(d)) : 0;
  const int64_t fp8_rows = dh_q + fp8_dequantised;
  ActivationBytes a;
  a.saved = x + gate_saved_bytes_for(c, tokens, rc.router) + layout + (recompute ? 0 : h) +
            (keeps_rows ? in_rows : 0) + out + shared_h + fp8_weights;
  // Chunks of the experts' [N, f] temporaries (Experts' auto rule: 4 where f > d and each chunk
  // keeps >= 2048 rows).
  const int64_t chunks =
      c.expert_chunks > 0 ? c.expert_chunks : (f > d && recv >= 4 * 2048 ? 4 : 1);
  const int64_t dx = tokens * d * 4;
  const int64_t shared_dx = sf > 0 ? tokens * d * cb : 0;
  // Backward, stage by stage, above what is still saved:
  const int64_t shared_phase = sf > 0 ? tokens * sf * cb + shared_dx : 0;
  const int64_t d_cw = n * 4;  // the combine weights' gradient
  // experts: one chunk's a or da, and with recompute the re-gathered rows and h; FP8: dh's
  // quantised rows, written chunk by chunk beside dh
  const int64_t expert_phase = shared_dx + d_cw + recv * f / chunks * cb + dh_q + dout_q +
                               (recompute ? h + (keeps_rows ? 0 : in_rows) : 0);
  // the gate/up weight gradient: the input rows in place of d_out; bf16 gradients of f32
  // activations go through an f32 [E_local, d, 2f] and its bf16 cast (ops
  // grouped_matmul_weight_grad)
  const int64_t grad_temp = c.expert_grad_dtype == "bf16" && dtype == DType::f32
                                ? 6 * (c.num_experts / ep) * d * 2 * f
                                : 0;
  // By then d_out (over out's storage where dispatch moved nothing) is gone, and the input rows
  // are the kept ones or gathered again for it.
  const bool out_gone = ep > 1 || (fwd_chunks == 1 && bwd_chunks == 1);
  const int64_t weight_phase = shared_dx + d_cw + grad_temp + (recompute ? h : 0) + dh_q -
                               (out_gone ? out : 0) + (keeps_rows ? 0 : in_rows);
  // dispatch back and order: d_rows [N, d] (and the received ones), dx [T, d]; h and out gone
  const int64_t freed = (recompute ? 0 : h) + out + (keeps_rows ? in_rows : 0);
  const int64_t order_phase =
      shared_dx + d_cw + out + (ep > 1 ? in_rows : 0) + dx + pairs * 4 - freed;
  // gate: its temporaries and dx beside the order's dx and the shared experts'
  const int64_t gate_phase =
      shared_dx + dx + pairs * 4 + gate_backward_bytes_for(c, tokens, rc.router) + dx - freed;
  // combine's backward (ep > 1): the rows arrive and are permuted to expert order beside the
  // incoming gradient (counted as out)
  const int64_t combine_phase = ep > 1 && bwd_chunks == 1 ? shared_dx + d_cw + 2 * in_rows : 0;
  // the pipelined backward's first chunk: the whole d_rows [N, d] made up front beside the
  // incoming gradient, and the chunk's rows (with ep > 1: two arrival buffers in flight and the
  // rows permuted to expert order), a falling share as the chunks grow
  const int64_t pipeline_phase =
      bwd_chunks > 1 ? shared_dx + d_cw + out + (ep > 1 ? 3 : 1) * in_rows / bwd_chunks +
                           recv / bwd_chunks * f / chunks * cb + (recompute ? h / bwd_chunks : 0)
                     : 0;
  // fp8: the gate/up data gradient, dh's quantised copy beside d_rows being made (dh itself,
  // h's storage, is gone unless a piecewise backward keeps it for its next piece)
  const bool dh_gone = !recompute && fwd_chunks == bwd_chunks;
  const int64_t fp8_phase =
      fp8 ? shared_dx + d_cw + fp8_rows + recv * d * cb - (dh_gone ? h : 0) : 0;
  a.backward_extra = std::max({shared_phase, combine_phase, expert_phase, weight_phase, order_phase,
                               gate_phase, pipeline_phase, fp8_phase});
  a.kept = weights_kept ? fp8_weights : 0;
  return a;
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
  const auto& world = groups_.world;
  if (gate_->routing_bias() != nullptr && world && world->size() > 1) {
    // On the world's device (an NCCL world moves CUDA tensors); i64, exact: the step's load.
    Tensor load = Tensor::from_vector(pending_load_, {static_cast<int64_t>(pending_load_.size())},
                                      world->device());
    world->all_reduce(load);
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
  const auto& world = groups_.world;
  if (world && world->size() > 1) {
    Tensor t =
        Tensor::from_vector(out.counts, {static_cast<int64_t>(out.counts.size())}, world->device());
    world->all_reduce(t);  // i64: exact
    out.counts = t.to_vector<int64_t>();
  }
  return out;
}

void MoELayer::reset_coactivation() {
  coactivation_ = CoactivationMatrix(cfg_.num_experts);
}

void MoELayer::permute_experts(const std::vector<int>& perm, std::span<const ExpertRider> riders) {
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
  permute_expert_state(*gate_, *experts_, perm, riders, groups_.ep.get());
  pending_load_ = permuted(pending_load_, perm);
  if (!load_.empty()) load_ = permuted(load_, perm);
  if (!tokens_per_expert_.empty()) tokens_per_expert_ = permuted(tokens_per_expert_, perm);
  coactivation_ = permuted(coactivation_, perm);
  // Frozen routing keeps choosing the same (moved) experts.
  if (last_topk_idx_.defined()) last_topk_idx_ = renumbered(last_topk_idx_, perm);
}

}  // namespace xmoe::moe
