#pragma once
// NCCL_CHECK for the NCCL backend (host code compiled by the C++ compiler).
#include <nccl.h>

#include <string>

#include "xmoe/core/error.h"

namespace xmoe::comm::nccl {

/// NCCL's own account of the last failure on this thread (may be empty).
inline std::string last_error_detail() {
  const char* text = ncclGetLastError(nullptr);
  return text && *text ? fmt::format(": {}", text) : std::string();
}

}  // namespace xmoe::comm::nccl

/// NCCL_CHECK(ncclAllReduce(...)): throws xmoe::Error naming the call and NCCL's error.
#define NCCL_CHECK(call)                                                     \
  do {                                                                       \
    const ncclResult_t status_ = (call);                                     \
    XMOE_CHECK(status_ == ncclSuccess, "[nccl] {} failed: {} ({}){}", #call, \
               ncclGetErrorString(status_), static_cast<int>(status_),       \
               ::xmoe::comm::nccl::last_error_detail());                     \
  } while (0)
