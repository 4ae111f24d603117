// Units for the core spinner: it spins only while launches are in flight and
// for its linger after, then sleeps; a launch always ends, even on failure.
#include "plugins/cpu/core_spinner.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <functional>
#include <stdexcept>
#include <thread>

#include "runtime/plugin.h"

using tpu::plugins::cpu::CoreSpinner;
using tpu::runtime::LaunchScope;
using namespace std::chrono_literals;

namespace {
// Polls `cond` for up to 10 s (the machine may be busy).
bool eventually(const std::function<bool()>& cond) {
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return cond();
}

// Stands in for pjrt::Event: keeps the callback, or fails to register it.
struct FakeEvent {
  mutable std::function<void()> cb;
  bool fail = false;
  void onReady(std::function<void()> fn) const {
    if (fail) throw std::runtime_error("PJRT_Event_OnReady failed");
    cb = std::move(fn);
  }
};

// Launch hooks that drive a spinner, as the CPU plugin's support does.
struct SpinnerHooks final : tpu::runtime::PluginSupport {
  explicit SpinnerHooks(CoreSpinner& s) : spinner(s) {}
  const char* name() const override { return "test"; }
  bool wantsLaunchHooks() const override { return true; }
  void launchBegin() override { spinner.begin(); }
  void launchEnd() override { spinner.end(); }
  CoreSpinner& spinner;
};

// Spinners need SCHED_IDLE; where the system refuses it they do not run.
bool spinnersRun(const CoreSpinner& s, int n) {
  return eventually([&] { return s.activeThreads() == n; });
}
}  // namespace

TEST(CoreSpinner, SleepsWhenIdleSpinsWhileInFlightThenSleepsAfterLinger) {
  CoreSpinner s(2, 5ms);
  if (!spinnersRun(s, 2)) GTEST_SKIP() << "SCHED_IDLE is not available here";
  ASSERT_TRUE(eventually([&] { return s.asleep() == 2; }));
  s.begin();
  ASSERT_TRUE(eventually([&] { return s.asleep() == 0; }));
  std::this_thread::sleep_for(30ms);  // well past the linger: still in flight
  EXPECT_EQ(s.asleep(), 0);
  auto ended = std::chrono::steady_clock::now();
  s.end();
  ASSERT_TRUE(eventually([&] { return s.asleep() == 2; }));
  EXPECT_GE(std::chrono::steady_clock::now() - ended, 5ms);
  EXPECT_EQ(s.inFlight(), 0);
}

// A spinner must not keep its core from a thread that became runnable there:
// it yields now and then while it spins, and not at all while it sleeps.
TEST(CoreSpinner, YieldsItsCoreWhileSpinningOnly) {
  CoreSpinner s(1, 1ms);
  if (!spinnersRun(s, 1)) GTEST_SKIP() << "SCHED_IDLE is not available here";
  ASSERT_TRUE(eventually([&] { return s.asleep() == 1; }));
  const int64_t before = s.yields();
  s.begin();
  EXPECT_TRUE(eventually([&] { return s.yields() >= before + 10; }));  // one per 50 us of spinning
  s.end();
  ASSERT_TRUE(eventually([&] { return s.asleep() == 1; }));
  const int64_t asleep = s.yields();
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(s.yields(), asleep);
}

TEST(CoreSpinner, AsyncLaunchEndsWhenItsEventFires) {
  CoreSpinner s(1, 1ms);
  SpinnerHooks hooks(s);
  FakeEvent ev;
  {
    LaunchScope launch(&hooks);
    launch.endWhenReady(ev);
  }
  EXPECT_EQ(s.inFlight(), 1);  // the launch outlives its guard
  ASSERT_TRUE(ev.cb);
  ev.cb();
  EXPECT_EQ(s.inFlight(), 0);
}

TEST(CoreSpinner, LaunchEndsWhenItFails) {
  CoreSpinner s(1, 1ms);
  SpinnerHooks hooks(s);
  EXPECT_THROW(
      {
        LaunchScope launch(&hooks);
        throw std::runtime_error("PJRT_LoadedExecutable_Execute failed");
      },
      std::runtime_error);
  EXPECT_EQ(s.inFlight(), 0);
  FakeEvent bad{{}, true};
  EXPECT_THROW(
      {
        LaunchScope launch(&hooks);
        launch.endWhenReady(bad);
      },
      std::runtime_error);
  EXPECT_EQ(s.inFlight(), 0);
  LaunchScope none(nullptr);  // no hooks (another plugin): nothing to count
  none.endWhenReady(bad);
}

TEST(CoreSpinner, LingerFromEnvironment) {
  unsetenv("TORCH_TPU_CPU_SPIN_US");
  EXPECT_EQ(CoreSpinner::lingerFromEnv(), 2000us);
  setenv("TORCH_TPU_CPU_SPIN_US", "0", 1);
  EXPECT_EQ(CoreSpinner::lingerFromEnv(), 0us);
  setenv("TORCH_TPU_CPU_SPIN_US", "150", 1);
  EXPECT_EQ(CoreSpinner::lingerFromEnv(), 150us);
  for (const char* bad : {"-1", "2ms", "x"}) {
    setenv("TORCH_TPU_CPU_SPIN_US", bad, 1);
    EXPECT_THROW(CoreSpinner::lingerFromEnv(), std::invalid_argument) << bad;
  }
  unsetenv("TORCH_TPU_CPU_SPIN_US");
}
