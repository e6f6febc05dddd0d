// The performance models (sched/): the least-squares fit, the profile file and its checks, the
// predictions, a quick one-process profile, the pipelined layer's chunks and the gradient
// partition.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <fstream>
#include <vector>

#include "testing.h"
#include "xmoe/comm/group.h"
#include "xmoe/sched/grad_partition.h"
#include "xmoe/sched/linear_model.h"
#include "xmoe/sched/perf_model.h"
#include "xmoe/sched/pipeline_plan.h"
#include "xmoe/sched/profiler.h"

using namespace xmoe;
using namespace xmoe::sched;
using xmoe::testing::error_of;
using xmoe::testing::TempDir;

TEST(LinearFit, ExactLineRecoversAlphaAndBeta) {
  std::vector<double> x, t;
  for (int e = 10; e <= 26; e += 2) {
    x.push_back(std::exp2(e));
    t.push_back(7e-6 + 3e-10 * x.back());
  }
  for (const FitOptions o : {FitOptions{}, FitOptions{.relative = true, .non_negative = true}}) {
    const LinearModel m = fit_linear(x, t, "byte", o);
    EXPECT_NEAR(m.alpha, 7e-6, 1e-12);
    EXPECT_NEAR(m.beta / 3e-10, 1.0, 1e-9);
    EXPECT_NEAR(m.r2, 1.0, 1e-12);
    EXPECT_EQ(m.n, 9);
    EXPECT_EQ(m.unit, "byte");
    EXPECT_NEAR(m.predict(1e6), 7e-6 + 3e-4, 1e-12);
  }
}

TEST(LinearFit, NoisyDataHasTheKnownR2) {
  // Residuals (+1, -1, -1, +1) are orthogonal to 1 and to x, so the fit is still 2 + 3x, with
  // SS_res = 4 and SS_tot = 49 around the mean 9.5: R² = 45/49.
  const std::vector<double> x = {1, 2, 3, 4}, t = {6, 7, 10, 15};
  const LinearModel m = fit_linear(x, t, "flop");
  EXPECT_NEAR(m.alpha, 2.0, 1e-12);
  EXPECT_NEAR(m.beta, 3.0, 1e-12);
  EXPECT_NEAR(m.r2, 45.0 / 49.0, 1e-12);
}

TEST(LinearFit, RelativeWeightingFollowsTheSmallSizes) {
  // Small times exact on 1 + x, one large point 50% slow. Unweighted, the large point sets the
  // slope and the small sizes are predicted far off; weighted by 1/t^2 the errors
  // balance over all points.
  const std::vector<double> x = {1, 2, 4, 8, 1e6}, t = {2, 3, 5, 9, 1.5e6};
  const std::vector<double> small_x(x.begin(), x.begin() + 4), small_t(t.begin(), t.begin() + 4);
  const LinearModel plain = fit_linear(x, t, "byte");
  const LinearModel relative = fit_linear(x, t, "byte", {.relative = true});
  EXPECT_GT(median_relative_error(plain, small_x, small_t), 0.25);     // 0.264
  EXPECT_LT(median_relative_error(relative, small_x, small_t), 0.08);  // 0.072
}

TEST(LinearFit, NonNegativeClampsTheIntercept) {
  // t = -1 + 2x exactly: the unconstrained fit finds alpha = -1; constrained, alpha = 0 and
  // beta is the least-squares slope through the origin, sum(x t) / sum(x^2) = 50 / 30.
  const std::vector<double> x = {1, 2, 3, 4}, t = {1, 3, 5, 7};
  EXPECT_NEAR(fit_linear(x, t, "byte").alpha, -1.0, 1e-12);
  const LinearModel m = fit_linear(x, t, "byte", {.non_negative = true});
  EXPECT_EQ(m.alpha, 0.0);
  EXPECT_NEAR(m.beta, 50.0 / 30.0, 1e-12);
  EXPECT_LT(m.r2, 1.0);
  // A falling line: beta = 0 and alpha the mean.
  const LinearModel flat =
      fit_linear(x, std::vector<double>{4, 3, 2, 1}, "byte", {.non_negative = true});
  EXPECT_EQ(flat.beta, 0.0);
  EXPECT_NEAR(flat.alpha, 2.5, 1e-12);
}

TEST(LinearFit, RefusesWhatHasNoLine) {
  const std::vector<double> one = {1}, two = {1, 2}, same = {4, 4, 4};
  EXPECT_CONTAINS(error_of([&] { fit_linear(one, one, "byte"); }),
                  "[fit] a line needs at least 2 samples, got 1");
  EXPECT_CONTAINS(error_of([&] { fit_linear({}, {}, "byte"); }), "at least 2 samples, got 0");
  EXPECT_CONTAINS(error_of([&] {
                    fit_linear(same, std::vector<double>{1, 2, 3}, "byte");
                  }),
                  "all 3 samples have x = 4: the slope is undefined");
  EXPECT_CONTAINS(error_of([&] { fit_linear(two, same, "byte"); }), "2 sizes but 3 times");
  EXPECT_CONTAINS(error_of([&] {
                    fit_linear(two, std::vector<double>{1, NAN}, "byte");
                  }),
                  "sample 1 is not finite");
  EXPECT_CONTAINS(error_of([&] {
                    fit_linear(two, std::vector<double>{0, 1}, "byte", {.relative = true});
                  }),
                  "relative weighting needs positive times; sample 0 has t = 0");
}

