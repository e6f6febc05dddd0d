#pragma once
// Shared by the benchmarks: the median time of repeated runs, the device synchronised around
// each (a CUDA op returns before its kernels are done).
#include <algorithm>
#include <vector>

#include "xmoe/core/device_api.h"
#include "xmoe/core/timer.h"

namespace xmoe::bench {

/// Median seconds of `iters` runs of `op` after one warm-up run (module load, allocator).
template <class Op>
double median_seconds(Device device, int iters, Op&& op) {
  op();
  backend::synchronize(device);
  std::vector<double> seconds;
  for (int i = 0; i < iters; ++i) {
    const Timer timer;
    op();
    backend::synchronize(device);
    seconds.push_back(timer.seconds());
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

}  // namespace xmoe::bench
