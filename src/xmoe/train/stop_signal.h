#pragma once
// SIGTERM and SIGINT during training: the first asks the trainer to finish its step, save a
// checkpoint and stop (docs/training.md, "Signals, kills and full disks"); a second one ends
// the process at once, by the signal's default action. The handler only stores the signal
// number in an atomic (async-signal-safe); the trainer polls it once per step.
#include <string>

namespace xmoe::train {

/// Exit code of `xmoe train` after a signal stopped it with a checkpoint: 128 + the signal
/// number, as a shell reports a process that the signal ended (143 for SIGTERM, 130 for SIGINT).
inline constexpr int kExitAfterSignalBase = 128;

/// Installs the handlers while alive and puts the previous ones back on destruction.
class StopSignalHandlers {
 public:
  StopSignalHandlers();
  ~StopSignalHandlers();
  StopSignalHandlers(const StopSignalHandlers&) = delete;
  StopSignalHandlers& operator=(const StopSignalHandlers&) = delete;
};

/// The first SIGTERM/SIGINT received since the handlers were installed; 0 if none.
int stop_signal_received();

/// "SIGTERM", "SIGINT", else "signal N".
std::string signal_name(int signal);

}  // namespace xmoe::train
