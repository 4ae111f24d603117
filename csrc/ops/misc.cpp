// Miscellaneous lowerings: shrink activations, GLU, smooth-L1/Huber losses,
// 2-d NLL loss (via the 1-d lowering), trace, count_nonzero, aminmax,
// channel_shuffle, linalg_cross, logit_backward.
#include <cmath>
#include <limits>

#include "ops/common.h"

namespace tpu::ops {
namespace {

Arg tensorArg(const Value& v) {
  Arg a;
  a.kind = Arg::Kind::Tensor;
  a.value = v;
  return a;
}
Arg intListArg(std::vector<int64_t> v) {
  Arg a;
  a.kind = Arg::Kind::IntList;
  a.ints = std::move(v);
  return a;
}
Arg intArg(int64_t v) {
  Arg a;
  a.kind = Arg::Kind::Int;
  a.i = v;
  return a;
}
Arg boolArg(bool v) {
  Arg a;
  a.kind = Arg::Kind::Bool;
  a.b = v;
  return a;
}

// Runs another op's registered lowering on the given arguments.
std::vector<Value> delegate(Ctx& c, const std::string& name, std::vector<Arg> args, std::vector<Type> expected = {}) {
  const Lowering* l = findLowering(name, "");
  if (!l || l->data_dependent || !l->const_scalars.empty())
    throw ir::Unsupported("no lowering to delegate to: " + name);
  Ctx sub(c.b, name, std::move(args), std::move(expected));
  auto r = l->fn(sub);
  if (!sub.mutations().empty() || sub.rngStatesUsed() > 0) throw ir::Unsupported("delegated lowering has side effects");
  if (sub.boundsOk().valid()) c.requireInRange(sub.boundsOk());
  return r;
}

std::vector<int64_t> allDims(int rank) {
  std::vector<int64_t> d;
  for (int i = 0; i < rank; ++i) d.push_back(i);
  return d;
}

Value reduceLoss(ir::Builder& b, const Value& l, int64_t reduction) {
  if (reduction == 0) return l;
  Value s = reduceSum(b, l, allDims(l.rank()));
  if (reduction == 1) s = div(b, s, b.constant(static_cast<double>(l.type.numel()), l.dtype()));
  return s;
}

// Gradient of a reduced loss broadcast back to the elementwise shape.
Value lossGrad(ir::Builder& b, const Value& g, const Shape& shape, int64_t reduction, DType acc) {
  Value gg = b.broadcastTo(b.convert(g, acc), shape);
  int64_t n = 1;
  for (auto s : shape) n *= s;
  if (reduction == 1) gg = div(b, gg, b.constant(static_cast<double>(n), acc, shape));
  return gg;
}

// --- shrink activations
Value shrink(Ctx& c, const Value& x, const Value& lambd, bool soft) {
  ir::Builder& b = c.b;
  Value l = b.broadcastTo(lambd, x.shape());
  Value nl = b.unary("negate", l);
  Value zero = b.constant(0.0, x.dtype(), x.shape());
  // Zero inside [-l, l], as PyTorch tests it: a NaN is not inside and stays NaN.
  Value inside = b.binary("and", b.compare(x, nl, ir::Cmp::GE), b.compare(x, l, ir::Cmp::LE));
  if (!soft) return b.select(inside, zero, x);
  return b.select(inside, zero, b.select(b.compare(x, l, ir::Cmp::GT), sub(b, x, l), add(b, x, l)));
}
Registrar reg_hardshrink("hardshrink", [](Ctx& c) {
  Value x = c.tensor(0);
  DType acc = accOf(floatOf(x.dtype()));
  Value r = shrink(c, c.b.convert(x, acc), c.scalarOr(1, acc, 0.5), false);
  return std::vector<Value>{c.b.convert(r, outType(c, x.dtype()))};
});
Registrar reg_softshrink("softshrink", [](Ctx& c) {
  Value x = c.tensor(0);
  DType acc = accOf(floatOf(x.dtype()));
  Value r = shrink(c, c.b.convert(x, acc), c.scalarOr(1, acc, 0.5), true);
  return std::vector<Value>{c.b.convert(r, outType(c, x.dtype()))};
});
std::vector<Value> shrinkBackward(Ctx& c) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0), x = c.tensor(1);
  DType acc = accOf(floatOf(x.dtype()));
  auto vs = broadcastAll(b, {b.convert(g, acc), b.convert(x, acc)});
  Value l = b.broadcastTo(c.scalar(2, acc), vs[1].shape());
  Value inside = b.binary("and", b.compare(vs[1], b.unary("negate", l), ir::Cmp::GE), b.compare(vs[1], l, ir::Cmp::LE));
  Value r = b.select(inside, b.constant(0.0, acc, vs[0].shape()), vs[0]);
  return {b.convert(r, outType(c, g.dtype()))};
}
Registrar reg_hardshrink_backward("hardshrink_backward", shrinkBackward);
Registrar reg_softshrink_backward("softshrink_backward", shrinkBackward);

// --- GLU
std::pair<Value, Value> halves(ir::Builder& b, const Value& x, int64_t dim) {
  int64_t n = x.shape()[dim];
  if (n % 2) throw ir::Unsupported("glu: odd dimension");
  Shape start(x.rank(), 0), mid = x.shape(), start2(x.rank(), 0), strides(x.rank(), 1);
  mid[dim] = n / 2;
  start2[dim] = n / 2;
  return {b.slice(x, start, mid, strides), b.slice(x, start2, x.shape(), strides)};
}
Registrar reg_glu("glu", [](Ctx& c) {
  Value x = c.tensor(0);
  if (x.rank() == 0) throw ir::Unsupported("glu of a 0-d tensor");
  int64_t dim = wrapDim(c.i64Or(1, -1), x.rank());
  DType acc = accOf(x.dtype());
  auto [a, g] = halves(c.b, c.b.convert(x, acc), dim);
  return std::vector<Value>{c.b.convert(mul(c.b, a, c.b.unary("logistic", g)), x.dtype())};
});
Registrar reg_glu_backward("glu_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value go = c.tensor(0), x = c.tensor(1);
  int64_t dim = wrapDim(c.i64(2), x.rank());
  DType acc = accOf(x.dtype());
  auto [a, g] = halves(b, b.convert(x, acc), dim);
  Value gg = b.convert(go, acc);
  Value s = b.unary("logistic", g);
  Value da = mul(b, gg, s);
  Value one = b.constant(1.0, acc, s.shape());
  Value db = mul(b, mul(b, gg, a), mul(b, s, sub(b, one, s)));
  return std::vector<Value>{b.convert(b.concatenate({da, db}, dim), x.dtype())};
});

