#include "xmoe/train/memory_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "xmoe/core/device.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/error.h"
#include "xmoe/model/block.h"
#include "xmoe/model/transformer.h"
#include "xmoe/ops/ops.h"
#include "xmoe/parallel/grad_sync.h"
#include "xmoe/parallel/zero.h"

namespace xmoe::train {

namespace {

/// One parameter as this rank holds it, in the model's collect_parameters order (which fixes
/// the gradient buckets and so the zero shards).
struct ParamSpec {
  int64_t numel = 0;
  ParamKind kind = ParamKind::dense;
  bool compute_copy = false;  ///< gets a bf16 copy in bf16 compute (a matrix a matmul reads)
  bool reads_f32 = false;     ///< forward reads the f32 weights (Parameter::reads_f32)
  int64_t grad_bytes = 4;     ///< per element
};

/// The parameters of model::Transformer(cfg) on a rank of tp group size `tp` and ep group size
/// `ep`: the attention and dense FFN matrices are this rank's 1/tp shards (ParamKind::
/// tensor_shard), the experts its E/ep; without SSMB the MoE layer's other parameters are
/// tensor_replicated (model/moe_ffn.cpp).
std::vector<ParamSpec> parameter_specs(const ModelConfig& m, int tp, bool ssmb, int ep) {
  const int64_t d = m.d_model, hd = d / m.num_heads;
  const int64_t q = m.num_heads * hd / tp, kv = m.num_kv_heads * hd / tp;
  const MoeConfig& moe = m.moe;
  const int64_t f = moe.expert_hidden, sf = static_cast<int64_t>(moe.num_shared_experts) * f;
  const int64_t local = moe.num_experts / ep, dense_hidden = m.dense_hidden / tp;
  const int64_t expert_grad = moe.expert_grad_dtype == "bf16" ? 2 : 4;
  const ParamKind shard = tp > 1 ? ParamKind::tensor_shard : ParamKind::dense;
  const ParamKind moe_kind = tp > 1 && !ssmb ? ParamKind::tensor_replicated : ParamKind::dense;
  std::vector<ParamSpec> out;
  auto vec = [&](int64_t n, ParamKind kind) { out.push_back({n, kind, false, false, 4}); };
  auto mat = [&](int64_t n, ParamKind kind, bool reads_f32 = false) {
    out.push_back({n, kind, true, reads_f32, 4});
  };
  // embed: looked up in f32 (a copy only when tied to the LM head)
  out.push_back({m.vocab_size * d, ParamKind::dense, m.tie_embeddings, true, 4});
  for (int i = 0; i < m.num_layers; ++i) {
    vec(d, ParamKind::dense);  // attn_norm
    mat(d * q, shard);
    mat(d * kv, shard);
    mat(d * kv, shard);
    mat(q * d, shard);
    vec(d, ParamKind::dense);  // ffn_norm
    if (i < m.first_dense_layers) {
      mat(d * 2 * dense_hidden, shard);
      mat(dense_hidden * d, shard);
      continue;
    }
    if (moe.gate == "xmoe") {  // the cosine router runs in f32
      mat(d * moe.router_dim, moe_kind, true);
      mat(static_cast<int64_t>(moe.router_dim) * moe.num_experts, moe_kind, true);
      vec(1, moe_kind);  // temperature
    } else {
      mat(d * moe.num_experts, moe_kind, moe.router_dtype != "bf16");
    }
    out.push_back({local * d * 2 * f, ParamKind::expert, true, false, expert_grad});
    out.push_back({local * f * d, ParamKind::expert, true, false, expert_grad});
    if (sf > 0) {
      mat(d * 2 * sf, moe_kind);
      mat(sf * d, moe_kind);
    }
  }
  vec(d, ParamKind::dense);  // final_norm
  if (!m.tie_embeddings) mat(d * m.vocab_size, ParamKind::dense);
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

int smallest_world(const Config& config) {
  const ParallelConfig& p = config.parallel;
  return p.ssmb ? std::lcm(p.tp, p.ep) : p.tp * p.ep;
}

MemoryModel predict_memory(const Config& config, const MemoryModelOptions& o) {
  const ModelConfig& m = config.model;
  MemoryModel r;
  r.world = o.world;
  r.tp = config.parallel.tp;
  r.ssmb = config.parallel.ssmb;
  r.ep = config.parallel.ep;
  r.zero = config.parallel.zero;
  r.offload = config.train.offload_optimizer;
  XMOE_CHECK(o.world >= 1 && r.tp >= 1 && o.world % r.tp == 0,
             "[memory] parallel.tp = {} does not divide {} ranks", r.tp, o.world);
  XMOE_CHECK(o.rank >= 0 && o.rank < o.world, "[memory] rank {} of {} ranks", o.rank, o.world);
  // The layout of parallel/layout.h: tp innermost; the MoE world is the whole world with SSMB,
  // else the tp-replica group (this rank's index there: its data rank).
  const int data_ranks = o.world / r.tp, data_rank = o.rank / r.tp;
  const int moe_world = r.ssmb ? o.world : data_ranks, moe_rank = r.ssmb ? o.rank : data_rank;
  XMOE_CHECK(r.ep >= 1 && moe_world % r.ep == 0,
             "[memory] {} ranks do not split into parallel.ep = {} expert-parallel groups{}",
             moe_world, r.ep,
             r.ssmb ? std::string()
                    : fmt::format(" (the MoE layers' ranks: {} ranks / parallel.tp = {}, "
                                  "parallel.ssmb = false)",
                                  o.world, r.tp));
  XMOE_CHECK(m.moe.num_experts % r.ep == 0,
             "[memory] model.moe.num_experts = {} is not divisible by parallel.ep = {}",
             m.moe.num_experts, r.ep);
  r.dp = moe_world / r.ep;
  r.cuda = parse_device(config.train.device).is_cuda();
  const std::string& dt = config.train.dtype;
  r.bf16_compute = dt == "bf16" || (dt == "auto" && r.cuda);
  const DType compute = r.bf16_compute ? DType::bf16 : DType::f32;
  // Offload on CUDA: the master weights, the moments and the staging live in pinned host
  // memory (on the CPU they are host memory anyway, counted with the rest).
  const bool on_host = r.offload && r.cuda;

  // Parameters, compute copies, gradients.
  const std::vector<ParamSpec> params = parameter_specs(m, r.tp, r.ssmb, r.ep);
  std::vector<int64_t> numels;
  std::vector<ParamKind> kinds;
  for (const ParamSpec& p : params) {
    const bool copy = r.bf16_compute && p.compute_copy;
    r.parameters += p.numel;
    r.parameter_bytes += 4 * p.numel;
    if (copy) r.compute_copy_bytes += 2 * p.numel;
    if (on_host && (p.reads_f32 || !copy)) r.device_f32_bytes += 4 * p.numel;
    r.whole_gradient_bytes += p.grad_bytes * p.numel;
    numels.push_back(p.numel);
    kinds.push_back(p.kind);
  }

  // The buckets of the gradient sync, their zero shards and buffers (parallel/grad_sync.cpp):
  // dense buckets over the world, expert ones over the dp group, tensor-parallel ones over the
  // tp-replica group.
  auto group_of = [&](ParamKind kind) -> std::pair<int, int> {
    switch (kind) {
      case ParamKind::dense:
        return {o.world, o.rank};
      case ParamKind::expert:
        return {r.dp, moe_rank / r.ep};
      case ParamKind::tensor_shard:
      case ParamKind::tensor_replicated:
        break;
    }
    return {data_ranks, data_rank};
  };
  // Offload: AdamW's host buffers for each piece it owns, its gradient (the f32 shard with
  // zero 2) and its bf16 copy.
  auto staging = [&](const ParamSpec& p, int64_t count) {
    if (!r.offload) return int64_t{0};
    const int64_t grad = r.zero == 2 ? 4 : p.grad_bytes;
    return count * (grad + (r.bf16_compute && p.compute_copy ? 2 : 0));
  };
  int64_t shard_bytes = 0, owned = 0;
  const bool syncs = o.world > 1 || r.zero == 2;
  for (const std::vector<size_t>& members :
       parallel::GradientSync::bucket_plan(numels, kinds, o.bucket_bytes)) {
    std::vector<int64_t> sizes;
    for (size_t i : members) sizes.push_back(numels[i]);
    const auto [group, rank] = group_of(kinds[members.front()]);
    const parallel::BucketShards plan = parallel::BucketShards::plan(sizes, group, rank);
    int64_t bucket_numel = 0;
    for (int64_t n : sizes) bucket_numel += n;
    if (r.zero == 0) {
      owned += bucket_numel;
      for (size_t i : members) r.staging_bytes += staging(params[i], numels[i]);
    } else {
      for (const parallel::ShardPiece& p : plan.pieces) {
        owned += p.count;
        r.staging_bytes += staging(params[members[p.param]], p.count);
      }
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
  // working peak; an f32 dx [T/tp, d] is carried between them.
  const int64_t batch = config.train.batch_size, seq = config.train.seq_len;
  const model::RecomputeOptions rc = model::parse_recompute(m.recompute);
  // Attention backward's scratch: cuDNN sizes its workspace per shape, so ask it where a GPU
  // is here; elsewhere the native kernel's D (B, H/tp, S) floats, a lower bound.
  const int64_t heads = m.num_heads / r.tp, head_dim = m.d_model / m.num_heads;
  if (r.cuda && backend::cuda_available()) {
    r.attention_workspace_bytes =
        ops::attention_backward_workspace_bytes(compute, batch, seq, heads, m.num_kv_heads / r.tp,
                                                head_dim, parse_device(config.train.device));
    r.attention_workspace_asked = true;
  } else if (r.cuda) {
    r.attention_workspace_bytes = batch * heads * seq * 4;
  }
  const model::ActivationLayout layout{r.tp, r.ssmb, r.ep, o.load_imbalance,
                                       r.attention_workspace_bytes};
  const ActivationBytes ends =
      model::Transformer::ends_activation_bytes_for(m, batch, seq, compute, r.tp);
  std::vector<ActivationBytes> blocks;
  int64_t saved = ends.saved;
  for (int i = 0; i < m.num_layers; ++i) {
    blocks.push_back(
        model::TransformerBlock::activation_bytes_for(m, i, batch, seq, compute, rc, layout));
    r.layer_saved.push_back(blocks.back().saved);
    saved += blocks.back().saved;
  }
  int64_t peak = saved + ends.backward_extra;
  int64_t held = saved - ends.saved + ends.kept;
  const int64_t carry = batch * seq / r.tp * m.d_model * 4;
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    peak = std::max(peak, held + carry + it->backward_extra);
    held -= it->saved;
  }
  r.activation_peak_bytes = peak;

  const int64_t in_step_grads = r.zero == 2 ? r.whole_gradient_bytes : 0;
  r.steady_bytes =
      r.compute_copy_bytes + r.gradient_bytes + state +
      (on_host ? r.device_f32_bytes : r.parameter_bytes + r.optimizer_bytes + r.staging_bytes);
  r.peak_bytes = r.steady_bytes + in_step_grads + std::max(r.activation_peak_bytes, r.comm_bytes);
  r.host_bytes = on_host ? r.parameter_bytes + r.optimizer_bytes + r.staging_bytes : 0;

  const std::string sharded = r.zero >= 1 ? fmt::format(", zero {} shards", r.zero) : "";
  r.terms = {
      {"parameters (f32 master)", r.parameter_bytes, true, on_host},
      {"f32 copies forward reads (offload)", r.device_f32_bytes, true},
      {"compute copies (bf16)", r.compute_copy_bytes, true},
      {r.zero == 2 ? "gradient shards (zero 2, f32)" : "gradients", r.gradient_bytes, true},
      {"AdamW moments m, v" + sharded, r.optimizer_bytes, true, on_host},
      {"offload staging (gradients, bf16 copies)", r.staging_bytes, true, on_host},
      {"RoPE tables, gate bias", state, true},
      {"whole gradients in the step (zero 2)", in_step_grads, false},
      {r.tp > 1 ? fmt::format("activations saved for backward ({}x{} / tp {})", batch, seq, r.tp)
                : fmt::format("activations saved for backward ({}x{} tokens)", batch, seq),
       saved, false},
      {"backward working set (peak above saved)", r.activation_peak_bytes - saved, false},
      {"gradient sync / zero buffers (after backward)", r.comm_bytes, false},
  };
  return r;
}

std::string memory_table(const MemoryModel& r) {
  const double n = static_cast<double>(std::max<int64_t>(1, r.parameters));
  const std::string layout =
      r.tp == 1
          ? fmt::format("world {} = dp {} x ep {}", r.world, r.dp, r.ep)
          : fmt::format("world {} = data {} x tp {}, MoE layers {} = dp {} x ep {} ({})", r.world,
                        r.world / r.tp, r.tp, r.dp * r.ep, r.dp, r.ep, r.ssmb ? "SSMB" : "no SSMB");
  std::string out = fmt::format(
      "# memory per rank: {}, parallel.zero {}, {} compute on {}{}; {:.2f}M parameters held "
      "here\n",
      layout, r.zero, r.bf16_compute ? "bf16" : "f32", r.cuda ? "cuda" : "cpu",
      r.offload ? ", optimizer offloaded" : "", n / 1e6);
  out += fmt::format("#   {:<48} {:>12} {:>10}\n", "component", "bytes", "B/param");
  auto line = [&](const std::string& name, int64_t bytes) {
    out += fmt::format("#   {:<48} {:>12} {:>10.2f}\n", name, human_bytes(bytes),
                       static_cast<double>(bytes) / n);
  };
  for (const MemoryTerm& t : r.terms)
    if (t.steady && !t.host && t.bytes > 0) line(t.name, t.bytes);
  line(r.host_bytes > 0 ? "= between steps, on the device" : "= between steps", r.steady_bytes);
  for (const MemoryTerm& t : r.terms)
    if (!t.steady && !t.host && t.bytes > 0) line(t.name, t.bytes);
  line(r.host_bytes > 0 ? "= peak of a step, on the device" : "= peak of a step", r.peak_bytes);
  for (const MemoryTerm& t : r.terms)
    if (t.host && t.bytes > 0) line("host: " + t.name, t.bytes);
  if (r.host_bytes > 0) line("= pinned host memory (offload)", r.host_bytes);
  if (r.attention_workspace_bytes > 0)
    out += fmt::format("#     of which attention backward's workspace {:>20} {}\n",
                       human_bytes(r.attention_workspace_bytes),
                       r.attention_workspace_asked ? "(asked of the GPU's attention kernel)"
                                                   : "(no GPU here to ask cuDNN: a lower bound)");
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
