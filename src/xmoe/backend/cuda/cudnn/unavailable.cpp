// A build without cuDNN (XMOE_CUDNN off, or no CUDA at all): cuDNN's attention declines every
// shape, so xmoe's own kernels run all of it.
#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/core/error.h"

namespace xmoe::cuda {

bool cudnn_attention_available() {
  return false;
}
bool cudnn_attention_forward_ready(const CudnnAttentionShape&, size_t*) {
  return false;
}
bool cudnn_attention_backward_ready(const CudnnAttentionShape&, size_t*) {
  return false;
}
void cudnn_attention_forward(const CudnnAttentionShape&, void*, float*, const void*, const void*,
                             const void*, void*, Stream) {
  XMOE_FAIL("[attention] this build has no cuDNN (XMOE_CUDNN is off)");
}
void cudnn_attention_backward(const CudnnAttentionShape&, void*, void*, void*, const void*,
                              const void*, const void*, const void*, const float*, const void*,
                              void*, Stream) {
  XMOE_FAIL("[attention] this build has no cuDNN (XMOE_CUDNN is off)");
}

}  // namespace xmoe::cuda
