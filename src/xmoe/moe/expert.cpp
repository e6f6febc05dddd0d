#include "xmoe/moe/expert.h"

#include <algorithm>

#include "xmoe/ops/fp8.h"
#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

namespace {

class SwigluExperts final : public Experts {
 public:
  explicit SwigluExperts(const ExpertArgs& a)
      : recompute_(a.recompute), fp8_(a.fp8), chunks_(a.chunks) {
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
    start_forward(group_sizes);
    return forward_part_({std::move(rows)}, 0, num_groups());
  }

  Tensor forward_gathered(const Tensor& x, const Tensor& index,
                          std::span<const int64_t> group_sizes) override {
    XMOE_CHECK(regather_, "[moe experts] forward_gathered without an input regather");
    start_forward(group_sizes);
    if (!fp8_) return forward_part_({xmoe::ops::gather_rows(x, index)}, 0, num_groups());
    return forward_part_({Tensor(), x, index}, 0, num_groups());
  }
  bool fuses_gather() const override { return fp8_; }

  Tensor backward(Tensor d_out) override {
    XMOE_CHECK(!parts_.empty(), "[moe experts] backward without a forward");
    return backward_part(std::move(d_out), 0, static_cast<int64_t>(groups_.size()));
  }
  bool reads_fp8_output_grad() const override { return fp8_; }
  Tensor backward(Tensor d_out, xmoe::ops::Fp8Rows d_out_fp8) override {
    XMOE_CHECK(d_out_fp8.group_sizes == groups_,
               "[moe experts] d_out's FP8 rows are not in the forward's {} groups", groups_.size());
    check_shape(d_out_fp8.data, d_out.shape(), "moe experts backward", "d_out_fp8.data");
    // Rows of another dtype would be quantised after their cast to the rows' dtype.
    if (fp8_ && d_out.dtype() == rows_dtype_) dout_fp8_ = std::move(d_out_fp8);
    Tensor d_rows = backward(std::move(d_out));
    dout_fp8_ = {};
    return d_rows;
  }

  void begin_forward(std::span<const int64_t> group_sizes) override {
    XMOE_CHECK(static_cast<int64_t>(group_sizes.size()) == gate_up_.value.size(0),
               "[moe experts] {} group sizes for {} local experts", group_sizes.size(),
               gate_up_.value.size(0));
    regather_ = nullptr;  // a part holds its own rows
    start_forward(group_sizes);
  }

  Tensor forward_part(Tensor rows, int64_t group_begin, int64_t group_end) override {
    XMOE_CHECK(0 <= group_begin && group_begin < group_end &&
                   group_end <= static_cast<int64_t>(groups_.size()),
               "[moe experts] part of groups [{}, {}) outside the forward's {} groups", group_begin,
               group_end, groups_.size());
    for (const Part& p : parts_)
      XMOE_CHECK(p.group_end <= group_begin || group_end <= p.group_begin,
                 "[moe experts] part of groups [{}, {}) overlaps the part [{}, {})", group_begin,
                 group_end, p.group_begin, p.group_end);
    return forward_part_({std::move(rows)}, group_begin, group_end);
  }

