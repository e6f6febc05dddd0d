// The region profiler (core/profile.h): nesting, aggregation by name under a parent, reset,
// off records nothing; and the regions a training step of a micro MoE model reports. The device
// timeline's analysis (core/device_timeline.h) on records made up here.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "training_fixture.h"
#include "xmoe/core/allocator.h"
#include "xmoe/core/device_timeline.h"
#include "xmoe/core/env.h"
#include "xmoe/core/profile.h"
#include "xmoe/model/transformer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/optim/clip.h"

using namespace xmoe;

namespace {

class Profile : public ::testing::Test {
 protected:
  void SetUp() override {
    profiling::enable(false);
    profiling::reset();
  }
  // Other tests of the binary run with the profiler as they found it: off.
  void TearDown() override {
    profiling::enable(false);
    profiling::reset();
  }
};

std::map<std::string, profiling::Region> by_path() {
  std::map<std::string, profiling::Region> m;
  for (const profiling::Region& r : profiling::report()) m[r.path] = r;
  return m;
}

Tensor make_ids(int64_t b, int64_t s, int64_t vocab, int32_t offset) {
  std::vector<int32_t> v(static_cast<size_t>(b * s));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<int32_t>((i * 7 + static_cast<size_t>(offset)) % vocab);
  return Tensor::from_vector<int32_t>(v, {b, s});
}

// One training step as bench_train_step runs it, inside a "step" region.
void train_step(model::Transformer& m, optim::AdamW& opt, const std::vector<Parameter*>& params) {
  const Tensor ids = make_ids(2, 8, 11, 0), targets = make_ids(2, 8, 11, 3);
  ProfileScope scope("step", Device::cpu());
  m.zero_grad();
  m.forward_loss(ids, targets);
  m.backward(1.0f);
  const double norm = optim::grad_norm(params);
  optim::scale_grads(params, optim::clip_factor(norm, 1e-3f));  // tiny max norm: clips
  opt.step(1e-3f);
  for (moe::MoELayer* l : m.moe_layers()) l->update_routing_bias();
}

}  // namespace

// First in the file: no test has called enable() yet. ctest runs it once more under
// XMOE_PROFILE=1 (tests/CMakeLists.txt).
TEST(ProfileEnv, DefaultFollowsXmoeProfile) {
  const bool on = env::flag("XMOE_PROFILE");
  EXPECT_EQ(profiling::enabled(), on);
  profiling::reset();
  { ProfileScope scope("region", Device::cpu()); }
  EXPECT_EQ(profiling::report().size(), on ? 1u : 0u);
  profiling::enable(false);
  profiling::reset();
}

TEST_F(Profile, NestedScopesAggregateByNameUnderTheirParent) {
  profiling::enable(true);
  for (int i = 0; i < 3; ++i) {
    ProfileScope outer("outer", Device::cpu());
    for (int j = 0; j < 2; ++j) {
      ProfileScope inner("inner", Device::cpu());
      ProfileScope leaf("leaf", Device::cpu());
    }
  }
  {
    ProfileScope inner("inner", Device::cpu());  // the same name at the top: another region
  }
  const auto r = by_path();
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r.at("outer").calls, 3);
  EXPECT_EQ(r.at("outer").depth, 0);
  EXPECT_EQ(r.at("outer").parent, "");
  EXPECT_EQ(r.at("outer/inner").calls, 6);
  EXPECT_EQ(r.at("outer/inner").name, "inner");
  EXPECT_EQ(r.at("outer/inner").parent, "outer");
  EXPECT_EQ(r.at("outer/inner/leaf").calls, 6);
  EXPECT_EQ(r.at("outer/inner/leaf").depth, 2);
  EXPECT_EQ(r.at("inner").calls, 1);
  // Inclusive: a child interval lies inside its parent's, measured on the same clock.
  EXPECT_LE(r.at("outer/inner").total_ms, r.at("outer").total_ms);
  EXPECT_LE(r.at("outer/inner/leaf").total_ms, r.at("outer/inner").total_ms);
  EXPECT_DOUBLE_EQ(r.at("outer").self_ms, r.at("outer").total_ms - r.at("outer/inner").total_ms);
  // Sorted by total, largest first.
  const auto rep = profiling::report();
  for (size_t i = 1; i < rep.size(); ++i) EXPECT_GE(rep[i - 1].total_ms, rep[i].total_ms);
  const std::string table = profiling::report_table();
  EXPECT_NE(table.find("outer"), std::string::npos);
  EXPECT_NE(table.find("    leaf"), std::string::npos) << table;  // indented by depth
}

