// grid_sampler_2d: samples input [N, C, H, W] at the normalized (x, y)
// positions of grid [N, Ho, Wo, 2], bilinear or nearest, with zeros, border
// or reflection padding; and its gradient with respect to the input.
#include <cmath>

#include "ops/common.h"

namespace tpu::ops {
namespace {

enum Interp { kBilinear = 0, kNearest = 1, kBicubic = 2 };
enum Padding { kZeros = 0, kBorder = 1, kReflection = 2 };

// A coordinate and its derivative with respect to the grid value.
struct Coord {
  Value x, dx;
};

// Reflects x into [lo, hi] (span = hi - lo), as often as needed.
Coord reflect(ir::Builder& b, const Coord& c, double lo, double hi) {
  const Shape& s = c.x.shape();
  DType t = c.x.dtype();
  double span = hi - lo;
  if (span <= 0) return {b.zeros(c.x.type), b.zeros(c.x.type)};
  Value rel = sub(b, c.x, b.constant(lo, t, s));
  Value d = b.unary("abs", rel);
  Value sign = b.select(b.compare(rel, b.zeros(c.x.type), ir::Cmp::LT), b.constant(-1.0, t, s), b.constant(1.0, t, s));
  Value flips = b.unary("floor", div(b, d, b.constant(span, t, s)));
  Value extra = sub(b, d, mul(b, flips, b.constant(span, t, s)));
  Value even = b.compare(b.binary("remainder", flips, b.constant(2.0, t, s)), b.zeros(c.x.type), ir::Cmp::EQ);
  Value x = b.select(even, add(b, extra, b.constant(lo, t, s)), sub(b, b.constant(span + lo, t, s), extra));
  Value dx = mul(b, c.dx, b.select(even, sign, b.unary("negate", sign)));
  return {x, dx};
}

// Clamps to [0, size - 1]; the derivative is 0 where clamped.
Coord clip(ir::Builder& b, const Coord& c, int64_t size) {
  const Shape& s = c.x.shape();
  DType t = c.x.dtype();
  Value lo = b.constant(0.0, t, s), hi = b.constant(double(size - 1), t, s);
  Value inside = b.binary("and", b.compare(c.x, lo, ir::Cmp::GT), b.compare(c.x, hi, ir::Cmp::LT));
  return {b.clamp(lo, c.x, hi), b.select(inside, c.dx, b.zeros(c.x.type))};
}

// Source coordinate along an axis of `size` for normalized coordinates.
Coord sourceCoord(ir::Builder& b, const Value& g, int64_t size, int padding, bool align) {
  const Shape& s = g.shape();
  DType t = g.dtype();
  Value one = b.constant(1.0, t, s);
  Coord c;
  if (align) {
    c.x = mul(b, mul(b, add(b, g, one), b.constant(0.5, t, s)), b.constant(double(size - 1), t, s));
    c.dx = b.constant(double(size - 1) / 2, t, s);
  } else {
    c.x = mul(b, sub(b, mul(b, add(b, g, one), b.constant(double(size), t, s)), one), b.constant(0.5, t, s));
    c.dx = b.constant(double(size) / 2, t, s);
  }
  if (padding == kBorder) return clip(b, c, size);
  if (padding == kReflection) {
    c = align ? reflect(b, c, 0, double(size - 1)) : reflect(b, c, -0.5, double(size) - 0.5);
    return clip(b, c, size);
  }
  return c;
}

struct Tap {
  Value flat;      // [N, P] int64 flat index into H*W (0 where invalid)
  Value weight;    // [N, P] weight, 0 where the tap is outside the input
  Value dwx, dwy;  // [N, P] d weight / d grid x and y (bilinear), 0 outside
};

struct Taps {
  std::vector<Tap> taps;
  int64_t n, p;
};

// The taps (index, weight) of every output position.
Taps taps(ir::Builder& b, const Value& grid, int64_t h, int64_t w, int interp, int padding, bool align, DType acc) {
  int64_t n = grid.shape()[0], p = grid.shape()[1] * grid.shape()[2];
  Value gg = b.reshape(b.convert(grid, acc), {n, p, 2});
  Value gx = b.reshape(b.slice(gg, {0, 0, 0}, {n, p, 1}, {1, 1, 1}), {n, p});
  Value gy = b.reshape(b.slice(gg, {0, 0, 1}, {n, p, 2}, {1, 1, 1}), {n, p});
  Coord cx = sourceCoord(b, gx, w, padding, align), cy = sourceCoord(b, gy, h, padding, align);
  Value x = cx.x, y = cy.x;
  Shape s{n, p};
  Value zero = b.zeros(Type{acc, s});
  auto tap = [&](const Value& ix, const Value& iy, const Value& wt, const Value& dwx, const Value& dwy) {
    Value inx = b.binary("and", b.compare(ix, b.constant(0.0, acc, s), ir::Cmp::GE),
                         b.compare(ix, b.constant(double(w - 1), acc, s), ir::Cmp::LE));
    Value iny = b.binary("and", b.compare(iy, b.constant(0.0, acc, s), ir::Cmp::GE),
                         b.compare(iy, b.constant(double(h - 1), acc, s), ir::Cmp::LE));
    Value ok = b.binary("and", inx, iny);
    Value fi = add(b, mul(b, b.convert(iy, DType::I64), b.constantInt(w, DType::I64, s)), b.convert(ix, DType::I64));
    return Tap{b.select(ok, fi, b.constantInt(0, DType::I64, s)), b.select(ok, wt, zero),
               b.select(ok, mul(b, dwx, cx.dx), zero), b.select(ok, mul(b, dwy, cy.dx), zero)};
  };
  if (interp == kNearest) {
    // Round half to even, like nearbyint; no gradient flows to the grid.
    return {
        {tap(b.unary("round_nearest_even", x), b.unary("round_nearest_even", y), b.constant(1.0, acc, s), zero, zero)},
        n,
        p};
  }
  Value x0 = b.unary("floor", x), y0 = b.unary("floor", y);
  Value one = b.constant(1.0, acc, s);
  Value x1 = add(b, x0, one), y1 = add(b, y0, one);
  // The CPU kernel's formulas (they round alike in low precision).
  Value fx = sub(b, x, x0), fy = sub(b, y, y0);
  Value ex = sub(b, x1, x), ey = sub(b, y1, y);
  auto neg = [&](const Value& v) { return b.unary("negate", v); };
  return {{tap(x0, y0, mul(b, ex, ey), neg(ey), neg(ex)), tap(x1, y0, mul(b, fx, ey), ey, neg(fx)),
           tap(x0, y1, mul(b, ex, fy), neg(fy), ex), tap(x1, y1, mul(b, fx, fy), fy, fx)},
          n,
          p};
}

ir::Builder::GatherDims tapGather() {
  ir::Builder::GatherDims dn;
  dn.offset_dims = {2};
  dn.collapsed_slice_dims = {2};
  dn.start_index_map = {2};
  dn.operand_batching_dims = {0};
  dn.start_indices_batching_dims = {0};
  dn.index_vector_dim = 2;
  return dn;
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
  Value sum;
  for (const Tap& t : taps(b, grid, h, w, interp, padding, align, acc).taps) {
    Value v = b.gather(xx, b.reshape(t.flat, {n, p, 1}), tapGather(), {1, ch, 1});  // [N, P, C]
    Value term = mul(b, v, b.broadcastInDim(t.weight, {n, p, ch}, {0, 1}));
    sum = sum.valid() ? add(b, sum, term) : term;
  }
  Value r = b.reshape(b.transpose(sum, {0, 2, 1}), {n, ch, ho, wo});
  return std::vector<Value>{b.convert(r, out)};
});

// grid_sampler_2d_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners,
//                          output_mask) -> (grad_input, grad_grid)
Registrar reg_grid_sampler_2d_backward("grid_sampler_2d_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0), x = c.tensor(1), grid = c.tensor(2);
  int interp = static_cast<int>(c.i64(3)), padding = static_cast<int>(c.i64(4));
  bool align = c.flag(5);
  auto mask = c.arg(6).ints;
  if (interp == kBicubic || x.rank() != 4) throw ir::Unsupported("bicubic grid sampling");
  int64_t n = x.shape()[0], ch = x.shape()[1], h = x.shape()[2], w = x.shape()[3];
  int64_t p = grid.shape()[1] * grid.shape()[2];
  if (x.type.numel() == 0 || p == 0) return std::vector<Value>{b.zeros(x.type), b.zeros(grid.type)};
  DType acc = accOf(x.dtype());
  Taps tp = taps(b, grid, h, w, interp, padding, align, acc);
  Value gg = b.transpose(b.reshape(b.convert(g, acc), {n, ch, p}), {0, 2, 1});  // [N, P, C]
  std::vector<Value> res(2);
  if (mask.empty() || mask[0]) {
    ir::Builder::ScatterDims dn;
    dn.update_window_dims = {2};
    dn.inserted_window_dims = {2};
    dn.scatter_dims_to_operand_dims = {2};
    dn.input_batching_dims = {0};
    dn.scatter_indices_batching_dims = {0};
    dn.index_vector_dim = 2;
    Value gi = b.zeros(Type{acc, {n, ch, h * w}});
    for (const Tap& t : tp.taps) {
      Value upd = mul(b, gg, b.broadcastInDim(t.weight, {n, p, ch}, {0, 1}));
      gi = b.scatter(gi, b.reshape(t.flat, {n, p, 1}), upd, dn, [](ir::Builder& bb, const std::vector<Value>& a) {
        return std::vector<Value>{add(bb, a[0], a[1])};
      });
    }
    res[0] = b.convert(b.reshape(gi, x.shape()), x.dtype());
  }
  if (mask.size() > 1 && mask[1]) {
    Value xx = b.reshape(b.convert(x, acc), {n, ch, h * w});
    Value gx, gy;
    for (const Tap& t : tp.taps) {
      Value v = b.gather(xx, b.reshape(t.flat, {n, p, 1}), tapGather(), {1, ch, 1});  // [N, P, C]
      Value gv = reduceSum(b, mul(b, v, gg), {2});                                    // [N, P]
      Value ax = mul(b, gv, t.dwx), ay = mul(b, gv, t.dwy);
      gx = gx.valid() ? add(b, gx, ax) : ax;
      gy = gy.valid() ? add(b, gy, ay) : ay;
    }
    Value gr = b.concatenate({b.reshape(gx, {n, p, 1}), b.reshape(gy, {n, p, 1})}, 2);
    res[1] = b.convert(b.reshape(gr, grid.shape()), grid.dtype());
  }
  return res;
});

}  // namespace
}  // namespace tpu::ops
