#pragma once
// The collective watchdog (parallel.collective_timeout_s): a rank that stops answering — a
// hang, a deadlock, a process stopped by a debugger, a dead node whose peers are left waiting —
// makes every rank wait in a collective forever. A group with a watchdog records the name of
// each collective it is in (Group's public calls, and the wait() of their async Work); a thread
// checks a few times per timeout, and one in flight longer than the timeout ends the job: a
// line naming this rank, the collective, its group and the timeout on stderr, then
// Group::abort(kExitCollectiveTimeout) (MPI_Abort; on NCCL ncclCommAbort first, which frees the
// device from the kernels that wait for a missing peer). Every rank blocked on the missing one
// fires within the timeout (plus one check interval), so the whole job ends.
//
// Cost per collective: one uncontended mutex, a clock read and a vector push/erase (measured in
// docs/benchmarks.md).
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace xmoe::comm {

class Group;

/// Exit code of every rank when the watchdog ended the job (as GNU timeout's).
inline constexpr int kExitCollectiveTimeout = 124;

class Watchdog {
 public:
  /// What ends the job: by default, the message on stderr and group.abort(kExitCollectiveTimeout).
  using OnTimeout = std::function<void(const std::string& message, Group& group)>;

  /// `timeout_s` > 0. `config_key` is named in the message (the knob that sets the timeout).
  explicit Watchdog(double timeout_s, std::string config_key = "parallel.collective_timeout_s",
                    OnTimeout on_timeout = {});
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// Watches a collective that blocks the calling thread while the Scope lives.
  class Scope {
   public:
    Scope() = default;
    Scope(Watchdog* w, uint64_t id) : w_(w), id_(id) {}
    ~Scope() {
      if (w_) w_->disarm(id_);
    }
    Scope(Scope&& o) noexcept : w_(std::exchange(o.w_, nullptr)), id_(o.id_) {}
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    Scope& operator=(Scope&&) = delete;

   private:
    Watchdog* w_ = nullptr;
    uint64_t id_ = 0;
  };
  Scope watch(const char* collective, Group& group);
  /// Watches a collective queued on a device: it counts as done once `drained()` (polled from
  /// the watchdog's thread) returns true, e.g. its stream went idle.
  void watch_queued(const char* collective, Group& group, std::function<bool()> drained);
  /// Drops the queued entries of `group` (before the group is destroyed).
  void forget(const Group& group);

  double timeout_s() const { return timeout_s_; }
  /// Collectives in flight now (for tests).
  size_t in_flight() const;

 private:
  struct Entry {
    uint64_t id;
    const char* collective;
    Group* group;
    std::chrono::steady_clock::time_point since;
    std::function<bool()> drained;  // empty: a blocking call, ended by its Scope
  };
  void disarm(uint64_t id);
  void run();

  const double timeout_s_;
  const std::string config_key_;
  OnTimeout on_timeout_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Entry> entries_;
  uint64_t next_id_ = 1;
  bool stop_ = false;
  bool fired_ = false;
  std::thread thread_;
};

}  // namespace xmoe::comm
