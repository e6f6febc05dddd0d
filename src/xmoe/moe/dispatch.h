#pragma once
// Stages 3 and 5, Dispatch and Combine: move the expert input rows to the rank that owns their
// expert and the outputs back (DeepEP-style). dispatch() returns the received rows plus a
// DispatchHandle (counts per source/destination, the received rows' grouping by local expert)
// that combine() — and both backwards — require. Implementations by name (moe.dispatch):
//   local       one process: identity
//   all_to_all  uneven all-to-all-v of exactly the routed rows over the ep group, per-expert
//               counts exchanged first; received rows permuted into local-expert-major order
//   rbd         redundancy-bypassing two-stage dispatch over the node hierarchy (X-MoE): one
//               pilot row per (token, destination node) crosses the inter-node link, replicas
//               are made inside the node; combine sums a token's weighted outputs inside the
//               node first (dispatch_rbd.h). Needs RowInfo; with one node it is all_to_all.
// Backward of dispatch is a combine of the gradients with the same handle, and vice versa.
// Every rank of the group takes part in every collective, also one that sends or receives no
// row at all (a skipped collective would hang the others).
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"
#include "xmoe/core/tensor.h"
#include "xmoe/moe/registry.h"

namespace xmoe::moe {

/// Communication knobs, in one place (DeepEP's Config).
struct DispatchConfig {
  std::string algorithm = "local";  ///< moe.dispatch
  int64_t num_experts = 0;          ///< global E
  int ep_rank = 0, ep_size = 1;     ///< expert-parallel group (experts split in contiguous blocks)
  /// The ep group (all_to_all, rbd); rank/size must equal ep_rank/ep_size. Null = one process.
  std::shared_ptr<comm::Group> group;
  /// rbd: ranks of the ep group sharing a node, rank r on node r / ranks_per_node. 0 = the
  /// group's topology (comm::world(ranks_per_node) / parallel.ranks_per_node), which is also
  /// what the byte counters classify links by; set it only to simulate other nodes (tests).
  int ranks_per_node = 0;
};

struct RbdState;  // dispatch_rbd.h

/// Everything combine needs to reverse a dispatch.
///
/// all_to_all: rows arrive grouped by source rank, then by local expert (the sender's order);
/// the experts need them grouped by local expert, then by source rank. recv_layout[j] is the
/// arrival row that becomes expert-order row j (expert_rows = arrival[recv_layout]);
/// arrival_layout is its inverse (arrival = expert_rows[arrival_layout]), which combine uses.
/// Both are undefined when no permutation is needed (local, or one rank).
struct DispatchHandle {
  std::vector<int64_t> send_counts;  ///< [ep_size] rows sent to each rank
  std::vector<int64_t> recv_counts;  ///< [ep_size] rows received from each rank
  /// [E_local] received rows per local expert, contiguous by expert: the expert's groups.
  std::vector<int64_t> recv_tokens_per_expert;
  /// [E] rows per global expert as sent (the order stage's grouping).
  std::vector<int64_t> send_tokens_per_expert;
  /// [ep_size * E_local] rows received from source p for local expert i at p * E_local + i.
  std::vector<int64_t> recv_counts_per_expert;
  int64_t num_send_rows = 0, num_recv_rows = 0;
  Tensor recv_layout;     ///< i32 [N_recv]: arrival row of expert-order row j
  Tensor arrival_layout;  ///< i32 [N_recv]: expert-order row of arrival row i (the inverse)
  /// Dispatchers that reduce in combine (rbd): i32 [G], the token of each row combine returns.
  Tensor group_tokens;
  /// rbd: the plan of all three roles (source, pilot, expert owner; rbd_plan.h) and what
  /// combine saved for backward (dispatch_rbd.h). Shared, so copies of the handle see one plan.
  std::shared_ptr<RbdState> rbd;
};

/// Per-row facts the layer knows besides the rows; only dispatchers that reduce in combine
/// (reduces_in_combine(), i.e. rbd) read them.
struct RowInfo {
  Tensor token_ids;        ///< i32 [N] token of each row (the order stage's token_ids)
  Tensor combine_weights;  ///< f32 [N] combine weight of each row
  int64_t num_tokens = 0;  ///< T (token ids are in [0, T))
};

struct DispatchResult {
  Tensor rows;  ///< [N_recv, d] rows for this rank's experts, grouped by local expert
  DispatchHandle handle;
};

/// One direction of the pipelined layer (moe.pipeline, docs/pipeline.md) over chunks of local
/// experts: chunk c holds local experts [bounds[c], bounds[c + 1]) of every ep rank, so each
/// expert's rows stay in one chunk. The layer calls, for c = 0..r-1 in order,
///   start_in(c + 1) (ahead), wait_in(c), compute, start_out(c, ...);
/// then finish(). start_* only start the exchange (non-blocking collectives: MPI_Ialltoallv,
/// or NCCL on the communication stream), so the compute of chunk c overlaps the exchanges of
/// chunks c - 1 (back) and c + 1 (in). Every rank makes the same calls in the same order.
class ChunkedPass {
 public:
  virtual ~ChunkedPass() = default;
  /// Starts moving chunk c's rows to the experts.
  virtual void start_in(int c) = 0;
  /// Chunk c's rows for this rank's experts [n_c, d], grouped by local expert: rows
  /// [row_begin(c), row_begin(c + 1)) of what the unchunked dispatch gives.
  virtual Tensor wait_in(int c) = 0;
  /// Starts moving chunk c's expert results [n_c, d] back.
  virtual void start_out(int c, Tensor out) = 0;
  /// Waits for every chunk's way back; what the unchunked call gives.
  virtual Tensor finish() = 0;
};

/// Chunks of local experts: bounds [r + 1] from 0 to E_local.
using ChunkBounds = std::vector<int64_t>;

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  virtual std::string_view name() const = 0;
  /// rows [N, d] grouped by global expert with tokens_per_expert [E] rows each.
  virtual DispatchResult dispatch(const Tensor& rows,
                                  std::span<const int64_t> tokens_per_expert) = 0;
  /// The same, with the rows' tokens and combine weights (required by rbd, ignored otherwise).
  virtual DispatchResult dispatch(const Tensor& rows, std::span<const int64_t> tokens_per_expert,
                                  const RowInfo& info) {
    (void)info;
    return dispatch(rows, tokens_per_expert);
  }
  /// False (local, all_to_all): combine returns the expert outputs [N, d] in the dispatched
  /// order and the I-Order stage weights and sums them per token. True (rbd): combine applies
  /// the combine weights itself and returns per-(token, node) partial sums [G, d] with tokens
  /// handle.group_tokens (y = scatter_add(partial, group_tokens)); combine_backward then takes
  /// d_partial [G, d] and computes d(combine_weights) [N] too (combine_weights_grad), and
  /// dispatch_backward returns d_rows [N, d] whose pilot rows carry their group's summed
  /// gradient (other rows zero; order backward scatter-adds them into dx all the same).
  virtual bool reduces_in_combine() const { return false; }
  /// False where dispatch hands the rows back as they are (local; all_to_all over one rank): it
  /// then also takes undefined rows (the experts read x through the order's indices) and plans
  /// from the counts alone.
  virtual bool moves_rows() const { return true; }
  /// reduces_in_combine(): d(combine_weights) [N] (RowInfo order) of the last combine_backward.
  virtual Tensor combine_weights_grad(const DispatchHandle& handle) const;
  /// Expert outputs [N_recv, d] back to their source ranks, in the order dispatch took them.
  virtual Tensor combine(const Tensor& expert_out, const DispatchHandle& handle) = 0;
  /// d_received [N_recv, d] -> d_rows [N, d] (a combine of gradients).
  virtual Tensor dispatch_backward(const Tensor& d_recv, const DispatchHandle& handle) = 0;
  /// d_combined [N, d] -> d_expert_out [N_recv, d] (a dispatch of gradients).
  virtual Tensor combine_backward(const Tensor& d_combined, const DispatchHandle& handle) = 0;

