// A token file and the meta.json beside it. The input is a 2-byte little-endian length L, then
// L bytes of meta.json (L = 0: no meta.json), then the token file's bytes.
#include <cstddef>
#include <cstdint>
#include <filesystem>

#include "fuzz_common.h"
#include "xmoe/data/token_file.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  xmoe::fuzz::quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t meta_size = std::min<size_t>(size - 2, data[0] | (size_t{data[1]} << 8));
  const auto dir = xmoe::fuzz::scratch_dir();
  std::filesystem::remove(dir / "meta.json");
  if (meta_size > 0) xmoe::fuzz::write_bytes(dir / "meta.json", data + 2, meta_size);
  xmoe::fuzz::write_bytes(dir / "train.bin", data + 2 + meta_size, size - 2 - meta_size);
  xmoe::fuzz::expect_clean_error([&] {
    const auto file = xmoe::data::TokenFile::open((dir / "train.bin").string());
    int32_t first = 0;
    if (file.size() > 0) file.read(0, 1, &first);
  });
  return 0;
}
