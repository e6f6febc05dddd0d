// metrics.jsonl as a resumed run reads it: truncate_metrics keeps the lines up to a step.
#include <cstddef>
#include <cstdint>
#include <filesystem>

#include "fuzz_common.h"
#include "xmoe/train/run_folder.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  xmoe::fuzz::quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto dir = xmoe::fuzz::scratch_dir();
  xmoe::fuzz::write_bytes(dir / "metrics.jsonl", data, size);
  xmoe::fuzz::expect_clean_error([&] { xmoe::train::truncate_metrics(dir.string(), 20); });
  return 0;
}
