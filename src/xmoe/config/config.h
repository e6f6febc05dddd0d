#pragma once
// The resolved configuration of a run. Every key is declared once in config.cpp's key table
// (name, default, range, doc), which drives YAML parsing, `--set key=value`, validation,
// `xmoe config show` and docs/config.md.
#include <cstdint>
#include <string>
#include <vector>

namespace xmoe {

struct MoeConfig {
  int num_experts = 16;          ///< routed experts E
  int top_k = 2;                 ///< experts per token k
  int expert_hidden = 128;       ///< f: hidden width of one routed expert
  int num_shared_experts = 1;    ///< always-on experts (one SwiGLU of width shared * f)
  std::string gate = "softmax_topk";  ///< softmax_topk | sigmoid | switch | xmoe
  // softmax_topk
  bool softmax_before_topk = true;  ///< softmax over all E then top-k (GShard), else top-k then softmax (Mixtral)
  bool renormalize = true;          ///< renormalise the k weights to sum to 1
  // sigmoid (DeepSeek-V3)
  int num_groups = 1;            ///< expert groups for group-limited routing
  int topk_groups = 1;           ///< groups a token may route into
  float routed_scaling = 1.0f;   ///< multiplies routed weights
  float bias_update_rate = 1e-3f;  ///< aux-loss-free balancing bias step (0 = off)
  // xmoe (cosine router)
  int router_dim = 16;           ///< low-dimensional projection width
  float router_temperature = 0.3f;  ///< initial temperature (learned)
  // losses
  float aux_loss_weight = 0.01f;     ///< GShard/Switch load-balance loss
  float seq_aux_loss_weight = 0.0f;  ///< sequence-level balance loss
  float z_loss_weight = 0.0f;        ///< router z-loss
  // implementation
  std::string impl = "pft";      ///< pft (padding-free) | padded (capacity, drops overflow)
  float capacity_factor = 1.25f; ///< padded only
  std::string dispatch = "local";  ///< local | all_to_all | rbd
};

struct ModelConfig {
  int vocab_size = 256;
  int d_model = 256;
  int num_layers = 4;
  int num_heads = 4;
  int num_kv_heads = 4;          ///< < num_heads: grouped-query attention
  int max_seq_len = 256;
  int dense_hidden = 512;        ///< SwiGLU width of the first_dense_layers dense FFNs
  int first_dense_layers = 1;
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  float init_std = 0.02f;
  bool tie_embeddings = false;
  std::vector<std::string> recompute;  ///< modules recomputed in backward: attention, ffn, moe
  MoeConfig moe;
};

struct DataConfig {
  std::string corpus = "/usr/share/games/fortunes";  ///< a text file or a folder of text files
  std::string dir = "data/default";  ///< where prepared token files live (train.bin, val.bin)
  float val_fraction = 0.05f;
};

struct TrainConfig {
  int steps = 600;
  int batch_size = 16;           ///< sequences per micro-batch (per data-parallel rank)
  int seq_len = 128;
  int grad_accum = 1;
  float lr = 3e-3f;
  float min_lr = 3e-4f;
  int warmup_steps = 50;
  float weight_decay = 0.1f;
  float beta1 = 0.9f, beta2 = 0.95f, adam_eps = 1e-8f;
  float grad_clip = 1.0f;
  int eval_every = 100;
  int eval_batches = 8;
  int save_every = 200;
  int log_every = 10;
  int max_bad_steps = 5;         ///< consecutive NaN/Inf steps before the run stops
  uint64_t seed = 1234;
  std::string out_dir = "runs/default";
  std::string device = "cpu";
};

struct ParallelConfig {
  int ep = 1;                    ///< expert-parallel degree
  int tp = 1;                    ///< tensor-parallel degree (turns on SSMB)
  int ranks_per_node = 0;        ///< 0 = detect; >0 declares simulated nodes
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  ParallelConfig parallel;
};

}  // namespace xmoe
