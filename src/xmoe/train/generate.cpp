#include "xmoe/train/generate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/core/rng.h"
#include "xmoe/data/prepare.h"
#include "xmoe/data/tokenizer.h"
#include "xmoe/model/transformer.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/state.h"

namespace xmoe::train {

namespace {

/// Samples one token id from logits [V] with temperature and top-k.
int sample(const float* logits, int64_t vocab, const GenerateOptions& o, Rng& rng) {
  if (o.temperature <= 0)
    return static_cast<int>(std::max_element(logits, logits + vocab) - logits);
  std::vector<int> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  const int64_t k = o.top_k > 0 ? std::min<int64_t>(o.top_k, vocab) : vocab;
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int a, int b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  std::vector<double> p(static_cast<size_t>(k));
  const double mx = logits[ids[0]];
  double total = 0;
  for (int64_t i = 0; i < k; ++i) total += p[i] = std::exp((logits[ids[i]] - mx) / o.temperature);
  double u = rng.uniform() * total;
  for (int64_t i = 0; i < k; ++i) {
    u -= p[i];
    if (u <= 0) return ids[i];
  }
  return ids[k - 1];
}

}  // namespace

std::string generate(const std::string& checkpoint, const GenerateOptions& options) {
  std::string dir = checkpoint;
  if (!std::filesystem::exists(std::filesystem::path(dir) / "manifest.json")) {
    const auto latest = latest_checkpoint(dir);
    XMOE_CHECK(latest.has_value(),
               "[generate] {} is neither a checkpoint nor a run folder with one", checkpoint);
    dir = *latest;
  }
  const Checkpoint ckpt = load_checkpoint(dir);
  const Config config =
      load_config_string(ckpt.state.at("config").get<std::string>(), dir + "/manifest.json");
  // The tokenizer the run trained with (its copy in the checkpoint), unless one is given.
  const std::string tokenizer_path =
      options.tokenizer.empty() ? checkpoint_tokenizer(dir, ckpt) : options.tokenizer;
  const std::unique_ptr<data::Tokenizer> tok = data::load_tokenizer(tokenizer_path);
  XMOE_CHECK(tok->vocab_size() <= config.model.vocab_size,
             "[generate] the {} tokenizer has {} tokens, more than the checkpoint's "
             "model.vocab_size ({})",
             tok->name(), tok->vocab_size(), config.model.vocab_size);
  model::Transformer model(config.model, config.train.seed);
  restore_parameters(ckpt.tensors, model.parameters(), dir);
  restore_routing_biases(ckpt.tensors, model.moe_layers(), dir);

  std::vector<int32_t> ids;
  for (uint32_t t : tok->encode(options.prompt)) ids.push_back(static_cast<int32_t>(t));
  if (ids.empty()) ids.push_back(tok->eos_id() >= 0 ? static_cast<int32_t>(tok->eos_id()) : '\n');
  Rng rng(options.seed, stream_id("generate"));
  // Positions past the trained sequence length were never seen: slide a window of that size.
  const int64_t window = std::min(config.train.seq_len, config.model.max_seq_len);
  const int64_t vocab = config.model.vocab_size;
  std::vector<uint32_t> generated;
  for (int i = 0; i < options.max_new_tokens; ++i) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(ids.size()), window);
    std::vector<int32_t> context(ids.end() - n, ids.end());
    const Tensor logits = model.forward(Tensor::from_vector(context, {1, n}));
    model.release();
    // Ids past the tokenizer's vocabulary (a model.vocab_size rounded up) are never sampled.
    const int next =
        sample(logits.data<float>() + (n - 1) * vocab, tok->vocab_size(), options, rng);
    ids.push_back(next);
    generated.push_back(static_cast<uint32_t>(next));
  }
  return options.prompt + tok->decode(generated);
}

}  // namespace xmoe::train
