// Hugging Face export and import (train/hf.h, docs/ecosystem.md): export -> import gives the
// checkpoint's tensors bit for bit for each architecture, bf16 exports round to nearest even,
// sharded folders read back, an imported run trains on, and what has no counterpart is refused
// naming the key. (Logits against transformers: ctest hf_logits_match_transformers.)
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "testing.h"
#include "training_fixture.h"
#include "xmoe/data/tokenizer.h"
#include "xmoe/io/file.h"
#include "xmoe/io/safetensors.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/hf.h"
#include "xmoe/train/run_folder.h"

namespace fs = std::filesystem;
using namespace xmoe;
using nlohmann::json;
using xmoe::testing::error_of;

namespace {

struct ArchCase {
  std::string name, architecture;
  void (*shape)(ModelConfig&);
};

const ArchCase kCases[] = {
    {"glm4moe", "Glm4MoeForCausalLM",
     [](ModelConfig& m) {
       m.moe.gate = "sigmoid";
       m.moe.num_experts = 8;
       m.moe.top_k = 3;
       m.moe.num_groups = 4;
       m.moe.topk_groups = 2;
       m.moe.routed_scaling = 2.5f;
       m.moe.bias_update_rate = 0.05f;  // a bias far from zero after a few steps
     }},
    {"ernie", "Ernie4_5_MoeForCausalLM", [](ModelConfig& m) { m.moe.num_shared_experts = 2; }},
    {"mixtral", "MixtralForCausalLM",
     [](ModelConfig& m) {
       m.moe.num_shared_experts = 0;
       m.first_dense_layers = 0;
       m.tie_embeddings = true;
     }},
    {"llama", "LlamaForCausalLM", [](ModelConfig& m) { m.first_dense_layers = m.num_layers; }},
};

class HfTest : public xmoe::testing::MicroCorpusTest {
 protected:
  HfTest() : MicroCorpusTest("xmoe-hf-") {}

