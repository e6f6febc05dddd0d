#pragma once
// The plan of a redundancy-bypassing dispatch (moe.dispatch = rbd, dispatch_rbd.h): which rows
// go where in both stages and how combine reduces them, as integers. Pure functions, no
// communication: the dispatcher runs them with its metadata exchanges in between, and
// plan_rbd() runs them for every rank of a group in one process (tests, byte counts).
//
// A rank plays three roles, and each role's plan needs what the previous one sent:
//   plan_rbd_source  from this rank's routing: (token, node) groups, their pilots, per-peer
//                    stage-1 counts and the stage-1 metadata of every member row;
//   plan_rbd_pilot   from the stage-1 metadata received: one replica per member, the stage-2
//                    counts inside the node, the replica -> pilot map (combine's reduction map)
//                    and the stage-2 metadata;
//   plan_rbd_owner   from the stage-2 metadata received: the expert-major order of the rows.
//
// Metadata is int32, never f32 (which is exact only below 2^24): ids and row indices are
// checked to fit int32, the combine weight travels as its f32 bits (std::bit_cast).
#include <cstdint>
#include <span>
#include <vector>

#include "xmoe/comm/topology.h"

namespace xmoe::moe {

/// Where experts live: ep rank r owns experts [r * E_local, (r + 1) * E_local) and sits on
/// node topo.node_of(r).
struct RbdLayout {
  comm::Topology topo;           ///< node of each of the P ep ranks
  int64_t experts_per_rank = 1;  ///< E_local
  int num_ranks() const { return topo.size(); }
  int64_t num_experts() const { return experts_per_rank * num_ranks(); }
  int owner(int64_t expert) const { return static_cast<int>(expert / experts_per_rank); }
};

/// One rank's rows as the order stage laid them out (PFT): grouped by global expert.
struct RbdRouting {
  std::span<const int64_t> tokens_per_expert;  ///< [E] rows per global expert
  std::span<const int32_t> token_ids;          ///< [N] token of each row (>= 0)
  std::span<const float> combine_weights;      ///< [N] combine weight of each row
};

/// Stage-1 metadata, int32 [members, 3] beside the pilots, per member row in send order:
/// (expert * 2 + 1 if the row is its group's pilot else expert * 2, source row, weight's bits).
/// A group's members are contiguous, pilot first, so the flag numbers the groups.
inline constexpr int64_t kRbdStage1Width = 3;
/// Stage-2 metadata, int32 [replicas, 3] beside the replicas: (local expert, source rank,
/// source row), the owner's sort key.
inline constexpr int64_t kRbdStage2Width = 3;

/// Source role: this rank's N rows grouped by (token, node of the row's expert) into G groups.
/// A group's first row (lowest expert) is its pilot and goes to the owner of that expert.
/// Send order: groups by destination rank, then by pilot row; members: groups in send order,
/// each with its rows ascending.
struct RbdSourcePlan {
  int64_t num_rows = 0;               ///< N
  std::vector<int64_t> group_send;    ///< [P] groups (pilot rows) sent to each rank in stage 1
  std::vector<int64_t> member_send;   ///< [P] member rows (metadata only) sent to each rank
  std::vector<int32_t> pilot_rows;    ///< [G] row of each group's pilot, in send order
  std::vector<int32_t> group_tokens;  ///< [G] token of each group, in send order
  std::vector<int32_t> member_rows;   ///< [N] row of each member, in send order
  std::vector<int32_t> stage1_meta;   ///< [N, kRbdStage1Width], in send order
  int64_t num_groups() const { return static_cast<int64_t>(pilot_rows.size()); }
};

/// Pilot role: the groups this rank received in stage 1 (arrival order: by source rank, then
/// in the source's send order) and one replica per member for the member's expert owner, all
/// on this node. Stage-2 order: replicas by owner (local rank on the node), then by arrival.
struct RbdPilotPlan {
  std::vector<int64_t> group_recv, member_recv;  ///< [P] stage-1 groups / members per source
  std::vector<int64_t> replica_send;  ///< [L] replicas to each rank of the node (stage 2)
  /// [M] arrival index of the group each replica copies: replicas = pilots[replica_group];
  /// combine's reduction map: partial[replica_group[j]] += weight[j] * out[j].
  std::vector<int32_t> replica_group;
  std::vector<float> replica_weight;    ///< [M] combine weight of each replica
  std::vector<int32_t> replica_member;  ///< [M] stage-1 arrival position of each replica
  std::vector<int32_t> stage2_meta;     ///< [M, kRbdStage2Width], stage-2 order
  int64_t num_groups() const;
  int64_t num_replicas() const { return static_cast<int64_t>(replica_group.size()); }
};

/// Owner role: the R replicas received in stage 2 (arrival: by node rank, then the pilot's
/// stage-2 order), put in all_to_all's expert order (local expert, source rank, source row).
struct RbdOwnerPlan {
  std::vector<int64_t> replica_recv;   ///< [L] replicas from each rank of the node
  std::vector<int32_t> expert_order;   ///< [R] arrival row of expert-order row j
  std::vector<int32_t> arrival_order;  ///< [R] expert-order row of arrival row i (the inverse)
  std::vector<int64_t> recv_tokens_per_expert;  ///< [E_local]
  std::vector<int64_t> recv_counts_per_expert;  ///< [P * E_local] source p, local expert i
  std::vector<int64_t> recv_counts;             ///< [P] rows from each source rank
  int64_t num_rows() const { return static_cast<int64_t>(expert_order.size()); }
};

/// The plan of one rank in all three roles.
struct RbdPlan {
  RbdSourcePlan source;
  RbdPilotPlan pilot;
  RbdOwnerPlan owner;
};

RbdSourcePlan plan_rbd_source(const RbdLayout& layout, const RbdRouting& routing);
/// rank: this ep rank; stage1_meta: the members received, [sum(member_recv), 3].
RbdPilotPlan plan_rbd_pilot(const RbdLayout& layout, int rank, std::vector<int64_t> group_recv,
                            std::vector<int64_t> member_recv, std::span<const int32_t> stage1_meta);
/// stage2_meta: the replicas received, [sum(replica_recv), 3].
RbdOwnerPlan plan_rbd_owner(const RbdLayout& layout, std::vector<int64_t> replica_recv,
                            std::span<const int32_t> stage2_meta);

/// Every rank's plan in one process: the three phases with the metadata exchanges done in
/// memory (what the dispatcher's all_to_all_counts / all_to_all_v calls deliver). routing[r]
/// is ep rank r's routing.
std::vector<RbdPlan> plan_rbd(const RbdLayout& layout, std::span<const RbdRouting> routing);

}  // namespace xmoe::moe
