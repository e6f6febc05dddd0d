#pragma once
// Hugging Face model folders (docs/ecosystem.md): `xmoe export --format hf` writes a checkpoint
// as config.json + model.safetensors (+ index when sharded) + tokenizer files in the naming of
// the transformers architecture with the same math; `xmoe import --hf` reads such a folder back
// into a run folder whose step-0 checkpoint `xmoe train --resume` continues from.
//
//   xmoe model                                          -> architecture
//   moe.gate = sigmoid (groups, bias, shared experts,    -> Glm4MoeForCausalLM (DeepSeek-V3's
//     dense first layers)                                    MoE with GQA attention)
//   moe.gate = softmax_topk, renormalised, no shared     -> MixtralForCausalLM
//     experts, no dense first layers
//   moe.gate = softmax_topk, renormalised, with shared   -> Ernie4_5_MoeForCausalLM (q and k
//     experts or dense first layers                          rows reordered for its interleaved
//                                                            RoPE pairs)
//   every layer dense (first_dense_layers = num_layers)  -> LlamaForCausalLM
// Anything else is refused with an error naming the config key and the feature.
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/core/tensor.h"

namespace xmoe::train {

/// "Glm4MoeForCausalLM", "Ernie4_5_MoeForCausalLM", "MixtralForCausalLM" or "LlamaForCausalLM"
/// for `model`; `requested`
/// ("" or "auto" = choose) must be that one. Throws "[hf] ..." naming the config key whose
/// value no transformers architecture expresses exactly (and why DeepseekV3ForCausalLM is not one).
std::string hf_architecture(const ModelConfig& model, const std::string& requested = "auto");

/// config.json of `model` as `architecture`, weights stored in `dtype` (f32 or bf16).
nlohmann::json hf_config(const ModelConfig& model, const std::string& architecture, DType dtype);

/// The ModelConfig a config.json describes (one of the architectures above). Every key xmoe
/// cannot honour (rope scaling, biases, qk-norm, sliding windows, ...) is an error naming the
/// key, its value and `path`. Keys that only training uses (aux losses, ...) keep xmoe's defaults.
ModelConfig model_config_from_hf(const nlohmann::json& config, const std::string& path);

/// A checkpoint's parameters (names as xmoe saves them: experts one slice per expert,
/// "<name>@<e>", and the sigmoid gate's "<layer>.moe.router.bias") -> the architecture's tensors
/// (f32, HF layout [out, in]). Every parameter of the model must be present and used.
std::map<std::string, Tensor> to_hf_tensors(const ModelConfig& model,
                                            const std::string& architecture,
                                            const std::map<std::string, Tensor>& xmoe_tensors);
/// The inverse: HF tensors (f32 or bf16) -> xmoe checkpoint names, f32. A missing, misshapen or
/// unexpected tensor is an error naming it and `path`.
std::map<std::string, Tensor> from_hf_tensors(const ModelConfig& model,
                                              const std::string& architecture,
                                              const std::map<std::string, Tensor>& hf_tensors,
                                              const std::string& path);

struct HfExportOptions {
  std::string architecture = "auto";
  DType dtype = DType::f32;  ///< f32 or bf16 (rounded to nearest even)
  /// model.safetensors up to this size; above it, model-0000i-of-0000n.safetensors and
  /// model.safetensors.index.json (transformers' default is 5 GB).
  int64_t max_shard_bytes = 5'000'000'000;
};

struct HfExportResult {
  std::string architecture;
  std::string checkpoint;          ///< the step-N folder exported
  std::vector<std::string> files;  ///< written, in out_dir
  int64_t tensor_bytes = 0;
};

/// Exports `checkpoint` (a step-N folder, or a run folder: its latest) into `out_dir`, which
/// must not exist or be empty. Written into `<out_dir>.tmp` and renamed into place.
HfExportResult export_hf(const std::string& checkpoint, const std::string& out_dir,
                         const HfExportOptions& options);

struct HfImportResult {
  std::string architecture;
  std::string checkpoint;  ///< run_dir/step-0
  Config config;
};

/// Imports the HF folder `hf_dir` into the new run folder `run_dir` (absent or empty): a step-0
/// checkpoint with the folder's weights, zero AdamW moments and the config from config.json
/// (model) and xmoe's defaults (the rest), then `overrides` ("key=value"; keys of the
/// architecture that config.json fixes are refused). `xmoe train --resume --set
/// train.out_dir=<run_dir>` trains from it.
HfImportResult import_hf(const std::string& hf_dir, const std::string& run_dir,
                         const std::vector<std::string>& overrides);

}  // namespace xmoe::train
