#include "runtime/slow_watch.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "runtime/env.h"

namespace tpu::runtime {
namespace {

using Clock = std::chrono::steady_clock;

struct Entry {
  std::string what;
  Clock::time_point start;
  int reports = 0;
};

// One thread for every watch, started at the first; it outlives them (never
// joined: the process may exit while a compile runs).
struct Watchdog {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Entry> entries;
  uint64_t next = 1;
  bool started = false;

  static Watchdog& get() {
    static Watchdog* w = new Watchdog();
    return *w;
  }

  void loop(double threshold) {
    std::unique_lock<std::mutex> l(mu);
    for (;;) {
      // A quarter of the threshold between looks (5 ms to 500 ms): reports come late by at most that.
      cv.wait_for(l, std::chrono::duration<double>(std::min(0.5, std::max(0.005, threshold / 4))));
      const auto now = Clock::now();
      for (auto& [id, e] : entries) {
        const double s = std::chrono::duration<double>(now - e.start).count();
        if (s < threshold * (e.reports + 1)) continue;
        ++e.reports;
        std::fprintf(stderr, "torch_tpu: still compiling %s after %.1f s\n", e.what.c_str(), s);
      }
    }
  }
};

}  // namespace

double SlowWatch::thresholdSeconds() {
  static const double t = [] {
    const char* v = env::get("TORCH_TPU_SLOW_COMPILE_S");
    if (!v || !*v) return 20.0;
    char* end = nullptr;
    const double d = std::strtod(v, &end);
    if (!end || *end != '\0' || !(d >= 0))
      throw std::invalid_argument(std::string("TORCH_TPU_SLOW_COMPILE_S must be a number of seconds >= 0, not '") +
                                  v + "'");
    return d;
  }();
  return t;
}

SlowWatch::SlowWatch(std::string what) {
  const double threshold = thresholdSeconds();
  if (threshold <= 0) return;
  auto& w = Watchdog::get();
  std::lock_guard<std::mutex> g(w.mu);
  if (!w.started) {
    w.started = true;
    std::thread([&w, threshold] { w.loop(threshold); }).detach();
  }
  id_ = w.next++;
  w.entries.emplace(id_, Entry{std::move(what), Clock::now(), 0});
}

SlowWatch::~SlowWatch() {
  if (!id_) return;
  auto& w = Watchdog::get();
  std::lock_guard<std::mutex> g(w.mu);
  auto it = w.entries.find(id_);
  if (it == w.entries.end()) return;
  if (it->second.reports > 0)
    std::fprintf(stderr, "torch_tpu: compiled %s in %.1f s\n", it->second.what.c_str(),
                 std::chrono::duration<double>(Clock::now() - it->second.start).count());
  w.entries.erase(it);
}

}  // namespace tpu::runtime
