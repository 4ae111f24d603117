// Random numbers from the device generator: each op takes a fresh THREE_FRY
// state (derived from the generator's seed and offset), so results are
// reproducible under manual_seed and differ between calls.
#include <cmath>

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

// random_.from(self, from, to?), random_.to(self, to), random_(self)
Registrar reg_random("random", [](Ctx& c) {
  Value x = c.tensor(0);
  ir::Builder& b = c.b;
  int64_t lo = 0, hi;
  if (c.kind(1) == Arg::Kind::Int && c.kind(2) == Arg::Kind::Int) {
    lo = c.i64(1);
    hi = c.i64(2);
  } else if (c.kind(1) == Arg::Kind::Int && c.size() > 2 && c.kind(2) == Arg::Kind::None) {
    throw ir::Unsupported("random_ without an upper bound");
  } else if (c.kind(1) == Arg::Kind::Int) {
    hi = c.i64(1);
  } else {
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
  DType acc = accOf(g.dtype());
  Value gm = mul(b, b.convert(g, acc), b.convert(m, acc));
  return std::vector<Value>{b.convert(mul(b, gm, b.constant(scale, acc, g.shape())), g.dtype())};
});

}  // namespace
}  // namespace tpu::ops
