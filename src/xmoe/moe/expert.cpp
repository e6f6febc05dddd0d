#include "xmoe/moe/expert.h"

#include <algorithm>

#include "xmoe/moe/moe_ops.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

namespace {

class SwigluExperts final : public Experts {
 public:
  explicit SwigluExperts(const ExpertArgs& a) : recompute_(a.recompute) {
    XMOE_CHECK(a.num_local >= 0 && a.first_expert >= 0 &&
                   a.first_expert + a.num_local <= a.num_experts,
               "[moe experts] local experts [{}, {}) outside [0, {})", a.first_expert,
               a.first_expert + a.num_local, a.num_experts);
    XMOE_CHECK(a.hidden >= 1, "[moe] moe.expert_hidden = {} must be >= 1", a.hidden);
    gate_up_ = Parameter::make(a.prefix + ".experts.gate_up", {a.num_local, a.d_model, 2 * a.hidden},
                               ParamKind::expert, true, a.grad_dtype);
    down_ = Parameter::make(a.prefix + ".experts.down", {a.num_local, a.hidden, a.d_model},
                            ParamKind::expert, true, a.grad_dtype);
    for (Parameter* p : {&gate_up_, &down_}) {
      p->global_rows = a.num_experts;
      p->row_offset = a.first_expert;
      p->lazy_zero_grad = true;  // backward writes every group (empty ones get zeros)
    }
    gate_up_.init_normal(a.seed, a.init_std);
    down_.init_normal(a.seed, a.down_std);
  }

  std::string_view name() const override { return "swiglu"; }

  Tensor forward(const Tensor& rows, std::span<const int64_t> group_sizes) override {
    groups_.assign(group_sizes.begin(), group_sizes.end());
    rows_ = rows;                                                                   // [N, d]
    // bf16 rows (CUDA): the bf16 compute copies of the f32 master weights (a cast per forward
    // where there are none), kept for backward; the weight gradients are f32 or bf16.
    wgu_ = as_dtype(gate_up_.compute(), rows.dtype());
    wd_ = as_dtype(down_.compute(), rows.dtype());
    Tensor h = xmoe::ops::grouped_matmul(rows, wgu_, groups_);                       // [N, 2f]
    Tensor out = xmoe::ops::grouped_matmul(xmoe::ops::swiglu(h), wd_, groups_);      // [N, d]
    h_ = recompute_ ? Tensor() : h;
    return out;
  }

  Tensor backward(Tensor d_out) override {
    XMOE_CHECK(rows_.defined(), "[moe experts] backward without a forward");
    check_shape(d_out, {rows_.size(0), down_.value.size(2)}, "moe experts backward", "d_out");
    Tensor dout = as_dtype(d_out, rows_.dtype());
    d_out = Tensor();
    // At most two of h [N, 2f], a and da [N, f] live at a time: a goes before da comes, and
    // h becomes dh in place. d_out and the saved rows go as soon as they are used.
    Tensor dh = h_.defined() ? h_ : xmoe::ops::grouped_matmul(rows_, wgu_, groups_);  // h
    h_ = Tensor();
    Tensor a = xmoe::ops::swiglu(dh);                                                // [N, f]
    xmoe::ops::grouped_matmul_weight_grad(down_.grad, a, dout, groups_,
                                          !down_.take_grad_overwrite());
    a = Tensor();
    Tensor da = xmoe::ops::grouped_matmul(dout, wd_, groups_, true);                  // [N, f]
    dout = Tensor();
    xmoe::ops::swiglu_backward_(dh, da);                                             // [N, 2f]
    da = Tensor();
    xmoe::ops::grouped_matmul_weight_grad(gate_up_.grad, rows_, dh, groups_,
                                          !gate_up_.take_grad_overwrite());
    rows_ = Tensor();  // so d_rows [N, d] takes its place rather than adding to it
    return xmoe::ops::grouped_matmul(dh, wgu_, groups_, true);                        // [N, d]
  }

