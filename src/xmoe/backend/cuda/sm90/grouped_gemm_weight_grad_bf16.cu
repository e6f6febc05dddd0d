// sm90 grouped GEMM, dw_g (bf16) = x_g^T dy_g (+ beta dw_g): the bf16 gradients of
// model.moe.expert_grad_dtype = bf16, f32 accumulation rounded once on the store.
#include "xmoe/backend/cuda/sm90/grouped_gemm_impl.cuh"

namespace xmoe::cuda::sm90::detail {

using WeightGradBf16Gemm = GroupedGemm<ColumnMajor, RowMajor, cutlass::bfloat16_t,
                                       cutlass::bfloat16_t, Cooperative128x256, true>;

size_t weight_grad_bf16_scratch_bytes(const ProblemList& list) {
  return WeightGradBf16Gemm::scratch_bytes(list);
}
void weight_grad_bf16_run(const ProblemList& list, float beta, void* scratch, Stream stream) {
  WeightGradBf16Gemm::run(list, beta, scratch, stream);
}

}  // namespace xmoe::cuda::sm90::detail
