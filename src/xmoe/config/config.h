#pragma once
// The resolved configuration of a run. Every key is declared once in config.cpp's key table
// (name, default, range, doc), which drives YAML parsing, `--set key=value`, validation,
// `xmoe config show` and docs/config.md.
#include <cstdint>
#include <string>
#include <vector>

namespace xmoe {

struct MoeConfig {
  int num_experts = 16;        ///< routed experts E
  int top_k = 2;               ///< experts per token k
  int expert_hidden = 128;     ///< f: hidden width of one routed expert
  int num_shared_experts = 1;  ///< always-on experts (one SwiGLU of width shared * f)
  /// off | routing | all (CUDA): the shared experts on a second stream beside the routed path's
  /// routing stages, or beside all of it (the default: same bits, faster on an H100)
  std::string shared_overlap = "all";
  std::string gate = "softmax_topk";  ///< softmax_topk | sigmoid | switch | xmoe
  // softmax_topk
  /// softmax over all E then top-k (GShard), else top-k then softmax (Mixtral)
  bool softmax_before_topk = true;
  bool renormalize = true;  ///< renormalise the k weights to sum to 1
  // sigmoid (DeepSeek-V3)
  int num_groups = 1;              ///< expert groups for group-limited routing
  int topk_groups = 1;             ///< groups a token may route into
  float routed_scaling = 1.0f;     ///< multiplies routed weights
  float bias_update_rate = 1e-3f;  ///< aux-loss-free balancing bias step (0 = off)
  /// f32 | bf16: the linear router's GEMM operands (f32 accumulation and f32 logits either way)
  std::string router_dtype = "f32";
  // xmoe (cosine router)
  int router_dim = 16;              ///< low-dimensional projection width
  float router_temperature = 0.3f;  ///< initial temperature (learned)
  // losses
  float aux_loss_weight = 0.01f;     ///< GShard/Switch load-balance loss
  float seq_aux_loss_weight = 0.0f;  ///< sequence-level balance loss
  float z_loss_weight = 0.0f;        ///< router z-loss
  // implementation
  std::string impl = "pft";       ///< pft (padding-free) | padded (capacity, drops overflow)
  float capacity_factor = 1.25f;  ///< padded only
  std::string dispatch = "auto";  ///< auto | local | all_to_all | rbd
  /// f32 | bf16: dtype of the routed experts' weight gradients (the master weights stay f32)
  std::string expert_grad_dtype = "f32";
  /// bf16 | fp8: the routed experts' forward and data-gradient GEMMs in the compute dtype, or in
  /// FP8 E4M3 with block scales (docs/fp8.md)
  std::string expert_dtype = "bf16";
  int expert_chunks = 0;  ///< the experts' [N, f] activations in this many row chunks (0: auto)
  /// keep the experts' input rows [N, d] for backward instead of gathering them again from x
  /// (one gather pass less per layer for N * d * 2 bytes more per layer; docs/moe.md)
  bool keep_expert_rows = false;
  /// off | auto | N: Dispatch, Expert and Combine in N chunks of local experts (docs/pipeline.md)
  std::string pipeline = "off";
  std::string pipeline_backward = "same";  ///< same | off | auto | N: the backward's chunks
  std::string pipeline_profile;            ///< the `xmoe profile` file for auto ("": run folder)

  bool operator==(const MoeConfig&) const = default;
};

/// model.moe.pipeline (and pipeline_backward, "same" excepted): the chunk count, 1 for off, 0
/// for auto. Throws naming `key` and the value otherwise.
int parse_pipeline_chunks(const std::string& value, const char* key);

struct ModelConfig {
  int vocab_size = 256;
  int d_model = 256;
  int num_layers = 4;
  int num_heads = 4;
  int num_kv_heads = 4;  ///< < num_heads: grouped-query attention
  int max_seq_len = 256;
  int dense_hidden = 512;  ///< SwiGLU width of the first_dense_layers dense FFNs
  int first_dense_layers = 1;
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  float init_std = 0.02f;
  bool tie_embeddings = false;
  std::vector<std::string> recompute;  ///< modules recomputed in backward: attention, ffn, moe
  MoeConfig moe;

  bool operator==(const ModelConfig&) const = default;
};

struct DataConfig {
  std::string corpus = "/usr/share/games/fortunes";  ///< a text file or a folder of text files
  std::string dir = "data/default";  ///< where prepared token files live (train.bin, val.bin)
  float val_fraction = 0.05f;
  /// Several prepared folders trained on together, each "DIR:WEIGHT" (data/mix.h); when set,
  /// training reads these instead of data.dir.
  std::vector<std::string> mix;

