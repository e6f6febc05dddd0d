// A token file and the meta.json beside it: the input's bytes before its first NUL are meta.json
// (none if empty), the bytes after it the token file. A separator, not a length, so that
// mutating the JSON text does not move the split.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>

#include "fuzz_common.h"
#include "xmoe/data/token_file.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  xmoe::fuzz::quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* nul = static_cast<const uint8_t*>(std::memchr(data, 0, size));
  const size_t meta_size = nul != nullptr ? static_cast<size_t>(nul - data) : size;
  const size_t tokens_begin = std::min(size, meta_size + 1);
  const auto dir = xmoe::fuzz::scratch_dir();
  std::filesystem::remove(dir / "meta.json");
  if (meta_size > 0) xmoe::fuzz::write_bytes(dir / "meta.json", data, meta_size);
  xmoe::fuzz::write_bytes(dir / "train.bin", data + tokens_begin, size - tokens_begin);
  xmoe::fuzz::expect_clean_error([&] {
    const auto file = xmoe::data::TokenFile::open((dir / "train.bin").string());
    int32_t first = 0;
    if (file.size() > 0) file.read(0, 1, &first);
  });
  return 0;
}
