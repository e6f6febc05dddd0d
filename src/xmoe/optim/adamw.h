#pragma once
// AdamW (Loshchilov & Hutter 2019) with decoupled weight decay, on f32 master weights; the
// moments f32 or bf16 (AdamWConfig::moments_dtype).
//   m <- b1 m + (1 - b1) g            v <- b2 v + (1 - b2) g^2
//   p <- p - lr * wd * p              (only where Parameter::weight_decay)
//   p <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/core/copy_queue.h"
#include "xmoe/core/parameter.h"
#include "xmoe/ops/optim.h"
#include "xmoe/optim/clip.h"  // clip_grad_norm, grads_finite: used with every step

namespace xmoe::optim {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
  /// train.offload_optimizer: the update runs on the host (docs/training.md, "Optimizer
  /// offload"); the parameters' values must be host tensors (model::Transformer::
  /// offload_master_weights on CUDA).
  bool offload = false;
  /// Offload: elements per group of the pipeline that copies gradients to the host, updates
  /// and copies the weights back (group i+1's gradients travel while group i updates).
  int64_t offload_group_numel = int64_t{16} << 20;
  /// Offload: every gradient gets a whole host buffer, so that prefetch_grads() can start it
  /// during backward (train.offload_overlap, where nothing changes the gradients after
  /// backward). Otherwise the gradients travel during the update through kOffloadSlots buffers
  /// of one group each: the host holds 2 or 4 bytes per element less.
  bool offload_whole_grads = true;
  /// train.adam_moments_dtype: f32 or bf16 storage of m and v (the update computes in f32 and
  /// stores bf16 ones rounded to nearest even; ops::adamw_step).
  DType moments_dtype = DType::f32;
  /// Offload (train.offload_delayed_update_from): -1 off; N >= 0: updates 1..N as usual, from
  /// update N + 1 on step() leaves the host update running and the next step() publishes it
  /// (ZeRO-Offload's one-step delayed parameter update). Needs offload_whole_grads and whole
  /// pieces (no zero sharding).
  int64_t delayed_from = -1;
  /// train.beta1, train.beta2, train.adam_eps, train.weight_decay, train.offload_optimizer,
  /// train.offload_overlap, train.adam_moments_dtype,
  /// train.offload_delayed_update_from.
  static AdamWConfig from(const TrainConfig& t);
  /// from(t) for a training run whose gradients are final when backward ends (one process,
  /// zero < 2: parallel::GradientSync::grads_final_after_backward) or not: whole host gradient
  /// buffers only where backward starts their copies or the delayed update reads them while the
  /// next step runs; else the gradient rings. The trainer's AdamW, and the memory model's.
  static AdamWConfig for_run(const TrainConfig& t, bool grads_final_after_backward);
};

/// A run of one parameter's elements that an AdamW updates: the whole parameter (the default),
/// or the flat range [offset, offset + count) of it (a ZeRO shard, parallel.zero >= 1; a
/// parameter may straddle the shards of two ranks). Each piece is updated with the same
/// per-element formula and order, so a parameter split into pieces over ranks gets the bits it
/// gets whole.
struct AdamWPiece {
  /// `own_grad` (implied by a defined `grad`): the piece's gradient is its own tensor, given
  /// with the piece or before each step (AdamW::set_piece_grads), not param->grad's range.
  /// `master`: the optimizer keeps the range's f32 master weights (see `master`).
  explicit AdamWPiece(Parameter* p, int64_t offset_ = 0, int64_t count_ = -1, Tensor grad_ = {},
                      bool own_grad_ = false, bool master_ = false)
      : param(p),
        offset(offset_),
        count(count_),
        grad(std::move(grad_)),
        own_grad(own_grad_ || grad.defined()),
        master(master_) {}

