// Named configurations and the parameter counter. `tiny` is the struct defaults (the CPU
// run); `moe-1b` is the first GPU-scale model; the rest are real model shapes for planning.
#include <algorithm>
#include <map>

#include "xmoe/config/config.h"
#include "xmoe/core/error.h"

namespace xmoe {

namespace {

struct Preset {
  const char* name;
  const char* description;
  Config (*make)();
};

// DeepSeek-MoE style: softmax over all experts, top-k weights not renormalised.
void deepseek_gate(MoeConfig& moe) {
  moe.gate = "softmax_topk";
  moe.softmax_before_topk = true;
  moe.renormalize = false;
}

Config tiny() {
  return Config{};
}

Config moe_1b() {
  Config c;
  ModelConfig& m = c.model;
  m.vocab_size = 32768;
  m.d_model = 1024;
  m.num_layers = 16;
  m.num_heads = 16;
  m.num_kv_heads = 16;
  m.max_seq_len = 2048;
  m.dense_hidden = 4096;
  // All 16 blocks are MoE: with a dense first block the total drops to 0.93B; the 0.97B/0.24B
  // target is met with 16 MoE blocks (see docs/config.md for the computed counts).
  m.first_dense_layers = 0;
  m.moe.num_experts = 64;
  m.moe.expert_hidden = 256;
  m.moe.top_k = 6;
  m.moe.num_shared_experts = 2;
  deepseek_gate(m.moe);
  c.train.seq_len = 2048;
  c.train.batch_size = 8;
  c.train.lr = 1e-3f;
  c.train.min_lr = 1e-4f;
  c.train.warmup_steps = 200;
  c.train.steps = 5000;
  c.train.device = "cuda";
  c.train.out_dir = "runs/moe-1b";
  c.data.dir = "data/moe-1b";
  return c;
}

// Shared by the planning presets: long context, small per-rank batch, GPU.
Config planning(int ctx, int seq_len) {
  Config c;
  c.model.max_seq_len = ctx;
  c.train.seq_len = seq_len;
  c.train.batch_size = 1;
  c.train.lr = 4.2e-4f;
  c.train.min_lr = 4.2e-5f;
  c.train.warmup_steps = 2000;
  c.train.device = "cuda";
  c.model.init_std = 0.006f;
  return c;
}

Config deepseek_moe_16b() {
  Config c = planning(4096, 4096);
  ModelConfig& m = c.model;
  m.vocab_size = 102400;
  m.d_model = 2048;
  m.num_layers = 28;
  m.num_heads = 16;
  m.num_kv_heads = 16;
  m.first_dense_layers = 1;
  m.dense_hidden = 10944;
  m.moe.num_experts = 64;
  m.moe.expert_hidden = 1408;
  m.moe.top_k = 6;
  m.moe.num_shared_experts = 2;
  deepseek_gate(m.moe);
  m.moe.aux_loss_weight = 0.001f;
  return c;
}

Config deepseek_v2_lite() {
  Config c = deepseek_moe_16b();
  c.model.num_layers = 27;
  return c;
}

Config mixtral_8x7b() {
  Config c = planning(32768, 4096);
  ModelConfig& m = c.model;
  m.vocab_size = 32000;
  m.d_model = 4096;
  m.num_layers = 32;
  m.num_heads = 32;
  m.num_kv_heads = 8;
  m.first_dense_layers = 0;
  m.dense_hidden = 14336;
  m.rope_theta = 1e6f;
  m.moe.num_experts = 8;
  m.moe.expert_hidden = 14336;
  m.moe.top_k = 2;
  m.moe.num_shared_experts = 0;
  m.moe.gate = "softmax_topk";
  m.moe.softmax_before_topk = false;  // top-2 of the logits, then softmax over the two
  m.moe.renormalize = true;
  m.moe.aux_loss_weight = 0.02f;
  return c;
}

Config xmoe_small() {
  Config c = planning(4096, 4096);
  ModelConfig& m = c.model;
  m.vocab_size = 102400;
  m.d_model = 2048;
  m.num_layers = 18;
  m.num_heads = 16;
  m.num_kv_heads = 16;
  m.first_dense_layers = 2;
  m.dense_hidden = 10944;
  m.moe.num_experts = 64;
  m.moe.expert_hidden = 1408;
  m.moe.top_k = 6;
  m.moe.num_shared_experts = 2;
  deepseek_gate(m.moe);
  return c;
}

Config xmoe_medium() {
  Config c = planning(4096, 4096);
  ModelConfig& m = c.model;
  m.vocab_size = 102400;
  m.d_model = 4096;
  m.num_layers = 24;
  m.num_heads = 32;
  m.num_kv_heads = 32;
  m.first_dense_layers = 1;
  m.dense_hidden = 16384;
  m.moe.num_experts = 128;
  m.moe.expert_hidden = 1408;
  m.moe.top_k = 6;
  m.moe.num_shared_experts = 2;
  deepseek_gate(m.moe);
  return c;
}

Config xmoe_large() {
  Config c = planning(4096, 4096);
  ModelConfig& m = c.model;
  m.vocab_size = 129280;
  m.d_model = 7168;
  m.num_layers = 56;
  m.num_heads = 56;
  m.num_kv_heads = 56;
  m.first_dense_layers = 3;
  m.dense_hidden = 18432;
  m.moe.num_experts = 256;
  m.moe.expert_hidden = 1792;
  m.moe.top_k = 8;
  m.moe.num_shared_experts = 1;
  deepseek_gate(m.moe);
  return c;
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> p = {
      {"tiny",
       "the CPU default (the struct defaults): byte vocab, d=256, 4 layers, 16 experts f=128 "
       "top-2 + 1 shared, first layer dense",
       tiny},
      {"moe-1b",
       "d=1024, 16 MoE layers, 16 heads, 64 experts f=256 top-6 + 2 shared, vocab 32768, "
       "seq 2048; all layers MoE (first_dense_layers=0) to reach the 0.97B / 0.24B target",
       moe_1b},
      {"deepseek-moe-16b",
       "DeepSeek-MoE 16B: d=2048, 28 layers, 16 heads, 64 experts f=1408 top-6 + 2 shared, "
       "first layer dense (10944), vocab 102400, ctx 4096",
       deepseek_moe_16b},
      {"deepseek-v2-lite",
       "DeepSeek-V2-Lite shape: d=2048, 27 layers, 16 heads, 64 experts f=1408 top-6 + 2 shared, "
       "first layer dense (10944), vocab 102400; plain MHA instead of MLA (attention parameter "
       "count differs)",
       deepseek_v2_lite},
      {"mixtral-8x7b",
       "Mixtral 8x7B: d=4096, 32 layers, 32 heads / 8 KV heads, 8 experts f=14336 top-2, no "
       "shared or dense layers, vocab 32000, ctx 32768, trained at seq 4096",
       mixtral_8x7b},
      {"xmoe-small",
       "approximation of the X-MoE paper's Small (~10.1B) DeepSeek-style model: d=2048, 18 "
       "layers (2 dense), 64 experts f=1408 top-6 + 2 shared, vocab 102400",
       xmoe_small},
      {"xmoe-medium",
       "approximation of the X-MoE paper's Medium (~55B): d=4096, 24 layers (1 dense), 128 "
       "experts f=1408 top-6 + 2 shared, vocab 102400",
       xmoe_medium},
      {"xmoe-large",
       "approximation of the X-MoE paper's Large (~545B): d=7168, 56 layers (3 dense), 256 "
       "experts f=1792 top-8 + 1 shared, vocab 129280, MHA",
       xmoe_large},
  };
  return p;
}

const Preset* find_preset(const std::string& name) {
  for (const Preset& p : presets())
    if (name == p.name) return &p;
  return nullptr;
}

[[noreturn]] void unknown_preset(const std::string& name) {
  std::string names;
  for (const Preset& p : presets()) names += (names.empty() ? "" : ", ") + std::string(p.name);
  XMOE_FAIL("[config] unknown preset '{}' (known presets: {})", name, names);
}

}  // namespace

Config preset(const std::string& name) {
  const Preset* p = find_preset(name);
  if (!p) unknown_preset(name);
  return p->make();
}

std::vector<std::string> preset_names() {
  std::vector<std::string> out;
  for (const Preset& p : presets()) out.push_back(p.name);
  return out;
}

std::string preset_description(const std::string& name) {
  const Preset* p = find_preset(name);
  if (!p) unknown_preset(name);
  return p->description;
}

ParamCount count_parameters(const ModelConfig& m) {
  const int64_t d = m.d_model, V = m.vocab_size, L = m.num_layers;
  const int64_t head_dim = m.num_heads > 0 ? d / m.num_heads : 0;
  const int64_t kv = static_cast<int64_t>(m.num_kv_heads) * head_dim;
  const MoeConfig& moe = m.moe;
  const int64_t E = moe.num_experts, f = moe.expert_hidden;

  ParamCount pc;
  pc.embedding = V * d * (m.tie_embeddings ? 1 : 2);
  const int64_t norms = 2 * d;
  const int64_t attention = d * d + 2 * d * kv + d * d;  // q, k, v, o
  const int64_t dense_ffn = 3 * d * m.dense_hidden;      // SwiGLU: gate, up, down
  // The sigmoid gate's balancing bias (E values) is updated by a rule, not trained: not counted.
  const int64_t router = moe.gate == "xmoe"
                             ? d * moe.router_dim + static_cast<int64_t>(moe.router_dim) * E + 1
                             : d * E;
  const int64_t expert = 3 * d * f;
  const int64_t shared = 3 * d * (moe.num_shared_experts * f);
  const int64_t dense_layers = std::min<int64_t>(m.first_dense_layers, L);
  const int64_t moe_layers = L - dense_layers;

  const int64_t common = pc.embedding + L * (norms + attention) + dense_layers * dense_ffn + d;
  pc.total = common + moe_layers * (router + E * expert + shared);
  pc.active = common + moe_layers * (router + std::min<int64_t>(moe.top_k, E) * expert + shared);
  return pc;
}

}  // namespace xmoe