TEST(LinearFit, MedianRelativeError) {
  const LinearModel m{.alpha = 0, .beta = 1, .r2 = 1, .n = 2, .unit = "byte"};
  // errors 0.25, 0, 0.5 -> median 0.25; with a fourth of 1.0 -> (0.25 + 0.5) / 2
  EXPECT_NEAR(median_relative_error(m, std::vector<double>{5, 2, 2}, std::vector<double>{4, 2, 4}),
              0.25, 1e-12);
  EXPECT_NEAR(
      median_relative_error(m, std::vector<double>{5, 2, 2, 2}, std::vector<double>{4, 2, 4, 1}),
      0.375, 1e-12);
}

namespace {

TaskModel model_of(Task task, double alpha, double beta) {
  TaskModel m;
  m.task = task;
  m.dtype = "f32";
  m.x = {1024, 4096, 16384};
  for (double x : m.x) m.t.push_back(alpha + beta * x);
  m.heldout_x = {2048};
  m.heldout_t = {(alpha + beta * 2048) * 1.1};  // predicted 10% low
  m.fit = fit_linear(m.x, m.t, std::string(task_unit(task)));
  return m;
}

Profile sample_profile() {
  Profile p;
  p.machine = {.device = "cpu",
               .device_name = "Test CPU",
               .host = "host0",
               .backend = "mpi",
               .world_size = 4,
               .ranks_per_node = 2,
               .nodes = 2,
               .date = "2025-01-01T00:00:00Z",
               .xmoe_version = "0.1.0"};
  p.measurement = {.statistic = "min", .warmup = 2, .repetitions = 7};
  TaskModel a2a = model_of(Task::all_to_all_v, 1e-5, 1e-9);
  a2a.ranks = 2;
  TaskModel a2a_inter = model_of(Task::all_to_all_v, 5e-5, 1e-8);
  a2a_inter.link = comm::LinkClass::inter_node;
  a2a_inter.ranks = 2;
  TaskModel small = model_of(Task::gemm_forward, 2e-6, 1e-11);
  small.in = 128, small.out = 256, small.groups = 8;
  TaskModel large = model_of(Task::gemm_forward, 4e-6, 5e-12);
  large.in = 1024, large.out = 512, large.groups = 8;
  TaskModel gather = model_of(Task::gather_rows, 1e-6, 2e-10);
  gather.width = 256;
  TaskModel attention = model_of(Task::attention_forward, 3e-6, 2e-11);
  attention.head_dim = 64, attention.seq_len = 2048;
  TaskModel adamw = model_of(Task::adamw, 1e-6, 1e-10);
  p.models = {a2a, a2a_inter, small, large, gather, attention, adamw};
  return p;
}

}  // namespace

TEST(ProfileFile, RoundTripKeepsEveryField) {
  TempDir dir;
  const Profile p = sample_profile();
  save_profile(p, dir / "profile.json");
  const Profile q = load_profile(dir / "profile.json");
  EXPECT_EQ(profile_to_json(q), profile_to_json(p));
  EXPECT_EQ(q.machine.device_name, "Test CPU");
  EXPECT_EQ(q.machine.ranks_per_node, 2);
  EXPECT_EQ(q.measurement.statistic, "min");
  EXPECT_EQ(q.measurement.repetitions, 7);
  ASSERT_EQ(q.models.size(), 7u);
  EXPECT_EQ(q.models[1].link, comm::LinkClass::inter_node);
  EXPECT_EQ(q.models[3].in, 1024);
  EXPECT_EQ(q.models[4].width, 256);
  EXPECT_EQ(q.models[5].head_dim, 64);
  EXPECT_EQ(q.models[5].seq_len, 2048);
  EXPECT_EQ(q.models[6].task, Task::adamw);
  EXPECT_EQ(q.models[0].fit.alpha, p.models[0].fit.alpha);  // doubles survive exactly
  EXPECT_EQ(q.models[0].fit.beta, p.models[0].fit.beta);
  EXPECT_NEAR(q.models[0].heldout_error(), 0.1 / 1.1, 1e-9);
  EXPECT_NEAR(q.heldout_error(), 0.1 / 1.1, 1e-9);
}

