#include "xmoe/model/transformer.h"

#include <algorithm>
#include <iterator>

#include "xmoe/core/profile.h"
#include "xmoe/moe/layer.h"
#include "xmoe/ops/ops.h"

namespace xmoe::model {

void validate(const ModelConfig& c) {
  XMOE_CHECK(c.vocab_size > 0, "[config] model.vocab_size = {} must be positive", c.vocab_size);
  XMOE_CHECK(c.num_layers > 0, "[config] model.num_layers = {} must be positive", c.num_layers);
  XMOE_CHECK(c.num_heads > 0 && c.d_model % c.num_heads == 0,
             "[config] model.d_model = {} is not a multiple of model.num_heads = {}", c.d_model,
             c.num_heads);
  XMOE_CHECK((c.d_model / c.num_heads) % 2 == 0,
             "[config] head_dim = model.d_model / model.num_heads = {} must be even (RoPE)",
             c.d_model / c.num_heads);
  XMOE_CHECK(c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0,
             "[config] model.num_heads = {} is not a multiple of model.num_kv_heads = {}",
             c.num_heads, c.num_kv_heads);
  XMOE_CHECK(c.max_seq_len > 0, "[config] model.max_seq_len = {} must be positive", c.max_seq_len);
  XMOE_CHECK(c.first_dense_layers >= 0, "[config] model.first_dense_layers = {} must be >= 0",
             c.first_dense_layers);
  XMOE_CHECK(c.first_dense_layers == 0 || c.dense_hidden > 0,
             "[config] model.dense_hidden = {} must be positive", c.dense_hidden);
  XMOE_CHECK(c.init_std > 0, "[config] model.init_std = {} must be positive", c.init_std);
  XMOE_CHECK(c.norm_eps > 0, "[config] model.norm_eps = {} must be positive", c.norm_eps);
  parse_recompute(c.recompute);
}

Transformer::Transformer(const ModelConfig& cfg, uint64_t seed, const parallel::Layout* layout)
    : cfg_(cfg) {
  validate(cfg);
  if (layout && layout->tp > 1) {
    tp_ = layout->tp;
    tp_rank_ = layout->tp_rank;
    // Without SSMB the MoE layers' world is the tp-replica group (1/P of the ranks), whose
    // gradient convention is P times smaller than the model's; their aux losses' gradients
    // get the same factor as the cross-entropy's (checked by the distributed tests).
    if (!layout->ssmb) moe_aux_scale_ = static_cast<float>(layout->tp);
  }
  const int64_t d = cfg.d_model, v = cfg.vocab_size;
  rope_ = std::make_shared<ops::RopeTables>(
      ops::rope_tables(cfg.max_seq_len, d / cfg.num_heads, cfg.rope_theta));
  // Sequence parallelism: the embedding, the norms and the LM head are replicated; each rank
  // applies them to its own slice of the tokens.
  embed_ = std::make_unique<Embedding>("embed.weight", v, d, seed, cfg.init_std);
  for (int i = 0; i < cfg.num_layers; ++i)
    blocks_.push_back(std::make_unique<TransformerBlock>(cfg, i, rope_, seed, layout));
  final_norm_ = std::make_unique<RMSNorm>("final_norm.weight", d, cfg.norm_eps);
  if (!cfg.tie_embeddings) {
    lm_head_ = std::make_unique<Parameter>(Parameter::make("lm_head.weight", {d, v}));
    lm_head_->init_normal(seed, cfg.init_std);
  }
}

Transformer::~Transformer() = default;

Tensor Transformer::forward(const Tensor& ids) {
  XMOE_CHECK(ids.dim() == 2, "[transformer] ids must be [B, S], got {}", shape_str(ids.shape()));
  check_dtype(ids, DType::i32, "transformer", "ids");
  XMOE_CHECK(ids.device() == device_, "[transformer] ids are on {} but the model is on {}",
             ids.device().str(), device_.str());
  seq_ = ids.size(1);
  XMOE_CHECK(seq_ >= 1 && seq_ <= cfg_.max_seq_len,
             "[transformer] sequence length {} outside [1, model.max_seq_len = {}]", seq_,
             cfg_.max_seq_len);
  const Tensor mine = my_sequences(ids, "ids");
  batch_ = mine.size(0);
  logits_ = targets_ = Tensor();
  ProfileScope scope("model.fwd", device_);
  TransformerBlock::Stream x{embed_->forward(mine), Tensor()};  // [T, d]
  for (auto& b : blocks_) x = b->forward(x, batch_, seq_);
  // The residual stream is f32; the final norm adds the last FFN's output in its pass and
  // writes the LM head's input in compute dtype.
  xf_ = x.branch.defined() ? final_norm_->forward_add(x.sum, x.branch, compute_).y
                           : final_norm_->forward(x.sum, compute_);
  x = {};
  ProfileScope head("lm_head.fwd", device_);
  // logits [T, V] = xf [T, d] @ lm_head [d, V]   (tied: @ embed^T, embed [V, d])
  return lm_head_ ? ops::matmul(xf_, lm_head_->compute())
                  : ops::matmul(xf_, embed_->weight().compute(), false, true);
}

float Transformer::forward_loss(const Tensor& ids, const Tensor& targets) {
  Tensor logits = forward(ids);
  XMOE_CHECK(targets.numel() == ids.numel(), "[transformer] targets {} do not match ids {}",
             shape_str(targets.shape()), shape_str(ids.shape()));
  const Tensor mine = my_sequences(targets.reshape(ids.shape()), "targets");
  targets_ = mine.reshape({mine.numel()});
  ProfileScope scope("cross_entropy.fwd", device_);
  ce_ = ops::cross_entropy(logits, targets_);
  logits_ = logits;
  return ce_.loss;
}

Tensor Transformer::my_sequences(const Tensor& t, const char* what) const {
  if (tp_ == 1) return t;
  const int64_t b = t.size(0);
  XMOE_CHECK(b % tp_ == 0,
             "[transformer] {} hold {} sequences, which do not split over parallel.tp = {} "
             "(train.batch_size must be a multiple of parallel.tp)",
             what, b, tp_);
  return t.rows(tp_rank_ * (b / tp_), (tp_rank_ + 1) * (b / tp_));
}

float Transformer::loss(const Tensor& logits, const Tensor& targets) {
  return ops::cross_entropy(logits, targets.reshape({targets.numel()})).loss;
}

float Transformer::evaluate_loss(const Tensor& ids, const Tensor& targets) {
  const float l = forward_loss(ids, targets);
  release();
  return l;
}

void Transformer::release() {
  embed_->release();
  for (auto& b : blocks_) b->release();
  final_norm_->release();
  xf_ = logits_ = targets_ = Tensor();
  ce_ = {};
}

void Transformer::backward(float dloss) {
  XMOE_CHECK(logits_.defined(), "[transformer] backward() without a forward_loss()");
  // The logits are not needed again: their buffer becomes dlogits.
  Tensor dlogits = logits_;
  logits_ = Tensor();
  {
    ProfileScope scope("cross_entropy.bwd", device_);
    ops::cross_entropy_backward_(dlogits, targets_, ce_, dloss);
  }
  targets_ = Tensor();
  ce_ = {};
  // The aux losses are part of the objective with the same scale as the cross-entropy.
  for (moe::MoELayer* layer : moe_layers()) layer->set_aux_grad_scale(dloss * moe_aux_scale_);
  backward_logits(dlogits);
  for (moe::MoELayer* layer : moe_layers()) layer->set_aux_grad_scale(1.0f);
}

template <class F>
void Transformer::backward_of(const std::vector<Parameter*>& params, F&& backward) {
  materialize_grads(params);
  backward();
  if (grads_ready_) grads_ready_(params);
}

void Transformer::backward_logits(const Tensor& dlogits) {
  XMOE_CHECK(xf_.defined(), "[transformer] backward without a forward");
  check_shape(dlogits, {batch_ * seq_, cfg_.vocab_size}, "transformer_backward", "dlogits");
  ProfileScope scope("model.bwd", device_);
  Tensor dx;
  if (lm_head_) {
    backward_of({lm_head_.get()}, [&] {
      ProfileScope head("lm_head.bwd", device_);
      ops::matmul_into(lm_head_->grad, xf_, dlogits, /*trans_a=*/true, false, 1.f, 1.f);
      dx = ops::matmul_f32(dlogits, lm_head_->compute(), false, /*trans_b=*/true);
    });
  } else {
    // The tied table's gradient is finished by the embedding's backward, last.
    ProfileScope head("lm_head.bwd", device_);
    Parameter& e = embed_->weight();
    e.materialize_grad();
    ops::matmul_into(e.grad, dlogits, xf_, /*trans_a=*/true, false, 1.f, 1.f);
    dx = ops::matmul_f32(dlogits, e.compute());
  }
  xf_ = Tensor();
  backward_of(final_norm_->parameters(),
              [&] { dx = final_norm_->backward(as_dtype(dx, DType::f32)); });
  // Each block hands the block below its dx and dx's compute-dtype copy (made in its last norm's
  // pass); the first block's dx goes to the embedding, in f32 only.
  Tensor dx_compute;
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it)
    backward_of((*it)->parameters(), [&] {
      Tensor below;
      dx = (*it)->backward(dx, std::move(dx_compute),
                           std::next(it) == blocks_.rend() ? nullptr : &below);
      dx_compute = std::move(below);
    });
  backward_of(embed_->parameters(), [&] { embed_->backward(dx); });
}

