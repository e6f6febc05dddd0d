#pragma once
// CPU kernels: plain functions on raw row-major f32 pointers. They are the reference that the
// CUDA kernels are checked against, and the multi-threaded CPU training path (OpenMP + OpenBLAS).
#include <cstdint>

namespace xmoe::cpu {

// C[M,N] = alpha * op(A) @ op(B) + beta * C   (OpenBLAS sgemm; lda/ldb from the untransposed
// shapes)
void gemm(float* c, const float* a, const float* b, int64_t m, int64_t n, int64_t k, bool trans_a,
          bool trans_b, float alpha, float beta);
// x (rows, cols) as bf16 terms summing to it exactly (term 0 = bf16(x), term 1 = bf16(x - t0),
// term 2 = x - t0 - t1): out (rows, cols * n) bf16 bits, column block j = term terms[j].
void split_bf16_columns(uint16_t* out, const float* x, int64_t rows, int64_t cols, const int* terms,
                        int n);
// out (rows, cols) = (accumulate ? out : 0) + the n column blocks of y (rows, cols * n), in order.
void sum_column_blocks(float* out, const float* y, int64_t rows, int64_t cols, int64_t n,
                       bool accumulate);
// y[o_g:o_g+n_g] = x[o_g:o_g+n_g] @ w[g]  (w[g] is [K, M], or [M, K] when trans_w)
void grouped_gemm(float* y, const float* x, const float* w, const int64_t* group_sizes,
                  int64_t groups, int64_t k, int64_t m, bool trans_w);
// dw[g] = x_g^T @ dy_g (+ dw[g] when accumulate); dw [G, K, M]
void grouped_gemm_weight_grad(float* dw, const float* x, const float* dy,
                              const int64_t* group_sizes, int64_t groups, int64_t k, int64_t m,
                              bool accumulate);

// ---- FP8 E4M3 block quantisation (fp8.cpp; core/fp8.h, docs/fp8.md) ----------------------
// x [N, K] -> q [N, K] e4m3 bytes with one scale per row and 128-column block. Scales are
// grouped like the rows: group g (first row o_g, n_g rows) holds [ceil(K/128), n_g] from
// o_g * ceil(K/128) (the layout the sm90 FP8 grouped GEMM reads).
void quantize_rows_fp8(uint8_t* q, float* scales, const float* x, const int64_t* group_sizes,
                       int64_t groups, int64_t k);
// quantize_rows_fp8 of rows index[r] (in range) of x, without the gathered copy.
void gather_quantize_rows_fp8(uint8_t* q, float* scales, const float* x, const int32_t* index,
                              const int64_t* group_sizes, int64_t groups, int64_t k);
void dequantize_rows_fp8(float* x, const uint8_t* q, const float* scales,
                         const int64_t* group_sizes, int64_t groups, int64_t k);
// w [G, K, M] -> q [G, K, M] and its transpose q_t [G, M, K], one scale per 128 x 128 block:
// scales [G, ceil(K/128), ceil(M/128)] and its transpose scales_t.
void quantize_weights_fp8(uint8_t* q, uint8_t* q_t, float* scales, float* scales_t, const float* w,
                          int64_t groups, int64_t k, int64_t m);
void dequantize_weights_fp8(float* w, const uint8_t* q, const float* scales, int64_t groups,
                            int64_t k, int64_t m);

void softmax_forward(float* y, const float* x, int64_t rows, int64_t cols);
void softmax_backward(float* dx, const float* y, const float* dy, int64_t rows, int64_t cols);
void sigmoid_forward(float* y, const float* x, int64_t n);
void sigmoid_backward(float* dx, const float* y, const float* dy, int64_t n);
// h [N, 2f] = [gate | up]; a [N, f] = silu(gate) * up
void swiglu_forward(float* a, const float* h, int64_t rows, int64_t f);
/// value, where given: swiglu(h) written too (it may be da: each element is read first).
void swiglu_backward(float* dh, const float* h, const float* da, int64_t rows, int64_t f,
                     float* value = nullptr);

// sum = x + a, then y = rmsnorm(sum) in the same pass over each row (a and sum null: the norm
// of x).
void add_rmsnorm_forward(float* y, float* sum, float* rstd, const float* x, const float* a,
                         const float* w, int64_t rows, int64_t d, float eps);
// dx (+ residual when not null); dw += sum over rows
void rmsnorm_backward(float* dx, float* dw, const float* x, const float* w, const float* rstd,
                      const float* dy, int64_t rows, int64_t d, const float* residual = nullptr);

void topk(float* values, int32_t* indices, const float* x, int64_t rows, int64_t cols, int64_t k);
void gather_rows(float* out, const float* x, const int32_t* index, int64_t m, int64_t d);
// out[index[i]] += weight[i] * src[i]; weight may be null
void scatter_add_rows(float* out, const float* src, const int32_t* index, const float* weight,
                      int64_t m, int64_t n_out, int64_t d);
void row_dot(float* out, const float* a, const float* b, int64_t rows, int64_t d);

}  // namespace xmoe::cpu