  bool operator==(const DataConfig&) const = default;
};

/// One entry of data.mix.
struct DataMixEntry {
  std::string dir;
  double weight = 0;  ///< as given (> 0); the loader normalises the weights to sum to 1
};
/// data.mix parsed: "DIR:WEIGHT" entries (the weight after the last ':'). Throws "[config]
/// data.mix entry '...' ..." for an entry without a weight, a weight that is not a finite
/// positive number, an empty folder or a folder listed twice.
std::vector<DataMixEntry> parse_data_mix(const std::vector<std::string>& mix);

struct TrainConfig {
  int steps = 600;
  int batch_size = 16;  ///< sequences per micro-batch (per data-parallel rank)
  int seq_len = 128;
  int grad_accum = 1;
  float lr = 3e-3f;
  float min_lr = 3e-4f;
  int warmup_steps = 50;
  float weight_decay = 0.1f;
  float beta1 = 0.9f, beta2 = 0.95f, adam_eps = 1e-8f;
  /// f32 | bf16: storage of the AdamW moments m, v (computed in f32 either way;
  /// docs/training.md, "AdamW moments in bf16").
  std::string adam_moments_dtype = "f32";
  float grad_clip = 1.0f;
  int eval_every = 100;
  int eval_batches = 8;
  int save_every = 200;
  int keep_checkpoints = 0;  ///< newest step-N checkpoints kept in out_dir (0 = all)
  /// Write checkpoints on a side thread from a host copy of the state (docs/training.md).
  bool async_checkpoint = false;
  std::string on_save_error = "stop";  ///< stop | continue (docs/training.md)
  int log_every = 10;
  int max_bad_steps = 5;  ///< consecutive NaN/Inf steps before the run stops
  uint64_t seed = 1234;
  std::string out_dir = "runs/default";
  std::string device = "cpu";
  /// Compute dtype of activations and matmuls: auto (bf16 on cuda, f32 on cpu), f32, bf16.
  /// Master weights, gradients and optimizer state are f32 whatever it is (docs/cuda.md), but
  /// for train.adam_moments_dtype and model.moe.expert_grad_dtype.
  std::string dtype = "auto";
  /// Master weights and AdamW moments in (pinned) host memory, the update on CPU threads
  /// (docs/training.md, "Optimizer offload").
  bool offload_optimizer = false;
  /// offload: each module's gradients start for the host during backward once final
  bool offload_overlap = true;
  /// offload: -1 off; N >= 0: steps 1..N update as usual, from step N + 1 on each step's host
  /// update runs while the next step computes (its weights lag one update)
  int offload_delayed_update_from = -1;

  bool operator==(const TrainConfig&) const = default;
};

struct ParallelConfig {
  int ep = 1;                             ///< expert-parallel degree
  int tp = 1;                             ///< tensor-parallel degree (parallel/layout.h)
  bool ssmb = true;                       ///< tp > 1: sequence-sharded MoE blocks
  int ranks_per_node = 0;                 ///< 0 = detect; >0 declares simulated nodes
  std::string expert_placement = "none";  ///< none | affinity
  int placement_batches = 8;              ///< batches recorded to choose the affinity placement
  int zero = 0;  ///< 0 | 1 (AdamW moments sharded over dp) | 2 (also gradients reduce-scattered)
  int bucket_kib = 32 << 10;      ///< gradient bucket size (KiB of f32 gradients)
  bool overlap_grad_sync = true;  ///< each bucket's all-reduce (reduce-scatter) starts in backward
  std::string grad_partition = "off";  ///< off | auto: dense buckets sized to hide in backward
  /// A collective in flight longer than this ends the job (comm/watchdog.h); 0 = no watchdog.
  float collective_timeout_s = 600;

  bool operator==(const ParallelConfig&) const = default;
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  ParallelConfig parallel;

  bool operator==(const Config&) const = default;
};

// ---- the key table and everything derived from it (config.cpp) --------------------------

enum class ConfigType : uint8_t { int_, float_, bool_, string, uint64, string_list };

/// One row of the key table, as shown to users (docs, `xmoe config keys`).
struct ConfigKeyInfo {
  std::string name;  ///< dotted name, e.g. "model.moe.top_k"
  ConfigType type;
  std::string type_name;      ///< "int", "float", "bool", "string", "uint64", "list of string"
  std::string default_value;  ///< the struct default, formatted as in YAML
  std::string range;          ///< "[1, inf)", "softmax_topk | sigmoid | ...", "any"
  std::string doc;
};

/// Every key, in table order (model, model.moe, data, train, parallel).
const std::vector<ConfigKeyInfo>& config_keys();
/// Value of `key` formatted as a YAML scalar or flow list; throws on unknown keys.
std::string config_get(const Config& config, const std::string& key);
/// Sets `key` from its text form (lists are comma-separated); checks the type but not ranges.
void config_set(Config& config, const std::string& key, const std::string& value);

/// Loads a YAML file of nested maps mirroring the dotted names (model: {moe: {top_k: 6}}).
/// A top-level `preset: <name>` starts from that preset. Unknown keys are errors naming the key
/// and the closest known key; type errors name the key and the value. Does not validate().
Config load_config_file(const std::string& path);
/// Same, from YAML text; `source` names it in errors.
Config load_config_string(const std::string& yaml, const std::string& source = "<string>");
/// Applies "key=value" (from `--set key=value`); lists are comma-separated.
void apply_override(Config& config, const std::string& key_eq_value);
/// Checks every key's range and the cross-key rules; throws one Error listing every violation,
/// each naming the keys and their values.
void validate(const Config& config);
/// All keys as nested YAML; load_config_string(to_yaml(c)) == c.
std::string to_yaml(const Config& config);
/// docs/config.md, generated from the key table.
std::string config_reference_markdown();

/// Levenshtein distance: how "did you mean" picks the closest key (and the CLI the closest
/// command).
size_t edit_distance(const std::string& a, const std::string& b);

/// Named model/run shapes. "tiny" is exactly the struct defaults.
Config preset(const std::string& name);
std::vector<std::string> preset_names();
/// One-line description of a preset (shape, and for planning presets what is approximated).
std::string preset_description(const std::string& name);

struct ParamCount {
  int64_t total = 0;      ///< all trained parameters
  int64_t active = 0;     ///< parameters one token uses (k routed experts instead of E)
  int64_t embedding = 0;  ///< token embedding (+ LM head unless tied)
};
/// Counts parameters of the decoder: embeddings, per layer 2 RMSNorms, attention (q, k, v, o),
/// a SwiGLU FFN (dense layers) or router + routed + shared experts (MoE layers), final norm.
/// The sigmoid gate's balancing bias is not a trained parameter and is not counted.
ParamCount count_parameters(const ModelConfig& model);

}  // namespace xmoe
