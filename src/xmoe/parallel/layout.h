#pragma once
// The parallel layout of a run: world = dp_dense × tp, and the MoE layers' ranks split as
// moe_world = dp × ep (docs/training.md, "Parallel layout").
//
// Tensor parallelism (tp, innermost): world rank r has tp_rank = r % tp; the tp group is tp
// consecutive ranks, which read the same micro-batch, each working on its 1/tp slice of the
// tokens (sequence parallelism) and holding 1/tp of the attention heads and dense FFN columns.
// The tp-replica group is the world/tp ranks of one tp_rank (they hold the same shards).
//
// The MoE layers: with SSMB (parallel.ssmb, the default) every rank routes its own slice, so the
// MoE world is the whole world; without it the tp group runs the MoE layer replicated on its
// whole micro-batch and the MoE world is the tp-replica group. The MoE world has ep_rank = m % ep
// and dp_rank = m / ep for its rank m: the ranks of one ep group are consecutive there, so with
// ranks placed node by node an ep group stays inside as few nodes as possible. Experts are
// sharded over the ep group (each rank holds num_experts / ep consecutive experts) and
// replicated over dp.
#include <memory>

#include "xmoe/comm/group.h"

namespace xmoe::parallel {

struct Layout {
  int world_size = 1, world_rank = 0;
  int tp = 1, tp_rank = 0;
  bool ssmb = true;
  int dp = 1, ep = 1;  ///< of the MoE world: dp × ep = moe_world->size()
  int dp_rank = 0, ep_rank = 0;
  std::shared_ptr<comm::Group> world;             ///< all ranks (dense gradients, the loss)
  std::shared_ptr<comm::Group> tp_group;          ///< tp consecutive ranks: one micro-batch
  std::shared_ptr<comm::Group> tp_replica_group;  ///< same tp_rank: tensor-parallel gradients
  std::shared_ptr<comm::Group> moe_world;  ///< the MoE layers' world (statistics, aux losses)
  std::shared_ptr<comm::Group> ep_group;   ///< ranks sharing a dp index: dispatch/combine
  std::shared_ptr<comm::Group> dp_group;   ///< replicas of this rank's experts: expert gradients

  /// Splits `world` into tp groups of `tp` consecutive ranks, then the MoE world (the world with
  /// `ssmb`, else the tp-replica group) into ep groups of `ep` consecutive ranks and dp groups
  /// across them. Throws, naming the degree, when tp does not divide the world size or ep the
  /// MoE world's.
  static Layout create(std::shared_ptr<comm::Group> world, int ep, int tp = 1, bool ssmb = true);
  /// One process: every group is the single-process group.
  static Layout single();

  /// Ranks reading distinct micro-batches (world / tp) and this rank's index among them.
  int data_ranks() const { return world_size / tp; }
  int data_rank() const { return world_rank / tp; }
  /// The experts are replicated over the tp group (no SSMB): only tp_rank 0 writes them.
  bool experts_replicated_over_tp() const { return tp > 1 && !ssmb; }

  /// First global expert held here and how many, for num_experts experts.
  int64_t first_expert(int64_t num_experts) const { return ep_rank * (num_experts / ep); }
  int64_t local_experts(int64_t num_experts) const { return num_experts / ep; }
};

}  // namespace xmoe::parallel
