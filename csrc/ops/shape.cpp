// Shape and construction ops: cat, pad, flip, roll, tril/triu, arange,
// linspace, eye, and the copies that materialise a new layout.
#include "ops/common.h"

namespace tpu::ops {
namespace {

Registrar reg_cat("cat", [](Ctx& c) {
  auto vs = c.tensors(0);
  std::vector<Value> keep;
  for (const auto& v : vs)
    if (!(v.rank() == 1 && v.shape()[0] == 0)) keep.push_back(v);  // legacy: 1-d empties are skipped
  DType t = vs.empty() ? DType::F32 : vs[0].dtype();
  for (const auto& v : vs) t = ir::promote(t, v.dtype());
  DType out = outType(c, t);
  if (keep.empty()) return std::vector<Value>{c.b.constant(0.0, out, {0})};
  int64_t dim = wrapDim(c.i64Or(1, 0), keep[0].rank());
  for (auto& v : keep) v = c.b.convert(v, out);
  return std::vector<Value>{c.b.concatenate(keep, dim)};
});

Registrar reg_constant_pad_nd("constant_pad_nd", [](Ctx& c) {
  Value x = c.tensor(0);
  auto pad = c.ints(1);
  Shape lo(x.rank(), 0), hi(x.rank(), 0), in(x.rank(), 0);
  for (size_t i = 0; i + 1 < pad.size() + 1 && i / 2 < static_cast<size_t>(x.rank()); i += 2) {
    int64_t d = x.rank() - 1 - static_cast<int64_t>(i / 2);
    lo[d] = pad[i];
    hi[d] = i + 1 < pad.size() ? pad[i + 1] : 0;
  }
  Value v = c.scalarOr(2, x.dtype(), 0.0);
  return std::vector<Value>{c.b.pad(x, v, lo, hi, in)};
});

Registrar reg_flip("flip", [](Ctx& c) {
  Value x = c.tensor(0);
  return std::vector<Value>{c.b.reverse(x, wrapDims(c.ints(1), x.rank()))};
});

Registrar reg_roll("roll", [](Ctx& c) {
  Value x = c.tensor(0);
  auto shifts = c.ints(1);
  auto dims = c.optInts(2).value_or(std::vector<int64_t>{});
  ir::Builder& b = c.b;
  Value r = x;
  if (dims.empty()) {  // roll the flattened tensor
    int64_t n = x.type.numel();
    r = b.reshape(x, {n});
    shifts = {shifts.at(0)};
    dims = {0};
  }
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrapDim(dims[i], r.rank());
    int64_t n = r.shape()[d];
    if (n == 0) continue;
    int64_t s = ((shifts[i] % n) + n) % n;
    if (s == 0) continue;
    Shape st(r.rank(), 0), lim = r.shape(), str(r.rank(), 1);
    st[d] = n - s;
    Value tail = b.slice(r, st, lim, str);
    st[d] = 0;
    lim[d] = n - s;
    Value head = b.slice(r, st, lim, str);
    r = b.concatenate({tail, head}, d);
  }
  return std::vector<Value>{b.reshape(r, x.shape())};
});

std::vector<Value> triangle(Ctx& c, bool lower) {
  Value x = c.tensor(0);
  int64_t k = c.i64Or(1, 0);
  int r = x.rank();
  Type it{DType::I64, x.shape()};
  Value row = c.b.iota(it, r - 2), col = c.b.iota(it, r - 1);
  Value diff = sub(c.b, col, row);
  Value kk = c.b.constantInt(k, DType::I64, x.shape());
  Value keep = c.b.compare(diff, kk, lower ? ir::Cmp::LE : ir::Cmp::GE);
  return {c.b.select(keep, x, c.b.zeros(x.type))};
}
Registrar reg_tril("tril", [](Ctx& c) { return triangle(c, true); });
Registrar reg_triu("triu", [](Ctx& c) { return triangle(c, false); });

// arange(start, end, step, out): values start + i*step in the out dtype.
Registrar reg_arange("arange",
                     [](Ctx& c) {
                       if (!c.hasExpected()) throw ir::Unsupported("arange without a known size");
                       const Type& out = c.expectedAt(0);
                       ir::Builder& b = c.b;
                       size_t n = c.size();
                       // arange.start_out(start, end, step, *, out) or arange.out(end, *, out)
                       bool has_start = n >= 4 && c.isScalarArg(1);
                       DType comp = ir::isFloat(out.dtype) ? DType::F64 : DType::I64;
                       Value start = has_start ? c.scalar(0, comp) : b.constant(0.0, comp);
                       Value step = has_start && c.has(2) ? c.scalar(2, comp) : b.constant(1.0, comp);
                       Value i = b.iota({comp, out.shape}, 0);
                       Value v = add(b, b.broadcastTo(start, out.shape), mul(b, i, b.broadcastTo(step, out.shape)));
                       return std::vector<Value>{b.convert(v, out.dtype)};
                     },
                     {0, 1, 2});  // the values decide the length: part of the program

// linspace.out(start, end, steps, *, out)
Registrar reg_linspace("linspace", [](Ctx& c) {
  if (!c.hasExpected()) throw ir::Unsupported("linspace without a known size");
  const Type& out = c.expectedAt(0);
  int64_t steps = c.i64(2);
  ir::Builder& b = c.b;
  DType comp = DType::F64;
  Value start = b.broadcastTo(c.scalar(0, comp), out.shape), end = b.broadcastTo(c.scalar(1, comp), out.shape);
  if (steps <= 1) return std::vector<Value>{b.convert(start, out.dtype)};
  Value step = div(b, sub(b, end, start), b.constant(static_cast<double>(steps - 1), comp, out.shape));
  Value i = b.iota({comp, out.shape}, 0);
  Value fwd = add(b, start, mul(b, i, step));
  Value bwd = sub(b, end, mul(b, sub(b, b.constant(static_cast<double>(steps - 1), comp, out.shape), i), step));
  Value half = b.constant(static_cast<double>(steps / 2), comp, out.shape);
  Value v = b.select(b.compare(i, half, ir::Cmp::LT), fwd, bwd);
  if (!ir::isFloat(out.dtype)) v = mul(b, b.unary("sign", v), b.unary("floor", b.unary("abs", v)));
  return std::vector<Value>{b.convert(v, out.dtype)};
});

// eye.m_out(n, m, *, out) / eye.out(n, *, out)
Registrar reg_eye("eye", [](Ctx& c) {
  if (!c.hasExpected()) throw ir::Unsupported("eye without a known size");
  const Type& out = c.expectedAt(0);
  Type it{DType::I64, out.shape};
  Value eq = c.b.compare(c.b.iota(it, 0), c.b.iota(it, 1), ir::Cmp::EQ);
  return std::vector<Value>{c.b.convert(eq, out.dtype)};
});

// select_backward / slice_backward: zeros with the gradient placed in.
Registrar reg_slice_backward("slice_backward", [](Ctx& c) {
  Value g = c.tensor(0);
  auto sizes = c.ints(1);
  int64_t dim = wrapDim(c.i64(2), static_cast<int64_t>(sizes.size()));
  int64_t n = sizes[dim];
  int64_t start = c.i64(3), end = c.i64(4), step = c.i64(5);
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape lo(sizes.size(), 0), hi(sizes.size(), 0), in(sizes.size(), 0);
  int64_t cnt = g.shape()[dim];
  lo[dim] = start;
  in[dim] = step - 1;
  int64_t span = cnt > 0 ? (cnt - 1) * step + 1 : 0;
  hi[dim] = n - start - span;
  return std::vector<Value>{c.b.pad(g, c.b.constant(0.0, g.dtype()), lo, hi, in)};
});
Registrar reg_select_backward("select_backward", [](Ctx& c) {
  Value g = c.tensor(0);
  auto sizes = c.ints(1);
  int64_t dim = wrapDim(c.i64(2), static_cast<int64_t>(sizes.size()));
  int64_t idx = c.i64(3);
  if (idx < 0) idx += sizes[dim];
  Shape s = sizes;
  s[dim] = 1;
  Value gg = c.b.reshape(g, s);
  Shape lo(sizes.size(), 0), hi(sizes.size(), 0), in(sizes.size(), 0);
  lo[dim] = idx;
  hi[dim] = sizes[dim] - idx - 1;
  return std::vector<Value>{c.b.pad(gg, c.b.constant(0.0, g.dtype()), lo, hi, in)};
});

}  // namespace
}  // namespace tpu::ops
