// sm90 FP8 grouped GEMM (128x128): 128 x 128 x 128 tiles, two consumer warpgroups of 64 x 128 each,
// no cluster.
#include "xmoe/backend/cuda/sm90/grouped_gemm_fp8_impl.cuh"

namespace xmoe::cuda::sm90::detail {

Fp8Kernel fp8_kernel_128x128() {
  return fp8_kernel_of<Fp8Gemm<cute::Shape<cute::_128, cute::_128, cute::_128>,
                               cute::Shape<cute::_1, cute::_1, cute::_1>, false>>();
}

}  // namespace xmoe::cuda::sm90::detail
