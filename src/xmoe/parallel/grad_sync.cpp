#include "xmoe/parallel/grad_sync.h"

#include <algorithm>

#include "xmoe/core/profile.h"
#include "xmoe/ops/optim.h"
#include "xmoe/parallel/tensor_parallel.h"

namespace xmoe::parallel {

namespace {

/// Σ grad² of `params` as an f64 [1] tensor on their device (the CPU for none): one
/// deterministic multi-tensor reduction; nothing waits.
Tensor grad_sum_squares(const std::vector<Parameter*>& params) {
  settle_grads(params);
  std::vector<Tensor> grads;
  grads.reserve(params.size());
  for (const Parameter* p : params) grads.push_back(p->grad);
  return ops::multi_sum_squares(grads);
}

/// The parameters' gradients and their views of `packed`: consecutive rows, in order, every
/// gradient on `device`. multi_copy_scaled(views, grads) packs (bf16 widened to f32), the reverse
/// unpacks.
struct PackedViews {
  std::vector<Tensor> grads, views;
};
PackedViews packed_views(const std::vector<Parameter*>& params, const Tensor& packed,
                         Device device) {
  PackedViews v;
  int64_t offset = 0;
  for (const Parameter* p : params) {
    XMOE_CHECK(p->grad.device() == device, "[grad_sync] {} has its grad on {} but {} on {}",
               p->name, p->grad.device().str(), params[0]->name, device.str());
    v.grads.push_back(p->grad);
    v.views.push_back(packed.rows(offset, offset + p->grad.numel()));
    offset += p->grad.numel();
  }
  return v;
}

/// t as one flat [numel] view.
Tensor flat(const Tensor& t) {
  return t.reshape({t.numel()});
}

}  // namespace

GradientSync::GradientSync(std::vector<Parameter*> params, const Layout& layout,
                           int64_t bucket_bytes, int zero,
                           const std::vector<std::vector<Parameter*>>& dense_buckets)
    : params_(std::move(params)), layout_(layout), zero_(zero) {
  XMOE_CHECK(zero >= 0 && zero <= 2, "[grad_sync] parallel.zero = {} is not 0, 1 or 2", zero);
  std::vector<int64_t> numels;
  std::vector<ParamKind> kinds;
  for (const Parameter* p : params_) {
    numels.push_back(p->grad.numel());
    kinds.push_back(p->kind);
  }
  std::vector<std::vector<size_t>> plan = bucket_plan(numels, kinds, bucket_bytes);
  if (!dense_buckets.empty()) {
    // The given dense buckets first (in their order), then the planned buckets of other kinds.
    std::unordered_map<const Parameter*, size_t> index;
    for (size_t i = 0; i < params_.size(); ++i) index[params_[i]] = i;
    std::vector<std::vector<size_t>> given;
    std::vector<bool> placed(params_.size(), false);
    for (const std::vector<Parameter*>& bucket : dense_buckets) {
      std::vector<size_t> members;
      for (const Parameter* p : bucket) {
        const auto it = index.find(p);
        XMOE_CHECK(it != index.end() && p->kind == ParamKind::dense && !placed[it->second],
                   "[grad_sync] dense bucket member {} is not a dense parameter synchronised "
                   "here, or is in two buckets",
                   p->name);
        placed[it->second] = true;
        members.push_back(it->second);
      }
      if (!members.empty()) given.push_back(std::move(members));
    }
    for (size_t i = 0; i < params_.size(); ++i)
      XMOE_CHECK(placed[i] || kinds[i] != ParamKind::dense,
                 "[grad_sync] dense parameter {} is in none of the given buckets",
                 params_[i]->name);
    for (std::vector<size_t>& b : plan)
      if (kinds[b.front()] != ParamKind::dense) given.push_back(std::move(b));
    plan = std::move(given);
  }
  for (const std::vector<size_t>& members : plan) {
    Bucket b;
    b.kind = kinds[members.front()];
    for (size_t i : members) {
      b.params.push_back(params_[i]);
      b.numel += numels[i];
      bucket_of_[params_[i]] = buckets_.size();
    }
    buckets_.push_back(std::move(b));
  }
  if (zero_ == 0) return;
  for (Bucket& b : buckets_) {
    const comm::Group& group = group_of(b);
    std::vector<int64_t> numels;
    for (const Parameter* p : b.params) numels.push_back(p->value.numel());
    b.shards = BucketShards::plan(numels, group.size(), group.rank());
    std::vector<char> bf16;
    for (const Parameter* p : b.params) bf16.push_back(shards_master(*p, zero_));
    b.lanes = GatherLanes::plan(numels, bf16, group.size());
  }
}

bool GradientSync::shards_master(const Parameter& p, int zero) {
  return zero >= 1 && p.compute_copy.defined() && p.compute_copy.dtype() == DType::bf16 &&
         !p.reads_f32;
}

std::vector<std::vector<size_t>> GradientSync::bucket_plan(std::span<const int64_t> numels,
                                                           std::span<const ParamKind> kinds,
                                                           int64_t bucket_bytes) {
  const int64_t bucket_numel = std::max<int64_t>(1, bucket_bytes / 4);
  std::vector<std::vector<size_t>> out;
  for (ParamKind kind : {ParamKind::dense, ParamKind::expert, ParamKind::tensor_shard,
                         ParamKind::tensor_replicated}) {
    std::vector<size_t> b;
    int64_t n = 0;
    for (size_t i = 0; i < numels.size(); ++i) {
      if (kinds[i] != kind) continue;
      if (n > 0 && n + numels[i] > bucket_numel) {
        out.push_back(std::move(b));
        b.clear();
        n = 0;
      }
      b.push_back(i);
      n += numels[i];
    }
    if (n > 0) out.push_back(std::move(b));
  }
  return out;
}

comm::Group& GradientSync::group_of(const Bucket& b) const {
  switch (b.kind) {
    case ParamKind::dense:
      return *layout_.world;
    case ParamKind::expert:
      return *layout_.dp_group;
    case ParamKind::tensor_shard:
    case ParamKind::tensor_replicated:
      break;
  }
  return *layout_.tp_replica_group;
}

bool GradientSync::replicated_over_tp(ParamKind kind) const {
  return kind == ParamKind::tensor_replicated ||
         (kind == ParamKind::expert && layout_.experts_replicated_over_tp());
}

void GradientSync::start_all_reduce(size_t bucket) {
  Bucket& b = buckets_[bucket];
  XMOE_CHECK(!b.started, "[grad_sync] bucket {} ({}...) started twice in one step", bucket,
             b.params[0]->name);
  b.started = true;
  settle_grads(b.params);
  comm::Group& group = group_of(b);
  // Pack the bucket's gradients into one f32 buffer (bf16 gradients are widened, so the sum is
  // f32 whatever they are; CUDA: one multi-tensor copy) and start its all-reduce where the
  // group's tensors live (NCCL: on this device; MPI: on the host, CUDA buffers staged through
  // it). finish_all_reduce unpacks. The gradients stay allocated: they receive the average.
  const Device d = b.device = b.params[0]->grad.device();
  b.packed = Tensor::empty({b.numel}, DType::f32, d);
  {
    PackedViews v = packed_views(b.params, b.packed, d);
    ops::multi_copy_scaled(v.views, v.grads, 1.0f);
  }
  if (group.size() > 1) {
    if (group.device() == d) {
      b.work = group.all_reduce_async(b.packed);
    } else {
      XMOE_CHECK(group.device().is_cpu(),
                 "[grad_sync] gradients on {} but the group's tensors live on {}", d.str(),
                 group.device().str());
      b.summed = b.packed.to(Device::cpu());
      b.work = group.all_reduce_async(b.summed);
    }
  }
  all_reducing_.push_back(bucket);
}

void GradientSync::finish_all_reduce() {
  const float scale = 1.0f / static_cast<float>(layout_.world_size);
  for (size_t bucket : all_reducing_) {
    Bucket& b = buckets_[bucket];
    if (b.work) b.work->wait();
    if (b.summed.defined()) b.packed.copy_from(b.summed);
    // Unpack with the 1/world scale (bf16 rounded once).
    PackedViews v = packed_views(b.params, b.packed, b.device);
    ops::multi_copy_scaled(v.grads, v.views, scale);
    b.work.reset();
    b.packed = Tensor();
    b.summed = Tensor();
  }
  all_reducing_.clear();
}

void GradientSync::start_reduce_scatter(size_t bucket) {
  finish_reduce_scatter();
  Bucket& b = buckets_[bucket];
  XMOE_CHECK(!b.started, "[grad_sync] bucket {} ({}...) started twice in one step", bucket,
             b.params[0]->name);
  b.started = true;
  materialize_grads(b.params);  // (a parameter no backward wrote: a zero gradient)
  settle_grads(b.params);
  comm::Group& group = group_of(b);
  // Pack the padded bucket (the padding zeroed; bf16 gradients widened: the sum is f32), then
  // free the whole gradients: the update reads the shard (4 of the 4 + 12/N bytes per element).
  const Device d = b.device = b.params[0]->grad.device();
  b.packed = Tensor::empty({b.shards.padded}, DType::f32, d);
  if (b.shards.padded > b.numel) b.packed.rows(b.numel, b.shards.padded).zero_();
  {
    PackedViews v = packed_views(b.params, b.packed, d);
    ops::multi_copy_scaled(v.views, v.grads, 1.0f);
  }  // the views' references to the gradients go before the gradients are freed
  for (Parameter* p : b.params) p->release_grad();
  if (group.size() == 1) {
    b.summed = std::move(b.packed);
  } else {
    // Where the group's tensors live (NCCL: this device; MPI: the host, staged through it).
    if (group.device() != d) {
      XMOE_CHECK(group.device().is_cpu(),
                 "[grad_sync] gradients on {} but the group's tensors live on {}", d.str(),
                 group.device().str());
      b.packed = b.packed.to(Device::cpu());
    }
    b.work = group.reduce_scatter_async(b.packed, b.summed);
  }
  in_flight_ = bucket;
}

void GradientSync::finish_reduce_scatter() {
  if (in_flight_ == kNone) return;
  Bucket& b = buckets_[in_flight_];
  in_flight_ = kNone;
  if (b.work) b.work->wait();
  // This rank's shard of the sum, scaled as the all-reduced gradients are: in place where the
  // sum is on the gradients' device (no second buffer while the bucket is in flight).
  const Device d = b.device;
  b.grad_shard = b.summed.device() == d ? b.summed : Tensor::empty({b.shards.shard}, DType::f32, d);
  std::vector<Tensor> dst{b.grad_shard};
  const std::vector<Tensor> src{b.summed.device() == d ? b.summed : b.summed.to(d)};
  ops::multi_copy_scaled(dst, src, 1.0f / static_cast<float>(layout_.world_size));
  b.work.reset();
  b.packed = Tensor();
  b.summed = Tensor();
}

void GradientSync::grads_ready(const std::vector<Parameter*>& params) {
  if (zero_ < 2 && layout_.world_size == 1) return;
  for (const Parameter* p : params) {
    const auto it = bucket_of_.find(p);
    XMOE_CHECK(it != bucket_of_.end(), "[grad_sync] grads_ready: {} is not synchronised here",
               p->name);
    Bucket& b = buckets_[it->second];
    XMOE_CHECK(b.ready < b.params.size(),
               "[grad_sync] grads_ready: {} reported finished twice in one step", p->name);
    if (++b.ready < b.params.size()) continue;
    if (zero_ == 2)
      start_reduce_scatter(it->second);
    else
      start_all_reduce(it->second);
  }
}

std::vector<std::vector<Parameter*>> GradientSync::buckets() const {
  std::vector<std::vector<Parameter*>> out;
  for (const Bucket& b : buckets_) out.push_back(b.params);
  return out;
}

int64_t GradientSync::gradient_bytes() const {
  int64_t bytes = 0;
  for (const Parameter* p : params_)
    if (p->grad.defined()) bytes += static_cast<int64_t>(p->grad.nbytes());
  for (const Bucket& b : buckets_)
    if (b.grad_shard.defined()) bytes += static_cast<int64_t>(b.grad_shard.nbytes());
  return bytes;
}

void GradientSync::sync() {
  if (zero_ == 2) {
    // The buckets grads_ready() did not start, in order; then the last one in flight.
    for (size_t i = 0; i < buckets_.size(); ++i)
      if (!buckets_[i].started) start_reduce_scatter(i);
    finish_reduce_scatter();
    for (Bucket& b : buckets_) {
      b.started = false;
      b.ready = 0;
    }
    return;
  }
  if (layout_.world_size == 1) return;
  // The buckets grads_ready() started are in flight; the others start here, in order, each
  // finished before the next (one packed bucket at a time).
  finish_all_reduce();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (buckets_[i].started) continue;
    start_all_reduce(i);
    finish_all_reduce();
  }
  for (Bucket& b : buckets_) {
    b.started = false;
    b.ready = 0;
  }
}

