// The YAML config parser on arbitrary text: load_config_string accepts it or throws an Error.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "xmoe/config/config.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  xmoe::fuzz::quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  xmoe::fuzz::expect_clean_error([&] {
    (void)xmoe::load_config_string(std::string(reinterpret_cast<const char*>(data), size),
                                   "fuzz.yaml");
  });
  return 0;
}
