// Linked when xmoe is built without CUDA: the MoE launchers of backend/cuda/moe_kernels.h exist,
// and each throws naming its op. (No CUDA tensor can exist in such a build, so the MoE ops never
// get here; the stubs keep the link complete.)
#include "xmoe/backend/cuda/moe_kernels.h"
#include "xmoe/core/error.h"

namespace xmoe::cuda {

namespace {
[[noreturn]] void no_cuda(const char* op) {
  XMOE_FAIL("[{}] has no CUDA implementation: this xmoe was built without CUDA (XMOE_CUDA=OFF)",
            op);
}
}  // namespace

void moe_scale_rows(void*, DType, const float*, int64_t, int64_t, Stream) {
  no_cuda("scale_rows_");
}
void moe_row_dot_f32(float*, const void*, const void*, DType, int64_t, int64_t, Stream) {
  no_cuda("row_dot");
}
void moe_take_along_rows(void*, const void*, DType, const int32_t*, int64_t, int64_t, int64_t,
                         Stream) {
  no_cuda("take_along_rows");
}
void moe_put_along_rows_add(void*, DType, const int32_t*, const void*, DType, int64_t, int64_t,
                            int64_t, Stream) {
  no_cuda("put_along_rows_add");
}
void moe_transpose(void*, const void*, DType, int64_t, int64_t, Stream) {
  no_cuda("transpose");
}
void moe_l2_normalize_rows(void*, float*, const void*, DType, int64_t, int64_t, float, Stream) {
  no_cuda("l2_normalize_rows");
}
void moe_l2_normalize_rows_backward(void*, const void*, const float*, const void*, DType, int64_t,
                                    int64_t, Stream) {
  no_cuda("l2_normalize_rows_backward");
}
void moe_renormalize_rows(void*, float*, const void*, DType, int64_t, int64_t, float, Stream) {
  no_cuda("renormalize_rows");
}
void moe_renormalize_rows_backward(void*, const void*, const float*, const void*, DType, int64_t,
                                   int64_t, float, Stream) {
  no_cuda("renormalize_rows_backward");
}
size_t moe_layout_workspace_bytes(int64_t, int64_t) {
  no_cuda("moe order");
}
void moe_layout(const int32_t*, const float*, int64_t, int64_t, int64_t, int64_t, int32_t*,
                int32_t*, float*, int32_t*, int64_t*, void*, size_t, Stream) {
  no_cuda("moe order");
}
void moe_gather_weighted_rows_dot(void*, float*, const void*, DType, const void*, DType,
                                  const int32_t*, const float*, int64_t, int64_t, int64_t, Stream,
                                  uint8_t*, float*, const int64_t*, int64_t) {
  no_cuda("gather_weighted_rows_dot");
}
void moe_aux_stats(double*, float*, double*, const float*, const int32_t*, const float*, int64_t,
                   int64_t, int64_t, int64_t, double*, Stream) {
  no_cuda("moe aux losses");
}
int64_t moe_aux_stats_scratch(int64_t, int64_t, int64_t) {
  no_cuda("moe aux losses");
}
void moe_aux_finalize(double*, float*, double*, const double*, int64_t, int64_t, int64_t, int64_t,
                      double, double, double, Stream) {
  no_cuda("moe aux losses");
}
void moe_aux_backward(float*, float*, const float*, const float*, const float*, const double*,
                      int64_t, int64_t, int64_t, int64_t, float, float, float, const float*,
                      Stream) {
  no_cuda("moe aux losses backward");
}
void moe_softmax_routing_backward(float*, const float*, const int32_t*, const float*, int64_t,
                                  const float*, const float*, const float*, const double*, int64_t,
                                  int64_t, int64_t, int64_t, float, float, float, const float*,
                                  Stream) {
  no_cuda("moe softmax routing backward");
}
void moe_group_limited_scores(float*, const float*, const float*, int64_t, int64_t, int64_t,
                              int64_t, Stream) {
  no_cuda("moe gate sigmoid");
}
void moe_div_temperature(float*, const float*, const float*, float, int64_t, Stream) {
  no_cuda("moe gate xmoe");
}
void moe_temperature_grad(float*, const float*, const float*, const float*, float, int64_t,
                          Stream) {
  no_cuda("moe gate xmoe");
}

}  // namespace xmoe::cuda