TEST(ProfileFile, PredictsFromTheRightModel) {
  const Profile p = sample_profile();
  EXPECT_NEAR(p.predict_dispatch(1e6, comm::LinkClass::intra_node), 1e-5 + 1e-3, 1e-12);
  EXPECT_NEAR(p.predict_collective(Task::all_to_all_v, comm::LinkClass::inter_node, 1e6),
              5e-5 + 1e-2, 1e-12);
  // 1000x500 is nearest the 1024x512 model; 100x300 nearest 128x256.
  EXPECT_NEAR(p.predict_gemm(Task::gemm_forward, 64, 1000, 500), 4e-6 + 5e-12 * 2 * 64 * 1000 * 500,
              1e-12);
  EXPECT_NEAR(p.predict_gemm(Task::gemm_forward, 64, 100, 300), 2e-6 + 1e-11 * 2 * 64 * 100 * 300,
              1e-12);
  EXPECT_NEAR(p.predict_rows(Task::gather_rows, 1e6), 1e-6 + 2e-4, 1e-12);
  // 4 * pairs * seq^2 * head_dim FLOPs, from the one attention model (nearest shape).
  EXPECT_NEAR(*p.predict_attention(Task::attention_forward, 8, 128, 1024),
              3e-6 + 2e-11 * 4 * 8 * 1024.0 * 1024 * 128, 1e-12);
  EXPECT_FALSE(p.predict_attention(Task::attention_backward, 8, 64, 2048).has_value());
  EXPECT_NEAR(*p.predict_adamw(1000), 1e-6 + 1e-10 * 16000, 1e-15);
  EXPECT_CONTAINS(error_of([&] { p.predict_attention(Task::adamw, 1, 1, 1); }),
                  "adamw is not an attention task");
  EXPECT_CONTAINS(
      error_of([&] { p.predict_collective(Task::all_reduce, comm::LinkClass::intra_node, 1); }),
      "no all_reduce model over intra_node links");
  EXPECT_CONTAINS(error_of([&] { p.predict_gemm(Task::gemm_backward_data, 1, 1, 1); }),
                  "no gemm_backward_data model");
  EXPECT_CONTAINS(error_of([&] { p.predict_rows(Task::scatter_rows, 1); }),
                  "no scatter_rows model");
  EXPECT_CONTAINS(error_of([&] { p.predict_gemm(Task::all_reduce, 1, 1, 1); }),
                  "all_reduce is not a GEMM kind");
}

TEST(ProfileFile, Fp8GemmModelsAnswerOnlyFp8Questions) {
  Profile p = sample_profile();
  // An FP8 model of the exact bf16 shape 1024x512 and an FP8 quantiser.
  TaskModel fp8 = model_of(Task::gemm_forward, 3e-6, 2e-12);
  fp8.in = 128, fp8.out = 256, fp8.groups = 8, fp8.dtype = "fp8";
  TaskModel quantize = model_of(Task::quantize_rows_fp8, 1e-6, 5e-10);
  quantize.width = 256;
  EXPECT_FALSE(p.has_fp8_gemm(Task::gemm_forward));
  EXPECT_FALSE(p.predict_quantize_fp8(1e6).has_value());
  p.models.push_back(fp8);
  p.models.push_back(quantize);
  EXPECT_TRUE(p.has_fp8_gemm(Task::gemm_forward));
  EXPECT_FALSE(p.has_fp8_gemm(Task::gemm_backward_data));
  // bf16 at 128x256 takes the bf16 model of that shape; FP8 at 1024x512 the one FP8 model.
  EXPECT_NEAR(p.predict_gemm(Task::gemm_forward, 64, 128, 256), 2e-6 + 1e-11 * 2 * 64 * 128 * 256,
              1e-12);
  EXPECT_NEAR(p.predict_gemm(Task::gemm_forward, 64, 1024, 512, true),
              3e-6 + 2e-12 * 2 * 64 * 1024 * 512, 1e-12);
  EXPECT_NEAR(*p.predict_quantize_fp8(1e6), 1e-6 + 5e-4, 1e-12);
  EXPECT_CONTAINS(error_of([&] { p.predict_gemm(Task::gemm_backward_data, 1, 8, 8, true); }),
                  "no FP8 gemm_backward_data model (xmoe profile --fp8 measures them)");
  // The file keeps them apart.
  TempDir dir;
  save_profile(p, dir / "fp8.json");
  const Profile q = load_profile(dir / "fp8.json");
  EXPECT_EQ(profile_to_json(q), profile_to_json(p));
  EXPECT_EQ(q.models[7].dtype, "fp8");
  EXPECT_EQ(q.models[8].task, Task::quantize_rows_fp8);
  EXPECT_EQ(q.models[8].width, 256);
}