  WeightedGrads backward_weighted(Tensor g_in, const Tensor& w) override {
    XMOE_CHECK(rows_.defined(), "[moe experts] backward without a forward");
    check_shape(g_in, {rows_.size(0), down_.value.size(2)}, "moe experts backward", "g");
    check_shape(w, {rows_.size(0)}, "moe experts backward", "w");
    Tensor g = as_dtype(g_in, rows_.dtype());
    g_in = Tensor();
    // out = a Wd and d_out = w * g, so dWd = (w * a)^T g, da = w * (g Wd^T) and
    // d_w = g . out = (g Wd^T) . a: a is made twice from h rather than kept next to da.
    Tensor dh = h_.defined() ? h_ : xmoe::ops::grouped_matmul(rows_, wgu_, groups_);  // h
    h_ = Tensor();
    Tensor a = xmoe::ops::swiglu(dh);                                                // [N, f]
    scale_rows_(a, w);
    xmoe::ops::grouped_matmul_weight_grad(down_.grad, a, g, groups_,
                                          !down_.take_grad_overwrite());
    a = Tensor();
    Tensor da = xmoe::ops::grouped_matmul(g, wd_, groups_, true);                     // [N, f]
    g = Tensor();
    WeightedGrads r;
    r.d_weights = row_dot_f32(da, xmoe::ops::swiglu(dh));
    scale_rows_(da, w);
    xmoe::ops::swiglu_backward_(dh, da);                                             // [N, 2f]
    da = Tensor();
    xmoe::ops::grouped_matmul_weight_grad(gate_up_.grad, rows_, dh, groups_,
                                          !gate_up_.take_grad_overwrite());
    rows_ = Tensor();
    r.d_rows = xmoe::ops::grouped_matmul(dh, wgu_, groups_, true);                    // [N, d]
    return r;
  }

  // Peaks in units of N elements: backward with the I-Order stage keeping out holds
  // max(3d + 2f, 2d + 3f) (rows, h, out, d_rows; then rows, h, d_out, a or da),
  // backward_weighted max(2d + 3f, d + 4f) (rows, h, g, w * a or da; then rows, h, da, a).
  bool folding_weights_saves_memory() const override {
    const int64_t d = gate_up_.value.size(1), f = down_.value.size(1);
    return std::max(2 * d + 3 * f, d + 4 * f) < std::max(3 * d + 2 * f, 2 * d + 3 * f);
  }

  void release() override { rows_ = h_ = wgu_ = wd_ = Tensor(); }
  void forget_input() override { rows_ = Tensor(); }
  void restore_input(Tensor rows) override {
    int64_t n = 0;
    for (int64_t g : groups_) n += g;
    check_shape(rows, {n, gate_up_.value.size(1)}, "moe experts restore_input", "rows");
    rows_ = std::move(rows);
  }
  void set_recompute(bool on) override { recompute_ = on; }
  void collect_parameters(std::vector<Parameter*>& out) override {
    out.push_back(&gate_up_);
    out.push_back(&down_);
  }

 private:
  bool recompute_;
  Parameter gate_up_, down_;
  std::vector<int64_t> groups_;
  Tensor rows_, h_;
  Tensor wgu_, wd_;  // the weights in the rows' dtype (the parameters themselves when f32)
};

}  // namespace

Experts::WeightedGrads Experts::backward_weighted(Tensor, const Tensor&) {
  XMOE_FAIL("[moe experts] '{}' experts cannot fold the combine weights into backward", name());
}

ExpertRegistry& expert_registry() {
  static ExpertRegistry registry = [] {
    ExpertRegistry r("expert");
    r.add("swiglu", [](const ExpertArgs& a) -> std::unique_ptr<Experts> {
      return std::make_unique<SwigluExperts>(a);
    });
    return r;
  }();
  return registry;
}

std::unique_ptr<Experts> make_experts(const std::string& name, const ExpertArgs& args) {
  return expert_registry().create(name, args);
}

}  // namespace xmoe::moe