// --- smooth L1 / Huber
std::vector<Value> smoothLoss(Ctx& c, bool huber) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0), t = c.tensor(1);
  int64_t reduction = c.i64Or(2, 1);
  double beta = c.f64Or(3, 1.0);
  DType acc = accOf(floatOf(x.dtype()));
  auto vs = broadcastAll(b, {b.convert(x, acc), b.convert(t, acc)});
  Value z = b.unary("abs", sub(b, vs[0], vs[1]));
  const Shape& sh = z.shape();
  Value bb = b.constant(beta, acc, sh), half = b.constant(0.5, acc, sh);
  Value small = b.compare(z, bb, ir::Cmp::LT);
  Value l;
  if (huber) {
    l = b.select(small, mul(b, half, mul(b, z, z)), mul(b, bb, sub(b, z, mul(b, half, bb))));
  } else if (beta == 0) {
    l = z;
  } else {
    l = b.select(small, div(b, mul(b, half, mul(b, z, z)), bb), sub(b, z, mul(b, half, bb)));
  }
  return {b.convert(reduceLoss(b, l, reduction), outType(c, x.dtype()))};
}
Registrar reg_smooth_l1_loss("smooth_l1_loss", [](Ctx& c) { return smoothLoss(c, false); });
Registrar reg_huber_loss("huber_loss", [](Ctx& c) { return smoothLoss(c, true); });
std::vector<Value> smoothLossBackward(Ctx& c, bool huber) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0), x = c.tensor(1), t = c.tensor(2);
  int64_t reduction = c.i64(3);
  double beta = c.f64(4);
  DType acc = accOf(floatOf(x.dtype()));
  auto vs = broadcastAll(b, {b.convert(x, acc), b.convert(t, acc)});
  Value d = sub(b, vs[0], vs[1]);
  const Shape& sh = d.shape();
  Value bb = b.constant(beta, acc, sh), nb = b.constant(-beta, acc, sh);
  Value hi = b.compare(d, bb, ir::Cmp::GT), lo = b.compare(d, nb, ir::Cmp::LT);
  Value mid = huber ? d : (beta == 0 ? b.constant(0.0, acc, sh) : div(b, d, bb));
  Value pos = huber ? bb : b.constant(1.0, acc, sh);
  Value neg = huber ? nb : b.constant(-1.0, acc, sh);
  Value r = b.select(hi, pos, b.select(lo, neg, mid));
  r = mul(b, r, lossGrad(b, g, sh, reduction, acc));
  return {b.convert(r, outType(c, x.dtype()))};
}
Registrar reg_smooth_l1_loss_backward("smooth_l1_loss_backward", [](Ctx& c) { return smoothLossBackward(c, false); });
Registrar reg_huber_loss_backward("huber_loss_backward", [](Ctx& c) { return smoothLossBackward(c, true); });

// --- 2-d NLL loss: (N, C, H, W) -> (N*H*W, C) and the 1-d lowering.
Value flattenNll(ir::Builder& b, const Value& x) {
  const Shape& s = x.shape();
  Value t = b.transpose(x, {0, 2, 3, 1});
  return b.reshape(t, {s[0] * s[2] * s[3], s[1]});
}
Arg optTensorArg(const std::optional<Value>& v) { return v ? tensorArg(*v) : Arg{}; }
Registrar reg_nll_loss2d_forward("nll_loss2d_forward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0), t = c.tensor(1);
  if (x.rank() != 4 || t.rank() != 3) throw ir::Unsupported("nll_loss2d: expected 4-d input");
  int64_t reduction = c.i64(3);
  Value tt = b.reshape(t, {t.type.numel()});
  auto r = delegate(
      c, "nll_loss_forward",
      {tensorArg(flattenNll(b, x)), tensorArg(tt), optTensorArg(c.optTensor(2)), intArg(reduction), intArg(c.i64(4))});
  if (reduction == 0) r[0] = b.reshape(r[0], t.shape());
  return r;
});
Registrar reg_nll_loss2d_backward("nll_loss2d_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0), x = c.tensor(1), t = c.tensor(2);
  if (x.rank() != 4 || t.rank() != 3) throw ir::Unsupported("nll_loss2d: expected 4-d input");
  int64_t reduction = c.i64(4);
  Value gg = reduction == 0 ? b.reshape(g, {g.type.numel()}) : g;
  Value tt = b.reshape(t, {t.type.numel()});
  auto r = delegate(c, "nll_loss_backward",
                    {tensorArg(gg), tensorArg(flattenNll(b, x)), tensorArg(tt), optTensorArg(c.optTensor(3)),
                     intArg(reduction), intArg(c.i64(5)), tensorArg(c.tensor(6))});
  const Shape& s = x.shape();
  Value back = b.reshape(r[0], {s[0], s[2], s[3], s[1]});
  return std::vector<Value>{b.transpose(back, {0, 3, 1, 2})};
});

// --- reductions
Registrar reg_trace("trace", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  if (x.rank() != 2) throw ir::Unsupported("trace: expected a matrix");
  DType out = outType(c, (ir::isInt(x.dtype()) || x.dtype() == DType::Bool) ? DType::I64 : x.dtype());
  DType acc = accOf(out);
  Value xx = b.convert(x, acc);
  Type it{DType::I64, x.shape()};
  Value diag = b.compare(b.iota(it, 0), b.iota(it, 1), ir::Cmp::EQ);
  Value r = reduceSum(b, b.select(diag, xx, b.constant(0.0, acc, x.shape())), {0, 1});
  return std::vector<Value>{b.convert(r, out)};
});
Registrar reg_count_nonzero("count_nonzero", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  if (ir::isComplex(x.dtype())) throw ir::Unsupported("count_nonzero of complex");
  auto dims = reductionDims(c.optInts(1), x.rank());
  if (x.rank() == 0) dims.clear();
  Value nz = b.compare(x, b.constant(0.0, x.dtype(), x.shape()), ir::Cmp::NE);
  Value r = reduceSum(b, b.convert(nz, DType::I64), dims);
  return std::vector<Value>{r};
});
Registrar reg_aminmax("aminmax", [](Ctx& c) {
  Value x = c.tensor(0);
  bool keep = c.flagOr(2, false);
  std::vector<int64_t> dims;
  if (c.has(1))
    dims = {c.i64(1)};
  else if (keep)
    dims = allDims(x.rank());  // amax treats [] as all dims
  Value lo = delegate(c, "amin", {tensorArg(x), intListArg(dims), boolArg(keep)})[0];
  Value hi = delegate(c, "amax", {tensorArg(x), intListArg(dims), boolArg(keep)})[0];
  return std::vector<Value>{lo, hi};
});

