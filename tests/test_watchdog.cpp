// The collective watchdog (comm/watchdog.h) in one process: a watched call that outlives the
// timeout is reported with its name, the knob and the timeout; short calls and drained queued
// collectives are not; its cost per collective is measured.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "testing.h"
#include "xmoe/comm/group.h"
#include "xmoe/comm/watchdog.h"
#include "xmoe/core/timer.h"

using namespace xmoe;
using xmoe::testing::error_of;

namespace {

/// Records what the watchdog would end the job with.
struct Fired {
  std::mutex mutex;
  std::string message;
  int count = 0;
  comm::Watchdog::OnTimeout handler() {
    return [this](const std::string& m, comm::Group&) {
      std::lock_guard<std::mutex> lock(mutex);
      message = m;
      ++count;
    };
  }
  int fired() {
    std::lock_guard<std::mutex> lock(mutex);
    return count;
  }
};

void sleep_s(double s) {
  std::this_thread::sleep_for(std::chrono::duration<double>(s));
}

}  // namespace

TEST(Watchdog, ACallPastTheTimeoutIsReportedWithItsName) {
  Fired fired;
  auto group = comm::make_single_group();
  comm::Watchdog w(0.2, "parallel.collective_timeout_s", fired.handler());
  {
    const comm::Watchdog::Scope scope = w.watch("all_reduce", *group);
    EXPECT_EQ(w.in_flight(), 1u);
    sleep_s(0.6);
  }
  EXPECT_EQ(w.in_flight(), 0u);
  ASSERT_EQ(fired.fired(), 1);  // once: the job ends at the first
  EXPECT_CONTAINS(fired.message,
                  "[watchdog] all_reduce did not complete within "
                  "parallel.collective_timeout_s = 0.2 s");
  EXPECT_CONTAINS(fired.message, "rank 0 of 1");
}

TEST(Watchdog, ShortCallsAndDrainedQueuedCollectivesAreNotReported) {
  Fired fired;
  auto group = comm::make_single_group();
  comm::Watchdog w(1.0, "k", fired.handler());
  std::atomic<bool> drained{false};
  w.watch_queued("all_to_all_v", *group, [&] { return drained.load(); });
  sleep_s(0.1);
  drained = true;  // the queued collective finished within the timeout
  for (int i = 0; i < 20; ++i) {
    const comm::Watchdog::Scope scope = w.watch("barrier", *group);
    sleep_s(0.02);
  }
  sleep_s(1.5);
  EXPECT_EQ(fired.fired(), 0) << fired.message;
  EXPECT_EQ(w.in_flight(), 0u);
}

TEST(Watchdog, AQueuedCollectiveThatNeverDrainsIsReported) {
  Fired fired;
  auto group = comm::make_single_group();
  comm::Watchdog w(0.2, "k", fired.handler());
  w.watch_queued("broadcast", *group, [] { return false; });
  sleep_s(0.6);
  ASSERT_EQ(fired.fired(), 1);
  EXPECT_CONTAINS(fired.message, "broadcast did not complete within k = 0.2 s");
}

TEST(Watchdog, ForgetDropsAGroupsQueuedCollectives) {
  Fired fired;
  auto group = comm::make_single_group();
  comm::Watchdog w(0.2, "k", fired.handler());
  w.watch_queued("all_reduce", *group, [] { return false; });
  w.forget(*group);
  sleep_s(0.4);
  EXPECT_EQ(fired.fired(), 0);
}

TEST(Watchdog, ZeroTimeoutIsRefusedNamingTheKey) {
  EXPECT_CONTAINS(error_of([] { comm::Watchdog w(0, "parallel.collective_timeout_s"); }),
                  "[watchdog] parallel.collective_timeout_s = 0 must be > 0");
}

TEST(Watchdog, GroupsSplitFromAWatchedGroupAreWatched) {
  Fired fired;
  auto group = comm::make_single_group();
  auto w = std::make_shared<comm::Watchdog>(600, "k", fired.handler());
  group->set_watchdog(w);
  EXPECT_EQ(group->split(0, 0)->watchdog(), w);
  group->set_watchdog(nullptr);
  EXPECT_EQ(group->split(0, 0)->watchdog(), nullptr);
}

// The cost a watched collective adds: a mutex, a clock read and a vector push/erase per call,
// and a Work wrapper for the async ones. Measured on the single-process group, whose
// collectives themselves cost next to nothing (docs/benchmarks.md has the figures).
TEST(Watchdog, CostPerCollectiveIsSmall) {
  auto group = comm::make_single_group();
  Tensor t = Tensor::from_vector<float>({1.f}, {1});
  const int n = 200000;
  auto time_all_reduce = [&] {
    Timer timer;
    for (int i = 0; i < n; ++i) group->all_reduce(t);
    return timer.seconds() / n * 1e9;
  };
  const double plain_ns = time_all_reduce();
  group->set_watchdog(std::make_shared<comm::Watchdog>(600));
  const double watched_ns = time_all_reduce();
  group->set_watchdog(nullptr);
  std::printf(
      "{\"bench\": \"watchdog_overhead\", \"group\": \"single\", \"all_reduce_ns\": %.1f, "
      "\"watched_all_reduce_ns\": %.1f, \"added_ns\": %.1f}\n",
      plain_ns, watched_ns, watched_ns - plain_ns);
#ifdef NDEBUG
  // An MPI all-reduce of one number takes microseconds; the watchdog must add far less.
  EXPECT_LT(watched_ns - plain_ns, 2000.0);
#else
  GTEST_SKIP() << "timed only in optimised builds (Debug and the sanitizers make every call slow)";
#endif
}