TEST(ProfileFile, CorruptFilesNameTheFileAndTheKey) {
  TempDir dir;
  const std::string good = profile_to_json(sample_profile());
  const auto load_text = [&](const std::string& text) {
    const std::string path = dir / "p.json";
    std::ofstream(path) << text;
    return error_of([&] { load_profile(path); });
  };
  const auto replace = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  const std::string p = dir / "p.json";
  EXPECT_CONTAINS(load_text("{\"format\": "), p + ": not valid JSON");
  EXPECT_CONTAINS(load_text("[]"), p + ": the top level is not an object");
  // {text in the good file, its replacement, the error expected}
  const std::vector<std::array<std::string, 3>> cases = {
      {"\"xmoe-profile\"", "\"other\"", "format is not 'xmoe-profile'"},
      {"\"version\": 1", "\"version\": 7", "version is 7; this xmoe reads version 1"},
      {"\"beta\":", "\"bet\":", "models[0].fit.beta is missing"},
      {"\"statistic\": \"min\"", "\"statistic\": \"mean\"",
       "measurement.statistic 'mean' is not median or min"},
      {"\"task\": \"all_to_all_v\"", "\"task\": \"all_to_al\"",
       "models[0].task 'all_to_al' is not a task (all_to_all_v, all_gather"},
      {"\"link\": \"intra_node\"", "\"link\": \"rack\"",
       "models[0].link 'rack' is not intra_node or inter_node"},
      {"\"unit\": \"byte\"", "\"unit\": \"flop\"",
       "models[0].fit.unit is 'flop', but all_to_all_v counts bytes"},
      {"\"world_size\": 4", "\"world_size\": \"4\"",
       "machine.world_size is not a whole number >= 1"},
      {"\"n\": 3", "\"n\": 4", "models[0].fit.n is 4, but models[0].samples has 3"},
      {"\"in\": 128", "\"in\": 0", "models[2].in is not a whole number >= 1"},
      {"\"head_dim\": 64", "\"head_dim\": -1", "models[5].head_dim is not a whole number >= 1"},
      {"\"samples\": [", "\"samples\": [[1, -2], ",
       "models[0].samples[0] is not an [x, seconds] pair of positive numbers"},
  };
  for (const auto& [from, to, error] : cases)
    EXPECT_CONTAINS(load_text(replace(from, to)), p + ": " + error);
  EXPECT_CONTAINS(error_of([&] { load_profile(dir / "none.json"); }), "none.json");
}

TEST(Profiler, QuickOneProcessProfileFitsTheComputeTasks) {
  int steps = 0, total = 0;
  ProfileOptions o;
  o.quick = true;
  o.gemm_shapes = {{32, 48}};
  o.statistic = "min";
  o.progress = [&](const ProfileProgress& p) {
    EXPECT_EQ(p.done, steps + 1);
    steps = p.done;
    total = p.total;
  };
  const Profile p = run_profile(comm::make_single_group(), Device::cpu(), o);
  EXPECT_EQ(steps, total);
  EXPECT_EQ(p.machine.world_size, 1);
  EXPECT_EQ(p.machine.device, "cpu");
  EXPECT_FALSE(p.machine.date.empty());
  EXPECT_EQ(p.measurement.statistic, "min");
  EXPECT_EQ(p.measurement.repetitions, 5);
  // One rank: no collective to time; 3 GEMM kinds of one shape, attention forward and backward
  // of one shape, the 2 row tasks and AdamW.
  ASSERT_EQ(p.models.size(), 8u);
  for (const TaskModel& m : p.models) {
    EXPECT_FALSE(is_collective(m.task));
    EXPECT_TRUE(std::isfinite(m.fit.alpha) && m.fit.alpha >= 0) << task_name(m.task);
    // beta > 0 on a quiet machine; on one loaded by other builds the small quick sizes may
    // time flat, so only its sign is checked.
    EXPECT_TRUE(std::isfinite(m.fit.beta) && m.fit.beta >= 0) << task_name(m.task);
    for (double t : m.t) EXPECT_GT(t, 0.0) << task_name(m.task);
    EXPECT_TRUE(std::isfinite(m.fit.r2)) << task_name(m.task);
    EXPECT_GE(m.fit.n, 5);
    EXPECT_FALSE(m.heldout_x.empty());
  }
  EXPECT_EQ(p.models[0].in, 32);
  EXPECT_EQ(p.models[0].x.front(), 2.0 * 16 * 32 * 48);  // 16 rows
  EXPECT_TRUE(std::isfinite(p.heldout_error()));
  EXPECT_GE(p.predict_gemm(Task::gemm_forward, 4096, 32, 48),
            p.predict_gemm(Task::gemm_forward, 16, 32, 48));
}