std::vector<Transformer::BackwardModule> Transformer::backward_modules() {
  std::vector<BackwardModule> out;
  if (lm_head_) out.push_back({"lm_head", {lm_head_.get()}});
  out.push_back({"final_norm", final_norm_->parameters()});
  for (size_t i = blocks_.size(); i-- > 0;)
    out.push_back({"block " + std::to_string(i), blocks_[i]->parameters()});
  out.push_back({"embedding", embed_->parameters()});
  return out;
}

float Transformer::aux_loss() const {
  float s = 0.f;
  for (const auto& b : blocks_) s += b->ffn().aux_loss();
  return s;
}

std::vector<moe::MoELayer*> Transformer::moe_layers() {
  std::vector<moe::MoELayer*> out;
  for (auto& b : blocks_)
    if (moe::MoELayer* m = b->ffn().moe_layer()) out.push_back(m);
  return out;
}

void Transformer::set_recompute(const RecomputeOptions& r) {
  for (auto& b : blocks_) b->set_recompute(r);
}

int64_t Transformer::saved_bytes() const {
  int64_t s = embed_->saved_bytes() + final_norm_->saved_bytes() + held_bytes(xf_) +
              held_bytes(logits_) + held_bytes(targets_) + held_bytes(ce_.lse);
  for (const auto& b : blocks_) s += b->saved_bytes();
  return s;
}

