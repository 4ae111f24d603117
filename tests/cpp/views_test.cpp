// Units for strided view reads/writes over a device array (runtime layer).
#include "runtime/views.h"

#include <gtest/gtest.h>

#include <numeric>

#include "device_buffers.h"

using namespace tpu;
using tpu::test_util::host;

namespace {

std::unique_ptr<runtime::DeviceArray> filled(int64_t n) {
  std::vector<float> host(n);
  std::iota(host.begin(), host.end(), 0.0f);
  auto a = std::make_unique<runtime::DeviceArray>(0, n * sizeof(float));
  a->set(runtime::Runtime::get().upload(host.data(), ir::DType::F32, {n}, 0), ir::DType::F32, n);
  return a;
}

}  // namespace

TEST(Views, ContiguousSliceWithOffset) {
  auto ap = filled(12);
  runtime::ViewGeometry g{ir::DType::F32, {2, 3}, {3, 1}, 5};
  EXPECT_EQ(host(runtime::readView(*ap, g), 6), (std::vector<float>{5, 6, 7, 8, 9, 10}));
}

TEST(Views, TransposeIsDensePermuted) {
  auto ap = filled(6);  // [[0,1,2],[3,4,5]]
  runtime::ViewGeometry g{ir::DType::F32, {3, 2}, {1, 3}, 0};
  EXPECT_EQ(host(runtime::readView(*ap, g), 6), (std::vector<float>{0, 3, 1, 4, 2, 5}));
}

TEST(Views, SteppedSliceReadsAsABox) {
  auto ap = filled(12);  // 3x4
  runtime::ViewGeometry g{ir::DType::F32, {2, 2}, {8, 2}, 1};
  EXPECT_EQ(host(runtime::readView(*ap, g), 4), (std::vector<float>{1, 3, 9, 11}));
}

// The last column of a 3x4 matrix: its window padded to whole rows runs past
// the end of the storage, which must not shift the read.
TEST(Views, BoxWindowPastTheEndOfStorage) {
  auto ap = filled(12);
  runtime::ViewGeometry g{ir::DType::F32, {3}, {4}, 3};
  EXPECT_EQ(host(runtime::readView(*ap, g), 3), (std::vector<float>{3, 7, 11}));
}

// One head's block of a fused QKV projection, transposed to (head, token, dim)
// (a transposing box: read alone on XLA:CPU by the gather):
// storage [tokens=3, 3 * heads=2 * dim=2], k starts at column 4.
TEST(Views, PerHeadSplitOfAFusedProjection) {
  auto ap = filled(36);  // 3 tokens x 12
  runtime::ViewGeometry g{ir::DType::F32, {2, 3, 2}, {2, 12, 1}, 4};
  std::vector<float> want;
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 3; ++t)
      for (int d = 0; d < 2; ++d) want.push_back(static_cast<float>(t * 12 + 4 + h * 2 + d));
  EXPECT_EQ(host(runtime::readView(*ap, g), 12), want);
}

// The same per-head split read inside a graph (not standalone): a slice of
// its window and a transpose, whatever the plugin.
TEST(Views, PerHeadSplitInsideAGraphIsASliceAndATranspose) {
  auto ap = filled(36);
  runtime::ViewGeometry g{ir::DType::F32, {2, 3, 2}, {2, 12, 1}, 4};
  ir::Builder b;
  ir::Value flat = b.param({ir::DType::F32, {36}});
  b.output(runtime::buildRead(b, flat, b.constantInt(4, ir::DType::I64), g, /*standalone=*/false));
  std::string text = b.emit();
  EXPECT_EQ(text.find("stablehlo.gather"), std::string::npos) << text;
  EXPECT_NE(text.find("stablehlo.transpose"), std::string::npos) << text;
  auto prog = runtime::Runtime::get().compile(b, "view_read_test");
  auto out = runtime::execute(*prog, {ap->buffer()}, 0)[0];
  std::vector<float> want;
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 3; ++t)
      for (int d = 0; d < 2; ++d) want.push_back(static_cast<float>(t * 12 + 4 + h * 2 + d));
  EXPECT_EQ(host(out, 12), want);
}

