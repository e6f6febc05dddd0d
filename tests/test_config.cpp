#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "testing.h"
#include "xmoe/config/config.h"
#include "xmoe/core/error.h"

using namespace xmoe;
using xmoe::testing::error_of;
using xmoe::testing::TempDir;

namespace {

// The error of `--set key=value` on the default config.
std::string set_error(const std::string& key_eq_value) {
  Config c;
  return error_of([&] { apply_override(c, key_eq_value); });
}

}  // namespace

TEST(Config, TinyIsTheStructDefaults) {
  EXPECT_TRUE(preset("tiny") == Config{});
  EXPECT_EQ(to_yaml(preset("tiny")), to_yaml(Config{}));
}

TEST(Config, EveryPresetValidates) {
  for (const std::string& name : preset_names()) {
    SCOPED_TRACE(name);
    EXPECT_NO_THROW(validate(preset(name)));
    EXPECT_FALSE(preset_description(name).empty());
  }
}

// Every preset's whole config against tests/data/presets.yaml, recorded from the presets as
// they were written before they became one table (config/presets.cpp): a preset that changes
// any value, a default it inherits included, fails here. After an intended change, copy the
// file this test writes (named in the failure) over tests/data/presets.yaml.
TEST(Config, PresetsAreTheRecordedConfigs) {
  std::string got;
  for (const std::string& name : preset_names())
    got += "# preset: " + name + "\n" + to_yaml(preset(name));
  const auto path = std::filesystem::path(XMOE_SOURCE_DIR) / "tests" / "data" / "presets.yaml";
  std::ifstream in(path);
  const std::string recorded((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  if (got == recorded) return;
  const auto actual = std::filesystem::temp_directory_path() / "xmoe_presets.yaml";
  std::ofstream(actual) << got;
  ADD_FAILURE() << "the presets differ from " << path << " (now: " << actual << ")";
}

TEST(Config, YamlRoundTrip) {
  for (const std::string& name : preset_names()) {
    SCOPED_TRACE(name);
    const Config c = preset(name);
    EXPECT_TRUE(load_config_string(to_yaml(c)) == c) << to_yaml(c);
  }
  Config c;
  c.model.recompute = {"attention", "moe"};
  c.model.moe.router_temperature = 0.1234567f;
  c.train.adam_eps = 1e-12f;
  c.train.seed = 18446744073709551615ull;
  c.data.corpus = "a \"quoted\" path\\with: colon";
  c.model.tie_embeddings = true;
  const Config back = load_config_string(to_yaml(c));
  EXPECT_TRUE(back == c) << to_yaml(c);
  EXPECT_EQ(back.data.corpus, c.data.corpus);
  EXPECT_EQ(back.train.seed, c.train.seed);
  EXPECT_EQ(back.model.recompute, c.model.recompute);
}

TEST(Config, NestedYamlAndPreset) {
  const Config c = load_config_string(R"(
preset: moe-1b
model:
  moe:
    top_k: 4
  recompute: [attention, ffn]
train:
  lr: 2e-3
  device: cuda:1
)");
  EXPECT_EQ(c.model.d_model, 1024);  // from the preset
  EXPECT_EQ(c.model.moe.top_k, 4);
  EXPECT_EQ(c.model.recompute, (std::vector<std::string>{"attention", "ffn"}));
  EXPECT_FLOAT_EQ(c.train.lr, 2e-3f);
  EXPECT_EQ(c.train.device, "cuda:1");
  EXPECT_NO_THROW(validate(c));
}

TEST(Config, LoadFile) {
  const auto path = std::filesystem::temp_directory_path() / "xmoe_test_config.yaml";
  std::ofstream(path) << "model:\n  num_layers: 6\nparallel: {ep: 2}\n";
  const Config c = load_config_file(path.string());
  EXPECT_EQ(c.model.num_layers, 6);
  EXPECT_EQ(c.parallel.ep, 2);
  std::filesystem::remove(path);
  EXPECT_CONTAINS(error_of([] { load_config_file("/nonexistent/x.yaml"); }), "/nonexistent/x.yaml");
}

TEST(Config, UnknownKeySuggestsTheClosest) {
  EXPECT_CONTAINS(error_of([] { load_config_string("model:\n  moe:\n    topk: 6\n"); }),
                  "unknown key 'model.moe.topk' (did you mean 'model.moe.top_k'?)");
  // In the wrong section: found by its last component.
  EXPECT_CONTAINS(error_of([] { load_config_string("train:\n  top_k: 6\n"); }),
                  "unknown key 'train.top_k' (did you mean 'model.moe.top_k'?)");
  EXPECT_CONTAINS(error_of([] { load_config_string("modle:\n  d_model: 6\n"); }),
                  "unknown key 'modle.d_model' (did you mean 'model.d_model'?)");
  Config c;
  EXPECT_CONTAINS(error_of([&] { apply_override(c, "train.lrr=1"); }),
                  "unknown key 'train.lrr' (did you mean 'train.lr'?)");
  const std::string far = error_of([] { load_config_string("zzzzzzzzzzzz: 1\n"); });
  EXPECT_CONTAINS(far, "unknown key 'zzzzzzzzzzzz'");
  EXPECT_EQ(far.find("did you mean"), std::string::npos);
}

TEST(Config, TypeErrorsNameKeyAndValue) {
  EXPECT_CONTAINS(error_of([] { load_config_string("model:\n  moe:\n    top_k: six\n"); }),
                  "model.moe.top_k = 'six' is not a valid int");
  EXPECT_CONTAINS(error_of([] { load_config_string("train:\n  lr: fast\n"); }),
                  "train.lr = 'fast' is not a valid float");
  EXPECT_CONTAINS(error_of([] { load_config_string("model:\n  tie_embeddings: maybe\n"); }),
                  "model.tie_embeddings = 'maybe' is not a valid bool");
  EXPECT_CONTAINS(error_of([] { load_config_string("train:\n  offload_optimizer: maybe\n"); }),
                  "train.offload_optimizer = 'maybe' is not a valid bool");
  EXPECT_CONTAINS(error_of([] { load_config_string("train:\n  seed: -1\n"); }),
                  "train.seed = '-1' is negative; train.seed is a uint64");
  EXPECT_CONTAINS(error_of([] { load_config_string("model:\n  d_model: [1, 2]\n"); }),
                  "model.d_model");
  EXPECT_CONTAINS(error_of([] { load_config_string("model: 3\n"); }), "'model' is a section");
  EXPECT_CONTAINS(error_of([] { load_config_string("model: {d_model: 99999999999}\n"); }),
                  "model.d_model = '99999999999'");
}

TEST(Config, BadPresetNameListsTheNames) {
  const std::string e = error_of([] { preset("moe-2b"); });
  EXPECT_CONTAINS(e, "unknown preset 'moe-2b'");
  EXPECT_CONTAINS(e, "moe-1b");
  EXPECT_CONTAINS(e, "tiny");
  EXPECT_CONTAINS(error_of([] { load_config_string("preset: nope\n"); }), "unknown preset 'nope'");
}

TEST(Config, Overrides) {
  Config c;
  apply_override(c, "model.moe.top_k=6");
  apply_override(c, "train.lr = 1e-4");
  apply_override(c, "model.tie_embeddings=yes");
  apply_override(c, "model.recompute=attention, moe");
  apply_override(c, "train.out_dir=runs/a=b");  // only the first '=' splits
  apply_override(c, "train.seed=42");
  EXPECT_EQ(c.model.moe.top_k, 6);
  EXPECT_FLOAT_EQ(c.train.lr, 1e-4f);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_EQ(c.model.recompute, (std::vector<std::string>{"attention", "moe"}));
  EXPECT_EQ(c.train.out_dir, "runs/a=b");
  EXPECT_EQ(c.train.seed, 42u);
  apply_override(c, "model.recompute=");
  EXPECT_TRUE(c.model.recompute.empty());
  EXPECT_EQ(config_get(c, "model.moe.top_k"), "6");
  EXPECT_CONTAINS(error_of([&] { apply_override(c, "model.moe.top_k"); }), "not key=value");
  EXPECT_CONTAINS(error_of([&] { apply_override(c, "model.moe.top_k=2.5"); }),
                  "model.moe.top_k = '2.5'");
}

TEST(Config, RangeAndCrossKeyErrorsNameKeysAndValues) {
  auto check = [](const char* setting, const std::vector<std::string>& needles) {
    Config c;
    for (const std::string& s : {std::string(setting)}) {
      size_t start = 0;
      while (start < s.size()) {
        const size_t semi = std::min(s.find(';', start), s.size());
        apply_override(c, s.substr(start, semi - start));
        start = semi + 1;
      }
    }
    const std::string e = error_of([&] { validate(c); });
    for (const std::string& n : needles) EXPECT_CONTAINS(e, n);
  };
  check("model.moe.num_experts=8;model.moe.top_k=9",
        {"model.moe.top_k = 9 exceeds model.moe.num_experts = 8"});
  check("model.d_model=250", {"model.d_model = 250 is not divisible by model.num_heads = 4"});
  check("model.d_model=12;model.num_heads=4", {"head dimension", "= 3 is odd"});
  check("model.num_kv_heads=3", {"model.num_heads = 4 is not divisible by model.num_kv_heads = 3"});
  check("parallel.ep=3", {"model.moe.num_experts = 16 is not divisible by parallel.ep = 3"});
  check("model.moe.gate=topk", {"model.moe.gate = \"topk\" is not one of softmax_topk"});
  check("model.moe.gate=switch", {"model.moe.gate = \"switch\"", "model.moe.top_k = 2"});
  check("model.moe.gate=xmoe;model.moe.router_dtype=bf16",
        {"model.moe.router_dtype = \"bf16\" applies to the linear routers"});
  check("model.moe.gate=sigmoid;model.moe.num_groups=3",
        {"model.moe.num_experts = 16 is not divisible by model.moe.num_groups = 3"});
  check("model.moe.gate=sigmoid;model.moe.num_groups=4;model.moe.topk_groups=5",
        {"model.moe.topk_groups = 5 exceeds model.moe.num_groups = 4"});
  check("model.moe.gate=sigmoid;model.moe.num_groups=8;model.moe.topk_groups=1;model.moe.top_k=3",
        {"model.moe.top_k = 3 exceeds the 2 experts reachable"});
  check("model.moe.impl=dense", {"model.moe.impl = \"dense\""});
  check("model.moe.expert_grad_dtype=f16", {"model.moe.expert_grad_dtype = \"f16\""});
  check("model.moe.dispatch=nccl", {"model.moe.dispatch = \"nccl\""});
  check("model.first_dense_layers=5",
        {"model.first_dense_layers = 5 exceeds model.num_layers = 4"});
  check("train.seq_len=512", {"train.seq_len = 512 exceeds model.max_seq_len = 256"});
  check("train.min_lr=0.1", {"train.min_lr = 0.1 exceeds train.lr = 0.003"});
  check("model.recompute=attention,mlp", {"model.recompute entry 'mlp'"});
  check("train.device=gpu", {"train.device = \"gpu\""});
  check("model.moe.top_k=0", {"model.moe.top_k = 0 is outside [1, inf)"});
  check("train.lr=0", {"train.lr = 0.0 is outside (0, inf)"});
  check("data.val_fraction=1", {"data.val_fraction = 1.0 is outside [0, 1)"});
  check("data.corpus=", {"data.corpus is empty"});
  // Several problems are reported together.
  check("model.d_model=250;parallel.ep=3",
        {"2 problems", "model.d_model = 250", "parallel.ep = 3"});
  Config ok;
  ok.train.device = "cuda:3";
  EXPECT_NO_THROW(validate(ok));
}

TEST(Config, KeyTableCoversEveryField) {
  // Changing each key away from its default must change the YAML: a key whose accessor pointed
  // at the wrong member would be caught by a duplicate, and the count guards forgotten fields.
  std::set<std::string> names;
  for (const ConfigKeyInfo& k : config_keys()) {
    EXPECT_TRUE(names.insert(k.name).second) << "duplicate key " << k.name;
    EXPECT_FALSE(k.doc.empty()) << k.name;
    EXPECT_EQ(config_get(Config{}, k.name), k.default_value);
  }
  // 13 model + 28 model.moe + 4 data + 28 train + 11 parallel fields in config.h.
  EXPECT_EQ(config_keys().size(), 13u + 28u + 4u + 28u + 11u);
}

// train.offload_delayed_update_from needs the offloaded optimizer with whole gradient buffers,
// whole (unsharded) weights and nothing else writing them between steps.
TEST(Config, DelayedOffloadUpdateNeedsItsKeys) {
  auto error = [](const std::string& yaml) {
    return error_of([&] { validate(load_config_string(yaml)); });
  };
  const std::string key = "train:\n  offload_delayed_update_from: 2\n";
  const std::string offload = key + "  offload_optimizer: true\n";
  EXPECT_CONTAINS(error(key),
                  "train.offload_delayed_update_from = 2 delays the offloaded update; it needs "
                  "train.offload_optimizer = true");
  EXPECT_CONTAINS(error(offload + "  offload_overlap: false\n"),
                  "train.offload_delayed_update_from = 2 needs train.offload_overlap = true");
  EXPECT_CONTAINS(error(offload + "parallel:\n  zero: 1\n"),
                  "train.offload_delayed_update_from = 2 needs parallel.zero = 0 (got 1)");
  EXPECT_CONTAINS(error(offload + "parallel:\n  expert_placement: affinity\n"),
                  "train.offload_delayed_update_from = 2 needs parallel.expert_placement = none "
                  "(got affinity)");
  EXPECT_CONTAINS(error("train:\n  offload_delayed_update_from: -2\n"),
                  "train.offload_delayed_update_from");
  EXPECT_NO_THROW(validate(load_config_string(offload)));
  EXPECT_EQ(load_config_string(offload).train.offload_delayed_update_from, 2);
  EXPECT_EQ(Config{}.train.offload_delayed_update_from, -1);  // off
}

TEST(Config, ParameterCounts) {
  const ParamCount p = count_parameters(preset("moe-1b").model);
  EXPECT_NEAR(static_cast<double>(p.total), 0.97e9, 0.03 * 0.97e9);
  EXPECT_NEAR(static_cast<double>(p.active), 0.24e9, 0.03 * 0.24e9);
  EXPECT_EQ(p.embedding, 2LL * 32768 * 1024);

  // tiny by hand: d=256, V=256, 4 layers (1 dense), 4 heads = 4 kv heads, E=16 f=128 k=2, 1 shared.
  const int64_t d = 256, emb = 2 * 256 * d, attn = 4 * d * d, norms = 2 * d;
  const int64_t dense = 3 * d * 512, router = d * 16, expert = 3 * d * 128, shared = 3 * d * 128;
  const ParamCount t = count_parameters(Config{}.model);
  EXPECT_EQ(t.total, emb + 4 * (attn + norms) + dense + 3 * (router + 16 * expert + shared) + d);
  EXPECT_EQ(t.active, emb + 4 * (attn + norms) + dense + 3 * (router + 2 * expert + shared) + d);

  // GQA, tied embeddings, the X-MoE gate and the (untrained) sigmoid bias.
  ModelConfig m = Config{}.model;
  m.num_kv_heads = 2;
  m.tie_embeddings = true;
  m.moe.gate = "xmoe";
  const ParamCount g = count_parameters(m);
  const int64_t attn_gqa = 2 * d * d + 2 * d * (2 * 64);
  const int64_t router_x = d * 16 + 16 * 16 + 1;
  EXPECT_EQ(g.total,
            256 * d + 4 * (attn_gqa + norms) + dense + 3 * (router_x + 16 * expert + shared) + d);
  m.moe.gate = "sigmoid";
  m.tie_embeddings = false;
  m.num_kv_heads = 4;
  EXPECT_EQ(count_parameters(m).total, t.total);

  // Real shapes land near their published sizes.
  EXPECT_NEAR(count_parameters(preset("deepseek-moe-16b").model).total / 1e9, 16.4, 0.3);
  EXPECT_NEAR(count_parameters(preset("mixtral-8x7b").model).total / 1e9, 46.7, 0.3);
  EXPECT_NEAR(count_parameters(preset("mixtral-8x7b").model).active / 1e9, 12.9, 0.3);
  EXPECT_NEAR(count_parameters(preset("xmoe-small").model).total / 1e9, 10.1, 0.5);
  EXPECT_NEAR(count_parameters(preset("xmoe-medium").model).total / 1e9, 55, 2.5);
  EXPECT_NEAR(count_parameters(preset("xmoe-large").model).total / 1e9, 545, 25);
}

TEST(Config, ReferenceDocIsUpToDate) {
  const std::string md = config_reference_markdown();
  for (const ConfigKeyInfo& k : config_keys()) EXPECT_CONTAINS(md, "`" + k.name + "`");
  const auto path = std::filesystem::path(XMOE_SOURCE_DIR) / "docs" / "config.md";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path << " is missing; write it with `xmoe config keys > docs/config.md`";
  const std::string committed((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
  EXPECT_EQ(committed, md) << path
                           << " is stale; regenerate it with `xmoe config keys > docs/config.md`";
}

TEST(Config, ShippedConfigFilesLoadAndValidate) {
  const auto dir = std::filesystem::path(XMOE_SOURCE_DIR) / "configs";
  int n = 0;
  if (std::filesystem::is_directory(dir))
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (e.path().extension() == ".yaml" || e.path().extension() == ".yml") {
        SCOPED_TRACE(e.path().string());
        EXPECT_NO_THROW(validate(load_config_file(e.path().string())));
        ++n;
      }
  if (n == 0) GTEST_SKIP() << "no configs/*.yaml";
}

// ---- config input a careless user trips on (issue 38) ------------------------------------

TEST(Config, LoadFileRefusesADirectory) {
  TempDir tmp;
  const std::string e = error_of([&] { load_config_file(tmp.str()); });
  EXPECT_CONTAINS(e, "[config] " + tmp.str() + " is a directory, not a YAML file");
}

TEST(Config, LoadFileRefusesAnEmptyFile) {
  TempDir tmp;
  for (const char* text : {"", "   \n\n\t\n", "# all commented out\n#train:\n#  steps: 5\n"}) {
    SCOPED_TRACE(text);
    const std::string path = tmp / "run.yaml";
    std::ofstream(path) << text;
    EXPECT_CONTAINS(error_of([&] { load_config_file(path); }), "[config] " + path + " is empty");
  }
  // Internal YAML text (e.g. a checkpoint's) may still be empty: the defaults.
  EXPECT_TRUE(load_config_string("") == Config{});
}

TEST(Config, DuplicateKeysAreRefused) {
  // A repeated section.
  EXPECT_CONTAINS(
      error_of([] { load_config_string("train: {steps: 1}\ntrain: {steps: 2}\n", "a.yaml"); }),
      "[config] a.yaml: key 'train' appears twice (lines 1 and 2)");
  // A repeated key inside one map, named by its dotted path.
  EXPECT_CONTAINS(
      error_of([] { load_config_string("train:\n  steps: 1\n  lr: 0.1\n  steps: 2\n"); }),
      "key 'train.steps' appears twice (lines 2 and 4)");
  EXPECT_CONTAINS(
      error_of([] { load_config_string("model:\n  moe:\n    top_k: 1\n    top_k: 2\n"); }),
      "key 'model.moe.top_k' appears twice (lines 3 and 4)");
  EXPECT_CONTAINS(error_of([] { load_config_string("model: {moe: {top_k: 1, top_k: 2}}\n"); }),
                  "key 'model.moe.top_k' appears twice (both on line 1)");
  EXPECT_CONTAINS(error_of([] { load_config_string("preset: tiny\npreset: moe-1b\n"); }),
                  "key 'preset' appears twice");
  // From a file, the error names the file.
  TempDir tmp;
  const std::string path = tmp / "dup.yaml";
  std::ofstream(path) << "parallel:\n  ep: 2\nparallel:\n  ep: 4\n";
  EXPECT_CONTAINS(error_of([&] { load_config_file(path); }),
                  path + ": key 'parallel' appears twice (lines 1 and 3)");
  // The same leaf name in different sections is not a duplicate.
  EXPECT_NO_THROW(
      load_config_string("model: {vocab_size: 256}\ntrain: {steps: 3}\nparallel: {ep: 1}\n"));
}

TEST(Config, UnsignedKeysRefuseNegativeValues) {
  for (const char* v : {"-1", "-18446744073709551615", " -5"}) {
    SCOPED_TRACE(v);
    const std::string e = set_error(fmt::format("train.seed={}", v));
    EXPECT_CONTAINS(e, fmt::format("train.seed = '{}' is negative", v));
    EXPECT_CONTAINS(e, "a whole number from 0 to 2^64 - 1 = 18446744073709551615");
  }
  Config c;
  apply_override(c, "train.seed=18446744073709551615");
  EXPECT_EQ(c.train.seed, 18446744073709551615ull);
}

TEST(Config, NumbersRefuseGarbageAndOutOfRangeValues) {
  // Trailing garbage, fractions and other notations are refused, naming the key and value.
  for (const char* v : {"12abc", "1.5", "1e3", "0x10", "", "12 34", "--1"}) {
    SCOPED_TRACE(v);
    EXPECT_CONTAINS(set_error(fmt::format("model.d_model={}", v)),
                    fmt::format("model.d_model = '{}' is not a valid int", v));
    EXPECT_CONTAINS(set_error(fmt::format("train.seed={}", v)),
                    fmt::format("train.seed = '{}' is not a valid uint64", v));
  }
  EXPECT_CONTAINS(set_error("train.lr=0.1x"), "train.lr = '0.1x' is not a valid float");
  EXPECT_CONTAINS(set_error("train.lr=nan"), "train.lr = 'nan' is not a valid float");

  // Out of the type's range: the range in words, not wrapped or clamped.
  std::string e = set_error("model.d_model=99999999999");
  EXPECT_CONTAINS(e, "model.d_model = '99999999999' is too large for an int");
  EXPECT_CONTAINS(e, "a whole number from -2147483648 to 2147483647");
  EXPECT_CONTAINS(set_error("model.d_model=-99999999999"),
                  "model.d_model = '-99999999999' is too small for an int");
  EXPECT_CONTAINS(set_error("model.d_model=2147483648"), "is too large for an int");
  EXPECT_CONTAINS(set_error("train.seed=18446744073709551616"),
                  "train.seed = '18446744073709551616' is too large for a uint64");
  EXPECT_CONTAINS(set_error("train.lr=1e39"),
                  "train.lr = '1e39' is too large in magnitude for a float");
  EXPECT_CONTAINS(set_error("train.lr=1e999"), "train.lr = '1e999' is too large");
  EXPECT_CONTAINS(set_error("train.lr=inf"), "train.lr = 'inf' is not finite");
  EXPECT_CONTAINS(set_error("train.adam_eps=1e-50"),
                  "train.adam_eps = '1e-50' is too small for a float: it would be stored as 0");
  // A huge value is echoed shortened, and no bound in any message is a long run of digits.
  const std::string huge(300, '9');
  e = set_error("model.d_model=" + huge);
  EXPECT_CONTAINS(e, "model.d_model = '999999999999999999999999...' (300 characters) is too large");
  EXPECT_LT(e.size(), 200u) << e;
  for (const std::string& m : {e, set_error("train.seed=" + huge), set_error("train.lr=" + huge),
                               set_error("train.lr=1e-999")}) {
    size_t run = 0, longest = 0;
    for (char ch : m)
      longest = std::max(longest, run = std::isdigit(static_cast<unsigned char>(ch)) ? run + 1 : 0);
    EXPECT_LE(longest, 24u) << m;
  }
  // The same checks apply to YAML values.
  EXPECT_CONTAINS(error_of([] { load_config_string("model: {d_model: 12abc}\n"); }),
                  "model.d_model = '12abc' is not a valid int");
  EXPECT_CONTAINS(error_of([] { load_config_string("train: {lr: 1e39}\n"); }),
                  "train.lr = '1e39' is too large in magnitude for a float");
  // Values at the edges still load.
  Config c;
  apply_override(c, "train.warmup_steps=2147483647");
  apply_override(c, "train.lr=3e38");
  apply_override(c, "train.adam_eps=1e-40");  // a subnormal float, not 0
  EXPECT_EQ(c.train.warmup_steps, 2147483647);
  EXPECT_GT(c.train.adam_eps, 0.0f);
}

TEST(Config, TensorParallelDividesHeadsHiddenAndBatch) {
  Config c;  // tiny: 4 kv heads, dense hidden 512, batch 16
  apply_override(c, "parallel.tp=4");
  EXPECT_NO_THROW(validate(c));
  EXPECT_TRUE(c.parallel.ssmb);
  apply_override(c, "parallel.tp=8");
  EXPECT_CONTAINS(error_of([&] { validate(c); }),
                  "model.num_kv_heads = 4 is not divisible by parallel.tp = 8");
  apply_override(c, "parallel.tp=2");
  apply_override(c, "train.batch_size=3");
  apply_override(c, "model.dense_hidden=511");
  const std::string e = error_of([&] { validate(c); });
  EXPECT_CONTAINS(e, "train.batch_size = 3 is not divisible by parallel.tp = 2");
  EXPECT_CONTAINS(e, "model.dense_hidden = 511 is not divisible by parallel.tp = 2");
  c.parallel.tp = 0;
  EXPECT_CONTAINS(error_of([&] { validate(c); }), "parallel.tp = 0 is outside [1, inf)");
  apply_override(c, "parallel.ssmb=false");
  EXPECT_FALSE(c.parallel.ssmb);
}

// A map used as a key (YAML's `? key`), found by tests/fuzz/fuzz_config: yaml-cpp's BadConversion
// escaped; now an Error naming where the key is.
TEST(FuzzFindings, ComplexKeyIsRefused) {
  EXPECT_CONTAINS(error_of([] {
                    load_config_string("? model: {d_model: 64, n_heads: 4}\nmoe: {gate: topk}\n",
                                       "fuzz.yaml");
                  }),
                  "[config] fuzz.yaml: the top level has a key model: {d_model: 64, n_heads: 4} "
                  "that is not a name");
  EXPECT_CONTAINS(error_of([] { load_config_string("model:\n  ? [a, b]\n  : 1\n", "f.yaml"); }),
                  "[config] f.yaml: 'model' has a key [a, b] that is not a name");
}

TEST(Config, PipelineKeysTakeOffAutoOrAChunkCount) {
  EXPECT_EQ(parse_pipeline_chunks("off", "k"), 1);
  EXPECT_EQ(parse_pipeline_chunks("auto", "k"), 0);
  EXPECT_EQ(parse_pipeline_chunks("4", "k"), 4);
  for (const char* bad : {"0", "-2", "4x", "", "same"})
    EXPECT_CONTAINS(
        error_of([&] { parse_pipeline_chunks(bad, "model.moe.pipeline"); }),
        fmt::format("model.moe.pipeline = '{}' is not off, auto or a chunk count", bad));
  Config c;
  c.model.moe.pipeline = "3";
  c.model.moe.pipeline_backward = "same";
  EXPECT_NO_THROW(validate(c));
  c.model.moe.pipeline = "same";  // only the backward's key takes same
  EXPECT_CONTAINS(error_of([&] { validate(c); }),
                  "model.moe.pipeline = 'same' is not off, auto or a chunk count >= 1");
  c.model.moe.pipeline = "auto";
  c.model.moe.pipeline_backward = "0";
  EXPECT_CONTAINS(error_of([&] { validate(c); }),
                  "model.moe.pipeline_backward = '0' is not same, off, auto or a chunk count");
}
