// Dispatch of the sm90 grouped GEMMs to their instantiations (no CUTLASS headers here).
#include <cuda_runtime.h>

#include <atomic>

#include "xmoe/backend/cuda/cuda_check.cuh"
#include "xmoe/backend/cuda/sm90/grouped_gemm.h"

namespace xmoe::cuda::sm90 {

bool supported(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // 0 unknown, 1 yes, 2 no
  if (device < 0 || device >= kMaxDevices) return false;
  int state = cached[device].load(std::memory_order_relaxed);
  if (state == 0) {
    int major = 0, minor = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    state = major == 9 && minor == 0 ? 1 : 2;  // sm_90a code runs on 9.0 only
    cached[device].store(state, std::memory_order_relaxed);
  }
  return state == 1;
}

size_t scratch_bytes(GroupedKind kind, const ProblemList& list) {
  switch (kind) {
    case GroupedKind::forward: return detail::forward_scratch_bytes(list);
    case GroupedKind::forward_trans_w: return detail::forward_trans_w_scratch_bytes(list);
    case GroupedKind::weight_grad: return detail::weight_grad_scratch_bytes(list);
  }
  return 0;
}

void run(GroupedKind kind, const ProblemList& list, float beta, void* scratch, Stream stream) {
  switch (kind) {
    case GroupedKind::forward: return detail::forward_run(list, beta, scratch, stream);
    case GroupedKind::forward_trans_w: return detail::forward_trans_w_run(list, beta, scratch, stream);
    case GroupedKind::weight_grad: return detail::weight_grad_run(list, beta, scratch, stream);
  }
}

}  // namespace xmoe::cuda::sm90
