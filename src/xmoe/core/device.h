#pragma once
#include <fmt/format.h>

#include <string>

namespace xmoe {

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static Device cpu() { return {DeviceType::cpu, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::cuda, index}; }
  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool operator==(const Device&) const = default;
  std::string str() const { return is_cpu() ? "cpu" : fmt::format("cuda:{}", index); }
};

/// Parses "cpu", "cuda", "cuda:1"; throws on anything else.
Device parse_device(const std::string& name);
/// CUDA devices visible to this process: 0 when none is, or when xmoe was built without CUDA.
int cuda_device_count();
/// cuda_device_count() > 0.
bool cuda_available();

}  // namespace xmoe