double GradientSync::global_grad_sum_squares() const {
  const Device d = params_.empty() ? Device::cpu() : params_[0]->grad.device();
  ProfileScope scope("optim.grad_norm", d);
  comm::Group& world = *layout_.world;
  if (zero_ == 2) {
    // Every element of a bucket is in exactly one rank's shard of its group, and the groups
    // cover every parameter once, except where the tp ranks of a group hold the same copy
    // (counted tp times: divided by tp). The pieces are summed per kind in parameter order and
    // added as zero 0 adds its sums, so that one process gets zero 0's bits.
    std::vector<Tensor> dense, expert, shard, replicated;
    for (const Bucket& b : buckets_) {
      std::vector<Tensor>& list = b.kind == ParamKind::dense          ? dense
                                  : b.kind == ParamKind::expert       ? expert
                                  : b.kind == ParamKind::tensor_shard ? shard
                                                                      : replicated;
      for (const ShardPiece& p : b.shards.pieces)
        list.push_back(b.grad_shard.rows(p.shard_offset, p.shard_offset + p.count));
    }
    const bool expert_copies = replicated_over_tp(ParamKind::expert);
    Tensor t = Tensor::from_vector<double>(
        {ops::multi_sum_squares(dense).item(), ops::multi_sum_squares(shard).item(),
         ops::multi_sum_squares(expert).item(), ops::multi_sum_squares(replicated).item()},
        {4}, world.device());
    if (world.size() > 1) world.all_reduce(t);
    const std::vector<double> s = t.to_vector<double>();
    const double tp = layout_.tp;
    return (s[0] + s[1]) + (expert_copies ? s[2] / tp : s[2]) + s[3] / tp;
  }
  // After sync the dense and tp-replicated gradients are the same on every rank (counted
  // here once); the tensor-parallel shards add up over the tp group, the experts over the ep
  // group (each rank holds different ones).
  std::vector<Parameter*> local, shards, expert;
  for (Parameter* p : params_)
    (p->kind == ParamKind::expert         ? expert
     : p->kind == ParamKind::tensor_shard ? shards
                                          : local)
        .push_back(p);
  auto summed_over = [](const std::vector<Parameter*>& ps, comm::Group& group) {
    Tensor t = grad_sum_squares(ps);
    if (group.size() > 1) {
      // On the device where the group lives (NCCL), else through the host.
      if (t.device() != group.device()) t = t.to(group.device());
      group.all_reduce(t);
    }
    return t.item();
  };
  return grad_sum_squares(local).item() + summed_over(shards, *layout_.tp_group) +
         summed_over(expert, *layout_.ep_group);
}

