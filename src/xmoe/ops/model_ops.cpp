#include "xmoe/ops/model_ops.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "xmoe/backend/cpu/model_kernels.h"
#include "xmoe/core/device_api.h"
#include "xmoe/ops/dispatch.h"

namespace xmoe::ops {

using detail::require_2d;
using detail::require_float;
using detail::require_like;
using detail::require_like_or_f32;
using detail::require_on;
using detail::stream_of;

namespace {
/// i32 ids on ref's device, every value in [0, limit) (or negative, with allow_negative). On
/// CUDA the scan runs on the device and waits for it: embedding and cross-entropy run once per
/// step, where one wait is cheap and a bad token id deserves a clear error.
void check_ids(const char* op, const char* name, const Tensor& ids, int64_t limit,
               bool allow_negative, const Tensor& ref, const char* ref_name) {
  require_on(op, name, ids, DType::i32, ref_name, ref);
  detail::check_index_values(op, name, ids, limit, allow_negative);
}
}  // namespace

// ---- embedding ------------------------------------------------------------------------------

Tensor embedding(const Tensor& table, const Tensor& ids) {
  require_float("embedding", "table", table);
  require_2d("embedding", "table", table);
  check_ids("embedding", "ids", ids, table.size(0), false, table, "table");
  Tensor out = Tensor::empty({ids.numel(), table.size(1)}, table.dtype(), table.device());
  if (table.is_cpu()) {
    cpu::embedding_forward(out.data<float>(), table.data<float>(), ids.data<int32_t>(), ids.numel(),
                           table.size(1));
  } else {
    cuda::gather_rows(out.raw(), table.raw(), table.dtype(), ids.data<int32_t>(), ids.numel(),
                      table.size(0), table.size(1), stream_of(table));
  }
  return out;
}

void embedding_backward(Tensor& dtable, const Tensor& ids, const Tensor& dout) {
  const char* op = "embedding_backward";
  require_float(op, "dout", dout);
  require_like_or_f32(op, "dtable", dtable, "dout", dout);
  require_2d(op, "dtable", dtable);
  check_ids(op, "ids", ids, dtable.size(0), false, dtable, "dtable");
  check_shape(dout, {ids.numel(), dtable.size(1)}, op, "dout");
  if (dtable.is_cpu()) {
    cpu::embedding_backward(dtable.data<float>(), dout.data<float>(), ids.data<int32_t>(),
                            ids.numel(), dtable.size(1));
  } else {
    // Deterministic scatter: rows added per token id in increasing position, as on the CPU.
    const cuda::Stream s = stream_of(dtable);
    const size_t bytes = cuda::scatter_add_rows_workspace_bytes(ids.numel(), dtable.size(0));
    Tensor ws = Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, dtable.device());
    cuda::scatter_add_rows(dtable.raw(), dtable.dtype(), dout.raw(), dout.dtype(),
                           ids.data<int32_t>(), nullptr, DType::f32, ids.numel(), dtable.size(0),
                           dtable.size(1), ws.raw(), bytes, s);
  }
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

RopeTables rope_tables(int64_t max_seq_len, int64_t head_dim, float theta, Device device) {
  RopeTables t = rope_tables(max_seq_len, head_dim, theta);
  if (!device.is_cpu()) {
    t.cos = t.cos.to(device);
    t.sin = t.sin.to(device);
  }
  return t;
}

namespace {
void rope_impl(const char* op, Tensor& x, const RopeTables& t, bool inverse) {
  require_float(op, "x", x);
  XMOE_CHECK(x.dim() == 4, "[{}] x must be [B, S, H, hd], got {}", op, shape_str(x.shape()));
  XMOE_CHECK(t.cos.defined() && x.size(3) == t.head_dim,
             "[{}] x has head_dim {} but the tables were built for {}", op, x.size(3), t.head_dim);
  XMOE_CHECK(x.size(1) <= t.max_seq_len, "[{}] sequence length {} exceeds max_seq_len {}", op,
             x.size(1), t.max_seq_len);
  XMOE_CHECK(t.cos.device() == x.device() && t.sin.device() == x.device(),
             "[{}] x is on {} but the tables are on {}: build them with rope_tables(..., device)",
             op, x.device().str(), t.cos.device().str());
  if (x.is_cpu()) {
    cpu::rope_apply(x.data<float>(), t.cos.data<float>(), t.sin.data<float>(), x.size(0), x.size(1),
                    x.size(2), x.size(3), inverse);
  } else {
    cuda::rope_apply(x.raw(), x.dtype(), t.cos.data<float>(), t.sin.data<float>(), x.size(0),
                     x.size(1), x.size(2), x.size(3), inverse, stream_of(x));
  }
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
  require_float(op, "q", q);
  require_like(op, "k", k, "q", q);
  require_like(op, "v", v, "q", q);
  XMOE_CHECK(q.dim() == 4, "[{}] q must be [B, S, H, hd], got {}", op, shape_str(q.shape()));
  XMOE_CHECK(k.dim() == 4, "[{}] k must be [B, S, Hkv, hd], got {}", op, shape_str(k.shape()));
  const AttnDims d{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  check_shape(k, {d.b, d.s, -1, d.hd}, op, "k");
  check_shape(v, k.shape(), op, "v");
  XMOE_CHECK(d.hkv > 0 && d.h % d.hkv == 0, "[{}] query heads {} must be a multiple of kv heads {}",
             op, d.h, d.hkv);
  XMOE_CHECK(d.hd > 0, "[{}] head_dim must be positive", op);
  XMOE_CHECK(q.is_cpu() || d.hd <= cuda::kAttentionMaxHeadDim,
             "[{}] head_dim {} exceeds {}, the largest the CUDA kernels take", op, d.hd,
             cuda::kAttentionMaxHeadDim);
  return d;
}
}  // namespace

AttentionResult attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  const AttnDims d = attention_dims("attention", q, k, v);
  AttentionResult r{Tensor::empty(q.shape(), q.dtype(), q.device()),
                    Tensor::empty({d.b, d.h, d.s}, DType::f32, q.device())};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
  if (q.is_cpu()) {
    cpu::attention_forward(r.out.data<float>(), r.lse.data<float>(), q.data<float>(),
                           k.data<float>(), v.data<float>(), d.b, d.s, d.h, d.hkv, d.hd, scale,
                           causal);
  } else {
    const size_t bytes =
        cuda::attention_forward_workspace_bytes(q.dtype(), d.b, d.s, d.h, d.hkv, d.hd, causal);
    Tensor ws =
        bytes > 0 ? Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, q.device()) : Tensor();
    cuda::attention_forward(r.out.raw(), r.lse.data<float>(), q.raw(), k.raw(), v.raw(), q.dtype(),
                            d.b, d.s, d.h, d.hkv, d.hd, scale, causal,
                            bytes > 0 ? ws.raw() : nullptr, stream_of(q));
  }
  return r;
}

