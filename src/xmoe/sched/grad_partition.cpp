#include "xmoe/sched/grad_partition.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "xmoe/core/error.h"
#include "xmoe/sched/pipeline_plan.h"

namespace xmoe::sched {

namespace {

/// R_m: the idle clock when module m is done.
std::vector<double> ready_times(std::span<const GradModule> modules) {
  std::vector<double> ready;
  double t = 0;
  for (const GradModule& m : modules) {
    XMOE_CHECK(m.idle_seconds >= 0 && m.grad_bytes >= 0,
               "[grad_partition] module {}: idle {} s, {} bytes (need >= 0)", m.name,
               m.idle_seconds, m.grad_bytes);
    t += m.idle_seconds;
    ready.push_back(t);
  }
  return ready;
}

double piece_seconds(const LinearModel& all_reduce, int64_t bytes) {
  return bytes > 0 ? all_reduce.predict(static_cast<double>(bytes)) : 0.0;
}

/// Drops pieces without bytes (no collective), their modules going to the next piece.
void fold_empty(std::vector<GradPiece>& pieces) {
  std::vector<GradPiece> out;
  int pending_first = -1;
  for (GradPiece p : pieces) {
    if (p.bytes == 0) {
      if (pending_first < 0) pending_first = p.first;
      continue;
    }
    if (pending_first >= 0) p.first = pending_first;
    pending_first = -1;
    out.push_back(p);
  }
  pieces = std::move(out);
}

}  // namespace

void predict_pieces(GradPartition& partition, std::span<const GradModule> modules,
                    const LinearModel& all_reduce) {
  const std::vector<double> ready = ready_times(modules);
  partition.backward_seconds = ready.empty() ? 0.0 : ready.back();
  double end = 0;
  int64_t total = 0;
  for (GradPiece& p : partition.pieces) {
    p.start = std::max(end, ready[static_cast<size_t>(p.last)]);
    p.end = end = p.start + piece_seconds(all_reduce, p.bytes);
    total += p.bytes;
  }
  partition.exposed_seconds = std::max(0.0, end - partition.backward_seconds);
  partition.exposed_unpartitioned = piece_seconds(all_reduce, total);
}

GradPartition partition_gradients(std::span<const GradModule> modules,
                                  const LinearModel& all_reduce) {
  XMOE_CHECK(all_reduce.alpha >= 0 && all_reduce.beta >= 0,
             "[grad_partition] all-reduce model alpha {} s, beta {} s/byte (need >= 0)",
             all_reduce.alpha, all_reduce.beta);
  const std::vector<double> ready = ready_times(modules);
  const size_t n = modules.size();
  std::vector<int64_t> prefix(n + 1, 0);  // bytes of modules [0, i)
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + modules[i].grad_bytes;
  // end[k][b]: the earliest end of k pieces covering modules [0, b); first[k][b]: the first
  // module of their last piece. Then the fewest pieces that reach the earliest end of all.
  const double never = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> end(n + 1, std::vector<double>(n + 1, never));
  std::vector<std::vector<size_t>> first(n + 1, std::vector<size_t>(n + 1, 0));
  end[0][0] = 0;
  for (size_t k = 1; k <= n; ++k)
    for (size_t b = k; b <= n; ++b)
      for (size_t a = k - 1; a < b; ++a) {
        const double e = std::max(end[k - 1][a], ready[b - 1]) +
                         piece_seconds(all_reduce, prefix[b] - prefix[a]);
        if (e < end[k][b]) end[k][b] = e, first[k][b] = a;
      }
  size_t pieces = 0;
  double best = never;
  for (size_t k = 1; k <= n; ++k) best = std::min(best, end[k][n]);
  for (size_t k = 1; k <= n && pieces == 0; ++k)
    if (end[k][n] <= best + 1e-12 * std::abs(best)) pieces = k;
  GradPartition out;
  for (size_t k = pieces, b = n; k > 0; b = first[k][b], --k) {
    const size_t a = first[k][b];
    out.pieces.push_back({static_cast<int>(a), static_cast<int>(b - 1), prefix[b] - prefix[a]});
  }
  std::reverse(out.pieces.begin(), out.pieces.end());
  fold_empty(out.pieces);
  predict_pieces(out, modules, all_reduce);
  return out;
}

GradPartition partition_per_module(std::span<const GradModule> modules) {
  GradPartition out;
  for (size_t m = 0; m < modules.size(); ++m)
    out.pieces.push_back({static_cast<int>(m), static_cast<int>(m), modules[m].grad_bytes});
  fold_empty(out.pieces);
  return out;
}

std::string GradPartition::summary(std::span<const GradModule> modules) const {
  std::string s = fmt::format("gradient partition: {} dense piece(s) ({})", pieces.size(), source);
  const auto name = [&](int m) {
    return m >= 0 && static_cast<size_t>(m) < modules.size() ? modules[m].name : std::to_string(m);
  };
  for (size_t i = 0; i < pieces.size(); ++i) {
    const GradPiece& p = pieces[i];
    s += fmt::format("{} {}{} {:.1f} KiB", i == 0 ? ":" : ";", name(p.first),
                     p.first == p.last ? std::string() : ".." + name(p.last),
                     static_cast<double>(p.bytes) / 1024.0);
  }
  if (backward_seconds > 0)
    s += fmt::format(
        "; predicted backward {:.1f} us, exposed sync {:.1f} us (one all-reduce after "
        "backward: {:.1f} us)",
        backward_seconds * 1e6, exposed_seconds * 1e6, exposed_unpartitioned * 1e6);
  return s;
}

std::vector<double> predict_backward_idle(const Profile& p, const ModelConfig& m,
                                          const BackwardShape& s) {
  const int64_t tokens = s.batch * s.seq_len, d = m.d_model, tp = std::max(s.tp, 1);
  const int64_t head_dim = d / m.num_heads, kv = m.num_kv_heads * head_dim;
  // A dense matmul y[T, in] -> [T, out] backward: its data and weight gradients.
  const auto matmul = [&](int64_t rows, int64_t in, int64_t out) {
    return p.predict_gemm(Task::gemm_backward_data, rows, in, out) +
           p.predict_gemm(Task::gemm_backward_weight, rows, in, out);
  };
  // RMSNorm backward reads x, dy and writes dx: about three [T, d] passes.
  const double norm = p.predict_rows(Task::gather_rows, static_cast<double>(3 * tokens * d * 4));
  // Attention: the projections (q, o: d x d; k, v: d x kv), split over tp, and the kernel.
  const double attention =
      2 * norm / 3 + matmul(tokens, d, (2 * d + 2 * kv) / tp) +
      p.predict_attention(Task::attention_backward, s.batch * m.num_heads / tp, head_dim, s.seq_len)
          .value_or(0.0);
  const double dense_ffn =
      matmul(tokens, d, 2 * m.dense_hidden / tp) + matmul(tokens, m.dense_hidden / tp, d);
  // The MoE layer's tokens (SSMB: 1/tp of them), their routed rows, and its layer time less
  // what its exchanges hold the links (docs/pipeline.md's t(r) - r (d + c)).
  const int64_t moe_tokens = tp > 1 && s.ssmb ? tokens / tp : tokens;
  PipelineShape shape;
  shape.rows = moe_tokens * m.moe.top_k;
  shape.d_model = d;
  shape.expert_hidden = m.moe.expert_hidden;
  shape.local_experts = m.moe.num_experts / std::max(s.ep, 1);
  shape.ep = s.ep;
  shape.elem_bytes = s.elem_bytes;
  shape.link = s.ep_link;
  const int r = std::max(s.pipeline_backward, 1);
  const ChunkTimes chunk = predict_chunk(p, shape, r, true);
  const int64_t shared = int64_t{m.moe.num_shared_experts} * m.moe.expert_hidden;
  const double moe =
      predict_pipelined(chunk, r) - r * (chunk.dispatch + chunk.combine) +
      matmul(moe_tokens, d, m.moe.num_experts) +
      (shared > 0 ? matmul(moe_tokens, d, 2 * shared) + matmul(moe_tokens, shared, d) : 0.0);

  std::vector<double> out;
  if (!m.tie_embeddings) out.push_back(matmul(tokens, d, m.vocab_size));
  out.push_back(norm);
  for (int i = m.num_layers; i-- > 0;)
    out.push_back(attention + (i < m.first_dense_layers ? dense_ffn : std::max(moe, 0.0)));
  out.push_back(p.predict_rows(Task::scatter_rows, static_cast<double>(tokens * d * 4)));
  return out;
}

GradPartition resolve_grad_partition(const Config& config, std::vector<GradModule> modules,
                                     const BackwardShape& shape, comm::LinkClass world_link) {
  const std::string path = run_profile_path(config);
  if (path.empty()) {
    GradPartition g = partition_per_module(modules);
    g.source = "no profile: one piece per module";
    return g;
  }
  const Profile profile = load_profile(path);  // a named file that is missing or bad: an error
  try {
    const std::vector<double> idle = predict_backward_idle(profile, config.model, shape);
    XMOE_CHECK(idle.size() == modules.size(),
               "[grad_partition] {} backward modules predicted, the model has {}", idle.size(),
               modules.size());
    for (size_t i = 0; i < idle.size(); ++i) modules[i].idle_seconds = idle[i];
    const TaskModel* all_reduce = profile.find(Task::all_reduce, world_link);
    XMOE_CHECK(all_reduce != nullptr, "[profile] the profile has no all_reduce model over {} links",
               link_name(world_link));
    GradPartition g = partition_gradients(modules, all_reduce->fit);
    g.source = "from " + path;
    return g;
  } catch (const Error& e) {  // a profile without a model the prediction needs
    GradPartition g = partition_per_module(modules);
    g.source = fmt::format("{} lacks a model ({}): one piece per module", path, e.what());
    return g;
  }
}

}  // namespace xmoe::sched