// --- shape-like
Registrar reg_channel_shuffle("channel_shuffle", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  int64_t g = c.i64(1);
  if (x.rank() < 3 || g <= 0 || x.shape()[1] % g) throw ir::Unsupported("channel_shuffle arguments");
  const Shape& s = x.shape();
  Shape split{s[0], g, s[1] / g};
  std::vector<int64_t> perm{0, 2, 1};
  for (int i = 2; i < x.rank(); ++i) {
    split.push_back(s[i]);
    perm.push_back(i + 1);
  }
  return std::vector<Value>{b.reshape(b.transpose(b.reshape(x, split), perm), s)};
});

Registrar reg_linalg_cross("linalg_cross", [](Ctx& c) {
  ir::Builder& b = c.b;
  DType t = outType(c, resultType(c, {0, 1}));
  if (ir::isComplex(t)) throw ir::Unsupported("complex cross");
  auto vs = broadcastAll(b, {b.convert(c.tensor(0), t), b.convert(c.tensor(1), t)});
  int64_t dim = wrapDim(c.i64Or(2, -1), vs[0].rank());
  if (vs[0].shape()[dim] != 3) throw ir::Unsupported("cross: dim size must be 3");
  auto comp = [&](const Value& v, int64_t i) {
    Shape st(v.rank(), 0), lim = v.shape(), str(v.rank(), 1);
    st[dim] = i;
    lim[dim] = i + 1;
    return b.slice(v, st, lim, str);
  };
  Value a0 = comp(vs[0], 0), a1 = comp(vs[0], 1), a2 = comp(vs[0], 2);
  Value b0 = comp(vs[1], 0), b1 = comp(vs[1], 1), b2 = comp(vs[1], 2);
  Value r0 = sub(b, mul(b, a1, b2), mul(b, a2, b1));
  Value r1 = sub(b, mul(b, a2, b0), mul(b, a0, b2));
  Value r2 = sub(b, mul(b, a0, b1), mul(b, a1, b0));
  return std::vector<Value>{b.concatenate({r0, r1, r2}, dim)};
});

// logit_backward(grad, self, eps?)
Registrar reg_logit_backward("logit_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0), x = c.tensor(1);
  DType acc = accOf(floatOf(x.dtype()));
  auto vs = broadcastAll(b, {b.convert(g, acc), b.convert(x, acc)});
  const Shape& sh = vs[1].shape();
  Value xx = vs[1];
  Value one = b.constant(1.0, acc, sh);
  Value r = div(b, vs[0], mul(b, xx, sub(b, one, xx)));
  bool has_eps = c.has(2);
  double eps = has_eps ? c.f64(2) : -1.0;
  double lo = eps < 0 ? 0.0 : eps, hi = eps < 0 ? 1.0 : 1.0 - eps;
  Value out = b.binary("or", b.compare(xx, b.constant(lo, acc, sh), ir::Cmp::LT),
                       b.compare(xx, b.constant(hi, acc, sh), ir::Cmp::GT));
  r = b.select(out, b.constant(eps < 0 ? NAN : 0.0, acc, sh), r);
  return std::vector<Value>{b.convert(r, outType(c, x.dtype()))};
});

// Picks, along `dim`, the element at position `pos` (shape of x without dim).
Value pickAlong(ir::Builder& b, const Value& x, int64_t dim, const Value& pos) {
  std::vector<int64_t> keep;
  for (int i = 0; i < x.rank(); ++i)
    if (i != dim) keep.push_back(i);
  Value hit = b.compare(b.iota({DType::I64, x.shape()}, static_cast<int>(dim)), b.broadcastInDim(pos, x.shape(), keep),
                        ir::Cmp::EQ);
  Value zero = b.constant(0.0, x.dtype(), x.shape());
  Value sel = b.select(hit, x, zero);
  if (x.dtype() == DType::Bool) return reduceMax(b, sel, {dim});
  return reduceSum(b, sel, {dim});
}

// Sorted values/indices along dim (NaN last), via the sort lowering.
std::vector<Value> sortAlong(Ctx& c, const Value& x, int64_t dim) {
  return delegate(c, "sort", {tensorArg(x), intArg(dim), boolArg(false)});
}

// Selects order statistic `pos` (per row) from the sorted row.
std::vector<Value> orderStat(Ctx& c, const Value& x, int64_t dim, bool keep,
                             const std::function<Value(const Value& nan_count, int64_t n)>& position) {
  ir::Builder& b = c.b;
  auto s = sortAlong(c, x, dim);
  int64_t n = x.shape()[dim];
  Value nan_count = ir::isFloat(x.dtype()) ? reduceSum(b, b.convert(b.compare(x, x, ir::Cmp::NE), DType::I64), {dim})
                                           : b.constantInt(0, DType::I64, [&] {
                                               Shape r;
                                               for (int i = 0; i < x.rank(); ++i)
                                                 if (i != dim) r.push_back(x.shape()[i]);
                                               return r;
                                             }());
  Value pos = position(nan_count, n);
  Value v = pickAlong(b, s[0], dim, pos), i = pickAlong(b, s[1], dim, pos);
  if (keep) {
    v = keepDims(b, v, x.shape(), {dim});
    i = keepDims(b, i, x.shape(), {dim});
  }
  return {v, i};
}

// median: the lower middle; any NaN makes it NaN (the first NaN's index).
Value medianPos(ir::Builder& b, const Value& nan_count, int64_t n, bool ignore_nan) {
  Value nn = b.constantInt(n, DType::I64, nan_count.shape());
  Value one = b.constantInt(1, DType::I64, nan_count.shape()), two = b.constantInt(2, DType::I64, nan_count.shape());
  if (ignore_nan) {
    Value valid = sub(b, nn, nan_count);
    Value p = div(b, sub(b, valid, one), two);
    Value zero = b.constantInt(0, DType::I64, nan_count.shape());
    return b.select(b.compare(valid, zero, ir::Cmp::GT), p, zero);
  }
  Value mid = b.constantInt((n - 1) / 2, DType::I64, nan_count.shape());
  Value zero = b.constantInt(0, DType::I64, nan_count.shape());
  return b.select(b.compare(nan_count, zero, ir::Cmp::GT), sub(b, nn, nan_count), mid);
}

std::vector<Value> medianImpl(Ctx& c, bool ignore_nan) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  if (ir::isComplex(x.dtype())) throw ir::Unsupported("complex median");
  auto pos = [&](const Value& nc, int64_t n) { return medianPos(b, nc, n, ignore_nan); };
  if (!c.has(1)) {  // full reduction: value only
    if (x.type.numel() == 0) throw ir::Unsupported("median of an empty tensor");
    Value flat = b.reshape(x, {x.type.numel()});
    return {orderStat(c, flat, 0, false, pos)[0]};
  }
  bool keep = c.flagOr(2, false);
  if (x.rank() == 0) return {x, b.constantInt(0, DType::I64)};
  int64_t dim = wrapDim(c.i64(1), x.rank());
  if (x.shape()[dim] == 0) throw ir::Unsupported("median over an empty dim");
  return orderStat(c, x, dim, keep, pos);
}
Registrar reg_median("median", [](Ctx& c) { return medianImpl(c, false); });
Registrar reg_nanmedian("nanmedian", [](Ctx& c) { return medianImpl(c, true); });

