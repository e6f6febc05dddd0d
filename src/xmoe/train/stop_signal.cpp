#include "xmoe/train/stop_signal.h"

#include <fmt/format.h>

#include <atomic>
#include <csignal>

namespace xmoe::train {

namespace {

std::atomic<int> g_received{0};
static_assert(std::atomic<int>::is_always_lock_free);

struct sigaction g_previous_term, g_previous_int;

extern "C" void on_stop_signal(int signal) {
  int none = 0;
  if (g_received.compare_exchange_strong(none, signal)) return;
  // A second signal: the default action (the process ends by the signal, now).
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

}  // namespace

StopSignalHandlers::StopSignalHandlers() {
  g_received.store(0);
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // reads and writes in progress go on
  sigaction(SIGTERM, &action, &g_previous_term);
  sigaction(SIGINT, &action, &g_previous_int);
}

StopSignalHandlers::~StopSignalHandlers() {
  sigaction(SIGTERM, &g_previous_term, nullptr);
  sigaction(SIGINT, &g_previous_int, nullptr);
}

int stop_signal_received() {
  return g_received.load();
}

std::string signal_name(int signal) {
  if (signal == SIGTERM) return "SIGTERM";
  if (signal == SIGINT) return "SIGINT";
  return fmt::format("signal {}", signal);
}

}  // namespace xmoe::train
