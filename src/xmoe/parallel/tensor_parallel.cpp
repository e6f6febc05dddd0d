#include "xmoe/parallel/tensor_parallel.h"

#include "xmoe/core/profile.h"

namespace xmoe::parallel {

namespace {
bool alone(const comm::Group* tp) {
  return tp == nullptr || tp->size() == 1;
}
}  // namespace

Tensor gather_rows(comm::Group* tp, const Tensor& x) {
  if (alone(tp)) return x;
  ProfileScope scope("tp.all_gather", x.device());
  return on_group(*tp, x, [&](const Tensor& t) { return tp->all_gather(t); });
}

Tensor scatter_sum_rows(comm::Group* tp, const Tensor& x) {
  if (alone(tp)) return x;
  ProfileScope scope("tp.reduce_scatter", x.device());
  return on_group(*tp, x, [&](const Tensor& t) { return tp->reduce_scatter(t); });
}

Tensor own_rows(comm::Group* tp, const Tensor& x) {
  if (alone(tp)) return x;
  const int64_t n = x.size(0) / tp->size();
  XMOE_CHECK(n * tp->size() == x.size(0), "[parallel] {} rows do not split over {} tp ranks",
             x.size(0), tp->size());
  return x.rows(tp->rank() * n, (tp->rank() + 1) * n);
}

Tensor gather_shards(comm::Group& tp, const Tensor& shard, const ShardSpec& spec) {
  XMOE_CHECK(spec.sharded(), "[parallel] gather_shards of a tensor that is not sharded");
  // Gathered where the group moves tensors (NCCL: on the device), assembled on the host.
  const Tensor flat = shard.reshape({shard.numel()});
  Tensor all =
      tp.size() == 1 ? flat : on_group(tp, flat, [&](const Tensor& t) { return tp.all_gather(t); });
  if (!all.is_cpu()) all = all.to(Device::cpu());
  const int64_t numel = shard.numel();
  Tensor whole = Tensor::empty(spec.whole, shard.dtype());
  const int64_t n = numel / (spec.outer() * spec.inner());  // along spec.dim
  for (int t = 0; t < tp.size(); ++t) {
    ShardSpec s = spec;
    s.offset = t * n;
    place_shard(whole, s, all.rows(t * numel, (t + 1) * numel));
  }
  return whole;
}

Parameter make_split_parameter(std::string name, const Shape& whole, const Shape& local,
                               const Shape& view, int dim, comm::Group* tp) {
  if (alone(tp)) return Parameter::make(std::move(name), whole);
  const int size = tp->size();
  const Shape& v = view.empty() ? whole : view;
  const int64_t extent = v.at(static_cast<size_t>(dim));
  XMOE_CHECK(extent % size == 0, "[parallel] {}: dim {} of {} does not split over {} tp ranks",
             name, dim, shape_str(v), size);
  Parameter p = Parameter::make(std::move(name), local, ParamKind::tensor_shard);
  int64_t numel = 1;
  for (int64_t n : whole) numel *= n;
  XMOE_CHECK(p.value.numel() * size == numel, "[parallel] {}: {} is not 1/{} of {}", p.name,
             shape_str(local), size, shape_str(whole));
  p.shard = {whole, view, dim, tp->rank() * (extent / size)};
  return p;
}

}  // namespace xmoe::parallel