// Each region's peak is the highest live bytes inside it; a nested region does not hide the
// enclosing one's earlier high-water mark, and the allocator's own peak survives the scopes.
TEST_F(Profile, RegionsRecordTheirPeakLiveBytes) {
  profiling::enable(true);
  const Device cpu = Device::cpu();
  const int64_t base = memory_stats(cpu).live_bytes;
  reset_peak_memory(cpu);
  {
    ProfileScope outer("outer", cpu);
    { Tensor big = Tensor::empty({1 << 20}, DType::f32, cpu); }  // 4 MiB, freed
    {
      ProfileScope inner("inner", cpu);
      Tensor small = Tensor::empty({1 << 10}, DType::f32, cpu);  // 4 KiB
    }
  }
  const auto r = by_path();
  EXPECT_GE(r.at("outer").peak_bytes, base + (4 << 20));
  EXPECT_GE(r.at("outer/inner").peak_bytes, base + (4 << 10));
  EXPECT_LT(r.at("outer/inner").peak_bytes, base + (4 << 20));
  EXPECT_GE(memory_stats(cpu).peak_bytes, base + (4 << 20));
  EXPECT_NE(profiling::report_table().find("peak MiB"), std::string::npos);
}

TEST_F(Profile, ResetForgetsRegionsAndScopesOpenAcrossIt) {
  profiling::enable(true);
  {
    ProfileScope a("a", Device::cpu());
    profiling::reset();
    ProfileScope b("b", Device::cpu());  // opened after the reset: top level, not under "a"
  }
  const auto r = by_path();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r.count("b"), 1u);
  profiling::reset();
  EXPECT_TRUE(profiling::report().empty());
}

TEST_F(Profile, ScopeOpenWhenTurnedOffStillRecordsItsEnd) {
  profiling::enable(true);
  {
    ProfileScope a("a", Device::cpu());
    profiling::enable(false);
    ProfileScope b("b", Device::cpu());  // off: not recorded
  }
  const auto r = by_path();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r.at("a").calls, 1);
}

TEST_F(Profile, OffRecordsNothing) {
  model::Transformer m(xmoe::testing::micro_model(), 7);
  const auto params = m.parameters();
  optim::AdamW opt(params, {});
  train_step(m, opt, params);
  EXPECT_TRUE(profiling::report().empty());
}

TEST_F(Profile, TrainingStepReportsEveryModuleAndStage) {
  // Layer 0 dense, layer 1 MoE with a shared expert and aux losses: every stage of it runs.
  model::Transformer m(xmoe::testing::micro_model(), 7);
  const auto params = m.parameters();
  optim::AdamW opt(params, {});
  profiling::enable(true);
  const int steps = 2;
  for (int s = 0; s < steps; ++s) train_step(m, opt, params);
  profiling::enable(false);
  const auto r = by_path();

  // Expected regions and their calls per step (2 blocks: one dense, one MoE).
  const std::string f = "step/model.fwd", b = "step/model.bwd";
  const std::string mf = f + "/block.fwd/moe.fwd", mb = b + "/block.bwd/moe.bwd";
  std::map<std::string, int> expected = {
      {"step", 1},  // zero_grad is not a region of the library (the bench adds one)
      {f, 1},
      {f + "/embedding.fwd", 1},
      {f + "/block.fwd", 2},
      {f + "/block.fwd/norm.fwd", 4},
      {f + "/block.fwd/block.attention.fwd", 2},
      {f + "/block.fwd/block.ffn.fwd", 1},
      {mf, 1},
      {f + "/norm.fwd", 1},  // the final norm
      {f + "/lm_head.fwd", 1},
      {"step/cross_entropy.fwd", 1},
      {"step/cross_entropy.bwd", 1},
      {b, 1},
      {b + "/lm_head.bwd", 1},
      {b + "/norm.bwd", 1},
      {b + "/block.bwd", 2},
      {b + "/block.bwd/norm.bwd", 4},
      {b + "/block.bwd/block.attention.bwd", 2},
      {b + "/block.bwd/block.ffn.bwd", 1},
      {mb, 1},
      {b + "/embedding.bwd", 1},
      {"step/optim.grad_norm", 1},
      {"step/optim.clip", 1},
      {"step/optim.adamw", 1},
      {"step/moe.update_bias", 1},
      {mf + "/moe.gate.fwd/moe.aux_loss.fwd", 1},
      {mb + "/moe.gate.bwd/moe.aux_loss.bwd", 1},
  };
  for (const char* stage : {"gate", "order", "dispatch", "expert", "combine", "iorder", "shared"}) {
    expected[mf + "/moe." + stage + ".fwd"] = 1;
    expected[mb + "/moe." + stage + ".bwd"] = 1;
  }
  for (const auto& [path, per_step] : expected) {
    ASSERT_EQ(r.count(path), 1u) << "missing region " << path;
    EXPECT_EQ(r.at(path).calls, per_step * steps) << path;
  }
  EXPECT_EQ(r.size(), expected.size()) << "unexpected regions";

  // Consistency: children sum to at most their parent (exactly on one clock; a tolerance for
  // the rounding of the sums), nothing is negative, and the top level is covered by "step".
  std::map<std::string, double> children;
  for (const auto& [path, reg] : r) {
    EXPECT_GE(reg.total_ms, 0.0) << path;
    if (!reg.parent.empty()) children[reg.parent] += reg.total_ms;
  }
  for (const auto& [parent, sum] : children) {
    ASSERT_EQ(r.count(parent), 1u) << parent;
    const double total = r.at(parent).total_ms;
    EXPECT_LE(sum, total * (1 + 1e-9) + 1e-6) << parent;
    EXPECT_NEAR(r.at(parent).self_ms, total - sum, 1e-6 + 1e-9 * total) << parent;
  }
  // The forward and backward passes are most of a step.
  EXPECT_GT(r.at(f).total_ms + r.at(b).total_ms, 0.0);
}