std::vector<OwnedPiece> GradientSync::owned_pieces() const {
  std::vector<OwnedPiece> out;
  if (zero_ == 0) {
    for (Parameter* p : params_) out.push_back({p, 0, p->value.numel(), false, false});
    return out;
  }
  for (const Bucket& b : buckets_)
    for (const ShardPiece& s : b.shards.pieces)
      out.push_back({b.params[s.param], s.offset, s.count, zero_ == 2,
                     shards_master(*b.params[s.param], zero_)});
  return out;
}

std::vector<Tensor> GradientSync::shard_grads() const {
  XMOE_CHECK(zero_ == 2, "[grad_sync] shard_grads needs parallel.zero = 2");
  std::vector<Tensor> out;
  for (const Bucket& b : buckets_) {
    XMOE_CHECK(b.grad_shard.defined(), "[grad_sync] shard_grads before sync()");
    for (const ShardPiece& s : b.shards.pieces)
      out.push_back(b.grad_shard.rows(s.shard_offset, s.shard_offset + s.count));
  }
  return out;
}

void GradientSync::release_shards() {
  for (Bucket& b : buckets_) b.grad_shard = Tensor();
}

Tensor GradientSync::all_gather(const Bucket& b, const Tensor& shard) const {
  comm::Group& group = group_of(b);
  if (group.size() == 1) return shard;
  return on_group(group, shard, [&](const Tensor& t) { return group.all_gather(t); });
}

