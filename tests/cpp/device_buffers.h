// Test helper: a device buffer's first elements, downloaded to the host.
#pragma once

#include <vector>

#include "runtime/runtime.h"

namespace tpu::test_util {

inline std::vector<float> host(const runtime::BufferPtr& b, size_t n) {
  std::vector<float> out(n);
  runtime::Runtime::get().download(*b, out.data(), n * sizeof(float));
  return out;
}

}  // namespace tpu::test_util
