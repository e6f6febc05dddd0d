#include "xmoe/train/hf.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include "xmoe/data/prepare.h"
#include "xmoe/data/tokenizer.h"
#include "xmoe/io/file.h"
#include "xmoe/io/safetensors.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/run_folder.h"
#include "xmoe/train/state.h"

namespace xmoe::train {

namespace fs = std::filesystem;
using nlohmann::json;
using TensorMap = std::map<std::string, Tensor>;

namespace {

constexpr const char* kMixtral = "MixtralForCausalLM";
constexpr const char* kGlm4Moe = "Glm4MoeForCausalLM";
constexpr const char* kErnie = "Ernie4_5_MoeForCausalLM";
constexpr const char* kLlama = "LlamaForCausalLM";
constexpr const char* kDeepseekV3 = "DeepseekV3ForCausalLM";

bool all_dense(const ModelConfig& m) {
  return m.first_dense_layers >= m.num_layers;
}

std::string model_type(const std::string& arch) {
  return arch == kMixtral   ? "mixtral"
         : arch == kGlm4Moe ? "glm4_moe"
         : arch == kErnie   ? "ernie4_5_moe"
                            : "llama";
}

/// softmax_topk whose k weights are the softmax over the chosen k (Mixtral's and ERNIE's form;
/// GShard's renormalised top-k of the softmax is the same numbers).
bool softmax_over_k(const MoeConfig& e) {
  return e.gate == "softmax_topk" && (e.renormalize || !e.softmax_before_topk);
}

/// The first config key of an MoE model that `arch` cannot express, with the reason; "" if none.
std::string unsupported_by(const ModelConfig& m, const std::string& arch) {
  const MoeConfig& e = m.moe;
  if (arch == kDeepseekV3)
    return "DeepseekV3ForCausalLM uses multi-head latent attention (low-rank, normalised "
           "key/value compression and a rotary part shared by all heads), which xmoe's "
           "grouped-query attention is not; xmoe's sigmoid-gated models export as "
           "Glm4MoeForCausalLM, DeepSeek-V3's MoE with GQA attention";
  if (arch == kLlama)
    return all_dense(m) ? ""
                        : fmt::format(
                              "model.first_dense_layers = {} < model.num_layers = {}: "
                              "LlamaForCausalLM has no MoE layer",
                              m.first_dense_layers, m.num_layers);
  if (all_dense(m)) return fmt::format("every layer is dense: the model is a {}", kLlama);
  if (e.gate == "xmoe")
    return "model.moe.gate = xmoe (cosine router: projection, L2 normalisation, learned "
           "temperature) has no Hugging Face architecture";
  if (e.gate == "switch" && arch != kGlm4Moe)
    return fmt::format(
        "model.moe.gate = switch weights the expert by its probability; {} renormalises the "
        "top-k weights (to 1 for top-1)",
        arch);
  if (arch == kMixtral || arch == kErnie) {
    if (e.gate != "softmax_topk")
      return fmt::format("model.moe.gate = {}: {} routes by softmax top-k", e.gate, arch);
    if (!softmax_over_k(e))
      return fmt::format(
          "model.moe.renormalize = false with softmax_before_topk: {} renormalises the top-k "
          "weights",
          arch);
  }
  if (arch == kMixtral) {
    if (e.num_shared_experts > 0)
      return fmt::format("model.moe.num_shared_experts = {}: {} has no shared experts ({} has)",
                         e.num_shared_experts, kMixtral, kErnie);
    if (m.first_dense_layers > 0)
      return fmt::format(
          "model.first_dense_layers = {}: every layer of {} is an MoE layer ({} "
          "has dense first layers)",
          m.first_dense_layers, kMixtral, kErnie);
    return "";
  }
  if (arch == kErnie) return "";
  if (arch == kGlm4Moe) {
    if (e.gate != "sigmoid")
      return fmt::format("model.moe.gate = {}: {} routes by sigmoid scores with a selection bias",
                         e.gate, kGlm4Moe);
    if (e.num_shared_experts < 1)
      return fmt::format("model.moe.num_shared_experts = 0: {} always has shared experts",
                         kGlm4Moe);
    if (e.num_experts / e.num_groups < 2)
      return fmt::format(
          "model.moe.num_groups = {} with {} expert per group: {} scores a group by its top-2 "
          "experts",
          e.num_groups, e.num_experts / e.num_groups, kGlm4Moe);
    return "";
  }
  return fmt::format("unknown architecture '{}' (xmoe exports {}, {}, {} and {})", arch, kGlm4Moe,
                     kErnie, kMixtral, kLlama);
}

/// One HF tensor and where it lives in an xmoe tensor: columns [col0, col1) of the 2-D xmoe
/// tensor (the whole tensor when col1 = 0), transposed when `transpose` (xmoe stores matrices
/// [in, out], transformers' Linear [out, in]). `interleave_heads` = head size of a q or k
/// projection whose HF rows pair (2j, 2j+1) for RoPE where xmoe pairs columns (j, j + hd/2).
struct TensorLink {
  std::string hf, xmoe;
  Shape xmoe_shape;
  int64_t col0 = 0, col1 = 0;
  bool transpose = false;
  int64_t interleave_heads = 0;

