// sm90 FP8 grouped GEMM (64x128_pp): ping-pong: each consumer warpgroup owns a 64 x 128 tile, one's
// epilogue under the other's main loop.
#include "xmoe/backend/cuda/sm90/grouped_gemm_fp8_impl.cuh"

namespace xmoe::cuda::sm90::detail {

using Fp8Gemm_64x128_pp = Fp8Gemm<cute::Shape<cute::_64, cute::_128, cute::_128>,
                                  cute::Shape<cute::_1, cute::_1, cute::_1>, true>;

size_t fp8_64x128_pp_scratch_bytes(const ProblemList& list) {
  return fp8_scratch_bytes<Fp8Gemm_64x128_pp>(list);
}
void fp8_64x128_pp_run(const ProblemList& list, const Fp8Scales& scales, void* scratch,
                       Stream stream) {
  fp8_run<Fp8Gemm_64x128_pp>(list, scales, scratch, stream);
}

}  // namespace xmoe::cuda::sm90::detail
