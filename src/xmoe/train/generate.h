#pragma once
// Sampling text from a trained checkpoint (byte-level vocabulary).
#include <cstdint>
#include <string>

namespace xmoe::train {

struct GenerateOptions {
  std::string prompt;
  int max_new_tokens = 256;
  float temperature = 0.8f;  ///< 0 = greedy
  int top_k = 40;            ///< 0 = whole vocabulary
  uint64_t seed = 0;
  /// Tokenizer file for the prompt and the output; "" = the run's, which the checkpoint
  /// carries (train::checkpoint_tokenizer).
  std::string tokenizer;
};

/// Loads the checkpoint folder (a `step-N` folder, or a run folder: its latest checkpoint) and
/// returns prompt + sampled continuation. Deterministic for a fixed seed.
std::string generate(const std::string& checkpoint, const GenerateOptions& options);

}  // namespace xmoe::train