  /// The xmoe column (within [col0, col1)) that HF's column c (row c when transposed) holds.
  int64_t xmoe_col(int64_t c) const {
    if (interleave_heads == 0) return col0 + c;
    const int64_t hd = interleave_heads, j = c % hd;
    return col0 + c - j + (j % 2 == 0 ? j / 2 : j / 2 + hd / 2);
  }

  Shape hf_shape() const {
    if (xmoe_shape.size() == 1) return xmoe_shape;
    const int64_t cols = col1 > 0 ? col1 - col0 : xmoe_shape[1];
    return transpose ? Shape{cols, xmoe_shape[0]} : Shape{xmoe_shape[0], cols};
  }
};

/// Every tensor of `m` as `arch` names it.
std::vector<TensorLink> tensor_links(const ModelConfig& m, const std::string& arch) {
  const int64_t d = m.d_model, hd = m.d_model / m.num_heads, V = m.vocab_size;
  const int64_t q = m.num_heads * hd, kv = m.num_kv_heads * hd;
  const MoeConfig& e = m.moe;
  const int64_t f = e.expert_hidden, shared = int64_t{e.num_shared_experts} * f;
  std::vector<TensorLink> links;
  const auto linear = [&](std::string hf, std::string xm, Shape shape) {
    links.push_back({std::move(hf), std::move(xm), std::move(shape), 0, 0, true});
  };
  // ERNIE 4.5 rotates interleaved pairs: its q and k rows are xmoe's columns reordered per head.
  const int64_t rope_perm = arch == kErnie ? hd : 0;
  // A SwiGLU's fused [in, 2h] gate|up matrix and its [h, in] down matrix.
  const auto swiglu = [&](const std::string& hf_prefix, const std::string& gate,
                          const std::string& up, const std::string& down,
                          const std::string& xm_prefix, const std::string& suffix, int64_t h) {
    links.push_back(
        {hf_prefix + gate + ".weight", xm_prefix + ".gate_up" + suffix, {d, 2 * h}, 0, h, true});
    links.push_back(
        {hf_prefix + up + ".weight", xm_prefix + ".gate_up" + suffix, {d, 2 * h}, h, 2 * h, true});
    linear(hf_prefix + down + ".weight", xm_prefix + ".down" + suffix, {h, d});
  };
  links.push_back({"model.embed_tokens.weight", "embed.weight", {V, d}});
  for (int i = 0; i < m.num_layers; ++i) {
    const std::string hf = fmt::format("model.layers.{}.", i), xm = fmt::format("layers.{}.", i);
    links.push_back({hf + "input_layernorm.weight", xm + "attn_norm.weight", {d}});
    links.push_back(
        {hf + "self_attn.q_proj.weight", xm + "attn.wq", {d, q}, 0, 0, true, rope_perm});
    links.push_back(
        {hf + "self_attn.k_proj.weight", xm + "attn.wk", {d, kv}, 0, 0, true, rope_perm});
    linear(hf + "self_attn.v_proj.weight", xm + "attn.wv", {d, kv});
    linear(hf + "self_attn.o_proj.weight", xm + "attn.wo", {q, d});
    links.push_back({hf + "post_attention_layernorm.weight", xm + "ffn_norm.weight", {d}});
    if (i < m.first_dense_layers) {
      swiglu(hf + "mlp.", "gate_proj", "up_proj", "down_proj", xm + "ffn", "", m.dense_hidden);
      continue;
    }
    const std::string moe = xm + "moe";
    const bool mixtral = arch == kMixtral;
    const std::string block = hf + (mixtral ? "block_sparse_moe." : "mlp.");
    linear(block + "gate.weight", moe + ".router.weight", {d, e.num_experts});
    if (arch == kGlm4Moe)
      links.push_back(
          {block + "gate.e_score_correction_bias", moe + ".router.bias", {e.num_experts}});
    for (int x = 0; x < e.num_experts; ++x) {
      const std::string expert = fmt::format("{}experts.{}.", block, x),
                        slice = fmt::format("@{}", x);
      if (mixtral)
        swiglu(expert, "w1", "w3", "w2", moe + ".experts", slice, f);
      else
        swiglu(expert, "gate_proj", "up_proj", "down_proj", moe + ".experts", slice, f);
    }
    if (shared > 0)
      swiglu(block + "shared_experts.", "gate_proj", "up_proj", "down_proj", moe + ".shared", "",
             shared);
  }
  links.push_back({"model.norm.weight", "final_norm.weight", {d}});
  if (!m.tie_embeddings) linear("lm_head.weight", "lm_head.weight", {d, V});
  return links;
}

/// Tensors an architecture has and xmoe's model has not, which must be zero for the two to
/// compute the same: ERNIE's selection bias (xmoe's softmax_topk selects by probability alone).
std::vector<std::pair<std::string, Shape>> zero_tensors(const ModelConfig& m,
                                                        const std::string& arch) {
  std::vector<std::pair<std::string, Shape>> out;
  if (arch != kErnie) return out;
  for (int i = m.first_dense_layers; i < m.num_layers; ++i)
    out.emplace_back(fmt::format("model.layers.{}.mlp.moe_statics.e_score_correction_bias", i),
                     Shape{1, m.moe.num_experts});
  return out;
}

/// The HF tensor of `link` cut from the xmoe tensor `x` (f32, CPU).
Tensor to_hf(const TensorLink& link, const Tensor& x) {
  if (x.dim() == 1) return x.clone();
  const int64_t R = x.size(0), C = x.size(1), w = link.hf_shape()[link.transpose ? 0 : 1];
  Tensor out = Tensor::empty(link.hf_shape());
  const float* s = x.data<float>();
  float* o = out.data<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < w; ++c)
      o[link.transpose ? c * R + r : r * w + c] = s[r * C + link.xmoe_col(c)];
  return out;
}

/// Writes the HF tensor `h` (f32) into its place in the xmoe tensor `x`.
void from_hf(const TensorLink& link, const Tensor& h, Tensor& x) {
  if (x.dim() == 1) {
    x.copy_from(h);
    return;
  }
  const int64_t R = x.size(0), C = x.size(1), w = link.hf_shape()[link.transpose ? 0 : 1];
  const float* s = h.data<float>();
  float* o = x.data<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < w; ++c)
      o[r * C + link.xmoe_col(c)] = s[link.transpose ? c * R + r : r * w + c];
}

