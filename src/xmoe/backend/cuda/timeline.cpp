// The device timeline (core/device_timeline.h) from CUPTI's activity records. CUPTI is opened at
// run time (dlopen), so that nothing else in xmoe depends on it: a machine without it runs
// everything but the timeline, which then says what it looked for.
#include "xmoe/core/device_timeline.h"
#include "xmoe/core/error.h"

#if __has_include(<cupti_activity.h>)
#include <cuda_runtime.h>
#include <cupti_activity.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace xmoe::backend {

namespace {

struct Cupti {
  void* library = nullptr;
  std::string path;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
};

/// CUPTI's library: the loader's search path first, then the toolkit's usual places.
const Cupti& cupti() {
  static const Cupti c = [] {
    Cupti c;
    std::vector<std::string> candidates = {"libcupti.so.13", "libcupti.so"};
    for (const char* var : {"CUDA_HOME", "CUDA_PATH"})
      if (const char* root = std::getenv(var))
        for (const char* sub : {"/extras/CUPTI/lib64/", "/lib64/", "/lib/"})
          candidates.push_back(std::string(root) + sub + "libcupti.so.13");
    for (const char* root : {"/usr/local/cuda", "/usr/local/cuda-13.0"})
      for (const char* sub : {"/extras/CUPTI/lib64/", "/lib64/", "/lib/"})
        candidates.push_back(std::string(root) + sub + "libcupti.so.13");
    std::string tried;
    for (const std::string& name : candidates) {
      c.library = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (c.library) {
        c.path = name;
        break;
      }
      tried += (tried.empty() ? "" : ", ") + name;
    }
    XMOE_CHECK(c.library != nullptr,
               "[device timeline] CUPTI's library was not found (tried {}); put libcupti.so.13 on "
               "LD_LIBRARY_PATH or set CUDA_HOME",
               tried);
    auto load = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(c.library, symbol));
      XMOE_CHECK(fn != nullptr, "[device timeline] {} lacks {}", c.path, symbol);
    };
    load(c.register_callbacks, "cuptiActivityRegisterCallbacks");
    load(c.enable, "cuptiActivityEnable");
    load(c.disable, "cuptiActivityDisable");
    load(c.flush_all, "cuptiActivityFlushAll");
    load(c.next_record, "cuptiActivityGetNextRecord");
    load(c.result_string, "cuptiGetResultString");
    return c;
  }();
  return c;
}

void check(CUptiResult status, const char* what) {
  if (status == CUPTI_SUCCESS) return;
  const char* text = "unknown";
  cupti().result_string(status, &text);
  XMOE_FAIL("[device timeline] {}: {}", what, text);
}

/// What the buffers' records become; filled by CUPTI's completion callback (any thread).
struct Recording {
  std::mutex mutex;
  bool active = false;
  std::vector<DeviceActivity> activities;
  std::vector<uint32_t> correlation;                 // activities[i]'s launch call
  std::unordered_map<uint32_t, int64_t> call_start;  // correlation id -> host call's start
  std::unordered_map<const char*, std::string> names;
};
Recording& recording() {
  static Recording* r = new Recording;  // leaked: CUPTI may call back during exit
  return *r;
}

constexpr size_t kBufferBytes = size_t{8} << 20;
constexpr size_t kBufferAlign = 8;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kBufferAlign, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

