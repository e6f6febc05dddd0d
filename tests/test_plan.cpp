// The planner (src/xmoe/plan/): cluster descriptions and their file errors, group spans, the α-β
// collective model against hand-computed times, the enumeration and ranking of layouts, the
// chosen config round trip, the largest-model search, the pipelined MoE layer's chunk count
// (time and memory) and the overlap rules.
#include <gtest/gtest.h>

#include <fstream>

#include "testing.h"
#include "xmoe/config/config.h"
#include "xmoe/plan/planner.h"
#include "xmoe/train/memory_model.h"

using namespace xmoe;
using namespace xmoe::plan;
using xmoe::testing::error_of;
using xmoe::testing::TempDir;

TEST(Cluster, BuiltInsHaveTheirDataSheets) {
  EXPECT_EQ(builtin_cluster_names(),
            (std::vector<std::string>{"dgx-h100", "dgx-h200", "frontier"}));
  const Cluster h100 = builtin_cluster("dgx-h100"), h200 = builtin_cluster("dgx-h200");
  const Cluster frontier = builtin_cluster("frontier");
  EXPECT_EQ(h100.gpus_per_node, 8);
  EXPECT_EQ(h100.gpu_memory, int64_t{80} << 30);
  EXPECT_EQ(h200.gpu_memory, int64_t{141} << 30);
  EXPECT_DOUBLE_EQ(h100.intra.bandwidth, 450e9);
  EXPECT_DOUBLE_EQ(h100.inter.bandwidth, 50e9);  // 8 x 400 Gb/s over 8 GPUs
  EXPECT_EQ(frontier.gpu_memory, int64_t{64} << 30);
  EXPECT_DOUBLE_EQ(frontier.inter.bandwidth, 12.5e9);  // 4 x 25 GB/s over 8 GCDs
  EXPECT_EQ(frontier.world(), 8);
  EXPECT_DOUBLE_EQ(h100.fp8_flops, 1979e12);
  EXPECT_DOUBLE_EQ(h200.fp8_flops, 1979e12);
  EXPECT_EQ(frontier.fp8_flops, 0);  // MI250X: no FP8 matrix units
  EXPECT_CONTAINS(error_of([] { builtin_cluster("dgx-a100"); }), "unknown cluster 'dgx-a100'");
}

TEST(Cluster, FilesStartFromABaseOrDeclareEverything) {
  const Cluster c = cluster_from_yaml(
      "base: dgx-h100\nnodes: 4\nintra_node: {bandwidth_gbs: 300}\nusable_host_memory: 0.75\n",
      "c.yaml");
  EXPECT_EQ(c.name, "dgx-h100");
  EXPECT_EQ(c.world(), 32);
  EXPECT_DOUBLE_EQ(c.usable_host_memory, 0.75);
  EXPECT_DOUBLE_EQ(c.usable_memory, 0.9);  // kept from the base
  EXPECT_DOUBLE_EQ(c.intra.bandwidth, 300e9);
  EXPECT_DOUBLE_EQ(c.intra.latency, 5e-6);  // kept from the base
  const Cluster own = cluster_from_yaml(
      R"({"name": "lab", "gpus_per_node": 4, "gpu_memory_gib": 24, "peak_tflops": 165,
          "gemm_efficiency": 0.5, "memory_bandwidth_gbs": 1000,
          "intra_node": {"bandwidth_gbs": 32, "latency_us": 10}})",
      "lab.json");
  EXPECT_EQ(own.name, "lab");
  EXPECT_EQ(own.world(), 4);
  EXPECT_DOUBLE_EQ(own.peak_flops, 165e12);
}

