#pragma once
// Expert placement by affinity (beyond X-MoE). RBD sends a token once per destination node, so
// the inter-node traffic is the number of distinct nodes among a token's experts. Experts that
// tokens pick together (co-activation) should therefore share a node. This file:
//   - CoactivationMatrix: E x E counts of expert pairs chosen by one token (MoELayer records it);
//   - optimize_placement: a permutation perm[new_slot] = old_expert that packs co-activated
//     experts onto nodes (slot s lives on node s / experts_per_node), maximising
//     sum_{i != j on one node} C_ij: greedy seeding, then best-improvement pairwise swaps
//     (Kernighan-Lin style), deterministic;
//   - pilot counts to evaluate a placement on a recorded routing.
// Applying one: MoELayer::permute_experts(perm, riders) (moe/expert_permutation.h), the
// optimizer's moments among the riders.
#include <cstdint>
#include <span>
#include <vector>

namespace xmoe::moe {

/// Symmetric E x E counts: at(a, b) = tokens that chose both a and b (a != b); at(e, e) = tokens
/// that chose e.
struct CoactivationMatrix {
  int64_t num_experts = 0;
  std::vector<int64_t> counts;  ///< row-major [E * E]

  CoactivationMatrix() = default;
  explicit CoactivationMatrix(int64_t e) : num_experts(e), counts(static_cast<size_t>(e * e), 0) {}
  int64_t at(int64_t a, int64_t b) const {
    return counts[static_cast<size_t>(a * num_experts + b)];
  }
  int64_t& at(int64_t a, int64_t b) { return counts[static_cast<size_t>(a * num_experts + b)]; }
  /// Adds one token's choice of `experts` (distinct ids).
  void add_token(std::span<const int32_t> experts);
  /// Counts of topk_idx [T * k] (row-major, k per token).
  static CoactivationMatrix from_routing(std::span<const int32_t> topk_idx, int64_t top_k,
                                         int64_t num_experts);
};

/// sum over ordered pairs i != j placed on one node of C_ij (perm[slot] = expert, slot s on
/// node s / experts_per_node).
int64_t intra_node_coactivation(const CoactivationMatrix& c, std::span<const int> perm,
                                int experts_per_node);

struct PlacementOptions {
  int max_swaps = 100000;  ///< cap on improving swaps of the local search
};

/// perm[new_slot] = old_expert for num_nodes nodes of experts_per_node slots each
/// (num_nodes * experts_per_node = E), maximising intra_node_coactivation. Runs the swap
/// search from the identity and from a greedy seeding and keeps the better (the identity's
/// on a tie, which moves nothing); inside a node experts keep ascending old ids. Deterministic.
std::vector<int> optimize_placement(const CoactivationMatrix& c, int num_nodes,
                                    int experts_per_node, PlacementOptions options = {});

/// Pilots a routing sends under a placement: for each token, the number of distinct nodes
/// among the nodes of its experts, where old expert e sits on node slot_of(e) /
/// experts_per_node (perm[slot] = e; an empty perm = identity). topk_idx [T * k] holds OLD
/// expert ids.
struct PilotCount {
  int64_t tokens = 0;
  int64_t pairs = 0;        ///< T * k: rows a plain all_to_all sends
  int64_t node_pilots = 0;  ///< sum_t distinct nodes (rbd's pilots, own node included)
  /// sum_t distinct nodes other than the token's source node (source_node >= 0), or
  /// sum_t distinct * (num_nodes - 1) / num_nodes (the expectation for a source node uniform
  /// over the nodes) when source_node < 0.
  double internode_pilots = 0;
  double internode_pairs = 0;  ///< the same for all_to_all: pairs on remote nodes
};
PilotCount count_pilots(std::span<const int32_t> topk_idx, int64_t top_k, std::span<const int> perm,
                        int num_nodes, int experts_per_node, int source_node = -1);

/// Expected inter-node pilots per token from the co-activation matrix alone, by inclusion-
/// exclusion to second order (exact for k <= 2, an estimate above): a proxy for ranking.
double expected_internode_pilots(const CoactivationMatrix& c, std::span<const int> perm,
                                 int num_nodes, int experts_per_node);

}  // namespace xmoe::moe