/// A float as JSON shows it: its shortest decimal (1e-05, not 9.999999747378752e-06), which
/// reads back as the same float.
double json_float(float v) {
  return std::stod(fmt::format("{}", v));
}

std::string dtype_json_name(DType dtype) {
  return dtype == DType::bf16 ? "bfloat16" : "float32";
}

}  // namespace

std::string hf_architecture(const ModelConfig& model, const std::string& requested) {
  std::string arch = requested;
  if (requested.empty() || requested == "auto")
    arch = all_dense(model)                          ? kLlama
           : model.moe.gate == "sigmoid"             ? kGlm4Moe
           : unsupported_by(model, kMixtral).empty() ? kMixtral
                                                     : kErnie;
  const std::string why = unsupported_by(model, arch);
  const bool chosen = requested.empty() || requested == "auto";
  XMOE_CHECK(why.empty(), "[hf] {}: {}",
             chosen ? std::string("no Hugging Face architecture computes this model")
                    : "this model cannot be exported as " + arch,
             why);
  return arch;
}

json hf_config(const ModelConfig& m, const std::string& arch, DType dtype) {
  const MoeConfig& e = m.moe;
  json c = {{"architectures", {arch}},
            {"model_type", model_type(arch)},
            {"vocab_size", m.vocab_size},
            {"hidden_size", m.d_model},
            {"num_hidden_layers", m.num_layers},
            {"num_attention_heads", m.num_heads},
            {"num_key_value_heads", m.num_kv_heads},
            {"head_dim", m.d_model / m.num_heads},
            {"max_position_embeddings", m.max_seq_len},
            {"rms_norm_eps", json_float(m.norm_eps)},
            {"rope_theta", json_float(m.rope_theta)},
            {"rope_scaling", nullptr},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"attention_dropout", 0.0},
            {"initializer_range", json_float(m.init_std)},
            {"tie_word_embeddings", m.tie_embeddings},
            {"use_cache", true},
            {"bos_token_id", nullptr},
            {"eos_token_id", nullptr},
            {"torch_dtype", dtype_json_name(dtype)}};
  if (arch == kLlama) {
    c["intermediate_size"] = m.dense_hidden;
    c["mlp_bias"] = false;
    c["pretraining_tp"] = 1;
  } else if (arch == kMixtral) {
    c["intermediate_size"] = e.expert_hidden;
    c["num_local_experts"] = e.num_experts;
    c["num_experts_per_tok"] = e.top_k;
    c["sliding_window"] = nullptr;
    c["router_aux_loss_coef"] = json_float(e.aux_loss_weight);
    c["output_router_logits"] = false;
  } else if (arch == kErnie) {
    c["intermediate_size"] = m.dense_hidden;
    c["use_bias"] = false;
    c["moe_intermediate_size"] = e.expert_hidden;
    c["moe_num_experts"] = e.num_experts;
    c["moe_k"] = e.top_k;
    c["moe_num_shared_experts"] = e.num_shared_experts;
    c["moe_layer_start_index"] = m.first_dense_layers;
    c["moe_layer_end_index"] = m.num_layers - 1;
    c["moe_layer_interval"] = 1;
    c["moe_norm_min"] = 1e-12;
    c["router_aux_loss_coef"] = json_float(e.aux_loss_weight);
    c["pad_token_id"] = nullptr;
  } else {
    c["intermediate_size"] = m.dense_hidden;
    c["moe_intermediate_size"] = e.expert_hidden;
    c["n_routed_experts"] = e.num_experts;
    c["n_shared_experts"] = e.num_shared_experts;
    c["num_experts_per_tok"] = e.top_k;
    c["first_k_dense_replace"] = m.first_dense_layers;
    c["n_group"] = e.num_groups;
    c["topk_group"] = e.topk_groups;
    c["routed_scaling_factor"] = json_float(e.routed_scaling);
    c["norm_topk_prob"] = true;
    c["partial_rotary_factor"] = 1.0;
    c["use_qk_norm"] = false;
    c["num_nextn_predict_layers"] = 0;
  }
  return c;
}