TEST(Cluster, FileErrorsNameTheFileAndTheKey) {
  const auto err = [](const std::string& text) {
    return error_of([&] { cluster_from_yaml(text, "c.yaml"); });
  };
  EXPECT_CONTAINS(err("base: dgx-h100\nnodez: 2\n"), "[cluster] c.yaml: 'nodez' is not a key");
  EXPECT_CONTAINS(err("base: dgx-h100\nnodes: 0\n"), "c.yaml: nodes = 0 must be >= 1");
  EXPECT_CONTAINS(err("base: dgx-h100\nintra_node: {bandwidth_gbs: -1}\n"),
                  "c.yaml: intra_node.bandwidth_gbs = -1 must be > 0");
  EXPECT_CONTAINS(err("base: dgx-h100\ninter_node: {speed: 3}\n"),
                  "c.yaml: inter_node.speed is not a key");
  EXPECT_CONTAINS(err("base: dgx-h100\ngemm_efficiency: 1.5\n"),
                  "c.yaml: gemm_efficiency = 1.5 must be <= 1");
  EXPECT_CONTAINS(err("base: dgx-h100\nusable_host_memory: 2\n"),
                  "c.yaml: usable_host_memory = 2 must be <= 1");
  EXPECT_CONTAINS(err("base: dgx-h100\npeak_tflops: fast\n"),
                  "c.yaml: peak_tflops = 'fast' is not a number");
  EXPECT_CONTAINS(err("base: dgx-h100\ndevice: tpu\n"),
                  "c.yaml: device = 'tpu' must be cuda or cpu");
  EXPECT_CONTAINS(err("base: dgx-a100\n"), "c.yaml: base: [cluster] unknown cluster 'dgx-a100'");
  EXPECT_CONTAINS(err("gpus_per_node: 8\n"), "c.yaml: gpu_memory_gib is missing");
  EXPECT_CONTAINS(err("base: frontier\nfp8_tflops: 400\n"),
                  "c.yaml: fp8_tflops is set, fp8_gemm_efficiency is missing");
  EXPECT_CONTAINS(err("base: dgx-h100\nfp8_gemm_efficiency: 0\n"),
                  "c.yaml: fp8_gemm_efficiency = 0 must be > 0");
  EXPECT_CONTAINS(err("[1, 2]"), "c.yaml: expected a map of keys");
  EXPECT_CONTAINS(error_of([] { resolve_cluster("/no/such/cluster.yaml"); }),
                  "neither a built-in cluster");
}

TEST(StepTime, GroupSpansFollowTheRankLayout) {
  EXPECT_EQ(group_span(8, 1, 8).nodes, 1);   // ep 8 of consecutive ranks: one node
  EXPECT_EQ(group_span(16, 1, 8).nodes, 2);  // ep 16: two nodes of 8
  EXPECT_EQ(group_span(4, 8, 8).nodes, 4);   // dp over ep 8: one member per node
  EXPECT_EQ(group_span(4, 2, 8).nodes, 1);   // stride 2: 4 members on a node of 8
  EXPECT_EQ(group_span(8, 2, 8).nodes, 2);
  EXPECT_EQ(group_span(1, 1, 8).ranks, 1);
}

TEST(StepTime, CollectivesFollowTheAlphaBetaModelPerLink) {
  Cluster c = builtin_cluster("dgx-h100");
  c.nodes = 4;
  const Rates r(c);
  const double x = 1e9, a_i = 5e-6, a_e = 10e-6, b_i = 450e9, b_e = 50e9;
  // One node: a ring of 8 over NVLink.
  EXPECT_NEAR(r.collective(sched::Task::all_reduce, {8, 1}, x), 14 * a_i + 2.0 * 7 / 8 * x / b_i,
              1e-12);
  EXPECT_NEAR(r.collective(sched::Task::all_gather, {8, 1}, x), 7 * a_i + 7.0 / 8 * x / b_i, 1e-12);
  // Four nodes: within each node, then each GPU's 1/8 across the 4 nodes over its NIC share.
  EXPECT_NEAR(r.collective(sched::Task::all_reduce, {32, 4}, x),
              14 * a_i + 2.0 * 7 / 8 * x / b_i + 6 * a_e + 2.0 * 3 / 4 * (x / 8) / b_e, 1e-12);
  // all_to_all over 16 ranks on 2 nodes: 7/16 of the bytes stay on the node, 8/16 leave it;
  // both links at once, the slower decides.
  EXPECT_NEAR(r.collective(sched::Task::all_to_all_v, {16, 2}, x), a_e + 0.5 * x / b_e, 1e-12);
  EXPECT_EQ(r.collective(sched::Task::all_reduce, {1, 1}, x), 0);
}

