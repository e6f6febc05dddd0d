// xmoe (Chi et al. 2022, "On the Representation Collapse of Sparse Mixture of Experts"):
//   z = x @ Wp                       Wp "<prefix>.router.weight" [d, router_dim]
//   logits = cos(z, e_j) / tau       e  "<prefix>.router.expert_embeddings" [router_dim, E]
//                                    tau "<prefix>.router.temperature" [1], learned, >= 0.01
// then softmax over E and top-k (renormalised per moe.renormalize). Both z and the expert
// embeddings are L2-normalised, so routing depends on directions in a small space.
#include "xmoe/moe/gates/gates.h"
#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

namespace {

constexpr float kMinTemperature = 0.01f;

class XmoeGate final : public Gate {
 public:
  explicit XmoeGate(const GateArgs& a)
      : Gate(a),
        routing_({cfg_.top_k,
                  true,
                  cfg_.renormalize,
                  {cfg_.aux_loss_weight, cfg_.seq_aux_loss_weight, cfg_.z_loss_weight}}) {
    XMOE_CHECK(cfg_.router_dtype == "f32",
               "[moe] moe.router_dtype = \"{}\" applies to the linear routers; the xmoe cosine "
               "router runs in f32",
               cfg_.router_dtype);
    XMOE_CHECK(cfg_.router_dim >= 1, "[moe] moe.router_dim = {} must be >= 1", cfg_.router_dim);
    XMOE_CHECK(cfg_.router_temperature > 0.f, "[moe] moe.router_temperature = {} must be > 0",
               cfg_.router_temperature);
    const int64_t r = cfg_.router_dim;
    proj_ = Parameter::make(prefix_ + ".router.weight", {d_model_, r});
    proj_.reads_f32 = true;  // the cosine router runs in f32
    proj_.init_normal(a.seed, a.init_std);
    emb_ = Parameter::make(prefix_ + ".router.expert_embeddings", {r, num_experts_});
    emb_.reads_f32 = true;
    emb_.init_normal(a.seed, a.init_std);
    temp_ = Parameter::make(prefix_ + ".router.temperature", {1}, ParamKind::dense, false);
    temp_.init_constant(cfg_.router_temperature);
  }

  GateOutput forward(const Tensor& x, int64_t seq_len, const Tensor& fixed_idx) override {
    check_forward_args(x, seq_len, fixed_idx);
    x_ = x;  // bf16 activations are cast again in backward: no f32 copy kept
    GateOutput out = routing_.forward(route_logits(), seq_len, fixed_idx, world_.get());
    if (recompute_) {  // z, |z| [T], cos [T, E], logits and probs [T, E]
      zn_ = {};
      cos_ = Tensor();
      routing_.drop_routing_tensors();
    }
    return out;
  }

  Tensor backward(const Tensor& d_topk_weight) override {
    XMOE_CHECK(x_.defined(), "[moe gate xmoe] backward without a forward");
    if (!routing_.has_routing_tensors()) routing_.restore(route_logits());  // router recompute
    Tensor dlogits = routing_.backward(d_topk_weight, aux_grad_scale_,
                                       aux_grad_device_scale_);  // [T, E]
    // logits = cos / tau: d tau = -sum(dlogits * cos) / tau^2 (zero while clamped).
    xmoe::ops::moe_temperature_grad(temp_.grad, dlogits, cos_, temp_.weights_f32(),
                                    kMinTemperature);
    Tensor dcos = xmoe::ops::moe_div_temperature(dlogits, temp_.weights_f32(), kMinTemperature);
    Tensor dzn = xmoe::ops::matmul(dcos, en_.y);               // [T, r]
    Tensor den = xmoe::ops::matmul(dcos, zn_.y, true, false);  // [E, r]
    Tensor demb = xmoe::ops::transpose(
        xmoe::ops::l2_normalize_rows_backward(en_.y, en_.norm, den));  // [r, E]
    xmoe::ops::add_(emb_.grad, demb);
    Tensor dz = xmoe::ops::l2_normalize_rows_backward(zn_.y, zn_.norm, dzn);  // [T, r]
    xmoe::ops::matmul_into(proj_.grad, xmoe::ops::as_dtype(x_, DType::f32), dz, true, false, 1.f,
                           1.f);
    return xmoe::ops::matmul(dz, proj_.weights_f32(), false, true);
  }

  void collect_parameters(std::vector<Parameter*>& out) override {
    out.push_back(&proj_);
    out.push_back(&emb_);
    out.push_back(&temp_);
  }
  std::string_view name() const override { return "xmoe"; }
  void release() override {
    x_ = cos_ = Tensor();
    zn_ = en_ = {};
    routing_.release();
  }

 private:
  /// logits [T, E] of x_, keeping z, e (normalised) and cos for backward.
  Tensor route_logits() {
    zn_ = xmoe::ops::l2_normalize_rows(
        xmoe::ops::matmul(xmoe::ops::as_dtype(x_, DType::f32), proj_.weights_f32()));  // [T, r]
    en_ = xmoe::ops::l2_normalize_rows(xmoe::ops::transpose(emb_.weights_f32()));      // [E, r]
    cos_ = xmoe::ops::matmul(zn_.y, en_.y, false, true);                               // [T, E]
    // On CUDA the temperature is read on the device: no wait for its value.
    return xmoe::ops::moe_div_temperature(cos_, temp_.weights_f32(), kMinTemperature);
  }

  SoftmaxRouting routing_;
  Parameter proj_, emb_, temp_;
  Tensor x_, cos_;
  xmoe::ops::L2NormResult zn_, en_;
};

}  // namespace

std::unique_ptr<Gate> make_xmoe_gate(const GateArgs& a) {
  return std::make_unique<XmoeGate>(a);
}

}  // namespace xmoe::moe
