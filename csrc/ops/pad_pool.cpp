// Padding and resampling: reflection / replication padding and nearest /
// linear / bilinear upsampling, with their backward ops. Each is separable:
// applied (and differentiated) one spatial dim at a time.
#include <cmath>

#include "ops/common.h"

namespace tpu::ops {
namespace {

Value sliceDim(ir::Builder& b, const Value& v, int64_t d, int64_t lo, int64_t hi) {
  Shape start(v.rank(), 0), limit = v.shape(), strides(v.rank(), 1);
  start[d] = lo;
  limit[d] = hi;
  return b.slice(v, start, limit, strides);
}

// Pads (or crops, for negative amounts) dim d with zeros.
Value zeroPadDim(ir::Builder& b, const Value& v, int64_t d, int64_t lo, int64_t hi) {
  if (lo == 0 && hi == 0) return v;
  Shape l(v.rank(), 0), h(v.rank(), 0), in(v.rank(), 0);
  l[d] = lo;
  h[d] = hi;
  return b.pad(v, b.constant(0.0, v.dtype()), l, h, in);
}

// Takes x[..., idx[o], ...] along dim d (idx: i32[out]).
Value takeDim(ir::Builder& b, const Value& x, int64_t d, const Value& idx) {
  ir::Builder::GatherDims dn;
  for (int64_t i = 0; i < x.rank(); ++i)
    if (i != d) dn.offset_dims.push_back(i);
  dn.collapsed_slice_dims = {d};
  dn.start_index_map = {d};
  dn.index_vector_dim = 1;
  Shape sizes = x.shape();
  sizes[d] = 1;
  return b.gather(x, b.reshape(idx, {idx.shape()[0], 1}), dn, sizes);
}

// g (dim d of size out) times the weights w[out, in]: dim d becomes in.
Value applyWeightsT(ir::Builder& b, const Value& g, int64_t d, const Value& w) {
  Value r = b.dotGeneral(g, w, {}, {}, {d}, {0}, g.dtype());  // (..others.., in)
  std::vector<int64_t> perm;
  int64_t rank = g.rank();
  for (int64_t i = 0, j = 0; i < rank; ++i) perm.push_back(i == d ? rank - 1 : j++);
  return b.transpose(r, perm);
}

// One-hot weights [out, in] for index vector idx (i32[out]) scaled by lam.
Value oneHot(ir::Builder& b, const Value& idx, int64_t in, DType t, const Value* lam = nullptr) {
  int64_t out = idx.shape()[0];
  Value cols = b.iota(Type{DType::I32, {out, in}}, 1);
  Value rows = b.broadcastInDim(idx, {out, in}, {0});
  Value m = b.convert(b.compare(rows, cols, ir::Cmp::EQ), t);
  if (lam) m = mul(b, m, b.broadcastInDim(*lam, {out, in}, {0}));
  return m;
}

// The (dim, lo, hi) triples of a padding list for the trailing dims.
std::vector<std::array<int64_t, 3>> padDims(const std::vector<int64_t>& pad, int64_t rank) {
  std::vector<std::array<int64_t, 3>> r;
  for (size_t i = 0; i + 1 < pad.size(); i += 2) r.push_back({rank - 1 - int64_t(i / 2), pad[i], pad[i + 1]});
  return r;
}

Value reflectDim(ir::Builder& b, const Value& x, int64_t d, int64_t l, int64_t r) {
  int64_t w = x.shape()[d];
  if (l < 0 || r < 0 || l >= w || r >= w) throw ir::Unsupported("reflection pad: padding out of range");
  std::vector<Value> parts;
  if (l > 0) parts.push_back(b.reverse(sliceDim(b, x, d, 1, l + 1), {d}));
  parts.push_back(x);
  if (r > 0) parts.push_back(b.reverse(sliceDim(b, x, d, w - 1 - r, w - 1), {d}));
  return parts.size() == 1 ? x : b.concatenate(parts, d);
}

// Output position o reads input |w - 1 - |w - 1 - |o - l||| (any padding
// with |pad| < w, negative included).
Value reflectIdx(ir::Builder& b, int64_t w, int64_t l, int64_t r) {
  int64_t out = w + l + r;
  if (std::abs(l) >= w || std::abs(r) >= w || out <= 0) throw ir::Unsupported("reflection pad: padding out of range");
  auto ci = [&](int64_t v) { return b.constantInt(v, DType::I32, {out}); };
  Value j = b.unary("abs", sub(b, b.iota(Type{DType::I32, {out}}, 0), ci(l)));
  return sub(b, ci(w - 1), b.unary("abs", sub(b, ci(w - 1), j)));
}

Value reflectDimBackward(ir::Builder& b, const Value& g, int64_t d, int64_t l, int64_t r, int64_t w) {
  Value gi = sliceDim(b, g, d, l, l + w);
  if (l > 0) gi = add(b, gi, zeroPadDim(b, b.reverse(sliceDim(b, g, d, 0, l), {d}), d, 1, w - 1 - l));
  if (r > 0) gi = add(b, gi, zeroPadDim(b, b.reverse(sliceDim(b, g, d, l + w, l + w + r), {d}), d, w - 1 - r, 1));
  return gi;
}

// Output position o reads input clamp(o - l, 0, w - 1) (negative padding
// included, as PyTorch defines it).
Value replicateIdx(ir::Builder& b, int64_t w, int64_t l, int64_t r) {
  int64_t out = w + l + r;
  if (w <= 0 || out <= 0) throw ir::Unsupported("replication pad: empty dim");
  Value o = sub(b, b.iota(Type{DType::I32, {out}}, 0), b.constantInt(l, DType::I32, {out}));
  return b.clamp(b.constantInt(0, DType::I32, {out}), o, b.constantInt(w - 1, DType::I32, {out}));
}

std::vector<Value> padForward(Ctx& c, bool reflect) {
  Value x = c.tensor(0);
  auto dims = padDims(c.ints(1), x.rank());
  Value y = x;
  for (auto& [d, l, r] : dims) {
    if (reflect && l >= 0 && r >= 0)
      y = reflectDim(c.b, y, d, l, r);
    else
      y = takeDim(c.b, y, d, reflect ? reflectIdx(c.b, y.shape()[d], l, r) : replicateIdx(c.b, y.shape()[d], l, r));
  }
  return {y};
}

// (grad_output, self, padding)
std::vector<Value> padBackward(Ctx& c, bool reflect) {
  Value g = c.tensor(0), x = c.tensor(1);
  DType out = outType(c, x.dtype());
  DType acc = accOf(out);
  Value gg = c.b.convert(g, acc);
  auto dims = padDims(c.ints(2), x.rank());
  for (auto& [d, l, r] : dims) {
    int64_t w = x.shape()[d];
    if (reflect && l >= 0 && r >= 0)
      gg = reflectDimBackward(c.b, gg, d, l, r, w);
    else
      gg = applyWeightsT(c.b, gg, d,
                         oneHot(c.b, reflect ? reflectIdx(c.b, w, l, r) : replicateIdx(c.b, w, l, r), w, acc));
  }
  return {c.b.convert(gg, out)};
}

Registrar reg_reflection_pad1d("reflection_pad1d", [](Ctx& c) { return padForward(c, true); });
Registrar reg_reflection_pad2d("reflection_pad2d", [](Ctx& c) { return padForward(c, true); });
Registrar reg_reflection_pad3d("reflection_pad3d", [](Ctx& c) { return padForward(c, true); });
Registrar reg_replication_pad1d("replication_pad1d", [](Ctx& c) { return padForward(c, false); });
Registrar reg_replication_pad2d("replication_pad2d", [](Ctx& c) { return padForward(c, false); });
Registrar reg_replication_pad3d("replication_pad3d", [](Ctx& c) { return padForward(c, false); });
Registrar reg_reflection_pad1d_bw("reflection_pad1d_backward", [](Ctx& c) { return padBackward(c, true); });
Registrar reg_reflection_pad2d_bw("reflection_pad2d_backward", [](Ctx& c) { return padBackward(c, true); });
Registrar reg_reflection_pad3d_bw("reflection_pad3d_backward", [](Ctx& c) { return padBackward(c, true); });
Registrar reg_replication_pad1d_bw("replication_pad1d_backward", [](Ctx& c) { return padBackward(c, false); });
Registrar reg_replication_pad2d_bw("replication_pad2d_backward", [](Ctx& c) { return padBackward(c, false); });
Registrar reg_replication_pad3d_bw("replication_pad3d_backward", [](Ctx& c) { return padBackward(c, false); });

// --------------------------------------------------------------- upsampling

// PyTorch's area_pixel_compute_scale.
double pixelScale(int64_t in, int64_t out, bool align_corners, std::optional<double> scale) {
  if (align_corners) return out > 1 ? double(in - 1) / double(out - 1) : 0.0;
  return (scale && *scale > 0) ? 1.0 / *scale : double(in) / double(out);
}

// The scale arguments from index `at`: N optional doubles or, for the .vec
// overloads, one optional double list.
std::vector<std::optional<double>> scalesAt(Ctx& c, size_t at, int n) {
  std::vector<std::optional<double>> s(n);
  if (c.kind(at) == Arg::Kind::DoubleList) {
    auto& v = c.arg(at).doubles;
    for (int i = 0; i < n && i < int(v.size()); ++i) s[i] = v[i];
    return s;
  }
  for (int i = 0; i < n; ++i)
    if (c.has(at + i)) s[i] = c.f64(at + i);
  return s;
}

// Nearest source index per output position, in float32 like PyTorch.
Value nearestIdx(ir::Builder& b, int64_t in, int64_t out, std::optional<double> scale, bool exact) {
  float sc = float(pixelScale(in, out, false, scale));
  Value o = b.iota(Type{DType::F32, {out}}, 0);
  if (exact) o = add(b, o, b.constant(0.5, DType::F32, {out}));
  Value src = b.unary("floor", mul(b, o, b.constant(sc, DType::F32, {out})));
  Value i = b.convert(src, DType::I32);
  return b.binary("minimum", i, b.constantInt(in - 1, DType::I32, {out}));
}

// Linear source indices and weights per output position (acc precision).
struct LinearIdx {
  Value i0, i1, l0, l1;
};
LinearIdx linearIdx(ir::Builder& b, int64_t in, int64_t out, bool align, std::optional<double> scale, DType acc) {
  double sc = pixelScale(in, out, align, scale);
  Value o = b.iota(Type{acc, {out}}, 0);
  Value kk = b.constant(sc, acc, {out});
  Value src;
  if (align) {
    src = mul(b, o, kk);
  } else {
    src = sub(b, mul(b, add(b, o, b.constant(0.5, acc, {out})), kk), b.constant(0.5, acc, {out}));
    src = b.binary("maximum", src, b.constant(0, acc, {out}));
  }
  Value i0 = b.convert(b.unary("floor", src), DType::I32);
  i0 = b.binary("minimum", i0, b.constantInt(in - 1, DType::I32, {out}));
  Value i1 =
      b.binary("minimum", add(b, i0, b.constantInt(1, DType::I32, {out})), b.constantInt(in - 1, DType::I32, {out}));
  Value l1 = sub(b, src, b.convert(i0, acc));
  Value l0 = sub(b, b.constant(1, acc, {out}), l1);
  return {i0, i1, l0, l1};
}

// Spatial output sizes: PyTorch's meta result.
Shape outSpatial(Ctx& c, int n) {
  if (!c.hasExpected()) throw ir::Unsupported("upsample: unknown output size");
  const Shape& s = c.expectedAt(0).shape;
  return Shape(s.end() - n, s.end());
}

std::vector<Value> nearestForward(Ctx& c, int n, bool exact) {
  Value x = c.tensor(0);
  Shape os = outSpatial(c, n);
  auto scales = scalesAt(c, 2, n);
  Value y = x;
  for (int i = 0; i < n; ++i) {
    int64_t d = x.rank() - n + i;
    y = takeDim(c.b, y, d, nearestIdx(c.b, x.shape()[d], os[i], scales[i], exact));
  }
  return {y};
}

// (grad_output, output_size, input_size, scales...)
std::vector<Value> nearestBackward(Ctx& c, int n, bool exact) {
  Value g = c.tensor(0);
  Shape in = c.ints(2);
  DType out = outType(c, g.dtype());
  DType acc = accOf(out);
  auto scales = scalesAt(c, 3, n);
  Value gg = c.b.convert(g, acc);
  for (int i = 0; i < n; ++i) {
    int64_t d = g.rank() - n + i;
    Value idx = nearestIdx(c.b, in[d], g.shape()[d], scales[i], exact);
    gg = applyWeightsT(c.b, gg, d, oneHot(c.b, idx, in[d], acc));
  }
  return {c.b.convert(gg, out)};
}

Registrar reg_un1("upsample_nearest1d", [](Ctx& c) { return nearestForward(c, 1, false); });
Registrar reg_un2("upsample_nearest2d", [](Ctx& c) { return nearestForward(c, 2, false); });
Registrar reg_un3("upsample_nearest3d", [](Ctx& c) { return nearestForward(c, 3, false); });
Registrar reg_une1("_upsample_nearest_exact1d", [](Ctx& c) { return nearestForward(c, 1, true); });
Registrar reg_une2("_upsample_nearest_exact2d", [](Ctx& c) { return nearestForward(c, 2, true); });
Registrar reg_une3("_upsample_nearest_exact3d", [](Ctx& c) { return nearestForward(c, 3, true); });
Registrar reg_un1b("upsample_nearest1d_backward", [](Ctx& c) { return nearestBackward(c, 1, false); });
Registrar reg_un2b("upsample_nearest2d_backward", [](Ctx& c) { return nearestBackward(c, 2, false); });
Registrar reg_un3b("upsample_nearest3d_backward", [](Ctx& c) { return nearestBackward(c, 3, false); });
Registrar reg_une1b("_upsample_nearest_exact1d_backward", [](Ctx& c) { return nearestBackward(c, 1, true); });
Registrar reg_une2b("_upsample_nearest_exact2d_backward", [](Ctx& c) { return nearestBackward(c, 2, true); });
Registrar reg_une3b("_upsample_nearest_exact3d_backward", [](Ctx& c) { return nearestBackward(c, 3, true); });

// (self, output_size, align_corners, scales...)
std::vector<Value> linearForward(Ctx& c, int n) {
  Value x = c.tensor(0);
  DType out = outType(c, x.dtype());
  if (!ir::isFloat(out)) throw ir::Unsupported("linear upsampling of integers");
  // PyTorch's CPU kernels for 1-d and 3-d compute indices and weights in the
  // low-precision type itself (results differ past bf16 tolerance).
  if (n != 2 && (out == DType::BF16 || out == DType::F16)) throw ir::Unsupported("low-precision linear/trilinear");
  DType acc = accOf(out);
  Shape os = outSpatial(c, n);
  bool align = c.flag(2);
  auto scales = scalesAt(c, 3, n);
  ir::Builder& b = c.b;
  Value y = b.convert(x, acc);
  for (int i = 0; i < n; ++i) {
    int64_t d = x.rank() - n + i;
    LinearIdx li = linearIdx(b, x.shape()[d], os[i], align, scales[i], acc);
    Value a0 = takeDim(b, y, d, li.i0), a1 = takeDim(b, y, d, li.i1);
    Value l0 = b.broadcastInDim(li.l0, a0.shape(), {d}), l1 = b.broadcastInDim(li.l1, a0.shape(), {d});
    y = add(b, mul(b, a0, l0), mul(b, a1, l1));
  }
  return {b.convert(y, out)};
}

// (grad_output, output_size, input_size, align_corners, scales...)
std::vector<Value> linearBackward(Ctx& c, int n) {
  Value g = c.tensor(0);
  Shape in = c.ints(2);
  bool align = c.flag(3);
  DType out = outType(c, g.dtype());
  DType acc = accOf(out);
  auto scales = scalesAt(c, 4, n);
  ir::Builder& b = c.b;
  Value gg = b.convert(g, acc);
  for (int i = 0; i < n; ++i) {
    int64_t d = g.rank() - n + i;
    LinearIdx li = linearIdx(b, in[d], g.shape()[d], align, scales[i], acc);
    Value w = add(b, oneHot(b, li.i0, in[d], acc, &li.l0), oneHot(b, li.i1, in[d], acc, &li.l1));
    gg = applyWeightsT(b, gg, d, w);
  }
  return {b.convert(gg, out)};
}

Registrar reg_ul1("upsample_linear1d", [](Ctx& c) { return linearForward(c, 1); });
Registrar reg_ub2("upsample_bilinear2d", [](Ctx& c) { return linearForward(c, 2); });
Registrar reg_ut3("upsample_trilinear3d", [](Ctx& c) { return linearForward(c, 3); });
Registrar reg_ul1b("upsample_linear1d_backward", [](Ctx& c) { return linearBackward(c, 1); });
Registrar reg_ub2b("upsample_bilinear2d_backward", [](Ctx& c) { return linearBackward(c, 2); });
Registrar reg_ut3b("upsample_trilinear3d_backward", [](Ctx& c) { return linearBackward(c, 3); });

// --------------------------------------------------------------- bicubic

// Weights [out, in] of bicubic interpolation along one dim: 4 taps around
// the source position (clamped at the borders) with Keys' cubic, A = -0.75.
Value bicubicWeights(ir::Builder& b, int64_t in, int64_t out, bool align, std::optional<double> scale, DType acc) {
  double sc = pixelScale(in, out, align, scale);
  Value o = b.iota(Type{acc, {out}}, 0);
  Value kk = b.constant(sc, acc, {out});
  // Unlike linear, the source position is not clamped at 0.
  Value src =
      align ? mul(b, o, kk) : sub(b, mul(b, add(b, o, b.constant(0.5, acc, {out})), kk), b.constant(0.5, acc, {out}));
  Value fl = b.unary("floor", src);
  Value t = sub(b, src, fl);
  Value i0 = b.convert(fl, DType::I32);
  const double A = -0.75;
  auto cst = [&](double v) { return b.constant(v, acc, {out}); };
  // |x| <= 1: ((A + 2) x - (A + 3)) x^2 + 1;  1 < |x| < 2: ((A x - 5A) x + 8A) x - 4A
  auto near = [&](const Value& x) {
    return add(b, mul(b, mul(b, sub(b, mul(b, cst(A + 2), x), cst(A + 3)), x), x), cst(1));
  };
  auto far = [&](const Value& x) {
    return sub(b, mul(b, add(b, mul(b, sub(b, mul(b, cst(A), x), cst(5 * A)), x), cst(8 * A)), x), cst(4 * A));
  };
  Value one = cst(1);
  Value w[4] = {far(add(b, t, one)), near(t), near(sub(b, one, t)), far(sub(b, cst(2), t))};
  Value m;
  for (int k = 0; k < 4; ++k) {
    Value idx = add(b, i0, b.constantInt(k - 1, DType::I32, {out}));
    idx = b.clamp(b.constantInt(0, DType::I32, {out}), idx, b.constantInt(in - 1, DType::I32, {out}));
    Value term = oneHot(b, idx, in, acc, &w[k]);
    m = m.valid() ? add(b, m, term) : term;
  }
  return m;
}

// upsample_bicubic2d(self, output_size, align_corners, scales_h, scales_w)
Registrar reg_bicubic("upsample_bicubic2d", [](Ctx& c) {
  Value x = c.tensor(0);
  DType out = outType(c, x.dtype());
  if (!ir::isFloat(out)) throw ir::Unsupported("bicubic upsampling of integers");
  // The CPU kernel rounds its intermediate sums in the low-precision type
  // (up to 1 bf16 ulp apart from an f32 computation): the fallback matches it.
  if (out == DType::BF16 || out == DType::F16) throw ir::Unsupported("low-precision bicubic");
  DType acc = accOf(out);
  Shape os = outSpatial(c, 2);
  bool align = c.flag(2);
  auto scales = scalesAt(c, 3, 2);
  ir::Builder& b = c.b;
  Value y = b.convert(x, acc);
  for (int i = 0; i < 2; ++i) {
    int64_t d = x.rank() - 2 + i;
    Value w = bicubicWeights(b, x.shape()[d], os[i], align, scales[i], acc);
    y = applyWeightsT(b, y, d, b.transpose(w, {1, 0}));
  }
  return std::vector<Value>{b.convert(y, out)};
});

// upsample_bicubic2d_backward(grad_output, output_size, input_size, align_corners, scales_h, scales_w)
Registrar reg_bicubic_backward("upsample_bicubic2d_backward", [](Ctx& c) {
  Value g = c.tensor(0);
  Shape in = c.ints(2);
  bool align = c.flag(3);
  DType out = outType(c, g.dtype());
  DType acc = accOf(out);
  auto scales = scalesAt(c, 4, 2);
  ir::Builder& b = c.b;
  Value gg = b.convert(g, acc);
  for (int i = 0; i < 2; ++i) {
    int64_t d = g.rank() - 2 + i;
    gg = applyWeightsT(b, gg, d, bicubicWeights(b, in[d], g.shape()[d], align, scales[i], acc));
  }
  return std::vector<Value>{b.convert(gg, out)};
});

// --------------------------------------------------------------- adaptive max pooling

// Gathers the adaptive windows of dim d: (.., I, ..) -> (.., O, K, ..), with
// the input position of each element (i32[O, K]) and whether it is in the
// window (bool[O, K]).
struct Windows {
  Value vals, pos, valid;
};
Windows adaptiveWindows(ir::Builder& b, const Value& x, int64_t d, int64_t in, int64_t out) {
  int64_t kmax = 0;
  for (int64_t o = 0; o < out; ++o) {
    int64_t st = o * in / out, en = ((o + 1) * in + out - 1) / out;
    kmax = std::max(kmax, en - st);
  }
  Type t{DType::I32, {out, kmax}};
  auto ci = [&](int64_t v) { return b.constantInt(v, DType::I32, t.shape); };
  Value o = b.iota(t, 0), kk = b.iota(t, 1);
  Value st = b.binary("divide", mul(b, o, ci(in)), ci(out));
  Value en = b.binary("divide", add(b, mul(b, add(b, o, ci(1)), ci(in)), ci(out - 1)), ci(out));
  Value raw = add(b, st, kk);
  Value valid = b.compare(raw, en, ir::Cmp::LT);
  Value pos = b.binary("minimum", raw, ci(in - 1));
  ir::Builder::GatherDims dn;
  for (int64_t i = 0; i < x.rank(); ++i)
    if (i != d) dn.offset_dims.push_back(i < d ? i : i + 1);
  dn.collapsed_slice_dims = {d};
  dn.start_index_map = {d};
  dn.index_vector_dim = 2;
  Shape sizes = x.shape();
  sizes[d] = 1;
  Value g = b.gather(x, b.reshape(pos, {out, kmax, 1}), dn, sizes);
  return {g, pos, valid};
}

// The input and output size of an adaptive pool over the trailing n dims.
std::pair<Value, std::vector<int64_t>> adaptiveArgs(Ctx& c, int n) {
  Value x = c.tensor(0);
  std::vector<int64_t> os = c.ints(1);
  if (static_cast<int>(os.size()) != n || x.rank() < n + 1) throw ir::Unsupported("adaptive pool: shape");
  return {x, os};
}

// _adaptive_avg_pool{2,3}d(self, output_size): each window's sum over its
// count, one dim at a time over gathered windows (a product with an averaging
// matrix would spread an infinity as NaN into the other windows).
std::vector<Value> adaptiveAvg(Ctx& c, int n) {
  const auto [x, os] = adaptiveArgs(c, n);
  ir::Builder& b = c.b;
  const int64_t r = x.rank();
  Shape out_shape = x.shape();
  for (int j = 0; j < n; ++j) {
    if (os[j] <= 0 || x.shape()[r - n + j] == 0) throw ir::Unsupported("adaptive_avg_pool: empty window");
    out_shape[r - n + j] = os[j];
  }
  if (x.type.numel() == 0) return {b.zeros({x.dtype(), out_shape})};  // an empty batch
  DType acc = accOf(x.dtype());
  Value v = b.convert(x, acc);
  for (int j = 0; j < n; ++j) {
    int64_t d = r - n + j;
    Windows w = adaptiveWindows(b, v, d, x.shape()[d], os[j]);  // (.., O, K, ..)
    const Shape& full = w.vals.shape();
    Value in = b.select(b.broadcastInDim(w.valid, full, {d, d + 1}), w.vals, b.zeros({acc, full}));
    Value sum = reduceSum(b, in, {d + 1});
    Value count = reduceSum(b, b.convert(w.valid, acc), {1});
    v = div(b, sum, b.broadcastInDim(count, sum.shape(), {d}));
  }
  return {b.convert(v, x.dtype())};
}
Registrar reg_adaptive_avg_pool2d("_adaptive_avg_pool2d", [](Ctx& c) { return adaptiveAvg(c, 2); });
Registrar reg_adaptive_avg_pool3d("_adaptive_avg_pool3d", [](Ctx& c) { return adaptiveAvg(c, 3); });

// adaptive_max_pool{2,3}d(self, output_size) -> (out, indices)
std::vector<Value> adaptiveMax(Ctx& c, int n) {
  const auto [x, os] = adaptiveArgs(c, n);
  ir::Builder& b = c.b;
  const int64_t r = x.rank();
  if (x.type.numel() == 0) throw ir::Unsupported("adaptive_max_pool: empty input");
  int64_t lead = r - n;
  for (int j = 0; j < n; ++j)
    if (os[j] <= 0) throw ir::Unsupported("adaptive_max_pool: empty output");
  // Gather dim j's windows: (.., O0, K0, .., Oj, Kj, in_{j+1}, ..).
  Value v = x;
  std::vector<Windows> ws;
  for (int j = 0; j < n; ++j) {
    ws.push_back(adaptiveWindows(b, v, lead + 2 * j, x.shape()[lead + j], os[j]));
    v = ws.back().vals;
  }
  Shape full = v.shape();
  Value flat, valid;
  std::vector<int64_t> kdims;
  for (int j = 0; j < n; ++j) {
    std::vector<int64_t> dims = {lead + 2 * j, lead + 2 * j + 1};
    kdims.push_back(lead + 2 * j + 1);
    Value p = b.broadcastInDim(b.convert(ws[j].pos, DType::I64), full, dims);
    Value ok = b.broadcastInDim(ws[j].valid, full, dims);
    flat = flat.valid() ? add(b, mul(b, flat, b.constantInt(x.shape()[lead + j], DType::I64, full)), p) : p;
    valid = valid.valid() ? b.binary("and", valid, ok) : ok;
  }
  int64_t sp = 1;
  for (int j = 0; j < n; ++j) sp *= x.shape()[lead + j];
  DType t = x.dtype();
  v = b.select(valid, v, b.constant(lowestValue(t), t, full));
  flat = b.select(valid, flat, b.constantInt(sp, DType::I64, full));
  bool is_float = ir::isFloat(t);
  auto res = b.reduce({v, flat}, {b.constant(lowestValue(t), t), b.constantInt(-1, DType::I64)}, kdims,
                      maxWithIndex(is_float));
  return {res[0], res[1]};
}
Registrar reg_adaptive_max_pool2d("adaptive_max_pool2d", [](Ctx& c) { return adaptiveMax(c, 2); });
Registrar reg_adaptive_max_pool3d("adaptive_max_pool3d", [](Ctx& c) { return adaptiveMax(c, 3); });

// Places g (over the trailing `n` dims) at the flat positions `idx` of a zero
// tensor of `shape`: added (a max pool's gradient) or written (max_unpool).
Value scatterByIndex(ir::Builder& b, const Value& g, const Shape& shape, const Value& idx, int n, DType out,
                     bool accumulate = true) {
  int64_t sp = 1, l = 1, total = 1;
  for (int i = 0; i < n; ++i) {
    sp *= shape[shape.size() - 1 - i];
    l *= g.shape()[g.rank() - 1 - i];
  }
  for (auto d : shape) total *= d;
  int64_t lead = total / std::max<int64_t>(sp, 1);
  DType acc = accumulate ? accOf(out) : out;
  Value gg = b.reshape(b.convert(g, acc), {lead, l});
  Value ii = b.reshape(b.convert(idx, DType::I64), {lead, l});
  Value rows = b.reshape(b.iota(Type{DType::I64, {lead, l}}, 0), {lead, l, 1});
  Value coords = b.concatenate({rows, b.reshape(ii, {lead, l, 1})}, 2);
  ir::Builder::ScatterDims dn;
  dn.inserted_window_dims = {0, 1};
  dn.scatter_dims_to_operand_dims = {0, 1};
  dn.index_vector_dim = 2;
  Value res = b.scatter(b.constant(0.0, acc, {lead, sp}), coords, gg, dn,
                        [accumulate](ir::Builder& bb, const std::vector<Value>& a) {
                          return std::vector<Value>{accumulate ? add(bb, a[0], a[1]) : a[1]};
                        });
  return b.convert(b.reshape(res, shape), out);
}

// adaptive_max_pool{2,3}d_backward(grad_output, self, indices)
Registrar reg_adaptive_max_pool2d_backward("adaptive_max_pool2d_backward", [](Ctx& c) {
  Value x = c.tensor(1);
  return std::vector<Value>{scatterByIndex(c.b, c.tensor(0), x.shape(), c.tensor(2), 2, outType(c, x.dtype()))};
});
Registrar reg_adaptive_max_pool3d_backward("adaptive_max_pool3d_backward", [](Ctx& c) {
  Value x = c.tensor(1);
  return std::vector<Value>{scatterByIndex(c.b, c.tensor(0), x.shape(), c.tensor(2), 3, outType(c, x.dtype()))};
});

// --------------------------------------------------------------- max_pool3d

// PyTorch's pooling_output_shape.
int64_t poolOut(int64_t in, int64_t k, int64_t p, int64_t s, int64_t d, bool ceil) {
  int64_t num = in + 2 * p - d * (k - 1) - 1 + (ceil ? s - 1 : 0);
  int64_t out = (num >= 0 ? num / s : -((-num + s - 1) / s)) + 1;
  if (ceil && (out - 1) * s >= in + p) --out;
  return out;
}

// max_pool3d_with_indices(self, kernel, stride, padding, dilation, ceil_mode) -> (out, indices)
Registrar reg_max_pool3d_with_indices("max_pool3d_with_indices", [](Ctx& c) {
  Value x = c.tensor(0);
  ir::Builder& b = c.b;
  int64_t r = x.rank();
  if (r != 4 && r != 5) throw ir::Unsupported("max_pool3d: rank");
  auto expand = [](std::vector<int64_t> v, std::vector<int64_t> dflt) {
    if (v.empty()) return dflt;
    if (v.size() == 1) return std::vector<int64_t>(3, v[0]);
    return v;
  };
  auto k = expand(c.ints(1), {});
  auto st = expand(c.ints(2), k);
  auto pd = expand(c.has(3) ? c.ints(3) : std::vector<int64_t>{0}, {0, 0, 0});
  auto dl = expand(c.has(4) ? c.ints(4) : std::vector<int64_t>{1}, {1, 1, 1});
  bool ceil = c.flagOr(5, false);
  if (k.size() != 3 || st.size() != 3 || pd.size() != 3 || dl.size() != 3) throw ir::Unsupported("max_pool3d: args");
  int64_t lead = r - 3;
  Shape win(r, 1), str(r, 1), dil(r, 1);
  std::vector<std::pair<int64_t, int64_t>> pad(r, {0, 0});
  int64_t sp = 1;
  for (int i = 0; i < 3; ++i) {
    int64_t in = x.shape()[lead + i];
    int64_t o = poolOut(in, k[i], pd[i], st[i], dl[i], ceil);
    if (o <= 0) throw ir::Unsupported("max_pool3d: empty output");
    win[lead + i] = k[i];
    str[lead + i] = st[i];
    dil[lead + i] = dl[i];
    pad[lead + i] = {pd[i], (o - 1) * st[i] + dl[i] * (k[i] - 1) + 1 - in - pd[i]};
    sp *= in;
  }
  if (x.type.numel() == 0) throw ir::Unsupported("max_pool3d: empty input");
  Type it{DType::I64, x.shape()};
  auto ci = [&](int64_t v) { return b.constantInt(v, DType::I64, x.shape()); };
  int64_t dd = x.shape()[lead], hh = x.shape()[lead + 1], ww = x.shape()[lead + 2];
  (void)dd;
  Value flat =
      add(b, mul(b, add(b, mul(b, b.iota(it, lead), ci(hh)), b.iota(it, lead + 1)), ci(ww)), b.iota(it, lead + 2));
  DType t = x.dtype();
  bool is_float = ir::isFloat(t);
  auto res = b.reduceWindow({x, flat}, {b.constant(lowestValue(t), t), b.constantInt(-1, DType::I64)}, win, str,
                            Shape(r, 1), dil, pad, maxWithIndex(is_float));
  (void)sp;
  return std::vector<Value>{res[0], res[1]};
});

// max_pool3d_with_indices_backward(grad, self, kernel, stride, padding, dilation, ceil_mode, indices)
Registrar reg_max_pool3d_backward("max_pool3d_with_indices_backward", [](Ctx& c) {
  Value x = c.tensor(1);
  return std::vector<Value>{scatterByIndex(c.b, c.tensor(0), x.shape(), c.tensor(7), 3, outType(c, x.dtype()))};
});

// max_unpool2d(self, indices, output_size) / max_unpool3d(self, indices,
// output_size, stride, padding): each value goes to its flat index in the
// output plane. Indices outside the plane raise (PyTorch checks them too).
std::vector<Value> maxUnpool(Ctx& c, int n) {
  Value x = c.tensor(0), idx = c.tensor(1);
  auto os = c.ints(2);
  if (static_cast<int64_t>(os.size()) != n || x.rank() < n) throw ir::Unsupported("max_unpool: output_size");
  Shape shape(x.shape().begin(), x.shape().end() - n);
  int64_t plane = 1;
  for (auto d : os) {
    shape.push_back(d);
    plane *= d;
  }
  if (Type{x.dtype(), shape}.numel() == 0 || x.type.numel() == 0) return {c.b.zeros(Type{x.dtype(), shape})};
  c.requireInRange(indicesInRange(c.b, idx, plane, false));
  return {scatterByIndex(c.b, x, shape, idx, n, x.dtype(), false)};
}
Registrar reg_max_unpool2d("max_unpool2d", [](Ctx& c) { return maxUnpool(c, 2); });
Registrar reg_max_unpool3d("max_unpool3d", [](Ctx& c) { return maxUnpool(c, 3); });

// --------------------------------------------------------------- im2col / col2im

// im2col(self, kernel_size, dilation, padding, stride): (N, C, H, W) ->
// (N, C * kh * kw, L), channel index c * kh * kw + i * kw + j.
Registrar reg_im2col("im2col", [](Ctx& c) {
  Value x = c.tensor(0);
  ir::Builder& b = c.b;
  auto k = c.ints(1), dl = c.ints(2), pd = c.ints(3), st = c.ints(4);
  bool batched = x.rank() == 4;
  if (!batched) x = b.reshape(x, {1, x.shape()[0], x.shape()[1], x.shape()[2]});
  int64_t n = x.shape()[0], ch = x.shape()[1], h = x.shape()[2], w = x.shape()[3];
  int64_t oh = (h + 2 * pd[0] - (dl[0] * (k[0] - 1) + 1)) / st[0] + 1;
  int64_t ow = (w + 2 * pd[1] - (dl[1] * (k[1] - 1) + 1)) / st[1] + 1;
  if (oh <= 0 || ow <= 0 || x.type.numel() == 0) throw ir::Unsupported("im2col: empty");
  Value xp = b.pad(x, b.constant(0.0, x.dtype()), {0, 0, pd[0], pd[1]}, {0, 0, pd[0], pd[1]}, {0, 0, 0, 0});
  std::vector<Value> cols;
  for (int64_t i = 0; i < k[0]; ++i)
    for (int64_t j = 0; j < k[1]; ++j) {
      Shape s0{0, 0, i * dl[0], j * dl[1]};
      Shape s1{n, ch, i * dl[0] + (oh - 1) * st[0] + 1, j * dl[1] + (ow - 1) * st[1] + 1};
      Value sl = b.slice(xp, s0, s1, {1, 1, st[0], st[1]});
      cols.push_back(b.reshape(sl, {n, ch, 1, oh * ow}));
    }
  Value r = b.reshape(b.concatenate(cols, 2), {n, ch * k[0] * k[1], oh * ow});
  if (!batched) r = b.reshape(r, {ch * k[0] * k[1], oh * ow});
  return std::vector<Value>{r};
});

// col2im(self, output_size, kernel_size, dilation, padding, stride): the
// adjoint of im2col (overlapping patches add up).
Registrar reg_col2im("col2im", [](Ctx& c) {
  Value x = c.tensor(0);
  ir::Builder& b = c.b;
  auto os = c.ints(1), k = c.ints(2), dl = c.ints(3), pd = c.ints(4), st = c.ints(5);
  bool batched = x.rank() == 3;
  if (!batched) x = b.reshape(x, {1, x.shape()[0], x.shape()[1]});
  int64_t n = x.shape()[0], kk = k[0] * k[1];
  if (kk <= 0 || x.shape()[1] % kk != 0) throw ir::Unsupported("col2im: shape");
  int64_t ch = x.shape()[1] / kk;
  int64_t h = os[0], w = os[1];
  int64_t oh = (h + 2 * pd[0] - (dl[0] * (k[0] - 1) + 1)) / st[0] + 1;
  int64_t ow = (w + 2 * pd[1] - (dl[1] * (k[1] - 1) + 1)) / st[1] + 1;
  if (oh * ow != x.shape()[2] || x.type.numel() == 0) throw ir::Unsupported("col2im: shape");
  DType out = outType(c, x.dtype());
  DType acc = accOf(out);
  Value xc = b.reshape(b.convert(x, acc), {n, ch, kk, oh, ow});
  int64_t hp = h + 2 * pd[0], wp = w + 2 * pd[1];
  Value sum;
  for (int64_t i = 0; i < k[0]; ++i)
    for (int64_t j = 0; j < k[1]; ++j) {
      int64_t idx = i * k[1] + j;
      Value blk = b.reshape(b.slice(xc, {0, 0, idx, 0, 0}, {n, ch, idx + 1, oh, ow}, {1, 1, 1, 1, 1}), {n, ch, oh, ow});
      int64_t lo0 = i * dl[0], lo1 = j * dl[1];
      int64_t hi0 = hp - (lo0 + (oh - 1) * st[0] + 1), hi1 = wp - (lo1 + (ow - 1) * st[1] + 1);
      Value placed = b.pad(blk, b.constant(0.0, acc), {0, 0, lo0, lo1}, {0, 0, hi0, hi1}, {0, 0, st[0] - 1, st[1] - 1});
      sum = sum.valid() ? add(b, sum, placed) : placed;
    }
  Value r = b.pad(sum, b.constant(0.0, acc), {0, 0, -pd[0], -pd[1]}, {0, 0, -pd[0], -pd[1]}, {0, 0, 0, 0});
  if (!batched) r = b.reshape(r, {ch, h, w});
  return std::vector<Value>{b.convert(r, out)};
});

}  // namespace
}  // namespace tpu::ops