TEST(StepTime, AProfileModelIsUsedAtItsMeasuredGroupSize) {
  sched::Profile p;
  sched::TaskModel ar;
  ar.task = sched::Task::all_reduce;
  ar.ranks = 4;
  ar.fit = {.alpha = 30e-6, .beta = 2e-9, .r2 = 1, .n = 2, .unit = "byte"};
  p.models.push_back(ar);
  Cluster c = builtin_cluster("dgx-h100");
  const Rates r(c, p);
  // At 4 ranks exactly the profile's prediction; at 8 the unfolded link: 2(r-1) steps of
  // alpha / 6 and 2(r-1)/r of the bytes at 1.5 / beta.
  EXPECT_NEAR(r.collective(sched::Task::all_reduce, {4, 1}, 1e6), 30e-6 + 2e-3, 1e-12);
  EXPECT_NEAR(r.collective(sched::Task::all_reduce, {8, 1}, 1e6),
              14 * 5e-6 + 2.0 * 7 / 8 * 1e6 * 2e-9 / 1.5, 1e-12);
  // No all_gather model: the cluster's link.
  EXPECT_NEAR(r.collective(sched::Task::all_gather, {8, 1}, 1e6), 7 * 5e-6 + 7.0 / 8 * 1e6 / 450e9,
              1e-12);
}

TEST(StepTime, Fp8ExpertsTakeTheFp8RateForwardAndDataGradient) {
  Config c = preset("moe-1b");
  c.train.batch_size = 4;
  c.model.moe.expert_dtype = "fp8";
  Config b = c;
  b.model.moe.expert_dtype = "bf16";
  // FP8 at twice bf16's rate and elementwise work nearly free: FP8 saves half of each expert
  // forward and data-gradient GEMM's FLOP time, and its quantising passes cost ~nothing.
  Cluster cl = cluster_from_yaml(
      "base: dgx-h100\nfp8_tflops: 1978\nfp8_gemm_efficiency: 0.6\nmemory_bandwidth_gbs: 1e12\n",
      "fast.yaml");
  const Rates r(cl);
  const train::MemoryModel mem = train::predict_memory(c);
  const auto moe_compute = [&](const Config& config) {
    const StepTime t = predict_step_time(config, mem, r, {});
    for (const TimeTerm& term : t.terms)
      if (term.name == "MoE compute fwd+bwd") return term.seconds;
    ADD_FAILURE() << "no MoE compute term";
    return 0.0;
  };
  const int64_t rows = c.train.batch_size * c.train.seq_len * c.model.moe.top_k;
  const int64_t d = c.model.d_model, f = c.model.moe.expert_hidden;
  using sched::Task;
  double saved = 0;
  for (const auto& [in, out] : {std::pair{d, 2 * f}, std::pair{f, d}})
    saved += r.gemm(Task::gemm_forward, rows, in, out) -
             r.gemm(Task::gemm_forward, rows, in, out, true) +
             r.gemm(Task::gemm_backward_data, rows, out, in) -
             r.gemm(Task::gemm_backward_data, rows, out, in, true);
  EXPECT_NEAR(saved, 0.5 * (2.0 * rows * d * 2 * f + 2.0 * rows * f * d) * 2 / (989e12 * 0.6),
              1e-12);
  const int layers = c.model.num_layers - c.model.first_dense_layers;
  EXPECT_NEAR(moe_compute(b) - moe_compute(c), layers * saved, 1e-6 * layers * saved);
  // FP8 at bf16's rate: FP8 costs exactly its quantising passes, dy's and dh's rows in every
  // micro-batch's backward and the local experts' weights once per step.
  const Cluster same_rate =
      cluster_from_yaml("base: dgx-h100\nfp8_tflops: 989\nfp8_gemm_efficiency: 0.6\n", "s.yaml");
  const Rates s(same_rate);
  c.train.grad_accum = b.train.grad_accum = 2;
  const auto moe_compute_on = [&](const Config& config, const Rates& rates) {
    for (const TimeTerm& term : predict_step_time(config, mem, rates, {}).terms)
      if (term.name == "MoE compute fwd+bwd") return term.seconds;
    return 0.0;
  };
  const double elem = 2, rows_q = s.stream(rows * (d + 2 * f) * (elem + 1 + 4.0 / 128));
  const double weights_q = s.stream(3.0 * c.model.moe.num_experts * d * f * (elem + 2));
  EXPECT_NEAR(moe_compute_on(c, s) - moe_compute_on(b, s), layers * (2 * rows_q + weights_q), 1e-9);
  // No FP8 rate, no FP8 plan: frontier's GPUs, or a profile without FP8 models.
  const Rates frontier(builtin_cluster("frontier"));
  EXPECT_CONTAINS(error_of([&] { predict_step_time(c, mem, frontier, {}); }),
                  "cluster frontier declares no FP8 rate");
  EXPECT_CONTAINS(error_of([&] { make_plan(c, frontier, {}); }), "declares no FP8 rate");
  const Rates profiled(cl, sched::Profile{});
  EXPECT_CONTAINS(error_of([&] { predict_step_time(c, mem, profiled, {}); }),
                  "the profile has no FP8 GEMM models (measure them with xmoe profile --fp8");
}

