#pragma once
// The parallel layout of a run: world = dp × ep. Experts are sharded over the ep group (each
// rank holds num_experts / ep consecutive experts) and replicated over dp; dense parameters are
// replicated on every rank. Every rank reads its own micro-batches, so all world ranks are
// data-parallel for the dense parameters.
//
// World rank r has ep_rank = r % ep and dp_rank = r / ep: the ranks of one ep group are
// consecutive, so with ranks placed node by node an ep group stays inside as few nodes as
// possible.
#include <memory>

#include "xmoe/comm/group.h"

namespace xmoe::parallel {

struct Layout {
  int world_size = 1, world_rank = 0;
  int dp = 1, ep = 1;
  int dp_rank = 0, ep_rank = 0;
  std::shared_ptr<comm::Group> world;     ///< all ranks (dense gradients, MoE statistics)
  std::shared_ptr<comm::Group> ep_group;  ///< ranks sharing a dp index: dispatch/combine
  std::shared_ptr<comm::Group> dp_group;  ///< replicas of this rank's experts: expert gradients

  /// Splits `world` into ep groups of `ep` consecutive ranks and dp groups across them.
  /// Throws when ep does not divide the world size.
  static Layout create(std::shared_ptr<comm::Group> world, int ep);
  /// One process: every group is the single-process group.
  static Layout single();

  /// First global expert held here and how many, for num_experts experts.
  int64_t first_expert(int64_t num_experts) const { return ep_rank * (num_experts / ep); }
  int64_t local_experts(int64_t num_experts) const { return num_experts / ep; }
};

}  // namespace xmoe::parallel
