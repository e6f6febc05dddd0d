// Causal / full self-attention on cuDNN's fused SDPA kernels (the graph API through the
// header-only cuDNN frontend): bf16 q, k, v in xmoe's (B, S, H, hd) layout, described to cuDNN as
// (B, H, S, hd) with strides, f32 statistics. cuDNN's Stats are xmoe's lse: the natural-log
// log-sum-exp of the scaled scores, so either side's backward takes the other's forward.
//
// One graph per (device, shape, scale, causal, direction), built on first use (heuristics mode A,
// its first plan) and kept for the process: a training run meets a handful of shapes. A shape
// cuDNN declines is remembered as declined, with one warning, and attention.cu falls back to
// xmoe's kernels.
#include <cuda_runtime.h>
#include <cudnn.h>
#include <cudnn_frontend.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "xmoe/backend/cuda/check.h"
#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/core/env.h"
#include "xmoe/core/error.h"

namespace xmoe::cuda {

namespace {

namespace fe = cudnn_frontend;

// Tensor uids of the variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV };

/// XMOE_ATTENTION_DETERMINISTIC=0 lets cuDNN's backward accumulate dq with atomics (faster on
/// some shapes, not bitwise repeatable). Default 1: the same bits every run, as xmoe's kernels.
bool deterministic_backward() {
  static const bool on = env::flag("XMOE_ATTENTION_DETERMINISTIC");
  return on;
}

struct Key {
  int device;
  bool backward;
  int64_t batch, seq, heads, kv_heads, head_dim;
  float scale;
  bool causal, deterministic;
  auto tie() const {
    return std::tie(device, backward, batch, seq, heads, kv_heads, head_dim, scale, causal,
                    deterministic);
  }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;  // null: cuDNN declined the shape
  size_t workspace_bytes = 0;
};

struct State {
  std::mutex mutex;
  std::map<int, cudnnHandle_t> handles;  // one per device, re-pointed at each call's stream
  std::map<Key, Entry> graphs;
};
State& state() {
  static State* s = new State();  // never destroyed: handles outlive static teardown order
  return *s;
}

void check_cudnn(cudnnStatus_t status, const char* call) {
  if (status != CUDNN_STATUS_SUCCESS)
    XMOE_FAIL("[attention] {} failed: {} ({})", call, cudnnGetErrorString(status),
              static_cast<int>(status));
}

int current_device() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// Caller holds the mutex.
cudnnHandle_t handle_for(State& s, int device) {
  auto it = s.handles.find(device);
  if (it != s.handles.end()) return it->second;
  cudnnHandle_t handle = nullptr;
  check_cudnn(cudnnCreate(&handle), "cudnnCreate");
  s.handles.emplace(device, handle);
  return handle;
}

// (B, S, H, hd) storage seen as (B, H, S, hd).
std::shared_ptr<fe::graph::Tensor_attributes> bshd(fe::graph::Graph& g, const char* name,
                                                   int64_t uid, int64_t b, int64_t s, int64_t h,
                                                   int64_t hd) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({b, h, s, hd})
                      .set_stride({s * h * hd, hd, h * hd, 1}));
}

void set_bshd(const std::shared_ptr<fe::graph::Tensor_attributes>& t, int64_t uid, int64_t b,
              int64_t s, int64_t h, int64_t hd) {
  t->set_output(true).set_uid(uid).set_dim({b, h, s, hd}).set_stride({s * h * hd, hd, h * hd, 1});
}

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

/// A bf16 graph (f32 math) with the inputs q, k, v that both directions read.
struct GraphInputs {
  std::shared_ptr<fe::graph::Graph> graph;
  TensorPtr q, k, v;
};
GraphInputs make_graph(const Key& k) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return GraphInputs{g, bshd(*g, "q", kQ, k.batch, k.seq, k.heads, k.head_dim),
                     bshd(*g, "k", kK, k.batch, k.seq, k.kv_heads, k.head_dim),
                     bshd(*g, "v", kV, k.batch, k.seq, k.kv_heads, k.head_dim)};
}

std::shared_ptr<fe::graph::Graph> forward_graph(const Key& k) {
  auto [g, q, kt, v] = make_graph(k);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("xmoe_attention")
                     .set_generate_stats(true)
                     .set_attn_scale(k.scale)
                     .set_causal_mask(k.causal);
  auto [o, stats] = g->sdpa(q, kt, v, options);
  set_bshd(o, kO, k.batch, k.seq, k.heads, k.head_dim);
  stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({k.batch, k.heads, k.seq, 1})
      .set_stride({k.heads * k.seq, k.seq, 1, 1});
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const Key& k) {
  auto [g, q, kt, v] = make_graph(k);
  auto o = bshd(*g, "o", kO, k.batch, k.seq, k.heads, k.head_dim);
  auto dout = bshd(*g, "dout", kdO, k.batch, k.seq, k.heads, k.head_dim);
  auto stats = g->tensor(fe::graph::Tensor_attributes()
                             .set_name("stats")
                             .set_uid(kStats)
                             .set_data_type(fe::DataType_t::FLOAT)
                             .set_dim({k.batch, k.heads, k.seq, 1})
                             .set_stride({k.heads * k.seq, k.seq, 1, 1}));
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("xmoe_attention_backward")
                     .set_attn_scale(k.scale)
                     .set_causal_mask(k.causal)
                     .set_deterministic_algorithm(k.deterministic);
  auto [dq, dk, dv] = g->sdpa_backward(q, kt, v, o, dout, stats, options);
  set_bshd(dq, kdQ, k.batch, k.seq, k.heads, k.head_dim);
  set_bshd(dk, kdK, k.batch, k.seq, k.kv_heads, k.head_dim);
  set_bshd(dv, kdV, k.batch, k.seq, k.kv_heads, k.head_dim);
  return g;
}

