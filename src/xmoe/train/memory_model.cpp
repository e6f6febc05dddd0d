#include "xmoe/train/memory_model.h"

#include <fmt/format.h>

#include <algorithm>

#include "xmoe/core/device.h"
#include "xmoe/core/error.h"
#include "xmoe/model/block.h"
#include "xmoe/model/transformer.h"
#include "xmoe/parallel/grad_sync.h"
#include "xmoe/parallel/zero.h"

namespace xmoe::train {

namespace {

/// One parameter as this rank holds it, in the model's collect_parameters order (which fixes
/// the gradient buckets and so the zero shards).
struct ParamSpec {
  int64_t numel = 0;
  bool expert = false;
  bool compute_copy = false;  ///< gets a bf16 copy in bf16 compute (a matrix a matmul reads)
  int64_t grad_bytes = 4;     ///< per element
};

/// The parameters of model::Transformer(cfg) on an ep rank of `ep`.
std::vector<ParamSpec> parameter_specs(const ModelConfig& m, int ep) {
  const int64_t d = m.d_model, hd = d / m.num_heads;
  const int64_t q = m.num_heads * hd, kv = m.num_kv_heads * hd;
  const MoeConfig& moe = m.moe;
  const int64_t f = moe.expert_hidden, sf = static_cast<int64_t>(moe.num_shared_experts) * f;
  const int64_t local = moe.num_experts / ep;
  const int64_t expert_grad = moe.expert_grad_dtype == "bf16" ? 2 : 4;
  std::vector<ParamSpec> out;
  auto vec = [&](int64_t n) { out.push_back({n, false, false, 4}); };
  auto mat = [&](int64_t n) { out.push_back({n, false, true, 4}); };
  out.push_back({m.vocab_size * d, false, m.tie_embeddings, 4});  // embed: looked up unless tied
  for (int i = 0; i < m.num_layers; ++i) {
    vec(d);  // attn_norm
    mat(d * q);
    mat(d * kv);
    mat(d * kv);
    mat(q * d);
    vec(d);  // ffn_norm
    if (i < m.first_dense_layers) {
      mat(d * 2 * m.dense_hidden);
      mat(m.dense_hidden * d);
      continue;
    }
    if (moe.gate == "xmoe") {
      mat(d * moe.router_dim);
      mat(static_cast<int64_t>(moe.router_dim) * moe.num_experts);
      vec(1);  // temperature
    } else {
      mat(d * moe.num_experts);
    }
    out.push_back({local * d * 2 * f, true, true, expert_grad});
    out.push_back({local * f * d, true, true, expert_grad});
    if (sf > 0) {
      mat(d * 2 * sf);
      mat(sf * d);
    }
  }
  vec(d);  // final_norm
  if (!m.tie_embeddings) mat(d * m.vocab_size);
  return out;
}

std::string human_bytes(int64_t b) {
  const double v = static_cast<double>(b);
  if (b >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", v / (1 << 30));
  if (b >= (int64_t{1} << 20)) return fmt::format("{:.1f} MiB", v / (1 << 20));
  if (b >= 1024) return fmt::format("{:.1f} KiB", v / 1024);
  return fmt::format("{} B", b);
}

}  // namespace

MemoryModel predict_memory(const Config& config, const MemoryModelOptions& o) {
  const ModelConfig& m = config.model;
  MemoryModel r;
  r.world = o.world;
  r.ep = config.parallel.ep;
  r.zero = config.parallel.zero;
  XMOE_CHECK(o.world >= 1 && r.ep >= 1 && o.world % r.ep == 0,
             "[memory] {} ranks do not split into parallel.ep = {} expert-parallel groups", o.world,
             r.ep);
  XMOE_CHECK(o.rank >= 0 && o.rank < o.world, "[memory] rank {} of {} ranks", o.rank, o.world);
  XMOE_CHECK(m.moe.num_experts % r.ep == 0,
             "[memory] model.moe.num_experts = {} is not divisible by parallel.ep = {}",
             m.moe.num_experts, r.ep);
  r.dp = o.world / r.ep;
  r.cuda = parse_device(config.train.device).is_cuda();
  const std::string& dt = config.train.dtype;
  r.bf16_compute = dt == "bf16" || (dt == "auto" && r.cuda);
  const DType compute = r.bf16_compute ? DType::bf16 : DType::f32;

  // Parameters, compute copies, gradients.
  const std::vector<ParamSpec> params = parameter_specs(m, r.ep);
  std::vector<int64_t> numels;
  std::vector<ParamKind> kinds;
  for (const ParamSpec& p : params) {
    r.parameters += p.numel;
    r.parameter_bytes += 4 * p.numel;
    if (r.bf16_compute && p.compute_copy) r.compute_copy_bytes += 2 * p.numel;
    r.whole_gradient_bytes += p.grad_bytes * p.numel;
    numels.push_back(p.numel);
    kinds.push_back(p.expert ? ParamKind::expert : ParamKind::dense);
  }

  // The buckets of the gradient sync, their zero shards and buffers. Layout: world rank r has
  // ep_rank r % ep, dp_rank r / ep; dense buckets split over the world, expert ones over dp.
  int64_t shard_bytes = 0, owned = 0;
  const bool syncs = o.world > 1 || r.zero == 2;
  for (const std::vector<size_t>& members :
       parallel::GradientSync::bucket_plan(numels, kinds, o.bucket_bytes)) {
    std::vector<int64_t> sizes;
    for (size_t i : members) sizes.push_back(numels[i]);
    const bool exp = kinds[members.front()] == ParamKind::expert;
    const int group = exp ? r.dp : o.world, rank = exp ? o.rank / r.ep : o.rank;
    const parallel::BucketShards plan = parallel::BucketShards::plan(sizes, group, rank);
    int64_t bucket_numel = 0;
    for (int64_t n : sizes) bucket_numel += n;
    if (r.zero == 0) {
      owned += bucket_numel;
    } else {
      for (const parallel::ShardPiece& p : plan.pieces) owned += p.count;
    }
    if (r.zero == 2) shard_bytes += 4 * plan.shard;
    int64_t buffers = 0;
    if (syncs) {  // the packed f32 bucket, and the reduce-scatter's shard
      buffers = 4 * (r.zero == 2 ? plan.padded : bucket_numel);
      if (r.zero == 2 && group > 1) buffers += 4 * plan.shard;
    }
    if (r.zero >= 1)  // gather_params: this rank's shard packed, then every rank's
      buffers = std::max(buffers, 4 * plan.shard + (group > 1 ? 4 * plan.padded : 0));
    r.comm_bytes = std::max(r.comm_bytes, buffers);
  }
  r.optimizer_bytes = 8 * owned;
  r.gradient_bytes = r.zero == 2 ? shard_bytes : r.whole_gradient_bytes;

  // State beside the parameters: the RoPE tables, the sigmoid gate's balancing bias.
  const int64_t moe_layers = std::max(0, m.num_layers - m.first_dense_layers);
  const int64_t state = static_cast<int64_t>(m.max_seq_len) * (m.d_model / m.num_heads) * 4 +
                        (m.moe.gate == "sigmoid" ? moe_layers * m.moe.num_experts * 4 : 0);

  // Activations of one micro-batch: backward starts with everything forward saved and the
  // logits' gradient, then walks the layers down, each freeing its saved tensors after its
  // working peak; an f32 dx [T, d] is carried between them.
  const int64_t batch = config.train.batch_size, seq = config.train.seq_len;
  const model::RecomputeOptions rc = model::parse_recompute(m.recompute);
  const ActivationBytes ends =
      model::Transformer::ends_activation_bytes_for(m, batch, seq, compute);
  std::vector<ActivationBytes> blocks;
  int64_t saved = ends.saved;
  for (int i = 0; i < m.num_layers; ++i) {
    blocks.push_back(model::TransformerBlock::activation_bytes_for(m, i, batch, seq, compute, rc,
                                                                   r.ep, o.load_imbalance));
    r.layer_saved.push_back(blocks.back().saved);
    saved += blocks.back().saved;
  }
  int64_t peak = saved + ends.backward_extra;
  int64_t held = saved - ends.saved + ends.kept;
  const int64_t carry = batch * seq * m.d_model * 4;
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    peak = std::max(peak, held + carry + it->backward_extra);
    held -= it->saved;
  }
  r.activation_peak_bytes = peak;

