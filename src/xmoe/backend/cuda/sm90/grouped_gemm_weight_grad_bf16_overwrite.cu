// sm90 grouped GEMM, dw_g (bf16) = x_g^T dy_g without reading dw (beta = 0).
#include "xmoe/backend/cuda/sm90/grouped_gemm_impl.cuh"

namespace xmoe::cuda::sm90::detail {

using WeightGradBf16OverwriteGemm =
    GroupedGemm<ColumnMajor, RowMajor, void, cutlass::bfloat16_t, Cooperative128x256, true>;

size_t weight_grad_bf16_overwrite_scratch_bytes(const ProblemList& list) {
  return WeightGradBf16OverwriteGemm::scratch_bytes(list);
}
void weight_grad_bf16_overwrite_run(const ProblemList& list, void* scratch, Stream stream) {
  WeightGradBf16OverwriteGemm::run(list, 0.f, scratch, stream);
}

}  // namespace xmoe::cuda::sm90::detail