// Overlapping windows (an as_strided unfold) cannot be a box: the gather reads them.
TEST(Views, OverlappingViewFallsBackToGather) {
  auto ap = filled(6);
  runtime::ViewGeometry g{ir::DType::F32, {3, 3}, {1, 1}, 1};
  EXPECT_EQ(host(runtime::readView(*ap, g), 9), (std::vector<float>{1, 2, 3, 2, 3, 4, 3, 4, 5}));
}

TEST(Views, WriteThroughSteppedViewKeepsTheRest) {
  auto ap = filled(12);  // 3x4; write [1::1, ::2] = rows 1-2, columns 0 and 2
  std::vector<float> v{-1, -2, -3, -4};
  auto vb = runtime::Runtime::get().upload(v.data(), ir::DType::F32, {4}, 0);
  runtime::ViewGeometry g{ir::DType::F32, {2, 2}, {4, 2}, 4};
  runtime::writeView(*ap, g, vb);
  EXPECT_EQ(host(ap->buffer(), 12), (std::vector<float>{0, 1, 2, 3, -1, 5, -2, 7, -3, 9, -4, 11}));
}

// A transposed stepped view written at the end of the storage.
TEST(Views, WriteThroughTransposedSteppedViewAtTheEnd) {
  auto ap = filled(12);                  // 3x4; view = columns 1 and 3 of rows 1-2, transposed (2x2)
  std::vector<float> v{-1, -2, -3, -4};  // [[-1,-2],[-3,-4]] -> (col1: rows 1,2), (col3: rows 1,2)
  auto vb = runtime::Runtime::get().upload(v.data(), ir::DType::F32, {4}, 0);
  runtime::ViewGeometry g{ir::DType::F32, {2, 2}, {2, 4}, 5};
  runtime::writeView(*ap, g, vb);
  EXPECT_EQ(host(ap->buffer(), 12), (std::vector<float>{0, 1, 2, 3, 4, -1, 6, -3, 8, -2, 10, -4}));
}

TEST(Views, ExpandBroadcasts) {
  auto ap = filled(3);
  runtime::ViewGeometry g{ir::DType::F32, {2, 3}, {0, 1}, 0};
  EXPECT_EQ(host(runtime::readView(*ap, g), 6), (std::vector<float>{0, 1, 2, 0, 1, 2}));
}

TEST(Views, WriteThroughStridedViewKeepsTheRest) {
  auto ap = filled(6);
  std::vector<float> v{-1, -2};
  auto vb = runtime::Runtime::get().upload(v.data(), ir::DType::F32, {2}, 0);
  runtime::ViewGeometry col{ir::DType::F32, {2}, {3}, 1};  // column 1 of 2x3
  runtime::writeView(*ap, col, vb);
  EXPECT_EQ(host(ap->buffer(), 6), (std::vector<float>{0, -1, 2, 3, -2, 5}));
}

TEST(Views, UnwrittenArrayReadsAsZeros) {
  runtime::DeviceArray a(0, 4 * sizeof(float));
  runtime::ViewGeometry g{ir::DType::F32, {4}, {1}, 0};
  EXPECT_EQ(host(runtime::readView(a, g), 4), (std::vector<float>{0, 0, 0, 0}));
}

TEST(Views, ReinterpretBytesAsAnotherDtype) {
  auto ap = filled(2);  // 0.0f, 1.0f
  runtime::ViewGeometry g{ir::DType::I32, {2}, {1}, 0};
  auto b = runtime::readView(*ap, g);
  std::vector<int32_t> out(2);
  runtime::Runtime::get().download(*b, out.data(), 8);
  EXPECT_EQ(out[0], 0);
  EXPECT_EQ(out[1], 0x3F800000);
}