// kthvalue(self, k, dim=-1, keepdim=False)
Registrar reg_kthvalue("kthvalue", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  int64_t k = c.i64(1);
  bool keep = c.flagOr(3, false);
  if (x.rank() == 0) {
    if (k != 1) throw ir::Unsupported("kthvalue: k out of range");
    return std::vector<Value>{x, b.constantInt(0, DType::I64)};
  }
  int64_t dim = wrapDim(c.i64Or(2, -1), x.rank());
  if (k < 1 || k > x.shape()[dim]) throw ir::Unsupported("kthvalue: k out of range");
  // Among equal values PyTorch leaves the index unspecified; this is the
  // position in a stable sort.
  auto s = sortAlong(c, x, dim);
  Shape start(x.rank(), 0), limit = x.shape(), strides(x.rank(), 1);
  start[dim] = k - 1;
  limit[dim] = k;
  Value v = b.slice(s[0], start, limit, strides), i = b.slice(s[1], start, limit, strides);
  if (!keep) {
    Shape r;
    for (int d = 0; d < x.rank(); ++d)
      if (d != dim) r.push_back(x.shape()[d]);
    v = b.reshape(v, r);
    i = b.reshape(i, r);
  }
  return std::vector<Value>{v, i};
});

// cummax(self, dim) / cummin, and the helpers their composite calls,
// _cummax_helper(self, values!, indices!, dim): an inclusive scan of (value,
// index) pairs; NaN wins, ties take the later index. cummax is lowered whole
// so that the dispatcher sees it and refuses what PyTorch's cummax refuses
// (complex).
std::vector<Value> cumExtreme(Ctx& c, bool is_max, size_t dim_arg) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  Value vals, idx;
  if (x.rank() == 0) {
    vals = x;
    idx = b.constantInt(0, DType::I64);
  } else {
    int64_t dim = wrapDim(c.i64(dim_arg), x.rank());
    int64_t n = x.shape()[dim];
    Shape window(x.rank(), 1), strides(x.rank(), 1), dil(x.rank(), 1);
    std::vector<std::pair<int64_t, int64_t>> pad(x.rank(), {0, 0});
    window[dim] = n;
    pad[dim] = {n - 1, 0};
    bool is_float = ir::isFloat(x.dtype());
    Value io = b.iota({DType::I64, x.shape()}, static_cast<int>(dim));
    Value init;
    if (x.dtype() == DType::Bool) {
      init = b.constant(is_max ? 0.0 : 1.0, DType::Bool);
    } else if (is_float) {
      init = b.constant(is_max ? -INFINITY : INFINITY, x.dtype());
    } else {  // exact integer limits (int64's do not survive a double)
      int64_t lim = x.dtype() == DType::I64
                        ? (is_max ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int64_t>::max())
                        : static_cast<int64_t>(is_max ? lowestValue(x.dtype()) : highestValue(x.dtype()));
      init = b.constantInt(lim, x.dtype());
    }
    auto r = b.reduceWindow({x, io}, {init, b.constantInt(-1, DType::I64)}, window, strides, dil, dil, pad,
                            [is_max, is_float](ir::Builder& bb, const std::vector<Value>& a) {
                              Value av = a[0], ai = a[1], bv = a[2], bi = a[3];
                              Value better = bb.compare(bv, av, is_max ? ir::Cmp::GT : ir::Cmp::LT);
                              Value tie = bb.compare(bv, av, ir::Cmp::EQ);
                              if (is_float) {
                                Value an = bb.compare(av, av, ir::Cmp::NE), bn = bb.compare(bv, bv, ir::Cmp::NE);
                                better = bb.binary("or", bb.binary("and", bn, bb.unary("not", an)), better);
                                tie = bb.binary("or", tie, bb.binary("and", an, bn));
                              }
                              Value later = bb.compare(bi, ai, ir::Cmp::GT);
                              Value pick_b = bb.binary("or", better, bb.binary("and", tie, later));
                              return std::vector<Value>{bb.select(pick_b, bv, av), bb.select(pick_b, bi, ai)};
                            });
    vals = r[0];
    idx = r[1];
  }
  return {vals, idx};
}
std::vector<Value> cumExtremeHelper(Ctx& c, bool is_max) {
  std::vector<Value> r = cumExtreme(c, is_max, 3);
  c.mutate(1, r[0]);
  c.mutate(2, r[1]);
  return {};
}
Registrar reg_cummax("cummax", [](Ctx& c) { return cumExtreme(c, true, 1); });
Registrar reg_cummin("cummin", [](Ctx& c) { return cumExtreme(c, false, 1); });
Registrar reg_cummax_helper("_cummax_helper", [](Ctx& c) { return cumExtremeHelper(c, true); });
Registrar reg_cummin_helper("_cummin_helper", [](Ctx& c) { return cumExtremeHelper(c, false); });

// diag_embed(self, offset, dim1, dim2)
Registrar reg_diag_embed("diag_embed", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  int64_t off = c.i64Or(1, 0);
  int64_t rank = x.rank() + 1;
  int64_t d1 = wrapDim(c.i64Or(2, -2), rank), d2 = wrapDim(c.i64Or(3, -1), rank);
  if (x.rank() == 0 || d1 == d2) throw ir::Unsupported("diag_embed arguments");
  int64_t n = x.shape().back() + (off < 0 ? -off : off);
  Shape out;
  std::vector<int64_t> map;
  int j = 0;
  for (int64_t i = 0; i < rank; ++i) {
    if (i == d1 || i == d2) {
      out.push_back(n);
    } else {
      out.push_back(x.shape()[j]);
      map.push_back(i);
      ++j;
    }
  }
  // x's last dim runs along the diagonal: position p = row (dim1) index
  // for offset >= 0, column (dim2) index for offset < 0.
  Value r1 = b.iota({DType::I64, out}, static_cast<int>(d1)), r2 = b.iota({DType::I64, out}, static_cast<int>(d2));
  Value on = b.compare(sub(b, r2, r1), b.constantInt(off, DType::I64, out), ir::Cmp::EQ);
  int64_t m = x.shape().back();
  // Pad x's last dim to n, then broadcast it along the other diagonal dim.
  Value xp = b.pad(
      x, b.constant(0.0, x.dtype()), Shape(x.rank(), 0),
      [&] {
        Shape hi(x.rank(), 0);
        hi.back() = n - m;
        return hi;
      }(),
      Shape(x.rank(), 0));
  map.push_back(off >= 0 ? d1 : d2);
  Value xb = b.broadcastInDim(xp, out, map);
  return std::vector<Value>{b.select(on, xb, b.constant(0.0, x.dtype(), out))};
});

