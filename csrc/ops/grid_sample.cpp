// grid_sampler_2d: samples input [N, C, H, W] at the normalized (x, y)
// positions of grid [N, Ho, Wo, 2], bilinear or nearest, with zeros, border
// or reflection padding; and its gradient with respect to the input.
#include <cmath>

#include "ops/common.h"

namespace tpu::ops {
namespace {

enum Interp { kBilinear = 0, kNearest = 1, kBicubic = 2 };
enum Padding { kZeros = 0, kBorder = 1, kReflection = 2 };

// Reflects x into [lo, hi] (span = hi - lo), as often as needed.
Value reflect(ir::Builder& b, const Value& x, double lo, double hi) {
  const Shape& s = x.shape();
  DType t = x.dtype();
  double span = hi - lo;
  if (span <= 0) return b.zeros(x.type);
  Value d = b.unary("abs", sub(b, x, b.constant(lo, t, s)));
  Value flips = b.unary("floor", div(b, d, b.constant(span, t, s)));
  Value extra = sub(b, d, mul(b, flips, b.constant(span, t, s)));
  Value even = b.compare(b.binary("remainder", flips, b.constant(2.0, t, s)), b.zeros(x.type), ir::Cmp::EQ);
  return b.select(even, add(b, extra, b.constant(lo, t, s)), sub(b, b.constant(span + lo, t, s), extra));
}

// Source coordinate along an axis of `size` for normalized coordinates.
Value sourceCoord(ir::Builder& b, const Value& g, int64_t size, int padding, bool align) {
  const Shape& s = g.shape();
  DType t = g.dtype();
  Value one = b.constant(1.0, t, s);
  Value x = align ? mul(b, mul(b, add(b, g, one), b.constant(0.5, t, s)), b.constant(double(size - 1), t, s))
                  : mul(b, sub(b, mul(b, add(b, g, one), b.constant(double(size), t, s)), one),
                        b.constant(0.5, t, s));
  auto clip = [&](const Value& v) {
    return b.clamp(b.constant(0.0, t, s), v, b.constant(double(size - 1), t, s));
  };
  if (padding == kBorder) return clip(x);
  if (padding == kReflection) {
    x = align ? reflect(b, x, 0, double(size - 1)) : reflect(b, x, -0.5, double(size) - 0.5);
    return clip(x);
  }
  return x;
}

struct Tap {
  Value flat;    // [N, P] int64 flat index into H*W (0 where invalid)
  Value weight;  // [N, P] weight, 0 where the tap is outside the input
};

// The taps (index, weight) of every output position.
std::vector<Tap> taps(ir::Builder& b, const Value& grid, int64_t h, int64_t w, int interp, int padding, bool align,
                      DType acc) {
  int64_t n = grid.shape()[0], p = grid.shape()[1] * grid.shape()[2];
  Value gg = b.reshape(b.convert(grid, acc), {n, p, 2});
  Value gx = b.reshape(b.slice(gg, {0, 0, 0}, {n, p, 1}, {1, 1, 1}), {n, p});
  Value gy = b.reshape(b.slice(gg, {0, 0, 1}, {n, p, 2}, {1, 1, 1}), {n, p});
  Value x = sourceCoord(b, gx, w, padding, align), y = sourceCoord(b, gy, h, padding, align);
  Shape s{n, p};
  auto tap = [&](const Value& ix, const Value& iy, const Value& wt) {
    Value inx = b.binary("and", b.compare(ix, b.constant(0.0, acc, s), ir::Cmp::GE),
                         b.compare(ix, b.constant(double(w - 1), acc, s), ir::Cmp::LE));
    Value iny = b.binary("and", b.compare(iy, b.constant(0.0, acc, s), ir::Cmp::GE),
                         b.compare(iy, b.constant(double(h - 1), acc, s), ir::Cmp::LE));
    Value ok = b.binary("and", inx, iny);
    Value fi = add(b, mul(b, b.convert(iy, DType::I64), b.constantInt(w, DType::I64, s)), b.convert(ix, DType::I64));
    return Tap{b.select(ok, fi, b.constantInt(0, DType::I64, s)), b.select(ok, wt, b.zeros(Type{acc, s}))};
  };
  if (interp == kNearest) {
    // Round half to even, like nearbyint.
    return {tap(b.unary("round_nearest_even", x), b.unary("round_nearest_even", y), b.constant(1.0, acc, s))};
  }
  Value x0 = b.unary("floor", x), y0 = b.unary("floor", y);
  Value one = b.constant(1.0, acc, s);
  Value x1 = add(b, x0, one), y1 = add(b, y0, one);
  // The CPU kernel's formulas (they round alike in low precision).
  Value fx = sub(b, x, x0), fy = sub(b, y, y0);
  Value ex = sub(b, x1, x), ey = sub(b, y1, y);
  return {tap(x0, y0, mul(b, ex, ey)), tap(x1, y0, mul(b, fx, ey)), tap(x0, y1, mul(b, ex, fy)),
          tap(x1, y1, mul(b, fx, fy))};
}

// grid_sampler_2d(input, grid, interpolation_mode, padding_mode, align_corners)
Registrar reg_grid_sampler_2d("grid_sampler_2d", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0), grid = c.tensor(1);
  int interp = static_cast<int>(c.i64(2)), padding = static_cast<int>(c.i64(3));
  bool align = c.flag(4);
  if (interp == kBicubic || x.rank() != 4) throw ir::Unsupported("bicubic grid sampling");
  int64_t n = x.shape()[0], ch = x.shape()[1], h = x.shape()[2], w = x.shape()[3];
  int64_t ho = grid.shape()[1], wo = grid.shape()[2], p = ho * wo;
  DType out = outType(c, x.dtype());
  // The CPU computes low-precision sampling in that precision, op by op.
  DType acc = out;
  if (x.type.numel() == 0 || p == 0) return std::vector<Value>{b.zeros(Type{out, {n, ch, ho, wo}})};
  Value xx = b.reshape(b.convert(x, acc), {n, ch, h * w});
  ir::Builder::GatherDims dn;
  dn.offset_dims = {2};
  dn.collapsed_slice_dims = {2};
  dn.start_index_map = {2};
  dn.operand_batching_dims = {0};
  dn.start_indices_batching_dims = {0};
  dn.index_vector_dim = 2;
  Value sum;
  for (const Tap& t : taps(b, grid, h, w, interp, padding, align, acc)) {
    Value v = b.gather(xx, b.reshape(t.flat, {n, p, 1}), dn, {1, ch, 1});  // [N, P, C]
    Value term = mul(b, v, b.broadcastInDim(t.weight, {n, p, ch}, {0, 1}));
    sum = sum.valid() ? add(b, sum, term) : term;
  }
  Value r = b.reshape(b.transpose(sum, {0, 2, 1}), {n, ch, ho, wo});
  return std::vector<Value>{b.convert(r, out)};
});

}  // namespace
}  // namespace tpu::ops
