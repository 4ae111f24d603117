// Units for fused eager's pending graph (runtime layer).
#include "fused/engine/fused_graph.h"

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "device_buffers.h"
#include "runtime/runtime.h"
#include "runtime/views.h"

using namespace tpu;
using tpu::test_util::host;

// Autograd's device thread frees tensors while the main thread materialises
// the pending graph (a compiled graph's replay flushes its arguments). A
// pending array freed then must be neither read nor written by the
// materialisation; the arrays still alive get their values.
TEST(LazyGraph, ArraysFreedOnAnotherThreadWhileTheGraphMaterializes) {
  constexpr int64_t kN = 4096;
  constexpr int kArrays = 48;
  std::vector<float> ones(kN, 1.0f);
  runtime::DeviceArray src(0, kN * sizeof(float));
  src.set(runtime::Runtime::get().upload(ones.data(), ir::DType::F32, {kN}, 0), ir::DType::F32, kN);
  auto& fusion = runtime::Fusion::get();
  for (int round = 0; round < 30; ++round) {
    std::vector<std::unique_ptr<runtime::DeviceArray>> doomed, kept;
    {
      std::lock_guard<runtime::FusionMutex> lock(fusion.mutex());
      auto& graph = fusion.graph(0);
      ir::Builder& b = graph.builder();
      ir::Value x = graph.storage(src, ir::DType::F32);
      for (int i = 0; i < kArrays; ++i) {
        auto a = std::make_unique<runtime::DeviceArray>(0, kN * sizeof(float));
        ir::Value v = b.binary("add", x, b.constant(i, ir::DType::F32, {kN}));
        graph.bind(*a, v, ir::DType::F32);
        (i % 2 ? kept : doomed).push_back(std::move(a));
      }
    }
    std::thread freer([&] {
      for (auto& a : doomed) {
        a.reset();
        std::this_thread::yield();
      }
    });
    fusion.flush(0);
    freer.join();
    for (int i = 0; i < kArrays / 2; ++i) {
      ASSERT_TRUE(kept[i]->materialized()) << "round " << round << " array " << i;
      EXPECT_EQ(host(kept[i]->buffer(), kN)[kN - 1], 2.0f + 2 * i);
    }
  }
}