TEST(Profiler, Fp8MeasuresTheFp8ExpertsGemmsAndQuantiser) {
  ProfileOptions o;
  o.quick = true;
  o.fp8 = true;
  o.gemm_shapes = {{128, 256}};
  o.attention_shapes = {{16, 32}};
  int steps = 0, total = 0;
  o.progress = [&](const ProfileProgress& p) { steps = p.done, total = p.total; };
  const Profile p = run_profile(comm::make_single_group(), Device::cpu(), o);
  EXPECT_EQ(steps, total);
  // The 8 models of the default profile, FP8 forward and data gradient, the quantiser.
  ASSERT_EQ(p.models.size(), 11u);
  int fp8_gemms = 0;
  for (const TaskModel& m : p.models) {
    if (is_gemm(m.task) && m.dtype == "fp8") {
      ++fp8_gemms;
      EXPECT_NE(m.task, Task::gemm_backward_weight);  // FP8 experts' weight gradient is bf16
      EXPECT_EQ(m.in, 128);
      EXPECT_EQ(m.out, 256);
    }
    EXPECT_TRUE(std::isfinite(m.fit.beta) && m.fit.beta >= 0) << task_name(m.task);
  }
  EXPECT_EQ(fp8_gemms, 2);
  EXPECT_TRUE(p.has_fp8_gemm(Task::gemm_forward) && p.has_fp8_gemm(Task::gemm_backward_data));
  const TaskModel* q = p.find(Task::quantize_rows_fp8, comm::LinkClass::intra_node);
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->width, 256);
  EXPECT_EQ(q->fit.unit, "byte");
  EXPECT_GT(p.predict_gemm(Task::gemm_forward, 4096, 128, 256, true), 0.0);
}

TEST(Profiler, GemmShapeFlag) {
  const GemmShape s = parse_gemm_shape("1024x512", "--gemm-shape");
  EXPECT_EQ(s.in, 1024);
  EXPECT_EQ(s.out, 512);
  for (const char* bad : {"1024", "x512", "1024x", "10x-2", "4y4", "0x3", "3x4x5"})
    EXPECT_CONTAINS(error_of([&] { parse_gemm_shape(bad, "--gemm-shape"); }),
                    fmt::format("--gemm-shape '{}' is not INxOUT", bad));
}

// ---- The pipelined layer's chunk count (sched/pipeline_plan.h)
// -----------------------------------

namespace {

/// Linear models of every task the pipeline formula reads: all-to-all-v at `a2a_beta` s/byte
/// (intra-node, 2 ranks), GEMMs at `gemm_beta` s/FLOP, gathers at 0.1 ns/byte.
Profile pipeline_profile(double a2a_beta, double gemm_beta) {
  Profile p = sample_profile();
  TaskModel a2a = model_of(Task::all_to_all_v, 2e-5, a2a_beta);
  a2a.ranks = 2;
  TaskModel gather = model_of(Task::gather_rows, 1e-6, 1e-10);
  gather.width = 64;
  p.models = {a2a, gather};
  for (Task t : {Task::gemm_forward, Task::gemm_backward_data, Task::gemm_backward_weight}) {
    TaskModel m = model_of(t, 5e-6, gemm_beta);
    m.in = 64, m.out = 128, m.groups = 8;
    p.models.push_back(m);
  }
  return p;
}

PipelineShape shape_of(int ep) {
  return {.rows = 4096 * 4, .d_model = 64, .expert_hidden = 64, .local_experts = 8, .ep = ep};
}

}  // namespace

TEST(PipelinePlan, TheFormulaOverlapsTheSlowerSide) {
  const ChunkTimes t{.dispatch = 3, .experts = 4, .combine = 2};
  EXPECT_DOUBLE_EQ(predict_pipelined(t, 1), 9);          // d + e + c
  EXPECT_DOUBLE_EQ(predict_pipelined(t, 3), 9 + 2 * 5);  // communication bound: r (d+c) + e
  const ChunkTimes compute{.dispatch = 1, .experts = 4, .combine = 1};
  EXPECT_DOUBLE_EQ(predict_pipelined(compute, 4), 6 + 3 * 4);  // d + r e + c
}

TEST(PipelinePlan, ChunkTimesFollowTheModels) {
  const Profile p = pipeline_profile(1e-9, 1e-11);
  const PipelineShape s = shape_of(2);
  const ChunkTimes one = predict_chunk(p, s, 1, false), two = predict_chunk(p, s, 2, false);
  const double bytes = 4096.0 * 4 * 64 * 4;
  EXPECT_NEAR(one.dispatch, 2e-5 + 1e-9 * bytes, 1e-12);
  EXPECT_NEAR(two.dispatch, 2e-5 + 1e-9 * bytes / 2, 1e-12);
  EXPECT_DOUBLE_EQ(one.dispatch, one.combine);
  // forward: two projections of 2 n d 2f and 2 n f d FLOPs and two permutations; backward:
  // four GEMMs
  const double flops = 2.0 * 4096 * 4 * 64 * 64 * 3, permute = 2 * (1e-6 + 1e-10 * bytes);
  EXPECT_NEAR(one.experts, permute + 2 * 5e-6 + 1e-11 * flops, 1e-12);
  EXPECT_NEAR(predict_chunk(p, s, 1, true).experts, permute + 4 * 5e-6 + 2e-11 * flops, 1e-12);
  // one rank: nothing moves
  EXPECT_EQ(predict_chunk(p, shape_of(1), 1, false).dispatch, 0.0);
}

