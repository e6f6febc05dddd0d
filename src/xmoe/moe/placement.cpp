#include "xmoe/moe/placement.h"

#include <algorithm>
#include <numeric>

#include "xmoe/core/error.h"

namespace xmoe::moe {

void CoactivationMatrix::add_token(std::span<const int32_t> experts) {
  for (size_t i = 0; i < experts.size(); ++i) {
    const int32_t a = experts[i];
    XMOE_CHECK(a >= 0 && a < num_experts, "[placement] expert id {} outside [0, {})", a,
               num_experts);
    ++at(a, a);
    for (size_t j = i + 1; j < experts.size(); ++j) {
      ++at(a, experts[j]);
      ++at(experts[j], a);
    }
  }
}

CoactivationMatrix CoactivationMatrix::from_routing(std::span<const int32_t> topk_idx,
                                                    int64_t top_k, int64_t num_experts) {
  CoactivationMatrix c(num_experts);
  for (size_t t = 0; t + top_k <= topk_idx.size(); t += static_cast<size_t>(top_k))
    c.add_token(topk_idx.subspan(t, static_cast<size_t>(top_k)));
  return c;
}

namespace {

void check_layout(int64_t E, int num_nodes, int experts_per_node, const char* op) {
  XMOE_CHECK(num_nodes >= 1 && experts_per_node >= 1 && int64_t{num_nodes} * experts_per_node == E,
             "[{}] {} nodes x {} experts per node != {} experts", op, num_nodes, experts_per_node,
             E);
}

/// node of each old expert under perm (empty = identity).
std::vector<int> node_of_expert(std::span<const int> perm, int64_t E, int experts_per_node) {
  std::vector<int> node(static_cast<size_t>(E));
  for (int64_t s = 0; s < E; ++s) {
    const int e = perm.empty() ? static_cast<int>(s) : perm[s];
    node[e] = static_cast<int>(s / experts_per_node);
  }
  return node;
}

/// Affinity A = C + C^T off the diagonal (so each unordered pair counts both orders).
std::vector<int64_t> affinity(const CoactivationMatrix& c) {
  const int64_t E = c.num_experts;
  std::vector<int64_t> a(static_cast<size_t>(E * E), 0);
  for (int64_t i = 0; i < E; ++i)
    for (int64_t j = 0; j < E; ++j)
      if (i != j) a[i * E + j] = c.at(i, j) + c.at(j, i);
  return a;
}

int64_t objective(const std::vector<int64_t>& a, const std::vector<int>& node, int64_t E) {
  int64_t s = 0;
  for (int64_t i = 0; i < E; ++i)
    for (int64_t j = 0; j < E; ++j)
      if (node[i] == node[j]) s += a[i * E + j];
  return s / 2;  // a counts C_ij + C_ji: the ordered-pair sum
}

/// Best-improvement pairwise swaps between nodes until no swap gains (Kernighan-Lin style).
void swap_search(const std::vector<int64_t>& a, std::vector<int>& node, int64_t E, int num_nodes,
                 int max_swaps) {
  // s[e * N + n] = affinity of e to the experts on node n.
  std::vector<int64_t> s(static_cast<size_t>(E * num_nodes), 0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < E; ++j) s[e * num_nodes + node[j]] += a[e * E + j];
  for (int it = 0; it < max_swaps; ++it) {
    int64_t best = 0, ba = -1, bb = -1;
    for (int64_t x = 0; x < E; ++x)
      for (int64_t y = x + 1; y < E; ++y) {
        const int nx = node[x], ny = node[y];
        if (nx == ny) continue;
        const int64_t gain = s[x * num_nodes + ny] + s[y * num_nodes + nx] - 2 * a[x * E + y] -
                             s[x * num_nodes + nx] - s[y * num_nodes + ny];
        if (gain > best) best = gain, ba = x, bb = y;
      }
    if (ba < 0) return;
    const int na = node[ba], nb = node[bb];
    for (int64_t e = 0; e < E; ++e) {
      s[e * num_nodes + na] += a[e * E + bb] - a[e * E + ba];
      s[e * num_nodes + nb] += a[e * E + ba] - a[e * E + bb];
    }
    std::swap(node[ba], node[bb]);
  }
}

/// Greedy seeding: each node in turn takes the free expert with the most affinity to the other
/// free experts, then, until full, the free expert with the most affinity to its members.
std::vector<int> greedy(const std::vector<int64_t>& a, int64_t E, int num_nodes, int per_node) {
  std::vector<int> node(static_cast<size_t>(E), -1);
  for (int n = 0; n < num_nodes; ++n) {
    std::vector<int64_t> pull(static_cast<size_t>(E), 0);  // affinity to the node's members
    for (int m = 0; m < per_node; ++m) {
      int64_t best = -1, pick = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (node[e] >= 0) continue;
        int64_t score = pull[e];
        if (m == 0)
          for (int64_t j = 0; j < E; ++j) score += node[j] < 0 ? a[e * E + j] : 0;
        if (score > best) best = score, pick = e;
      }
      node[pick] = n;
      for (int64_t e = 0; e < E; ++e) pull[e] += a[e * E + pick];
    }
  }
  return node;
}

std::vector<int> to_perm(const std::vector<int>& node, int64_t E, int num_nodes, int per_node) {
  std::vector<int> perm;
  perm.reserve(static_cast<size_t>(E));
  for (int n = 0; n < num_nodes; ++n)
    for (int64_t e = 0; e < E; ++e)
      if (node[e] == n) perm.push_back(static_cast<int>(e));
  (void)per_node;
  return perm;
}

}  // namespace

