#pragma once
// Model FLOPs utilisation (MFU): the training FLOPs a step needs by the PaLM count, against the
// peak of the device. The one place that states the peak.
#include <cstdint>

#include "xmoe/config/config.h"

namespace xmoe::train {

/// Dense bf16 tensor-core peak of one NVIDIA H100 / H200 SXM (without sparsity), FLOP/s.
constexpr double kPeakFlopsPerDevice = 989e12;

/// Training FLOPs per token (forward + backward), PaLM appendix B:
///   6 · N_active + 12 · L · d · S
/// N_active = count_parameters(model).active (k routed experts instead of E, embeddings
/// included), L layers, d = d_model (= heads · head_dim), S the sequence length (attention).
inline double training_flops_per_token(const ModelConfig& model, int64_t seq_len) {
  const double active = static_cast<double>(count_parameters(model).active);
  return 6.0 * active + 12.0 * model.num_layers * static_cast<double>(model.d_model) *
                            static_cast<double>(seq_len);
}

/// MFU of `tokens_per_s` tokens per second spread over `devices` devices.
inline double mfu(const ModelConfig& model, int64_t seq_len, double tokens_per_s, int devices) {
  return training_flops_per_token(model, seq_len) * tokens_per_s /
         (kPeakFlopsPerDevice * static_cast<double>(devices));
}

}  // namespace xmoe::train
