#pragma once
// Trainable parameters. Modules own their Parameters and expose them by pointer; the optimizer,
// gradient synchronisation and checkpoints work on that flat list.
#include <string>
#include <utility>
#include <vector>

#include "xmoe/core/rng.h"
#include "xmoe/core/tensor.h"

namespace xmoe {

enum class ParamKind : uint8_t {
  dense,   ///< replicated on every rank; gradient all-reduced over the world
  expert,  ///< sharded over the expert-parallel group along dim 0; replicated over dp
  /// a tensor-parallel shard (Parameter::shard): its gradient already sums the tp group's
  /// losses; all-reduced over the tp-replica group (the ranks holding the same shard)
  tensor_shard,
  /// replicated on every rank, but the tp ranks of a group compute the same gradient (the MoE
  /// layer without SSMB runs replicated over the tp group): all-reduced over the tp-replica group
  tensor_replicated,
};

/// Where a parameter's tensor sits in the whole (unsharded) one, of shape `whole` (empty: not
/// sharded). The whole tensor is seen as view() (`view`, or `whole` when empty: any shape of its
/// element count, row-major; e.g. a fused [d, 2h] gate|up as [d, 2, h]); this rank holds indices
/// [offset, offset + n) along dim `dim` of it and all of every other dim, stored row-major.
struct ShardSpec {
  Shape whole;
  Shape view;
  int dim = 0;
  int64_t offset = 0;

  bool sharded() const { return !whole.empty(); }
  const Shape& view_shape() const { return view.empty() ? whole : view; }
  /// Product of the view's dims before `dim` (runs of the shard) and after it (run stride).
  int64_t outer() const;
  int64_t inner() const;
};

/// This rank's shard of `whole` (a tensor of spec.whole's element count), a new contiguous
/// tensor of `local_shape`.
Tensor slice_shard(const Tensor& whole, const ShardSpec& spec, const Shape& local_shape);
/// Writes `shard` (of ShardSpec spec) into its place in `whole`.
void place_shard(Tensor& whole, const ShardSpec& spec, const Tensor& shard);

struct Parameter {
  std::string name;  ///< stable, hierarchical: "layers.3.moe.experts.gate_up"
  /// f32 master weights (bf16 after drop_master_weights; the bf16 compute copy itself after
  /// shard_master_weights)
  Tensor value;
  /// value's shape and device, f32 (bf16 for the routed experts' weights with
  /// model.moe.expert_grad_dtype = bf16); backward accumulates into it
  Tensor grad;
  /// bf16 copy of value for the matmuls of a bf16-compute model (docs/cuda.md), on value's
  /// device; undefined in f32 compute. AdamW rewrites it with every update; whoever else writes
  /// value (checkpoint load, expert permutation) refreshes it (model::Transformer::
  /// refresh_compute_weights).
  Tensor compute_copy;
  /// train.offload_optimizer on CUDA (offload_master()): value lives in pinned host memory, and
  /// this f32 copy of it on the device is what forward and backward read where they read f32
  /// weights (f32 compute; parameters without a bf16 copy, or reads_f32). Undefined otherwise.
  /// The offloaded AdamW rewrites it with every update, like compute_copy.
  Tensor device_f32;
  /// Its module reads the f32 weights (weights_f32()) even where a bf16 compute copy exists
  /// (the embedding lookup of a tied table, the f32 routers).
  bool reads_f32 = false;
  /// parallel.zero >= 1 (shard_master_weights()): value is compute_copy (one tensor) and the
  /// f32 master weights exist only as the optimizer's shard pieces (optim::AdamW::master).
  bool master_sharded = false;
  ParamKind kind = ParamKind::dense;
  bool weight_decay = true;  ///< false for norms, biases, temperatures
  /// Expert and tensor-parallel parameters: which part of the whole tensor this is.
  ShardSpec shard;
  /// Set by an owner whose backward writes every element of grad (the expert weights, whose
  /// f32 gradients are the largest): zero_grad() then only marks grad as zero, and the first
  /// backward overwrites it instead of reading it (no memset, no read of E·3·d·f floats).
  bool lazy_zero_grad = false;
  /// grad is logically zero but its memory is stale (zero_grad() deferred the memset).
  bool grad_zero_pending = false;
  /// release_grad() freed grad: it is logically zero until materialize_grad() allocates it
  /// again (zero_grad() keeps it freed), in released_grad_dtype on released_grad_device.
  bool grad_released = false;
  DType released_grad_dtype = DType::f32;
  Device released_grad_device;

