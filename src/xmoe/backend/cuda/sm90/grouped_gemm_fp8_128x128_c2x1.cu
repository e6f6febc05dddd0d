// sm90 FP8 grouped GEMM (128x128_c2x1): the same tiles on 2 x 1 clusters: each weight tile loaded
// once (TMA multicast) for two row tiles (the default).
#include "xmoe/backend/cuda/sm90/grouped_gemm_fp8_impl.cuh"

namespace xmoe::cuda::sm90::detail {

Fp8Kernel fp8_kernel_128x128_c2x1() {
  return fp8_kernel_of<Fp8Gemm<cute::Shape<cute::_128, cute::_128, cute::_128>,
                               cute::Shape<cute::_2, cute::_1, cute::_1>, false>>();
}

}  // namespace xmoe::cuda::sm90::detail