TEST(PipelinePlan, Fp8ExpertsTimeTheirForwardAndDataGradientOnFp8Models) {
  Profile p = pipeline_profile(1e-9, 1e-11);
  // FP8 models 4x faster; the weight gradient has none (it stays bf16).
  for (Task t : {Task::gemm_forward, Task::gemm_backward_data}) {
    TaskModel m = model_of(t, 5e-6, 0.25e-11);
    m.in = 64, m.out = 128, m.groups = 8, m.dtype = "fp8";
    p.models.push_back(m);
  }
  PipelineShape s = shape_of(2);
  s.fp8 = true;
  const double bytes = 4096.0 * 4 * 64 * 4, permute = 2 * (1e-6 + 1e-10 * bytes);
  const double flops = 2.0 * 4096 * 4 * 64 * 64 * 3;
  EXPECT_NEAR(predict_chunk(p, s, 1, false).experts, permute + 2 * 5e-6 + 0.25e-11 * flops, 1e-12);
  // backward: the data gradient at the FP8 rate, the weight gradient at bf16's
  EXPECT_NEAR(predict_chunk(p, s, 1, true).experts, permute + 4 * 5e-6 + (0.25e-11 + 1e-11) * flops,
              1e-12);
  // A run with FP8 experts whose profile has no FP8 models takes the default and says why.
  TempDir dir;
  save_profile(pipeline_profile(2e-9, 3e-11), dir / "profile.json");
  Config c;
  c.train.out_dir = dir.str();
  c.model.moe.num_experts = 16;
  c.model.moe.pipeline = "auto";
  c.model.moe.expert_dtype = "fp8";
  const PipelineChoice chosen = resolve_pipeline(c, 4096, 2, 1, 4);
  EXPECT_EQ(chosen.forward, 2);
  EXPECT_CONTAINS(chosen.source, "xmoe profile --fp8");
}

TEST(PipelinePlan, ChoosesChunksWhereTheyPay) {
  // Exchange and experts of similar cost: chunks hide one behind the other.
  const Profile balanced = pipeline_profile(2e-9, 3e-11);
  const PipelineChoice c = choose_pipeline(&balanced, shape_of(2));
  EXPECT_GT(c.forward, 1);
  EXPECT_GT(c.backward, 1);
  ASSERT_EQ(c.forward_seconds.size(), 8u);
  EXPECT_LT(c.forward_seconds[c.forward - 1], c.forward_seconds[0]);
  for (double t : c.forward_seconds) EXPECT_GE(t, c.forward_seconds[c.forward - 1]);
  // One rank: nothing to hide, every chunk adds start-ups.
  EXPECT_EQ(choose_pipeline(&balanced, shape_of(1)).forward, 1);
  // Start-ups that dwarf the transfer: one chunk.
  Profile slow_start = pipeline_profile(1e-13, 1e-14);
  EXPECT_EQ(choose_pipeline(&slow_start, shape_of(2)).forward, 1);
  // At most one chunk per local expert.
  PipelineShape few = shape_of(2);
  few.local_experts = 3;
  EXPECT_EQ(choose_pipeline(&balanced, few).forward_seconds.size(), 3u);
  // No profile: the documented default.
  const PipelineChoice d = choose_pipeline(nullptr, shape_of(4));
  EXPECT_EQ(d.forward, 2);
  EXPECT_EQ(d.backward, 2);
  EXPECT_EQ(choose_pipeline(nullptr, shape_of(1)).forward, 1);
}

TEST(PipelinePlan, ResolvesTheConfigKeys) {
  TempDir dir;
  Config c;
  c.train.out_dir = dir.str();
  c.model.moe.num_experts = 16;
  c.model.moe.pipeline = "3";
  PipelineChoice p = resolve_pipeline(c, 256, 2, 1, 4);
  EXPECT_EQ(p.forward, 3);
  EXPECT_EQ(p.backward, 3);  // same
  c.model.moe.pipeline_backward = "off";
  EXPECT_EQ(resolve_pipeline(c, 256, 2, 1, 4).backward, 1);
  c.model.moe.pipeline = "auto";  // no profile anywhere: the default
  c.model.moe.pipeline_backward = "same";
  p = resolve_pipeline(c, 256, 2, 1, 4);
  EXPECT_EQ(p.forward, 2);
  EXPECT_NE(p.source.find("no profile"), std::string::npos) << p.source;
  // A profile in the run folder is found; one named by the key is read.
  save_profile(pipeline_profile(2e-9, 3e-11), dir / "profile.json");
  p = resolve_pipeline(c, 4096, 2, 1, 4);
  EXPECT_NE(p.source.find("profile.json"), std::string::npos) << p.source;
  EXPECT_EQ(p.forward_seconds.size(), 8u);
  EXPECT_NE(p.summary().find("predicted forward"), std::string::npos) << p.summary();
  c.model.moe.pipeline_profile = dir / "missing.json";
  EXPECT_THROW(resolve_pipeline(c, 256, 2, 1, 4), Error);
  c.model.moe.pipeline_profile = "";
  c.model.moe.pipeline = "three";
  try {
    resolve_pipeline(c, 256, 2, 1, 4);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.moe.pipeline = 'three'"), std::string::npos)
        << e.what();
  }
}

