// The safetensors reader on arbitrary bytes (header length, JSON header, tensor data).
#include <cstddef>
#include <cstdint>

#include "fuzz_common.h"
#include "xmoe/io/safetensors.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  xmoe::fuzz::quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = xmoe::fuzz::scratch_dir() / "model.safetensors";
  xmoe::fuzz::write_bytes(path, data, size);
  xmoe::fuzz::expect_clean_error([&] { (void)xmoe::io::load_safetensors(path.string()); });
  return 0;
}