namespace {

/// config.json's value of `key`, which must exist and be of the JSON kind `T` reads.
template <class T>
T required(const json& c, const std::string& key, const std::string& path) {
  XMOE_CHECK(c.contains(key) && !c[key].is_null(), "[hf] {}: config.json has no '{}'", path, key);
  try {
    return c[key].get<T>();
  } catch (const json::exception&) {
    XMOE_FAIL("[hf] {}: config.json '{}' = {} is not of the expected type", path, key,
              c[key].dump());
  }
}

/// Refuses a key present with a value other than the one xmoe's math has.
void require_value(const json& c, const std::string& key, const json& allowed,
                   const std::string& path, const std::string& why) {
  if (!c.contains(key)) return;
  const json& v = c[key];
  const bool same = v == allowed || (v.is_number() && allowed.is_number() &&
                                     v.get<double>() == allowed.get<double>());
  XMOE_CHECK(same, "[hf] {}: config.json '{}' = {} is not supported: {}", path, key, v.dump(), why);
}

}  // namespace

ModelConfig model_config_from_hf(const json& c, const std::string& path) {
  XMOE_CHECK(c.is_object(), "[hf] {}: config.json is not a JSON object", path);
  XMOE_CHECK(c.contains("architectures") && c["architectures"].is_array() &&
                 c["architectures"].size() == 1 && c["architectures"][0].is_string(),
             "[hf] {}: config.json 'architectures' must name one architecture", path);
  const std::string arch = c["architectures"][0].get<std::string>();
  XMOE_CHECK(arch == kMixtral || arch == kGlm4Moe || arch == kErnie || arch == kLlama,
             "[hf] {}: architecture {} cannot be imported (xmoe reads {}, {}, {} and {}){}", path,
             arch, kGlm4Moe, kErnie, kMixtral, kLlama,
             arch == kDeepseekV3 ? ": DeepseekV3ForCausalLM uses multi-head latent attention" : "");
  ModelConfig m;
  m.vocab_size = required<int>(c, "vocab_size", path);
  m.d_model = required<int>(c, "hidden_size", path);
  m.num_layers = required<int>(c, "num_hidden_layers", path);
  m.num_heads = required<int>(c, "num_attention_heads", path);
  m.num_kv_heads = c.contains("num_key_value_heads") && !c["num_key_value_heads"].is_null()
                       ? required<int>(c, "num_key_value_heads", path)
                       : m.num_heads;
  m.max_seq_len = required<int>(c, "max_position_embeddings", path);
  m.norm_eps = required<float>(c, "rms_norm_eps", path);
  m.rope_theta = c.contains("rope_theta") ? required<float>(c, "rope_theta", path) : 10000.0f;
  if (c.contains("initializer_range")) m.init_std = required<float>(c, "initializer_range", path);
  m.tie_embeddings = c.value("tie_word_embeddings", false);
  XMOE_CHECK(m.num_heads > 0 && m.d_model % m.num_heads == 0,
             "[hf] {}: hidden_size = {} is not a multiple of num_attention_heads = {}", path,
             m.d_model, m.num_heads);
  require_value(c, "head_dim", m.d_model / m.num_heads, path,
                "xmoe's head size is hidden_size / num_attention_heads");
  require_value(c, "rope_scaling", nullptr, path, "xmoe has plain RoPE only");
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
    require_value(c["rope_parameters"], "rope_type", "default", path + " (rope_parameters)",
                  "xmoe has plain RoPE only");
    if (c["rope_parameters"].contains("rope_theta"))
      m.rope_theta = required<float>(c["rope_parameters"], "rope_theta", path);
  }
  require_value(c, "hidden_act", "silu", path, "xmoe's FFNs are SwiGLU (silu)");
  require_value(c, "attention_bias", false, path, "xmoe's projections have no bias");
  require_value(c, "mlp_bias", false, path, "xmoe's projections have no bias");
  require_value(c, "pretraining_tp", 1, path, "the weights must be whole");
  require_value(c, "sliding_window", nullptr, path, "xmoe's attention is full causal");
  require_value(c, "partial_rotary_factor", 1.0, path, "xmoe rotates the whole head");
  require_value(c, "use_qk_norm", false, path, "xmoe has no query/key norm");
  require_value(c, "num_nextn_predict_layers", 0, path,
                "xmoe has no multi-token prediction layers");
  MoeConfig& e = m.moe;
  if (arch == kLlama) {
    m.dense_hidden = required<int>(c, "intermediate_size", path);
    m.first_dense_layers = m.num_layers;
  } else if (arch == kMixtral) {
    e.gate = "softmax_topk";
    e.softmax_before_topk = false;  // Mixtral: top-k of the logits, softmax over the k
    e.renormalize = true;
    e.num_shared_experts = 0;
    e.expert_hidden = required<int>(c, "intermediate_size", path);
    e.num_experts = required<int>(c, "num_local_experts", path);
    e.top_k = required<int>(c, "num_experts_per_tok", path);
    if (c.contains("router_aux_loss_coef"))
      e.aux_loss_weight = required<float>(c, "router_aux_loss_coef", path);
    m.first_dense_layers = 0;
    m.dense_hidden = e.expert_hidden;  // unused: no dense layer
  } else if (arch == kErnie) {
    e.gate = "softmax_topk";
    e.softmax_before_topk = true;  // ERNIE: softmax over all experts, top-k, renormalised
    e.renormalize = true;
    m.dense_hidden = required<int>(c, "intermediate_size", path);
    e.expert_hidden = required<int>(c, "moe_intermediate_size", path);
    e.num_experts = required<int>(c, "moe_num_experts", path);
    e.top_k = required<int>(c, "moe_k", path);
    e.num_shared_experts = c.value("moe_num_shared_experts", 0);
    m.first_dense_layers = c.value("moe_layer_start_index", 1);
    require_value(c, "use_bias", false, path, "xmoe's projections have no bias");
    require_value(c, "moe_layer_interval", 1, path, "xmoe's MoE layers follow the dense ones");
    if (c.contains("moe_layer_end_index") && c["moe_layer_end_index"] != -1)
      require_value(c, "moe_layer_end_index", m.num_layers - 1, path,
                    "xmoe's MoE layers go to the last layer");
    if (c.contains("router_aux_loss_coef"))
      e.aux_loss_weight = required<float>(c, "router_aux_loss_coef", path);
  } else {
    e.gate = "sigmoid";
    m.dense_hidden = required<int>(c, "intermediate_size", path);
    e.expert_hidden = required<int>(c, "moe_intermediate_size", path);
    e.num_experts = required<int>(c, "n_routed_experts", path);
    e.num_shared_experts = required<int>(c, "n_shared_experts", path);
    e.top_k = required<int>(c, "num_experts_per_tok", path);
    m.first_dense_layers = c.value("first_k_dense_replace", 0);
    e.num_groups = c.value("n_group", 1);
    e.topk_groups = c.value("topk_group", 1);
    e.routed_scaling = c.value("routed_scaling_factor", 1.0f);
    require_value(c, "norm_topk_prob", true, path,
                  "xmoe's sigmoid gate normalises the top-k weights");
  }
  return m;
}