// parallel.grad_partition: the pieces from given all-reduce and backward times.
namespace {

/// t = alpha + beta * bytes.
LinearModel all_reduce_model(double alpha, double beta) {
  LinearModel m;
  m.alpha = alpha;
  m.beta = beta;
  m.unit = "byte";
  return m;
}

/// `n` modules of `idle` seconds and `bytes` gradient bytes each.
std::vector<GradModule> uniform_modules(int n, double idle, int64_t bytes) {
  std::vector<GradModule> out;
  for (int i = 0; i < n; ++i) {
    std::string name = "m";
    name += std::to_string(i);
    out.push_back({name, idle, bytes});
  }
  return out;
}

/// The pieces cover the modules with gradients in order, without gaps, and carry their bytes.
void expect_contiguous(const GradPartition& g, std::span<const GradModule> modules) {
  int64_t total = 0, covered = 0;
  for (const GradModule& m : modules) total += m.grad_bytes;
  int next = 0;
  for (const GradPiece& p : g.pieces) {
    EXPECT_EQ(p.first, next);
    EXPECT_LE(p.first, p.last);
    int64_t bytes = 0;
    for (int m = p.first; m <= p.last; ++m) bytes += modules[static_cast<size_t>(m)].grad_bytes;
    EXPECT_EQ(p.bytes, bytes);
    EXPECT_GT(p.bytes, 0);
    covered += p.bytes;
    next = p.last + 1;
  }
  EXPECT_EQ(covered, total);
  for (size_t i = 1; i < g.pieces.size(); ++i) {
    EXPECT_GE(g.pieces[i].start, g.pieces[i - 1].end);  // one channel, in order
    EXPECT_GE(g.pieces[i].start, g.pieces[i - 1].start);
  }
}

}  // namespace

TEST(GradPartition, PiecesHideInTheBackwardThatFollows) {
  // 8 modules of 1 ms compute and 1 MB each at 2 GB/s and 0.1 ms start-up: a module's
  // all-reduce (0.6 ms) fits the next module's compute, and only what the last module finishes
  // is left after backward.
  const auto modules = uniform_modules(8, 1e-3, 1000000);
  const LinearModel ar = all_reduce_model(1e-4, 5e-10);
  const GradPartition g = partition_gradients(modules, ar);
  expect_contiguous(g, modules);
  EXPECT_NEAR(g.backward_seconds, 8e-3, 1e-12);
  ASSERT_GE(g.pieces.size(), 2u);
  EXPECT_EQ(g.pieces.back().last, 7);
  // The least possible: the last module's gradients cannot start before backward ends.
  EXPECT_NEAR(g.exposed_seconds, ar.predict(1e6), 1e-9);
  EXPECT_NEAR(g.exposed_unpartitioned, ar.predict(8e6), 1e-12);
  // Every piece but the last ends inside backward.
  for (size_t i = 0; i + 1 < g.pieces.size(); ++i) EXPECT_LE(g.pieces[i].end, g.backward_seconds);
  // No other partition of these modules ends earlier: compare against every split of 8
  // modules (2^7), predicted the same way.
  double best = 1e9;
  for (int mask = 0; mask < 128; ++mask) {
    GradPartition other;
    int first = 0;
    for (int m = 0; m < 8; ++m) {
      if (m == 7 || (mask >> m & 1)) {
        other.pieces.push_back({first, m, int64_t{1000000} * (m - first + 1)});
        first = m + 1;
      }
    }
    predict_pieces(other, modules, ar);
    best = std::min(best, other.exposed_seconds);
  }
  EXPECT_NEAR(g.exposed_seconds, best, 1e-12);
  EXPECT_NE(g.summary(modules).find("m0"), std::string::npos) << g.summary(modules);
}

