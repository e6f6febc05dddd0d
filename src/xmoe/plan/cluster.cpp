#include "xmoe/plan/cluster.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <functional>
#include <map>

#include "xmoe/core/error.h"
#include "xmoe/io/file.h"

namespace xmoe::plan {

namespace {

constexpr double kGB = 1e9;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

/// DGX H100 / H200: 8 GPUs on NVLink 4 (450 GB/s per direction per GPU), 8 × 400 Gb/s
/// InfiniBand per node (50 GB/s per GPU). Rates are the data sheets'; gemm_efficiency is the
/// share of the bf16 peak large grouped GEMMs reach, fp8_gemm_efficiency the share of the FP8
/// peak xmoe's block-scaled FP8 grouped GEMM reached on an H100 (617-1023 TFLOP/s at the expert
/// shapes of docs/fp8.md, "Speed"; docs/plan.md).
Cluster dgx(const std::string& name, double memory_gib, double hbm_gbs) {
  Cluster c;
  c.name = name;
  c.gpus_per_node = 8;
  c.device = "cuda";
  c.gpu_memory = static_cast<int64_t>(memory_gib * kGiB);
  c.host_memory = static_cast<int64_t>(2048 * kGiB);
  c.peak_flops = 989e12;
  c.gemm_efficiency = 0.6;
  c.fp8_flops = 1979e12;
  c.fp8_gemm_efficiency = 0.4;
  c.memory_bandwidth = hbm_gbs * kGB * 0.7;  // elementwise kernels reach ~70% of HBM
  c.host_bandwidth = 50 * kGB;               // PCIe 5 x16
  c.intra = {450 * kGB, 5e-6};
  c.inter = {50 * kGB, 10e-6};
  return c;
}

/// Frontier: 4 MI250X per node = 8 GCDs of 64 GiB HBM2e (1.6 TB/s, 191.5 TFLOP/s bf16 each),
/// Infinity Fabric between GCDs (50 GB/s per direction for a GCD's all-to-all share), 4 × 25
/// GB/s Slingshot NICs per node (12.5 GB/s per GCD), 512 GiB DDR4 per node. No FP8 matrix units.
Cluster frontier() {
  Cluster c;
  c.name = "frontier";
  c.gpus_per_node = 8;
  c.device = "cuda";
  c.gpu_memory = static_cast<int64_t>(64 * kGiB);
  c.host_memory = static_cast<int64_t>(512 * kGiB);
  c.peak_flops = 191.5e12;
  c.gemm_efficiency = 0.45;
  c.memory_bandwidth = 1600 * kGB * 0.7;
  c.host_bandwidth = 36 * kGB;  // Infinity Fabric CPU-GCD link
  c.intra = {50 * kGB, 8e-6};
  c.inter = {12.5 * kGB, 20e-6};
  return c;
}

/// One accessor per key of the file: applies the YAML value to the cluster, checking it.
struct Reader {
  const std::string& source;
  std::string key(const std::string& k) const { return fmt::format("[cluster] {}: {}", source, k); }
  double number(const YAML::Node& n, const std::string& k, double lo, bool open) const {
    double v = 0;
    try {
      v = n.as<double>();
    } catch (const YAML::Exception&) {
      XMOE_FAIL("{} = '{}' is not a number", key(k), n.Scalar());
    }
    XMOE_CHECK(open ? v > lo : v >= lo, "{} = {} must be {} {}", key(k), v, open ? ">" : ">=", lo);
    return v;
  }
  /// A fraction in (0, 1].
  double fraction(const YAML::Node& n, const std::string& k) const {
    const double v = number(n, k, 0, true);
    XMOE_CHECK(v <= 1, "{} = {} must be <= 1", key(k), v);
    return v;
  }
  int integer(const YAML::Node& n, const std::string& k) const {
    int v = 0;
    try {
      v = n.as<int>();
    } catch (const YAML::Exception&) {
      XMOE_FAIL("{} = '{}' is not an integer", key(k), n.Scalar());
    }
    XMOE_CHECK(v >= 1, "{} = {} must be >= 1", key(k), v);
    return v;
  }
};

void read_link(const Reader& r, const YAML::Node& map, const std::string& name, Link& link) {
  XMOE_CHECK(map.IsMap(), "{} must be a map of bandwidth_gbs, latency_us", r.key(name));
  for (const auto& kv : map) {
    const std::string k = kv.first.as<std::string>(), full = name + "." + k;
    if (k == "bandwidth_gbs") {
      link.bandwidth = r.number(kv.second, full, 0, true) * kGB;
    } else if (k == "latency_us") {
      link.latency = r.number(kv.second, full, 0, false) * 1e-6;
    } else {
      XMOE_FAIL("{} is not a key (a link has bandwidth_gbs, latency_us)", r.key(full));
    }
  }
}

}  // namespace

std::vector<std::string> builtin_cluster_names() {
  return {"dgx-h100", "dgx-h200", "frontier"};
}

Cluster builtin_cluster(const std::string& name) {
  if (name == "dgx-h100") return dgx(name, 80, 3350);
  if (name == "dgx-h200") return dgx(name, 141, 4800);
  if (name == "frontier") return frontier();
  XMOE_FAIL("[cluster] unknown cluster '{}' (built in: dgx-h100, dgx-h200, frontier; or a file)",
            name);
}

Cluster cluster_from_yaml(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    XMOE_FAIL("[cluster] {}: not YAML or JSON: {}", source, e.what());
  }
  XMOE_CHECK(root.IsMap(), "[cluster] {}: expected a map of keys (docs/plan.md)", source);
  const Reader r{source};
  Cluster c;
  if (const YAML::Node base = root["base"]) {
    try {
      c = builtin_cluster(base.as<std::string>());
    } catch (const Error& e) {
      XMOE_FAIL("{}: {}", r.key("base"), e.what());
    }
  } else {
    c.name = std::filesystem::path(source).stem().string();
  }
  const std::map<std::string, std::function<void(const YAML::Node&)>> keys = {
      {"base", [](const YAML::Node&) {}},
      {"name", [&](const YAML::Node& n) { c.name = n.as<std::string>(); }},
      {"nodes", [&](const YAML::Node& n) { c.nodes = r.integer(n, "nodes"); }},
      {"gpus_per_node",
       [&](const YAML::Node& n) { c.gpus_per_node = r.integer(n, "gpus_per_node"); }},
      {"device",
       [&](const YAML::Node& n) {
         c.device = n.as<std::string>();
         XMOE_CHECK(c.device == "cuda" || c.device == "cpu", "{} = '{}' must be cuda or cpu",
                    r.key("device"), c.device);
       }},
      {"gpu_memory_gib",
       [&](const YAML::Node& n) {
         c.gpu_memory = static_cast<int64_t>(r.number(n, "gpu_memory_gib", 0, true) * kGiB);
       }},
      {"usable_memory",
       [&](const YAML::Node& n) { c.usable_memory = r.fraction(n, "usable_memory"); }},
      {"host_memory_gib",
       [&](const YAML::Node& n) {
         c.host_memory = static_cast<int64_t>(r.number(n, "host_memory_gib", 0, false) * kGiB);
       }},
      {"usable_host_memory",
       [&](const YAML::Node& n) { c.usable_host_memory = r.fraction(n, "usable_host_memory"); }},
      {"peak_tflops",
       [&](const YAML::Node& n) { c.peak_flops = r.number(n, "peak_tflops", 0, true) * 1e12; }},
      {"gemm_efficiency",
       [&](const YAML::Node& n) { c.gemm_efficiency = r.fraction(n, "gemm_efficiency"); }},
      {"fp8_tflops",
       [&](const YAML::Node& n) { c.fp8_flops = r.number(n, "fp8_tflops", 0, false) * 1e12; }},
      {"fp8_gemm_efficiency",
       [&](const YAML::Node& n) { c.fp8_gemm_efficiency = r.fraction(n, "fp8_gemm_efficiency"); }},
      {"memory_bandwidth_gbs",
       [&](const YAML::Node& n) {
         c.memory_bandwidth = r.number(n, "memory_bandwidth_gbs", 0, true) * kGB;
       }},
      {"host_bandwidth_gbs",
       [&](const YAML::Node& n) {
         c.host_bandwidth = r.number(n, "host_bandwidth_gbs", 0, true) * kGB;
       }},
      {"intra_node", [&](const YAML::Node& n) { read_link(r, n, "intra_node", c.intra); }},
      {"inter_node", [&](const YAML::Node& n) { read_link(r, n, "inter_node", c.inter); }},
  };
  for (const auto& kv : root) {
    const std::string k = kv.first.as<std::string>();
    const auto it = keys.find(k);
    if (it == keys.end()) {
      std::string known;
      for (const auto& [name, _] : keys) known += (known.empty() ? "" : ", ") + name;
      XMOE_FAIL("[cluster] {}: '{}' is not a key (keys: {})", source, k, known);
    }
    it->second(kv.second);
  }
  // A file without a base must declare what the planner needs.
  const std::pair<const char*, bool> required[] = {
      {"gpu_memory_gib", c.gpu_memory > 0},
      {"peak_tflops", c.peak_flops > 0},
      {"gemm_efficiency", c.gemm_efficiency > 0},
      {"memory_bandwidth_gbs", c.memory_bandwidth > 0},
      {"intra_node.bandwidth_gbs", c.intra.bandwidth > 0 || c.gpus_per_node == 1},
      {"inter_node.bandwidth_gbs", c.inter.bandwidth > 0 || c.nodes == 1},
  };
  for (const auto& [name, present] : required)
    XMOE_CHECK(present, "[cluster] {}: {} is missing (or give base: <built-in cluster>)", source,
               name);
  XMOE_CHECK(c.fp8_flops == 0 || c.fp8_gemm_efficiency > 0,
             "[cluster] {}: fp8_tflops is set, fp8_gemm_efficiency is missing", source);
  if (c.host_bandwidth <= 0) c.host_bandwidth = c.intra.bandwidth > 0 ? c.intra.bandwidth : 1e12;
  return c;
}

