#include "xmoe/comm/topology.h"

#include <map>

#include "xmoe/core/error.h"

namespace xmoe::comm {

Topology::Topology(std::vector<int> node_of_rank) {
  XMOE_CHECK(!node_of_rank.empty(), "[topology] no ranks");
  std::map<int, int> renumber;
  for (int& n : node_of_rank) {
    auto it = renumber.find(n);
    if (it == renumber.end()) it = renumber.emplace(n, static_cast<int>(renumber.size())).first;
    n = it->second;
  }
  node_of_rank_ = std::move(node_of_rank);
  num_nodes_ = static_cast<int>(renumber.size());
}

Topology Topology::uniform(int world_size, int ranks_per_node) {
  XMOE_CHECK(ranks_per_node > 0 && world_size % ranks_per_node == 0,
             "[topology] parallel.ranks_per_node = {} does not divide the world size {}",
             ranks_per_node, world_size);
  std::vector<int> nodes(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) nodes[static_cast<size_t>(r)] = r / ranks_per_node;
  return Topology(std::move(nodes));
}

std::vector<int> Topology::ranks_on(int node) const {
  std::vector<int> out;
  for (int r = 0; r < size(); ++r)
    if (node_of_rank_[static_cast<size_t>(r)] == node) out.push_back(r);
  return out;
}

int Topology::local_rank(int rank) const {
  int local = 0;
  for (int r = 0; r < rank; ++r) local += node_of(r) == node_of(rank);
  return local;
}

Topology Topology::subset(const std::vector<int>& ranks) const {
  std::vector<int> nodes;
  nodes.reserve(ranks.size());
  for (int r : ranks) nodes.push_back(node_of(r));
  return Topology(std::move(nodes));
}

}  // namespace xmoe::comm