  Parameter* param = nullptr;
  int64_t offset = 0;
  int64_t count = -1;  ///< -1: the whole parameter
  /// [count] gradient of the range (f32 or bf16), e.g. a view of a reduce-scattered shard;
  /// undefined without own_grad: the range of param->grad, read at every step
  Tensor grad;
  bool own_grad = false;
  /// ZeRO's master-weight sharding (parallel/grad_sync.h, GradientSync::shards_master): the
  /// optimizer copies the range of the parameter's f32 value when it is built and from then on
  /// updates that copy, writing the parameter's bf16 compute copy; the owner then frees the
  /// whole f32 value (Parameter::shard_master_weights). The parameter needs a bf16 copy.
  bool master = false;

  bool whole() const { return offset == 0 && count == param->value.numel() && !own_grad; }
};

class AdamW {
 public:
  /// Keeps the pointers (the parameters must outlive the optimizer) and zeroed m, v per
  /// parameter (of AdamWConfig::moments_dtype). Parameter names must be unique (they key the
  /// exported state).
  AdamW(std::vector<Parameter*> params, AdamWConfig cfg);
  /// m, v only for each piece's elements: [count], or the parameter's shape for a whole
  /// piece. A parameter appears in at most one piece.
  AdamW(std::span<const AdamWPiece> pieces, AdamWConfig cfg);
  /// Finishes a delayed update (finish()); errors are dropped here (call finish() to see them).
  ~AdamW();
  // The delayed update's thread holds `this`.
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  /// One update of every parameter from grad * grad_scale with learning rate `lr`; step() += 1.
  /// grad_scale is the clip factor (clip_factor): applying it here instead of scale_grads saves
  /// a pass over the gradients, with the same bits. Does not change or clear the grads. One
  /// ops::adamw_step: on CUDA a fused multi-tensor kernel, the CPU's formula in the CPU's
  /// operation order, which also rewrites each parameter's bf16 compute copy; nothing waits
  /// for the device.
  ///
  /// Offloaded (AdamWConfig::offload): m, v and the master weights are host tensors (pinned
  /// when the gradients are on a CUDA device); group by group, the gradients are copied to host
  /// buffers on a copy stream, updated by the CPU kernel of ops::adamw_step (OpenMP), and the
  /// updated bf16 copies (and f32 device copies) copied back on another, so the copies of group
  /// i+1 and i-1 overlap the update of group i. The device's next work waits for the last copy
  /// (on the device; the host does not wait). The same code runs on the CPU, with host copies:
  /// the same bits as without offload.
  ///
  /// Delayed (AdamWConfig::delayed_from, from update delayed_from + 1 on): first finish() the
  /// previous update; then this step's gradients go to the host, the device's next work waits
  /// for their copies (not for the update), and the host update runs on a thread of its own
  /// (OpenMP leaving one core to the caller), writing the master weights and moments in place
  /// and, through the copy queue, twins of the tensors forward reads (compute_copy,
  /// device_f32); step() returns at once. The update is the one the plain step would do (this
  /// step's lr, grad_scale and t); only when its weights become visible differs. On the CPU the
  /// optimizer gives every parameter whose forward reads f32 weights a device_f32 copy, so that
  /// nothing forward reads is written while the update runs.
  void step(float lr, float grad_scale = 1.0f);
  /// Delayed: waits for the update step() left running (rethrowing its error) and publishes it:
  /// each parameter's compute_copy and device_f32 swap with the twins it wrote (no copy), and
  /// the device's next work waits for its copies. Call before anything else reads or writes the
  /// master weights or the moments (export_state, a checkpoint, the end of training). A no-op
  /// when none is pending.
  void finish();
  /// Delayed: an update is running or done but not yet published (finish()).
  bool update_pending() const { return pending_; }
  /// Delayed: whether update `t` (1-based) is delayed.
  bool delays(int64_t t) const {
    return cfg_.offload && cfg_.delayed_from >= 0 && t > cfg_.delayed_from;
  }
  /// Delayed: bytes of the twins (on the compute device) and of the f32 copies forward reads
  /// that the delayed mode added on the CPU.
  int64_t delayed_update_bytes() const;
  /// Zeroes every parameter's grad.
  void zero_grad();
  /// Offloaded: the gradients of `params` are final for the coming step() (backward finished
  /// them and no sync changes them): their pieces' copies to the host start now, on the copy
  /// queue after the device's queued work, so that they travel during the rest of backward;
  /// step() copies only the others. Pieces with their own gradient (zero 2 shards) are left to
  /// step(). A no-op without offload. Delayed: first waits for the running update (which reads
  /// the host gradient buffers), without publishing it.
  void prefetch_grads(const std::vector<Parameter*>& params);
  /// Drops what prefetch_grads() started (a skipped step); step() does it after its update.
  void forget_prefetched();
  /// The gradients of the pieces that have their own (AdamWPiece::own_grad), in piece order:
  /// one [count] f32 or bf16 tensor each (e.g. views of the zero 2 shards, which exist only
  /// from the gradient sync to the update). Empty: forgets them (the shards can be freed).
  void set_piece_grads(std::span<const Tensor> grads);

