// Random numbers from the device generator: each op takes a fresh THREE_FRY
// state (derived from the generator's seed and offset), so results are
// reproducible under manual_seed and differ between calls.
#include <cmath>
#include <stdexcept>
#include <string>

#include "ops/common.h"

namespace tpu::ops {
namespace {

// Uniform floats in [0, 1) with the given shape, in f32 (or f64).
Value uniform01(Ctx& c, const Shape& shape, bool f64) {
  ir::Builder& b = c.b;
  Value state = c.rngState();
  if (f64) {
    Value bits = b.rngBitGenerator(state, {DType::U64, shape})[1];
    Value m = b.binary("shift_right_logical", bits, b.constantInt(12, DType::U64, shape));
    m = b.binary("or", m, b.bitcast(b.constantInt(0x3FF0000000000000LL, DType::I64, shape), {DType::U64, shape}));
    return sub(b, b.bitcast(m, {DType::F64, shape}), b.constant(1.0, DType::F64, shape));
  }
  Value bits = b.rngBitGenerator(state, {DType::U32, shape})[1];
  Value m = b.binary("shift_right_logical", bits, b.constantInt(9, DType::U32, shape));
  m = b.binary("or", m, b.constantInt(0x3F800000, DType::U32, shape));
  return sub(b, b.bitcast(m, {DType::F32, shape}), b.constant(1.0, DType::F32, shape));
}

Value standardNormal(Ctx& c, const Shape& shape, bool f64) {
  ir::Builder& b = c.b;
  Shape two = shape;
  two.insert(two.begin(), 2);
  Value u = uniform01(c, two, f64);
  DType t = u.dtype();
  Shape st(two.size(), 0), lim = two, str(two.size(), 1);
  lim[0] = 1;
  Value u1 = b.reshape(b.slice(u, st, lim, str), shape);
  st[0] = 1;
  lim[0] = 2;
  Value u2 = b.reshape(b.slice(u, st, lim, str), shape);
  // Box-Muller; 1 - u1 is in (0, 1] so the log is finite.
  Value r = b.unary("sqrt", mul(b, b.constant(-2.0, t, shape), b.unary("log", sub(b, b.constant(1.0, t, shape), u1))));
  Value th = mul(b, b.constant(2 * M_PI, t, shape), u2);
  return mul(b, r, b.unary("cosine", th));
}

bool wide(DType t) { return t == DType::F64; }

// uniform_(self, from, to)
Registrar reg_uniform("uniform", [](Ctx& c) {
  Value x = c.tensor(0);
  if (!ir::isFloat(x.dtype())) throw ir::Unsupported("uniform_ on a non-float tensor");
  double lo = c.f64Or(1, 0.0), hi = c.f64Or(2, 1.0);
  Value u = uniform01(c, x.shape(), wide(x.dtype()));
  DType t = u.dtype();
  Value v = add(c.b, c.b.constant(lo, t, x.shape()), mul(c.b, u, c.b.constant(hi - lo, t, x.shape())));
  return std::vector<Value>{c.b.convert(v, x.dtype())};
});

// normal_(self, mean, std) and normal.{Tensor_float, float_Tensor, Tensor_Tensor}
Registrar reg_normal("normal", [](Ctx& c) {
  ir::Builder& b = c.b;
  if (c.kind(1) == Arg::Kind::Double && c.kind(2) == Arg::Kind::Double) {  // in-place form
    Value x = c.tensor(0);
    if (!ir::isFloat(x.dtype())) throw ir::Unsupported("normal_ on a non-float tensor");
    Value z = standardNormal(c, x.shape(), wide(x.dtype()));
    DType t = z.dtype();
    Value v = add(b, b.constant(c.f64(1), t, x.shape()), mul(b, z, b.constant(c.f64(2), t, x.shape())));
    return std::vector<Value>{b.convert(v, x.dtype())};
  }
  if (!c.hasExpected()) throw ir::Unsupported("normal without a known result");
  const Type& out = c.expectedAt(0);
  Value z = standardNormal(c, out.shape, wide(out.dtype));
  DType t = z.dtype();
  Value mean = c.kind(0) == Arg::Kind::Tensor ? b.broadcastTo(b.convert(c.tensor(0), t), out.shape)
                                              : b.constant(c.f64(0), t, out.shape);
  Value std = c.kind(1) == Arg::Kind::Tensor ? b.broadcastTo(b.convert(c.tensor(1), t), out.shape)
                                             : b.constant(c.f64(1), t, out.shape);
  return std::vector<Value>{b.convert(add(b, mean, mul(b, z, std)), out.dtype)};
});

// bernoulli(self) (p = self), bernoulli_.float(self, p), bernoulli_.Tensor(self, p), bernoulli.p
Registrar reg_bernoulli("bernoulli", [](Ctx& c) {
  Value x = c.tensor(0);
  ir::Builder& b = c.b;
  Value u = uniform01(c, x.shape(), false);
  Value p;
  if (c.kind(1) == Arg::Kind::Double)
    p = b.constant(c.f64(1), DType::F32, x.shape());
  else if (c.kind(1) == Arg::Kind::Tensor)
    p = b.broadcastTo(b.convert(c.tensor(1), DType::F32), x.shape());
  else
    p = b.convert(x, DType::F32);
  return std::vector<Value>{b.convert(b.compare(u, p, ir::Cmp::LT), x.dtype())};
});

// The element type's name as PyTorch's messages spell it.
const char* cTypeName(DType t) {
  switch (t) {
    case DType::Bool:
      return "bool";
    case DType::U8:
      return "unsigned char";
    case DType::I8:
      return "signed char";
    case DType::I16:
      return "short int";
    case DType::I32:
      return "int";
    case DType::I64:
      return "long int";
    case DType::F16:
      return "c10::Half";
    case DType::BF16:
      return "c10::BFloat16";
    case DType::F32:
      return "float";
    case DType::F64:
      return "double";
    default:
      return "this dtype";
  }
}

// random_'s bounds as PyTorch checks them: from < to, and both ends representable in the
// tensor's type. Without this a bool tensor took values of [0, 10) and from >= to wrapped
// the range around to garbage.
void checkRandomBounds(DType t, int64_t from, int64_t to) {
  if (from >= to)
    throw std::invalid_argument("random_ expects 'from' to be less than 'to', but got from=" + std::to_string(from) +
                                " >= to=" + std::to_string(to));
  if (!ir::isFloat(t) && !ir::isInt(t) && t != DType::Bool)
    throw std::invalid_argument("check_random_bounds handles only integral, floating-point and boolean types");
  const double hi = ir::isFloat(t) ? largestFinite(t) : highestValue(t);  // floats: the finite range
  const double lo = ir::isFloat(t) ? -hi : lowestValue(t);
  const auto in = [&](int64_t v) {
    if (t == DType::I64) return true;  // every int64 is an int64
    return static_cast<double>(v) >= lo && static_cast<double>(v) <= hi;
  };
  if (!in(from)) throw std::invalid_argument(std::string("from is out of bounds for ") + cTypeName(t));
  if (!in(to - 1)) throw std::invalid_argument(std::string("to - 1 is out of bounds for ") + cTypeName(t));
}

// random_.from(self, from, to?), random_.to(self, to), random_(self)
Registrar reg_random("random", [](Ctx& c) {
  Value x = c.tensor(0);
  ir::Builder& b = c.b;
  int64_t lo = 0, hi;
  if (c.kind(1) == Arg::Kind::Int && c.kind(2) == Arg::Kind::Int) {
    lo = c.i64(1);
    hi = c.i64(2);
    checkRandomBounds(x.dtype(), lo, hi);
  } else if (c.kind(1) == Arg::Kind::Int && c.size() > 2 && c.kind(2) == Arg::Kind::None) {
    throw ir::Unsupported("random_ without an upper bound");
  } else if (c.kind(1) == Arg::Kind::Int) {
    hi = c.i64(1);
    checkRandomBounds(x.dtype(), lo, hi);
  } else {
    if (ir::isComplex(x.dtype())) throw ir::Unsupported("random_ of a complex tensor");  // the CPU raises for itself
    DType t = x.dtype();
    hi = t == DType::F32
             ? (1LL << 24) + 1
             : (t == DType::F64 ? (1LL << 53) + 1
                                : (t == DType::BF16 ? (1LL << 8) + 1
                                                    : (t == DType::F16 ? (1LL << 11) + 1
                                                                       : static_cast<int64_t>(highestValue(t)) + 1)));
    if (t == DType::Bool) hi = 2;
  }
  uint64_t range = static_cast<uint64_t>(hi - lo);
  Value bits = b.rngBitGenerator(c.rngState(), {DType::U64, x.shape()})[1];
  Value r =
      b.binary("remainder", bits,
               b.bitcast(b.constantInt(static_cast<int64_t>(range), DType::I64, x.shape()), {DType::U64, x.shape()}));
  Value v = add(b, b.bitcast(r, {DType::I64, x.shape()}), b.constantInt(lo, DType::I64, x.shape()));
  return std::vector<Value>{b.convert(v, x.dtype())};
});

Registrar reg_exponential("exponential", [](Ctx& c) {
  Value x = c.tensor(0);
  if (!ir::isFloat(x.dtype())) throw ir::Unsupported("exponential_ on a non-float tensor");
  ir::Builder& b = c.b;
  Value u = uniform01(c, x.shape(), wide(x.dtype()));
  DType t = u.dtype();
  Value v = div(b, b.unary("negate", b.unary("log_plus_one", b.unary("negate", u))),
                b.constant(c.f64Or(1, 1.0), t, x.shape()));
  return std::vector<Value>{b.convert(v, x.dtype())};
});

// Uniform in (0, 1]: safe under log.
Value uniformOpen01(Ctx& c, const Shape& shape, bool f64) {
  Value u = uniform01(c, shape, f64);
  return sub(c.b, c.b.constant(1.0, u.dtype(), shape), u);
}

// cauchy_(self, median, sigma): median + sigma * tan(pi * (u - 1/2)).
Registrar reg_cauchy("cauchy", [](Ctx& c) {
  Value x = c.tensor(0);
  if (!ir::isFloat(x.dtype())) throw ir::Unsupported("cauchy_ on a non-float tensor");
  ir::Builder& b = c.b;
  Value u = uniform01(c, x.shape(), wide(x.dtype()));
  DType t = u.dtype();
  Value a = mul(b, b.constant(M_PI, t, x.shape()), sub(b, u, b.constant(0.5, t, x.shape())));
  Value tan = div(b, b.unary("sine", a), b.unary("cosine", a));
  Value v = add(b, b.constant(c.f64Or(1, 0.0), t, x.shape()), mul(b, b.constant(c.f64Or(2, 1.0), t, x.shape()), tan));
  return std::vector<Value>{b.convert(v, x.dtype())};
});

// log_normal_(self, mean, std): exp of a normal sample.
Registrar reg_log_normal("log_normal", [](Ctx& c) {
  Value x = c.tensor(0);
  if (!ir::isFloat(x.dtype())) throw ir::Unsupported("log_normal_ on a non-float tensor");
  ir::Builder& b = c.b;
  Value z = standardNormal(c, x.shape(), wide(x.dtype()));
  DType t = z.dtype();
  Value v = add(b, b.constant(c.f64Or(1, 1.0), t, x.shape()), mul(b, z, b.constant(c.f64Or(2, 2.0), t, x.shape())));
  return std::vector<Value>{b.convert(b.unary("exponential", v), x.dtype())};
});

// geometric_(self, p): the number of Bernoulli(p) trials up to the first
// success, ceil(log(u) / log(1 - p)) for u in (0, 1].
Registrar reg_geometric("geometric", [](Ctx& c) {
  Value x = c.tensor(0);
  ir::Builder& b = c.b;
  bool f64 = x.dtype() == DType::F64 || x.dtype() == DType::I64;
  Value u = uniformOpen01(c, x.shape(), f64);
  DType t = u.dtype();
  double p = c.f64(1);
  Value v = b.unary("ceil", div(b, b.unary("log", u), b.constant(std::log1p(-p), t, x.shape())));
  // u == 1 gives 0 trials; the distribution starts at 1.
  v = b.binary("maximum", v, b.constant(1.0, t, x.shape()));
  return std::vector<Value>{b.convert(v, x.dtype())};
});

// rrelu_with_noise(self, noise!, lower, upper, training, generator): in
// training, negative inputs are scaled by a uniform draw in [lower, upper]
// recorded in `noise` (1 elsewhere); in eval by (lower + upper) / 2.
Registrar reg_rrelu_with_noise("rrelu_with_noise", [](Ctx& c) {
  Value x = c.tensor(0), noise = c.tensor(1);
  if (!ir::isFloat(x.dtype())) throw ir::Unsupported("rrelu on a non-float tensor");
  ir::Builder& b = c.b;
  bool training = c.flagOr(4, false);
  DType acc = accOf(x.dtype());
  Value lo = b.broadcastTo(c.scalarOr(2, acc, 1.0 / 8), x.shape());
  Value hi = b.broadcastTo(c.scalarOr(3, acc, 1.0 / 3), x.shape());
  Value xx = b.convert(x, acc);
  Value neg = b.compare(xx, b.zeros({acc, x.shape()}), ir::Cmp::LE);
  if (!training) {
    Value slope = mul(b, add(b, lo, hi), b.constant(0.5, acc, x.shape()));
    return std::vector<Value>{b.convert(b.select(neg, mul(b, xx, slope), xx), x.dtype())};
  }
  Value u = b.convert(uniform01(c, x.shape(), acc == DType::F64), acc);
  Value r = add(b, lo, mul(b, u, sub(b, hi, lo)));
  Value scale = b.select(neg, r, b.constant(1.0, acc, x.shape()));
  c.mutate(1, b.convert(scale, noise.dtype()));
  return std::vector<Value>{b.convert(mul(b, xx, scale), x.dtype())};
});

// multinomial(self, num_samples, replacement, generator) -> int64 indices.
// Without replacement: the k smallest Exp(1) / p keys (a weighted random
// permutation). With replacement: inverse-CDF lookups of uniform draws.
Registrar reg_multinomial("multinomial", [](Ctx& c) {
  Value p = c.tensor(0);
  int64_t k = c.i64(1);
  bool replacement = c.flagOr(2, false);
  if (!ir::isFloat(p.dtype()) || p.rank() < 1 || p.rank() > 2) throw ir::Unsupported("multinomial arguments");
  ir::Builder& b = c.b;
  bool batched = p.rank() == 2;
  int64_t rows = batched ? p.shape()[0] : 1, n = p.shape()[p.rank() - 1];
  if (n == 0 || k == 0 || rows == 0) throw ir::Unsupported("multinomial of an empty distribution");
  DType t = p.dtype() == DType::F64 ? DType::F64 : DType::F32;
  Value pp = b.reshape(b.convert(p, t), {rows, n});
  Value out;
  if (!replacement) {
    Value e = b.unary("negate", b.unary("log", uniformOpen01(c, {rows, n}, t == DType::F64)));
    // Zero-probability categories come last (key +inf).
    Value key = div(b, e, pp);
    out = b.slice(sortImpl(b, key, 1, false)[1], {0, 0}, {rows, k}, {1, 1});
  } else {
    Value cdf = scan(b, pp, 1, "add", 0.0);
    Value total = b.slice(cdf, {0, n - 1}, {rows, n}, {1, 1});  // [rows, 1]
    Value u = uniform01(c, {rows, k}, t == DType::F64);
    Value target = mul(b, u, b.broadcastInDim(b.reshape(total, {rows}), {rows, k}, {0}));
    Shape s3{rows, k, n};
    // index = number of categories whose cumulative mass is <= target,
    // skipping zero-probability categories at the boundary.
    Value le = b.compare(b.broadcastInDim(cdf, s3, {0, 2}), b.broadcastInDim(target, s3, {0, 1}), ir::Cmp::LE);
    Value idx = reduceSum(b, b.convert(le, DType::I64), {2});
    out = b.binary("minimum", idx, b.constantInt(n - 1, DType::I64, {rows, k}));
  }
  out = b.convert(out, DType::I64);
  return std::vector<Value>{batched ? out : b.reshape(out, {k})};
});

// native_dropout(input, p, train) -> (output, mask)
Registrar reg_native_dropout("native_dropout", [](Ctx& c) {
  Value x = c.tensor(0);
  double p = c.f64(1);
  bool train = c.has(2) ? c.flag(2) : true;
  ir::Builder& b = c.b;
  if (!train || p == 0) return std::vector<Value>{x, b.constantInt(1, DType::Bool, x.shape())};
  if (p >= 1) return std::vector<Value>{b.zeros(x.type), b.constantInt(0, DType::Bool, x.shape())};
  Value u = uniform01(c, x.shape(), false);
  Value mask = b.compare(u, b.constant(1.0 - p, DType::F32, x.shape()), ir::Cmp::LT);
  DType acc = accOf(x.dtype());
  Value scaled = mul(b, b.convert(x, acc), b.constant(1.0 / (1.0 - p), acc, x.shape()));
  Value out = b.select(mask, scaled, b.zeros({acc, x.shape()}));
  return std::vector<Value>{b.convert(out, x.dtype()), mask};
});
Registrar reg_native_dropout_backward("native_dropout_backward", [](Ctx& c) {
  Value g = c.tensor(0), m = c.tensor(1);
  double scale = c.f64(2);
  ir::Builder& b = c.b;
  // grad * mask * scale: a bool grad promotes to float with the scale.
  DType out = outType(c, g.dtype());
  DType acc = accOf(out);
  // The mask times the scale first: a float factor the compiler cannot turn into a select
  // (inf * 0 stays NaN, -7 * 0 stays -0, as on the CPU).
  Value factor = mul(b, b.convert(m, acc), b.constant(scale, acc, m.shape()));
  return std::vector<Value>{b.convert(mul(b, b.convert(g, acc), b.broadcastTo(factor, g.shape())), out)};
});

}  // namespace
}  // namespace tpu::ops