std::string memcpy_name(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "memcpy HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "memcpy PtoP";
    default:
      return "memcpy";
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  Recording& rec = recording();
  {
    std::lock_guard<std::mutex> lock(rec.mutex);
    CUpti_Activity* record = nullptr;
    while (cupti().next_record(buffer, valid, &record) == CUPTI_SUCCESS) {
      switch (record->kind) {
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
          const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
          auto [it, fresh] = rec.names.try_emplace(k->name);
          if (fresh) {
            if (k->name == nullptr) {
              it->second = "(unnamed kernel)";
            } else {
              int status = 0;
              char* plain = abi::__cxa_demangle(k->name, nullptr, nullptr, &status);
              it->second = short_kernel_name(status == 0 && plain ? plain : k->name);
              std::free(plain);
            }
          }
          rec.activities.push_back({DeviceActivity::Kind::kernel, it->second,
                                    static_cast<int64_t>(k->start), static_cast<int64_t>(k->end),
                                    k->streamId, -1});
          rec.correlation.push_back(k->correlationId);
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
          rec.activities.push_back({DeviceActivity::Kind::memcpy, memcpy_name(m->copyKind),
                                    static_cast<int64_t>(m->start), static_cast<int64_t>(m->end),
                                    m->streamId, -1});
          rec.correlation.push_back(m->correlationId);
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
          rec.activities.push_back({DeviceActivity::Kind::memset, "memset",
                                    static_cast<int64_t>(m->start), static_cast<int64_t>(m->end),
                                    m->streamId, -1});
          rec.correlation.push_back(m->correlationId);
          break;
        }
        case CUPTI_ACTIVITY_KIND_RUNTIME:
        case CUPTI_ACTIVITY_KIND_DRIVER: {
          const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
          rec.call_start[a->correlationId] = static_cast<int64_t>(a->start);
          break;
        }
        default:
          break;
      }
    }
  }
  std::free(buffer);
}

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                         CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
                                         CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};

}  // namespace

void start_device_timeline() {
  Recording& rec = recording();
  {
    std::lock_guard<std::mutex> lock(rec.mutex);
    XMOE_CHECK(!rec.active, "[device timeline] already recording");
    rec.activities.clear();
    rec.correlation.clear();
    rec.call_start.clear();
  }
  static std::once_flag registered;
  std::call_once(registered, [] {
    check(cupti().register_callbacks(buffer_requested, buffer_completed),
          "cuptiActivityRegisterCallbacks");
  });
  // Work queued before the recording starts is not part of it.
  const cudaError_t synced = cudaDeviceSynchronize();
  XMOE_CHECK(synced == cudaSuccess, "[device timeline] cudaDeviceSynchronize: {}",
             cudaGetErrorString(synced));
  for (CUpti_ActivityKind kind : kKinds) check(cupti().enable(kind), "cuptiActivityEnable");
  std::lock_guard<std::mutex> lock(rec.mutex);
  rec.active = true;
}

std::vector<DeviceActivity> stop_device_timeline() {
  Recording& rec = recording();
  {
    std::lock_guard<std::mutex> lock(rec.mutex);
    XMOE_CHECK(rec.active, "[device timeline] not recording");
  }
  const cudaError_t synced = cudaDeviceSynchronize();
  for (CUpti_ActivityKind kind : kKinds) cupti().disable(kind);
  check(cupti().flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(rec.mutex);
  rec.active = false;
  XMOE_CHECK(synced == cudaSuccess, "[device timeline] cudaDeviceSynchronize: {}",
             cudaGetErrorString(synced));
  std::vector<DeviceActivity> out = std::move(rec.activities);
  for (size_t i = 0; i < out.size(); ++i) {
    const auto it = rec.call_start.find(rec.correlation[i]);
    if (it != rec.call_start.end()) out[i].launch_ns = it->second;
  }
  rec.activities.clear();
  rec.correlation.clear();
  rec.call_start.clear();
  std::stable_sort(out.begin(), out.end(), [](const DeviceActivity& a, const DeviceActivity& b) {
    return a.start_ns < b.start_ns;
  });
  return out;
}

}  // namespace xmoe::backend

#else  // a toolkit without CUPTI's headers

namespace xmoe::backend {
void start_device_timeline() {
  XMOE_FAIL("[device timeline] this xmoe was built without CUPTI's headers (cupti_activity.h)");
}
std::vector<DeviceActivity> stop_device_timeline() {
  XMOE_FAIL("[device timeline] this xmoe was built without CUPTI's headers (cupti_activity.h)");
}
}  // namespace xmoe::backend

#endif
