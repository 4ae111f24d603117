// Elementwise lowerings: arithmetic, comparisons, logic, math functions,
// activations and their backward ops. Low-precision floats compute in
// float32 and round once at the end, as PyTorch's CPU kernels do.
#include <cmath>
#include <optional>

#include "ops/common.h"

namespace tpu::ops {
namespace {

// Unary ops that keep the input dtype (neg, abs, ...).
std::vector<Value> sameUnary(Ctx& c, const Fn1& f) {
  Value x = c.tensor(0);
  DType out = outType(c, x.dtype());
  DType comp = accOf(out);
  return {c.b.convert(f(c.b, c.b.convert(x, comp)), out)};
}

// Binary arithmetic with PyTorch type promotion and broadcasting.
std::vector<Value> arith(Ctx& c, const Fn2& f, size_t a = 0, size_t bi = 1) {
  DType t = resultType(c, {a, bi});
  DType out = outType(c, t);
  DType comp = accOf(ir::isFloat(out) || ir::isComplex(out) ? out : t);
  auto vs = broadcastAll(c.b, {c.b.convert(c.tensor(a), comp), c.b.convert(c.tensor(bi), comp)});
  return {c.b.convert(f(c.b, vs[0], vs[1]), out)};
}

std::vector<Value> comparison(Ctx& c, ir::Cmp dir) {
  DType t = resultType(c, {0, 1});
  auto vs = broadcastAll(c.b, {c.b.convert(c.tensor(0), t), c.b.convert(c.tensor(1), t)});
  return {c.b.compare(vs[0], vs[1], dir)};
}

Value un(ir::Builder& b, const char* op, const Value& x) { return b.unary(op, x); }
Value k(ir::Builder& b, double v, const Value& like) { return full(b, v, like); }

Value sigmoid(ir::Builder& b, const Value& x) { return b.unary("logistic", x); }

Value gelu(ir::Builder& b, const Value& x, bool tanh_approx) {
  if (tanh_approx) {
    // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    Value x3 = mul(b, mul(b, x, x), x);
    Value inner = mul(b, k(b, std::sqrt(2.0 / M_PI), x), add(b, x, mul(b, k(b, 0.044715, x), x3)));
    return mul(b, mul(b, k(b, 0.5, x), x), add(b, k(b, 1.0, x), b.unary("tanh", inner)));
  }
  Value e = erf(b, mul(b, x, k(b, M_SQRT1_2, x)));
  return mul(b, mul(b, k(b, 0.5, x), x), add(b, k(b, 1.0, x), e));
}

Value geluBackward(ir::Builder& b, const Value& g, const Value& x, bool tanh_approx) {
  if (tanh_approx) {
    double kBeta = std::sqrt(2.0 / M_PI), kKappa = 0.044715;
    Value x2 = mul(b, x, x);
    Value x3 = mul(b, x2, x);
    Value inner = mul(b, k(b, kBeta, x), add(b, x, mul(b, k(b, kKappa, x), x3)));
    Value t = b.unary("tanh", inner);
    Value left = mul(b, k(b, 0.5, x), x);
    Value right = add(b, k(b, 1.0, x), t);
    Value left_d = mul(b, k(b, 0.5, x), right);
    Value tanh_d = sub(b, k(b, 1.0, x), mul(b, t, t));
    Value inner_d = mul(b, k(b, kBeta, x), add(b, k(b, 1.0, x), mul(b, k(b, 3 * kKappa, x), x2)));
    Value right_d = mul(b, mul(b, left, tanh_d), inner_d);
    return mul(b, g, add(b, left_d, right_d));
  }
  Value cdf = mul(b, k(b, 0.5, x), add(b, k(b, 1.0, x), erf(b, mul(b, x, k(b, M_SQRT1_2, x)))));
  Value pdf = mul(b, k(b, 1.0 / std::sqrt(2 * M_PI), x), b.unary("exponential", mul(b, k(b, -0.5, x), mul(b, x, x))));
  return mul(b, g, add(b, cdf, mul(b, x, pdf)));
}

Value softplus(ir::Builder& b, const Value& x, const Value& beta, const Value& threshold) {
  Value bx = mul(b, x, beta);
  Value soft = div(b, b.unary("log_plus_one", b.unary("exponential", bx)), beta);
  return b.select(b.compare(bx, threshold, ir::Cmp::GT), x, soft);
}

Value floorDivInt(ir::Builder& b, const Value& x, const Value& y) {
  Value q = b.binary("divide", x, y);
  Value r = b.binary("remainder", x, y);
  Value zero = k(b, 0, x);
  Value rnz = b.compare(r, zero, ir::Cmp::NE);
  Value sdiff = b.compare(b.compare(r, zero, ir::Cmp::LT), b.compare(y, zero, ir::Cmp::LT), ir::Cmp::NE);
  return b.select(b.binary("and", rnz, sdiff), sub(b, q, k(b, 1, x)), q);
}

// Floating floor division as PyTorch computes it (fmod, then a corrected
// quotient), not floor(x / y): the two differ for infinite operands
// (inf // 1 is NaN, 0.3 // -inf is -1) and near integers.
Value floorDivFloat(ir::Builder& b, const Value& x, const Value& y) {
  Value zero = k(b, 0, x);
  Value mod = b.binary("remainder", x, y);
  Value q = div(b, sub(b, x, mod), y);
  Value fix = b.binary("and", b.compare(mod, zero, ir::Cmp::NE),
                       b.compare(b.compare(y, zero, ir::Cmp::LT), b.compare(mod, zero, ir::Cmp::LT), ir::Cmp::NE));
  q = b.select(fix, sub(b, q, k(b, 1, x)), q);
  Value fl = b.unary("floor", q);
  fl = b.select(b.compare(sub(b, q, fl), k(b, 0.5, x), ir::Cmp::GT), add(b, fl, k(b, 1, x)), fl);
  Value plain = div(b, x, y);
  // A zero quotient takes the sign of x / y; a zero divisor gives x / y itself.
  Value r = b.select(b.compare(q, zero, ir::Cmp::EQ), mul(b, zero, plain), fl);  // |x / y| < 1: finite
  return b.select(b.compare(y, zero, ir::Cmp::EQ), plain, r);
}

Value pyRemainder(ir::Builder& b, const Value& x, const Value& y) {
  Value r = b.binary("remainder", x, y);
  Value zero = k(b, 0, x);
  Value rnz = b.compare(r, zero, ir::Cmp::NE);
  Value sdiff = b.compare(b.compare(r, zero, ir::Cmp::LT), b.compare(y, zero, ir::Cmp::LT), ir::Cmp::NE);
  return b.select(b.binary("and", rnz, sdiff), add(b, r, y), r);
}

Value roundHalfEven(ir::Builder& b, const Value& x) { return b.unary("round_nearest_even", x); }

Value isnan(ir::Builder& b, const Value& x) {
  if (ir::isComplex(x.dtype())) return b.binary("or", isnan(b, b.real(x)), isnan(b, b.imag(x)));
  if (!ir::isFloat(x.dtype())) return b.constantInt(0, DType::Bool, x.shape());
  return b.compare(x, x, ir::Cmp::NE);
}

// Complex asinh on the closed first quadrant, where log(w + sqrt(w^2 + 1))
// neither cancels nor meets a branch cut; odd and conjugate symmetry give
// the rest (the signs of re z and im z carry over to the result's parts).
Value complexAsinh(ir::Builder& b, const Value& z) {
  Value re = b.real(z), im = b.imag(z), zero = b.zeros(re.type);
  Value w = b.complex(b.unary("abs", re), b.unary("abs", im));
  // log(w + sqrt(w^2 + 1)) as log1p(w + w^2 / (sqrt(w^2 + 1) + 1)): exact near 0.
  Value w2 = mul(b, w, w);
  Value r = b.unary("log_plus_one", add(b, w, div(b, w2, add(b, b.unary("sqrt", add(b, w2, k(b, 1, w))), k(b, 1, w)))));
  Value rr = b.real(r), ri = b.imag(r);
  rr = b.select(b.compare(re, zero, ir::Cmp::LT), b.unary("negate", rr), rr);
  ri = b.select(b.compare(im, zero, ir::Cmp::LT), b.unary("negate", ri), ri);
  return b.complex(rr, ri);
}

// --- registration helpers

#define UNARY_FLOAT(name, body) \
  Registrar reg_##name(#name, [](Ctx& c) { return floatUnary(c, [](ir::Builder& b, const Value& x) { return body; }); })
#define UNARY_SAME(name, body) \
  Registrar reg_##name(#name, [](Ctx& c) { return sameUnary(c, [](ir::Builder& b, const Value& x) { return body; }); })

UNARY_FLOAT(exp, un(b, "exponential", x));
UNARY_FLOAT(exp2, un(b, "exponential", mul(b, x, k(b, M_LN2, x))));
UNARY_FLOAT(expm1, un(b, "exponential_minus_one", x));
UNARY_FLOAT(log, un(b, "log", x));
UNARY_FLOAT(log2, mul(b, un(b, "log", x), k(b, 1.0 / M_LN2, x)));
UNARY_FLOAT(log10, mul(b, un(b, "log", x), k(b, 1.0 / M_LN10, x)));
UNARY_FLOAT(log1p, un(b, "log_plus_one", x));
UNARY_FLOAT(sqrt, un(b, "sqrt", x));
UNARY_FLOAT(rsqrt, un(b, "rsqrt", x));
UNARY_FLOAT(sin, un(b, "sine", x));
UNARY_FLOAT(cos, un(b, "cosine", x));
UNARY_FLOAT(tan, un(b, "tan", x));
UNARY_FLOAT(tanh, un(b, "tanh", x));
UNARY_FLOAT(sinh, mul(b, k(b, 0.5, x), sub(b, un(b, "exponential", x), un(b, "exponential", b.unary("negate", x)))));
UNARY_FLOAT(cosh, mul(b, k(b, 0.5, x), add(b, un(b, "exponential", x), un(b, "exponential", b.unary("negate", x)))));
UNARY_FLOAT(asin, b.binary("atan2", x, un(b, "sqrt", sub(b, k(b, 1, x), mul(b, x, x)))));
UNARY_FLOAT(acos, b.binary("atan2", un(b, "sqrt", sub(b, k(b, 1, x), mul(b, x, x))), x));
UNARY_FLOAT(atan, b.binary("atan2", x, k(b, 1, x)));
UNARY_FLOAT(asinh, ir::isComplex(x.dtype())
                       ? complexAsinh(b, x)
                       : mul(b, un(b, "sign", x),
                             un(b, "log", add(b, un(b, "abs", x), un(b, "sqrt", add(b, mul(b, x, x), k(b, 1, x)))))));
// Complex: sqrt(z+1) sqrt(z-1) keeps the principal branch (sqrt(z^2-1) does not).
UNARY_FLOAT(acosh, un(b, "log",
                      add(b, x,
                          ir::isComplex(x.dtype())
                              ? mul(b, un(b, "sqrt", add(b, x, k(b, 1, x))), un(b, "sqrt", sub(b, x, k(b, 1, x))))
                              : un(b, "sqrt", sub(b, mul(b, x, x), k(b, 1, x))))));
// Complex: (log1p(z) - log1p(-z)) / 2 puts the cuts (|re| > 1) where C99 does.
UNARY_FLOAT(atanh,
            ir::isComplex(x.dtype())
                ? mul(b, k(b, 0.5, x), sub(b, un(b, "log_plus_one", x), un(b, "log_plus_one", un(b, "negate", x))))
                : mul(b, k(b, 0.5, x), un(b, "log", div(b, add(b, k(b, 1, x), x), sub(b, k(b, 1, x), x)))));
UNARY_FLOAT(sigmoid, sigmoid(b, x));
UNARY_FLOAT(erf, erf(b, x));
UNARY_FLOAT(erfc, sub(b, k(b, 1, x), erf(b, x)));
UNARY_FLOAT(reciprocal, div(b, k(b, 1, x), x));
UNARY_FLOAT(log_sigmoid, b.unary("negate", softplus(b, b.unary("negate", x), k(b, 1, x), k(b, 20, x))));
UNARY_FLOAT(silu, mul(b, x, sigmoid(b, x)));
UNARY_FLOAT(mish, mul(b, x, un(b, "tanh", softplus(b, x, k(b, 1, x), k(b, 20, x)))));
UNARY_FLOAT(hardsigmoid, b.clamp(k(b, 0, x), div(b, add(b, x, k(b, 3, x)), k(b, 6, x)), k(b, 1, x)));
UNARY_FLOAT(hardswish, mul(b, x, b.clamp(k(b, 0, x), div(b, add(b, x, k(b, 3, x)), k(b, 6, x)), k(b, 1, x))));
UNARY_FLOAT(relu6, b.clamp(k(b, 0, x), x, k(b, 6, x)));
UNARY_FLOAT(selu, mul(b, k(b, 1.0507009873554804934193349852946, x),
                      b.select(b.compare(x, k(b, 0, x), ir::Cmp::GT), x,
                               mul(b, k(b, 1.6732632423543772848170429916717, x), un(b, "exponential_minus_one", x)))));

UNARY_SAME(neg, un(b, "negate", x));
UNARY_SAME(negative, un(b, "negate", x));
UNARY_SAME(positive, x);
Registrar reg_abs("abs", [](Ctx& c) {
  Value x = c.tensor(0);  // complex: |z| in float32, not |re z|
  if (ir::isComplex(x.dtype()))
    return std::vector<Value>{c.b.convert(un(c.b, "abs", x), outType(c, ir::complexPart(x.dtype())))};
  // stablehlo.abs refuses unsigned integers, which are their own absolute value.
  return sameUnary(c, [](ir::Builder& b, const Value& x) { return ir::isUnsigned(x.dtype()) ? x : un(b, "abs", x); });
});
// PyTorch's sign: (0 < x) - (x < 0), so NaN gives 0; stablehlo.sign gives
// NaN, and refuses unsigned integers (whose sign is x != 0).
Value signOf(ir::Builder& b, const Value& x) {
  if (x.dtype() == DType::Bool) return x;
  if (ir::isUnsigned(x.dtype())) return b.convert(b.compare(x, b.zeros(x.type), ir::Cmp::NE), x.dtype());
  if (ir::isFloat(x.dtype())) return b.select(isnan(b, x), b.zeros(x.type), un(b, "sign", x));
  return un(b, "sign", x);  // signed integers; complex: z / |z|
}
UNARY_SAME(sign, signOf(b, x));
UNARY_SAME(sgn, signOf(b, x));
UNARY_SAME(floor, ir::isFloat(x.dtype()) ? un(b, "floor", x) : x);
UNARY_SAME(ceil, ir::isFloat(x.dtype()) ? un(b, "ceil", x) : x);
UNARY_SAME(trunc, ir::isFloat(x.dtype()) ? mul(b, un(b, "sign", x), un(b, "floor", un(b, "abs", x))) : x);
UNARY_SAME(fix, ir::isFloat(x.dtype()) ? mul(b, un(b, "sign", x), un(b, "floor", un(b, "abs", x))) : x);
UNARY_SAME(frac, sub(b, x, mul(b, un(b, "sign", x), un(b, "floor", un(b, "abs", x)))));
UNARY_SAME(relu, x.dtype() == DType::Bool ? x : b.binary("maximum", x, k(b, 0, x)));
UNARY_SAME(square, mul(b, x, x));

Registrar reg_round("round", [](Ctx& c) {
  return sameUnary(c, [&c](ir::Builder& b, const Value& x) {
    if (!ir::isFloat(x.dtype())) return x;
    int64_t decimals = c.i64Or(1, 0);
    if (decimals == 0) return roundHalfEven(b, x);
    double s = std::pow(10.0, static_cast<double>(decimals));
    return div(b, roundHalfEven(b, mul(b, x, k(b, s, x))), k(b, s, x));
  });
});

Registrar reg_bitwise_not("bitwise_not", [](Ctx& c) {
  Value x = c.tensor(0);
  return std::vector<Value>{c.b.unary("not", x)};
});
Registrar reg_logical_not("logical_not", [](Ctx& c) {
  Value x = c.b.convert(c.tensor(0), DType::Bool);
  return std::vector<Value>{c.b.convert(c.b.unary("not", x), outType(c, DType::Bool))};
});
Registrar reg_isnan("isnan", [](Ctx& c) { return std::vector<Value>{isnan(c.b, c.tensor(0))}; });
Registrar reg_isinf("isinf", [](Ctx& c) {
  Value x = c.tensor(0);
  if (ir::isComplex(x.dtype())) {  // either part infinite
    Value ar = c.b.unary("abs", c.b.real(x)), ai = c.b.unary("abs", c.b.imag(x)), inf = k(c.b, INFINITY, ar);
    return std::vector<Value>{c.b.binary("or", c.b.compare(ar, inf, ir::Cmp::EQ), c.b.compare(ai, inf, ir::Cmp::EQ))};
  }
  if (!ir::isFloat(x.dtype())) return std::vector<Value>{c.b.constantInt(0, DType::Bool, x.shape())};
  Value a = c.b.unary("abs", x);
  return std::vector<Value>{c.b.compare(a, k(c.b, INFINITY, a), ir::Cmp::EQ)};
});
Registrar reg_isposinf("isposinf", [](Ctx& c) {
  Value x = c.tensor(0);
  if (!ir::isFloat(x.dtype())) return std::vector<Value>{c.b.constantInt(0, DType::Bool, x.shape())};
  return std::vector<Value>{c.b.compare(x, k(c.b, INFINITY, x), ir::Cmp::EQ)};
});
Registrar reg_isneginf("isneginf", [](Ctx& c) {
  Value x = c.tensor(0);
  if (!ir::isFloat(x.dtype())) return std::vector<Value>{c.b.constantInt(0, DType::Bool, x.shape())};
  return std::vector<Value>{c.b.compare(x, k(c.b, -INFINITY, x), ir::Cmp::EQ)};
});
Registrar reg_isfinite("isfinite", [](Ctx& c) {
  Value x = c.tensor(0);
  if (!ir::isFloat(x.dtype())) return std::vector<Value>{c.b.constantInt(1, DType::Bool, x.shape())};
  return std::vector<Value>{c.b.unary("is_finite", x)};
});
Registrar reg_signbit("signbit", [](Ctx& c) {
  Value x = c.tensor(0);
  if (!ir::isFloat(x.dtype())) {
    if (ir::isUnsigned(x.dtype())) return std::vector<Value>{c.b.constantInt(0, DType::Bool, x.shape())};
    return std::vector<Value>{c.b.compare(x, k(c.b, 0, x), ir::Cmp::LT)};
  }
  // Sign bit, so -0.0 counts: bitcast to the same-width integer.
  DType it = ir::itemSize(x.dtype()) == 8 ? DType::I64 : (ir::itemSize(x.dtype()) == 4 ? DType::I32 : DType::I16);
  Value bits = c.b.bitcast(x, {it, x.shape()});
  return std::vector<Value>{c.b.compare(bits, k(c.b, 0, bits), ir::Cmp::LT)};
});
Registrar reg_nan_to_num("nan_to_num", [](Ctx& c) {
  Value x = c.tensor(0);
  if (!ir::isFloat(x.dtype())) return std::vector<Value>{x};
  DType t = x.dtype();
  double big = largestFinite(t);
  Value nan = c.has(1) ? c.b.broadcastTo(c.b.constant(c.f64(1), t), x.shape()) : k(c.b, 0, x);
  Value pinf = c.has(2) ? c.b.broadcastTo(c.b.constant(c.f64(2), t), x.shape()) : k(c.b, big, x);
  Value ninf = c.has(3) ? c.b.broadcastTo(c.b.constant(c.f64(3), t), x.shape()) : k(c.b, -big, x);
  Value r = c.b.select(isnan(c.b, x), nan, x);
  r = c.b.select(c.b.compare(x, k(c.b, INFINITY, x), ir::Cmp::EQ), pinf, r);
  r = c.b.select(c.b.compare(x, k(c.b, -INFINITY, x), ir::Cmp::EQ), ninf, r);
  return std::vector<Value>{r};
});

// --- binary arithmetic

// add/sub/rsub's `alpha` (argument 2) times v, when given.
Value timesAlpha(Ctx& c, ir::Builder& b, const Value& v) {
  return c.has(2) ? mul(b, v, b.broadcastTo(c.scalar(2, v.dtype()), v.shape())) : v;
}
std::vector<Value> subtract(Ctx& c) {
  return arith(c, [&c](ir::Builder& b, const Value& x, const Value& y) { return sub(b, x, timesAlpha(c, b, y)); });
}
std::vector<Value> multiply(Ctx& c) {
  return arith(c, [](ir::Builder& b, const Value& x, const Value& y) { return mul(b, x, y); });
}
Registrar reg_add("add", [](Ctx& c) {
  return arith(c, [&c](ir::Builder& b, const Value& x, const Value& y) { return add(b, x, timesAlpha(c, b, y)); });
});
Registrar reg_sub("sub", subtract);
Registrar reg_subtract("subtract", subtract);
Registrar reg_rsub("rsub", [](Ctx& c) {
  return arith(c, [&c](ir::Builder& b, const Value& x, const Value& y) { return sub(b, y, timesAlpha(c, b, x)); });
});
Registrar reg_mul("mul", multiply);
Registrar reg_multiply("multiply", multiply);

std::vector<Value> divide(Ctx& c) {
  std::string mode = c.kind(2) == Arg::Kind::String ? c.str(2) : "";
  DType t = resultType(c, {0, 1});
  DType out = outType(c, mode.empty() && !ir::isComplex(t) ? floatOf(t) : t);
  if (mode.empty() || ir::isFloat(t)) {
    DType comp = ir::isComplex(out) ? out : accOf(mode.empty() ? floatOf(out) : out);
    auto vs = broadcastAll(c.b, {c.b.convert(c.tensor(0), comp), c.b.convert(c.tensor(1), comp)});
    Value q = mode == "floor" && !ir::isComplex(comp) ? floorDivFloat(c.b, vs[0], vs[1]) : div(c.b, vs[0], vs[1]);
    // trunc rounds the quotient to the result dtype first, as the CPU does.
    if (mode == "trunc" && comp != out) q = c.b.convert(c.b.convert(q, out), comp);
    if (mode == "trunc") q = mul(c.b, c.b.unary("sign", q), c.b.unary("floor", c.b.unary("abs", q)));
    return {c.b.convert(q, out)};
  }
  auto vs = broadcastAll(c.b, {c.b.convert(c.tensor(0), t), c.b.convert(c.tensor(1), t)});
  Value q = mode == "floor" ? floorDivInt(c.b, vs[0], vs[1]) : c.b.binary("divide", vs[0], vs[1]);
  return {c.b.convert(q, out)};
}
Registrar reg_div("div", divide);
Registrar reg_divide("divide", divide);
Registrar reg_true_divide("true_divide", divide);
Registrar reg_floor_divide("floor_divide", [](Ctx& c) {
  return arith(c, [](ir::Builder& b, const Value& x, const Value& y) {
    if (ir::isFloat(x.dtype())) return floorDivFloat(b, x, y);
    return floorDivInt(b, x, y);
  });
});
Registrar reg_remainder("remainder", [](Ctx& c) {
  return arith(c, [](ir::Builder& b, const Value& x, const Value& y) { return pyRemainder(b, x, y); });
});
Registrar reg_fmod("fmod", [](Ctx& c) {
  return arith(c, [](ir::Builder& b, const Value& x, const Value& y) { return b.binary("remainder", x, y); });
});
// x ** e for the exponents PyTorch's CPU kernel also computes without pow()
// (2, 3, 0.5, -0.5, -1, -2): the same values, and a multiply instead of
// exp(e * log(x)). Empty when e has no such form for the dtype of x.
std::optional<Value> powSpecial(ir::Builder& b, const Value& x, double e) {
  if (ir::isComplex(x.dtype())) return std::nullopt;
  if (e == 2) return mul(b, x, x);
  if (e == 3) return mul(b, mul(b, x, x), x);
  if (!ir::isFloat(x.dtype())) return std::nullopt;
  if (e == 0.5) return b.unary("sqrt", x);
  if (e == -0.5) return b.unary("rsqrt", x);
  if (e == -1) return div(b, k(b, 1, x), x);
  if (e == -2) return div(b, k(b, 1, x), mul(b, x, x));
  return std::nullopt;
}

// The exponent of pow.Tensor_Scalar (argument 1) is a program constant: its
// value picks the formula, so a new exponent compiles a new program.
Registrar reg_pow("pow",
                  [](Ctx& c) {
                    std::optional<double> e;
                    if (c.isScalarArg(1) && !c.isScalarArg(0)) e = c.arg(1).const_value;
                    DType t = resultType(c, {0, 1});
                    if (e && *e < 0 && !ir::isFloat(t) && !ir::isComplex(t) && t != DType::Bool)
                      throw std::invalid_argument("Integers to negative integer powers are not allowed.");
                    return arith(c, [e](ir::Builder& b, const Value& x, const Value& y) {
                      if (x.dtype() == DType::Bool) return b.binary("or", x, b.unary("not", y));
                      if (e)
                        if (auto r = powSpecial(b, x, *e)) return *r;
                      return b.binary("power", x, y);
                    });
                  },
                  {1});
Registrar reg_float_power("float_power", [](Ctx& c) {
  Value x = c.b.convert(c.tensor(0), DType::F64), y = c.b.convert(c.tensor(1), DType::F64);
  auto vs = broadcastAll(c.b, {x, y});
  return std::vector<Value>{c.b.binary("power", vs[0], vs[1])};
});
Registrar reg_atan2("atan2", [](Ctx& c) {
  DType out = outType(c, floatOf(resultType(c, {0, 1})));
  auto vs = broadcastAll(c.b, {c.b.convert(c.tensor(0), accOf(out)), c.b.convert(c.tensor(1), accOf(out))});
  return std::vector<Value>{c.b.convert(c.b.binary("atan2", vs[0], vs[1]), out)};
});
Registrar reg_arctan2("arctan2", [](Ctx& c) { return findLowering("atan2", "")->fn(c); });

std::vector<Value> maxmin(Ctx& c, bool is_max, bool ignore_nan) {
  return arith(c, [is_max, ignore_nan](ir::Builder& b, const Value& x, const Value& y) {
    if (x.dtype() == DType::Bool) return b.binary(is_max ? "or" : "and", x, y);
    Value r = b.binary(is_max ? "maximum" : "minimum", x, y);
    if (!ir::isFloat(x.dtype())) return r;
    Value xn = isnan(b, x), yn = isnan(b, y);
    if (ignore_nan) return b.select(xn, y, b.select(yn, x, r));
    return b.select(xn, x, b.select(yn, y, r));
  });
}
Registrar reg_maximum("maximum", [](Ctx& c) { return maxmin(c, true, false); });
Registrar reg_minimum("minimum", [](Ctx& c) { return maxmin(c, false, false); });
Registrar reg_fmax("fmax", [](Ctx& c) { return maxmin(c, true, true); });
Registrar reg_fmin("fmin", [](Ctx& c) { return maxmin(c, false, true); });

Registrar reg_hypot("hypot", [](Ctx& c) {
  return arith(c, [](ir::Builder& b, const Value& x, const Value& y) {
    return b.unary("sqrt", add(b, mul(b, x, x), mul(b, y, y)));
  });
});
Registrar reg_logaddexp("logaddexp", [](Ctx& c) {
  if (ir::isComplex(resultType(c, {0, 1}))) throw ir::Unsupported("complex logaddexp");
  return arith(c, [](ir::Builder& b, const Value& x, const Value& y) {
    Value m = b.binary("maximum", x, y);
    Value d = b.unary("negate", b.unary("abs", sub(b, x, y)));
    Value r = add(b, m, b.unary("log_plus_one", b.unary("exponential", d)));
    // inf + inf stays inf (the difference would be nan).
    return b.select(b.compare(x, y, ir::Cmp::EQ), add(b, x, k(b, M_LN2, x)), r);
  });
});
Registrar reg_xlogy("xlogy", [](Ctx& c) {
  DType out = outType(c, floatOf(resultType(c, {0, 1})));
  auto vs = broadcastAll(c.b, {c.b.convert(c.tensor(0), accOf(out)), c.b.convert(c.tensor(1), accOf(out))});
  ir::Builder& b = c.b;
  Value x = vs[0], y = vs[1];
  Value r = mul(b, x, b.unary("log", y));
  r = b.select(b.compare(x, k(b, 0, x), ir::Cmp::EQ), k(b, 0, x), r);
  r = b.select(isnan(b, y), y, r);
  return std::vector<Value>{b.convert(r, out)};
});
Registrar reg_copysign("copysign", [](Ctx& c) {
  DType out = outType(c, floatOf(resultType(c, {0, 1})));
  auto vs = broadcastAll(c.b, {c.b.convert(c.tensor(0), accOf(out)), c.b.convert(c.tensor(1), accOf(out))});
  ir::Builder& b = c.b;
  DType it = ir::itemSize(vs[1].dtype()) == 8 ? DType::I64 : DType::I32;
  Value neg = b.compare(b.bitcast(vs[1], {it, vs[1].shape()}), b.constantInt(0, it, vs[1].shape()), ir::Cmp::LT);
  Value a = b.unary("abs", vs[0]);
  return std::vector<Value>{b.convert(b.select(neg, b.unary("negate", a), a), out)};
});

// gcd by Euclid's algorithm, all elements in one while loop (each stops when
// its remainder is 0); lcm = |a / gcd(a, b) * b|, 0 when gcd is 0.
Value gcdOf(ir::Builder& b, const Value& x, const Value& y) {
  Type t = x.type;
  Value zero = b.zeros(t);
  auto st = b.whileLoop(
      {b.unary("abs", x), b.unary("abs", y)},
      [](ir::Builder& bb, const std::vector<Value>& s) {
        Value nz = bb.compare(s[1], bb.zeros(s[1].type), ir::Cmp::NE);
        std::vector<int64_t> all;
        for (int i = 0; i < s[1].rank(); ++i) all.push_back(i);
        Value any = all.empty() ? nz
                                : bb.reduce({nz}, {bb.constantInt(0, DType::Bool)}, all,
                                            [](ir::Builder& r, const std::vector<Value>& a) {
                                              return std::vector<Value>{r.binary("or", a[0], a[1])};
                                            })[0];
        return std::vector<Value>{any};
      },
      [](ir::Builder& bb, const std::vector<Value>& s) {
        Value z = bb.zeros(s[1].type);
        Value nz = bb.compare(s[1], z, ir::Cmp::NE);
        Value safe = bb.select(nz, s[1], bb.constantInt(1, s[1].dtype(), s[1].shape()));
        Value r = bb.binary("remainder", s[0], safe);
        return std::vector<Value>{bb.select(nz, s[1], s[0]), bb.select(nz, r, z)};
      });
  (void)zero;
  return st[0];
}
std::vector<Value> gcdLcm(Ctx& c, bool lcm) {
  DType t = resultType(c, {0, 1});
  if (!ir::isInt(t)) throw ir::Unsupported("gcd/lcm of a non-integer tensor");
  ir::Builder& b = c.b;
  auto vs = broadcastAll(b, {b.convert(c.tensor(0), t), b.convert(c.tensor(1), t)});
  Value g = gcdOf(b, vs[0], vs[1]);
  if (!lcm) return {g};
  Value z = b.zeros(g.type);
  Value nz = b.compare(g, z, ir::Cmp::NE);
  Value safe = b.select(nz, g, b.constantInt(1, t, g.shape()));
  Value l = b.unary("abs", mul(b, b.binary("divide", vs[0], safe), vs[1]));
  return {b.select(nz, l, z)};
}
Registrar reg_gcd("gcd", [](Ctx& c) { return gcdLcm(c, false); });
Registrar reg_lcm("lcm", [](Ctx& c) { return gcdLcm(c, true); });

std::vector<Value> bitwise(Ctx& c, const char* op) {
  DType t = resultType(c, {0, 1});
  auto vs = broadcastAll(c.b, {c.b.convert(c.tensor(0), t), c.b.convert(c.tensor(1), t)});
  return {c.b.binary(op, vs[0], vs[1])};
}
Registrar reg_bitwise_and("bitwise_and", [](Ctx& c) { return bitwise(c, "and"); });
Registrar reg_bitwise_or("bitwise_or", [](Ctx& c) { return bitwise(c, "or"); });
Registrar reg_bitwise_xor("bitwise_xor", [](Ctx& c) { return bitwise(c, "xor"); });
Registrar reg_and("__and__", [](Ctx& c) { return bitwise(c, "and"); });
Registrar reg_or("__or__", [](Ctx& c) { return bitwise(c, "or"); });
Registrar reg_xor("__xor__", [](Ctx& c) { return bitwise(c, "xor"); });
Registrar reg_lshift("bitwise_left_shift", [](Ctx& c) { return bitwise(c, "shift_left"); });
Registrar reg_rshift("bitwise_right_shift", [](Ctx& c) { return bitwise(c, "shift_right_arithmetic"); });
Registrar reg_lshift2("__lshift__", [](Ctx& c) { return bitwise(c, "shift_left"); });
Registrar reg_rshift2("__rshift__", [](Ctx& c) { return bitwise(c, "shift_right_arithmetic"); });

std::vector<Value> logical(Ctx& c, const char* op) {
  auto vs = broadcastAll(c.b, {c.b.convert(c.tensor(0), DType::Bool), c.b.convert(c.tensor(1), DType::Bool)});
  return {c.b.convert(c.b.binary(op, vs[0], vs[1]), outType(c, DType::Bool))};
}
Registrar reg_logical_and("logical_and", [](Ctx& c) { return logical(c, "and"); });
Registrar reg_logical_or("logical_or", [](Ctx& c) { return logical(c, "or"); });
Registrar reg_logical_xor("logical_xor", [](Ctx& c) { return logical(c, "xor"); });

Registrar reg_eq("eq", [](Ctx& c) { return comparison(c, ir::Cmp::EQ); });
Registrar reg_ne("ne", [](Ctx& c) { return comparison(c, ir::Cmp::NE); });
Registrar reg_lt("lt", [](Ctx& c) { return comparison(c, ir::Cmp::LT); });
Registrar reg_le("le", [](Ctx& c) { return comparison(c, ir::Cmp::LE); });
Registrar reg_gt("gt", [](Ctx& c) { return comparison(c, ir::Cmp::GT); });
Registrar reg_ge("ge", [](Ctx& c) { return comparison(c, ir::Cmp::GE); });
Registrar reg_not_equal("not_equal", [](Ctx& c) { return comparison(c, ir::Cmp::NE); });
Registrar reg_greater("greater", [](Ctx& c) { return comparison(c, ir::Cmp::GT); });
Registrar reg_less("less", [](Ctx& c) { return comparison(c, ir::Cmp::LT); });
Registrar reg_greater_equal("greater_equal", [](Ctx& c) { return comparison(c, ir::Cmp::GE); });
Registrar reg_less_equal("less_equal", [](Ctx& c) { return comparison(c, ir::Cmp::LE); });

// --- ternary and friends

Registrar reg_where("where", [](Ctx& c) {
  DType t = resultType(c, {1, 2});
  DType out = outType(c, t);
  auto vs = broadcastAll(
      c.b, {c.b.convert(c.tensor(0), DType::Bool), c.b.convert(c.tensor(1), out), c.b.convert(c.tensor(2), out)});
  return std::vector<Value>{c.b.select(vs[0], vs[1], vs[2])};
});

Registrar reg_masked_fill("masked_fill", [](Ctx& c) {
  Value x = c.tensor(0);
  auto vs = broadcastAll(c.b, {x, c.b.convert(c.tensor(1), DType::Bool), c.b.convert(c.tensor(2), x.dtype())});
  return std::vector<Value>{c.b.select(vs[1], vs[2], vs[0])};
});

std::vector<Value> clampImpl(Ctx& c, std::optional<size_t> lo, std::optional<size_t> hi) {
  std::vector<size_t> idx{0};
  if (lo) idx.push_back(*lo);
  if (hi) idx.push_back(*hi);
  DType t = resultType(c, idx);
  DType out = outType(c, t);
  DType comp = accOf(out);
  Value x = c.b.convert(c.tensor(0), comp);
  Shape s = x.shape();
  if (lo && c.has(*lo)) s = broadcastShapes(s, c.tensor(*lo).shape());
  if (hi && c.has(*hi)) s = broadcastShapes(s, c.tensor(*hi).shape());
  x = c.b.broadcastTo(x, s);
  Value nanmask = isnan(c.b, x);
  if (lo && c.has(*lo)) {
    Value l = c.b.broadcastTo(c.b.convert(c.tensor(*lo), comp), s);
    x = ir::isFloat(comp) ? c.b.select(isnan(c.b, l), l, c.b.binary("maximum", x, l)) : c.b.binary("maximum", x, l);
  }
  if (hi && c.has(*hi)) {
    Value h = c.b.broadcastTo(c.b.convert(c.tensor(*hi), comp), s);
    x = ir::isFloat(comp) ? c.b.select(isnan(c.b, h), h, c.b.binary("minimum", x, h)) : c.b.binary("minimum", x, h);
  }
  if (ir::isFloat(comp)) x = c.b.select(nanmask, c.b.broadcastTo(c.b.convert(c.tensor(0), comp), s), x);
  return {c.b.convert(x, out)};
}
Registrar reg_clamp("clamp", [](Ctx& c) { return clampImpl(c, 1, 2); });
Registrar reg_clip("clip", [](Ctx& c) { return clampImpl(c, 1, 2); });
Registrar reg_clamp_min("clamp_min", [](Ctx& c) { return clampImpl(c, 1, std::nullopt); });
Registrar reg_clamp_max("clamp_max", [](Ctx& c) { return clampImpl(c, std::nullopt, 1); });

Registrar reg_lerp("lerp", [](Ctx& c) {
  Value s = c.tensor(0);
  DType out = outType(c, s.dtype());
  DType comp = accOf(out);
  auto vs = broadcastAll(c.b, {c.b.convert(s, comp), c.b.convert(c.tensor(1), comp), c.b.convert(c.tensor(2), comp)});
  ir::Builder& b = c.b;
  Value d = sub(b, vs[1], vs[0]);
  // PyTorch: weight < 0.5 ? start + w*d : end - (1-w)*d
  Value lo = add(b, vs[0], mul(b, vs[2], d));
  Value hi = sub(b, vs[1], mul(b, sub(b, k(b, 1, vs[2]), vs[2]), d));
  Value aw = b.unary("abs", vs[2]);  // real, also for complex weights
  Value r = b.select(b.compare(aw, k(b, 0.5, aw), ir::Cmp::LT), lo, hi);
  return std::vector<Value>{b.convert(r, out)};
});

std::vector<Value> addcop(Ctx& c, bool is_div) {
  DType t = resultType(c, {0, 1, 2});
  DType out = outType(c, t);
  DType comp = accOf(out);
  auto vs = broadcastAll(
      c.b, {c.b.convert(c.tensor(0), comp), c.b.convert(c.tensor(1), comp), c.b.convert(c.tensor(2), comp)});
  Value v = c.b.broadcastTo(c.scalarOr(3, comp, 1.0), vs[0].shape());
  Value p = is_div ? div(c.b, vs[1], vs[2]) : mul(c.b, vs[1], vs[2]);
  return {c.b.convert(add(c.b, vs[0], mul(c.b, v, p)), out)};
}
Registrar reg_addcmul("addcmul", [](Ctx& c) { return addcop(c, false); });
Registrar reg_addcdiv("addcdiv", [](Ctx& c) { return addcop(c, true); });

// --- activations with parameters

Registrar reg_gelu("gelu", [](Ctx& c) {
  bool tanh = c.kind(1) == Arg::Kind::String && c.str(1) == "tanh";
  return floatUnary(c, [tanh](ir::Builder& b, const Value& x) { return gelu(b, x, tanh); });
});
Registrar reg_gelu_backward("gelu_backward", [](Ctx& c) {
  bool tanh = c.kind(2) == Arg::Kind::String && c.str(2) == "tanh";
  return arith(c, [tanh](ir::Builder& b, const Value& g, const Value& x) { return geluBackward(b, g, x, tanh); });
});
Registrar reg_silu_backward("silu_backward", [](Ctx& c) {
  return arith(c, [](ir::Builder& b, const Value& g, const Value& x) {
    Value s = sigmoid(b, x);
    return mul(b, g, mul(b, s, add(b, k(b, 1, x), mul(b, x, sub(b, k(b, 1, x), s)))));
  });
});
Registrar reg_sigmoid_backward("sigmoid_backward", [](Ctx& c) {
  return arith(
      c, [](ir::Builder& b, const Value& g, const Value& y) { return mul(b, g, mul(b, y, sub(b, k(b, 1, y), y))); });
});
Registrar reg_tanh_backward("tanh_backward", [](Ctx& c) {
  return arith(
      c, [](ir::Builder& b, const Value& g, const Value& y) { return mul(b, g, sub(b, k(b, 1, y), mul(b, y, y))); });
});
Registrar reg_threshold("threshold", [](Ctx& c) {
  Value x = c.tensor(0);
  DType out = outType(c, x.dtype());
  Value xx = c.b.convert(x, accOf(out));
  Value th = c.b.broadcastTo(c.scalar(1, xx.dtype()), xx.shape());
  Value v = c.b.broadcastTo(c.scalar(2, xx.dtype()), xx.shape());
  return std::vector<Value>{c.b.convert(c.b.select(c.b.compare(xx, th, ir::Cmp::LE), v, xx), out)};
});
Registrar reg_threshold_backward("threshold_backward", [](Ctx& c) {
  return arith(c, [&c](ir::Builder& b, const Value& g, const Value& x) {
    Value th = b.broadcastTo(c.scalar(2, x.dtype()), x.shape());
    return b.select(b.compare(x, th, ir::Cmp::LE), k(b, 0, g), g);
  });
});
Registrar reg_hardtanh("hardtanh", [](Ctx& c) {
  return sameUnary(c, [&c](ir::Builder& b, const Value& x) {
    return b.clamp(b.broadcastTo(c.scalarOr(1, x.dtype(), -1), x.shape()), x,
                   b.broadcastTo(c.scalarOr(2, x.dtype(), 1), x.shape()));
  });
});
Registrar reg_hardtanh_backward("hardtanh_backward", [](Ctx& c) {
  return arith(c, [&c](ir::Builder& b, const Value& g, const Value& x) {
    Value lo = b.broadcastTo(c.scalar(2, x.dtype()), x.shape()), hi = b.broadcastTo(c.scalar(3, x.dtype()), x.shape());
    Value in = b.binary("and", b.compare(x, lo, ir::Cmp::GT), b.compare(x, hi, ir::Cmp::LT));
    return b.select(in, g, k(b, 0, g));
  });
});
Registrar reg_leaky_relu("leaky_relu", [](Ctx& c) {
  return sameUnary(c, [&c](ir::Builder& b, const Value& x) {
    Value s = b.broadcastTo(c.scalarOr(1, x.dtype(), 0.01), x.shape());
    return b.select(b.compare(x, k(b, 0, x), ir::Cmp::GT), x, mul(b, x, s));
  });
});
Registrar reg_leaky_relu_backward("leaky_relu_backward", [](Ctx& c) {
  return arith(c, [&c](ir::Builder& b, const Value& g, const Value& x) {
    Value s = b.broadcastTo(c.scalar(2, x.dtype()), x.shape());
    return b.select(b.compare(x, k(b, 0, x), ir::Cmp::GT), g, mul(b, g, s));
  });
});
Registrar reg_elu("elu", [](Ctx& c) {
  return floatUnary(c, [&c](ir::Builder& b, const Value& x) {
    Value alpha = b.broadcastTo(c.scalarOr(1, x.dtype(), 1), x.shape());
    Value scale = b.broadcastTo(c.scalarOr(2, x.dtype(), 1), x.shape());
    Value in_scale = b.broadcastTo(c.scalarOr(3, x.dtype(), 1), x.shape());
    Value neg = mul(b, alpha, b.unary("exponential_minus_one", mul(b, x, in_scale)));
    return mul(b, scale, b.select(b.compare(x, k(b, 0, x), ir::Cmp::GT), x, neg));
  });
});
Registrar reg_elu_backward("elu_backward", [](Ctx& c) {
  // (grad, alpha, scale, input_scale, is_result, self_or_result)
  DType out = outType(c, c.tensor(0).dtype());
  DType comp = accOf(out);
  ir::Builder& b = c.b;
  auto vs = broadcastAll(b, {b.convert(c.tensor(0), comp), b.convert(c.tensor(5), comp)});
  Value g = vs[0], x = vs[1];
  Value alpha = b.broadcastTo(c.scalar(1, comp), x.shape());
  Value scale = b.broadcastTo(c.scalar(2, comp), x.shape());
  Value in_scale = b.broadcastTo(c.scalar(3, comp), x.shape());
  bool is_result = c.flag(4);
  Value negd = is_result ? mul(b, in_scale, add(b, x, mul(b, alpha, scale)))
                         : mul(b, mul(b, in_scale, mul(b, alpha, scale)), b.unary("exponential", mul(b, x, in_scale)));
  Value r = b.select(b.compare(x, k(b, 0, x), ir::Cmp::GT), mul(b, g, scale), mul(b, g, negd));
  return std::vector<Value>{b.convert(r, out)};
});
Registrar reg_softplus("softplus", [](Ctx& c) {
  return floatUnary(c, [&c](ir::Builder& b, const Value& x) {
    return softplus(b, x, b.broadcastTo(c.scalarOr(1, x.dtype(), 1), x.shape()),
                    b.broadcastTo(c.scalarOr(2, x.dtype(), 20), x.shape()));
  });
});
Registrar reg_softplus_backward("softplus_backward", [](Ctx& c) {
  return arith(c, [&c](ir::Builder& b, const Value& g, const Value& x) {
    Value beta = b.broadcastTo(c.scalar(2, x.dtype()), x.shape());
    Value th = b.broadcastTo(c.scalar(3, x.dtype()), x.shape());
    Value z = b.unary("exponential", mul(b, x, beta));
    Value d = div(b, z, add(b, z, k(b, 1, z)));
    return b.select(b.compare(mul(b, x, beta), th, ir::Cmp::GT), g, mul(b, g, d));
  });
});
Registrar reg_hardsigmoid_backward("hardsigmoid_backward", [](Ctx& c) {
  return arith(c, [](ir::Builder& b, const Value& g, const Value& x) {
    Value in = b.binary("and", b.compare(x, k(b, -3, x), ir::Cmp::GT), b.compare(x, k(b, 3, x), ir::Cmp::LT));
    return b.select(in, div(b, g, k(b, 6, g)), k(b, 0, g));
  });
});
Registrar reg_hardswish_backward("hardswish_backward", [](Ctx& c) {
  return arith(c, [](ir::Builder& b, const Value& g, const Value& x) {
    Value mid = mul(b, g, add(b, div(b, x, k(b, 3, x)), k(b, 0.5, x)));
    Value r = b.select(b.compare(x, k(b, 3, x), ir::Cmp::GE), g, mid);
    return b.select(b.compare(x, k(b, -3, x), ir::Cmp::LE), k(b, 0, g), r);
  });
});
Registrar reg_mish_backward("mish_backward", [](Ctx& c) {
  return arith(c, [](ir::Builder& b, const Value& g, const Value& x) {
    Value sp = softplus(b, x, k(b, 1, x), k(b, 20, x));
    Value t = b.unary("tanh", sp);
    Value s = sigmoid(b, x);
    return mul(b, g, add(b, t, mul(b, mul(b, x, s), sub(b, k(b, 1, x), mul(b, t, t)))));
  });
});
// log_sigmoid_forward(self) -> (output, buffer); the buffer is unused here.
Registrar reg_log_sigmoid_forward("log_sigmoid_forward", [](Ctx& c) {
  Value x = c.tensor(0);
  DType acc = accOf(x.dtype());
  ir::Builder& b = c.b;
  Value xx = b.convert(x, acc);
  Value y = b.unary("negate", softplus(b, b.unary("negate", xx), k(b, 1, xx), k(b, 20, xx)));
  return std::vector<Value>{b.convert(y, x.dtype()), b.zeros(x.type)};
});
Registrar reg_log_sigmoid_backward("log_sigmoid_backward", [](Ctx& c) {
  return arith(
      c, [](ir::Builder& b, const Value& g, const Value& x) { return mul(b, g, sigmoid(b, b.unary("negate", x))); });
});
Registrar reg_logit("logit", [](Ctx& c) {
  return floatUnary(c, [&c](ir::Builder& b, const Value& x0) {
    Value x = x0;
    if (c.has(1)) {
      // The bounds in a floating input's own type, as the CPU kernel holds them
      // (bfloat16's 1 - 1e-3 is 1: logit is then inf there too); an integer
      // input computes in its float result type (its bounds are not 0 and 0).
      const DType in = ir::isFloat(c.tensor(0).dtype()) ? c.tensor(0).dtype() : x.dtype();
      const double eps = c.f64(1);
      x = b.clamp(b.convert(b.convert(k(b, eps, x), in), x.dtype()), x,
                  b.convert(b.convert(k(b, 1 - eps, x), in), x.dtype()));
    }
    return b.unary("log", div(b, x, sub(b, k(b, 1, x), x)));
  });
});

// --- fill

Registrar reg_fill("fill", [](Ctx& c) {
  Value x = c.tensor(0);
  return std::vector<Value>{c.b.broadcastTo(c.b.convert(c.tensor(1), x.dtype()), x.shape())};
});
Registrar reg_zero("zero", [](Ctx& c) { return std::vector<Value>{c.b.zeros(c.tensor(0).type)}; });
Registrar reg_zeros_like("zeros_like", [](Ctx& c) {
  Value x = c.tensor(0);
  DType t = c.optDType(1).value_or(x.dtype());
  return std::vector<Value>{c.b.constant(0.0, t, x.shape())};
});
Registrar reg_ones_like("ones_like", [](Ctx& c) {
  Value x = c.tensor(0);
  DType t = c.optDType(1).value_or(x.dtype());
  return std::vector<Value>{c.b.constant(1.0, t, x.shape())};
});
Registrar reg_full_like("full_like", [](Ctx& c) {
  Value x = c.tensor(0);
  DType t = c.optDType(2).value_or(x.dtype());
  return std::vector<Value>{c.b.broadcastTo(c.b.convert(c.tensor(1), t), x.shape())};
});

}  // namespace
}  // namespace tpu::ops