TEST(StepTime, RbdCrossesFewerBytesBetweenNodes) {
  Config c = preset("xmoe-medium");
  c.parallel.ep = 32;
  c.train.batch_size = 1;
  Cluster cl = builtin_cluster("dgx-h100");
  cl.nodes = 4;
  const Rates r(cl);
  const train::MemoryModel m = train::predict_memory(c, {.world = 32});
  c.model.moe.dispatch = "all_to_all";
  const StepTime a2a = predict_step_time(c, m, r, {.world = 32});
  c.model.moe.dispatch = "rbd";
  const StepTime rbd = predict_step_time(c, m, r, {.world = 32});
  const auto term = [](const StepTime& t, const std::string& name) {
    for (const TimeTerm& x : t.terms)
      if (x.name == name) return x.seconds;
    return -1.0;
  };
  EXPECT_GT(term(a2a, "dispatch + combine"), 0);
  EXPECT_LT(term(rbd, "dispatch + combine"), term(a2a, "dispatch + combine"));
  EXPECT_EQ(term(rbd, "attention fwd+bwd"), term(a2a, "attention fwd+bwd"));
  // The pipelined layer: r chunks hide part of rbd's intra-node stage.
  const StepTime chunked = predict_step_time(c, m, r, {.world = 32, .moe_chunks = 4});
  EXPECT_LT(chunked.total, rbd.total);
  EXPECT_GT(chunked.hidden, 0);
}