int64_t attention_backward_workspace_bytes(DType dtype, int64_t batch, int64_t seq, int64_t heads,
                                           int64_t kv_heads, int64_t head_dim, Device device,
                                           bool causal) {
  if (device.is_cpu()) return 0;
  return static_cast<int64_t>(cuda::attention_backward_workspace_bytes(dtype, batch, seq, heads,
                                                                       kv_heads, head_dim, causal));
}

AttentionGrads attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, const Tensor& dout,
                                  bool causal) {
  const char* op = "attention_backward";
  const AttnDims d = attention_dims(op, q, k, v);
  require_like(op, "out", out, "q", q);
  require_on(op, "lse", lse, DType::f32, "q", q);
  require_like(op, "dout", dout, "q", q);
  check_shape(out, q.shape(), op, "out");
  check_shape(dout, q.shape(), op, "dout");
  check_shape(lse, {d.b, d.h, d.s}, op, "lse");
  AttentionGrads g{Tensor::empty(q.shape(), q.dtype(), q.device()),
                   Tensor::empty(k.shape(), k.dtype(), k.device()),
                   Tensor::empty(v.shape(), v.dtype(), v.device())};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
  if (q.is_cpu()) {
    cpu::attention_backward(g.dq.data<float>(), g.dk.data<float>(), g.dv.data<float>(),
                            q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                            lse.data<float>(), dout.data<float>(), d.b, d.s, d.h, d.hkv, d.hd,
                            scale, causal);
  } else {
    const cuda::Stream s = stream_of(q);
    const size_t bytes =
        cuda::attention_backward_workspace_bytes(q.dtype(), d.b, d.s, d.h, d.hkv, d.hd, causal);
    Tensor ws = Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, q.device());
    cuda::attention_backward(g.dq.raw(), g.dk.raw(), g.dv.raw(), q.raw(), k.raw(), v.raw(),
                             out.raw(), lse.data<float>(), dout.raw(), q.dtype(), d.b, d.s, d.h,
                             d.hkv, d.hd, scale, causal, ws.raw(), s);
  }
  return g;
}