  /// Number of updates done (t of the bias correction).
  int64_t step_count() const { return step_; }
  const AdamWConfig& config() const { return cfg_; }
  /// The parameter of each piece (piece i updates parameters()[i]).
  const std::vector<Parameter*>& parameters() const { return params_; }
  const std::vector<AdamWPiece>& pieces() const { return pieces_; }
  /// True when some piece is a part of its parameter (the moments are sharded).
  bool sharded() const { return sharded_; }
  /// Device of the parameters' values and of m, v (all on one device; the CPU when offloaded).
  Device device() const { return device_; }
  /// Bytes of m and v held here (what ZeRO divides).
  int64_t state_bytes() const;
  /// Bytes of the f32 master weights the pieces hold (AdamWPiece::master).
  int64_t master_bytes() const;
  bool offloaded() const { return cfg_.offload; }
  /// Offload: bytes of the host buffers the gradients and bf16 copies travel through.
  int64_t staging_bytes() const;
  /// Offload: the groups of the update's pipeline over pieces of `counts` elements, in order,
  /// as [begin, end) piece ranges; a group closes once it holds group_numel elements or more.
  static std::vector<std::pair<size_t, size_t>> offload_groups(std::span<const int64_t> counts,
                                                               int64_t group_numel);
  /// Offload: the updated bf16 copies travel back (and, without offload_whole_grads, the
  /// gradients travel in) through this many host buffers (one with a single group), each of the
  /// largest group's elements of that kind; group g uses buffer g % kOffloadSlots once group
  /// g - kOffloadSlots is done with it.
  static constexpr int kOffloadSlots = 2;
  /// Offload: the elements of a ring's host buffers for the pieces `member` marks (of `counts`
  /// elements) over `groups`: min(groups, kOffloadSlots) buffers of the largest group's elements.
  static int64_t ring_numel(const std::vector<std::pair<size_t, size_t>>& groups,
                            std::span<const int64_t> counts, const std::vector<char>& member);
  /// First / second moment of piece i, of AdamWConfig::moments_dtype.
  const Tensor& m(size_t i) const { return m_.at(i); }
  const Tensor& v(size_t i) const { return v_.at(i); }
  /// The f32 master weights of piece i when it holds them (AdamWPiece::master; the shape of
  /// m(i)), else undefined.
  const Tensor& master(size_t i) const { return master_.at(i); }

