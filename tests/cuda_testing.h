#pragma once
// Shared by the CPU-vs-CUDA parity tests: the skip rule and the error measure.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/comm/nccl/nccl_group.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/tensor.h"

/// The only acceptable skip of a CUDA test: no device visible (CI, the development machine).
#define XMOE_REQUIRE_CUDA()                                                                \
  do {                                                                                     \
    if (!::xmoe::backend::cuda_available())                                                \
      GTEST_SKIP() << "no CUDA device visible (this build or machine has none): the CUDA " \
                      "backend is tested by scripts/gpu-check.sh on the GPU machine";      \
  } while (0)

namespace xmoe::testing {

inline const Device kCuda = Device::cuda(0);

/// A host f32 copy of any f32/bf16 tensor.
inline Tensor host_f32(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  return h.dtype() == DType::bf16 ? h.to(DType::f32) : h;
}

/// ||got - ref|| / ||ref|| (absolute when ref is all zero), in double. Non-finite entries
/// must match exactly (the same infinity, or NaN in both); any other mismatch is infinite.
/// The same shape, dtype and bytes, wherever each tensor lives.
inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return a.nbytes() == 0 || std::memcmp(ha.raw(), hb.raw(), a.nbytes()) == 0;
}

inline double normalised_error(const Tensor& got, const Tensor& ref) {
  const std::vector<float> a = host_f32(got).to_vector<float>();
  const std::vector<float> b = host_f32(ref).to_vector<float>();
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) {
      if (a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))) continue;
      return std::numeric_limits<double>::infinity();
    }
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

/// Why the NCCL tests cannot run on this rank's host (empty: they can), decided by every rank
/// of `world` together (a collective) so that no rank waits for one that skips. Sets
/// `local_rank` to this rank's position on its host (its device).
inline std::string nccl_skip_reason(comm::Group& world, int& local_rank) {
  if (!comm::nccl::available())
    return "this xmoe was built without NCCL (XMOE_NCCL=OFF): nothing to test";
  const auto host = comm::nccl::host_ranks(world);
  local_rank = host.local_rank;
  const int devices = backend::cuda_device_count();
  std::string mine;
  if (devices == 0)
    mine = "no CUDA device visible";
  else if (host.local_size > devices)
    mine = fmt::format(
        "{} ranks on this host but {} CUDA device(s): NCCL does not allow two ranks of a "
        "communicator on one device (run with -np <= devices)",
        host.local_size, devices);
  Tensor bad = Tensor::from_vector<int32_t>({mine.empty() ? 0 : 1}, {1});
  world.all_reduce(bad, comm::ReduceOp::max);
  if (bad.data<int32_t>()[0] == 0) return "";
  return mine.empty() ? "another rank cannot run NCCL (no device for it)" : mine;
}

}  // namespace xmoe::testing