ActivationBytes Transformer::ends_activation_bytes_for(const ModelConfig& cfg, int64_t batch,
                                                       int64_t seq_len, DType dtype, int tp) {
  // The model keeps views of this rank's sequences of the batch, which hold all of it.
  const int64_t batch_ids = 2 * batch * seq_len * 4;
  const int64_t t = batch * seq_len / tp, c = static_cast<int64_t>(dtype_size(dtype));
  const ActivationBytes norm = RMSNorm::activation_bytes_for(t, cfg.d_model);
  const int64_t logits = t * cfg.vocab_size * c;
  const int64_t xf = t * cfg.d_model * c, lse = t * 4, dx = t * cfg.d_model * 4;
  // the LM head's dx, then (xf gone) the final norm's beside it
  return {batch_ids + norm.saved + xf + logits + lse, std::max(dx, dx + norm.backward_extra - xf),
          batch_ids + logits};
}

void Transformer::collect_parameters(std::vector<Parameter*>& out) {
  embed_->collect_parameters(out);
  for (auto& b : blocks_) b->collect_parameters(out);
  final_norm_->collect_parameters(out);
  if (lm_head_) out.push_back(lm_head_.get());
}

void Transformer::to(Device device) {
  XMOE_CHECK(compute_ == DType::f32 || device.is_cuda(),
             "[transformer] cannot move a bf16-compute model to {}: the CPU computes in f32",
             device.str());
  if (device == device_) return;
  XMOE_CHECK(!offloaded_,
             "[transformer] cannot move a model whose master weights are offloaded to the host "
             "(train.offload_optimizer) to {}",
             device.str());
  release();
  for (Parameter* p : parameters()) p->to(device);
  *rope_ = ops::rope_tables(rope_->max_seq_len, rope_->head_dim, rope_->theta, device);
  device_ = device;
}

