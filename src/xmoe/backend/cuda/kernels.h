#pragma once
// CUDA launchers: plain functions on raw device pointers and a stream (llm.c style). Each one
// launches `<op>_kernel` on `stream` and checks the launch; none synchronises with the host.
// Float operands are f32 or bf16 (`dt`), math and accumulation are f32; statistics (rstd, lse,
// loss rows) are f32; indices are i32. Row-major shapes are given in the comments.
// Plain header: the C++ compiler (ops/) and nvcc (backend/cuda/*.cu) both include it; a build
// without CUDA links backend/cuda_stub/kernels_stub.cpp, whose functions throw.
#include <cstddef>
#include <cstdint>

#include "xmoe/backend/cuda/runtime.h"
#include "xmoe/core/dtype.h"

namespace xmoe::cuda {

// ---- cuBLAS (blas.cpp) ----------------------------------------------------------------------

// c (M, N) of c_dt = alpha * op(a) @ op(b) + beta * c; a, b of ab_dt; a is (M, K) or (K, M)
// with trans_a, b is (K, N) or (N, K) with trans_b. c_dt is ab_dt, or f32 (f32 accumulation of
// bf16 products). f32 math (CUBLAS_COMPUTE_32F, no TF32).
void gemm(void* c, DType c_dt, const void* a, const void* b, DType ab_dt, int64_t m, int64_t n,
          int64_t k, bool trans_a, bool trans_b, float alpha, float beta, Stream stream);
// y[o_g : o_g + n_g] (n_g, M) = x[o_g : o_g + n_g] (n_g, K) @ w[g] ((K, M), or (M, K) when
// trans_w); group_sizes is a host array of `groups` entries.
void grouped_gemm(void* y, const void* x, const void* w, DType dt, const int64_t* group_sizes,
                  int64_t groups, int64_t k, int64_t m, bool trans_w, Stream stream);
// dw[g] (K, M) of dw_dt = x_g^T @ dy_g (+ dw[g] when accumulate); empty groups get 0 (or keep
// dw[g] when accumulate). dw_dt is dt or f32.
void grouped_gemm_weight_grad(void* dw, DType dw_dt, const void* x, const void* dy, DType dt,
                              const int64_t* group_sizes, int64_t groups, int64_t k, int64_t m,
                              bool accumulate, Stream stream);

// ---- FP8 E4M3 (fp8.cu, blas.cpp; docs/fp8.md) -----------------------------------------------
// As cpu::quantize_rows_fp8 etc. (the same layouts, bytes and scales), for f32 or bf16 inputs
// and outputs; group_sizes is a host array of at most kMaxFp8Groups entries.
constexpr int kMaxFp8Groups = 1024;
void quantize_rows_fp8(uint8_t* q, float* scales, const void* x, DType dt,
                       const int64_t* group_sizes, int64_t groups, int64_t k, Stream stream);
// quantize_rows_fp8 of swiglu(h) (h [rows, 2f], the a [rows, f] that swiglu_forward would
// write, in dt) in one pass: the same bytes and scales, no a in memory.
void swiglu_quantize_rows_fp8(uint8_t* q, float* scales, const void* h, DType dt,
                              const int64_t* group_sizes, int64_t groups, int64_t f, Stream stream);
// swiglu_backward(h, h, da, value = da) (h [rows, 2f] becomes dh, da [rows, f] swiglu(h)), then
// quantize_rows_fp8 of that dh: one pass where f % 128 == 0 (dh is not read back), else the two.
void swiglu_backward_quantize_fp8(void* h, void* da, DType dt, uint8_t* q, float* scales,
                                  const int64_t* group_sizes, int64_t groups, int64_t f,
                                  Stream stream);
// quantize_rows_fp8 of rows index[r] of x [x_rows, k] (as gather_rows: an index out of range is
// a row of zeros) in one pass: the same bytes and scales, no gathered copy in memory.
void gather_quantize_rows_fp8(uint8_t* q, float* scales, const void* x, DType dt,
                              const int32_t* index, int64_t x_rows, const int64_t* group_sizes,
                              int64_t groups, int64_t k, Stream stream);
void dequantize_rows_fp8(void* x, DType dt, const uint8_t* q, const float* scales,
                         const int64_t* group_sizes, int64_t groups, int64_t k, Stream stream);
void quantize_weights_fp8(uint8_t* q, uint8_t* q_t, float* scales, float* scales_t, const void* w,
                          DType dt, int64_t groups, int64_t k, int64_t m, Stream stream);
void dequantize_weights_fp8(void* w, DType dt, const uint8_t* q, const float* scales,
                            int64_t groups, int64_t k, int64_t m, Stream stream);
// y[o_g : o_g + n_g] (n_g, N) bf16 = x_g (n_g, K) @ w_g^T on the sm90 FP8 kernel: x e4m3 rows
// with their grouped 1 x 128 scales, w [G, N, K] e4m3 with [G, ceil(K/128), ceil(N/128)] scales.
// Returns false, having queued nothing, where the kernel does not apply (no sm90 device or
// CUTLASS, N or K not a multiple of 16, unaligned bases): the caller then dequantises.
bool grouped_gemm_fp8(void* y, const uint8_t* x, const float* x_scales, const uint8_t* w,
                      const float* w_scales, const int64_t* group_sizes, int64_t groups, int64_t k,
                      int64_t n, Stream stream);

// Which path the grouped GEMMs took, per kind, since the process started (tests check that the
// sm90 kernels run where they apply rather than a silent cuBLAS fallback).
enum class GroupedGemmKind : uint8_t { forward, forward_trans_w, weight_grad, fp8 };
struct GroupedGemmCalls {
  int64_t sm90 = 0, cublas = 0;
};
GroupedGemmCalls grouped_gemm_calls(GroupedGemmKind kind);
// True when `device` can run this build's sm90 grouped GEMMs (CUTLASS built in, CC 9.0).
bool grouped_gemm_sm90_available(int device);

// ---- elementwise (elementwise.cu) -----------------------------------------------------------

// dst = src converted (f32 <-> bf16, round to nearest even; same dtype copies)
void cast(void* dst, DType dst_dt, const void* src, DType src_dt, int64_t n, Stream stream);
// c = a + b; c of a_dt, b of either float dtype
void add(void* c, const void* a, DType a_dt, const void* b, DType b_dt, int64_t n, Stream stream);
// x (rows, cols) f32 as exact bf16 terms, column block j of out (rows, cols * n) = term
// terms[j] (cpu::split_bf16_columns); n <= 6.
void split_bf16_columns(void* out, const float* x, int64_t rows, int64_t cols, const int* terms,
                        int n, Stream stream);
// out (rows, cols) f32 (=, or += with accumulate) the n column blocks of y, in order.
void sum_column_blocks(float* out, const float* y, int64_t rows, int64_t cols, int64_t n,
                       bool accumulate, Stream stream);
// a += alpha * b (a and b may differ in dtype)
void add_inplace(void* a, DType a_dt, const void* b, DType b_dt, float alpha, int64_t n,
                 Stream stream);
void mul(void* c, const void* a, const void* b, DType dt, int64_t n, Stream stream);  // c = a * b
void scale_inplace(void* a, DType dt, float s, int64_t n, Stream stream);             // a *= s
void sigmoid_forward(void* y, const void* x, DType dt, int64_t n, Stream stream);
// dx = dy * y * (1 - y)
void sigmoid_backward(void* dx, const void* y, const void* dy, DType dt, int64_t n, Stream stream);
// h (rows, 2f) = [gate | up] -> a (rows, f) = silu(gate) * up
void swiglu_forward(void* a, const void* h, DType dt, int64_t rows, int64_t f, Stream stream);
// value, where not null: swiglu(h) written too (it may be da: each element is read first).
void swiglu_backward(void* dh, const void* h, const void* da, DType dt, int64_t rows, int64_t f,
                     Stream stream, void* value = nullptr);

// ---- reductions (reduce.cu) -----------------------------------------------------------------

enum class Reduction : uint8_t { sum, sum_squares, count_nonfinite };
// Bytes of device workspace `reduce` needs for n elements.
size_t reduce_workspace_bytes(int64_t n);
// *result (one device double) = reduction of x (n); deterministic: per-block partials in double,
// then one block sums them in a fixed order.
void reduce(double* result, const void* x, DType dt, int64_t n, Reduction kind, void* workspace,
            Stream stream);
// out (rows) = sum_j a (rows, d) * b (rows, d)
void row_dot(void* out, const void* a, const void* b, DType dt, int64_t rows, int64_t d,
             Stream stream);

// ---- softmax (softmax.cu) -------------------------------------------------------------------

// over the last dimension of (rows, cols)
void softmax_forward(void* y, const void* x, DType dt, int64_t rows, int64_t cols, Stream stream);
// dx = y * (dy - sum(dy * y))
void softmax_backward(void* dx, const void* y, const void* dy, DType dt, int64_t rows, int64_t cols,
                      Stream stream);

// ---- RMSNorm (norm.cu) ----------------------------------------------------------------------

// y (rows, d) of y_dt = x * rstd * w; rstd (rows) f32; w (d) of w_dt (x's dtype or f32). With
// a (rows, d) of a_dt, the norm is of x + a, written to sum (rows, d) of x_dt first.
struct RmsNormArgs {
  void* y = nullptr;
  DType y_dt = DType::f32;
  void* sum = nullptr;
  float* rstd = nullptr;
  const void* x = nullptr;
  DType x_dt = DType::f32;
  const void* a = nullptr;
  DType a_dt = DType::f32;
  const void* w = nullptr;
  DType w_dt = DType::f32;
  int64_t rows = 0, d = 0;
  float eps = 0.f;
};
void rmsnorm_forward(const RmsNormArgs& args, Stream stream);
size_t rmsnorm_backward_workspace_bytes(int64_t rows, int64_t d);
// dx (rows, d) of x_dt, from dy of dy_dt, plus residual (of x_dt) when given; dx_copy (bf16)
// when given gets the same values; dw (d) of w_dt += sum over rows of dy * x * rstd,
// deterministically (fixed per-block partials, then a fixed-order reduction).
struct RmsNormGradArgs {
  void* dx = nullptr;
  void* dx_copy = nullptr;
  void* dw = nullptr;
  const void* x = nullptr;
  DType x_dt = DType::f32;
  const void* w = nullptr;
  DType w_dt = DType::f32;
  const float* rstd = nullptr;
  const void* dy = nullptr;
  DType dy_dt = DType::f32;
  const void* residual = nullptr;
  int64_t rows = 0, d = 0;
};
void rmsnorm_backward(const RmsNormGradArgs& args, void* workspace, Stream stream);

// ---- selection and indexing (topk.cu, index.cu) ---------------------------------------------

// values (rows, k) of dt, descending; indices (rows, k) i32; ties go to the lower index.
void topk(void* values, int32_t* indices, const void* x, DType dt, int64_t rows, int64_t cols,
          int64_t k, Stream stream);
// probs = softmax(x) over the last dimension, then topk of probs: one pass over rows of up to 512
// columns (the bits of softmax_forward then topk), the two passes above that.
void softmax_topk(void* probs, void* values, int32_t* indices, const void* x, DType dt,
                  int64_t rows, int64_t cols, int64_t k, Stream stream);
// dst (groups, cap, d): group g's rows src[offsets[g] .. offsets[g + 1]) (at most cap of them)
// first, zero rows after; offsets (groups + 1) int64 on the device.
void pad_groups(void* dst, const void* src, DType dt, const int64_t* offsets, int64_t groups,
                int64_t cap, int64_t d, Stream stream);
// out (m, d) = x (n_rows, d)[index]; an index outside [0, n_rows) gives a zero row.
void gather_rows(void* out, const void* x, DType dt, const int32_t* index, int64_t m,
                 int64_t n_rows, int64_t d, Stream stream);
// out[t] (n_out, d) = sum over j < k of weight[r] * src[r] (n_src, d), r = slots[t * k + j]
// (i32 (n_out, k); rows outside [0, n_src) are skipped; weight (n_src) may be null = 1), added
// in f32 in increasing r: the bits of scatter_add_rows into zeros, without its sort. k <= 32.
// addend (n_out, d) of out_dt, where not null, is added to each f32 sum last, before the store.
void gather_sum_rows(void* out, DType out_dt, const void* src, DType src_dt, const int32_t* slots,
                     const void* weight, DType weight_dt, const void* addend, int64_t n_out,
                     int64_t k, int64_t n_src, int64_t d, Stream stream);
size_t scatter_add_rows_workspace_bytes(int64_t m, int64_t n_out);
// out[index[i]] (n_out, d) += weight[i] * src[i] (m, d); weight (m) may be null (= 1).
// Deterministic: the entries are sorted by destination row (stable radix sort on the device),
// then each output element adds its entries in increasing i, as the CPU does. Indices outside
// [0, n_out) are skipped.
void scatter_add_rows(void* out, DType out_dt, const void* src, DType src_dt, const int32_t* index,
                      const void* weight, DType weight_dt, int64_t m, int64_t n_out, int64_t d,
                      void* workspace, size_t workspace_bytes, Stream stream);
// *first_bad (one device int64) = smallest i with index[i] outside [0, limit) (negative values
// allowed when allow_negative), or -1.
void find_bad_index(int64_t* first_bad, const int32_t* index, int64_t n, int64_t limit,
                    bool allow_negative, Stream stream);

// ---- RoPE (rope.cu) -------------------------------------------------------------------------

// x (B, S, H, hd) rotated in place (rotate-half pairs); cos, sin (>= S, hd/2) f32.
void rope_apply(void* x, DType dt, const float* cos_table, const float* sin_table, int64_t batch,
                int64_t seq, int64_t heads, int64_t head_dim, bool inverse, Stream stream);

// ---- attention (attention.cu) ---------------------------------------------------------------

// Largest head_dim the attention kernels take.
constexpr int64_t kAttentionMaxHeadDim = 256;
// out (B, S, H, hd), lse (B, H, S) f32 (natural log); q (B, S, H, hd), k, v (B, S, Hkv, hd).
// bf16 runs on cuDNN's fused attention where it takes the shape (see below), everything else on
// xmoe's kernels: flash-style, the keys stream through shared memory in tiles with an online
// softmax; nothing of size S x S. `workspace` holds attention_forward_workspace_bytes.
size_t attention_forward_workspace_bytes(DType dt, int64_t batch, int64_t seq, int64_t heads,
                                         int64_t kv_heads, int64_t head_dim, bool causal);
void attention_forward(void* out, float* lse, const void* q, const void* k, const void* v, DType dt,
                       int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, float scale, bool causal, void* workspace, Stream stream);
size_t attention_backward_workspace_bytes(DType dt, int64_t batch, int64_t seq, int64_t heads,
                                          int64_t kv_heads, int64_t head_dim, bool causal);
// dq (B, S, H, hd), dk, dv (B, S, Hkv, hd) overwritten; probabilities recomputed from lse.
// Deterministic: xmoe's kernels sum every gradient element in one thread in a fixed order, and
// cuDNN runs its deterministic algorithm (unless XMOE_ATTENTION_DETERMINISTIC=0).
void attention_backward(void* dq, void* dk, void* dv, const void* q, const void* k, const void* v,
                        const void* out, const float* lse, const void* dout, DType dt,
                        int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, float scale, bool causal, void* workspace, Stream stream);

// Which implementation runs bf16 attention. XMOE_ATTENTION=cudnn (the default where the build
// has cuDNN) or native (xmoe's kernels) sets the starting value; tests switch it to compare.
enum class AttentionBackend : uint8_t { cudnn, native };
AttentionBackend attention_backend();
void set_attention_backend(AttentionBackend backend);
// The implementation attention_forward / attention_backward take for these arguments:
// "cudnn", "flash" (tensor-core kernels) or "cuda-core".
const char* attention_impl(DType dt, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, bool causal);

// cuDNN's fused attention (cudnn/attention.cpp; cudnn/unavailable.cpp declines everything in a
// build without cuDNN). One graph per shape, built on first use and cached. A shape cuDNN
// cannot run is declined (false, once, with a warning) and the caller uses its own kernels.
struct CudnnAttentionShape {
  int64_t batch, seq, heads, kv_heads, head_dim;
  float scale;
  bool causal;
};
bool cudnn_attention_available();  // built with cuDNN and a cuDNN library is loadable
bool cudnn_attention_forward_ready(const CudnnAttentionShape& shape, size_t* workspace_bytes);
bool cudnn_attention_backward_ready(const CudnnAttentionShape& shape, size_t* workspace_bytes);
void cudnn_attention_forward(const CudnnAttentionShape& shape, void* out, float* lse, const void* q,
                             const void* k, const void* v, void* workspace, Stream stream);
void cudnn_attention_backward(const CudnnAttentionShape& shape, void* dq, void* dk, void* dv,
                              const void* q, const void* k, const void* v, const void* out,
                              const float* lse, const void* dout, void* workspace, Stream stream);
// The tensor-core kernels (flash_attention.cu) behind the two above: bf16 with head_dim 64 or
// 128 and 16-byte aligned rows go there, everything else to the CUDA-core kernels.
bool flash_attention_supported(DType dt, int64_t head_dim);
void flash_attention_forward(void* out, float* lse, const void* q, const void* k, const void* v,
                             int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, float scale, bool causal, Stream stream);
void flash_attention_backward(void* dq, void* dk, void* dv, const void* q, const void* k,
                              const void* v, const void* out, const float* lse, const void* dout,
                              int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, float scale, bool causal, void* workspace,
                              Stream stream);

// ---- cross-entropy (cross_entropy.cu) -------------------------------------------------------

// Per row of logits (n, v): lse = log sum exp; loss = lse - logits[t] (0 where t < 0).
void cross_entropy_forward(float* loss, float* lse, const void* logits, DType dt,
                           const int32_t* targets, int64_t n, int64_t v, Stream stream);
// result[0] = sum of loss over rows with t >= 0 (double, fixed order), result[1] = their count.
void cross_entropy_reduce(double* result, const float* loss, const int32_t* targets, int64_t n,
                          Stream stream);
// dlogits = scale * (softmax - onehot(t)), 0 rows where t < 0; dlogits may alias logits.
void cross_entropy_backward(void* dlogits, const void* logits, DType dt, const float* lse,
                            const int32_t* targets, int64_t n, int64_t v, float scale,
                            Stream stream);

}  // namespace xmoe::cuda