TEST(Planner, RanksFittingLayoutsByTokensPerSecondAndWritesARunnableConfig) {
  Config base = preset("moe-1b");
  const Rates rates(builtin_cluster("dgx-h100"));
  const Plan p = make_plan(base, rates);
  ASSERT_GT(p.fitting, 0);
  EXPECT_EQ(p.layouts, static_cast<int>(p.candidates.size()));
  for (size_t i = 0; i + 1 < p.candidates.size(); ++i) {
    const Candidate &a = p.candidates[i], &b = p.candidates[i + 1];
    EXPECT_TRUE(a.fits || !b.fits);
    if (a.fits && b.fits) {
      EXPECT_GE(a.tokens_per_s, b.tokens_per_s);
    }
  }
  for (const Candidate& c : p.candidates) {
    // The memory is the memory model's for that config and world, whatever was cached.
    const train::MemoryModel m = train::predict_memory(c.config, {.world = 8});
    EXPECT_EQ(c.memory.peak_bytes, m.peak_bytes) << c.layout.str();
    EXPECT_EQ(c.fits, m.peak_bytes <= 0.9 * (int64_t{80} << 30)) << c.layout.str();
    EXPECT_EQ(c.config.parallel.ep, c.layout.ep);
    EXPECT_EQ(c.config.train.device, "cuda");
  }
  const Candidate& best = p.candidates.front();
  EXPECT_GT(best.mfu, 0);
  EXPECT_LT(best.mfu, 1);
  const std::string yaml = chosen_yaml(best, rates.cluster());
  EXPECT_CONTAINS(yaml, "# chosen by `xmoe plan` for dgx-h100 (8 ranks)");
  const Config loaded = load_config_string(yaml, "chosen.yaml");
  validate(loaded);
  EXPECT_EQ(loaded, best.config);
  EXPECT_CONTAINS(plan_table(p, 5), "tokens/s");
}

TEST(Planner, GlobalBatchSetsTheAccumulation) {
  PlanOptions o;
  o.global_batch = 64;
  const Plan p = make_plan(preset("moe-1b"), Rates(builtin_cluster("dgx-h100")), o);
  ASSERT_FALSE(p.candidates.empty());
  for (const Candidate& c : p.candidates)
    EXPECT_EQ(c.layout.grad_accum * c.layout.micro_batch * (8 / c.layout.tp), 64) << c.layout.str();
}

// train.adam_moments_dtype (token m16): a layout gets bf16 moments only where its f32-moment twin
// does not fit; there they cut the moment bytes in half and the AdamW time by 20/28.
TEST(Planner, Bf16MomentsOnlyWhereF32MomentsDoNotFit) {
  Cluster cl = builtin_cluster("dgx-h100");
  cl.gpu_memory = int64_t{24} << 30;  // tight enough that some layouts need the lever
  const Rates rates(cl);
  const Config base = preset("moe-1b");
  const Plan p = make_plan(base, rates);
  int m16 = 0, m16_fit = 0;
  for (const Candidate& c : p.candidates) {
    if (c.layout.adam_moments_dtype != "bf16") continue;
    ++m16;
    m16_fit += c.fits;
    EXPECT_EQ(c.config.train.adam_moments_dtype, "bf16");
    EXPECT_CONTAINS(c.layout.str(), " m16");
    PlanLayout twin = c.layout;
    twin.adam_moments_dtype = "f32";
    const Candidate f32 = evaluate_layout(base, twin, rates);
    EXPECT_FALSE(f32.fits) << c.layout.str();
    EXPECT_EQ(f32.memory.optimizer_bytes, 2 * c.memory.optimizer_bytes) << c.layout.str();
    EXPECT_LT(c.time.optimizer, f32.time.optimizer) << c.layout.str();
  }
  EXPECT_GT(m16_fit, 0);  // the lever made some layout fit
  PlanOptions f32_only;
  f32_only.moments_choices = {"f32"};
  const Plan q = make_plan(base, rates, f32_only);
  EXPECT_EQ(p.layouts, q.layouts + m16);
  EXPECT_EQ(p.fitting, q.fitting + m16_fit);
  std::printf(
      "[plan m16] moe-1b on 8 x 24 GiB: %d layouts fit with f32 moments, %d more with "
      "bf16 moments\n",
      q.fitting, m16_fit);
}

TEST(Planner, AModelTooLargeFitsNowhereAndTheTableSaysSo) {
  const Plan p = make_plan(preset("xmoe-large"), Rates(builtin_cluster("dgx-h100")));
  EXPECT_EQ(p.fitting, 0);
  EXPECT_GT(p.layouts, 0);
  for (size_t i = 0; i + 1 < p.candidates.size(); ++i)
    EXPECT_LE(p.candidates[i].memory.peak_bytes, p.candidates[i + 1].memory.peak_bytes);
  EXPECT_CONTAINS(plan_table(p, 3), "no layout fits");
}

