#include "plugins/cpu/core_spinner.h"

#include <sched.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "runtime/env.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tpu::plugins::cpu {
namespace {

// How often a spinner yields its core (see run()).
constexpr int64_t kYieldNs = 50'000;

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Tells the core this is a spin loop (it yields the pipeline to a sibling
// hyperthread and saves power).
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

bool lowerToIdlePriority() {
#ifdef SCHED_IDLE
  sched_param p{};
  return sched_setscheduler(0, SCHED_IDLE, &p) == 0;  // 0: the calling thread
#else
  return false;
#endif
}

}  // namespace

std::chrono::microseconds CoreSpinner::lingerFromEnv() {
  const char* v = env::get("TORCH_TPU_CPU_SPIN_US");
  if (!v || !*v) return std::chrono::microseconds(2000);
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  if (*end || x < 0)
    throw std::invalid_argument(std::string("TORCH_TPU_CPU_SPIN_US='") + v +
                                "' must be a number of microseconds (0 turns spinning off)");
  return std::chrono::microseconds(x);
}

CoreSpinner::CoreSpinner(int threads, std::chrono::microseconds linger)
    : linger_ns_(std::chrono::duration_cast<std::chrono::nanoseconds>(linger).count()) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

CoreSpinner::~CoreSpinner() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

bool CoreSpinner::wanted() const { return in_flight_.load() > 0 || nowNs() < until_ns_.load(); }

void CoreSpinner::begin() {
  // Sequentially consistent with run()'s asleep_++ then wanted(): either the
  // spinner sees this launch, or this sees the spinner asleep and wakes it.
  if (in_flight_.fetch_add(1) == 0 && asleep_.load() > 0) {
    std::lock_guard<std::mutex> g(mu_);
    cv_.notify_all();
  }
}

void CoreSpinner::end() {
  until_ns_.store(nowNs() + linger_ns_);
  in_flight_.fetch_sub(1);
}

void CoreSpinner::run() {
  if (!lowerToIdlePriority()) return;
  active_++;
  int64_t last_yield = nowNs();
  while (!stop_.load(std::memory_order_relaxed)) {
    if (wanted()) {
      for (int i = 0; i < 32; ++i) relax();
      // The kernel does not always hand the core to a thread that becomes
      // runnable here: after a sched_yield, or a wake-up it did not preempt
      // for, the scheduler (EEVDF) can leave this SCHED_IDLE spinner on the
      // core for its whole slice, milliseconds. Yielding now and then bounds
      // that wait.
      const int64_t now = nowNs();
      if (now - last_yield >= kYieldNs) {
        sched_yield();
        yields_.fetch_add(1, std::memory_order_relaxed);
        last_yield = now;
      }
      continue;
    }
    std::unique_lock<std::mutex> l(mu_);
    asleep_++;
    cv_.wait(l, [this] { return stop_.load() || wanted(); });
    asleep_--;
  }
  active_--;
}

}  // namespace tpu::plugins::cpu
