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
#include "xmoe/optim/adamw.h"
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
  /// Backward's modules in order (model::Transformer::backward_logits): 0 the LM head, 1 the
  /// final norm, 2 + j block L-1-j, 2 + L the embedding. `made`: the one whose backward first
  /// writes the gradient (materializes it), `ready`: the one that finishes it.
  int made = 0, ready = 0;
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
  auto at_block = [&](int i) { return 2 + (m.num_layers - 1 - i); };
  // embed: looked up in f32 (a copy only when tied to the LM head)
  const int embed_stage = 2 + m.num_layers;
  out.push_back({m.vocab_size * d, ParamKind::dense, m.tie_embeddings, true, 4,
                 m.tie_embeddings ? 0 : embed_stage, embed_stage});
  for (int i = 0; i < m.num_layers; ++i) {
    const size_t first = out.size();
    vec(d, ParamKind::dense);  // attn_norm
    mat(d * q, shard);
    mat(d * kv, shard);
    mat(d * kv, shard);
    mat(q * d, shard);
    vec(d, ParamKind::dense);  // ffn_norm
    if (i < m.first_dense_layers) {
      mat(d * 2 * dense_hidden, shard);
      mat(dense_hidden * d, shard);
      for (size_t k = first; k < out.size(); ++k) out[k].made = out[k].ready = at_block(i);
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
    for (size_t k = first; k < out.size(); ++k) out[k].made = out[k].ready = at_block(i);
  }
  vec(d, ParamKind::dense);  // final_norm
  out.back().made = out.back().ready = 1;
  if (!m.tie_embeddings) mat(d * m.vocab_size, ParamKind::dense);  // stage 0
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
  // The delayed update: forward reads f32 copies on the CPU too (the update writes value), and
  // each copy forward reads has a twin the update writes.
  r.delayed_update = r.offload && config.train.offload_delayed_update_from >= 0;
  const bool f32_copies = on_host || r.delayed_update;

  // Parameters, compute copies, gradients.
  const std::vector<ParamSpec> params = parameter_specs(m, r.tp, r.ssmb, r.ep);
  std::vector<int64_t> numels;
  std::vector<ParamKind> kinds;
  // zero >= 1: the f32 masters of a parameter read only through its bf16 copy are sharded
  // (parallel::GradientSync::shards_master): counted below, per owned piece.
  auto master_sharded = [&](const ParamSpec& p) {
    return r.zero >= 1 && r.bf16_compute && p.compute_copy && !p.reads_f32;
  };
  for (const ParamSpec& p : params) {
    const bool copy = r.bf16_compute && p.compute_copy;
    r.parameters += p.numel;
    if (!master_sharded(p)) r.parameter_bytes += 4 * p.numel;
    if (copy) r.compute_copy_bytes += 2 * p.numel;
    const bool f32_copy = f32_copies && (p.reads_f32 || !copy);
    if (f32_copy) r.device_f32_bytes += 4 * p.numel;
    if (r.delayed_update) r.delayed_update_bytes += ((copy ? 2 : 0) + (f32_copy ? 4 : 0)) * p.numel;
    r.whole_gradient_bytes += p.grad_bytes * p.numel;
    (p.kind == ParamKind::dense    ? r.dense_gradient_bytes
     : p.kind == ParamKind::expert ? r.expert_gradient_bytes
                                   : r.tensor_gradient_bytes) += p.grad_bytes * p.numel;
    if (r.zero >= 1)
      (p.kind == ParamKind::dense    ? r.dense_gather_bytes
       : p.kind == ParamKind::expert ? r.expert_gather_bytes
                                     : r.tensor_gather_bytes) +=
          (master_sharded(p) ? 2 : 4) * p.numel;
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
  // Offload: per piece AdamW owns (in its order: the buckets' shards in bucket order; zero 0
  // the parameters in the model's order, set after the walk) its elements, the bytes of its
  // gradient's elements (the f32 shard's with zero 2) and whether it has a bf16 copy. The host
  // buffers follow after the walk.
  std::vector<int64_t> piece_counts, piece_grad_bytes;
  std::vector<char> piece_copy;
  auto staging = [&](const ParamSpec& p, int64_t count) {
    if (!r.offload) return;
    piece_counts.push_back(count);
    piece_grad_bytes.push_back(r.zero == 2 ? 4 : p.grad_bytes);
    piece_copy.push_back(r.bf16_compute && p.compute_copy);
  };
  // zero 2's buckets as backward reaches them: members, group size, shard plan.
  struct ZeroBucket {
    std::vector<size_t> members;
    int group = 1;
    parallel::BucketShards plan;
  };
  std::vector<ZeroBucket> zero_buckets;
  // zero 0, 1 overlapped: each bucket's packed f32 copy, from its start (after the stage that
  // finishes it) to the sync after backward.
  std::vector<std::pair<int, int64_t>> all_reduce_starts;
  int64_t owned = 0;
  const bool syncs = o.world > 1;
  const int64_t bucket_bytes = int64_t{config.parallel.bucket_kib} << 10;
  for (const std::vector<size_t>& members :
       parallel::GradientSync::bucket_plan(numels, kinds, bucket_bytes)) {
    std::vector<int64_t> sizes;
    for (size_t i : members) sizes.push_back(numels[i]);
    const auto [group, rank] = group_of(kinds[members.front()]);
    const parallel::BucketShards plan = parallel::BucketShards::plan(sizes, group, rank);
    int64_t bucket_numel = 0;
    for (int64_t n : sizes) bucket_numel += n;
    if (r.zero == 0) {
      owned += bucket_numel;
      for (size_t i : members) staging(params[i], numels[i]);
    } else {
      for (const parallel::ShardPiece& p : plan.pieces) {
        owned += p.count;
        staging(params[members[p.param]], p.count);
        if (master_sharded(params[members[p.param]])) r.parameter_bytes += 4 * p.count;
      }
    }
    if (r.zero == 2) zero_buckets.push_back({members, group, plan});
    if (syncs && r.zero < 2 && config.parallel.overlap_grad_sync) {
      int ready = 0;
      for (size_t i : members) ready = std::max(ready, params[i].ready);
      all_reduce_starts.emplace_back(ready, 4 * bucket_numel);
    }
    // zero 0, 1: the all-reduce's packed f32 bucket (zero 2: below, in the walk)
    int64_t buffers = syncs && r.zero < 2 ? 4 * bucket_numel : 0;
    if (r.zero >= 1) {  // gather_params: per lane, this rank's packed, then every rank's
      std::vector<char> bf16;
      for (size_t i : members) bf16.push_back(master_sharded(params[i]));
      const auto [lane_bf16, lane_f32] = parallel::GatherLanes::lengths(sizes, bf16, group);
      for (const auto& [lane, bytes] : {std::pair{lane_bf16, 2}, std::pair{lane_f32, 4}})
        buffers = std::max(buffers, bytes * lane * (group > 1 ? 1 + group : 1));
    }
    r.comm_bytes = std::max(r.comm_bytes, buffers);
  }
  if (r.offload) {
    if (r.zero == 0) {  // AdamW's pieces: the parameters whole, in the model's order
      piece_counts.clear(), piece_grad_bytes.clear(), piece_copy.clear();
      for (size_t i = 0; i < params.size(); ++i) staging(params[i], numels[i]);
    }
    // The trainer's AdamW (GradientSync::grads_final_after_backward: one process, zero < 2).
    const optim::AdamWConfig adam =
        optim::AdamWConfig::for_run(config.train, o.world == 1 && r.zero < 2);
    const auto groups = optim::AdamW::offload_groups(piece_counts, adam.offload_group_numel);
    auto ring = [&](auto member) {
      std::vector<char> m;
      for (size_t i = 0; i < piece_counts.size(); ++i) m.push_back(member(i));
      return optim::AdamW::ring_numel(groups, piece_counts, m);
    };
    r.staging_bytes += 2 * ring([&](size_t i) { return piece_copy[i]; });
    if (adam.offload_whole_grads) {
      for (size_t i = 0; i < piece_counts.size(); ++i)
        r.staging_bytes += piece_counts[i] * piece_grad_bytes[i];
    } else {
      r.staging_bytes += 4 * ring([&](size_t i) { return piece_grad_bytes[i] == 4; }) +
                         2 * ring([&](size_t i) { return piece_grad_bytes[i] == 2; });
    }
  }
  // m and v per owned element: f32 or bf16 (train.adam_moments_dtype).
  r.moments_bf16 = optim::AdamWConfig::from(config.train).moments_dtype == DType::bf16;
  r.optimizer_bytes = (r.moments_bf16 ? 4 : 8) * owned;
  r.owned_parameters = owned;
  // zero 2 holds no gradient between steps (its shards live from the sync to the update).
  r.gradient_bytes = r.zero == 2 ? 0 : r.whole_gradient_bytes;

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
  const model::ActivationLayout layout{r.tp,
                                       r.ssmb,
                                       r.ep,
                                       o.load_imbalance,
                                       r.attention_workspace_bytes,
                                       config.train.grad_accum > 1};
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
  // zero 2's gradients inside the step (parallel/grad_sync.h), after backward's module
  // `stage` (-1: before the first): whole gradients from the module that makes them (all of
  // them from the start with accumulation) to their bucket's start; then the bucket's shard,
  // and its packed copy while its reduce-scatter is the one in flight. Overlapped, a bucket
  // starts after the module that finishes its last gradient; else all start after backward.
  const int stages = 3 + m.num_layers;
  const bool overlap = config.parallel.overlap_grad_sync;
  const bool accumulates = config.train.grad_accum > 1;
  auto bucket_start = [&](const ZeroBucket& b) {
    int ready = 0;
    for (size_t i : b.members) ready = std::max(ready, params[i].ready);
    return overlap ? ready : stages - 1;
  };
  // Buckets in the order they start (by stage, then bucket order, as grads_ready reports).
  std::vector<size_t> order(zero_buckets.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return bucket_start(zero_buckets[a]) < bucket_start(zero_buckets[b]);
  });
  // Bytes live while `stage` runs (inside: its own gradients made) with the first `started`
  // buckets of `order` started, and the largest moment of each bucket start after it.
  auto zero2_grads = [&](int stage, size_t started) {
    int64_t bytes = 0;
    std::vector<bool> released(params.size(), false);
    for (size_t k = 0; k < started; ++k) {
      const ZeroBucket& b = zero_buckets[order[k]];
      for (size_t i : b.members) released[i] = true;
      bytes += 4 * b.plan.shard;  // the reduce-scatter's output, then the gradient shard
      if (k + 1 == started && b.group > 1) bytes += 4 * b.plan.padded;  // in flight: packed
    }
    for (size_t i = 0; i < params.size(); ++i)
      if (!released[i] && (accumulates || params[i].made <= stage))
        bytes += params[i].grad_bytes * params[i].numel;
    return bytes;
  };
  // The moment bucket order[k] packs: its (and later) gradients, the shards before it, its
  // packed copy; the one in flight before it is finished.
  auto zero2_packing = [&](int stage, size_t k) {
    const ZeroBucket& b = zero_buckets[order[k]];
    return zero2_grads(stage, k) -
           (k > 0 && zero_buckets[order[k - 1]].group > 1
                ? 4 * zero_buckets[order[k - 1]].plan.padded
                : 0) +
           4 * b.plan.padded;
  };
  const bool zero2 = r.zero == 2;
  size_t started = 0;
  // The ends (the LM head's stage 0 and the final norm's 1, with their gradients), then
  // between stages the buckets that start, then each block.
  auto start_buckets_after = [&](int stage, int64_t live) {
    int64_t most = 0;
    while (zero2 && started < order.size() && bucket_start(zero_buckets[order[started]]) <= stage) {
      most = std::max(most, live + zero2_packing(stage, started));
      ++started;
    }
    return most;
  };
  // Bytes of the zero 0, 1 buckets in flight while `stage` runs.
  auto packed_before = [&](int stage) {
    int64_t bytes = 0;
    for (const auto& [ready, packed] : all_reduce_starts)
      if (ready < stage) bytes += packed;
    return bytes;
  };
  const int64_t carry = batch * seq / r.tp * m.d_model * 4;
  int64_t peak = saved + ends.backward_extra + (zero2 ? zero2_grads(1, 0) : packed_before(1));
  int64_t held = saved - ends.saved + ends.kept;
  peak = std::max({peak, start_buckets_after(1, held + carry), held + carry + packed_before(2)});
  int stage = 2;
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it, ++stage) {
    peak = std::max(peak, held + carry + it->backward_extra +
                              (zero2 ? zero2_grads(stage, started) : packed_before(stage)));
    held -= it->saved - it->kept;  // kept: the experts' FP8 weights across micro-batches
    peak = std::max(
        {peak, start_buckets_after(stage, held + carry), held + carry + packed_before(stage + 1)});
  }
  // The embedding's backward, then the buckets left (the sync after backward).
  peak =
      std::max(peak, held + carry + (zero2 ? zero2_grads(stage, started) : packed_before(stage)));
  peak = std::max({peak, start_buckets_after(stage, held), held + packed_before(stage + 1)});
  r.activation_peak_bytes = peak;  // zero 2: with the gradients
  int64_t shards = 0;
  for (const ZeroBucket& b : zero_buckets) shards += 4 * b.plan.shard;

  r.steady_bytes = r.compute_copy_bytes + r.gradient_bytes + state + r.device_f32_bytes +
                   r.delayed_update_bytes +
                   (on_host ? 0 : r.parameter_bytes + r.optimizer_bytes + r.staging_bytes);
  // zero 0, 1: every whole gradient is in the steady bytes; zero 2: backward's gradients are in
  // its peak, and the update runs beside the shards.
  r.peak_bytes = r.steady_bytes + std::max(r.activation_peak_bytes, shards + r.comm_bytes);
  const int64_t in_step_grads = zero2 ? shards : 0;
  r.host_bytes = on_host ? r.parameter_bytes + r.optimizer_bytes + r.staging_bytes : 0;

  const std::string sharded = r.zero >= 1 ? fmt::format(", zero {} shards", r.zero) : "";
  r.terms = {
      // (with bf16 compute zero shards the masters of the parameters read through bf16 copies)
      {"parameters (f32 master" + (r.bf16_compute ? sharded : "") + ")", r.parameter_bytes, true,
       on_host},
      {"f32 copies forward reads (offload)", r.device_f32_bytes, true},
      {"twins the delayed update writes", r.delayed_update_bytes, true},
      {"compute copies (bf16)", r.compute_copy_bytes, true},
      {"gradients", r.gradient_bytes, true},
      {"AdamW moments m, v" + std::string(r.moments_bf16 ? " (bf16)" : "") + sharded,
       r.optimizer_bytes, true, on_host},
      {"offload staging (gradients, bf16 copies)", r.staging_bytes, true, on_host},
      {"RoPE tables, gate bias", state, true},
      {"gradient shards from sync to update (zero 2, f32)", in_step_grads, false},
      {r.tp > 1 ? fmt::format("activations saved for backward ({}x{} / tp {})", batch, seq, r.tp)
                : fmt::format("activations saved for backward ({}x{} tokens)", batch, seq),
       saved, false},
      {zero2 ? "backward working set and whole gradients (peak above saved)"
             : "backward working set (peak above saved)",
       r.activation_peak_bytes - saved, false},
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
