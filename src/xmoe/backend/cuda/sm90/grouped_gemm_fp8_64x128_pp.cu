// sm90 FP8 grouped GEMM (64x128_pp): ping-pong: each consumer warpgroup owns a 64 x 128 tile, one's
// epilogue under the other's main loop.
#include "xmoe/backend/cuda/sm90/grouped_gemm_fp8_impl.cuh"

namespace xmoe::cuda::sm90::detail {

Fp8Kernel fp8_kernel_64x128_pp() {
  return fp8_kernel_of<Fp8Gemm<cute::Shape<cute::_64, cute::_128, cute::_128>,
                               cute::Shape<cute::_1, cute::_1, cute::_1>, true>>();
}

}  // namespace xmoe::cuda::sm90::detail