  Tensor backward_part(Tensor d_out, int64_t group_begin, int64_t group_end) override {
    const int64_t row_begin = group_row_.at(group_begin), row_end = group_row_.at(group_end);
    check_shape(d_out, {row_end - row_begin, down_.value.size(2)}, "moe experts backward", "d_out");
    // The saved parts that hold these groups, each covering [g0, g1) of them.
    std::vector<Part*> holders;
    int64_t covered = group_begin;
    for (Part& p : parts_)
      if (p.group_begin < group_end && group_begin < p.group_end) holders.push_back(&p);
    std::sort(holders.begin(), holders.end(),
              [](const Part* a, const Part* b) { return a->group_begin < b->group_begin; });
    for (const Part* p : holders) {
      XMOE_CHECK(p->group_begin <= covered && (p->rows.defined() || p->h.defined() || regather_),
                 "[moe experts] backward of groups [{}, {}) without their forward", group_begin,
                 group_end);
      covered = p->group_end;
    }
    XMOE_CHECK(!holders.empty() && covered >= group_end,
               "[moe experts] backward of groups [{}, {}) without their forward", group_begin,
               group_end);
    if (!backward_started_) {  // the first part of this backward: overwrite or accumulate
      accumulate_down_ = !down_.take_grad_overwrite();
      accumulate_gate_up_ = !gate_up_.take_grad_overwrite();
      backward_started_ = true;
    }
    Tensor dout = xmoe::ops::as_dtype(d_out, rows_dtype_);
    d_out = Tensor();
    Tensor d_rows;
    if (holders.size() == 1 && holders[0]->group_begin == group_begin &&
        holders[0]->group_end == group_end) {  // exactly one forward part (always unchunked)
      d_rows = backward_groups(*holders[0], group_begin, group_end, std::move(dout), nullptr);
    } else {  // each piece into its rows of d_rows
      d_rows =
          Tensor::empty({row_end - row_begin, gate_up_.value.size(1)}, dout.dtype(), dout.device());
      for (Part* p : holders) {
        const int64_t g0 = std::max(group_begin, p->group_begin);
        const int64_t g1 = std::min(group_end, p->group_end);
        const int64_t r0 = group_row_[g0] - row_begin, r1 = group_row_[g1] - row_begin;
        Tensor into = d_rows.rows(r0, r1);
        backward_groups(*p, g0, g1, dout.rows(r0, r1), &into);
      }
    }
    std::erase_if(parts_, [](const Part& p) { return p.groups_left == 0; });
    if (parts_.empty()) release();
    return d_rows;
  }

  // Peaks in units of N elements, C chunks: forward holds rows, h, out and one chunk's a,
  // 2d + 2f + f / C; backward the same with d_out for out and a or da (unchunked: 2d + 3f).