TensorMap to_hf_tensors(const ModelConfig& model, const std::string& arch,
                        const TensorMap& xmoe_tensors) {
  TensorMap out;
  for (const TensorLink& link : tensor_links(model, arch)) {
    auto it = xmoe_tensors.find(link.xmoe);
    XMOE_CHECK(it != xmoe_tensors.end(), "[hf] the checkpoint has no tensor '{}'", link.xmoe);
    XMOE_CHECK(it->second.shape() == link.xmoe_shape && it->second.dtype() == DType::f32,
               "[hf] the checkpoint's '{}' is {}, expected f32{}", link.xmoe, it->second.str(),
               shape_str(link.xmoe_shape));
    out.emplace(link.hf, to_hf(link, it->second));
  }
  for (const auto& [name, shape] : zero_tensors(model, arch))
    out.emplace(name, Tensor::zeros(shape));
  return out;
}

TensorMap from_hf_tensors(const ModelConfig& model, const std::string& arch,
                          const TensorMap& hf_tensors, const std::string& path) {
  TensorMap out;
  std::set<std::string> used;
  for (const TensorLink& link : tensor_links(model, arch)) {
    auto it = hf_tensors.find(link.hf);
    XMOE_CHECK(it != hf_tensors.end(), "[hf] {}: no tensor '{}'", path, link.hf);
    XMOE_CHECK(it->second.shape() == link.hf_shape(),
               "[hf] {}: '{}' has shape {}, config.json says {}", path, link.hf,
               shape_str(it->second.shape()), shape_str(link.hf_shape()));
    XMOE_CHECK(it->second.dtype() == DType::f32 || it->second.dtype() == DType::bf16,
               "[hf] {}: '{}' is {}; xmoe reads F32 and BF16", path, link.hf,
               dtype_name(it->second.dtype()));
    Tensor& x = out[link.xmoe];
    if (!x.defined()) x = Tensor::zeros(link.xmoe_shape);
    from_hf(link, it->second.to(DType::f32), x);
    used.insert(link.hf);
  }
  for (const auto& [name, shape] : zero_tensors(model, arch)) {
    auto it = hf_tensors.find(name);
    if (it == hf_tensors.end()) continue;
    const Tensor t = it->second.to(DType::f32);
    const bool zero = std::all_of(t.data<float>(), t.data<float>() + t.numel(),
                                  [](float v) { return v == 0.0f; });
    XMOE_CHECK(zero, "[hf] {}: '{}' is not zero: xmoe's softmax_topk gate has no selection bias",
               path, name);
    used.insert(name);
  }
  std::vector<std::string> extra;
  for (const auto& [name, t] : hf_tensors)
    if (!used.count(name)) extra.push_back(name);
  XMOE_CHECK(extra.empty(), "[hf] {}: {} tensor(s) that {} has no place for: {}", path,
             extra.size(), arch,
             fmt::join(extra.begin(), extra.begin() + std::min<size_t>(extra.size(), 5), ", "));
  return out;
}