int64_t intra_node_coactivation(const CoactivationMatrix& c, std::span<const int> perm,
                                int experts_per_node) {
  const int64_t E = c.num_experts;
  XMOE_CHECK(experts_per_node >= 1 && E % experts_per_node == 0,
             "[placement] {} experts per node for {} experts", experts_per_node, E);
  const std::vector<int> node = node_of_expert(perm, E, experts_per_node);
  int64_t s = 0;
  for (int64_t i = 0; i < E; ++i)
    for (int64_t j = 0; j < E; ++j)
      if (i != j && node[i] == node[j]) s += c.at(i, j);
  return s;
}

std::vector<int> optimize_placement(const CoactivationMatrix& c, int num_nodes,
                                    int experts_per_node, PlacementOptions options) {
  const int64_t E = c.num_experts;
  check_layout(E, num_nodes, experts_per_node, "optimize_placement");
  const std::vector<int64_t> a = affinity(c);
  std::vector<int> from_identity = node_of_expert({}, E, experts_per_node);
  swap_search(a, from_identity, E, num_nodes, options.max_swaps);
  std::vector<int> from_greedy = greedy(a, E, num_nodes, experts_per_node);
  swap_search(a, from_greedy, E, num_nodes, options.max_swaps);
  const bool greedy_better = objective(a, from_greedy, E) > objective(a, from_identity, E);
  return to_perm(greedy_better ? from_greedy : from_identity, E, num_nodes, experts_per_node);
}

PilotCount count_pilots(std::span<const int32_t> topk_idx, int64_t top_k, std::span<const int> perm,
                        int num_nodes, int experts_per_node, int source_node) {
  XMOE_CHECK(top_k >= 1 && topk_idx.size() % static_cast<size_t>(top_k) == 0,
             "[count_pilots] {} ids are not a multiple of k = {}", topk_idx.size(), top_k);
  const int64_t E = int64_t{num_nodes} * experts_per_node;
  XMOE_CHECK(perm.empty() || static_cast<int64_t>(perm.size()) == E,
             "[count_pilots] permutation of {} for {} experts", perm.size(), E);
  const std::vector<int> node = node_of_expert(perm, E, experts_per_node);
  const double remote = double(num_nodes - 1) / num_nodes;
  PilotCount out;
  std::vector<int> seen(static_cast<size_t>(num_nodes), -1);
  for (size_t t = 0; t < topk_idx.size() / static_cast<size_t>(top_k); ++t) {
    int distinct = 0, distinct_remote = 0, pairs_remote = 0;
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = topk_idx[t * top_k + j];
      XMOE_CHECK(e >= 0 && e < E, "[count_pilots] expert id {} outside [0, {})", e, E);
      const int n = node[e];
      pairs_remote += n != source_node;
      if (seen[n] != static_cast<int>(t)) {
        seen[n] = static_cast<int>(t);
        ++distinct;
        distinct_remote += n != source_node;
      }
    }
    ++out.tokens;
    out.pairs += top_k;
    out.node_pilots += distinct;
    out.internode_pilots += source_node >= 0 ? distinct_remote : distinct * remote;
    out.internode_pairs += source_node >= 0 ? pairs_remote : top_k * remote;
  }
  return out;
}

double expected_internode_pilots(const CoactivationMatrix& c, std::span<const int> perm,
                                 int num_nodes, int experts_per_node) {
  const int64_t E = c.num_experts;
  check_layout(E, num_nodes, experts_per_node, "expected_internode_pilots");
  const std::vector<int> node = node_of_expert(perm, E, experts_per_node);
  // sum_t |nodes of t| ~ sum_n (sum_{e in n} C_ee - sum_{e < f in n} C_ef) (Bonferroni).
  double distinct = 0;
  for (int64_t e = 0; e < E; ++e) {
    distinct += double(c.at(e, e));
    for (int64_t f = e + 1; f < E; ++f)
      if (node[e] == node[f]) distinct -= double(c.at(e, f));
  }
  return distinct * double(num_nodes - 1) / num_nodes;
}

}  // namespace xmoe::moe