  void release() override {
    parts_.clear();
    if (!keep_weights_) drop_weights();
    regather_ = nullptr;
    backward_started_ = false;
  }
  void keep_weights(bool keep) override {
    keep_weights_ = keep;
    if (!keep) drop_weights();
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
  /// Consecutive groups forward ran together, and what it saved for their backward.
  struct Part {
    int64_t group_begin, group_end, row_begin, row_end;
    Tensor rows, h;           // [n, d] (none with a regather), [n, 2f] (none with recompute)
    int64_t groups_left = 0;  // not yet backwarded
  };
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
  std::vector<Chunk> chunks(const Part& part) const {
    const int64_t n = part.row_end - part.row_begin;
    int64_t want = chunks_;
    if (want == 0) {
      const bool wide = down_.value.size(1) > gate_up_.value.size(1);
      want = wide && n >= kAutoChunks * kMinAutoChunkRows ? kAutoChunks : 1;
    }
    std::vector<Chunk> out;
    Chunk c{part.group_begin, part.group_begin, part.row_begin, part.row_begin};
    for (int64_t g = part.group_begin; g < part.group_end; ++g) {
      c.group_end = g + 1;
      c.row_end += groups_[static_cast<size_t>(g)];
      const auto closed = static_cast<int64_t>(out.size()) + 1;
      // Close at the first group boundary at or past closed / want of the rows.
      if (closed < want && (c.row_end - part.row_begin) * want >= closed * n &&
          c.row_end > c.row_begin && g + 1 < part.group_end) {
        out.push_back(c);
        c = Chunk{g + 1, g + 1, c.row_end, c.row_end};
      }
    }
    out.push_back(c);
    return out;
  }

  /// The part's saved rows, or (set_input_regather) the layer's gather of them, made now.
  Tensor input_rows(const Part& part) const {
    if (part.rows.defined()) return part.rows;
    Tensor rows = regather_();
    check_shape(rows, {part.row_end - part.row_begin, gate_up_.value.size(1)}, "moe experts",
                "re-gathered rows");
    return rows;
  }

  /// Backward of groups [g0, g1) of `part`: dout [n, d] of their rows -> d_rows, written into
  /// `into` when given (else returned). A part backwarded whole frees its saved tensors as it
  /// goes; one backwarded in pieces keeps them until its last piece.
  Tensor backward_groups(Part& part, int64_t g0, int64_t g1, Tensor dout, Tensor* into) {
    const bool whole = g0 == part.group_begin && g1 == part.group_end;
    const int64_t r0 = group_row_[g0] - part.row_begin, r1 = group_row_[g1] - part.row_begin;
    const std::span<const int64_t> sizes{groups_.data() + g0, groups_.data() + g1};
    XMOE_CHECK(whole || !regather_, "[moe experts] a re-gathered input backwarded in pieces");
    // h [n, 2f] becomes dh in place, chunk by chunk: a and da [n_c, f] live for one chunk, one
    // at a time. d_out and the saved rows go as soon as they are used.
    if (!part.h.defined() && !part.rows.defined()) part.rows = input_rows(part);  // recompute
    Tensor rows = part.rows.defined() ? part.rows.rows(r0, r1) : Tensor();
    Tensor dh = part.h.defined() ? part.h.rows(r0, r1)
                                 : expert_gemm(rows, Weight::gate_up, g0, g1, sizes, false);  // h
    if (whole) part.h = Tensor();
    // FP8: that pass also writes dh's FP8 rows, chunk by chunk into their groups of dh_q, for
    // the gate/up data gradient (dh itself stays for the weight gradient).
    xmoe::ops::Fp8Rows dh_q =
        fp8_ ? xmoe::ops::empty_fp8_rows(dh.size(1), sizes, dh.device()) : xmoe::ops::Fp8Rows{};
    for (const Chunk& c : chunks(Part{g0, g1, group_row_[g0], group_row_[g1], {}, {}, 0})) {
      const std::span<const int64_t> csizes = c.sizes(groups_);
      const int64_t c0 = c.row_begin - group_row_[g0], c1 = c.row_end - group_row_[g0];
      Tensor h_c = dh.rows(c0, c1), dout_c = dout.rows(c0, c1);
      // da [n_c, f] becomes swiglu(h) in the pass that turns h into dh [n_c, 2f]: the down
      // weight gradient's input without a pass (or a buffer) of its own.
      Tensor a = down_data_grad(dout_c, c.group_begin, c.group_end, csizes);
      if (fp8_) {
        xmoe::ops::Fp8Rows dh_qc = dh_q.groups(c.group_begin - g0, c.group_end - g0);
        xmoe::ops::swiglu_backward_with_value_fp8_(h_c, a, dh_qc);
      } else {
        xmoe::ops::swiglu_backward_with_value_(h_c, a);
      }
      Tensor dwd_c = down_.grad.rows(c.group_begin, c.group_end);
      xmoe::ops::grouped_matmul_weight_grad(dwd_c, a, dout_c, csizes, accumulate_down_);
    }
    dout = Tensor();
    if (!into) dout_fp8_ = {};  // the backward's only piece: its FP8 rows are used
    Tensor dwgu = gate_up_.grad.rows(g0, g1);
    xmoe::ops::grouped_matmul_weight_grad(dwgu, rows.defined() ? rows : input_rows(part), dh, sizes,
                                          accumulate_gate_up_);
    rows = Tensor();
    part.groups_left -= g1 - g0;
    if (part.groups_left == 0) part.rows = part.h = Tensor();
    const int64_t n = dh.size(0);
    const Device device = dh.device();
    if (fp8_) dh = Tensor();  // its FP8 rows are what the data gradient reads
    Tensor d_rows = into ? *into : Tensor::empty({n, gate_up_.value.size(1)}, rows_dtype_, device);
    if (fp8_) {
      xmoe::ops::grouped_matmul_fp8_into(d_rows, dh_q, qgu_.groups(g0, g1), true);
    } else {
      expert_gemm_into(d_rows, dh, Weight::gate_up, g0, g1, sizes, true);
    }
    return d_rows;  // [n, d]
  }

  int64_t num_groups() const { return static_cast<int64_t>(groups_.size()); }

  std::span<const int64_t> part_sizes(const Part& part) const {
    return {groups_.data() + part.group_begin, groups_.data() + part.group_end};
  }

  void start_forward(std::span<const int64_t> group_sizes) {
    parts_.clear();
    backward_started_ = false;
    groups_.assign(group_sizes.begin(), group_sizes.end());
    group_row_.assign(groups_.size() + 1, 0);
    for (size_t g = 0; g < groups_.size(); ++g) group_row_[g + 1] = group_row_[g] + groups_[g];
    if (!keep_weights_) drop_weights();  // cast (or quantised) in the first part
  }

  void drop_weights() {
    wgu_ = wd_ = Tensor();
    qgu_ = qd_ = {};
    weights_ready_ = false;
  }

  enum class Weight { gate_up, down };
  /// y = x_g @ w[g] (trans: w[g]^T) over groups [g0, g1) of one weight: in the rows' dtype, or
  /// (moe.expert_dtype = fp8) with x quantised per row and 128 columns and the quantised w.
  void expert_gemm_into(Tensor& y, const Tensor& x, Weight which, int64_t g0, int64_t g1,
                        std::span<const int64_t> sizes, bool trans) const {
    if (fp8_) {
      const xmoe::ops::Fp8Weights& q = which == Weight::gate_up ? qgu_ : qd_;
      xmoe::ops::grouped_matmul_fp8_into(y, xmoe::ops::quantize_rows_fp8(x, sizes),
                                         q.groups(g0, g1), trans);
    } else {
      const Tensor& w = which == Weight::gate_up ? wgu_ : wd_;
      xmoe::ops::grouped_matmul_into(y, x, w.rows(g0, g1), sizes, trans);
    }
  }
  Tensor expert_gemm(const Tensor& x, Weight which, int64_t g0, int64_t g1,
                     std::span<const int64_t> sizes, bool trans) const {
    const Tensor& w = which == Weight::gate_up ? gate_up_.value : down_.value;
    Tensor y = Tensor::empty({x.size(0), trans ? w.size(1) : w.size(2)}, rows_dtype_, x.device());
    expert_gemm_into(y, x, which, g0, g1, sizes, trans);
    return y;
  }

  /// da = d_out @ w_down^T over groups [g0, g1) of the forward (FP8: from d_out's FP8 rows
  /// where the backward was given them).
  Tensor down_data_grad(const Tensor& dout, int64_t g0, int64_t g1,
                        std::span<const int64_t> sizes) const {
    if (!dout_fp8_.data.defined()) return expert_gemm(dout, Weight::down, g0, g1, sizes, true);
    Tensor da = Tensor::empty({dout.size(0), down_.value.size(1)}, rows_dtype_, dout.device());
    xmoe::ops::grouped_matmul_fp8_into(da, dout_fp8_.groups(g0, g1), qd_.groups(g0, g1), true);
    return da;
  }

  /// A forward's input: the rows, or (FP8, forward_gathered) x [T, d] and the index of its rows.
  struct Input {
    Tensor rows;
    Tensor x = Tensor(), index = Tensor();
  };

  Tensor forward_part_(Input in, int64_t group_begin, int64_t group_end) {
    Part part{group_begin, group_end, group_row_[group_begin], group_row_[group_end],
              {},          {},        group_end - group_begin};
    const int64_t n = part.row_end - part.row_begin;
    Tensor& rows = in.rows;
    const bool gathered = !rows.defined();
    if (gathered) {
      check_shape(in.x, {-1, gate_up_.value.size(1)}, "moe experts", "x");
      check_shape(in.index, {n}, "moe experts", "index");
    } else {
      check_shape(rows, {n, gate_up_.value.size(1)}, "moe experts", "rows");
    }
    const Tensor& like = gathered ? in.x : rows;
    // bf16 rows (CUDA): the bf16 compute copies of the f32 master weights (a cast per forward
    // where there are none), kept for backward; the weight gradients are f32 or bf16.
    // FP8: the weights quantised once per forward (once per step with keep_weights), kept for
    // backward's data gradients.
    if (weights_ready_ && like.dtype() != rows_dtype_) drop_weights();  // kept, in another dtype
    if (!weights_ready_) {
      rows_dtype_ = like.dtype();
      if (fp8_) {
        qgu_ = xmoe::ops::quantize_weights_fp8(gate_up_.compute());
        qd_ = xmoe::ops::quantize_weights_fp8(down_.compute());
      } else {
        wgu_ = xmoe::ops::as_dtype(gate_up_.compute(), like.dtype());
        wd_ = xmoe::ops::as_dtype(down_.compute(), like.dtype());
      }
      weights_ready_ = true;
    }
    const std::span<const int64_t> sizes = part_sizes(part);
    Tensor h;        // [n, 2f]
    if (gathered) {  // FP8 rows quantised from x through the index: no gathered copy
      h = Tensor::empty({n, gate_up_.value.size(2)}, rows_dtype_, in.x.device());
      xmoe::ops::grouped_matmul_fp8_into(h,
                                         xmoe::ops::gather_quantize_rows_fp8(in.x, in.index, sizes),
                                         qgu_.groups(group_begin, group_end), false);
    } else {
      h = expert_gemm(rows, Weight::gate_up, group_begin, group_end, sizes, false);
    }
    part.rows = regather_ ? Tensor() : rows;
    in = {};  // the rows go here if the caller moved them in and backward can regather them
    Tensor out = Tensor::empty({n, down_.value.size(2)}, h.dtype(), h.device());
    for (const Chunk& c : chunks(part)) {  // a [n_c, f] lives for one chunk only
      const int64_t r0 = c.row_begin - part.row_begin, r1 = c.row_end - part.row_begin;
      Tensor out_c = out.rows(r0, r1);
      if (fp8_) {  // SwiGLU and the quantiser in one pass: swiglu(h) is never written
        xmoe::ops::grouped_matmul_fp8_into(
            out_c, xmoe::ops::swiglu_quantize_rows_fp8(h.rows(r0, r1), c.sizes(groups_)),
            qd_.groups(c.group_begin, c.group_end), false);
      } else {
        expert_gemm_into(out_c, xmoe::ops::swiglu(h.rows(r0, r1)), Weight::down, c.group_begin,
                         c.group_end, c.sizes(groups_), false);
      }
    }
    part.h = recompute_ ? Tensor() : h;
    parts_.push_back(std::move(part));
    return out;
  }

  bool recompute_;
  bool fp8_;                          // moe.expert_dtype = fp8
  int chunks_;                        // moe.expert_chunks (0: auto)
  std::function<Tensor()> regather_;  // set_input_regather
  Parameter gate_up_, down_;
  std::vector<int64_t> groups_;
  std::vector<int64_t> group_row_;  // first row of each group [E_local + 1]
  std::vector<Part> parts_;         // what forward saved, per part not yet backwarded
  bool backward_started_ = false;
  bool accumulate_down_ = false, accumulate_gate_up_ = false;
  Tensor wgu_, wd_;  // the weights in the rows' dtype (the parameters themselves when f32)
  xmoe::ops::Fp8Weights qgu_, qd_;  // fp8: the weights quantised instead
  xmoe::ops::Fp8Rows dout_fp8_;     // fp8: d_out's FP8 rows, during backward(d_out, d_out_fp8)
  DType rows_dtype_ = DType::f32;
  bool weights_ready_ = false;
  bool keep_weights_ = false;  // keep_weights(true): the weights do not change between passes
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