  /// A micro run of `arch`'s shape, trained 5 steps; returns its checkpoint folder.
  std::string trained(const ArchCase& arch) {
    train::train(config(arch, arch.name, 5), xmoe::testing::quiet());
    return (root_ / arch.name / "step-5").string();
  }
  Config config(const ArchCase& arch, const std::string& run, int steps) const {
    Config c = xmoe::testing::micro_config(root_, {.steps = steps, .every = steps, .run = run});
    arch.shape(c.model);
    validate(c);
    return c;
  }
  std::string path(const std::string& name) const { return (root_ / name).string(); }
};

/// The parameters and routing biases of a checkpoint (not the optimizer state).
std::map<std::string, Tensor> weights(const std::string& dir) {
  std::map<std::string, Tensor> out;
  for (auto& [name, t] : train::load_checkpoint(dir).tensors)
    if (name.find(".adam_") == std::string::npos && name != "optim.step") out.emplace(name, t);
  return out;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

}  // namespace

TEST_F(HfTest, ExportImportRoundTripIsBitwiseForEveryArchitecture) {
  for (const ArchCase& arch : kCases) {
    SCOPED_TRACE(arch.name);
    const std::string ckpt = trained(arch);
    const auto exported = train::export_hf(ckpt, path(arch.name + "-hf"), {});
    EXPECT_EQ(exported.architecture, arch.architecture);
    for (const char* f : {"config.json", "model.safetensors", "generation_config.json",
                          "tokenizer.json", "tokenizer_config.json"})
      EXPECT_TRUE(fs::is_regular_file(fs::path(path(arch.name + "-hf")) / f)) << f;
    const json config = json::parse(io::read_file(path(arch.name + "-hf") + "/config.json"));
    EXPECT_EQ(config["architectures"][0], arch.architecture);

    const auto imported = train::import_hf(path(arch.name + "-hf"), path(arch.name + "-back"), {});
    EXPECT_EQ(imported.architecture, arch.architecture);
    const auto want = weights(ckpt), got = weights(imported.checkpoint);
    ASSERT_EQ(want.size(), got.size());
    for (const auto& [name, t] : want) {
      ASSERT_TRUE(got.count(name)) << name;
      EXPECT_TRUE(same_bytes(t, got.at(name))) << name << " differs after export -> import";
    }
    if (arch.name == "glm4moe") {
      const Tensor& bias = want.at("layers.1.moe.router.bias");
      EXPECT_NE(bias.to_vector<float>(), std::vector<float>(bias.numel(), 0.f))
          << "the test needs a selection bias that is not zero";
    }
    // The imported run's model is the exported one's: config.json reads back the same.
    const Config original = load_config_string(
        train::load_checkpoint(ckpt).state.at("config").get<std::string>(), ckpt);
    EXPECT_EQ(train::hf_config(original.model, arch.architecture, DType::f32),
              train::hf_config(imported.config.model, arch.architecture, DType::f32));
  }
}

TEST_F(HfTest, ImportedRunTrainsOnWithResume) {
  const std::string ckpt = trained(kCases[1]);
  train::export_hf(ckpt, path("hf"), {});
  // The same run as a fresh one, from the imported weights.
  Config fresh = config(kCases[1], "fresh", 3);
  std::vector<std::string> keys;
  for (const std::string k : {"train.steps", "train.eval_every", "train.batch_size",
                              "train.seq_len", "train.warmup_steps", "train.lr"})
    keys.push_back(k + "=" + config_get(fresh, k));
  keys.push_back("data.dir=" + fresh.data.dir);  // config_get quotes strings as YAML does
  const auto imported = train::import_hf(path("hf"), path("from-hf"), keys);
  EXPECT_EQ(imported.checkpoint, path("from-hf") + "/step-0");
  Config c = train::resume_config(imported.config, {}).config;
  train::TrainOptions o = xmoe::testing::quiet();
  o.resume = true;
  const auto r = train::train(c, o);
  EXPECT_EQ(r.first_step, 0);
  ASSERT_EQ(r.steps.size(), 3u);
  // On the same first batch, the imported weights (trained 5 steps) beat a fresh initialisation.
  const auto f = train::train(fresh, xmoe::testing::quiet());
  EXPECT_LT(r.steps.front().loss, f.steps.front().loss - 0.1);
  EXPECT_TRUE(fs::is_directory(path("from-hf") + "/step-3"));
}

TEST_F(HfTest, Bf16ExportRoundsToNearestEvenAndShardsReadBack) {
  const std::string ckpt = trained(kCases[0]);
  train::HfExportOptions o;
  o.dtype = DType::bf16;
  o.max_shard_bytes = 16 * 1024;  // the micro model's ~100 KB of bf16 weights in several files
  const auto r = train::export_hf(ckpt, path("bf16"), o);
  const fs::path dir = path("bf16");
  ASSERT_TRUE(fs::is_regular_file(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  const json index = json::parse(io::read_file((dir / "model.safetensors.index.json").string()));
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), r.tensor_bytes);
  std::set<std::string> files;
  for (const auto& [tensor, file] : index["weight_map"].items()) files.insert(file);
  EXPECT_GT(files.size(), 2u);
  for (const std::string& f : files) {
    for (const auto& [name, t] : io::load_safetensors((dir / f).string()).tensors) {
      EXPECT_EQ(t.dtype(), DType::bf16) << name;
      EXPECT_EQ(index["weight_map"][name], f) << name;
    }
  }
  const auto imported = train::import_hf(path("bf16"), path("back"), {});
  for (const auto& [name, t] : weights(ckpt)) {
    const Tensor rounded = t.to(DType::bf16).to(DType::f32);
    EXPECT_TRUE(same_bytes(rounded, weights(imported.checkpoint).at(name))) << name;
  }
}

TEST_F(HfTest, ExportRefusesAFolderThatHoldsFiles) {
  const std::string ckpt = trained(kCases[3]);
  fs::create_directories(path("busy"));
  io::write_file_atomic(path("busy") + "/keep.txt", "mine");
  EXPECT_NE(
      error_of([&] { train::export_hf(ckpt, path("busy"), {}); }).find("exists and is not empty"),
      std::string::npos);
  EXPECT_EQ(io::read_file(path("busy") + "/keep.txt"), "mine");
}

TEST(HfArchitecture, FeaturesWithoutACounterpartAreRefusedByName) {
  const auto refusal = [](void (*edit)(ModelConfig&), const std::string& requested = "auto") {
    ModelConfig m;
    edit(m);
    return error_of([&] { train::hf_architecture(m, requested); });
  };
  EXPECT_NE(refusal([](ModelConfig& m) {
              m.moe.gate = "xmoe";
            }).find("model.moe.gate = xmoe (cosine router"),
            std::string::npos);
  EXPECT_NE(refusal([](ModelConfig& m) {
              m.moe.gate = "switch";
              m.moe.top_k = 1;
            }).find("model.moe.gate = switch"),
            std::string::npos);
  EXPECT_NE(refusal([](ModelConfig& m) {
              m.moe.renormalize = false;
            }).find("model.moe.renormalize = false"),
            std::string::npos);
  EXPECT_NE(refusal([](ModelConfig& m) {
              m.moe.gate = "sigmoid";
              m.moe.num_shared_experts = 0;
            }).find("model.moe.num_shared_experts = 0"),
            std::string::npos);
  EXPECT_NE(refusal([](ModelConfig& m) { m.moe.gate = "sigmoid"; }, "DeepseekV3ForCausalLM")
                .find("multi-head latent attention"),
            std::string::npos);
  EXPECT_NE(
      refusal([](ModelConfig&) {}, "MixtralForCausalLM").find("model.moe.num_shared_experts = 1"),
      std::string::npos);
  // The defaults (softmax top-k, a shared expert, a dense first layer) have one.
  EXPECT_EQ(train::hf_architecture(ModelConfig{}), "Ernie4_5_MoeForCausalLM");
}

TEST(HfConfig, KeysXmoeCannotHonourAreRefusedByName) {
  ModelConfig m;
  m.moe.gate = "sigmoid";
  const json good = train::hf_config(m, "Glm4MoeForCausalLM", DType::f32);
  EXPECT_TRUE(train::model_config_from_hf(good, "x/config.json") == m);
  const auto refusal = [&](const std::string& key, const json& value) {
    json c = good;
    c[key] = value;
    return error_of([&] { train::model_config_from_hf(c, "x/config.json"); });
  };
  EXPECT_NE(refusal("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4}})
                .find("'rope_scaling' = {\"factor\":4,\"rope_type\":\"yarn\"} is not supported"),
            std::string::npos);
  EXPECT_NE(refusal("use_qk_norm", true).find("'use_qk_norm' = true"), std::string::npos);
  EXPECT_NE(refusal("partial_rotary_factor", 0.5).find("'partial_rotary_factor' = 0.5"),
            std::string::npos);
  EXPECT_NE(refusal("attention_bias", true).find("x/config.json: config.json 'attention_bias'"),
            std::string::npos);
  EXPECT_NE(refusal("architectures", {"DeepseekV3ForCausalLM"}).find("multi-head latent"),
            std::string::npos);
  json no_heads = good;
  no_heads.erase("num_attention_heads");
  EXPECT_NE(error_of([&] {
              train::model_config_from_hf(no_heads, "x/config.json");
            }).find("no 'num_attention_heads'"),
            std::string::npos);
}

TEST_F(HfTest, ImportRefusesMissingTensorsAndArchitectureOverrides) {
  const std::string ckpt = trained(kCases[2]);
  train::export_hf(ckpt, path("hf"), {});
  EXPECT_NE(error_of([&] {
              train::import_hf(path("hf"), path("a"), {"model.d_model=64"});
            }).find("--set changes the architecture"),
            std::string::npos);
  // Training-only keys may be set.
  EXPECT_EQ(train::import_hf(path("hf"), path("b"), {"model.moe.z_loss_weight=0.001"})
                .config.model.moe.z_loss_weight,
            0.001f);
  auto tensors = io::load_safetensors(path("hf") + "/model.safetensors").tensors;
  tensors.erase("model.layers.1.block_sparse_moe.experts.3.w2.weight");
  io::save_safetensors(path("hf") + "/model.safetensors", tensors, {{"format", "pt"}});
  EXPECT_NE(error_of([&] {
              train::import_hf(path("hf"), path("c"), {});
            }).find("no tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight'"),
            std::string::npos);
}

TEST(HfTokenizer, MapsEveryByteToItsOwnId) {
  const json t = json::parse(data::ByteTokenizer::hf_tokenizer_json());
  const json& vocab = t["model"]["vocab"];
  ASSERT_EQ(vocab.size(), 256u);
  std::set<int> ids;
  for (const auto& [piece, id] : vocab.items()) ids.insert(id.get<int>());
  EXPECT_EQ(ids.size(), 256u);
  EXPECT_EQ(*ids.begin(), 0);
  EXPECT_EQ(*ids.rbegin(), 255);
  EXPECT_EQ(vocab["A"], 65);         // printable bytes stand for themselves
  EXPECT_EQ(vocab["\u0120"], 32);    // the space is GPT-2's "Ġ"
  EXPECT_EQ(vocab["\u0100"], 0);     // the first unprintable byte
  EXPECT_EQ(vocab["\u00e9"], 0xE9);  // Latin-1 printable: itself
  EXPECT_TRUE(t["model"]["merges"].empty());
  EXPECT_EQ(t["pre_tokenizer"]["use_regex"], false);
}
