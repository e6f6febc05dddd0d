#include "xmoe/plan/step_time.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "xmoe/core/error.h"
#include "xmoe/model/block.h"
#include "xmoe/sched/pipeline_plan.h"

namespace xmoe::plan {

namespace {

using sched::Task;

/// Per-byte factor and latency steps of a ring collective over `r` ranks (x as Task defines
/// it); all_to_all_v posts every message at once: one latency.
double byte_factor(Task task, int r) {
  const double f = static_cast<double>(r - 1) / r;
  return task == Task::all_reduce ? 2 * f : f;
}
double latency_steps(Task task, int r) {
  if (task == Task::all_to_all_v) return 1;
  return task == Task::all_reduce ? 2.0 * (r - 1) : r - 1;
}

/// Host DRAM bandwidth a node's CPU threads stream AdamW at with the optimizer offloaded.
constexpr double kHostUpdateBandwidth = 200e9;
/// Launch and start-up time of one GEMM when timed from the cluster's FLOP rate.
constexpr double kGemmLatency = 4e-6;

}  // namespace

bool grad_sync_overlaps_backward(const Config& c) {
  // Every zero level starts each bucket's all-reduce or reduce-scatter in backward
  // (parallel/grad_sync.h).
  return c.parallel.overlap_grad_sync;
}

bool offload_copies_overlap_backward(const Config& c, int world) {
  // AdamW::prefetch_grads, where GradientSync::grads_final_after_backward: no sync changes the
  // gradients after backward.
  return c.train.offload_optimizer && c.train.offload_overlap && world == 1 && c.parallel.zero < 2;
}

double hidden_behind_backward(double seconds, double tail, double budget) {
  return std::clamp(seconds - tail, 0.0, std::max(0.0, budget));
}

GroupSpan group_span(int size, int stride, int ranks_per_node) {
  if (size <= 1) return {1, 1};
  const int per_node = std::clamp(ranks_per_node / std::max(1, stride), 1, size);
  return {size, (size + per_node - 1) / per_node};
}

Rates::Rates(Cluster cluster, std::optional<sched::Profile> profile)
    : cluster_(std::move(cluster)), profile_(std::move(profile)) {}

double Rates::gemm(Task kind, int64_t rows, int64_t in, int64_t out, bool fp8) const {
  if (rows <= 0) return 0;
  // A profile without FP8 models refuses in predict_gemm; a cluster without an FP8 rate here.
  if (profile_) return profile_->predict_gemm(kind, rows, in, out, fp8);
  if (fp8) require_fp8();
  const double rate = fp8 ? cluster_.fp8_flops * cluster_.fp8_gemm_efficiency
                          : cluster_.peak_flops * cluster_.gemm_efficiency;
  return kGemmLatency + 2.0 * static_cast<double>(rows) * static_cast<double>(in) *
                            static_cast<double>(out) / rate;
}

void Rates::require_fp8() const {
  if (profile_) {
    XMOE_CHECK(profile_->has_fp8_gemm(Task::gemm_forward) &&
                   profile_->has_fp8_gemm(Task::gemm_backward_data),
               "[plan] model.moe.expert_dtype = fp8, but the profile has no FP8 GEMM models "
               "(measure them with xmoe profile --fp8, or plan without --profile)");
    return;
  }
  XMOE_CHECK(cluster_.fp8_flops > 0,
             "[plan] model.moe.expert_dtype = fp8, but cluster {} declares no FP8 rate "
             "(fp8_tflops: its GPUs have no FP8 matrix units, or the file leaves it out)",
             cluster_.name);
}

double Rates::quantize_fp8(double bytes) const {
  if (bytes <= 0) return 0;
  if (profile_)
    if (const auto t = profile_->predict_quantize_fp8(bytes)) return *t;
  return stream(bytes);
}

double Rates::stream(double bytes) const {
  if (bytes <= 0) return 0;
  if (profile_) return profile_->predict_rows(Task::gather_rows, bytes);
  return bytes / cluster_.memory_bandwidth;
}

double Rates::attention(Task kind, int64_t pairs, int64_t head_dim, int64_t seq_len) const {
  if (pairs <= 0) return 0;
  if (profile_)
    if (const auto t = profile_->predict_attention(kind, pairs, head_dim, seq_len)) return *t;
  const double s = static_cast<double>(seq_len);
  const double causal = 2.0 * static_cast<double>(pairs) * s * s * static_cast<double>(head_dim);
  return kGemmLatency + (kind == Task::attention_backward ? 2.5 : 1.0) * causal /
                            (cluster_.peak_flops * cluster_.gemm_efficiency);
}

double Rates::adamw(int64_t elements, bool moments_bf16) const {
  const double bytes = adamw_bytes_per_element(moments_bf16);
  if (profile_)
    if (const auto t = profile_->predict_adamw(elements))
      return *t * bytes / adamw_bytes_per_element(false);
  return stream(bytes * static_cast<double>(elements));
}

Link Rates::link(Task task, comm::LinkClass link) const {
  if (profile_)
    if (const sched::TaskModel* m = profile_->find(task, link); m && m->ranks > 1) {
      // t = α + β·x measured on m->ranks ranks = steps·α' + factor·x / bandwidth
      const double bandwidth = m->fit.beta > 0 ? byte_factor(task, m->ranks) / m->fit.beta : 1e30;
      return {bandwidth, m->fit.alpha / latency_steps(task, m->ranks)};
    }
  return link == comm::LinkClass::intra_node ? cluster_.intra : cluster_.inter;
}

double Rates::collective(Task task, GroupSpan span, double bytes) const {
  if (span.ranks <= 1 || bytes <= 0) return 0;
  if (task == Task::all_to_all_v) {
    const int per_node = span.ranks / span.nodes;
    const double to_node = bytes * (per_node - 1) / span.ranks;
    return all_to_all(span, to_node, bytes * (span.ranks - per_node) / span.ranks);
  }
  auto ring = [&](comm::LinkClass c, int r, double x) {
    if (r <= 1) return 0.0;
    const Link l = link(task, c);
    return latency_steps(task, r) * l.latency + byte_factor(task, r) * x / l.bandwidth;
  };
  if (span.nodes == 1) return ring(comm::LinkClass::intra_node, span.ranks, bytes);
  // Hierarchical: within each node, then each rank's 1/per_node share across the nodes.
  const int per_node = span.ranks / span.nodes;
  return ring(comm::LinkClass::intra_node, per_node, bytes) +
         ring(comm::LinkClass::inter_node, span.nodes, bytes / per_node);
}

double Rates::all_to_all(GroupSpan span, double intra_bytes, double inter_bytes) const {
  if (span.ranks <= 1) return 0;
  const Link i = link(Task::all_to_all_v, comm::LinkClass::intra_node);
  double t = i.latency + intra_bytes / i.bandwidth;
  if (span.nodes > 1) {
    const Link e = link(Task::all_to_all_v, comm::LinkClass::inter_node);
    t = std::max(t, e.latency + inter_bytes / e.bandwidth);  // both links at once
  }
  return t;
}

std::string time_terms(const StepTime& time) {
  std::string s;
  for (const TimeTerm& t : time.terms)
    if (t.seconds != 0) s += fmt::format(" {} {:.4g};", t.name, t.seconds);
  return s;
}

StepTime predict_step_time(const Config& c, const train::MemoryModel& mem, const Rates& rates,
                           const StepTimeOptions& o) {
  const ModelConfig& m = c.model;
  const MoeConfig& moe = m.moe;
  const int g = rates.cluster().gpus_per_node;
  const int tp = mem.tp, ep = mem.ep, dp = mem.dp;
  const bool ssmb = mem.ssmb || tp == 1;
  const double elem = mem.bf16_compute ? 2 : 4;
  const int64_t B = c.train.batch_size, S = c.train.seq_len, d = m.d_model;
  const int64_t T = B * S, Tr = T / tp;  // tokens of the tp group, of this rank
  const int64_t hd = d / m.num_heads, heads = m.num_heads / tp;
  const int64_t q = heads * hd, kv = m.num_kv_heads / tp * hd;
  const int64_t f = moe.expert_hidden, sf = int64_t{moe.num_shared_experts} * f;
  const int64_t dh = m.dense_hidden / tp, V = m.vocab_size;
  const int64_t Tm = ssmb ? Tr : T;  // tokens the MoE layer routes here
  const int64_t rows =
      std::llround(static_cast<double>(Tm * moe.top_k) * (ep > 1 ? o.load_imbalance : 1.0));
  const model::RecomputeOptions rc = model::parse_recompute(m.recompute);
  // FP8 experts: their forward and data-gradient GEMMs on FP8 operands, the weight gradient in
  // the compute dtype.
  const bool fp8 = moe.expert_dtype == "fp8";
  if (fp8) rates.require_fp8();

  const GroupSpan tp_span = group_span(tp, 1, g);
  const GroupSpan ep_span = group_span(ep, ssmb ? 1 : tp, g);

  // on_fp8: the FP8 experts' GEMMs; their weight gradient stays in the compute dtype.
  auto fwd = [&](int64_t n, int64_t in, int64_t out, bool on_fp8 = false) {
    return rates.gemm(Task::gemm_forward, n, in, out, on_fp8);
  };
  auto bwd = [&](int64_t n, int64_t in, int64_t out, bool on_fp8 = false) {
    return rates.gemm(Task::gemm_backward_data, n, out, in, on_fp8) +
           rates.gemm(Task::gemm_backward_weight, n, in, out);
  };

  // Attention on T tokens (gathered over tp), 1/tp of the heads.
  const double attn_proj_f = fwd(T, d, q) + 2 * fwd(T, d, kv) + fwd(T, q, d);
  const double attn_proj_b = bwd(T, d, q) + 2 * bwd(T, d, kv) + bwd(T, q, d);
  // The attention kernels (ops::attention: fused, no scores in memory) on B x heads sequences,
  // timed by the profile's attention models; rope, norm and residual pass the activations.
  const int64_t pairs = B * heads;
  const double core_f = rates.attention(Task::attention_forward, pairs, hd, S);
  const double core_b = rates.attention(Task::attention_backward, pairs, hd, S);
  const double attn_stream_f = rates.stream(2.0 * T * (q + 2 * kv) * elem + 4.0 * Tr * d * 4);
  const double attn_f = attn_proj_f + core_f + attn_stream_f;
  const double attn_b = attn_proj_b + core_b + 2 * attn_stream_f;
  const double attn_recompute = rc.attention ? attn_f : rc.attention_core ? core_f : 0;
  // The tp collectives around attention and the dense FFN: gather the rows in, sum-scatter out
  // (forward), and the same pair in backward.
  const double tp_pair = rates.collective(Task::all_gather, tp_span, T * d * elem) +
                         rates.collective(Task::reduce_scatter, tp_span, T * d * elem);

  const double dense_f =
      fwd(T, d, 2 * dh) + fwd(T, dh, d) + rates.stream(3.0 * T * dh * elem + 4.0 * Tr * d * 4);
  const double dense_b =
      bwd(T, d, 2 * dh) + bwd(T, dh, d) + rates.stream(6.0 * T * dh * elem + 4.0 * Tr * d * 4);

  // The MoE layer: router, the experts' grouped GEMMs over the busiest rank's rows, shared
  // experts, the row gathers and the weighted scatter-add of I-Order.
  const double router_f = fwd(Tm, d, moe.num_experts);
  const double experts_f = fwd(rows, d, 2 * f, fp8) + fwd(rows, f, d, fp8);
  // FP8's quantising passes beyond the bf16 layer's: the local experts' weights once per step
  // (the micro-batches share them; read, then written in both layouts the GEMMs read), and in
  // backward dy's and dh's rows for the data-gradient GEMMs (read, written a byte an element and
  // a scale per 128). Forward's quantisers replace the gather and SwiGLU passes moe_stream counts.
  const double q_row_bytes = elem + 1 + 4.0 / 128;
  const double quantize_weights =
      fp8 ? rates.quantize_fp8(3.0 * (moe.num_experts / ep) * d * f * (elem + 2)) : 0;
  const double quantize_b = fp8 ? rates.quantize_fp8(rows * (d + 2 * f) * q_row_bytes) : 0;
  const double shared_f = sf > 0 ? fwd(Tm, d, 2 * sf) + fwd(Tm, sf, d) : 0;
  const double moe_stream = rates.stream(rows * d * (elem + 4) + 3.0 * rows * f * elem +
                                         4.0 * Tm * moe.num_experts * 4 + 4.0 * Tm * d * 4);
  const double moe_f = router_f + experts_f + shared_f + moe_stream;
  const double moe_b = bwd(Tm, d, moe.num_experts) + bwd(rows, d, 2 * f, fp8) +
                       bwd(rows, f, d, fp8) + (sf > 0 ? bwd(Tm, d, 2 * sf) + bwd(Tm, sf, d) : 0) +
                       2 * moe_stream + quantize_b;
  const double moe_recompute = (rc.moe ? fwd(rows, d, 2 * f, fp8) : 0) + (rc.router ? router_f : 0);
  // Dispatch + combine, forward and backward: 4 all-to-alls of the routed rows.
  double a2a = 0;
  const int per_node = ep_span.ranks / ep_span.nodes;
  const bool rbd = moe.dispatch == "rbd" && ep_span.nodes > 1;
  if (ep > 1) {
    const double bytes = static_cast<double>(Tm * moe.top_k) * d * elem;
    if (rbd) {
      // Each token crosses to each remote node holding one of its experts once (stage 1),
      // then its replicas spread inside the node (stage 2).
      const double n = ep_span.nodes;
      const double remote_nodes = (n - 1) * (1 - std::pow(1 - 1 / n, moe.top_k));
      const double inter = static_cast<double>(Tm) * d * elem * remote_nodes;
      a2a = rates.all_to_all(ep_span, 0, inter) +
            rates.all_to_all({per_node, 1}, bytes * (per_node - 1) / per_node, 0);
    } else {
      a2a = rates.collective(Task::all_to_all_v, ep_span, bytes);
    }
    a2a *= 2;
  }
  // Without SSMB the tp group gathers the MoE layer's input (forward) and its gradient.
  const double moe_tp = ssmb ? 0 : 2 * rates.collective(Task::all_gather, tp_span, T * d * elem);
  // The pipelined layer (r chunks each way): FSMoE's formula (sched/pipeline_plan.h) on this
  // cluster's rates, the exchange over the ep group's links (rbd: its intra-node stage 2 only;
  // stage 1 runs whole). Its chunks' stages in series less t(r) is what the overlap hides; in
  // series they pay each GEMM's and exchange's start-up r times (the start-ups term).
  double moe_hidden_f = 0, moe_hidden_b = 0, chunk_startups = 0;
  const int64_t local = moe.num_experts / ep;
  const int chunks = static_cast<int>(std::min<int64_t>(o.moe_chunks, local));
  if (ep > 1 && chunks > 1) {
    const sched::PipelineShape shape{.rows = rows,
                                     .d_model = d,
                                     .expert_hidden = f,
                                     .local_experts = local,
                                     .ep = ep,
                                     .elem_bytes = static_cast<int64_t>(elem),
                                     .fp8 = fp8};
    const sched::ChunkRates chunk_rates{
        [&](Task kind, int64_t n, int64_t in, int64_t out, bool on_fp8) {
          return rates.gemm(kind, n, in, out, on_fp8);
        },
        [&](double bytes) { return rates.stream(bytes); },
        [&](double bytes) {
          return rbd ? rates.all_to_all({per_node, 1}, bytes * (per_node - 1) / per_node, 0)
                     : rates.collective(Task::all_to_all_v, ep_span, bytes);
        }};
    for (const bool backward : {false, true}) {
      const auto serial = [](const sched::ChunkTimes& t) {
        return t.dispatch + t.experts + t.combine;
      };
      const sched::ChunkTimes one = sched::predict_chunk(chunk_rates, shape, 1, backward);
      const sched::ChunkTimes each = sched::predict_chunk(chunk_rates, shape, chunks, backward);
      const double hidden = chunks * serial(each) - sched::predict_pipelined(each, chunks);
      (backward ? moe_hidden_b : moe_hidden_f) = hidden;
      chunk_startups += chunks * serial(each) - serial(one);
    }
  }

  // Embedding, final norm, LM head and cross-entropy on this rank's Tr tokens.
  const double head_f = fwd(Tr, d, V) + rates.stream(3.0 * Tr * V * 4 + 4.0 * Tr * d * 4);
  const double head_b = bwd(Tr, d, V) + rates.stream(2.0 * Tr * V * 4 + 4.0 * Tr * d * 4);

  const int dense_layers = std::min(m.first_dense_layers, m.num_layers);
  const int moe_layers = m.num_layers - dense_layers;
  const double micro = c.train.grad_accum;
  const double forward =
      micro * (m.num_layers * attn_f + dense_layers * dense_f + moe_layers * moe_f + head_f) +
      moe_layers * quantize_weights;
  const double backward =
      micro * (m.num_layers * attn_b + dense_layers * dense_b + moe_layers * moe_b + head_b);
  const double recompute = micro * (m.num_layers * attn_recompute + moe_layers * moe_recompute +
                                    (rc.ffn ? dense_layers * dense_f : 0));
  const double tp_comm =
      micro * (2 * tp_pair * (m.num_layers + dense_layers) + moe_layers * moe_tp);
  const double dispatch = micro * moe_layers * 2 * a2a;
  const double startups = micro * moe_layers * chunk_startups;
  const double moe_hidden = micro * moe_layers * (moe_hidden_f + moe_hidden_b);
  // What backward's compute can still hide (its last micro-batch: the sync and the copies start
  // there), less what the pipelined layers hide in it already.
  const double backward_budget = (backward + recompute) / micro - moe_layers * moe_hidden_b;
  // Backward finishes the embedding's gradient last: the bucket holding it (or that gradient,
  // when larger than a bucket) cannot start before backward ends.
  const double last_gradient_bytes =
      std::min<double>(mem.dense_gradient_bytes,
                       std::max<double>(int64_t{c.parallel.bucket_kib} << 10, 4.0 * V * d));

  // Gradient sync after backward: each group's gradients all-reduced (zero 2: reduce-scattered);
  // zero >= 1 then all-gathers the updated parameters over the same groups.
  const GroupSpan world_span = group_span(o.world, 1, g);
  const GroupSpan expert_dp = group_span(dp, ssmb ? ep : ep * tp, g);
  const GroupSpan tp_replicas = group_span(o.world / tp, tp, g);
  const Task sync_task = mem.zero == 2 ? Task::reduce_scatter : Task::all_reduce;
  const double sync = rates.collective(sync_task, world_span, mem.dense_gradient_bytes) +
                      rates.collective(sync_task, expert_dp, mem.expert_gradient_bytes) +
                      rates.collective(sync_task, tp_replicas, mem.tensor_gradient_bytes);
  const double sync_hidden =
      grad_sync_overlaps_backward(c)
          ? hidden_behind_backward(
                sync, rates.collective(sync_task, world_span, last_gradient_bytes), backward_budget)
          : 0;
  // The parameters of each group: f32, or the bf16 copies of those whose masters are sharded.
  const double gather =
      mem.zero == 0 ? 0
                    : rates.collective(Task::all_gather, world_span, mem.dense_gather_bytes) +
                          rates.collective(Task::all_gather, expert_dp, mem.expert_gather_bytes) +
                          rates.collective(Task::all_gather, tp_replicas, mem.tensor_gather_bytes);

  // AdamW over the elements this rank owns; the global norm reads the gradients and clipping
  // rewrites them. Offloaded, the update runs on the host's threads (28 bytes an element
  // streamed from DRAM, 20 with bf16 moments) after the gradients cross the host link and
  // before the bf16 copies come back.
  const double owned = static_cast<double>(mem.owned_parameters);
  const double grad_pass = rates.stream(3.0 * mem.whole_gradient_bytes);
  double optimizer = 0, offload_hidden = 0;
  if (mem.offload && mem.cuda) {
    const double host_link = rates.cluster().host_bandwidth;
    optimizer = grad_pass +
                Rates::adamw_bytes_per_element(mem.moments_bf16) * owned /
                    (kHostUpdateBandwidth / std::max(1, g)) +
                (owned * 4 + mem.compute_copy_bytes) / host_link;
    // The gradients' copies to the host start as their modules finish backward.
    if (offload_copies_overlap_backward(c, o.world))
      offload_hidden =
          hidden_behind_backward(owned * 4 / host_link, 4.0 * V * d / host_link, backward_budget);
  } else {
    optimizer = grad_pass + rates.adamw(mem.owned_parameters, mem.moments_bf16);
  }

  StepTime t;
  t.compute = forward + backward + recompute;
  t.communication = tp_comm + dispatch + startups + sync + gather;
  t.optimizer = optimizer;
  t.hidden = moe_hidden + sync_hidden + offload_hidden;
  t.total = t.compute + t.communication + t.optimizer - t.hidden;
  t.terms = {
      {"attention fwd+bwd", micro * m.num_layers * (attn_f + attn_b)},
      {"dense FFN fwd+bwd", micro * dense_layers * (dense_f + dense_b)},
      {"MoE compute fwd+bwd", micro * moe_layers * (moe_f + moe_b) + moe_layers * quantize_weights},
      {"LM head + loss fwd+bwd", micro * (head_f + head_b)},
      {"recompute", recompute},
      {"tp collectives", tp_comm},
      {"dispatch + combine", dispatch},
      {"MoE chunk start-ups", startups},
      {"gradient sync", sync},
      {"zero parameter gather", gather},
      {"optimizer", optimizer},
      {"hidden: MoE pipeline", -moe_hidden},
      {"hidden: gradient sync in backward", -sync_hidden},
      {"hidden: offload copies in backward", -offload_hidden}};
  return t;
}

}  // namespace xmoe::plan