// logspace(start, end, steps, base): base ** linspace(start, end, steps).
Registrar reg_logspace("logspace", [](Ctx& c) {
  if (!c.hasExpected()) throw ir::Unsupported("logspace without a known size");
  const Type& out = c.expectedAt(0);
  if (!ir::isFloat(out.dtype)) throw ir::Unsupported("integer logspace");
  ir::Builder& b = c.b;
  Value start = c.scalar(0, DType::F64), end = c.scalar(1, DType::F64);
  Value lin =
      delegate(c, "linspace", {tensorArg(start), tensorArg(end), intArg(c.i64(2))}, {Type{DType::F64, out.shape}})[0];
  Value r = b.binary("power", b.constant(c.f64Or(3, 10.0), DType::F64, out.shape), lin);
  return std::vector<Value>{b.convert(r, out.dtype)};
});

// renorm(self, p, dim, maxnorm): rescales each slice along dim to norm <= maxnorm.
Registrar reg_renorm("renorm",
                     [](Ctx& c) {
                       ir::Builder& b = c.b;
                       Value x = c.tensor(0);
                       double p = c.constScalar(1), maxnorm = c.constScalar(3);
                       if (std::isnan(p) || p <= 0 || x.rank() == 0 || ir::isComplex(x.dtype()))
                         throw ir::Unsupported("renorm arguments");
                       int64_t dim = wrapDim(c.i64(2), x.rank());
                       DType acc = accOf(floatOf(x.dtype()));
                       Value xx = b.convert(x, acc);
                       std::vector<int64_t> others;
                       for (int i = 0; i < x.rank(); ++i)
                         if (i != dim) others.push_back(i);
                       Value a = b.unary("abs", xx);
                       Value norm;
                       if (std::isinf(p)) {
                         norm = reduceMax(b, a, others);
                       } else if (p == 1) {
                         norm = reduceSum(b, a, others);
                       } else if (p == 2) {
                         norm = b.unary("sqrt", reduceSum(b, mul(b, a, a), others));
                       } else {
                         Value pp = b.constant(p, acc, a.shape());
                         Value s = reduceSum(b, b.binary("power", a, pp), others);
                         norm = b.binary("power", s, b.constant(1.0 / p, acc, s.shape()));
                       }
                       const Shape& ns = norm.shape();
                       Value mx = b.constant(maxnorm, acc, ns);
                       Value f =
                           b.select(b.compare(norm, mx, ir::Cmp::GT),
                                    div(b, mx, add(b, norm, b.constant(1e-7, acc, ns))), b.constant(1.0, acc, ns));
                       Value r = mul(b, xx, b.broadcastInDim(f, x.shape(), {dim}));
                       return std::vector<Value>{b.convert(r, x.dtype())};
                     },
                     {1, 3});

// searchsorted(sorted_sequence, self, out_int32, right, side, sorter) and
// bucketize(self, boundaries, out_int32, right): PyTorch's binary search step
// for step (a boundary not `>= x`, or not `> x` for right, moves the search
// right), so NaN queries and NaN boundaries land where the CPU puts them.
// ceil(log2(m + 1)) gathers of one element a query.
Value searchImpl(ir::Builder& b, const Value& seq, const Value& x, bool right, DType out,
                 const std::optional<Value>& sorter) {
  DType t = ir::promote(seq.dtype(), x.dtype());
  Value s = b.convert(seq, t), v = b.convert(x, t);
  const int64_t m = s.shape().back(), r = s.rank();
  if (r > 1 && r != v.rank()) throw ir::Unsupported("searchsorted: rank mismatch");
  const Shape& vs = v.shape();
  ir::Builder::GatherDims dn;  // one element of each query's row: leading dims batch
  for (int64_t i = 0; i + 1 < r; ++i) {
    dn.operand_batching_dims.push_back(i);
    dn.start_indices_batching_dims.push_back(i);
  }
  dn.collapsed_slice_dims = {r - 1};
  dn.start_index_map = {r - 1};
  dn.index_vector_dim = v.rank();
  Shape at_shape = vs;
  at_shape.push_back(1);
  auto at = [&](const Value& from, const Value& pos) {
    return b.reshape(b.gather(from, b.reshape(pos, at_shape), dn, Shape(r, 1)), vs);
  };
  auto ci = [&](int64_t n) { return b.constantInt(n, DType::I64, vs); };
  const std::optional<Value> order = sorter ? std::optional<Value>(b.convert(*sorter, DType::I64)) : std::nullopt;
  Value lo = ci(0), hi = ci(m);
  for (int64_t n = m; n > 0; n >>= 1) {
    Value active = b.compare(lo, hi, ir::Cmp::LT);
    Value mid = b.select(active, b.binary("divide", add(b, lo, hi), ci(2)), ci(0));
    Value bound = at(s, order ? at(*order, mid) : mid);
    Value go = b.unary("not", b.compare(bound, v, right ? ir::Cmp::GT : ir::Cmp::GE));
    lo = b.select(b.binary("and", active, go), add(b, mid, ci(1)), lo);
    hi = b.select(b.binary("and", active, b.unary("not", go)), mid, hi);
  }
  return b.convert(lo, out);
}
Registrar reg_searchsorted("searchsorted", [](Ctx& c) {
  Value seq = c.tensor(0), x = c.tensor(1);
  if (seq.rank() == 0 || ir::isComplex(seq.dtype())) throw ir::Unsupported("searchsorted arguments");
  bool right = c.flagOr(3, false);
  if (c.has(4)) right = c.str(4) == "right";
  DType out = c.flagOr(2, false) ? DType::I32 : DType::I64;
  return std::vector<Value>{searchImpl(c.b, seq, x, right, out, c.optTensor(5))};
});
Registrar reg_bucketize("bucketize", [](Ctx& c) {
  Value x = c.tensor(0), bnd = c.tensor(1);
  if (bnd.rank() != 1 || ir::isComplex(x.dtype())) throw ir::Unsupported("bucketize arguments");
  DType out = c.flagOr(2, false) ? DType::I32 : DType::I64;
  return std::vector<Value>{searchImpl(c.b, bnd, x, c.flagOr(3, false), out, std::nullopt)};
});

