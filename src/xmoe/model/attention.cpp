#include "xmoe/model/attention.h"

#include "xmoe/core/profile.h"
#include "xmoe/ops/ops.h"
#include "xmoe/parallel/tensor_parallel.h"

namespace xmoe::model {

namespace {

int tp_size(const std::shared_ptr<comm::Group>& tp) {
  return tp ? tp->size() : 1;
}

/// This rank's heads of `shape` over `tp` (which must divide the kv heads).
AttentionShape local_heads(const std::string& prefix, AttentionShape shape,
                           const std::shared_ptr<comm::Group>& tp) {
  const int p = tp_size(tp);
  XMOE_CHECK(shape.num_kv_heads > 0 && shape.num_heads % shape.num_kv_heads == 0,
             "[attention] {}: num_heads = {} is not a multiple of num_kv_heads = {}", prefix,
             shape.num_heads, shape.num_kv_heads);
  XMOE_CHECK(shape.num_kv_heads % p == 0,
             "[attention] {}: parallel.tp = {} does not divide model.num_kv_heads = {}", prefix, p,
             shape.num_kv_heads);
  shape.num_heads /= p;
  shape.num_kv_heads /= p;
  return shape;
}

/// [d, heads·hd] split by columns (heads) over tp.
Parameter column_split(std::string name, int64_t d, int64_t local_cols,
                       const std::shared_ptr<comm::Group>& tp) {
  const int64_t p = tp_size(tp);
  return parallel::make_split_parameter(std::move(name), {d, local_cols * p}, {d, local_cols}, {},
                                        1, tp.get());
}

}  // namespace

Attention::Attention(std::string prefix, AttentionShape shape,
                     std::shared_ptr<const ops::RopeTables> rope, uint64_t seed, float init_std,
                     float out_std, std::shared_ptr<comm::Group> tp)
    : shape_(local_heads(prefix, shape, tp)),
      tp_(std::move(tp)),
      rope_(std::move(rope)),
      wq_(column_split(prefix + ".wq", shape.d_model, shape_.num_heads * shape.head_dim, tp_)),
      wk_(column_split(prefix + ".wk", shape.d_model, shape_.num_kv_heads * shape.head_dim, tp_)),
      wv_(column_split(prefix + ".wv", shape.d_model, shape_.num_kv_heads * shape.head_dim, tp_)),
      wo_(parallel::make_split_parameter(
          prefix + ".wo", {shape.num_heads * shape.head_dim, shape.d_model},
          {shape_.num_heads * shape.head_dim, shape.d_model}, {}, 0, tp_.get())) {
  XMOE_CHECK(rope_ && rope_->head_dim == shape.head_dim,
             "[attention] {}: RoPE tables do not match head_dim {}", prefix, shape.head_dim);
  wq_.init_normal(seed, init_std);
  wk_.init_normal(seed, init_std);
  wv_.init_normal(seed, init_std);
  wo_.init_normal(seed, out_std);
}

void Attention::project() {
  const int64_t h = shape_.num_heads, hkv = shape_.num_kv_heads, hd = shape_.head_dim;
  q_ = ops::matmul(x_, wq_.compute()).reshape({batch_, seq_, h, hd});
  k_ = ops::matmul(x_, wk_.compute()).reshape({batch_, seq_, hkv, hd});
  v_ = ops::matmul(x_, wv_.compute()).reshape({batch_, seq_, hkv, hd});
  ops::rope_(q_, *rope_);
  ops::rope_(k_, *rope_);
}

void Attention::attend() {
  auto r = ops::attention(q_, k_, v_, /*causal=*/true);
  a_ = r.out;
  lse_ = r.lse;
}

Tensor Attention::forward(const Tensor& x, int64_t batch, int64_t seq_len) {
  check_shape(x, {batch * seq_len, shape_.d_model}, "attention", "x");
  ProfileScope scope("block.attention.fwd", x.device());
  batch_ = batch * tp_size(tp_);
  seq_ = seq_len;
  x_ = parallel::gather_rows(tp_.get(), x);
  project();
  attend();
  // f32 out: the output joins the residual stream (docs/cuda.md).
  Tensor y = ops::matmul_f32(a_.reshape({batch_ * seq_len, -1}), wo_.compute());
  if (recompute_ != AttentionRecompute::none) a_ = lse_ = Tensor();
  if (recompute_ == AttentionRecompute::all) q_ = k_ = v_ = Tensor();
  return parallel::scatter_sum_rows(tp_.get(), y);
}

Tensor Attention::backward(const Tensor& dy_in) {
  XMOE_CHECK(x_.defined(), "[attention] {}: backward without a forward", wq_.name);
  ProfileScope scope("block.attention.bwd", dy_in.device());
  // Recompute: the same ops on the same inputs give the same bits.
  if (!q_.defined()) project();
  if (!a_.defined()) attend();
  const int64_t t = batch_ * seq_;
  check_shape(dy_in, {t / tp_size(tp_), shape_.d_model}, "attention_backward", "dy");
  const Tensor dy = parallel::gather_rows(tp_.get(), dy_in);
  const Tensor a2 = a_.reshape({t, -1});
  ops::matmul_into(wo_.grad, a2, dy, /*trans_a=*/true, false, 1.f, 1.f);
  Tensor da = ops::matmul(dy, wo_.compute(), false, /*trans_b=*/true).reshape(a_.shape());
  auto g = ops::attention_backward(q_, k_, v_, a_, lse_, da, /*causal=*/true);
  ops::rope_backward_(g.dq, *rope_);
  ops::rope_backward_(g.dk, *rope_);
  const Tensor dq = g.dq.reshape({t, -1}), dk = g.dk.reshape({t, -1}), dv = g.dv.reshape({t, -1});
  ops::matmul_into(wq_.grad, x_, dq, true, false, 1.f, 1.f);
  ops::matmul_into(wk_.grad, x_, dk, true, false, 1.f, 1.f);
  ops::matmul_into(wv_.grad, x_, dv, true, false, 1.f, 1.f);
  Tensor dx = ops::matmul_f32(dq, wq_.compute(), false, true);  // f32: the residual's gradient
  ops::matmul_into(dx, dk, wk_.compute(), false, true, 1.f, 1.f);
  ops::matmul_into(dx, dv, wv_.compute(), false, true, 1.f, 1.f);
  release();
  return parallel::scatter_sum_rows(tp_.get(), dx);
}

int64_t Attention::saved_bytes() const {
  return held_bytes(x_) + held_bytes(q_) + held_bytes(k_) + held_bytes(v_) + held_bytes(a_) +
         held_bytes(lse_);
}

ActivationBytes Attention::activation_bytes_for(const AttentionShape& s, int64_t batch,
                                                int64_t seq_len, DType dtype,
                                                AttentionRecompute recompute, int tp,
                                                int64_t workspace) {
  const auto c = static_cast<int64_t>(dtype_size(dtype));
  const int64_t t = batch * seq_len, heads = s.num_heads / tp, kv_heads = s.num_kv_heads / tp;
  const int64_t q = t * heads * s.head_dim * c, kv = t * kv_heads * s.head_dim * c;
  const int64_t inner = 2 * q + 2 * kv + batch * heads * seq_len * 4;  // q, a, k, v, lse
  const int64_t kept = recompute == AttentionRecompute::none   ? inner
                       : recompute == AttentionRecompute::core ? q + 2 * kv  // a and lse dropped
                                                               : 0;
  const int64_t x = t * s.d_model * c;  // with tp: the gathered x
  // tp: backward gathers dy [T, d]; its reduce-scattered dx [T/tp, d] comes after release().
  const int64_t gathered_dy = tp > 1 ? x : 0;
  return {x + kept, inner - kept + gathered_dy + 2 * q + 2 * kv + workspace + t * s.d_model * 4};
}

void Attention::collect_parameters(std::vector<Parameter*>& out) {
  out.push_back(&wq_);
  out.push_back(&wk_);
  out.push_back(&wv_);
  out.push_back(&wo_);
}

}  // namespace xmoe::model