void GradientSync::gather_params() {
  if (zero_ == 0) return;
  ProfileScope scope("optim.zero_gather", params_.empty() ? Device::cpu() : params_[0]->device());
  for (const Bucket& b : buckets_) {
    const int rank = group_of(b).rank();
    // One lane per kind of weight: the bf16 copies of master-sharded parameters, the f32 values
    // of the others; each rank packs its updated elements (padding zero), gathers every rank's
    // and unpacks the other ranks' pieces (its own are in place: AdamW wrote them).
    for (const bool bf16 : {true, false}) {
      const int64_t lane = bf16 ? b.lanes.bf16 : b.lanes.f32;
      if (lane == 0) continue;
      auto weights = [&](const LanePiece& l) {
        const Parameter& p = *b.params[l.param];
        return flat(bf16 ? p.compute_copy : p.value).rows(l.offset, l.offset + l.count);
      };
      const LanePiece* first = nullptr;
      for (const LanePiece& l : b.lanes.pieces)
        if (l.bf16 == bf16 && !first) first = &l;
      Tensor mine =
          Tensor::zeros({lane}, bf16 ? DType::bf16 : DType::f32, weights(*first).device());
      std::vector<Tensor> dst, src;
      for (const LanePiece& l : b.lanes.pieces) {
        if (l.bf16 != bf16 || l.rank != rank) continue;
        dst.push_back(mine.rows(l.lane_at, l.lane_at + l.count));
        src.push_back(weights(l));
      }
      ops::multi_copy_scaled(dst, src, 1.0f);
      const Tensor all = all_gather(b, mine);
      dst.clear();
      src.clear();
      std::vector<Tensor> copies, copy_src;
      for (const LanePiece& l : b.lanes.pieces) {
        if (l.bf16 != bf16 || l.rank == rank) continue;
        const int64_t at = l.rank * lane + l.lane_at;
        dst.push_back(weights(l));
        src.push_back(all.rows(at, at + l.count));
        const Parameter& p = *b.params[l.param];
        if (!bf16 && p.compute_copy.defined()) {  // bf16(p), as AdamW writes it
          copies.push_back(flat(p.compute_copy).rows(l.offset, l.offset + l.count));
          copy_src.push_back(src.back());
        }
      }
      ops::multi_copy_scaled(dst, src, 1.0f);
      ops::multi_copy_scaled(copies, copy_src, 1.0f);
    }
  }
}

