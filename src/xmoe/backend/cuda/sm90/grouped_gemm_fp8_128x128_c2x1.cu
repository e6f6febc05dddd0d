// sm90 FP8 grouped GEMM (128x128_c2x1): the same tiles on 2 x 1 clusters: each weight tile loaded
// once (TMA multicast) for two row tiles.
#include "xmoe/backend/cuda/sm90/grouped_gemm_fp8_impl.cuh"

namespace xmoe::cuda::sm90::detail {

using Fp8Gemm_128x128_c2x1 = Fp8Gemm<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                     cute::Shape<cute::_2, cute::_1, cute::_1>, false>;

size_t fp8_128x128_c2x1_scratch_bytes(const ProblemList& list) {
  return fp8_scratch_bytes<Fp8Gemm_128x128_c2x1>(list);
}
void fp8_128x128_c2x1_run(const ProblemList& list, const Fp8Scales& scales, void* scratch,
                          Stream stream) {
  fp8_run<Fp8Gemm_128x128_c2x1>(list, scales, scratch, stream);
}

}  // namespace xmoe::cuda::sm90::detail