// tril_indices / triu_indices(row, col, offset): one short run per row.
std::vector<Value> triIndices(Ctx& c, bool upper) {
  ir::Builder& b = c.b;
  int64_t row = c.i64(0), col = c.i64(1), off = c.i64Or(2, 0);
  if (!c.hasExpected()) throw ir::Unsupported("tri_indices without a known size");
  DType out = c.expectedAt(0).dtype;
  if (row > 512) throw ir::Unsupported("tri_indices: too many rows");
  std::vector<Value> rs, cs;
  for (int64_t i = 0; i < row; ++i) {
    int64_t lo = upper ? std::max<int64_t>(0, i + off) : 0;
    int64_t hi = upper ? col : std::min<int64_t>(col, i + off + 1);
    if (hi <= lo) continue;
    rs.push_back(b.constantInt(i, DType::I64, {hi - lo}));
    cs.push_back(add(b, b.iota({DType::I64, {hi - lo}}, 0), b.constantInt(lo, DType::I64, {hi - lo})));
  }
  if (rs.empty()) return {b.constantInt(0, out, {2, 0})};
  Value r = rs.size() == 1 ? rs[0] : b.concatenate(rs, 0), cc = cs.size() == 1 ? cs[0] : b.concatenate(cs, 0);
  int64_t n = r.shape()[0];
  return {b.convert(b.concatenate({b.reshape(r, {1, n}), b.reshape(cc, {1, n})}, 0), out)};
}
Registrar reg_tril_indices("tril_indices", [](Ctx& c) { return triIndices(c, false); });
Registrar reg_triu_indices("triu_indices", [](Ctx& c) { return triIndices(c, true); });

// put(self, index, source, accumulate): scatter into the flattened tensor.
Registrar reg_put("put", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0), idx = c.tensor(1), src = c.tensor(2);
  bool acc = c.flagOr(3, false);
  int64_t n = x.type.numel(), k = idx.type.numel();
  if (k == 0) return std::vector<Value>{x};
  if (n == 0 || src.type.numel() != k) throw ir::Unsupported("put arguments");
  Value flat = b.reshape(x, {n});
  Value ii = b.reshape(b.convert(idx, DType::I64), {k});
  c.requireInRange(indicesInRange(b, ii, n, true));
  Value neg = b.compare(ii, b.constantInt(0, DType::I64, {k}), ir::Cmp::LT);
  ii = b.select(neg, add(b, ii, b.constantInt(n, DType::I64, {k})), ii);
  ir::Builder::ScatterDims dn;
  dn.inserted_window_dims = {0};
  dn.scatter_dims_to_operand_dims = {0};
  dn.index_vector_dim = 1;
  Value upd = b.reshape(b.convert(src, x.dtype()), {k});
  bool is_bool = x.dtype() == DType::Bool;
  Value r =
      b.scatter(flat, b.reshape(ii, {k, 1}), upd, dn, [acc, is_bool](ir::Builder& bb, const std::vector<Value>& a) {
        if (!acc) return std::vector<Value>{a[1]};
        return std::vector<Value>{is_bool ? bb.binary("or", a[0], a[1]) : add(bb, a[0], a[1])};
      });
  return std::vector<Value>{b.reshape(r, x.shape())};
});

// masked_scatter(self, mask, source): the i-th true position takes source[i];
// too short a source is an IndexError (take's range check) at the next host read.
Registrar reg_masked_scatter("masked_scatter", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0), mask = c.tensor(1), src = c.tensor(2);
  auto vs = broadcastAll(b, {x, mask});
  Value xx = vs[0], mm = b.convert(vs[1], DType::Bool);
  int64_t n = xx.type.numel();
  if (n == 0) return std::vector<Value>{xx};
  Value mf = b.reshape(mm, {n});
  if (src.type.numel() == 0) {  // valid while nothing is selected (multimodal models
    // splice in zero image features for text-only batches); else IndexError
    Value none = reduceMax(b, b.convert(mf, DType::I32), {0});
    c.requireInRange(b.compare(none, b.constantInt(0, DType::I32), ir::Cmp::EQ));
    return std::vector<Value>{xx};
  }
  Value m64 = b.convert(mf, DType::I64);
  Value incl = delegate(c, "cumsum", {tensorArg(m64), intArg(0)}, {Type{DType::I64, {n}}})[0];
  Value pos = sub(b, incl, m64);
  pos = b.select(mf, pos, b.constantInt(0, DType::I64, {n}));
  Value picked =
      delegate(c, "take", {tensorArg(b.convert(src, xx.dtype())), tensorArg(pos)}, {Type{xx.dtype(), {n}}})[0];
  Value r = b.select(mf, picked, b.reshape(xx, {n}));
  return std::vector<Value>{b.reshape(r, xx.shape())};
});

Arg strArg(std::string s) {
  Arg a;
  a.kind = Arg::Kind::String;
  a.s = std::move(s);
  return a;
}

// index_reduce(self, dim, index, source, reduce, include_self): scatter_reduce
// with the 1-d index broadcast over source.
Registrar reg_index_reduce("index_reduce", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0), idx = c.tensor(2), src = c.tensor(3);
  if (x.rank() == 0) {  // as 1-element vectors
    Value r = delegate(c, "index_reduce",
                       {tensorArg(b.reshape(x, {1})), intArg(0), tensorArg(b.reshape(idx, {idx.type.numel()})),
                        tensorArg(b.reshape(src, {src.type.numel()})), strArg(c.str(4)), boolArg(c.flagOr(5, true))},
                       {Type{x.dtype(), {1}}})[0];
    return std::vector<Value>{b.reshape(r, {})};
  }
  if (src.rank() != x.rank() || idx.rank() > 1) throw ir::Unsupported("index_reduce arguments");
  int64_t dim = wrapDim(c.i64(1), x.rank());
  Value ii = b.broadcastInDim(b.reshape(b.convert(idx, DType::I64), {idx.type.numel()}), src.shape(), {dim});
  return delegate(
      c, "scatter_reduce",
      {tensorArg(x), intArg(dim), tensorArg(ii), tensorArg(src), strArg(c.str(4)), boolArg(c.flagOr(5, true))},
      {x.type});
});

// unfold_backward(grad_in, input_sizes, dim, size, step): sums each window
// element back to its source position (a one-hot contraction).
Registrar reg_unfold_backward("unfold_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0);
  Shape in = c.ints(1);
  int64_t rank = static_cast<int64_t>(in.size());
  int64_t size = c.i64(3), step = c.i64(4);
  if (rank == 0) return std::vector<Value>{b.reshape(g, {})};
  int64_t dim = wrapDim(c.i64(2), rank);
  int64_t len = in[dim], nw = g.shape()[dim];
  DType acc = accOf(g.dtype());
  if (!ir::isFloat(acc)) throw ir::Unsupported("unfold_backward of an integer tensor");
  Shape ms{nw, size, len};
  Value pos =
      add(b, mul(b, b.iota({DType::I64, ms}, 0), b.constantInt(step, DType::I64, ms)), b.iota({DType::I64, ms}, 1));
  Value m = b.convert(b.compare(pos, b.iota({DType::I64, ms}, 2), ir::Cmp::EQ), acc);
  Value r = b.dotGeneral(b.convert(g, acc), m, {}, {}, {dim, rank}, {0, 1}, acc);
  // r: the other dims in order, then len; move len back to `dim`.
  std::vector<int64_t> perm;
  for (int64_t i = 0; i < rank - 1; ++i) {
    if (i == dim) perm.push_back(rank - 1);
    perm.push_back(i);
  }
  if (dim == rank - 1) perm.push_back(rank - 1);
  return std::vector<Value>{b.convert(b.transpose(r, perm), g.dtype())};
});

