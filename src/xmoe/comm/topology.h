#pragma once
// Which ranks share a node. Detected (ranks that share memory) or declared (`ranks_per_node`),
// so that several nodes can be simulated on one machine. Dispatch that distinguishes intra- and
// inter-node links (RBD) and the byte counters use it.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace xmoe::comm {

enum class LinkClass : uint8_t { intra_node = 0, inter_node = 1 };

class Topology {
 public:
  Topology() : node_of_rank_{0} {}
  /// node_of_rank[r] = node id of rank r (ids are 0..num_nodes-1, in order of first appearance).
  explicit Topology(std::vector<int> node_of_rank);
  /// Declared layout: rank r is on node r / ranks_per_node.
  static Topology uniform(int world_size, int ranks_per_node);

  int size() const { return static_cast<int>(node_of_rank_.size()); }
  int num_nodes() const { return num_nodes_; }
  int node_of(int rank) const { return node_of_rank_[static_cast<size_t>(rank)]; }
  /// Ranks on `node`, ascending.
  std::vector<int> ranks_on(int node) const;
  /// Position of `rank` among the ranks of its node.
  int local_rank(int rank) const;
  LinkClass link(int a, int b) const {
    return node_of(a) == node_of(b) ? LinkClass::intra_node : LinkClass::inter_node;
  }
  /// The sub-topology of `ranks` (in the given order), as for a split group.
  Topology subset(const std::vector<int>& ranks) const;

 private:
  std::vector<int> node_of_rank_;
  int num_nodes_ = 1;
};

}  // namespace xmoe::comm
