#pragma once
// What a module holds for one micro-batch, from its own formula. The memory model of a step
// (train/memory_model.h) adds these up; each module states its formula next to its code (a
// static activation_bytes_for), so the module and the model cannot drift apart unnoticed.
#include <cstdint>

namespace xmoe {

struct ActivationBytes {
  int64_t saved = 0;  ///< kept from forward until the module's backward
  /// The most the module's backward holds at once above `saved`: recomputed activations,
  /// temporaries, and the input gradient it returns (not the output gradient its caller passes
  /// in, which the caller holds).
  int64_t backward_extra = 0;
  /// Of `saved`, what stays held after the module's backward until the step's backward ends
  /// (the logits, which the loss's backward turns into their gradient in place; the batch).
  int64_t kept = 0;
};

}  // namespace xmoe