// Sums v down to `shape` (the reverse of broadcasting).
Value sumTo(ir::Builder& b, const Value& v, const Shape& shape) {
  int64_t lead = v.rank() - static_cast<int64_t>(shape.size());
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < v.rank(); ++i)
    if (i < lead || (shape[i - lead] == 1 && v.shape()[i] != 1)) dims.push_back(i);
  Value r = dims.empty() ? v : reduceSum(b, v, dims);
  return b.reshape(r, shape);
}

Registrar reg_prelu_kernel("_prelu_kernel", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0), w = c.tensor(1);
  DType acc = accOf(floatOf(x.dtype()));
  auto vs = broadcastAll(b, {b.convert(x, acc), b.convert(w, acc)});
  Value pos = b.compare(vs[0], b.constant(0.0, acc, vs[0].shape()), ir::Cmp::GT);
  Value r = b.select(pos, vs[0], mul(b, vs[1], vs[0]));
  return std::vector<Value>{b.convert(r, outType(c, x.dtype()))};
});
Registrar reg_prelu_kernel_backward("_prelu_kernel_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0), x = c.tensor(1), w = c.tensor(2);
  DType acc = accOf(floatOf(x.dtype()));
  auto vs = broadcastAll(b, {b.convert(g, acc), b.convert(x, acc), b.convert(w, acc)});
  const Shape& sh = vs[0].shape();
  Value zero = b.constant(0.0, acc, sh);
  Value pos = b.compare(vs[1], zero, ir::Cmp::GT);
  Value gx = b.select(pos, vs[0], mul(b, vs[2], vs[0]));
  Value gw = b.select(pos, zero, mul(b, vs[1], vs[0]));
  return std::vector<Value>{b.convert(sumTo(b, gx, x.shape()), x.dtype()),
                            b.convert(c.hasExpected() ? sumTo(b, gw, c.expectedAt(1).shape) : gw, w.dtype())};
});

// binary_cross_entropy(self, target, weight?, reduction); logs clamp at -100.
Registrar reg_binary_cross_entropy("binary_cross_entropy", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0), t = c.tensor(1);
  auto w = c.optTensor(2);
  int64_t reduction = c.i64Or(3, 1);
  DType acc = accOf(floatOf(x.dtype()));
  Value xx = b.convert(x, acc), tt = b.broadcastTo(b.convert(t, acc), x.shape());
  const Shape& sh = x.shape();
  Value lo = b.constant(-100.0, acc, sh), one = b.constant(1.0, acc, sh);
  Value lx = b.binary("maximum", b.unary("log", xx), lo);
  Value l1x = b.binary("maximum", b.unary("log", sub(b, one, xx)), lo);
  Value l = b.unary("negate", add(b, mul(b, tt, lx), mul(b, sub(b, one, tt), l1x)));
  if (w) l = mul(b, l, b.broadcastTo(b.convert(*w, acc), sh));
  return std::vector<Value>{b.convert(reduceLoss(b, l, reduction), x.dtype())};
});
Registrar reg_binary_cross_entropy_backward("binary_cross_entropy_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0), x = c.tensor(1), t = c.tensor(2);
  auto w = c.optTensor(3);
  int64_t reduction = c.i64Or(4, 1);
  DType acc = accOf(floatOf(x.dtype()));
  const Shape& sh = x.shape();
  Value xx = b.convert(x, acc), tt = b.broadcastTo(b.convert(t, acc), sh);
  Value one = b.constant(1.0, acc, sh);
  Value den = b.binary("maximum", mul(b, sub(b, one, xx), xx), b.constant(1e-12, acc, sh));
  Value r = mul(b, lossGrad(b, g, sh, reduction, acc), div(b, sub(b, xx, tt), den));
  if (w) r = mul(b, r, b.broadcastTo(b.convert(*w, acc), sh));
  return std::vector<Value>{b.convert(r, x.dtype())};
});

// _logcumsumexp(self, dim): an inclusive scan with a stable log-add-exp.
Registrar reg_logcumsumexp("_logcumsumexp", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  if (!ir::isFloat(x.dtype())) throw ir::Unsupported("logcumsumexp of a non-float tensor");
  // A scalar is its own scan; an empty tensor has none (a zero-size window does not compile).
  if (x.rank() == 0 || x.type.numel() == 0) return std::vector<Value>{x};
  DType acc = accOf(x.dtype());
  Value xx = b.convert(x, acc);
  int64_t dim = wrapDim(c.i64(1), x.rank());
  int64_t n = x.shape()[dim];
  Shape window(x.rank(), 1), strides(x.rank(), 1), dil(x.rank(), 1);
  std::vector<std::pair<int64_t, int64_t>> pad(x.rank(), {0, 0});
  window[dim] = n;
  pad[dim] = {n - 1, 0};
  auto r = b.reduceWindow({xx}, {b.constant(-INFINITY, acc)}, window, strides, dil, dil, pad,
                          [acc](ir::Builder& bb, const std::vector<Value>& a) {
                            Value mx = bb.binary("maximum", a[0], a[1]), mn = bb.binary("minimum", a[0], a[1]);
                            Value f = add(bb, mx, bb.unary("log_plus_one", bb.unary("exponential", sub(bb, mn, mx))));
                            Value keep = bb.binary("or", bb.compare(mn, bb.constant(-INFINITY, acc), ir::Cmp::EQ),
                                                   bb.compare(mx, bb.constant(INFINITY, acc), ir::Cmp::EQ));
                            // A NaN stays NaN past an infinity (maximum of inf and NaN is inf here).
                            Value nan = bb.binary("or", bb.compare(a[0], a[0], ir::Cmp::NE),
                                                  bb.compare(a[1], a[1], ir::Cmp::NE));
                            return std::vector<Value>{bb.select(nan, add(bb, a[0], a[1]), bb.select(keep, mx, f))};
                          });
  return std::vector<Value>{b.convert(r[0], x.dtype())};
});

