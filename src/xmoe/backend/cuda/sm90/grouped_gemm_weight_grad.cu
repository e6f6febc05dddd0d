// sm90 grouped GEMM, dw_g (f32) = x_g^T dy_g: A is M-major, the rows are the reduction.
#include "xmoe/backend/cuda/sm90/grouped_gemm_impl.cuh"

namespace xmoe::cuda::sm90::detail {

using WeightGradGemm = GroupedGemm<ColumnMajor, RowMajor, float, float, Cooperative128x256, true>;

size_t weight_grad_scratch_bytes(const ProblemList& list) {
  return WeightGradGemm::scratch_bytes(list);
}
void weight_grad_run(const ProblemList& list, float beta, void* scratch, Stream stream) {
  WeightGradGemm::run(list, beta, scratch, stream);
}

}  // namespace xmoe::cuda::sm90::detail
