// sm90 grouped GEMM, dw_g (f32) = x_g^T dy_g without reading dw (beta = 0): no source tile in
// the epilogue, so its shared memory goes to one more mainloop stage.
#include "xmoe/backend/cuda/sm90/grouped_gemm_impl.cuh"

namespace xmoe::cuda::sm90::detail {

using WeightGradOverwriteGemm =
    GroupedGemm<ColumnMajor, RowMajor, void, float, Cooperative128x256, true>;

size_t weight_grad_overwrite_scratch_bytes(const ProblemList& list) {
  return WeightGradOverwriteGemm::scratch_bytes(list);
}
void weight_grad_overwrite_run(const ProblemList& list, void* scratch, Stream stream) {
  WeightGradOverwriteGemm::run(list, 0.f, scratch, stream);
}

}  // namespace xmoe::cuda::sm90::detail
