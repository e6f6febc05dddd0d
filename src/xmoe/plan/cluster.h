#pragma once
// A cluster the planner lays a run out on (docs/plan.md): nodes of accelerators, each with its
// memory, compute rates and links. Built in: dgx-h100, dgx-h200, frontier; others come from a
// YAML or JSON file of the same keys, validated with errors that name the file and the key.
#include <cstdint>
#include <string>
#include <vector>

namespace xmoe::plan {

/// One link class, as one GPU sees it: bandwidth per direction (bytes/s) and start-up latency
/// (seconds) of a message.
struct Link {
  double bandwidth = 0;
  double latency = 0;
};

struct Cluster {
  std::string name;
  int nodes = 1;
  int gpus_per_node = 8;
  std::string device = "cuda";  ///< train.device of the chosen config: cuda | cpu
  int64_t gpu_memory = 0;       ///< bytes per GPU
  /// The fraction of gpu_memory a step may peak at (the rest: the CUDA context, libraries,
  /// the allocator's cache and fragmentation).
  double usable_memory = 0.9;
  int64_t host_memory = 0;  ///< bytes per node (optimizer offload)
  /// The fraction of host_memory the offloaded optimizer's pinned memory may take (the rest: the
  /// OS, the process, the model's host copy before it reaches the GPUs).
  double usable_host_memory = 0.9;
  double peak_flops = 0;       ///< dense bf16 FLOP/s per GPU (MFU's denominator)
  double gemm_efficiency = 0;  ///< fraction of peak_flops the GEMMs reach (no profile)
  /// Dense FP8 (e4m3) FLOP/s per GPU, 0 where the GPU has no FP8 matrix units; with
  /// fp8_gemm_efficiency, the FP8 experts' GEMMs (model.moe.expert_dtype = fp8) without a profile.
  double fp8_flops = 0;
  double fp8_gemm_efficiency = 0;
  double memory_bandwidth = 0;  ///< bytes/s per GPU: elementwise work streams at this rate
  double host_bandwidth = 0;    ///< bytes/s per GPU of the host link (offload transfers)
  Link intra;                   ///< between GPUs of one node (NVLink, Infinity Fabric)
  Link inter;  ///< between nodes, this GPU's share of its node's NICs (IB, Slingshot)

  int world() const { return nodes * gpus_per_node; }
};

/// The built-in clusters (one node each; set nodes for more).
std::vector<std::string> builtin_cluster_names();
/// Throws naming the known clusters.
Cluster builtin_cluster(const std::string& name);
/// Parses a cluster description (YAML or JSON; docs/plan.md lists the keys): an optional
/// `base: <built-in>` to start from, then the keys it overrides. Every error names `source`
/// and the key: "[cluster] c.yaml: intra_node.bandwidth_gbs = -1 must be > 0".
Cluster cluster_from_yaml(const std::string& text, const std::string& source);
/// A built-in name, else a file.
Cluster resolve_cluster(const std::string& name_or_path);
/// One line: nodes × GPUs, memory, links.
std::string describe(const Cluster& cluster);

}  // namespace xmoe::plan
