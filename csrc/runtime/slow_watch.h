// Says on stderr what a long compile is doing, so that a program that takes
// minutes to compile is not mistaken for a hang: after TORCH_TPU_SLOW_COMPILE_S
// seconds (default 20; 0: never) it names the program and its size, again at
// each further multiple of that, and how long it took once it is done.
// No torch headers here.
#pragma once

#include <cstdint>
#include <string>

namespace tpu::runtime {

class SlowWatch {
 public:
  // `what`: "the program for aten::add (12 ops, 3 KB of StableHLO)", say.
  explicit SlowWatch(std::string what);
  ~SlowWatch();
  SlowWatch(const SlowWatch&) = delete;
  SlowWatch& operator=(const SlowWatch&) = delete;

  // Seconds after which a compile is reported (0: never).
  static double thresholdSeconds();

 private:
  uint64_t id_ = 0;
};

}  // namespace tpu::runtime