  /// Allocates value and a zeroed grad (f32 or bf16) of `shape`.
  static Parameter make(std::string name, Shape shape, ParamKind kind = ParamKind::dense,
                        bool weight_decay = true, DType grad_dtype = DType::f32);
  void zero_grad() {
    // Released (zero 2, after the last step's sync): it stays freed, logically zero, until the
    // backward that writes it materializes it, so whole gradients exist only from their
    // module's backward to their bucket's reduce-scatter.
    if (grad_released) return;
    if (lazy_zero_grad) {
      grad_zero_pending = true;
    } else {
      grad.zero_();
    }
  }
  /// For the backward writing grad: true when it must overwrite rather than accumulate (a
  /// deferred zero); the write makes grad real, so the next one accumulates.
  bool take_grad_overwrite() { return std::exchange(grad_zero_pending, false); }
  /// For whoever reads grad (optimizer, norm, gradient sync): makes a deferred zero real, for a
  /// parameter no backward wrote since zero_grad().
  void settle_grad() {
    if (grad_zero_pending && grad.defined()) grad.zero_();
    grad_zero_pending = false;
  }
  /// Frees grad, which stays logically zero until materialize_grad() (parallel.zero = 2: once
  /// the gradient sync has packed it for the reduce-scatter, this rank keeps only its shard).
  void release_grad() {
    if (grad.defined()) {
      released_grad_dtype = grad.dtype();
      released_grad_device = grad.device();
      grad_released = true;
    }
    grad = Tensor();
    grad_zero_pending = false;
  }
  /// For the backward about to write grad: allocates a released one, zeroed (a lazily zeroed
  /// one is left for its writer to overwrite: no memset). A no-op otherwise.
  void materialize_grad() {
    if (!grad_released) return;
    const Shape& shape = value.shape();
    grad = lazy_zero_grad ? Tensor::empty(shape, released_grad_dtype, released_grad_device)
                          : Tensor::zeros(shape, released_grad_dtype, released_grad_device);
    grad_zero_pending = lazy_zero_grad;
    grad_released = false;
  }
  /// Keeps the weights in `dtype` (bf16) only: value becomes the compute copy (or, on the CPU,
  /// value cast) and the f32 master is freed, so a bf16 forward and backward hold 2 bytes of
  /// weight per element instead of 4 + 2. Only for passes that no optimizer follows (benchmarks,
  /// inference): AdamW refuses a parameter whose value is not f32.
  void drop_master_weights(DType dtype);
  /// parallel.zero >= 1: the f32 master weights leave the parameter for the optimizer's shard
  /// pieces (each rank holds only the elements its AdamW updates); value becomes the bf16
  /// compute copy, which forward and backward read and which the update's all-gather refreshes.
  /// Needs a bf16 compute copy and a module that never reads the f32 weights (!reads_f32).
  void shard_master_weights();
  /// The weight as forward and backward use it: the bf16 copy when there is one, else value.
  const Tensor& compute() const { return compute_copy.defined() ? compute_copy : weights_f32(); }
  /// The f32 weights on the device forward and backward run on: device_f32 when value is
  /// offloaded to the host, else value. Refused once the master weights are sharded.
  const Tensor& weights_f32() const {
    XMOE_CHECK(!master_sharded,
               "[parameter] {}: its f32 weights are sharded over the data-parallel ranks "
               "(parallel.zero >= 1); only its bf16 compute copy is whole here",
               name);
    return device_f32.defined() ? device_f32 : value;
  }
  /// The device forward and backward run on (value's, unless offloaded).
  Device device() const { return grad.defined() ? grad.device() : compute().device(); }
  /// True when value (the master weights) lives on the host while the parameter computes on a
  /// device (offload_master()).
  bool offloaded() const { return value.is_cpu() && !device().is_cpu(); }
  /// Moves value, grad and the compute copy to `device` (copies; a no-op if already there).
  /// Refused once offloaded.
  void to(Device device);
  /// train.offload_optimizer: moves value from its CUDA device into pinned host memory; the
  /// device keeps grad, compute_copy and, where forward reads f32 weights (no compute copy, or
  /// reads_f32), an f32 copy in device_f32. A no-op on the CPU, where value is already in host
  /// memory.
  void offload_master();
  /// value ~ N(0, std^2) from (seed, name, global element index, by `shard`): the same numbers
  /// however the parameter is sharded.
  void init_normal(uint64_t seed, float std);
  void init_constant(float v) { value.fill_(v); }
};

/// settle_grad() on each: call before reading gradients.
inline void settle_grads(const std::vector<Parameter*>& params) {
  for (Parameter* p : params) p->settle_grad();
}
/// materialize_grad() on each: call before a backward that writes their gradients.
inline void materialize_grads(const std::vector<Parameter*>& params) {
  for (Parameter* p : params) p->materialize_grad();
}

/// Anything that owns parameters.
class Module {
 public:
  virtual ~Module() = default;
  /// Appends pointers to this module's parameters (and its children's) in a stable order.
  virtual void collect_parameters(std::vector<Parameter*>& out) = 0;
  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> out;
    collect_parameters(out);
    return out;
  }
  void zero_grad() {
    for (Parameter* p : parameters()) p->zero_grad();
  }
};

}  // namespace xmoe
