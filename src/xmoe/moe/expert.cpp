#include "xmoe/moe/expert.h"

#include <algorithm>

#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

namespace {

class SwigluExperts final : public Experts {
 public:
  explicit SwigluExperts(const ExpertArgs& a) : recompute_(a.recompute), chunks_(a.chunks) {
    XMOE_CHECK(a.chunks >= 0, "[moe] moe.expert_chunks = {} must be >= 0", a.chunks);
    XMOE_CHECK(
        a.num_local >= 0 && a.first_expert >= 0 && a.first_expert + a.num_local <= a.num_experts,
        "[moe experts] local experts [{}, {}) outside [0, {})", a.first_expert,
        a.first_expert + a.num_local, a.num_experts);
    XMOE_CHECK(a.hidden >= 1, "[moe] moe.expert_hidden = {} must be >= 1", a.hidden);
    gate_up_ =
        Parameter::make(a.prefix + ".experts.gate_up", {a.num_local, a.d_model, 2 * a.hidden},
                        ParamKind::expert, true, a.grad_dtype);
    down_ = Parameter::make(a.prefix + ".experts.down", {a.num_local, a.hidden, a.d_model},
                            ParamKind::expert, true, a.grad_dtype);
    for (Parameter* p : {&gate_up_, &down_}) {
      p->shard.whole = p->value.shape();
      p->shard.whole[0] = a.num_experts;
      p->shard.offset = a.first_expert;
      p->lazy_zero_grad = true;  // backward writes every group (empty ones get zeros)
    }
    gate_up_.init_normal(a.seed, a.init_std);
    down_.init_normal(a.seed, a.down_std);
  }

  std::string_view name() const override { return "swiglu"; }

  Tensor forward(Tensor rows, std::span<const int64_t> group_sizes) override {
    groups_.assign(group_sizes.begin(), group_sizes.end());
    num_rows_ = rows.size(0);  // [N, d]
    // bf16 rows (CUDA): the bf16 compute copies of the f32 master weights (a cast per forward
    // where there are none), kept for backward; the weight gradients are f32 or bf16.
    wgu_ = xmoe::ops::as_dtype(gate_up_.compute(), rows.dtype());
    wd_ = xmoe::ops::as_dtype(down_.compute(), rows.dtype());
    Tensor h = xmoe::ops::grouped_matmul(rows, wgu_, groups_);  // [N, 2f]
    rows_ = regather_ ? Tensor() : rows;
    rows = Tensor();  // gone here if the caller moved it in and backward can regather it
    Tensor out = Tensor::empty({num_rows_, wd_.size(2)}, h.dtype(), h.device());
    for (const Chunk& c : chunks()) {  // a [n_c, f] lives for one chunk only
      Tensor out_c = out.rows(c.row_begin, c.row_end);
      xmoe::ops::grouped_matmul_into(out_c, xmoe::ops::swiglu(h.rows(c.row_begin, c.row_end)),
                                     wd_.rows(c.group_begin, c.group_end), c.sizes(groups_));
    }
    h_ = recompute_ ? Tensor() : h;
    return out;
  }

  Tensor backward(Tensor d_out) override {
    XMOE_CHECK(rows_.defined() || regather_, "[moe experts] backward without a forward");
    check_shape(d_out, {num_rows_, down_.value.size(2)}, "moe experts backward", "d_out");
    Tensor dout = xmoe::ops::as_dtype(d_out, wgu_.dtype());  // the rows' dtype
    d_out = Tensor();
    // h [N, 2f] becomes dh in place, chunk by chunk: a and da [n_c, f] live for one chunk, one
    // at a time. d_out and the saved rows go as soon as they are used.
    if (!h_.defined() && !rows_.defined()) rows_ = input_rows();  // recompute: needed twice
    Tensor dh = h_.defined() ? h_ : xmoe::ops::grouped_matmul(rows_, wgu_, groups_);  // h
    h_ = Tensor();
    const bool accumulate_down = !down_.take_grad_overwrite();
    for (const Chunk& c : chunks()) {
      const std::span<const int64_t> sizes = c.sizes(groups_);
      Tensor h_c = dh.rows(c.row_begin, c.row_end), dout_c = dout.rows(c.row_begin, c.row_end);
      Tensor dwd_c = down_.grad.rows(c.group_begin, c.group_end);
      xmoe::ops::grouped_matmul_weight_grad(dwd_c, xmoe::ops::swiglu(h_c), dout_c, sizes,
                                            accumulate_down);
      Tensor da = xmoe::ops::grouped_matmul(dout_c, wd_.rows(c.group_begin, c.group_end), sizes,
                                            true);  // [n_c, f]
      xmoe::ops::swiglu_backward_(h_c, da);         // [n_c, 2f]
    }
    dout = Tensor();
    xmoe::ops::grouped_matmul_weight_grad(gate_up_.grad, input_rows(), dh, groups_,
                                          !gate_up_.take_grad_overwrite());
    rows_ = Tensor();  // so d_rows [N, d] takes its place rather than adding to it
    regather_ = nullptr;
    return xmoe::ops::grouped_matmul(dh, wgu_, groups_, true);  // [N, d]
  }