// ---- cross-entropy --------------------------------------------------------------------------

CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& targets,
                                 bool ignore_negative) {
  const char* op = "cross_entropy";
  require_float(op, "logits", logits);
  require_2d(op, "logits", logits);
  check_shape(targets, {logits.size(0)}, op, "targets");
  const int64_t n = logits.size(0), v = logits.size(1);
  CrossEntropyResult r;
  r.lse = Tensor::empty({n}, DType::f32, logits.device());
  Tensor rows = Tensor::empty({n}, DType::f32, logits.device());
  if (!logits.is_cpu()) {
    // The loss must reach the host, so this op waits for the device once: the target check and
    // the loss sum (one block, fixed order, double) come back in one copy.
    require_on(op, "targets", targets, DType::i32, "logits", logits);
    const cuda::Stream s = stream_of(logits);
    cuda::cross_entropy_forward(rows.data<float>(), r.lse.data<float>(), logits.raw(),
                                logits.dtype(), targets.data<int32_t>(), n, v, s);
    Tensor result = Tensor::empty({3}, DType::i64, logits.device());  // [first bad, sum, count]
    auto* p = static_cast<char*>(result.raw());
    cuda::find_bad_index(reinterpret_cast<int64_t*>(p), targets.data<int32_t>(), n, v,
                         ignore_negative, s);
    cuda::cross_entropy_reduce(reinterpret_cast<double*>(p + 8), rows.data<float>(),
                               targets.data<int32_t>(), n, s);
    const std::vector<int64_t> host = result.to_vector<int64_t>();
    double sum = 0, count = 0;
    std::memcpy(&sum, &host[1], sizeof sum);
    std::memcpy(&count, &host[2], sizeof count);
    XMOE_CHECK(host[0] < 0, "[{}] {}[{}] = {} out of range [0, {})", op, "targets", host[0],
               static_cast<int64_t>(targets.item(host[0])), v);
    r.count = static_cast<int64_t>(count);
    r.loss = r.count ? static_cast<float>(sum / count) : 0.f;
    return r;
  }
  check_ids(op, "targets", targets, v, ignore_negative, logits, "logits");
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
  require_float(op, "logits", logits);
  require_2d(op, "logits", logits);
  require_on(op, "targets", targets, DType::i32, "logits", logits);
  check_shape(targets, {logits.size(0)}, op, "targets");
  require_on(op, "lse", fwd.lse, DType::f32, "logits", logits);
  check_shape(fwd.lse, {logits.size(0)}, op, "lse");
}

void ce_backward(Tensor& d, const Tensor& logits, const Tensor& targets,
                 const CrossEntropyResult& fwd, float dloss) {
  const float scale = fwd.count ? dloss / static_cast<float>(fwd.count) : 0.f;
  if (logits.is_cpu()) {
    cpu::cross_entropy_backward(d.data<float>(), logits.data<float>(), fwd.lse.data<float>(),
                                targets.data<int32_t>(), logits.size(0), logits.size(1), scale);
  } else {
    cuda::cross_entropy_backward(d.raw(), logits.raw(), logits.dtype(), fwd.lse.data<float>(),
                                 targets.data<int32_t>(), logits.size(0), logits.size(1), scale,
                                 stream_of(logits));
  }
}
}  // namespace

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets,
                              const CrossEntropyResult& fwd, float dloss) {
  check_ce_backward("cross_entropy_backward", logits, targets, fwd);
  Tensor d = Tensor::empty(logits.shape(), logits.dtype(), logits.device());
  ce_backward(d, logits, targets, fwd, dloss);
  return d;
}

void cross_entropy_backward_(Tensor& logits, const Tensor& targets, const CrossEntropyResult& fwd,
                             float dloss) {
  check_ce_backward("cross_entropy_backward_", logits, targets, fwd);
  ce_backward(logits, logits, targets, fwd, dloss);
}

}  // namespace xmoe::ops