// ---- folders -------------------------------------------------------------------------------

namespace {

constexpr const char* kWeights = "model.safetensors";
constexpr const char* kIndex = "model.safetensors.index.json";

void require_empty_or_absent(const std::string& dir, const std::string& what) {
  std::error_code ec;
  XMOE_CHECK(!fs::exists(dir, ec) || (fs::is_directory(dir, ec) && fs::is_empty(dir, ec)),
             "[hf] {} {} exists and is not empty: give a new folder", what, dir);
}

/// The step-N folder of `checkpoint` (itself, or a run folder's latest).
std::string checkpoint_folder(const std::string& checkpoint) {
  if (fs::exists(fs::path(checkpoint) / "manifest.json")) return checkpoint;
  const auto latest = latest_checkpoint(checkpoint);
  XMOE_CHECK(latest.has_value(), "[hf] {} is neither a checkpoint nor a run folder with one",
             checkpoint);
  return *latest;
}

/// Shards of at most `max_bytes` (a tensor larger than that gets a shard of its own), in name
/// order: one map per file.
std::vector<TensorMap> shard(const TensorMap& tensors, int64_t max_bytes) {
  std::vector<TensorMap> shards(1);
  int64_t bytes = 0;
  for (const auto& [name, t] : tensors) {
    const auto n = static_cast<int64_t>(t.nbytes());
    if (!shards.back().empty() && bytes + n > max_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().emplace(name, t);
    bytes += n;
  }
  return shards;
}

/// Every tensor of an HF folder: model.safetensors, or the files its index names.
TensorMap read_hf_tensors(const std::string& dir) {
  const fs::path single = fs::path(dir) / kWeights, index = fs::path(dir) / kIndex;
  std::vector<std::string> files;
  if (fs::is_regular_file(index)) {
    json j = json::parse(io::read_file(index.string()), nullptr, false);
    XMOE_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
               "[hf] {}: no weight_map", index.string());
    std::set<std::string> names;
    for (const auto& [tensor, file] : j["weight_map"].items()) {
      XMOE_CHECK(file.is_string() && file.get<std::string>().find('/') == std::string::npos,
                 "[hf] {}: '{}' maps to {}, not a file name", index.string(), tensor, file.dump());
      names.insert(file.get<std::string>());
    }
    files.assign(names.begin(), names.end());
  } else {
    XMOE_CHECK(fs::is_regular_file(single), "[hf] {}: neither {} nor {} is there", dir, kWeights,
               kIndex);
    files.push_back(kWeights);
  }
  TensorMap out;
  for (const std::string& f : files) {
    const std::string path = (fs::path(dir) / f).string();
    XMOE_CHECK(fs::is_regular_file(path), "[hf] {}: missing (named by {})", path, kIndex);
    for (auto& [name, t] : io::load_safetensors(path).tensors) {
      XMOE_CHECK(!out.count(name), "[hf] {}: tensor '{}' is in two files", dir, name);
      out.emplace(name, std::move(t));
    }
  }
  return out;
}

}  // namespace