  // Peaks in units of N elements, C chunks: forward holds rows, h, out and one chunk's a,
  // 2d + 2f + f / C; backward the same with d_out for out and a or da (unchunked: 2d + 3f).

  void release() override {
    rows_ = h_ = wgu_ = wd_ = Tensor();
    regather_ = nullptr;
  }
  void set_chunks(int chunks) override {
    XMOE_CHECK(chunks >= 0, "[moe] moe.expert_chunks = {} must be >= 0", chunks);
    chunks_ = chunks;
  }
  void set_input_regather(std::function<Tensor()> regather) override {
    regather_ = std::move(regather);
  }
  void set_recompute(bool on) override { recompute_ = on; }
  void collect_parameters(std::vector<Parameter*>& out) override {
    out.push_back(&gate_up_);
    out.push_back(&down_);
  }

 private:
  /// Consecutive groups whose SwiGLU output a and its gradient da [n_c, f] are made one chunk at
  /// a time (forward and backward), so the layer never holds them for all N rows.
  struct Chunk {
    int64_t group_begin, group_end, row_begin, row_end;
    std::span<const int64_t> sizes(const std::vector<int64_t>& groups) const {
      return {groups.data() + group_begin, groups.data() + group_end};
    }
  };
  // Auto (moe.expert_chunks = 0): 4 chunks where f > d, whose [N, f] temporaries are then the
  // largest thing the layer makes, and only while each keeps >= kMinAutoChunkRows rows (the
  // grouped GEMMs stay full); otherwise one. Cuts fall between groups, each chunk with about
  // N / C rows.
  static constexpr int kAutoChunks = 4;
  static constexpr int64_t kMinAutoChunkRows = 2048;
  std::vector<Chunk> chunks() const {
    const int64_t num_groups = static_cast<int64_t>(groups_.size());
    int64_t n = 0;
    for (int64_t g : groups_) n += g;
    int64_t want = chunks_;
    if (want == 0) {
      const bool wide = down_.value.size(1) > gate_up_.value.size(1);
      want = wide && n >= kAutoChunks * kMinAutoChunkRows ? kAutoChunks : 1;
    }
    std::vector<Chunk> out;
    Chunk c{0, 0, 0, 0};
    for (int64_t g = 0; g < num_groups; ++g) {
      c.group_end = g + 1;
      c.row_end += groups_[static_cast<size_t>(g)];
      const auto closed = static_cast<int64_t>(out.size()) + 1;
      // Close at the first group boundary at or past closed / want of the rows.
      if (closed < want && c.row_end * want >= closed * n && c.row_end > c.row_begin &&
          g + 1 < num_groups) {
        out.push_back(c);
        c = Chunk{g + 1, g + 1, c.row_end, c.row_end};
      }
    }
    out.push_back(c);
    return out;
  }

  /// The saved rows, or (forget_input) the layer's gather of them, made now.
  Tensor input_rows() const {
    if (rows_.defined()) return rows_;
    Tensor rows = regather_();
    check_shape(rows, {num_rows_, gate_up_.value.size(1)}, "moe experts", "re-gathered rows");
    return rows;
  }

  bool recompute_;
  int chunks_;                        // moe.expert_chunks (0: auto)
  std::function<Tensor()> regather_;  // set_input_regather
  Parameter gate_up_, down_;
  std::vector<int64_t> groups_;
  int64_t num_rows_ = 0;
  Tensor rows_, h_;
  Tensor wgu_, wd_;  // the weights in the rows' dtype (the parameters themselves when f32)
};

}  // namespace

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
