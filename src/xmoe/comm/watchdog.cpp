#include "xmoe/comm/watchdog.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "xmoe/comm/group.h"
#include "xmoe/core/error.h"

namespace xmoe::comm {

Watchdog::Watchdog(double timeout_s, std::string config_key, OnTimeout on_timeout)
    : timeout_s_(timeout_s),
      config_key_(std::move(config_key)),
      on_timeout_(std::move(on_timeout)) {
  XMOE_CHECK(timeout_s > 0, "[watchdog] {} = {} must be > 0 (0 turns the watchdog off)",
             config_key_, timeout_s);
  if (!on_timeout_)
    on_timeout_ = [](const std::string& message, Group& group) {
      std::fprintf(stderr, "%s\n", message.c_str());
      std::fflush(stderr);
      group.abort(kExitCollectiveTimeout);
    };
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

Watchdog::Scope Watchdog::watch(const char* collective, Group& group) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t id = next_id_++;
  entries_.push_back({id, collective, &group, std::chrono::steady_clock::now(), {}});
  return Scope(this, id);
}

void Watchdog::watch_queued(const char* collective, Group& group, std::function<bool()> drained) {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.push_back(
      {next_id_++, collective, &group, std::chrono::steady_clock::now(), std::move(drained)});
}

void Watchdog::disarm(uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  // The entry is usually the newest one.
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it)
    if (it->id == id) {
      entries_.erase(std::next(it).base());
      return;
    }
}

void Watchdog::forget(const Group& group) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::erase_if(entries_, [&](const Entry& e) { return e.group == &group && e.drained; });
}

size_t Watchdog::in_flight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

void Watchdog::run() {
  // A few checks per timeout: a rank ends at most timeout + timeout/8 after its call began.
  const auto interval = std::chrono::duration<double>(std::clamp(timeout_s_ / 8, 0.01, 2.0));
  const auto timeout = std::chrono::duration<double>(timeout_s_);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    wake_.wait_for(lock, interval, [this] { return stop_; });
    if (stop_ || fired_) continue;
    // Queued device collectives whose stream drained are done (cheap queries, under the lock).
    std::erase_if(entries_, [](const Entry& e) { return e.drained && e.drained(); });
    const auto now = std::chrono::steady_clock::now();
    auto late = std::find_if(entries_.begin(), entries_.end(),
                             [&](const Entry& e) { return now - e.since > timeout; });
    if (late == entries_.end()) continue;
    fired_ = true;
    Group& group = *late->group;
    const double waited = std::chrono::duration<double>(now - late->since).count();
    // Which rank is missing is knowable in a pair (the other one); in a larger group the ranks
    // that print no such line are the missing ones.
    const std::string missing =
        group.size() == 2
            ? fmt::format("rank {} of that group stopped answering", 1 - group.rank())
            : std::string(
                  "a rank of that group stopped answering (a rank that prints no such "
                  "line is one missing)");
    const std::string message = fmt::format(
        "xmoe: rank {} of {}: error: [watchdog] {} did not complete within {} = {} s (waited "
        "{:.1f} s in a group of {} ranks, {}): {}. Ending the job (exit code {}).",
        group.rank(), group.size(), late->collective, config_key_, timeout_s_, waited, group.size(),
        group.backend_name(), missing, kExitCollectiveTimeout);
    lock.unlock();
    on_timeout_(message, group);
    lock.lock();
  }
}

}  // namespace xmoe::comm
