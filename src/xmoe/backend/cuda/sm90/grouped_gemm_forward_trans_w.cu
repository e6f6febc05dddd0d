// sm90 grouped GEMM, y_g = x_g w_g^T, w_g (M, K) row-major: B is K-major.
#include "xmoe/backend/cuda/sm90/grouped_gemm_impl.cuh"

namespace xmoe::cuda::sm90::detail {

using ForwardTransWGemm =
    GroupedGemm<RowMajor, ColumnMajor, void, cutlass::bfloat16_t, Cooperative128x256, false>;

size_t forward_trans_w_scratch_bytes(const ProblemList& list) {
  return ForwardTransWGemm::scratch_bytes(list);
}
void forward_trans_w_run(const ProblemList& list, float beta, void* scratch, Stream stream) {
  ForwardTransWGemm::run(list, beta, scratch, stream);
}

}  // namespace xmoe::cuda::sm90::detail
