#pragma once
// CUDA_CHECK for host code compiled by the C++ compiler (.cpp). Kernel files (.cu) use
// cuda_check.cuh, which does not include fmt.
#include <cuda_runtime.h>

#include "xmoe/core/error.h"

/// CUDA_CHECK(cudaMalloc(...)): throws xmoe::Error naming the call and the CUDA error.
#define CUDA_CHECK(call)                                                   \
  do {                                                                     \
    const cudaError_t status_ = (call);                                    \
    XMOE_CHECK(status_ == cudaSuccess, "[cuda] {} failed: {} ({})", #call, \
               cudaGetErrorString(status_), static_cast<int>(status_));    \
  } while (0)