// isin(elements, test_elements, assume_unique, invert): a broadcast compare
// against every test element.
Registrar reg_isin("isin", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value e = c.tensor(0), t = c.tensor(1);
  if (ir::isComplex(e.dtype()) || ir::isComplex(t.dtype())) throw ir::Unsupported("complex isin");
  if (t.type.numel() > 4096) throw ir::Unsupported("isin with many test elements");
  DType ct = ir::promote(e.dtype(), t.dtype());
  int64_t m = t.type.numel();
  Shape cs = e.shape();
  cs.push_back(m);
  std::vector<int64_t> edims;
  for (int i = 0; i < e.rank(); ++i) edims.push_back(i);
  Value eb = b.broadcastInDim(b.convert(e, ct), cs, edims);
  Value tb = b.broadcastInDim(b.reshape(b.convert(t, ct), {m}), cs, {static_cast<int64_t>(e.rank())});
  Value hit = b.convert(b.compare(eb, tb, ir::Cmp::EQ), DType::I32);
  Value any = m == 0 ? b.constantInt(0, DType::I32, e.shape()) : reduceMax(b, hit, {static_cast<int64_t>(e.rank())});
  Value r = b.compare(any, b.constantInt(0, DType::I32, e.shape()), c.flagOr(3, false) ? ir::Cmp::EQ : ir::Cmp::NE);
  return std::vector<Value>{r};
});

// histc(self, bins, min, max): equal-width bins; min == max takes the data's
// range (widened by 1 each side when that is empty too). Integer inputs count
// in float64 (exact for their values) as CUDA's kernel accepts them; MoE
// routers call histc on expert indices.
Registrar reg_histc("histc", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  int64_t bins = c.i64Or(1, 100);
  if (ir::isComplex(x.dtype()) || x.dtype() == DType::Bool || bins <= 0) throw ir::Unsupported("histc arguments");
  int64_t n = x.type.numel();
  if (n * bins > (int64_t{1} << 24)) throw ir::Unsupported("histc too large");
  DType acc = ir::isFloat(x.dtype()) ? accOf(x.dtype()) : DType::F64;
  Value lo = c.scalarOr(2, acc, 0.0), hi = c.scalarOr(3, acc, 0.0);
  if (n == 0) return std::vector<Value>{b.constant(0.0, x.dtype(), {bins})};
  Value xf = b.reshape(b.convert(x, acc), {n});
  Value same = b.compare(lo, hi, ir::Cmp::EQ);
  lo = b.select(same, reduceMin(b, xf, {0}), lo);
  hi = b.select(same, reduceMax(b, xf, {0}), hi);
  Value same2 = b.compare(lo, hi, ir::Cmp::EQ);
  Value one = b.constant(1.0, acc);
  lo = b.select(same2, sub(b, lo, one), lo);
  hi = b.select(same2, add(b, hi, one), hi);
  Value lob = b.broadcastTo(lo, {n}), hib = b.broadcastTo(hi, {n});
  Value in = b.binary("and", b.compare(xf, lob, ir::Cmp::GE), b.compare(xf, hib, ir::Cmp::LE));
  Value pos = div(b, mul(b, sub(b, xf, lob), b.constant(static_cast<double>(bins), acc, {n})), sub(b, hib, lob));
  Value idx = b.convert(pos, DType::I64);
  idx = b.binary("minimum", idx, b.constantInt(bins - 1, DType::I64, {n}));
  idx = b.select(in, idx, b.constantInt(-1, DType::I64, {n}));
  Shape cs{n, bins};
  Value hit = b.compare(b.broadcastInDim(idx, cs, {0}), b.iota({DType::I64, cs}, 1), ir::Cmp::EQ);
  Value counts = reduceSum(b, b.convert(hit, acc), {0});
  return std::vector<Value>{b.convert(counts, x.dtype())};
});

// mode(self, dim, keepdim) -> (values, indices): the most frequent value
// (ties: the smallest), and the last index where it occurs, as on the CPU.
Registrar reg_mode("mode", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  if (ir::isComplex(x.dtype())) throw ir::Unsupported("complex mode");
  if (x.rank() == 0) return std::vector<Value>{x, b.constantInt(0, DType::I64)};
  int64_t dim = wrapDim(c.i64Or(1, -1), x.rank());
  bool keep = c.flagOr(2, false);
  int r = x.rank();
  int64_t n = x.shape()[dim];
  if (x.type.numel() == 0) throw ir::Unsupported("mode of an empty tensor");
  // Move dim last: v [..., n].
  std::vector<int64_t> perm;
  for (int i = 0; i < r; ++i)
    if (i != dim) perm.push_back(i);
  perm.push_back(dim);
  Value v = b.transpose(x, perm);
  Shape s = v.shape();
  Shape s2 = s;
  s2.push_back(n);  // [..., n (i), n (j)]
  std::vector<int64_t> lead_i, lead_j;
  for (int i = 0; i < r; ++i) {
    lead_i.push_back(i);
    lead_j.push_back(i < r - 1 ? i : r);
  }
  Value vi = b.broadcastInDim(v, s2, lead_i), vj = b.broadcastInDim(v, s2, lead_j);
  Value eq = b.compare(vi, vj, ir::Cmp::EQ);
  Value counts = reduceSum(b, b.convert(eq, DType::I64), {r});  // [..., n]
  // Order by (count desc, value asc); the first is the mode.
  bool is_bool = x.dtype() == DType::Bool;
  Value key = is_bool ? b.convert(v, DType::U8) : v;
  auto sorted = b.sort({counts, key}, r - 1, true, [](ir::Builder& bb, const std::vector<Value>& a) {
    Value more = bb.compare(a[0], a[1], ir::Cmp::GT), same = bb.compare(a[0], a[1], ir::Cmp::EQ);
    return std::vector<Value>{bb.binary("or", more, bb.binary("and", same, bb.compare(a[2], a[3], ir::Cmp::LT)))};
  });
  Shape start(r, 0), lim = s, one(r, 1);
  lim[r - 1] = 1;
  Value best = b.slice(sorted[1], start, lim, one);  // [..., 1]
  if (is_bool) best = b.convert(best, DType::Bool);
  Value hit = b.compare(v,
                        b.broadcastInDim(b.reshape(best, Shape(s.begin(), s.end() - 1)), s,
                                         [&] {
                                           std::vector<int64_t> d;
                                           for (int i = 0; i < r - 1; ++i) d.push_back(i);
                                           return d;
                                         }()),
                        ir::Cmp::EQ);
  Value pos = b.select(hit, b.iota(Type{DType::I64, s}, r - 1), b.constantInt(-1, DType::I64, s));
  Value idx = reduceMax(b, pos, {static_cast<int64_t>(r - 1)});
  Value val = b.reshape(best, idx.shape());
  if (keep) {
    val = keepDims(b, val, x.shape(), {dim});
    idx = keepDims(b, idx, x.shape(), {dim});
  }
  return std::vector<Value>{val, idx};
});

}  // namespace
}  // namespace tpu::ops