TEST(Planner, LargestModelIsTheLargestThatFits) {
  Cluster c = builtin_cluster("dgx-h100");
  c.gpu_memory = int64_t{2} << 30;  // 2 GiB GPUs: a small search space decides quickly
  const Rates rates(c);
  Config base = preset("moe-1b");
  const std::vector<int> layers = {2, 4, 8, 16}, experts = {16, 64, 256};
  const LargestModel m = largest_model(base, rates, layers, experts, {});
  EXPECT_TRUE(m.best.fits);
  EXPECT_EQ(m.best.config.model.num_layers, m.layers);
  EXPECT_EQ(m.best.config.model.moe.num_experts, m.experts);
  EXPECT_EQ(m.parameters, count_parameters(m.best.config.model).total);
  for (int l : layers)
    for (int e : experts) {
      const Config s = scaled_model(base, l, e);
      if (count_parameters(s.model).total > m.parameters) {
        EXPECT_EQ(make_plan(s, rates).fitting, 0) << l << " layers x " << e << " experts";
      }
    }
  c.gpu_memory = 1 << 20;
  EXPECT_CONTAINS(error_of([&] { largest_model(base, Rates(c), layers, experts, {}); }),
                  "[plan] no model of 4 layers x 3 experts choices fits");
}

// One GPU whose host memory holds the offloaded optimizer only without whole gradient buffers:
// the planner offers the offload whose gradients travel through group-sized buffers
// ("off:rings"), its host bytes are below the other offload's by the gradients' (less the
// buffers), and it is what fits.
TEST(Planner, OffloadWithGradientRingsWhenTheHostIsTheLimit) {
  Cluster c = builtin_cluster("dgx-h100");
  c.gpus_per_node = 1;
  Config base = preset("moe-1b");
  base.model.num_layers = 2;
  base.train.batch_size = 1;
  PlanOptions o;
  o.expert_grad_choices = {"bf16"};
  o.moments_choices = {"f32"};  // bf16 moments would make the whole buffers fit too
  o.recompute_choices = {{}};
  o.micro_batches = {1};
  const Plan all = make_plan(base, Rates(c), o);
  const Candidate *whole = nullptr, *rings = nullptr;
  for (const Candidate& x : all.candidates) {
    if (!x.layout.offload || x.layout.zero != 0) continue;
    (x.layout.offload_overlap ? whole : rings) = &x;
  }
  ASSERT_TRUE(whole && rings);
  EXPECT_CONTAINS(rings->layout.str(), "off:rings");
  EXPECT_FALSE(rings->config.train.offload_overlap);
  EXPECT_LT(rings->memory.host_bytes, whole->memory.host_bytes);
  // A host between the two: only the rings fit, and the planner says so (zero 2's gradients
  // never start in backward: it has no whole buffers either way).
  c.gpu_memory = int64_t{4} << 30;
  c.usable_host_memory = 1.0;
  c.host_memory = (rings->memory.host_bytes + whole->memory.host_bytes) / 2;
  const Plan p = make_plan(base, Rates(c), o);
  bool rings_fit = false, whole_fit = false;
  for (const Candidate& x : p.candidates)
    if (x.layout.offload && x.layout.zero < 2 && x.fits)
      (x.layout.offload_overlap ? whole_fit : rings_fit) = true;
  EXPECT_TRUE(rings_fit);
  EXPECT_FALSE(whole_fit);
}