  // Pipelining (ChunkedPass). The results are bitwise those of the unchunked calls.
  /// Whether forward_pass and backward_pass work here (local, all_to_all, rbd).
  virtual bool pipelines() const { return false; }
  /// dispatch() without moving the rows: the handle, with the counts and layouts. Collective.
  virtual DispatchHandle plan(const Tensor& rows, std::span<const int64_t> tokens_per_expert,
                              const RowInfo& info);
  /// dispatch then combine, chunk by chunk: in = the expert input rows of `rows` [N, d] (the
  /// handle's), out = the experts' output; finish() = combine(expert_out, handle).
  virtual std::unique_ptr<ChunkedPass> forward_pass(const Tensor& rows, DispatchHandle& handle,
                                                    const ChunkBounds& bounds);
  /// combine_backward then dispatch_backward, chunk by chunk: in = d_expert_out of
  /// `d_combined`, out = d_expert_in; finish() = dispatch_backward(d_expert_in, handle).
  virtual std::unique_ptr<ChunkedPass> backward_pass(const Tensor& d_combined,
                                                     DispatchHandle& handle,
                                                     const ChunkBounds& bounds);
};

using DispatchRegistry = Registry<Dispatcher, const DispatchConfig&>;
/// Built-in: "local", "all_to_all", "rbd" (all_to_all when the ep group spans one node).
DispatchRegistry& dispatch_registry();
std::unique_ptr<Dispatcher> make_dispatcher(const DispatchConfig& config);

}  // namespace xmoe::moe