std::vector<Tensor> GradientSync::gather_pieces(std::span<const Tensor> pieces) const {
  XMOE_CHECK(zero_ >= 1, "[grad_sync] gather_pieces needs parallel.zero >= 1");
  std::vector<Tensor> out(params_.size());
  // Where the pieces live (the host for an offloaded optimizer).
  const Device device = !pieces.empty()   ? pieces[0].device()
                        : params_.empty() ? Device::cpu()
                                          : params_[0]->device();
  size_t k = 0;
  for (const Bucket& b : buckets_) {
    Tensor shard = Tensor::zeros({b.shards.shard}, DType::f32, device);
    std::vector<Tensor> dst, src;
    for (const ShardPiece& s : b.shards.pieces) {
      XMOE_CHECK(k < pieces.size() && pieces[k].numel() == s.count,
                 "[grad_sync] gather_pieces: piece {} is {}, expected {} elements", k,
                 k < pieces.size() ? pieces[k].str() : std::string("missing"), s.count);
      dst.push_back(shard.rows(s.shard_offset, s.shard_offset + s.count));
      src.push_back(flat(pieces[k++]));
    }
    ops::multi_copy_scaled(dst, src, 1.0f);
    const Tensor all = all_gather(b, shard);
    int64_t offset = 0;
    for (const Parameter* p : b.params) {
      const size_t i =
          static_cast<size_t>(std::find(params_.begin(), params_.end(), p) - params_.begin());
      const int64_t n = p->value.numel();
      out[i] = all.rows(offset, offset + n).clone().reshape(p->value.shape());
      offset += n;
    }
  }
  XMOE_CHECK(k == pieces.size(), "[grad_sync] gather_pieces: {} pieces given, {} owned",
             pieces.size(), k);
  return out;
}

}  // namespace xmoe::parallel