namespace {
/// Parameters that feed a matmul: every matrix, but not the embedding table, which is only
/// looked up (into the f32 residual stream) unless it is tied to the LM head.
bool needs_compute_copy(const Parameter& p, const Parameter& embed, bool tied) {
  return p.value.dim() >= 2 && (&p != &embed || tied);
}

/// p's compute copy for compute dtype `dtype`: a bf16 cast of value (on its device) where a
/// matmul reads one, else none.
Tensor compute_copy_of(const Parameter& p, DType dtype, const Parameter& embed, bool tied) {
  return dtype == DType::bf16 && needs_compute_copy(p, embed, tied)
             ? ops::cast(p.value, DType::bf16)
             : Tensor();
}
}  // namespace

void Transformer::set_compute_dtype(DType dtype) {
  XMOE_CHECK(dtype == DType::f32 || dtype == DType::bf16,
             "[transformer] compute dtype {} is not f32 or bf16", dtype_name(dtype));
  XMOE_CHECK(dtype == DType::f32 || device_.is_cuda(),
             "[transformer] compute dtype bf16 needs the model on a CUDA device (it is on {}); "
             "call to(cuda) first",
             device_.str());
  XMOE_CHECK(!offloaded_,
             "[transformer] set the compute dtype before offloading the master weights "
             "(train.offload_optimizer)");
  release();
  compute_ = dtype;
  for (auto& b : blocks_) b->set_compute_dtype(dtype);
  const Parameter& embed = embed_->weight();
  for (Parameter* p : parameters()) {
    XMOE_CHECK(!p->master_sharded,
               "[transformer] {}: set the compute dtype before sharding the master weights "
               "(parallel.zero)",
               p->name);
    p->compute_copy = compute_copy_of(*p, dtype, embed, !lm_head_);
  }
}

void Transformer::offload_master_weights() {
  if (device_.is_cpu() || offloaded_) return;
  for (Parameter* p : parameters()) p->offload_master();
  offloaded_ = true;
}

void Transformer::place(Device device, DType dtype, bool offload_master) {
  if (!offload_master || device.is_cpu()) {  // nothing to offload on the CPU
    to(device);
    set_compute_dtype(dtype);
    return;
  }
  XMOE_CHECK(dtype == DType::f32 || dtype == DType::bf16,
             "[transformer] compute dtype {} is not f32 or bf16", dtype_name(dtype));
  XMOE_CHECK(device_.is_cpu() && !offloaded_,
             "[transformer] place() with offloaded master weights moves a model from the host "
             "(it is on {}{})",
             device_.str(), offloaded_ ? ", offloaded" : "");
  release();
  compute_ = dtype;
  for (auto& b : blocks_) b->set_compute_dtype(dtype);
  const Parameter& embed = embed_->weight();
  for (Parameter* p : parameters()) {
    p->to(device);
    p->compute_copy = compute_copy_of(*p, dtype, embed, !lm_head_);  // as set_compute_dtype
    p->offload_master();  // frees the device's f32 master unless forward reads it
  }
  *rope_ = ops::rope_tables(rope_->max_seq_len, rope_->head_dim, rope_->theta, device);
  device_ = device;
  offloaded_ = true;
}

void Transformer::refresh_compute_weights() {
  for (Parameter* p : parameters()) {
    if (p->device_f32.defined()) p->device_f32.copy_from(p->value);
    // Sharded masters (parallel.zero): value is the copy, which whoever wrote it made current.
    if (!p->compute_copy.defined() || p->master_sharded) continue;
    // Cast on the device, as without offload: the same bf16 bits.
    const Tensor& f32 =
        p->offloaded() && !p->device_f32.defined() ? p->value.to(device_) : p->weights_f32();
    p->compute_copy = ops::cast(f32, p->compute_copy.dtype());
  }
}

int64_t Transformer::num_parameters() {
  int64_t n = 0;
  for (Parameter* p : parameters()) n += p->value.numel();
  return n;
}

}  // namespace xmoe::model
