#include "xmoe/sched/pipeline_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

#include "xmoe/core/error.h"
#include "xmoe/moe/pipeline.h"

namespace xmoe::sched {

ChunkRates profile_chunk_rates(const Profile& p, comm::LinkClass link) {
  return {[&p](Task kind, int64_t rows, int64_t in, int64_t out, bool fp8) {
            return p.predict_gemm(kind, rows, in, out, fp8);
          },
          [&p](double bytes) { return p.predict_rows(Task::gather_rows, bytes); },
          [&p, link](double bytes) { return p.predict_dispatch(bytes, link); }};
}

ChunkTimes predict_chunk(const ChunkRates& rates, const PipelineShape& s, int chunks,
                         bool backward) {
  XMOE_CHECK(chunks >= 1, "[pipeline] {} chunks", chunks);
  const int64_t n = std::max<int64_t>(1, s.rows / chunks);
  const int64_t d = s.d_model, f = s.expert_hidden;
  const double bytes = static_cast<double>(n * d * s.elem_bytes);
  const double permute = rates.permute(bytes);
  const double a2a = s.ep > 1 ? rates.exchange(bytes) : 0.0;
  ChunkTimes t;
  t.dispatch = t.combine = a2a;
  // The permutations into and out of expert order run beside the GEMMs (compute).
  t.experts = 2 * permute;
  if (!backward) {
    t.experts += rates.gemm(Task::gemm_forward, n, d, 2 * f, s.fp8) +
                 rates.gemm(Task::gemm_forward, n, f, d, s.fp8);
  } else {
    t.experts += rates.gemm(Task::gemm_backward_weight, n, f, d, false) +
                 rates.gemm(Task::gemm_backward_data, n, f, d, s.fp8) +
                 rates.gemm(Task::gemm_backward_weight, n, d, 2 * f, false) +
                 rates.gemm(Task::gemm_backward_data, n, d, 2 * f, s.fp8);
  }
  return t;
}

ChunkTimes predict_chunk(const Profile& p, const PipelineShape& s, int chunks, bool backward) {
  return predict_chunk(profile_chunk_rates(p, s.link), s, chunks, backward);
}

double predict_pipelined(const ChunkTimes& t, int chunks) {
  const double comm = t.dispatch + t.combine;
  return comm + t.experts + (chunks - 1) * std::max(comm, t.experts);
}

namespace {

/// The r with the least predicted time (the smaller r on a tie); seconds[r - 1] = t(r).
int best_chunks(const std::vector<double>& seconds) {
  return static_cast<int>(std::min_element(seconds.begin(), seconds.end()) - seconds.begin()) + 1;
}

}  // namespace

PipelineChoice choose_pipeline(const Profile* profile, const PipelineShape& shape, int max_chunks) {
  PipelineChoice c;
  const int most = static_cast<int>(
      std::min<int64_t>(std::max(max_chunks, 1), std::max<int64_t>(shape.local_experts, 1)));
  if (!profile) {
    c.forward = c.backward = std::min(moe::default_pipeline_chunks(shape.ep), most);
    c.source = "no profile: the default";
    return c;
  }
  for (int r = 1; r <= most; ++r) {
    c.forward_seconds.push_back(predict_pipelined(predict_chunk(*profile, shape, r, false), r));
    c.backward_seconds.push_back(predict_pipelined(predict_chunk(*profile, shape, r, true), r));
  }
  c.forward = best_chunks(c.forward_seconds);
  c.backward = best_chunks(c.backward_seconds);
  return c;
}

std::string PipelineChoice::summary() const {
  std::string s = fmt::format("MoE pipeline: forward in {} chunk(s), backward in {} ({})", forward,
                              backward, source);
  const auto known = [](const std::vector<double>& v, int r) {
    return r >= 1 && r <= static_cast<int>(v.size());
  };
  if (known(forward_seconds, forward) && known(backward_seconds, backward))
    s += fmt::format(
        "; predicted forward {:.1f} us (r = 1: {:.1f} us), backward {:.1f} us (r = 1: {:.1f} us)",
        forward_seconds[forward - 1] * 1e6, forward_seconds[0] * 1e6,
        backward_seconds[backward - 1] * 1e6, backward_seconds[0] * 1e6);
  return s;
}

std::string run_profile_path(const Config& config) {
  if (!config.model.moe.pipeline_profile.empty()) return config.model.moe.pipeline_profile;
  const std::filesystem::path in_run = std::filesystem::path(config.train.out_dir) / "profile.json";
  return std::filesystem::exists(in_run) ? in_run.string() : std::string();
}

PipelineChoice resolve_pipeline(const Config& config, int64_t tokens, int ep, int ep_nodes,
                                int64_t elem_bytes) {
  const MoeConfig& m = config.model.moe;
  const int fwd = parse_pipeline_chunks(m.pipeline, "model.moe.pipeline");
  const int bwd = m.pipeline_backward == "same"
                      ? fwd
                      : parse_pipeline_chunks(m.pipeline_backward, "model.moe.pipeline_backward");
  PipelineChoice c;
  c.forward = fwd;
  c.backward = bwd;
  c.source = "as configured";
  if (fwd != 0 && bwd != 0) return c;

  PipelineShape shape;
  shape.rows = tokens * m.top_k;
  shape.d_model = config.model.d_model;
  shape.expert_hidden = m.expert_hidden;
  shape.local_experts = m.num_experts / std::max(ep, 1);
  shape.ep = ep;
  shape.elem_bytes = elem_bytes;
  shape.link = ep_nodes > 1 ? comm::LinkClass::inter_node : comm::LinkClass::intra_node;
  shape.fp8 = m.expert_dtype == "fp8";
  const std::string path = run_profile_path(config);
  PipelineChoice chosen;
  if (path.empty()) {
    chosen = choose_pipeline(nullptr, shape);
  } else {
    const Profile profile = load_profile(path);  // a named file that is missing or bad: an error
    try {
      chosen = choose_pipeline(&profile, shape);
      chosen.source = "from " + path;
    } catch (const Error& e) {  // a profile without a model the formula needs
      chosen = choose_pipeline(nullptr, shape);
      chosen.source = fmt::format("{} lacks a model ({}): the default", path, e.what());
    }
  }
  if (fwd != 0) chosen.forward = fwd;
  if (bwd != 0) chosen.backward = bwd;
  return chosen;
}

}  // namespace xmoe::sched
