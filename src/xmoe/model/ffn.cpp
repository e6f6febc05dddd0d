#include "xmoe/model/ffn.h"

#include "xmoe/core/profile.h"
#include "xmoe/ops/ops.h"
#include "xmoe/parallel/tensor_parallel.h"

namespace xmoe::model {

namespace {
int64_t local_hidden(const std::string& prefix, int64_t hidden, const comm::Group* tp) {
  const int p = tp ? tp->size() : 1;
  XMOE_CHECK(hidden % p == 0, "[dense_ffn] {}: parallel.tp = {} does not divide the hidden size {}",
             prefix, p, hidden);
  return hidden / p;
}
}  // namespace

DenseFFN::DenseFFN(std::string prefix, int64_t d_model, int64_t hidden, uint64_t seed,
                   float init_std, float out_std, std::shared_ptr<comm::Group> tp)
    : tp_(std::move(tp)),
      // gate_up [d, 2h] seen as [d, 2, h] (gate | up): split along the hidden units.
      gate_up_(
          parallel::make_split_parameter(prefix + ".gate_up", {d_model, 2 * hidden},
                                         {d_model, 2 * local_hidden(prefix, hidden, tp_.get())},
                                         {d_model, 2, hidden}, 2, tp_.get())),
      down_(parallel::make_split_parameter(prefix + ".down", {hidden, d_model},
                                           {local_hidden(prefix, hidden, tp_.get()), d_model}, {},
                                           0, tp_.get())) {
  gate_up_.init_normal(seed, init_std);
  down_.init_normal(seed, out_std);
}

Tensor DenseFFN::forward(const Tensor& x, int64_t /*seq_len*/) {
  check_shape(x, {-1, gate_up_.value.size(0)}, "dense_ffn", "x");
  ProfileScope scope("block.ffn.fwd", x.device());
  x_ = parallel::gather_rows(tp_.get(), x);
  Tensor h = ops::matmul(x_, gate_up_.compute());               // [T, 2h]
  Tensor y = ops::matmul_f32(ops::swiglu(h), down_.compute());  // f32: joins the residual stream
  if (!recompute_) h_ = h;
  return parallel::scatter_sum_rows(tp_.get(), y);
}

Tensor DenseFFN::backward(const Tensor& dy_in) {
  XMOE_CHECK(x_.defined(), "[dense_ffn] {}: backward without a forward", gate_up_.name);
  ProfileScope scope("block.ffn.bwd", dy_in.device());
  const Tensor dy = parallel::gather_rows(tp_.get(), dy_in);
  Tensor dh = h_.defined() ? h_ : ops::matmul(x_, gate_up_.compute());  // h, becomes dh below
  h_ = Tensor();
  Tensor a = ops::matmul(dy, down_.compute(), false, /*trans_b=*/true);  // da, then a
  ops::swiglu_backward_with_value_(dh, a);  // in place: h becomes dh, da becomes swiglu(h)
  ops::matmul_into(down_.grad, a, dy, /*trans_a=*/true, false, 1.f, 1.f);
  a = Tensor();
  ops::matmul_into(gate_up_.grad, x_, dh, true, false, 1.f, 1.f);
  Tensor dx = ops::matmul_f32(dh, gate_up_.compute(), false, true);
  x_ = Tensor();
  return parallel::scatter_sum_rows(tp_.get(), dx);
}

ActivationBytes DenseFFN::activation_bytes_for(int64_t tokens, int64_t d_model, int64_t hidden,
                                               DType dtype, bool recompute, int tp) {
  const auto c = static_cast<int64_t>(dtype_size(dtype));
  const int64_t local = hidden / tp;
  const int64_t x = tokens * d_model * c, h = tokens * 2 * local * c;
  // tp: the gathered dy [T, d]; x is freed before dx [T, d] is reduce-scattered.
  const int64_t gathered_dy = tp > 1 ? x : 0;
  return {x + (recompute ? 0 : h),
          (recompute ? h : 0) + gathered_dy + tokens * local * c + tokens * d_model * 4};
}

void DenseFFN::collect_parameters(std::vector<Parameter*>& out) {
  out.push_back(&gate_up_);
  out.push_back(&down_);
}

}  // namespace xmoe::model