namespace {

// tokenizer_config.json's special tokens of a SentencePiece model: its own pieces for the ids it
// reserves (null where it reserves none).
json sentencepiece_special_tokens(const data::Tokenizer& sp) {
  const auto token = [&](int64_t id) -> json { return id >= 0 ? json(sp.piece(id)) : json(); };
  return {{"bos_token", token(sp.bos_id())},
          {"eos_token", token(sp.eos_id())},
          {"unk_token", token(sp.unk_id())},
          {"pad_token", nullptr}};
}

}  // namespace

HfExportResult export_hf(const std::string& checkpoint, const std::string& out_dir,
                         const HfExportOptions& options) {
  XMOE_CHECK(options.dtype == DType::f32 || options.dtype == DType::bf16,
             "[hf] --dtype {} is not f32 or bf16", dtype_name(options.dtype));
  XMOE_CHECK(options.max_shard_bytes > 0, "[hf] --max-shard-size must be > 0");
  require_empty_or_absent(out_dir, "--out");
  HfExportResult r;
  r.checkpoint = checkpoint_folder(checkpoint);
  const Checkpoint ckpt = load_checkpoint(r.checkpoint);
  const Config config = load_config_string(ckpt.state.at("config").get<std::string>(),
                                           r.checkpoint + "/manifest.json");
  r.architecture = hf_architecture(config.model, options.architecture);
  TensorMap tensors = to_hf_tensors(config.model, r.architecture, ckpt.tensors);
  if (options.dtype != DType::f32)
    for (auto& [name, t] : tensors) t = t.to(options.dtype);

  const std::string dir = fs::path(out_dir).lexically_normal().string();
  const std::string tmp = dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  const auto write_json = [&](const std::string& name, const json& j) {
    io::write_file_atomic((fs::path(tmp) / name).string(), j.dump(2) + "\n");
    r.files.push_back(name);
  };
  const std::vector<TensorMap> shards = shard(tensors, options.max_shard_bytes);
  const io::Metadata meta = {{"format", "pt"}};  // transformers reads "pt" files
  json weight_map = json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name = shards.size() == 1 ? std::string(kWeights)
                                                : fmt::format("model-{:05d}-of-{:05d}.safetensors",
                                                              i + 1, shards.size());
    io::save_safetensors((fs::path(tmp) / name).string(), shards[i], meta);
    r.files.push_back(name);
    for (const auto& [tensor, t] : shards[i]) {
      weight_map[tensor] = name;
      r.tensor_bytes += static_cast<int64_t>(t.nbytes());
    }
  }
  if (shards.size() > 1)
    write_json(kIndex,
               {{"metadata", {{"total_size", r.tensor_bytes}}}, {"weight_map", weight_map}});
  write_json("config.json", hf_config(config.model, r.architecture, options.dtype));
  // The tokenizer the run trained with (the checkpoint's copy), as it is.
  const std::string tokenizer = checkpoint_tokenizer(r.checkpoint, ckpt);
  json generation = {{"do_sample", true},  // xmoe generate's sampling defaults
                     {"temperature", 0.8},
                     {"top_k", 40},
                     {"max_length", config.model.max_seq_len}};
  if (!tokenizer.empty()) {
    const std::string name = fs::path(tokenizer).filename().string();
    io::write_file_atomic((fs::path(tmp) / name).string(), io::read_file(tokenizer));
    r.files.push_back(name);
    if (name == "tokenizer.json") {
      write_json("tokenizer_config.json", {{"tokenizer_class", "PreTrainedTokenizerFast"},
                                           {"model_max_length", config.model.max_seq_len},
                                           {"clean_up_tokenization_spaces", false}});
    } else {
      // A SentencePiece model: transformers' Llama tokenizer reads tokenizer.model (BPE with
      // byte fallback, "▁" for spaces). xmoe adds no BOS/EOS when it encodes a text, so neither
      // does the exported one; the special tokens are the model's own.
      const std::unique_ptr<data::Tokenizer> sp = data::load_tokenizer(tokenizer);
      const json special = sentencepiece_special_tokens(*sp);
      json tc = {{"tokenizer_class", "LlamaTokenizer"},
                 {"model_max_length", config.model.max_seq_len},
                 {"add_bos_token", false},
                 {"add_eos_token", false},
                 {"clean_up_tokenization_spaces", false}};
      tc.update(special);
      write_json("tokenizer_config.json", tc);
      if (sp->bos_id() >= 0) generation["bos_token_id"] = sp->bos_id();
      if (sp->eos_id() >= 0) generation["eos_token_id"] = sp->eos_id();
    }
  } else if (config.model.vocab_size == data::ByteTokenizer::kVocabSize) {
    io::write_file_atomic((fs::path(tmp) / "tokenizer.json").string(),
                          data::ByteTokenizer::hf_tokenizer_json());
    r.files.push_back("tokenizer.json");
    write_json("tokenizer_config.json", {{"tokenizer_class", "PreTrainedTokenizerFast"},
                                         {"model_max_length", config.model.max_seq_len},
                                         {"clean_up_tokenization_spaces", false}});
  }
  write_json("generation_config.json", generation);
  io::fsync_path(tmp);
  if (fs::exists(dir)) fs::remove(dir);  // empty (checked above)
  fs::rename(tmp, dir);
  return r;
}

