#pragma once
// Error checks for kernel files (.cu). nvcc cannot compile fmt 9, so this header includes no
// xmoe header that uses fmt: the throwing functions are defined in device_api.cpp (C++ compiler)
// and raise xmoe::Error with the same message format as check.h.
#include <cuda_runtime.h>

namespace xmoe::cuda {
/// Throws xmoe::Error "[cuda] <call> failed: <message> (<status>)".
[[noreturn]] void throw_cuda_error(const char* call, int status, const char* message,
                                   const char* file, int line);
/// Throws xmoe::Error with `message`.
[[noreturn]] void throw_message(const char* message, const char* file, int line);
}  // namespace xmoe::cuda

#ifndef CUDA_CHECK
/// CUDA_CHECK(cudaMemsetAsync(...)): throws xmoe::Error naming the call and the CUDA error.
#define CUDA_CHECK(call)                                                               \
  do {                                                                                 \
    const cudaError_t status_ = (call);                                                \
    if (status_ != cudaSuccess) [[unlikely]]                                           \
      ::xmoe::cuda::throw_cuda_error(#call, static_cast<int>(status_),                 \
                                     cudaGetErrorString(status_), __FILE__, __LINE__); \
  } while (0)
#endif

/// After every <<<...>>> launch: a bad configuration surfaces here, not at a later sync.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
