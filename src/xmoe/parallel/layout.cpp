#include "xmoe/parallel/layout.h"

namespace xmoe::parallel {

Layout Layout::create(std::shared_ptr<comm::Group> world, int ep, int tp, bool ssmb) {
  Layout l;
  l.world_size = world->size();
  l.world_rank = world->rank();
  XMOE_CHECK(tp >= 1 && l.world_size % tp == 0,
             "[parallel] parallel.tp = {} does not divide the number of processes {}", tp,
             l.world_size);
  l.tp = tp;
  l.ssmb = ssmb;
  l.tp_rank = l.world_rank % tp;
  const int data_rank = l.world_rank / tp;
  l.tp_group = tp == 1 ? comm::make_single_group() : world->split(data_rank, l.tp_rank);
  l.tp_replica_group = tp == 1              ? world
                       : tp == l.world_size ? comm::make_single_group()
                                            : world->split(l.tp_rank, data_rank);
  l.moe_world = ssmb ? world : l.tp_replica_group;
  const int moe_size = l.moe_world->size(), moe_rank = l.moe_world->rank();
  XMOE_CHECK(ep >= 1 && moe_size % ep == 0,
             "[parallel] parallel.ep = {} does not divide the {} ranks of the MoE layers ({})", ep,
             moe_size,
             ssmb ? std::string("every process, with SSMB")
                  : fmt::format("processes / parallel.tp = {} / {}, parallel.ssmb = false",
                                l.world_size, tp));
  l.ep = ep;
  l.dp = moe_size / ep;
  l.ep_rank = moe_rank % ep;
  l.dp_rank = moe_rank / ep;
  l.ep_group = ep == 1 ? comm::make_single_group() : l.moe_world->split(l.dp_rank, l.ep_rank);
  l.dp_group = l.dp == 1 ? comm::make_single_group() : l.moe_world->split(l.ep_rank, l.dp_rank);
  l.world = std::move(world);
  return l;
}

Layout Layout::single() {
  return create(comm::make_single_group(), 1);
}

}  // namespace xmoe::parallel
