// Linked when xmoe is built without CUDA: the CUDA launchers and the device model of
// backend/cuda/{kernels,runtime}.h exist, and each throws naming its op. (The ops never get here
// in such a build, since no CUDA tensor can be created; the stubs keep the link complete.)
#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/backend/cuda/runtime.h"
#include "xmoe/core/error.h"

namespace xmoe::cuda {

namespace {
[[noreturn]] void no_cuda(const char* op) {
  XMOE_FAIL("[{}] has no CUDA implementation: this xmoe was built without CUDA (XMOE_CUDA=OFF)",
            op);
}
}  // namespace

// ---- device model ---------------------------------------------------------------------------
Stream current_stream(int) {
  no_cuda("current_stream");
}
void set_current_stream(int, Stream) {
  no_cuda("set_current_stream");
}
Stream activate(int) {
  no_cuda("activate");
}
CacheStats cache_stats(int) {
  no_cuda("cache_stats");
}
void empty_cache(int) {
  no_cuda("empty_cache");
}

// ---- cuBLAS ---------------------------------------------------------------------------------
void gemm(void*, DType, const void*, const void*, DType, int64_t, int64_t, int64_t, bool, bool,
          float, float, Stream) {
  no_cuda("matmul");
}
void grouped_gemm(void*, const void*, const void*, DType, const int64_t*, int64_t, int64_t, int64_t,
                  bool, Stream) {
  no_cuda("grouped_matmul");
}
void grouped_gemm_weight_grad(void*, DType, const void*, const void*, DType, const int64_t*,
                              int64_t, int64_t, int64_t, bool, Stream) {
  no_cuda("grouped_matmul_weight_grad");
}
void quantize_rows_fp8(uint8_t*, float*, const void*, DType, const int64_t*, int64_t, int64_t,
                       Stream) {
  no_cuda("quantize_rows_fp8");
}
void swiglu_quantize_rows_fp8(uint8_t*, float*, const void*, DType, const int64_t*, int64_t,
                              int64_t, Stream) {
  no_cuda("swiglu_quantize_rows_fp8");
}
void swiglu_backward_quantize_fp8(void*, void*, DType, uint8_t*, float*, const int64_t*, int64_t,
                                  int64_t, Stream) {
  no_cuda("swiglu_backward_with_value_fp8_");
}
void gather_quantize_rows_fp8(uint8_t*, float*, const void*, DType, const int32_t*, int64_t,
                              const int64_t*, int64_t, int64_t, Stream) {
  no_cuda("gather_quantize_rows_fp8");
}
void dequantize_rows_fp8(void*, DType, const uint8_t*, const float*, const int64_t*, int64_t,
                         int64_t, Stream) {
  no_cuda("dequantize_rows_fp8");
}
void quantize_weights_fp8(uint8_t*, uint8_t*, float*, float*, const void*, DType, int64_t, int64_t,
                          int64_t, Stream) {
  no_cuda("quantize_weights_fp8");
}
void dequantize_weights_fp8(void*, DType, const uint8_t*, const float*, int64_t, int64_t, int64_t,
                            Stream) {
  no_cuda("dequantize_weights_fp8");
}
bool grouped_gemm_fp8(void*, const uint8_t*, const float*, const uint8_t*, const float*,
                      const int64_t*, int64_t, int64_t, int64_t, Stream) {
  no_cuda("grouped_matmul_fp8");
}
GroupedGemmCalls grouped_gemm_calls(GroupedGemmKind) {
  return {};
}
bool grouped_gemm_sm90_available(int) {
  return false;
}

// ---- elementwise ----------------------------------------------------------------------------
void cast(void*, DType, const void*, DType, int64_t, Stream) {
  no_cuda("cast");
}
void split_bf16_columns(void*, const float*, int64_t, int64_t, const int*, int, Stream) {
  no_cuda("split_bf16_columns");
}
void sum_column_blocks(float*, const float*, int64_t, int64_t, int64_t, bool, Stream) {
  no_cuda("sum_column_blocks");
}
void add(void*, const void*, DType, const void*, DType, int64_t, Stream) {
  no_cuda("add");
}
void add_inplace(void*, DType, const void*, DType, float, int64_t, Stream) {
  no_cuda("add_");
}
void mul(void*, const void*, const void*, DType, int64_t, Stream) {
  no_cuda("mul");
}
void scale_inplace(void*, DType, float, int64_t, Stream) {
  no_cuda("scale_");
}
void sigmoid_forward(void*, const void*, DType, int64_t, Stream) {
  no_cuda("sigmoid");
}
void sigmoid_backward(void*, const void*, const void*, DType, int64_t, Stream) {
  no_cuda("sigmoid_backward");
}
void swiglu_forward(void*, const void*, DType, int64_t, int64_t, Stream) {
  no_cuda("swiglu");
}
void swiglu_backward(void*, const void*, const void*, DType, int64_t, int64_t, Stream, void*) {
  no_cuda("swiglu_backward");
}

// ---- reductions -----------------------------------------------------------------------------
size_t reduce_workspace_bytes(int64_t) {
  no_cuda("reduce");
}
void reduce(double*, const void*, DType, int64_t, Reduction, void*, Stream) {
  no_cuda("reduce");
}
void row_dot(void*, const void*, const void*, DType, int64_t, int64_t, Stream) {
  no_cuda("row_dot");
}

// ---- softmax, RMSNorm -----------------------------------------------------------------------
void softmax_forward(void*, const void*, DType, int64_t, int64_t, Stream) {
  no_cuda("softmax");
}
void softmax_backward(void*, const void*, const void*, DType, int64_t, int64_t, Stream) {
  no_cuda("softmax_backward");
}
void rmsnorm_forward(const RmsNormArgs&, Stream) {
  no_cuda("rmsnorm");
}
size_t rmsnorm_backward_workspace_bytes(int64_t, int64_t) {
  no_cuda("rmsnorm_backward");
}
void rmsnorm_backward(const RmsNormGradArgs&, void*, Stream) {
  no_cuda("rmsnorm_backward");
}

// ---- selection and indexing -----------------------------------------------------------------
void topk(void*, int32_t*, const void*, DType, int64_t, int64_t, int64_t, Stream) {
  no_cuda("topk");
}
void softmax_topk(void*, void*, int32_t*, const void*, DType, int64_t, int64_t, int64_t, Stream) {
  no_cuda("softmax_topk");
}
void gather_rows(void*, const void*, DType, const int32_t*, int64_t, int64_t, int64_t, Stream) {
  no_cuda("gather_rows");
}
void gather_sum_rows(void*, DType, const void*, DType, const int32_t*, const void*, DType,
                     const void*, int64_t, int64_t, int64_t, int64_t, Stream) {
  no_cuda("gather_sum_rows");
}
size_t scatter_add_rows_workspace_bytes(int64_t, int64_t) {
  no_cuda("scatter_add_rows");
}
void scatter_add_rows(void*, DType, const void*, DType, const int32_t*, const void*, DType, int64_t,
                      int64_t, int64_t, void*, size_t, Stream) {
  no_cuda("scatter_add_rows");
}
void find_bad_index(int64_t*, const int32_t*, int64_t, int64_t, bool, Stream) {
  no_cuda("find_bad_index");
}

// ---- model ops ------------------------------------------------------------------------------
void rope_apply(void*, DType, const float*, const float*, int64_t, int64_t, int64_t, int64_t, bool,
                Stream) {
  no_cuda("rope");
}
size_t attention_forward_workspace_bytes(DType, int64_t, int64_t, int64_t, int64_t, int64_t, bool) {
  no_cuda("attention");
}
void attention_forward(void*, float*, const void*, const void*, const void*, DType, int64_t,
                       int64_t, int64_t, int64_t, int64_t, float, bool, void*, Stream) {
  no_cuda("attention");
}
size_t attention_backward_workspace_bytes(DType, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          bool) {
  no_cuda("attention_backward");
}
void attention_backward(void*, void*, void*, const void*, const void*, const void*, const void*,
                        const float*, const void*, DType, int64_t, int64_t, int64_t, int64_t,
                        int64_t, float, bool, void*, Stream) {
  no_cuda("attention_backward");
}
AttentionBackend attention_backend() {
  return AttentionBackend::native;
}
void set_attention_backend(AttentionBackend) {}
const char* attention_impl(DType, int64_t, int64_t, int64_t, int64_t, int64_t, bool) {
  return "none";
}
void cross_entropy_forward(float*, float*, const void*, DType, const int32_t*, int64_t, int64_t,
                           Stream) {
  no_cuda("cross_entropy");
}
void cross_entropy_reduce(double*, const float*, const int32_t*, int64_t, Stream) {
  no_cuda("cross_entropy");
}
void cross_entropy_backward(void*, const void*, DType, const float*, const int32_t*, int64_t,
                            int64_t, float, Stream) {
  no_cuda("cross_entropy_backward");
}

}  // namespace xmoe::cuda
