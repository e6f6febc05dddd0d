// A build without CUTLASS (XMOE_CUTLASS off): the sm90 grouped GEMM declines every call, so
// cuBLAS does them all.
#include "xmoe/backend/cuda/sm90/grouped_gemm.h"
#include "xmoe/core/error.h"

namespace xmoe::cuda::sm90 {

int sm_count(int) {
  return 0;
}
bool supported(int) {
  return false;
}
size_t scratch_bytes(GroupedKind, const ProblemList&, float) {
  return 0;
}
void run(GroupedKind, const ProblemList&, float, void*, Stream) {
  XMOE_FAIL("[grouped_matmul] this build has no CUTLASS sm90 kernels (XMOE_CUTLASS is off)");
}
size_t fp8_scratch_bytes(const ProblemList&) {
  return 0;
}
void fp8_run(const ProblemList&, const Fp8Scales&, void*, Stream) {
  XMOE_FAIL("[grouped_matmul_fp8] this build has no CUTLASS sm90 kernels (XMOE_CUTLASS is off)");
}
void add_partials(const PartialSums&, Stream) {
  XMOE_FAIL("[grouped_matmul] this build has no CUTLASS sm90 kernels (XMOE_CUTLASS is off)");
}

}  // namespace xmoe::cuda::sm90