namespace {

/// The seconds of `t`'s term `name` (-1 when it has none).
double term_of(const StepTime& t, const std::string& name) {
  for (const TimeTerm& x : t.terms)
    if (x.name == name) return x.seconds;
  return -1;
}

/// moe-1b at ep 8 on one DGX H100 node whose NVLink runs at `intra_gbs`: the step with r chunks.
Candidate moe_1b_ep8(double intra_gbs, int chunks) {
  Cluster cl = builtin_cluster("dgx-h100");
  cl.intra.bandwidth = intra_gbs * 1e9;
  PlanLayout l;
  l.ep = 8;
  l.dispatch = "all_to_all";
  l.micro_batch = 4;
  l.moe_chunks = chunks;
  return evaluate_layout(preset("moe-1b"), l, Rates(cl));
}

/// The r of {1, 2, 4, 8} with the most tokens/s.
int fastest_chunks(double intra_gbs) {
  int best = 1;
  for (int r : {2, 4, 8})
    if (moe_1b_ep8(intra_gbs, r).tokens_per_s > moe_1b_ep8(intra_gbs, best).tokens_per_s) best = r;
  return best;
}

}  // namespace

TEST(PipelineChunks, NoneWithoutExpertParallelismOrWhenTheExchangeIsNegligible) {
  // ep 1: nothing to hide; the enumeration makes r only with ep > 1.
  const Plan p = make_plan(preset("moe-1b"), Rates(builtin_cluster("dgx-h100")));
  int pipelined = 0;
  for (const Candidate& c : p.candidates) {
    if (c.layout.ep == 1) {
      EXPECT_EQ(c.layout.moe_chunks, 1) << c.layout.str();
    }
    EXPECT_LE(c.layout.moe_chunks, 64 / c.layout.ep) << c.layout.str();  // a chunk holds an expert
    EXPECT_EQ(c.config.model.moe.pipeline,
              c.layout.moe_chunks > 1 ? std::to_string(c.layout.moe_chunks) : "off");
    if (c.layout.moe_chunks > 1 && pipelined++ == 0) {
      // Its config as `xmoe plan --out` writes it: the chunk count, and the same config back.
      const std::string yaml = chosen_yaml(c, p.cluster);
      EXPECT_CONTAINS(yaml, fmt::format("pipeline: \"{}\"", c.layout.moe_chunks));
      EXPECT_EQ(load_config_string(yaml, "chosen.yaml"), c.config);
    }
  }
  EXPECT_GT(pipelined, 0);
  Config c = preset("moe-1b");
  c.train.batch_size = 4;
  const train::MemoryModel m = train::predict_memory(c, {.world = 8});
  const Rates r(builtin_cluster("dgx-h100"));
  EXPECT_EQ(predict_step_time(c, m, r, {.world = 8, .moe_chunks = 4}).total,
            predict_step_time(c, m, r, {.world = 8}).total);
  // A link 1000x NVLink: the exchange is nothing to hide and r chunks only pay start-ups.
  EXPECT_EQ(fastest_chunks(450e3), 1);
  const Candidate fast = moe_1b_ep8(450e3, 4);
  EXPECT_GT(term_of(fast.time, "MoE chunk start-ups"), 0);
  EXPECT_LT(-term_of(fast.time, "hidden: MoE pipeline"), term_of(fast.time, "MoE chunk start-ups"));
}

TEST(PipelineChunks, SeveralWhenTheExchangeIsComparableToTheExperts) {
  // At 200 GB/s the four all-to-alls of a layer take about as long as its experts' GEMMs.
  const Candidate one = moe_1b_ep8(200, 1), four = moe_1b_ep8(200, 4);
  const double exchange = term_of(one.time, "dispatch + combine");
  const double experts = term_of(one.time, "MoE compute fwd+bwd");
  EXPECT_GT(exchange, 0.3 * experts);
  EXPECT_LT(exchange, 3 * experts);
  EXPECT_GT(fastest_chunks(200), 1);
  EXPECT_LT(four.time.total, one.time.total);
  EXPECT_GT(four.time.hidden, 0);
  EXPECT_NEAR(four.time.total,
              four.time.compute + four.time.communication + four.time.optimizer - four.time.hidden,
              1e-12);
  EXPECT_CONTAINS(time_terms(four.time), "hidden: MoE pipeline");
  EXPECT_EQ(time_terms(one.time).find("MoE pipeline"), std::string::npos);
}

