// A checkpoint manifest. Its folder holds two valid rank files that xmoe wrote once at start
// (their sizes and checksums are in the seed manifests), so a mutated manifest reaches the file
// checks and the merge of the ranks' tensors, not only the JSON parser.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "fuzz_common.h"
#include "xmoe/train/checkpoint.h"

namespace {

namespace fs = std::filesystem;
using xmoe::Tensor;

std::map<std::string, Tensor> rank_tensors(int rank) {
  std::map<std::string, Tensor> m;
  m["shared"] = Tensor::from_vector<float>({1.f, 2.f, 3.f, 4.f}, {4}).to(xmoe::DType::bf16);
  if (rank == 0) m["w"] = Tensor::from_vector<float>({1.5f, -2.f, 3.25f, 0.f, 1e-3f, 7.f}, {2, 3});
  if (rank == 1) m["idx"] = Tensor::from_vector<int32_t>({-1, 2, 3}, {3});
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  xmoe::fuzz::quiet_logs();
  const fs::path dir = xmoe::fuzz::scratch_dir() / "step-1";
  fs::create_directories(dir);
  for (int rank = 0; rank < 2; ++rank)
    xmoe::train::write_checkpoint_shard(dir.string(), rank_tensors(rank), rank);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path dir = xmoe::fuzz::scratch_dir() / "step-1";
  xmoe::fuzz::write_bytes(dir / "manifest.json", data, size);
  xmoe::fuzz::expect_clean_error([&] { (void)xmoe::train::load_checkpoint(dir.string()); });
  xmoe::fuzz::expect_clean_error([&] { (void)xmoe::train::load_checkpoint_rank(dir.string(), 1); });
  return 0;
}