  /// Name of the tensor holding the step count in exported state (i64 [1]).
  static constexpr const char* kStepKey = "optim.step";
  /// Adds "<param>.adam_m", "<param>.adam_v" (f32, the parameter's shape) and "optim.step"
  /// (i64 [1]) to `out`, for checkpoints, and "<param>" (f32) for the pieces that hold master
  /// weights. The tensors share storage with the optimizer, but bf16 moments, which are
  /// exported widened to f32 (exactly) in host memory: one checkpoint format for both moment
  /// dtypes, and no f32 copy on the device. Sharded moments throw: whoever knows the shards
  /// gathers them (train/state.cpp; parallel::GradientSync::gather_pieces widens them too).
  /// A pending delayed update throws: finish() it first.
  void export_state(std::map<std::string, Tensor>& out) const;
  /// Loads what export_state wrote (other tensors in `in` are ignored): each piece takes its
  /// range of its parameter's whole moments, and a piece holding master weights its range of
  /// "<param>". Every such tensor must be present with the parameter's shape (f32); a missing or
  /// mis-shaped one throws "[adamw] ..." and leaves the optimizer unchanged. bf16 moments take
  /// the f32 ones rounded to nearest even. A pending delayed update throws: finish() it first.
  void import_state(const std::map<std::string, Tensor>& in);

 private:
  /// Piece i's gradient where backward (or the gradient sync) left it: its own, or its range
  /// of param->grad.
  Tensor piece_grad(size_t i) const;
  void check_piece_grad(const AdamWPiece& piece, const Tensor& grad) const;
  /// Piece i's tensors for ops::adamw_step reading the gradient `grad`.
  ops::AdamWTensors piece_tensors(size_t i, const Tensor& grad, const Tensor& param_bf16) const;
  void step_offloaded(const ops::AdamWStep& s);
  /// Offload: piece i's gradient on the host as group g sees it.
  Tensor grad_host(size_t i, size_t g) const;
  /// Offload: queues group g's gradients not prefetched to the host; returns their marker.
  int send_grads(size_t g);
  /// Offload: the update of every group from the host gradients, copies back after each.
  /// `arrived`: each group's gradient marker (empty: sends them here, group g + 1's before
  /// group g's update). `to_twins`: the copies back go to the twins (a delayed update).
  void update_groups(const ops::AdamWStep& s, std::vector<int> arrived, bool to_twins);
  /// Delayed: waits for the update thread; rethrows its error.
  void join_update();

  std::vector<AdamWPiece> pieces_;
  std::vector<Parameter*> params_;
  bool sharded_ = false;
  AdamWConfig cfg_;
  Device device_ = Device::cpu();
  std::vector<Tensor> m_, v_;
  std::vector<Tensor> master_;  // per piece: its f32 master weights (AdamWPiece::master)
  int64_t step_ = 0;
  /// Offload: host buffers that one group of pieces at a time travels through, used in turn:
  /// per piece its offset in its group's buffer (-1: not in this ring).
  struct SlotRing {
    std::vector<int64_t> at;
    std::vector<Tensor> slots;
    /// Piece i's run in the buffer of group g (undefined when the piece is not in the ring).
    Tensor piece(size_t i, int64_t count, size_t g) const;
    int64_t bytes() const;
  };
  /// Offload: a ring of `dtype` buffers for the pieces `member` marks.
  SlotRing make_ring(std::span<const int64_t> counts, const std::vector<char>& member, DType dtype,
                     bool pinned) const;

  // Offload: the device of the gradients, groups of pieces [begin, end), per piece the whole
  // host buffer of its gradient (offload_whole_grads) or the gradient rings (f32, bf16), the
  // bf16 copies' ring, the two copy queues.
  Device compute_device_ = Device::cpu();
  std::vector<std::pair<size_t, size_t>> groups_;
  std::vector<Tensor> grad_host_;
  SlotRing grad_f32_ring_, grad_bf16_ring_, bf16_ring_;
  std::vector<char> prefetched_;  // per piece: its gradient is on its way to grad_host_
  bool any_prefetched_ = false;
  std::unique_ptr<CopyQueue> to_host_, to_device_;
  // Delayed: per piece the twins of its parameter's compute_copy and device_f32 (undefined
  // where the parameter has none), the f32 copies made on the CPU, the update's thread and
  // error, and whether an update waits to be published.
  std::vector<Tensor> twin_copy_, twin_f32_;
  int64_t cpu_f32_bytes_ = 0;
  std::thread update_thread_;
  std::exception_ptr update_error_;
  bool pending_ = false;
};

}  // namespace xmoe::optim
