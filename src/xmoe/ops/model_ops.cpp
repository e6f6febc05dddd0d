#include "xmoe/ops/model_ops.h"

#include <cmath>

#include "xmoe/backend/cpu/model_kernels.h"
#include "xmoe/ops/dispatch.h"

namespace xmoe::ops {

using detail::require_2d;
using detail::require_cpu;
using detail::require_f32;

namespace {
void check_ids(const char* op, const char* name, const Tensor& ids, int64_t limit,
               bool allow_negative) {
  require_cpu(op, name, ids, DType::i32);
  const int32_t* p = ids.data<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    XMOE_CHECK((p[i] >= 0 || allow_negative) && p[i] < limit,
               "[{}] {}[{}] = {} out of range [0, {})", op, name, i, p[i], limit);
}
}  // namespace

// ---- embedding ------------------------------------------------------------------------------

Tensor embedding(const Tensor& table, const Tensor& ids) {
  require_f32("embedding", "table", table);
  require_2d("embedding", "table", table);
  check_ids("embedding", "ids", ids, table.size(0), false);
  Tensor out = Tensor::empty({ids.numel(), table.size(1)});
  cpu::embedding_forward(out.data<float>(), table.data<float>(), ids.data<int32_t>(), ids.numel(),
                         table.size(1));
  return out;
}

void embedding_backward(Tensor& dtable, const Tensor& ids, const Tensor& dout) {
  const char* op = "embedding_backward";
  require_f32(op, "dtable", dtable);
  require_2d(op, "dtable", dtable);
  require_f32(op, "dout", dout);
  check_ids(op, "ids", ids, dtable.size(0), false);
  check_shape(dout, {ids.numel(), dtable.size(1)}, op, "dout");
  cpu::embedding_backward(dtable.data<float>(), dout.data<float>(), ids.data<int32_t>(),
                          ids.numel(), dtable.size(1));
}

// ---- rotary position embedding --------------------------------------------------------------

RopeTables rope_tables(int64_t max_seq_len, int64_t head_dim, float theta) {
  XMOE_CHECK(max_seq_len > 0, "[rope] max_seq_len must be positive, got {}", max_seq_len);
  XMOE_CHECK(head_dim > 0 && head_dim % 2 == 0, "[rope] head_dim must be even, got {}", head_dim);
  XMOE_CHECK(theta > 0, "[rope] theta must be positive, got {}", theta);
  RopeTables t{Tensor::empty({max_seq_len, head_dim / 2}),
               Tensor::empty({max_seq_len, head_dim / 2}), max_seq_len, head_dim, theta};
  cpu::rope_tables(t.cos.data<float>(), t.sin.data<float>(), max_seq_len, head_dim, theta);
  return t;
}

namespace {
void rope_impl(const char* op, Tensor& x, const RopeTables& t, bool inverse) {
  require_f32(op, "x", x);
  XMOE_CHECK(x.dim() == 4, "[{}] x must be [B, S, H, hd], got {}", op, shape_str(x.shape()));
  XMOE_CHECK(t.cos.defined() && x.size(3) == t.head_dim,
             "[{}] x has head_dim {} but the tables were built for {}", op, x.size(3), t.head_dim);
  XMOE_CHECK(x.size(1) <= t.max_seq_len, "[{}] sequence length {} exceeds max_seq_len {}", op,
             x.size(1), t.max_seq_len);
  cpu::rope_apply(x.data<float>(), t.cos.data<float>(), t.sin.data<float>(), x.size(0), x.size(1),
                  x.size(2), x.size(3), inverse);
}
}  // namespace

void rope_(Tensor& x, const RopeTables& tables) {
  rope_impl("rope", x, tables, false);
}
void rope_backward_(Tensor& dy, const RopeTables& tables) {
  rope_impl("rope_backward", dy, tables, true);
}
Tensor rope(const Tensor& x, const RopeTables& tables) {
  Tensor y = x.clone();
  rope_(y, tables);
  return y;
}
Tensor rope_backward(const Tensor& dy, const RopeTables& tables) {
  Tensor dx = dy.clone();
  rope_backward_(dx, tables);
  return dx;
}

// ---- causal self-attention ------------------------------------------------------------------

namespace {
struct AttnDims {
  int64_t b, s, h, hkv, hd;
};
AttnDims attention_dims(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  require_f32(op, "q", q);
  require_f32(op, "k", k);
  require_f32(op, "v", v);
  XMOE_CHECK(q.dim() == 4, "[{}] q must be [B, S, H, hd], got {}", op, shape_str(q.shape()));
  XMOE_CHECK(k.dim() == 4, "[{}] k must be [B, S, Hkv, hd], got {}", op, shape_str(k.shape()));
  const AttnDims d{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  check_shape(k, {d.b, d.s, -1, d.hd}, op, "k");
  check_shape(v, k.shape(), op, "v");
  XMOE_CHECK(d.hkv > 0 && d.h % d.hkv == 0, "[{}] query heads {} must be a multiple of kv heads {}",
             op, d.h, d.hkv);
  XMOE_CHECK(d.hd > 0, "[{}] head_dim must be positive", op);
  return d;
}
}  // namespace

AttentionResult attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  const AttnDims d = attention_dims("attention", q, k, v);
  AttentionResult r{Tensor::empty(q.shape()), Tensor::empty({d.b, d.h, d.s})};
  cpu::attention_forward(r.out.data<float>(), r.lse.data<float>(), q.data<float>(), k.data<float>(),
                         v.data<float>(), d.b, d.s, d.h, d.hkv, d.hd,
                         1.0f / std::sqrt(static_cast<float>(d.hd)), causal);
  return r;
}

AttentionGrads attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, const Tensor& dout,
                                  bool causal) {
  const char* op = "attention_backward";
  const AttnDims d = attention_dims(op, q, k, v);
  require_f32(op, "out", out);
  require_f32(op, "lse", lse);
  require_f32(op, "dout", dout);
  check_shape(out, q.shape(), op, "out");
  check_shape(dout, q.shape(), op, "dout");
  check_shape(lse, {d.b, d.h, d.s}, op, "lse");
  AttentionGrads g{Tensor::empty(q.shape()), Tensor::empty(k.shape()), Tensor::empty(v.shape())};
  cpu::attention_backward(g.dq.data<float>(), g.dk.data<float>(), g.dv.data<float>(),
                          q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                          lse.data<float>(), dout.data<float>(), d.b, d.s, d.h, d.hkv, d.hd,
                          1.0f / std::sqrt(static_cast<float>(d.hd)), causal);
  return g;
}

