// Reductions: sum, mean, prod, max/min (with and without indices), any/all,
// var/std, norms, logsumexp, cumulative ops, sort and top-k.
#include <cmath>

#include "ops/common.h"

namespace tpu::ops {
namespace {

// Integer sums accumulate in int64 (PyTorch promotes them).
DType sumType(DType in, std::optional<DType> dtype) {
  if (dtype) return *dtype;
  if (in == DType::Bool || ir::isInt(in)) return DType::I64;
  return in;
}

Value finish(ir::Builder& b, const Value& r, const Shape& in, const std::vector<int64_t>& dims, bool keep) {
  return keep ? keepDims(b, r, in, dims) : r;
}

// sum(self, dim?, keepdim, dtype) and sum(self, dtype)
std::vector<Value> sumLike(Ctx& c, bool mean) {
  Value x = c.tensor(0);
  // The dim overloads have (self, dim, keepdim, dtype); dim=None still keeps dims.
  bool has_dims = c.size() >= 3;
  std::optional<std::vector<int64_t>> d = has_dims && c.has(1) ? c.optInts(1) : std::nullopt;
  bool keep = has_dims ? c.flagOr(2, false) : false;
  std::optional<DType> dt = has_dims ? c.optDType(3) : c.optDType(1);
  auto dims = reductionDims(d, x.rank());
  DType out = outType(c, sumType(x.dtype(), dt));
  DType acc = accOf(out);
  if (mean && !ir::isFloat(acc) && !ir::isComplex(acc)) throw ir::Unsupported("mean of an integer tensor");
  Value r = reduceSum(c.b, c.b.convert(x, acc), dims);
  if (mean) {
    int64_t n = 1;
    for (auto dd : dims) n *= x.shape()[dd];
    r = div(c.b, r, c.b.constant(static_cast<double>(n), acc, r.shape()));
  }
  return {c.b.convert(finish(c.b, r, x.shape(), dims, keep), out)};
}
Registrar reg_sum("sum", [](Ctx& c) { return sumLike(c, false); });
Registrar reg_mean("mean", [](Ctx& c) { return sumLike(c, true); });
Registrar reg_nansum("nansum", [](Ctx& c) {
  Value x = c.tensor(0);
  if (ir::isFloat(x.dtype())) {
    Value z = c.b.constant(0.0, x.dtype(), x.shape());
    x = c.b.select(c.b.compare(x, x, ir::Cmp::NE), z, x);
  }
  auto dims = reductionDims(c.optInts(1), x.rank());
  DType out = outType(c, sumType(x.dtype(), c.optDType(3)));
  Value r = reduceSum(c.b, c.b.convert(x, accOf(out)), dims);
  return std::vector<Value>{c.b.convert(finish(c.b, r, x.shape(), dims, c.flagOr(2, false)), out)};
});

Registrar reg_prod("prod", [](Ctx& c) {
  Value x = c.tensor(0);
  bool has_dim = c.kind(1) == Arg::Kind::Int;
  std::vector<int64_t> dims = has_dim ? std::vector<int64_t>{wrapDim(c.i64(1), x.rank())} : reductionDims({}, x.rank());
  if (x.rank() == 0) dims.clear();
  bool keep = has_dim ? c.flagOr(2, false) : false;
  DType out = outType(c, sumType(x.dtype(), has_dim ? c.optDType(3) : c.optDType(1)));
  DType acc = accOf(out);
  Value xx = c.b.convert(x, acc);
  Value r = dims.empty()
                ? xx
                : c.b.reduce({xx}, {c.b.constant(1.0, acc)}, dims, [](ir::Builder& bb, const std::vector<Value>& a) {
                    return std::vector<Value>{mul(bb, a[0], a[1])};
                  })[0];
  return std::vector<Value>{c.b.convert(finish(c.b, r, x.shape(), dims, keep), out)};
});

// NaN-propagating max/min reduce for floats, in one pass: a NaN operand wins
// (the plugin's maximum/minimum need not propagate it).
Value extreme(ir::Builder& b, const Value& x, const std::vector<int64_t>& dims, bool is_max) {
  if (!ir::isFloat(x.dtype()) || dims.empty()) return is_max ? reduceMax(b, x, dims) : reduceMin(b, x, dims);
  return b.reduce({x}, {extremeConst(b, x.dtype(), is_max)}, dims,
                  [is_max](ir::Builder& bb, const std::vector<Value>& a) {
                    Value m = bb.binary(is_max ? "maximum" : "minimum", a[0], a[1]);
                    m = bb.select(bb.compare(a[1], a[1], ir::Cmp::NE), a[1], m);
                    return std::vector<Value>{bb.select(bb.compare(a[0], a[0], ir::Cmp::NE), a[0], m)};
                  })[0];
}

std::vector<Value> amaxmin(Ctx& c, bool is_max) {
  Value x = c.tensor(0);
  auto dims = reductionDims(c.optInts(1), x.rank());
  return {finish(c.b, extreme(c.b, x, dims, is_max), x.shape(), dims, c.flagOr(2, false))};
}
Registrar reg_amax("amax", [](Ctx& c) { return amaxmin(c, true); });
Registrar reg_amin("amin", [](Ctx& c) { return amaxmin(c, false); });

// The reduce body that keeps (value, index) of the max/min: the first
// occurrence (lowest index) among equals; for floats NaN counts as the max.
ir::Builder::BodyFn argExtremeBody(bool is_max, bool is_float) {
  return [is_max, is_float](ir::Builder& bb, const std::vector<Value>& a) {
    // a = {acc_v, acc_i, cur_v, cur_i}
    Value av = a[0], ai = a[1], cv = a[2], ci = a[3];
    Value better = bb.compare(cv, av, is_max ? ir::Cmp::GT : ir::Cmp::LT);
    Value eq = bb.compare(cv, av, ir::Cmp::EQ);
    Value lower_idx = bb.compare(ci, ai, ir::Cmp::LT);
    Value pick = bb.binary("or", better, bb.binary("and", eq, lower_idx));
    if (is_float) {
      Value cnan = bb.compare(cv, cv, ir::Cmp::NE);
      Value anan = bb.compare(av, av, ir::Cmp::NE);
      // NaN wins; among NaNs the lower index.
      pick = bb.select(anan, bb.binary("and", cnan, lower_idx), bb.binary("or", pick, cnan));
    }
    return std::vector<Value>{bb.select(pick, cv, av), bb.select(pick, ci, ai)};
  };
}

// Index of the max/min along one dim; first occurrence, NaN counts as max.
Value argExtreme(ir::Builder& b, const Value& x, int64_t dim, bool is_max) {
  Value idx = b.iota({DType::I64, x.shape()}, static_cast<int>(dim));
  auto r = b.reduce({x, idx}, {extremeConst(b, x.dtype(), is_max), b.constantInt(0, DType::I64)}, {dim},
                    argExtremeBody(is_max, ir::isFloat(x.dtype())));
  return r[1];
}

std::vector<Value> maxminDim(Ctx& c, bool is_max) {
  Value x = c.tensor(0);
  if (c.kind(1) != Arg::Kind::Int) {  // max(self): full reduction
    if (x.type.numel() == 0)
      throw std::invalid_argument(
          "max(): Expected reduction dim to be specified for input.numel() == 0. Specify the reduction dim with the "
          "'dim' argument.");
    return {extreme(c.b, x, reductionDims({}, x.rank()), is_max)};
  }
  int64_t dim = wrapDim(c.i64(1), x.rank());
  bool keep = c.flagOr(2, false);
  if (x.rank() == 0) return {x, c.b.constantInt(0, DType::I64)};
  Value v = extreme(c.b, x, {dim}, is_max);
  Value i = argExtreme(c.b, x, dim, is_max);
  return {finish(c.b, v, x.shape(), {dim}, keep), finish(c.b, i, x.shape(), {dim}, keep)};
}
Registrar reg_max("max", [](Ctx& c) { return maxminDim(c, true); });
Registrar reg_min("min", [](Ctx& c) { return maxminDim(c, false); });

std::vector<Value> argmaxmin(Ctx& c, bool is_max) {
  Value x = c.tensor(0);
  bool keep = c.flagOr(2, false);
  if (!c.has(1)) {
    Value flat = c.b.reshape(x, {x.type.numel()});
    Value i = argExtreme(c.b, flat, 0, is_max);
    if (keep) {
      Shape s(x.rank(), 1);
      return {c.b.reshape(i, s)};
    }
    return {i};
  }
  if (x.rank() == 0) return {c.b.constantInt(0, DType::I64)};
  int64_t dim = wrapDim(c.i64(1), x.rank());
  return {finish(c.b, argExtreme(c.b, x, dim, is_max), x.shape(), {dim}, keep)};
}
Registrar reg_argmax("argmax", [](Ctx& c) { return argmaxmin(c, true); });
Registrar reg_argmin("argmin", [](Ctx& c) { return argmaxmin(c, false); });

std::vector<Value> anyAll(Ctx& c, bool is_any) {
  Value x = c.b.convert(c.tensor(0), DType::Bool);
  std::vector<int64_t> dims;
  bool keep = false;
  if (c.kind(1) == Arg::Kind::IntList && c.ints(1).empty()) {
    keep = c.flagOr(2, false);  // all.dims(x, []): each element alone, unlike sum(x, [])
  } else if (c.kind(1) == Arg::Kind::Int || c.kind(1) == Arg::Kind::IntList) {
    dims = reductionDims(c.optInts(1), x.rank());
    keep = c.flagOr(2, false);
  } else if (c.size() > 1 && c.kind(1) == Arg::Kind::None) {
    dims = reductionDims({}, x.rank());
    keep = c.flagOr(2, false);
  } else {
    dims = reductionDims({}, x.rank());
  }
  Value r = is_any ? reduceMax(c.b, x, dims) : reduceMin(c.b, x, dims);
  DType out = outType(c, DType::Bool);
  return {c.b.convert(finish(c.b, r, x.shape(), dims, keep), out)};
}
Registrar reg_any("any", [](Ctx& c) { return anyAll(c, true); });
Registrar reg_all("all", [](Ctx& c) { return anyAll(c, false); });

// var/std/var_mean/std_mean .correction(self, dim?, *, correction?, keepdim)
std::vector<Value> varStd(Ctx& c, bool take_sqrt, bool with_mean) {
  Value x = c.tensor(0);
  auto dims = reductionDims(c.optInts(1), x.rank());
  double corr = c.has(2) ? c.constScalar(2) : 1.0;
  bool keep = c.flagOr(3, false);
  DType out = outType(c, x.dtype());
  // Complex: the mean is complex, the variance the mean of |x - mean|^2.
  bool cplx = ir::isComplex(x.dtype());
  DType acc = cplx ? x.dtype() : accOf(out);
  Value xx = c.b.convert(x, acc);
  int64_t n = 1;
  for (auto d : dims) n *= x.shape()[d];
  Value sum = reduceSum(c.b, xx, dims);
  Value mean = div(c.b, sum, full(c.b, static_cast<double>(n), sum));
  Value meank = keepDims(c.b, mean, x.shape(), dims);
  Value d = sub(c.b, xx, c.b.broadcastTo(meank, x.shape()));
  Value sq = cplx ? add(c.b, mul(c.b, c.b.real(d), c.b.real(d)), mul(c.b, c.b.imag(d), c.b.imag(d))) : mul(c.b, d, d);
  Value ss = reduceSum(c.b, sq, dims);
  Value denom = c.b.constant(std::max(0.0, static_cast<double>(n) - corr), ss.dtype(), ss.shape());
  Value var = div(c.b, ss, denom);
  if (take_sqrt) var = c.b.unary("sqrt", var);
  std::vector<Value> r{c.b.convert(finish(c.b, var, x.shape(), dims, keep), out)};
  DType mean_out = c.hasExpected() && c.expected().size() > 1 ? c.expectedAt(1).dtype : out;
  if (with_mean) r.push_back(c.b.convert(keep ? meank : mean, mean_out));
  return r;
}
Registrar reg_var("var", [](Ctx& c) { return varStd(c, false, false); }, {2});
Registrar reg_std("std", [](Ctx& c) { return varStd(c, true, false); }, {2});
Registrar reg_var_mean("var_mean", [](Ctx& c) { return varStd(c, false, true); }, {2});
Registrar reg_std_mean("std_mean", [](Ctx& c) { return varStd(c, true, true); }, {2});

// The norm of complex values is the norm of their moduli.
Value realMagnitude(ir::Builder& b, const Value& x) { return ir::isComplex(x.dtype()) ? b.unary("abs", x) : x; }

// linalg_vector_norm(self, ord, dim?, keepdim, *, dtype?)
Value vectorNorm(ir::Builder& b, const Value& x, double ord, const std::vector<int64_t>& dims) {
  Value a = b.unary("abs", x);
  if (std::isinf(ord)) return ord > 0 ? extreme(b, a, dims, true) : extreme(b, a, dims, false);
  if (ord == 0) {
    Value nz = b.convert(b.compare(x, full(b, 0, x), ir::Cmp::NE), x.dtype());
    return reduceSum(b, nz, dims);
  }
  if (ord == 1) return reduceSum(b, a, dims);
  if (ord == 2) return b.unary("sqrt", reduceSum(b, mul(b, a, a), dims));
  Value p = b.binary("power", a, full(b, ord, a));
  Value s = reduceSum(b, p, dims);
  return b.binary("power", s, b.constant(1.0 / ord, s.dtype(), s.shape()));
}
Registrar reg_linalg_vector_norm("linalg_vector_norm",
                                 [](Ctx& c) {
                                   Value x = c.tensor(0);
                                   double ord = c.has(1) ? c.constScalar(1) : 2.0;
                                   auto dims = reductionDims(c.optInts(2), x.rank());
                                   bool keep = c.flagOr(3, false);
                                   DType out = outType(c, c.optDType(4).value_or(floatOf(x.dtype())));
                                   Value r = vectorNorm(c.b, c.b.convert(realMagnitude(c.b, x), accOf(out)), ord, dims);
                                   return std::vector<Value>{c.b.convert(finish(c.b, r, x.shape(), dims, keep), out)};
                                 },
                                 {1});
// _foreach_norm(self list, ord, dtype) -> per-element linalg_vector_norm
Registrar reg_norm_for_foreach("norm",
                               [](Ctx& c) {
                                 Value x = c.tensor(0);
                                 double ord = c.has(1) ? c.constScalar(1) : 2.0;
                                 DType out = outType(c, floatOf(x.dtype()));
                                 if (c.kind(2) == Arg::Kind::DType) out = c.optDType(2).value_or(out);
                                 std::vector<int64_t> dims;
                                 bool keep = false;
                                 if (c.kind(2) == Arg::Kind::IntList || c.kind(2) == Arg::Kind::Int) {
                                   dims = reductionDims(c.optInts(2), x.rank());
                                   keep = c.flagOr(3, false);
                                 } else {
                                   dims = reductionDims({}, x.rank());
                                 }
                                 Value r = vectorNorm(c.b, c.b.convert(realMagnitude(c.b, x), accOf(out)), ord, dims);
                                 return std::vector<Value>{c.b.convert(finish(c.b, r, x.shape(), dims, keep), out)};
                               },
                               {1});

Registrar reg_logsumexp("logsumexp", [](Ctx& c) {
  Value x = c.tensor(0);
  if (ir::isComplex(x.dtype())) throw ir::Unsupported("complex logsumexp");
  auto dims = reductionDims(c.optInts(1), x.rank());
  bool keep = c.flagOr(2, false);
  DType out = outType(c, floatOf(x.dtype()));
  Value xx = c.b.convert(x, accOf(out));
  Value m = reduceMax(c.b, xx, dims);
  Value mk = keepDims(c.b, m, x.shape(), dims);
  // An all -inf row keeps -inf (the max would make it nan).
  Value safe = c.b.select(c.b.unary("is_finite", mk), mk, c.b.constant(0.0, mk.dtype(), mk.shape()));
  Value e = c.b.unary("exponential", sub(c.b, xx, c.b.broadcastTo(safe, x.shape())));
  Value r = add(c.b, c.b.unary("log", reduceSum(c.b, e, dims)), c.b.reshape(safe, m.shape()));
  return std::vector<Value>{c.b.convert(finish(c.b, r, x.shape(), dims, keep), out)};
});

}  // namespace

// Inclusive scan along `dim` via reduce_window over a padded window.
Value scan(ir::Builder& b, const Value& x, int64_t dim, const char* op, double init) {
  int64_t n = x.shape()[dim];
  Shape window(x.rank(), 1), strides(x.rank(), 1), dil(x.rank(), 1);
  std::vector<std::pair<int64_t, int64_t>> pad(x.rank(), {0, 0});
  window[dim] = n;
  pad[dim] = {n - 1, 0};
  std::string opname = op;
  return b.reduceWindow({x}, {b.constant(init, x.dtype())}, window, strides, dil, dil, pad,
                        [opname](ir::Builder& bb, const std::vector<Value>& a) {
                          return std::vector<Value>{bb.binary(opname.c_str(), a[0], a[1])};
                        })[0];
}

namespace {
std::vector<Value> cumop(Ctx& c, const char* op, double init) {
  Value x = c.tensor(0);
  DType out = outType(c, sumType(x.dtype(), c.optDType(2)));
  Value xx = c.b.convert(x, accOf(out));
  if (x.rank() == 0) return {c.b.convert(xx, out)};
  int64_t dim = wrapDim(c.i64(1), x.rank());
  return {c.b.convert(scan(c.b, xx, dim, op, init), out)};
}
Registrar reg_cumsum("cumsum", [](Ctx& c) { return cumop(c, "add", 0.0); });
Registrar reg_cumprod("cumprod", [](Ctx& c) { return cumop(c, "multiply", 1.0); });

}  // namespace

// sort(self, dim, descending) / sort.stable(self, *, stable, dim, descending)
std::vector<Value> sortImpl(ir::Builder& b, const Value& x, int64_t dim, bool descending) {
  Value idx = b.iota({DType::I64, x.shape()}, static_cast<int>(dim));
  bool is_float = ir::isFloat(x.dtype());
  auto r = b.sort({x, idx}, dim, true, [descending, is_float](ir::Builder& bb, const std::vector<Value>& a) {
    Value l = a[0], r = a[1];
    Value c = bb.compare(l, r, descending ? ir::Cmp::GT : ir::Cmp::LT);
    if (is_float) {  // NaN sorts as the largest value, like PyTorch.
      Value ln = bb.compare(l, l, ir::Cmp::NE), rn = bb.compare(r, r, ir::Cmp::NE);
      c = descending ? bb.binary("or", bb.binary("and", ln, bb.unary("not", rn)), c)
                     : bb.binary("and", bb.unary("not", ln), bb.binary("or", rn, c));
    }
    return std::vector<Value>{c};
  });
  return r;
}

namespace {
Registrar reg_sort("sort", [](Ctx& c) {
  Value x = c.tensor(0);
  int64_t dim;
  bool desc;
  if (c.kind(1) == Arg::Kind::Int) {
    dim = c.i64(1);
    desc = c.flagOr(2, false);
  } else {  // sort.stable
    dim = c.i64Or(2, -1);
    desc = c.flagOr(3, false);
  }
  if (x.rank() == 0) return std::vector<Value>{x, c.b.constantInt(0, DType::I64)};
  return sortImpl(c.b, x, wrapDim(dim, x.rank()), desc);
});
Registrar reg_argsort("argsort", [](Ctx& c) {
  Value x = c.tensor(0);
  int64_t dim = c.kind(1) == Arg::Kind::Int ? c.i64(1) : c.i64Or(2, -1);
  bool desc = c.kind(1) == Arg::Kind::Int ? c.flagOr(2, false) : c.flagOr(3, false);
  if (x.rank() == 0) return std::vector<Value>{c.b.constantInt(0, DType::I64)};
  return std::vector<Value>{sortImpl(c.b, x, wrapDim(dim, x.rank()), desc)[1]};
});
// The k largest by k rounds of (max, first index), each round masking out
// what it took: k row reductions instead of sorting whole rows (XLA:CPU's
// sort made topk(8) of a 512x512 tensor 130x slower than the CPU's). Same
// order as the stable descending sort: NaN first, ties by lower index.
constexpr int64_t kTopkBySelection = 16;
std::vector<Value> topkBySelection(ir::Builder& b, const Value& x, int64_t dim, int64_t k) {
  DType t = x.dtype();
  Value iota = b.iota({DType::I64, x.shape()}, static_cast<int>(dim));
  Value idx = iota, xs = x;
  // Taken entries get the worst value and an index above every real one, so
  // they lose even to an untaken entry of the worst value.
  Value worst = extremeConst(b, t, true, x.shape());
  Value no_idx = b.constantInt(INT64_MAX, DType::I64, x.shape());
  Shape one = x.shape();
  one[dim] = 1;
  std::vector<Value> vals, inds;
  for (int64_t j = 0; j < k; ++j) {
    auto r = b.reduce({xs, idx}, {extremeConst(b, t, true), b.constantInt(INT64_MAX, DType::I64)}, {dim},
                      argExtremeBody(true, ir::isFloat(t)));
    vals.push_back(b.reshape(r[0], one));
    inds.push_back(b.reshape(r[1], one));
    if (j + 1 == k) break;
    Value taken = b.compare(iota, b.broadcastTo(inds.back(), x.shape()), ir::Cmp::EQ);
    xs = b.select(taken, worst, xs);
    idx = b.select(taken, no_idx, idx);
  }
  return {b.concatenate(vals, dim), b.concatenate(inds, dim)};
}

Registrar reg_topk("topk", [](Ctx& c) {
  Value x = c.tensor(0);
  int64_t kk = c.i64(1);
  if (x.rank() == 0) return std::vector<Value>{x, c.b.constantInt(0, DType::I64)};
  int64_t dim = wrapDim(c.i64Or(2, -1), x.rank());
  bool largest = c.flagOr(3, true);
  if (largest && kk >= 1 && kk <= kTopkBySelection && x.dtype() != DType::Bool) return topkBySelection(c.b, x, dim, kk);
  auto s = sortImpl(c.b, x, dim, largest);
  Shape start(x.rank(), 0), limit = x.shape(), strides(x.rank(), 1);
  limit[dim] = kk;
  return std::vector<Value>{c.b.slice(s[0], start, limit, strides), c.b.slice(s[1], start, limit, strides)};
});

}  // namespace
}  // namespace tpu::ops
