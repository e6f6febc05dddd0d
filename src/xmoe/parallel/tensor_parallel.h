#pragma once
// The collectives of tensor and sequence parallelism over a tp group (docs/training.md,
// "Tensor parallelism"). Activations are [rows, ...] with the micro-batch's tokens as rows,
// sequence-major; rank t of the group holds rows [t·n, (t+1)·n). Each forward collective's
// backward is the other one:
//   gather_rows       (forward: slice -> whole)        backward: scatter_sum_rows
//   scatter_sum_rows  (forward: partial sums -> slice)  backward: gather_rows
// A null group or one of size 1 makes every function the identity.
#include "xmoe/comm/group.h"
#include "xmoe/core/parameter.h"

namespace xmoe::parallel {

/// `collective(t)` run where `group`'s tensors live: device tensors go through the host for a
/// group of host tensors (MPI); the result comes back on t's device.
template <typename F>
Tensor on_group(comm::Group& group, const Tensor& t, F&& collective) {
  if (group.device() == t.device()) return collective(t);
  XMOE_CHECK(group.device().is_cpu(), "[parallel] tensors on {} but the group's tensors live on {}",
             t.device().str(), group.device().str());
  return collective(t.to(Device::cpu())).to(t.device());
}

/// This rank's rows [n, ...] -> every rank's, in rank order [size·n, ...].
Tensor gather_rows(comm::Group* tp, const Tensor& x);
/// Every rank's partial [size·n, ...] -> their sum's rows of this rank [n, ...].
Tensor scatter_sum_rows(comm::Group* tp, const Tensor& x);
/// This rank's rows [n, ...] of a [size·n, ...] tensor that every rank holds (a view).
Tensor own_rows(comm::Group* tp, const Tensor& x);

/// The whole tensor (shape spec.global) of a parameter-shaped tensor `shard` sharded over `tp`
/// by `spec` (rank t holding offset t·n along spec.dim), on the host. Collective over tp.
Tensor gather_shards(comm::Group& tp, const Tensor& shard, const ShardSpec& spec);

/// A parameter whose whole tensor has shape `whole`, split over `tp` along dim `dim` of `view`
/// (a row-major view of it; empty = whole): this rank holds 1/size of it, stored as `local`
/// (ParamKind::tensor_shard, Parameter::shard set, so init_normal gives the whole tensor's
/// numbers). A null or size-1 group: the whole parameter (dense, unsharded). Not initialised.
Parameter make_split_parameter(std::string name, const Shape& whole, const Shape& local,
                               const Shape& view, int dim, comm::Group* tp);

}  // namespace xmoe::parallel