// complex64 <-> float bytes go through (real, imag) pairs: bitcast_convert
// rejects complex types.
TEST(Views, ReinterpretComplexAndBack) {
  auto ap = filled(6);  // 0..5
  auto c = runtime::readView(*ap, runtime::ViewGeometry{ir::DType::C64, {3}, {1}, 0});
  EXPECT_EQ(host(c, 6), (std::vector<float>{0, 1, 2, 3, 4, 5}));  // (0+1j), (2+3j), (4+5j)
  EXPECT_EQ(ap->dtype(), ir::DType::C64);
  auto imag = runtime::readView(*ap, runtime::ViewGeometry{ir::DType::F32, {3}, {2}, 1});
  EXPECT_EQ(host(imag, 3), (std::vector<float>{1, 3, 5}));
  ensureTyped(*ap, ir::DType::C64);
  auto bits = runtime::readView(*ap, runtime::ViewGeometry{ir::DType::I32, {2}, {1}, 0});
  std::vector<int32_t> out(2);
  runtime::Runtime::get().download(*bits, out.data(), 8);
  EXPECT_EQ(out[1], 0x3F800000);
}

TEST(Memory, LimitRaisesOutOfMemory) {
  int64_t limit = runtime::Runtime::get().memoryLimit(0);
  EXPECT_THROW(runtime::DeviceArray(0, static_cast<size_t>(limit) + 1), runtime::OutOfMemory);
  runtime::DeviceArray ok(0, 16);  // still usable afterwards
  EXPECT_EQ(ok.nbytes(), 16u);
}

// The builder follows a noted view through reshapes, transposes and slices,
// so that a kernel taking strided operands (attention's q, k and v) can read
// the storage in place.
TEST(BuilderViews, FollowReshapesTransposesAndSlices) {
  ir::Builder b;
  auto flat = b.param({ir::DType::F32, {200}});
  EXPECT_FALSE(b.viewOf(flat));
  // A packed projection, 2 x 4 rows of 24, read from 8 elements in.
  auto rows = b.reshape(b.slice(flat, {8}, {200}, {1}), {2, 4, 24});
  EXPECT_FALSE(b.viewOf(rows));  // only noted values are followed
  b.noteView(rows, ir::StridedView{flat, 8, {96, 24, 1}});
  auto k = b.slice(rows, {0, 0, 8}, {2, 4, 16}, {1, 1, 1});  // the middle 8 columns
  auto kv = b.viewOf(k);
  ASSERT_TRUE(kv);
  EXPECT_EQ(kv->base.id, flat.id);
  EXPECT_EQ(kv->offset, 16);
  EXPECT_EQ(kv->strides, (std::vector<int64_t>{96, 24, 1}));
  auto heads = b.transpose(b.reshape(k, {2, 4, 2, 4}), {0, 2, 1, 3});  // [B, H, L, E]
  auto hv = b.viewOf(heads);
  ASSERT_TRUE(hv);
  EXPECT_EQ(hv->offset, 16);
  EXPECT_EQ(hv->strides, (std::vector<int64_t>{96, 4, 24, 1}));
  // Batch and rows merge (rows are 24 apart, batches 4 rows); the 8 columns
  // of different rows do not.
  auto merged = b.viewOf(b.reshape(k, {8, 8}));
  ASSERT_TRUE(merged);
  EXPECT_EQ(merged->strides, (std::vector<int64_t>{24, 1}));
  EXPECT_FALSE(b.viewOf(b.reshape(k, {64})));
  EXPECT_FALSE(b.viewOf(b.reshape(k, {2, 32})));
  // Stepped slices scale the strides.
  auto every_other = b.viewOf(b.slice(k, {0, 1, 0}, {2, 4, 8}, {1, 2, 1}));
  ASSERT_TRUE(every_other);
  EXPECT_EQ(every_other->offset, 40);
  EXPECT_EQ(every_other->strides, (std::vector<int64_t>{96, 48, 1}));
}
