// sm90 grouped GEMM, y_g = x_g w_g, w_g (K, M) row-major: B is N-major.
#include "xmoe/backend/cuda/sm90/grouped_gemm_impl.cuh"

namespace xmoe::cuda::sm90::detail {

using ForwardGemm =
    GroupedGemm<RowMajor, RowMajor, void, cutlass::bfloat16_t, Cooperative128x256, false>;

size_t forward_scratch_bytes(const ProblemList& list) {
  return ForwardGemm::scratch_bytes(list);
}
void forward_run(const ProblemList& list, float beta, void* scratch, Stream stream) {
  ForwardGemm::run(list, beta, scratch, stream);
}

}  // namespace xmoe::cuda::sm90::detail