  const int64_t in_step_grads = r.zero == 2 ? r.whole_gradient_bytes : 0;
  r.steady_bytes =
      r.parameter_bytes + r.compute_copy_bytes + r.gradient_bytes + r.optimizer_bytes + state;
  r.peak_bytes = r.steady_bytes + in_step_grads + std::max(r.activation_peak_bytes, r.comm_bytes);

  const std::string sharded = r.zero >= 1 ? fmt::format(", zero {} shards", r.zero) : "";
  r.terms = {
      {"parameters (f32 master)", r.parameter_bytes, true},
      {"compute copies (bf16)", r.compute_copy_bytes, true},
      {r.zero == 2 ? "gradient shards (zero 2, f32)" : "gradients", r.gradient_bytes, true},
      {"AdamW moments m, v" + sharded, r.optimizer_bytes, true},
      {"RoPE tables, gate bias", state, true},
      {"whole gradients in the step (zero 2)", in_step_grads, false},
      {fmt::format("activations saved for backward ({}x{} tokens)", batch, seq), saved, false},
      {"backward working set (peak above saved)", r.activation_peak_bytes - saved, false},
      {"gradient sync / zero buffers (after backward)", r.comm_bytes, false},
  };
  return r;
}

std::string memory_table(const MemoryModel& r) {
  const double n = static_cast<double>(std::max<int64_t>(1, r.parameters));
  std::string out = fmt::format(
      "# memory per rank: world {} = dp {} x ep {}, parallel.zero {}, {} compute on {}; "
      "{:.2f}M parameters held here\n",
      r.world, r.dp, r.ep, r.zero, r.bf16_compute ? "bf16" : "f32", r.cuda ? "cuda" : "cpu",
      n / 1e6);
  out += fmt::format("#   {:<48} {:>12} {:>10}\n", "component", "bytes", "B/param");
  auto line = [&](const std::string& name, int64_t bytes) {
    out += fmt::format("#   {:<48} {:>12} {:>10.2f}\n", name, human_bytes(bytes),
                       static_cast<double>(bytes) / n);
  };
  for (const MemoryTerm& t : r.terms)
    if (t.steady && t.bytes > 0) line(t.name, t.bytes);
  line("= between steps", r.steady_bytes);
  for (const MemoryTerm& t : r.terms)
    if (!t.steady && t.bytes > 0) line(t.name, t.bytes);
  line("= peak of a step", r.peak_bytes);
  // Saved activations per layer, runs of equal layers on one line.
  for (size_t i = 0; i < r.layer_saved.size();) {
    size_t j = i;
    while (j + 1 < r.layer_saved.size() && r.layer_saved[j + 1] == r.layer_saved[i]) ++j;
    const std::string which =
        i == j ? fmt::format("layer {}", i) : fmt::format("layers {}-{}", i, j);
    out += fmt::format("#     saved by {:<38} {:>12} each\n", which, human_bytes(r.layer_saved[i]));
    i = j + 1;
  }
  return out;
}

}  // namespace xmoe::train