HfImportResult import_hf(const std::string& hf_dir, const std::string& run_dir,
                         const std::vector<std::string>& overrides) {
  require_empty_or_absent(run_dir, "--out");
  const std::string config_path = (fs::path(hf_dir) / "config.json").string();
  XMOE_CHECK(fs::is_regular_file(config_path),
             "[hf] {}: no config.json (not a Hugging Face "
             "model folder?)",
             hf_dir);
  const json hf = json::parse(io::read_file(config_path), nullptr, false);
  XMOE_CHECK(!hf.is_discarded(), "[hf] {}: not valid JSON", config_path);
  HfImportResult r;
  Config& config = r.config;
  config.model = model_config_from_hf(hf, config_path);
  r.architecture = hf["architectures"][0].get<std::string>();
  config.train.out_dir = run_dir;
  // As `xmoe train` stores them: a resume from any directory reads the same data.
  config.data.dir = fs::absolute(config.data.dir).lexically_normal().string();
  config.data.corpus = fs::absolute(config.data.corpus).lexically_normal().string();
  config.train.seq_len = std::min(config.train.seq_len, config.model.max_seq_len);
  const Config imported = config;
  for (const std::string& o : overrides) apply_override(config, o);
  // The keys config.json fixes cannot change: the weights would not fit them.
  const json before = hf_config(imported.model, r.architecture, DType::f32);
  const json after = hf_config(config.model, r.architecture, DType::f32);
  XMOE_CHECK(before == after,
             "[hf] --set changes the architecture that {} describes ({}); only keys config.json "
             "does not hold (training settings, model.moe losses, ...) can be set",
             config_path, fmt::join(config_differences(imported, config, "model."), "; "));
  validate(config);
  hf_architecture(config.model, r.architecture);  // --set may leave the architecture's math

  TensorMap tensors =
      from_hf_tensors(config.model, r.architecture, read_hf_tensors(hf_dir), hf_dir);
  // A run that starts here: zero AdamW moments and step, data from the beginning.
  TensorMap state;
  for (const auto& [name, t] : tensors) {
    if (name.size() > 12 && name.compare(name.size() - 12, 12, ".router.bias") == 0) continue;
    // An expert slice "<param>@<e>" has moments "<param>.adam_m@<e>" (train/state.h).
    const size_t at = name.find('@');
    const std::string param = name.substr(0, at),
                      slice = at == std::string::npos ? "" : name.substr(at);
    state.emplace(param + ".adam_m" + slice, Tensor::zeros(t.shape()));
    state.emplace(param + ".adam_v" + slice, Tensor::zeros(t.shape()));
  }
  state.emplace(optim::AdamW::kStepKey, Tensor::from_vector<int64_t>({0}, {1}));
  tensors.merge(state);
  json manifest;
  manifest["config"] = to_yaml(config);
  manifest["step"] = 0;
  manifest["data_position"] = 0;
  manifest["seed"] = config.train.seed;
  manifest["layout"] = {{"world", 1}, {"ep", 1}, {"dp", 1}};
  manifest["imported_from"] = fs::absolute(hf_dir).lexically_normal().string();
  r.checkpoint = (fs::path(run_dir) / "step-0").string();
  save_checkpoint(r.checkpoint, tensors, manifest);
  return r;
}

}  // namespace xmoe::train
