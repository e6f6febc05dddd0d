#include "xmoe/parallel/layout.h"

namespace xmoe::parallel {

Layout Layout::create(std::shared_ptr<comm::Group> world, int ep) {
  Layout l;
  l.world_size = world->size();
  l.world_rank = world->rank();
  XMOE_CHECK(ep >= 1 && l.world_size % ep == 0,
             "[parallel] parallel.ep = {} does not divide the number of processes {}", ep,
             l.world_size);
  l.ep = ep;
  l.dp = l.world_size / ep;
  l.ep_rank = l.world_rank % ep;
  l.dp_rank = l.world_rank / ep;
  l.ep_group = ep == 1 ? comm::make_single_group() : world->split(l.dp_rank, l.ep_rank);
  l.dp_group = l.dp == 1 ? comm::make_single_group() : world->split(l.ep_rank, l.dp_rank);
  l.world = std::move(world);
  return l;
}

Layout Layout::single() {
  return create(comm::make_single_group(), 1);
}

}  // namespace xmoe::parallel