TEST(GradPartition, SlowLinksMergeAndFastOnesSplit) {
  const auto modules = uniform_modules(6, 1e-3, 1000000);
  // Start-ups that dwarf compute: one all-reduce is cheapest (any split pays alpha again).
  const GradPartition slow = partition_gradients(modules, all_reduce_model(1.0, 1e-12));
  ASSERT_EQ(slow.pieces.size(), 1u);
  expect_contiguous(slow, modules);
  // Infinite bandwidth, no start-up: nothing is exposed (and one piece suffices).
  const GradPartition free = partition_gradients(modules, all_reduce_model(0, 0));
  EXPECT_EQ(free.exposed_seconds, 0.0);
  EXPECT_EQ(free.pieces.size(), 1u);
  // A tiny start-up and a transfer of half a window: pieces of up to two modules, the last alone.
  const GradPartition fast = partition_gradients(modules, all_reduce_model(1e-7, 5e-10));
  EXPECT_GT(fast.pieces.size(), 2u);
  EXPECT_EQ(fast.pieces.back().first, 5);
  EXPECT_NEAR(fast.exposed_seconds, 1e-7 + 5e-10 * 1e6, 1e-12);
  for (const GradPiece& p : fast.pieces) EXPECT_LE(p.last - p.first, 1);
  // Tiny gradients: everything the earlier modules make in one piece hidden in the last
  // module's backward, and the last module's alone after it.
  const GradPartition tiny =
      partition_gradients(uniform_modules(6, 1e-3, 16), all_reduce_model(1e-4, 1e-9));
  ASSERT_EQ(tiny.pieces.size(), 2u);
  EXPECT_EQ(tiny.pieces[0].last, 4);
}

TEST(GradPartition, DegenerateModules) {
  const LinearModel ar = all_reduce_model(1e-5, 1e-9);
  // No module, or no gradients: no piece, nothing exposed.
  EXPECT_TRUE(partition_gradients({}, ar).pieces.empty());
  const auto none = uniform_modules(3, 1e-3, 0);
  EXPECT_TRUE(partition_gradients(none, ar).pieces.empty());
  EXPECT_EQ(partition_gradients(none, ar).exposed_seconds, 0.0);
  // Modules without gradients (a norm-free block) go into the next piece.
  std::vector<GradModule> gaps = uniform_modules(5, 1e-3, 1000000);
  gaps[0].grad_bytes = gaps[2].grad_bytes = 0;
  const GradPartition g = partition_gradients(gaps, ar);
  expect_contiguous(g, gaps);
  EXPECT_EQ(g.pieces.front().first, 0);
  // No compute to hide behind (no MoE layer, nothing timed): everything after backward, in
  // one piece.
  const GradPartition flat = partition_gradients(uniform_modules(4, 0, 1000), ar);
  EXPECT_EQ(flat.pieces.size(), 1u);
  EXPECT_NEAR(flat.exposed_seconds, ar.predict(4000), 1e-15);
  // The default without a profile: one piece per module with gradients.
  const GradPartition d = partition_per_module(gaps);
  EXPECT_EQ(d.pieces.size(), 3u);
  expect_contiguous(d, gaps);
  EXPECT_NE(error_of([&] { partition_gradients(gaps, all_reduce_model(-1, 0)); }).find("alpha"),
            std::string::npos);
}

TEST(GradPartition, ResolvesFromTheRunsProfile) {
  TempDir dir;
  Config c;
  c.train.out_dir = dir.str();
  c.model.num_layers = 3;
  c.model.first_dense_layers = 1;
  c.model.moe.num_experts = 8;
  std::vector<GradModule> modules;
  for (const char* name : {"lm_head", "final_norm", "block 2", "block 1", "block 0", "embedding"})
    modules.push_back({name, 0, 100000});
  const BackwardShape shape{.batch = 8, .seq_len = 64, .ep = 2};
  // No profile: one piece per module.
  GradPartition g = resolve_grad_partition(c, modules, shape, comm::LinkClass::intra_node);
  EXPECT_EQ(g.pieces.size(), modules.size());
  EXPECT_NE(g.source.find("no profile"), std::string::npos) << g.source;
  // A profile without an all-reduce model: the default, saying what is missing.
  Profile p = pipeline_profile(2e-9, 3e-11);
  TaskModel scatter = model_of(Task::scatter_rows, 1e-6, 1e-10);
  scatter.width = 64;
  p.models.push_back(scatter);
  save_profile(p, dir / "profile.json");
  g = resolve_grad_partition(c, modules, shape, comm::LinkClass::intra_node);
  EXPECT_NE(g.source.find("all_reduce"), std::string::npos) << g.source;
  EXPECT_EQ(g.pieces.size(), modules.size());
  // With one: timed modules, partitioned by the model.
  TaskModel ar = model_of(Task::all_reduce, 1e-3, 1e-9);
  ar.ranks = 2;
  p.models.push_back(ar);
  save_profile(p, dir / "profile.json");
  g = resolve_grad_partition(c, modules, shape, comm::LinkClass::intra_node);
  EXPECT_NE(g.source.find("profile.json"), std::string::npos) << g.source;
  EXPECT_GT(g.backward_seconds, 0);
  expect_contiguous(g, modules);
  const std::vector<double> idle = predict_backward_idle(p, c.model, shape);
  ASSERT_EQ(idle.size(), modules.size());
  for (double t : idle) EXPECT_GT(t, 0);
  EXPECT_NE(g.summary(modules).find("exposed sync"), std::string::npos) << g.summary(modules);
  // Tied embeddings: no LM head module.
  c.model.tie_embeddings = true;
  EXPECT_EQ(predict_backward_idle(p, c.model, shape).size(), modules.size() - 1);
}
