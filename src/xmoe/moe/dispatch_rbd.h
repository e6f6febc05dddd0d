#pragma once
// Redundancy-bypassing dispatch (X-MoE, moe.dispatch = rbd). Experts live on ranks, ranks on
// nodes; a token routed to several experts on one node crosses the slow inter-node link once.
//
// CPU tensors only: the plan and the per-row metadata are built and exchanged on the host, so
// an ep group on the GPU (NCCL) or CUDA rows are refused with an error naming moe.dispatch;
// on one node rbd is all_to_all, which runs on the GPU.
//
// Roles (every rank plays all three in every call):
//   source  owns the token rows [N, d] (grouped by global expert, RowInfo: token, weight);
//   pilot   the rank that owns the *first* of a token's experts on a node: it receives the
//           token once for that node (the pilot row) with the pilot->replica map;
//   owner   the rank owning an expert: receives a replica of the row from the pilot.
//
// dispatch = plan, then exchanges. The plan (rbd_plan.h: pure functions on int32 metadata,
// testable in one process) needs two metadata exchanges, which dispatch runs first:
//   plan_rbd_source   groups rows by (token, node of the row's expert): G groups, each with its
//                     pilot (first row, lowest expert) for the owner of that expert;
//   exchange          all_to_all_counts (groups, members per peer) and all_to_all_v of the
//                     stage-1 metadata, int32 [N, 3] = (expert * 2 + pilot flag, source row,
//                     weight bits), over the ep group;
//   plan_rbd_pilot    one replica per member, sorted by owner; the replica -> group map;
//   exchange          all_to_all_counts and all_to_all_v of the stage-2 metadata, int32
//                     [M, 3] = (local expert, source rank, source row), over the node group;
//   plan_rbd_owner    sort by (local expert, source rank, source row): exactly all_to_all's
//                     expert-major order, so the experts see the same rows in the same order.
// Then the rows move as the plan says:
//   stage 1   all_to_all_v over the ep group: the pilots [G, d] (rows[pilot_rows]);
//   stage 2   all_to_all_v over the node's sub-group: replicas = pilots[replica_group];
//   owner     expert_in = arrival[expert_order].
// combine    owner -> pilot (stage 2 reversed); pilot: partial[g] = sum_i w_i * out_i over the
//            group's members in expert order (saves out for backward); pilot -> source
//            (stage 1 reversed): the partial sum [G, d] crosses the inter-node link once.
//            The layer adds the partials into their tokens (handle.group_tokens).
// combine_backward  source -> pilot: d_partial; pilot: d_out_i = w_i d_partial[g],
//            d_w_i = out_i . d_partial[g]; pilot -> owners: d_out; pilot -> source: d_w [N].
// dispatch_backward owners -> pilot: d_in; pilot: sum over the group; pilot -> source: one
//            row per group, put on the group's pilot row of d_rows [N, d] (others zero).
//
// Bytes over the inter-node link per direction: (sum over the source's tokens of the number of
// distinct remote nodes among its experts) x d x 4 for the rows, plus 12 bytes per routed row
// to a remote node for the stage-1 metadata (dispatch only) and 2 x 8 bytes per peer for the
// counts. combine_backward sends 4 bytes per routed row back (d_w).
//
// Nodes: DispatchConfig::ranks_per_node > 0 declares them (ep rank r on node r / rpn), else the
// group's topology. The group's byte counters classify links by the group's topology, so they
// are right per link class when the nodes come from there (comm::world(ranks_per_node)).
#include <cstdint>
#include <memory>
#include <vector>

#include "xmoe/comm/topology.h"
#include "xmoe/moe/dispatch.h"
#include "xmoe/moe/rbd_plan.h"

namespace xmoe::moe {

/// Node of each ep rank as rbd sees it (declared ranks_per_node, else the group's topology).
comm::Topology rbd_topology(const DispatchConfig& config);
int rbd_num_nodes(const DispatchConfig& config);
/// The rbd dispatcher (the registry returns all_to_all instead when there is one node).
/// Collective: splits the ep group into node groups.
std::unique_ptr<Dispatcher> make_rbd_dispatcher(const DispatchConfig& config);

/// What an rbd dispatch leaves for combine and both backwards (DispatchHandle::rbd): its plan,
/// the plan's index tensors for the row kernels, and what combine saved for backward.
struct RbdState {
  RbdPlan plan;
  Tensor pilot_rows;         ///< i32 [G] plan.source.pilot_rows
  Tensor replica_group;      ///< i32 [M] plan.pilot.replica_group
  Tensor replica_weight;     ///< f32 [M] plan.pilot.replica_weight
  Tensor member_out;         ///< [M, d] the replicas' expert outputs (combine saves; for d_w)
  Tensor d_combine_weights;  ///< f32 [N] (RowInfo order), combine_backward's result
};

}  // namespace xmoe::moe
