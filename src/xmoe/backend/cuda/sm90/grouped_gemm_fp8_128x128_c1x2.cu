// sm90 FP8 grouped GEMM (128x128_c1x2): the same tiles on 1 x 2 clusters: each row tile loaded once
// (TMA multicast) for two weight tiles.
#include "xmoe/backend/cuda/sm90/grouped_gemm_fp8_impl.cuh"

namespace xmoe::cuda::sm90::detail {

Fp8Kernel fp8_kernel_128x128_c1x2() {
  return fp8_kernel_of<Fp8Gemm<cute::Shape<cute::_128, cute::_128, cute::_128>,
                               cute::Shape<cute::_1, cute::_2, cute::_1>, false>>();
}

}  // namespace xmoe::cuda::sm90::detail
