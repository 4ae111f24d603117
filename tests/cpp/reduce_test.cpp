// Sums over the minor dim on the CPU plugin: split into [groups, lanes] so
// that XLA:CPU vectorizes them (ir::Builder::reduce), with the same values.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ops/common.h"
#include "runtime/views.h"

using namespace tpu;

namespace {

struct Case {
  ir::Shape shape;
  std::vector<int64_t> dims;
  ir::Shape split;  // the split operand's shape, or empty: not split
};

// Reference sums in double over `dims` of a row-major array.
std::vector<double> hostSum(const std::vector<float>& x, const ir::Shape& shape, const std::vector<int64_t>& dims) {
  const int rank = static_cast<int>(shape.size());
  std::vector<bool> red(rank, false);
  for (auto d : dims) red[d] = true;
  ir::Shape out_shape;
  for (int i = 0; i < rank; ++i)
    if (!red[i]) out_shape.push_back(shape[i]);
  int64_t out_n = 1;
  for (auto s : out_shape) out_n *= s;
  std::vector<double> out(out_n, 0.0);
  std::vector<int64_t> idx(rank, 0);
  for (float v : x) {
    int64_t o = 0;
    for (int i = 0; i < rank; ++i)
      if (!red[i]) o = o * shape[i] + idx[i];
    out[o] += v;
    for (int i = rank - 1; i >= 0 && ++idx[i] == shape[i]; --i) idx[i] = 0;
  }
  return out;
}

std::string tensorType(const ir::Shape& s) {
  std::string t = "tensor<";
  for (auto d : s) t += std::to_string(d) + "x";
  return t + "f32>";
}

void checkSum(const Case& c) {
  auto& rt = runtime::Runtime::get();
  ASSERT_EQ(rt.client().platformName(), "cpu");
  int64_t n = 1;
  for (auto s : c.shape) n *= s;
  std::vector<float> x(n);
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (auto& v : x) v = u(gen);

  ir::Builder b;
  ir::Value p = b.param({ir::DType::F32, c.shape});
  ir::Value r = ops::reduceSum(b, p, c.dims);
  b.output(r);
  const std::string text = b.emit();
  if (c.split.empty()) {
    EXPECT_EQ(text.find("stablehlo.reshape"), std::string::npos) << text;
  } else {
    EXPECT_NE(text.find(tensorType(c.split)), std::string::npos) << text;
    EXPECT_NE(text.find("optimization_barrier"), std::string::npos) << text;
  }

  auto prog = rt.compile(b, "reduce_test");
  auto in = rt.upload(x.data(), ir::DType::F32, c.shape, 0);
  auto out = runtime::execute(*prog, {in}, 0)[0];
  auto want = hostSum(x, c.shape, c.dims);
  std::vector<float> got(want.size());
  rt.download(*out, got.data(), got.size() * sizeof(float));
  int64_t per_out = n / static_cast<int64_t>(want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * per_out + 1e-4) << "output " << i;
}

}  // namespace

TEST(MinorSum, RowsOf512SplitIntoThirtyTwoGroupsOfSixteen) { checkSum({{5, 512}, {1}, {5, 32, 16}}); }

TEST(MinorSum, NarrowRowsSplitIntoFewerGroups) { checkSum({{7, 96}, {1}, {7, 6, 16}}); }

TEST(MinorSum, WideRowsKeepThirtyTwoGroupsOfWiderLanes) { checkSum({{3, 4096}, {1}, {3, 32, 128}}); }

TEST(MinorSum, FullSumMergesDimsThenSplits) { checkSum({{8, 64, 4}, {0, 1, 2}, {32, 64}}); }

TEST(MinorSum, NonAdjacentDimsSplitTheLastOne) { checkSum({{4, 3, 64}, {0, 2}, {4, 3, 4, 16}}); }

TEST(MinorSum, UnevenRowsAreNotSplit) { checkSum({{6, 40}, {1}, {}}); }

TEST(MinorSum, ColumnSumsAreNotSplit) { checkSum({{64, 48}, {0}, {}}); }
