// Keeps the host's cores awake while the CPU plugin runs programs.
//
// XLA:CPU hands each program's parallel loops, matmuls and host kernels to
// its worker threads, which park between them. On a virtual machine whose
// idle vCPUs halt, every wake-up of a parked worker then waits for the
// hypervisor to resume a halted vCPU. Spinning threads at SCHED_IDLE keep the
// vCPUs running: any normal thread that wakes preempts them at once, so they
// take no time from real work. They spin while programs are in flight and for
// a short linger after the last one finishes (the host's Python between
// launches), then sleep. This is the policy of OpenMP's spin-wait, applied to
// cores rather than to the workers XLA owns. While spinning they yield every
// 50 us, because a SCHED_IDLE thread is not always preempted at once: after
// another thread's sched_yield, the kernel's scheduler (EEVDF) may leave the
// spinner on the core for its whole time slice, a few milliseconds.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace tpu::plugins::cpu {

class CoreSpinner {
 public:
  // `threads` spinners; `linger`: how long they keep spinning once nothing
  // is in flight. Threads that cannot lower themselves to SCHED_IDLE exit
  // (a spinner at normal priority would compete with the work).
  CoreSpinner(int threads, std::chrono::microseconds linger);
  ~CoreSpinner();
  CoreSpinner(const CoreSpinner&) = delete;
  CoreSpinner& operator=(const CoreSpinner&) = delete;

  // A program was launched / finished. Cheap: atomics, plus a notify only
  // when spinners sleep.
  void begin();
  void end();

  // Spinners that run at SCHED_IDLE (for tests and metrics).
  int activeThreads() const { return active_.load(); }
  // Spinners asleep now (tests: all of them, once idle past the linger).
  int asleep() const { return asleep_.load(); }
  int inFlight() const { return in_flight_.load(); }
  // Times the spinners yielded their cores (tests).
  int64_t yields() const { return yields_.load(); }

  // TORCH_TPU_CPU_SPIN_US: the linger in microseconds; 0 turns spinning off.
  // Default 2000. Throws std::invalid_argument on a malformed value.
  static std::chrono::microseconds lingerFromEnv();

 private:
  void run();
  bool wanted() const;

  const int64_t linger_ns_;
  std::atomic<int> in_flight_{0};
  std::atomic<int64_t> until_ns_{0};  // steady-clock time the linger ends
  std::atomic<int> asleep_{0};
  std::atomic<int> active_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> yields_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
};

}  // namespace tpu::plugins::cpu