Key key_of(const CudnnAttentionShape& shape, bool backward) {
  return Key{current_device(), backward,
             shape.batch,      shape.seq,
             shape.heads,      shape.kv_heads,
             shape.head_dim,   shape.scale,
             shape.causal,     backward && deterministic_backward()};
}

// The cached graph of `key`, built on first use. Caller holds the mutex.
const Entry& entry_for(State& s, const Key& key) {
  auto it = s.graphs.find(key);
  if (it != s.graphs.end()) return it->second;
  Entry entry;
  cudnnHandle_t handle = handle_for(s, key.device);
  auto graph = key.backward ? backward_graph(key) : forward_graph(key);
  fe::error_t built = graph->build(handle, {fe::HeurMode_t::A});
  int64_t workspace = 0;
  if (built.is_good() && graph->get_workspace_size(workspace).is_good()) {
    entry.graph = std::move(graph);
    entry.workspace_bytes = static_cast<size_t>(workspace);
    spdlog::debug("[attention] cuDNN {} graph for B={} S={} H={} Hkv={} hd={}{}: workspace {} B",
                  key.backward ? "backward" : "forward", key.batch, key.seq, key.heads,
                  key.kv_heads, key.head_dim, key.causal ? " causal" : "", workspace);
  } else {
    spdlog::warn(
        "[attention] cuDNN declined the {} of B={} S={} H={} Hkv={} hd={}{}{} ({}); "
        "xmoe's kernels run it",
        key.backward ? "backward" : "forward", key.batch, key.seq, key.heads, key.kv_heads,
        key.head_dim, key.causal ? " causal" : "", key.deterministic ? " deterministic" : "",
        built.get_message());
  }
  return s.graphs.emplace(key, std::move(entry)).first->second;
}

bool ready(const CudnnAttentionShape& shape, bool backward, size_t* workspace_bytes) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  const Entry& e = entry_for(s, key_of(shape, backward));
  if (workspace_bytes != nullptr) *workspace_bytes = e.workspace_bytes;
  return e.graph != nullptr;
}

void execute(const CudnnAttentionShape& shape, bool backward,
             std::unordered_map<int64_t, void*>& pack, void* workspace, Stream stream) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  const Key key = key_of(shape, backward);
  const Entry& e = entry_for(s, key);
  XMOE_CHECK(e.graph != nullptr,
             "[attention] cuDNN has no graph for this shape (ask *_ready first)");
  cudnnHandle_t handle = handle_for(s, key.device);
  check_cudnn(cudnnSetStream(handle, stream), "cudnnSetStream");
  fe::error_t status = e.graph->execute(handle, pack, workspace);
  XMOE_CHECK(status.is_good(), "[attention] cuDNN {} failed: {}", backward ? "backward" : "forward",
             status.get_message());
}

}  // namespace

bool cudnn_attention_available() {
  static const bool available = [] {
    // cudnnGetVersion needs no handle: it tells whether the library loaded at all.
    const size_t version = cudnnGetVersion();
    if (version < 90000) {
      spdlog::warn("[attention] cuDNN {} is older than 9.0: xmoe's kernels run the attention",
                   version);
      return false;
    }
    return true;
  }();
  return available;
}

bool cudnn_attention_forward_ready(const CudnnAttentionShape& shape, size_t* workspace_bytes) {
  return ready(shape, /*backward=*/false, workspace_bytes);
}

bool cudnn_attention_backward_ready(const CudnnAttentionShape& shape, size_t* workspace_bytes) {
  return ready(shape, /*backward=*/true, workspace_bytes);
}

void cudnn_attention_forward(const CudnnAttentionShape& shape, void* out, float* lse, const void* q,
                             const void* k, const void* v, void* workspace, Stream stream) {
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<void*>(q)},
                                          {kK, const_cast<void*>(k)},
                                          {kV, const_cast<void*>(v)},
                                          {kO, out},
                                          {kStats, lse}};
  execute(shape, /*backward=*/false, pack, workspace, stream);
}

void cudnn_attention_backward(const CudnnAttentionShape& shape, void* dq, void* dk, void* dv,
                              const void* q, const void* k, const void* v, const void* out,
                              const float* lse, const void* dout, void* workspace, Stream stream) {
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<void*>(q)},
                                          {kK, const_cast<void*>(k)},
                                          {kV, const_cast<void*>(v)},
                                          {kO, const_cast<void*>(out)},
                                          {kStats, const_cast<float*>(lse)},
                                          {kdO, const_cast<void*>(dout)},
                                          {kdQ, dq},
                                          {kdK, dk},
                                          {kdV, dv}};
  execute(shape, /*backward=*/true, pack, workspace, stream);
}

}  // namespace xmoe::cuda
