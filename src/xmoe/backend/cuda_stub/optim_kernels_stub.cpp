// Linked when xmoe is built without CUDA: the optimizer launchers of
// backend/cuda/optim_kernels.h exist and throw naming their op (no CUDA tensor can exist in such
// a build, so the optimizer never calls them; the stubs keep the link complete).
#include "xmoe/backend/cuda/optim_kernels.h"
#include "xmoe/core/error.h"

namespace xmoe::cuda {

namespace {
[[noreturn]] void no_cuda(const char* op) {
  XMOE_FAIL("[{}] has no CUDA implementation: this xmoe was built without CUDA (XMOE_CUDA=OFF)",
            op);
}
}  // namespace

void adamw_step(const AdamWTensor*, int64_t, const AdamWScalars&, Stream) {
  no_cuda("adamw");
}
size_t multi_sum_squares_workspace_bytes(const FloatArray*, int64_t) {
  no_cuda("grad_sum_squares");
}
void multi_sum_squares(double*, const FloatArray*, int64_t, void*, Stream) {
  no_cuda("grad_sum_squares");
}
void multi_scale(const FloatArray*, int64_t, float, Stream) {
  no_cuda("scale_grads");
}
void multi_copy_scaled(const FloatArray*, const FloatArray*, int64_t, float, Stream) {
  no_cuda("grad_sync");
}

}  // namespace xmoe::cuda
