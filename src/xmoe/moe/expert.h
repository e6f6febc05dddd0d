#pragma once
// Stage 4, Expert: the routed experts over contiguous row groups (one group per local expert).
// Built-in "swiglu": out = (silu(x Wg) * x Wu) Wd per expert, with
//   "<prefix>.experts.gate_up" [E_local, d, 2f]  (gate | up fused)
//   "<prefix>.experts.down"    [E_local, f, d]
// as ParamKind::expert (shard: whole [E, ...], offset = first local expert). One grouped GEMM per
// projection. Saved for backward: the input rows (unless the layer can gather them again) and
// h = rows @ gate_up (not with recompute, which redoes the first grouped GEMM in backward).
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "xmoe/core/parameter.h"
#include "xmoe/moe/registry.h"
#include "xmoe/ops/fp8.h"

namespace xmoe::moe {

struct ExpertArgs {
  std::string prefix;
  int64_t num_experts = 0;   ///< global E
  int64_t first_expert = 0;  ///< first expert held here
  int64_t num_local = 0;     ///< E_local
  int64_t d_model = 0, hidden = 0;
  uint64_t seed = 0;
  float init_std = 0.02f, down_std = 0.02f;
  bool recompute = false;
  DType grad_dtype = DType::f32;  ///< of the weight gradients (moe.expert_grad_dtype)
  int chunks = 0;                 ///< moe.expert_chunks (0: auto)
  bool fp8 = false;               ///< moe.expert_dtype = fp8 (ops/fp8.h)
};

class Experts : public Module {
 public:
  virtual std::string_view name() const = 0;
  /// rows [N, d] grouped by local expert, group_sizes [E_local] -> out [N, d]. rows by value:
  /// a caller that moves it in (and set a regather) lets the rows go once h is made.
  virtual Tensor forward(Tensor rows, std::span<const int64_t> group_sizes) = 0;
  /// forward(gather_rows(x, index), group_sizes) for x [T, d] and index i32 [N] (grouped by
  /// local expert), reading x through the index where that saves the gathered copy (FP8 experts
  /// quantise straight from x). Needs set_input_regather first: backward's rows.
  virtual Tensor forward_gathered(const Tensor& x, const Tensor& index,
                                  std::span<const int64_t> group_sizes) = 0;
  /// Whether forward_gathered saves a pass over forward of the gathered rows.
  virtual bool fuses_gather() const = 0;
  /// d_out [N, d] -> d_rows [N, d]; accumulates the weight gradients. d_out by value: a caller
  /// that moves it in lets the experts free it (and their saved rows) as soon as they are used.
  virtual Tensor backward(Tensor d_out) = 0;
  /// Whether backward(d_out, d_out_fp8) saves a pass (FP8 experts: their down projection's data
  /// gradient reads d_out in FP8).
  virtual bool reads_fp8_output_grad() const = 0;
  /// backward(d_out) given d_out's FP8 rows in the forward's groups (ops::quantize_rows_fp8's
  /// bytes and scales, which the I-Order's backward writes in its pass where the rows did not
  /// move): the same result without quantising d_out again.
  virtual Tensor backward(Tensor d_out, xmoe::ops::Fp8Rows d_out_fp8) = 0;
  virtual void release() = 0;

  // Parts (the pipelined layer, moe.pipeline): forward and backward over consecutive groups,
  // one part at a time, so that the rows of one part can move while another computes. Each
  // group's rows see the same GEMM calls as in one forward (a group is never split), so the
  // outputs and weight gradients are bitwise those of forward/backward.
  /// Starts a forward in parts: every group's size [E_local]. No input regather.
  virtual void begin_forward(std::span<const int64_t> group_sizes) = 0;
  /// rows [n, d] of groups [group_begin, group_end) -> their output [n, d]. The parts of one
  /// forward cover the groups once each.
  virtual Tensor forward_part(Tensor rows, int64_t group_begin, int64_t group_end) = 0;
  /// Backward of the part over groups [group_begin, group_end): d_out [n, d] -> d_rows [n, d];
  /// writes those groups' weight gradients. Once every part is done, the saved state is freed.
  virtual Tensor backward_part(Tensor d_out, int64_t group_begin, int64_t group_end) = 0;

  virtual void set_recompute(bool on) = 0;
  /// The hidden activations [N, f] in this many chunks of rows (moe.expert_chunks; 0: auto).
  virtual void set_chunks(int chunks) = 0;
  /// For the next forward and its backward: keep no input rows; backward calls `regather` where
  /// it needs them (the layer gathers them again from x by the PFT indices, cheaper than keeping
  /// [N, d]). nullptr (and release()): forward keeps its rows.
  virtual void set_input_regather(std::function<Tensor()> regather) = 0;
  /// true: the weights stay as they are until keep_weights(false) (the micro-batches of one
  /// optimizer step), so what forward derives from them (their FP8 copies, a cast to the rows'
  /// dtype) is kept across passes and release() instead of derived again by every forward.
  /// false (the default): dropped now and after every backward.
  virtual void keep_weights(bool keep) = 0;
};

using ExpertRegistry = Registry<Experts, const ExpertArgs&>;
/// Built-in: "swiglu".
ExpertRegistry& expert_registry();
std::unique_ptr<Experts> make_experts(const std::string& name, const ExpertArgs& args);

}  // namespace xmoe::moe