Cluster resolve_cluster(const std::string& name_or_path) {
  for (const std::string& n : builtin_cluster_names())
    if (n == name_or_path) return builtin_cluster(n);
  XMOE_CHECK(std::filesystem::exists(name_or_path),
             "[cluster] '{}' is neither a built-in cluster (dgx-h100, dgx-h200, frontier) nor a "
             "file",
             name_or_path);
  return cluster_from_yaml(io::read_file(name_or_path), name_or_path);
}

std::string describe(const Cluster& c) {
  return fmt::format(
      "{}: {} nodes x {} {} of {:.0f} GiB ({} in all); {:.0f} TFLOP/s peak, GEMMs at {:.0f}%{}; "
      "intra-node {:.0f} GB/s, inter-node {:.1f} GB/s per GPU",
      c.name, c.nodes, c.gpus_per_node, c.device == "cpu" ? "ranks" : "GPUs",
      static_cast<double>(c.gpu_memory) / kGiB, c.world(), c.peak_flops / 1e12,
      100 * c.gemm_efficiency,
      c.fp8_flops > 0 ? fmt::format(" (FP8 {:.0f}, at {:.0f}%)", c.fp8_flops / 1e12,
                                    100 * c.fp8_gemm_efficiency)
                      : "",
      c.intra.bandwidth / kGB, c.inter.bandwidth / kGB);
}

}  // namespace xmoe::plan