// ---- cross-entropy --------------------------------------------------------------------------

CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& targets,
                                 bool ignore_negative) {
  const char* op = "cross_entropy";
  require_f32(op, "logits", logits);
  require_2d(op, "logits", logits);
  check_shape(targets, {logits.size(0)}, op, "targets");
  check_ids(op, "targets", targets, logits.size(1), ignore_negative);
  const int64_t n = logits.size(0), v = logits.size(1);
  CrossEntropyResult r;
  r.lse = Tensor::empty({n});
  Tensor rows = Tensor::empty({n});
  cpu::cross_entropy_forward(rows.data<float>(), r.lse.data<float>(), logits.data<float>(),
                             targets.data<int32_t>(), n, v);
  // Summed in row order, in double: the loss does not depend on the thread count.
  const float* pl = rows.data<float>();
  const int32_t* pt = targets.data<int32_t>();
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    if (pt[i] < 0) continue;
    total += pl[i];
    ++r.count;
  }
  r.loss = r.count ? static_cast<float>(total / static_cast<double>(r.count)) : 0.f;
  return r;
}

namespace {
void check_ce_backward(const char* op, const Tensor& logits, const Tensor& targets,
                       const CrossEntropyResult& fwd) {
  require_f32(op, "logits", logits);
  require_2d(op, "logits", logits);
  require_cpu(op, "targets", targets, DType::i32);
  check_shape(targets, {logits.size(0)}, op, "targets");
  require_f32(op, "lse", fwd.lse);
  check_shape(fwd.lse, {logits.size(0)}, op, "lse");
}
}  // namespace

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets,
                              const CrossEntropyResult& fwd, float dloss) {
  check_ce_backward("cross_entropy_backward", logits, targets, fwd);
  Tensor d = Tensor::empty(logits.shape());
  const float scale = fwd.count ? dloss / static_cast<float>(fwd.count) : 0.f;
  cpu::cross_entropy_backward(d.data<float>(), logits.data<float>(), fwd.lse.data<float>(),
                              targets.data<int32_t>(), logits.size(0), logits.size(1), scale);
  return d;
}

void cross_entropy_backward_(Tensor& logits, const Tensor& targets, const CrossEntropyResult& fwd,
                             float dloss) {
  check_ce_backward("cross_entropy_backward_", logits, targets, fwd);
  const float scale = fwd.count ? dloss / static_cast<float>(fwd.count) : 0.f;
  cpu::cross_entropy_backward(logits.data<float>(), logits.data<float>(), fwd.lse.data<float>(),
                              targets.data<int32_t>(), logits.size(0), logits.size(1), scale);
}

}  // namespace xmoe::ops