namespace {
DeviceActivity activity(std::string name, int64_t start, int64_t end, int64_t launch = -1,
                        DeviceActivity::Kind kind = DeviceActivity::Kind::kernel) {
  return {kind, std::move(name), start, end, 7, launch};
}
}  // namespace

// Busy is the union of the intervals (overlapping streams count once); each gap names what ran
// before and after it, and the part of it that passed before the host called the next launch.
TEST(DeviceTimeline, IdleGapsBetweenTheUnionOfActivities) {
  const std::vector<DeviceActivity> records = {
      // given out of order: the analysis sorts by start
      activity("c", 1000, 1100, /*launch=*/950),                  // gap 600..1000: launched at 950
      activity("a", 0, 500),                                      // busy 0..600 with b
      activity("b", 100, 600, -1, DeviceActivity::Kind::memcpy),  // overlaps a
      activity("d", 1100, 1200, /*launch=*/900),                  // no gap
      activity("e", 1500, 1600, /*launch=*/1000,
               DeviceActivity::Kind::memset),      // gap 1200..1500, queued
      activity("c", 1700, 1800, /*launch=*/2000),  // gap 1600..1700, host late (clamped)
  };
  const TimelineSummary s = summarize_timeline(records);
  EXPECT_EQ(s.span_ns, 1800);
  EXPECT_EQ(s.busy_ns, 600 + 200 + 100 + 100);
  EXPECT_EQ(s.idle_ns, 400 + 300 + 100);
  EXPECT_EQ(s.host_late_ns, 350 + 0 + 100);
  EXPECT_EQ(s.kernels, 4);
  EXPECT_EQ(s.memcpys, 1);
  EXPECT_EQ(s.memsets, 1);
  ASSERT_EQ(s.longest.size(), 3u);
  EXPECT_EQ(s.longest[0].ns(), 400);
  EXPECT_EQ(s.longest[0].before, "b");  // b, not a, reaches 600
  EXPECT_EQ(s.longest[0].after, "c");
  EXPECT_EQ(s.longest[0].host_late_ns, 350);
  EXPECT_EQ(s.longest[1].ns(), 300);
  EXPECT_EQ(s.longest[1].before, "d");
  EXPECT_EQ(s.longest[1].after, "e");
  EXPECT_EQ(s.longest[1].host_late_ns, 0);
  ASSERT_EQ(s.idle_before.size(), 2u);
  EXPECT_EQ(s.idle_before[0], (std::pair<std::string, int64_t>{"c", 500}));
  EXPECT_EQ(s.idle_before[1], (std::pair<std::string, int64_t>{"e", 300}));
  ASSERT_EQ(s.by_name.size(), 5u);  // c twice: 200 ns; a 500, b 500 (the first of equals: a)
  EXPECT_EQ(s.by_name[0].name, "a");
  EXPECT_EQ(s.by_name[0].ns, 500);
  EXPECT_EQ(s.by_name[2].name, "c");
  EXPECT_EQ(s.by_name[2].ns, 200);
  EXPECT_EQ(s.by_name[2].count, 2);
  EXPECT_EQ(summarize_timeline(records, 1).longest.size(), 1u);
  EXPECT_EQ(summarize_timeline({}).span_ns, 0);
}

TEST(DeviceTimeline, ShortKernelNames) {
  EXPECT_EQ(short_kernel_name("void xmoe::(anonymous namespace)::gather_rows_kernel<uint4>(uint4*, "
                              "const uint4*, int const*, long)"),
            "gather_rows_kernel<uint4>");
  EXPECT_EQ(short_kernel_name("void cutlass::device_kernel<gemm::GemmUniversal<int, (anonymous "
                              "namespace)::X>>(Params)"),
            "device_kernel<gemm::GemmUniversal<int, (anonymous namespace)::X>>");
  EXPECT_EQ(short_kernel_name("cudnn_generated_fort_native_sdpa_sm90_flash_bprop"),
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop");
  EXPECT_EQ(short_kernel_name("xmoe::adamw_kernel(float*)"), "adamw_kernel");
  EXPECT_EQ(short_kernel_name(std::string(200, 'k'), 20), std::string(17, 'k') + "...");
}
