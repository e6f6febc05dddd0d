#pragma once
// NCCL backend of comm::Group (CUDA tensors). Built when XMOE_NCCL is on (it needs XMOE_CUDA and
// XMOE_MPI); otherwise comm/nccl_stub/ provides these functions, which say that NCCL is missing.
// Plain header (no NCCL or CUDA headers): code that only holds a Group includes it freely.
//
// Each NCCL group rides on a CPU group over the same ranks (MPI, or the single-process group):
// the CPU group bootstraps the communicator (broadcasts ncclUniqueId), carries the host-side
// exchanges (all_to_all_counts, barrier) and gives the topology for the byte counters.
// Collectives run on a communication stream of their own; see docs/cuda.md, "NCCL backend".
#include <memory>

#include "xmoe/comm/group.h"

namespace xmoe::comm::nccl {

/// True when this xmoe was built with NCCL (XMOE_NCCL=ON).
bool available();

/// An NCCL communicator over the ranks of `cpu_group` (same rank numbers and topology), moving
/// tensors on cuda:`device`. Collective over `cpu_group`: every rank calls it, each with its own
/// device (NCCL allows one rank per device in a communicator).
std::shared_ptr<Group> make_group(std::shared_ptr<Group> cpu_group, int device);

/// Where this rank sits among the ranks of `cpu_group` that run on the same host (by host
/// name, whatever ranks_per_node declares). Collective over `cpu_group`.
struct HostRanks {
  int local_rank = 0;  ///< position among this host's ranks, in rank order
  int local_size = 1;  ///< ranks of the group on this host
};
HostRanks host_ranks(Group& cpu_group);

/// Frees `group`'s communicator at once (ncclCommAbort: no wait for queued work or for the
/// peers) when it is an NCCL group; it refuses every collective afterwards and its destructor
/// no longer synchronises. For error paths: a rank that leaves with an exception must not block
/// in ncclCommDestroy or a stream sync while its peers wait for it in a collective. Not
/// collective; a no-op for other groups.
void abandon(Group& group);

/// The NCCL group over comm::world(ranks_per_node)'s ranks; each rank takes the device of its
/// position on its host (cuda:local_rank). Throws on every rank when a host has more ranks
/// than visible CUDA devices. Release it before comm::finalize().
std::shared_ptr<Group> make_world(int ranks_per_node = 0);

}  // namespace xmoe::comm::nccl