TEST(PipelineChunks, MemoryFollowsWhatThePipelinedLayerAllocates) {
  // ep 8: the pipelined backward makes d_rows [N, d] up front and moves one chunk's rows at a
  // time: above the unchunked layer at r = 2, then falling with r.
  Config c = preset("moe-1b");
  c.parallel.ep = 8;
  c.train.batch_size = 4;
  auto peak = [&](const std::string& pipeline, int world) {
    c.model.moe.pipeline = pipeline;
    return train::predict_memory(c, {.world = world}).peak_bytes;
  };
  EXPECT_GT(peak("2", 8), peak("off", 8));
  EXPECT_GT(peak("2", 8), peak("4", 8));
  EXPECT_GT(peak("4", 8), peak("8", 8));
  EXPECT_EQ(peak("auto", 8), peak("2", 8));  // auto counted as its default without a profile
  EXPECT_EQ(peak("64", 8), peak("8", 8));    // at most E / ep = 8 chunks
  // One process: a pipelined layer keeps its input rows [N, d] (no re-gather from x).
  c.parallel.ep = 1;
  const int64_t rows = int64_t{4} * c.train.seq_len * c.model.moe.top_k * c.model.d_model * 4;
  EXPECT_GE(peak("2", 1) - peak("off", 1), rows);
}

TEST(Overlap, GradientSyncHidesInBackwardPerZeroLevel) {
  Config c = preset("moe-1b");
  c.train.batch_size = 4;
  const Rates r(builtin_cluster("dgx-h100"));
  for (int zero : {0, 1, 2})
    for (bool overlap : {false, true}) {
      c.parallel.zero = zero;
      c.parallel.overlap_grad_sync = overlap;
      const StepTime t =
          predict_step_time(c, train::predict_memory(c, {.world = 8}), r, {.world = 8});
      const double hidden = -term_of(t, "hidden: gradient sync in backward");
      EXPECT_EQ(grad_sync_overlaps_backward(c), overlap);
      if (grad_sync_overlaps_backward(c)) {
        // All but the embedding's bucket, which backward finishes last.
        EXPECT_GT(hidden, 0.5 * term_of(t, "gradient sync")) << zero;
        EXPECT_LT(hidden, term_of(t, "gradient sync")) << zero;
      } else {
        EXPECT_EQ(hidden, 0) << zero << overlap;
      }
    }
  // The rule: what is left after the tail, up to the budget.
  EXPECT_DOUBLE_EQ(hidden_behind_backward(10, 2, 5), 5);
  EXPECT_DOUBLE_EQ(hidden_behind_backward(10, 2, 50), 8);
  EXPECT_DOUBLE_EQ(hidden_behind_backward(1, 2, 50), 0);
  EXPECT_DOUBLE_EQ(hidden_behind_backward(10, 2, -1), 0);
}

TEST(Overlap, OffloadCopiesHideInBackwardOnOneProcess) {
  Config c = preset("moe-1b");
  c.train.batch_size = 4;
  c.train.device = "cuda";
  c.train.offload_optimizer = true;
  Cluster one = builtin_cluster("dgx-h100");
  one.gpus_per_node = 1;
  const Rates r(one);
  auto hidden = [&](bool overlap, int world) {
    c.train.offload_overlap = overlap;
    const StepTime t =
        predict_step_time(c, train::predict_memory(c, {.world = world}), r, {.world = world});
    return -term_of(t, "hidden: offload copies in backward");
  };
  EXPECT_GT(hidden(true, 1), 0);
  EXPECT_EQ(hidden(false, 1), 0);
  EXPECT_EQ(hidden(true, 8), 0);  // a sync follows backward: the copies start at the step
  c.parallel.zero = 2;
  EXPECT_FALSE(offload_copies_overlap_backward(c, 1));
}
