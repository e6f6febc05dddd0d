#pragma once
// Stages 3 and 5, Dispatch and Combine: move the expert input rows to the rank that owns their
// expert and the outputs back (DeepEP-style). dispatch() returns the received rows plus a
// DispatchHandle (counts per source/destination, the received rows' grouping by local expert)
// that combine() — and both backwards — require. Implementations by name (moe.dispatch):
//   local       one process: identity
//   all_to_all  uneven all-to-all-v of exactly the routed rows over the ep group, per-expert
//               counts exchanged first; received rows permuted into local-expert-major order
//   rbd         redundancy-bypassing two-stage dispatch over the node hierarchy (later)
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
  int ranks_per_node = 0;           ///< rbd: ranks sharing a node (0 = detect)
  int64_t chunk_rows = 0;           ///< rows per message chunk for pipelining (0 = one message)
};

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
};

struct DispatchResult {
  Tensor rows;  ///< [N_recv, d] rows for this rank's experts, grouped by local expert
  DispatchHandle handle;
};

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  virtual std::string_view name() const = 0;
  /// rows [N, d] grouped by global expert with tokens_per_expert [E] rows each.
  virtual DispatchResult dispatch(const Tensor& rows,
                                  std::span<const int64_t> tokens_per_expert) = 0;
  /// Expert outputs [N_recv, d] back to their source ranks, in the order dispatch took them.
  virtual Tensor combine(const Tensor& expert_out, const DispatchHandle& handle) = 0;
  /// d_received [N_recv, d] -> d_rows [N, d] (a combine of gradients).
  virtual Tensor dispatch_backward(const Tensor& d_recv, const DispatchHandle& handle) = 0;
  /// d_combined [N, d] -> d_expert_out [N_recv, d] (a dispatch of gradients).
  virtual Tensor combine_backward(const Tensor& d_combined, const DispatchHandle& handle) = 0;
};

using DispatchRegistry = Registry<Dispatcher, const DispatchConfig&>;
/// Built-in: "local", "all_to_all"; "rbd" is reserved and throws until it is implemented.
DispatchRegistry& dispatch_registry();
std::unique_ptr<Dispatcher> make_dispatcher(const DispatchConfig& config);

}  // namespace xmoe::moe
