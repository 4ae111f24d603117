// Bessel-family special functions: special_bessel_{j0,j1,y0,y1},
// special_modified_bessel_{k0,k1}, special_scaled_modified_bessel_{k0,k1},
// special_spherical_bessel_j0 and special_airy_ai.
//
// They compute in float64 and round once: power series below a split point
// (in float64 their cancellation stays far below float32 precision), the
// Hankel asymptotic expansions above it for J and Y, and for K (and Ai on
// the positive axis, through K_{1/3}) the trapezoidal rule on
// K_nu(x) = int_0^inf exp(-x cosh t) cosh(nu t) dt, which converges
// geometrically and sums positive terms only.
#include <cmath>

#include "ops/common.h"

namespace tpu::ops {
namespace {

const double kEulerGamma = 0.57721566490153286061;
// Series below, Hankel expansion above (float64 error about 1e-10 at worst).
const double kHankelSplit = 12.0;
const int kSeriesTerms = 45;
const int kHankelTerms = 20;

Value k(ir::Builder& b, double v, const Value& like) { return full(b, v, like); }
Value cmp(ir::Builder& b, const Value& x, double v, ir::Cmp d) { return b.compare(x, k(b, v, x), d); }
Value un(ir::Builder& b, const char* op, const Value& x) { return b.unary(op, x); }
// x limited to [lo, hi] so that a branch not taken stays finite.
Value clampTo(ir::Builder& b, const Value& x, double lo, double hi) { return b.clamp(k(b, lo, x), x, k(b, hi, x)); }

using Fn = std::function<Value(ir::Builder&, const Value&)>;

std::vector<Value> wideUnary(Ctx& c, const Fn& f) {
  Value x = c.tensor(0);
  if (ir::isComplex(x.dtype())) throw ir::Unsupported("complex Bessel function");
  DType out = outType(c, floatOf(x.dtype()));
  // PyTorch has no half-precision kernels for these: the CPU raises.
  if (out == DType::F16 || out == DType::BF16) throw ir::Unsupported("Bessel function in half precision");
  return {c.b.convert(f(c.b, c.b.convert(x, DType::F64)), out)};
}

// psi(m + 1) = -gamma + H_m.
double psi1(int m) {
  double h = -kEulerGamma;
  for (int j = 1; j <= m; ++j) h += 1.0 / j;
  return h;
}

// (x/2)^nu sum_k (s q)^k / (k! (k + nu)!), q = x^2/4, s = -1 (J) or +1 (I).
Value besselSeries(ir::Builder& b, const Value& x, int nu, double s) {
  Value q = mul(b, mul(b, x, x), k(b, 0.25 * s, x));
  Value sum = k(b, 1, x);
  for (int j = kSeriesTerms; j >= 1; --j)
    sum = add(b, k(b, 1, x), mul(b, sum, mul(b, q, k(b, 1.0 / (j * (j + nu)), x))));
  return nu == 1 ? mul(b, sum, mul(b, x, k(b, 0.5, x))) : sum;
}

// sum_k (psi(k+1) + psi(k+nu+1)) (s q)^k / (k! (k + nu)!): the logarithmic
// parts of Y_nu (s = -1) and K_nu (s = +1).
Value psiSeries(ir::Builder& b, const Value& x, int nu, double s, int terms) {
  Value q = mul(b, mul(b, x, x), k(b, 0.25 * s, x));
  Value t = k(b, 1, x);
  Value acc = k(b, psi1(0) + psi1(nu), x);
  for (int j = 1; j < terms; ++j) {
    t = mul(b, t, mul(b, q, k(b, 1.0 / (j * (j + nu)), x)));
    acc = add(b, acc, mul(b, t, k(b, psi1(j) + psi1(j + nu), x)));
  }
  return acc;
}

// Y_nu(x) for 0 < x (series form).
Value ySeries(ir::Builder& b, const Value& x, int nu) {
  Value lg = un(b, "log", mul(b, x, k(b, 0.5, x)));
  Value acc = psiSeries(b, x, nu, -1, kSeriesTerms);
  Value j = besselSeries(b, x, nu, -1);
  Value r = mul(b, k(b, 2 / M_PI, x), mul(b, lg, j));
  if (nu == 0) return sub(b, r, mul(b, acc, k(b, 1 / M_PI, x)));
  r = sub(b, r, div(b, k(b, 2 / M_PI, x), x));
  return sub(b, r, mul(b, mul(b, x, k(b, 0.5 / M_PI, x)), acc));
}

// Hankel's expansions for large x > 0: {J_nu(x), Y_nu(x)}.
std::pair<Value, Value> hankel(ir::Builder& b, const Value& x, int nu) {
  double mu = 4.0 * nu * nu;
  Value z = div(b, k(b, 1, x), x);
  // P and Q in Horner form over z^2 with the alternating signs folded in.
  std::vector<double> a{1.0};
  for (int j = 1; j < kHankelTerms; ++j) a.push_back(a.back() * (mu - (2.0 * j - 1) * (2.0 * j - 1)) / (8.0 * j));
  Value z2 = mul(b, z, z);
  Value P, Q;
  for (int j = kHankelTerms - 1; j >= 0; --j) {
    double cf = a[j] * (((j / 2) % 2) ? -1.0 : 1.0);
    Value& acc = (j % 2 == 0) ? P : Q;
    acc = acc.valid() ? add(b, mul(b, acc, z2), k(b, cf, x)) : k(b, cf, x);
  }
  Q = mul(b, Q, z);
  // cos/sin of x - (nu/2 + 1/4) pi without rounding the shifted argument.
  double phi = (nu / 2.0 + 0.25) * M_PI;
  Value cx = un(b, "cosine", x), sx = un(b, "sine", x);
  Value c = add(b, mul(b, cx, k(b, std::cos(phi), x)), mul(b, sx, k(b, std::sin(phi), x)));
  Value s = sub(b, mul(b, sx, k(b, std::cos(phi), x)), mul(b, cx, k(b, std::sin(phi), x)));
  Value amp = un(b, "sqrt", div(b, k(b, 2 / M_PI, x), x));
  return {mul(b, amp, sub(b, mul(b, P, c), mul(b, Q, s))), mul(b, amp, add(b, mul(b, P, s), mul(b, Q, c)))};
}

Value besselJ(ir::Builder& b, const Value& x, int nu) {
  Value ax = un(b, "abs", x);
  Value small = cmp(b, ax, kHankelSplit, ir::Cmp::LE);
  Value ser = besselSeries(b, clampTo(b, ax, 0, kHankelSplit), nu, -1);
  Value big = hankel(b, clampTo(b, ax, kHankelSplit, INFINITY), nu).first;
  Value r = b.select(small, ser, big);
  // PyTorch's CPU kernels give nan at +-inf.
  r = b.select(cmp(b, ax, INFINITY, ir::Cmp::EQ), k(b, NAN, x), r);
  if (nu == 1) r = b.select(cmp(b, x, 0, ir::Cmp::LT), b.unary("negate", r), r);
  return r;
}

Value besselY(ir::Builder& b, const Value& x, int nu) {
  Value small = cmp(b, x, kHankelSplit, ir::Cmp::LE);
  Value ser = ySeries(b, clampTo(b, x, 1e-300, kHankelSplit), nu);
  Value big = hankel(b, clampTo(b, x, kHankelSplit, INFINITY), nu).second;
  Value r = b.select(small, ser, big);
  r = b.select(cmp(b, x, INFINITY, ir::Cmp::EQ), k(b, NAN, x), r);
  r = b.select(cmp(b, x, 0, ir::Cmp::EQ), k(b, -INFINITY, x), r);
  r = b.select(cmp(b, x, 0, ir::Cmp::LT), k(b, NAN, x), r);
  return b.select(b.compare(x, x, ir::Cmp::NE), x, r);
}

// exp(x) K_nu(x) for x >= 2 by the trapezoidal rule in t. The integrand
// narrows like exp(-x t^2 / 2), so the step shrinks like 1/sqrt(x).
Value kScaledTrapezoid(ir::Builder& b, const Value& x, double nu) {
  const int n = 24;
  Value h = b.binary("minimum", k(b, 0.25, x), div(b, k(b, 0.6, x), un(b, "sqrt", x)));
  Value acc = k(b, 0.5, x);
  Value half = k(b, 0.5, x);
  for (int j = 1; j <= n; ++j) {
    Value t = mul(b, h, k(b, j, x));
    Value et = un(b, "exponential", t), emt = un(b, "exponential", b.unary("negate", t));
    Value cosh_m1 = sub(b, mul(b, half, add(b, et, emt)), k(b, 1, x));
    Value w = un(b, "exponential", b.unary("negate", mul(b, x, cosh_m1)));
    if (nu != 0) {
      Value ent = un(b, "exponential", mul(b, t, k(b, nu, x)));
      w = mul(b, w, mul(b, half, add(b, ent, div(b, k(b, 1, x), ent))));
    }
    acc = add(b, acc, w);
  }
  return mul(b, acc, h);
}

const double kKSplit = 2.0;

// K_nu(x) (scaled: exp(x) K_nu(x)) for nu in {0, 1}.
Value besselK(ir::Builder& b, const Value& x, int nu, bool scaled) {
  Value small = cmp(b, x, kKSplit, ir::Cmp::LE);
  Value xs = clampTo(b, x, 1e-300, kKSplit);
  Value lg = un(b, "log", mul(b, xs, k(b, 0.5, x)));
  Value acc = psiSeries(b, xs, nu, 1, 30);
  Value i = besselSeries(b, xs, nu, 1);
  Value ser = nu == 0 ? sub(b, mul(b, acc, k(b, 0.5, x)), mul(b, lg, i))
                      : sub(b, add(b, div(b, k(b, 1, x), xs), mul(b, lg, i)), mul(b, mul(b, xs, k(b, 0.25, x)), acc));
  Value xl = clampTo(b, x, kKSplit, INFINITY);
  Value big = kScaledTrapezoid(b, xl, nu);
  Value r = scaled ? b.select(small, mul(b, ser, un(b, "exponential", xs)), big)
                   : b.select(small, ser, mul(b, big, un(b, "exponential", b.unary("negate", xl))));
  r = b.select(cmp(b, x, INFINITY, ir::Cmp::EQ), k(b, 0, x), r);
  r = b.select(cmp(b, x, 0, ir::Cmp::EQ), k(b, INFINITY, x), r);
  r = b.select(cmp(b, x, 0, ir::Cmp::LT), k(b, NAN, x), r);
  return b.select(b.compare(x, x, ir::Cmp::NE), x, r);
}

// Ai(x): Maclaurin series on [-7, 2], (1/pi) sqrt(x/3) K_{1/3}(zeta) above,
// the oscillatory asymptotic expansion below, zeta = 2/3 |x|^(3/2).
Value airyAi(ir::Builder& b, const Value& x) {
  const double c1 = 0.355028053887817239;  // Ai(0)
  const double c2 = 0.258819403792806798;  // -Ai'(0)
  const double lo = -7, hi = 2;
  Value xm = clampTo(b, x, lo, hi);
  Value x3 = mul(b, mul(b, xm, xm), xm);
  Value t = k(b, 1, x), u = xm, f = t, g = u;
  for (int j = 1; j < kSeriesTerms; ++j) {
    t = mul(b, t, mul(b, x3, k(b, 1.0 / ((3.0 * j - 1) * (3.0 * j)), x)));
    u = mul(b, u, mul(b, x3, k(b, 1.0 / ((3.0 * j) * (3.0 * j + 1)), x)));
    f = add(b, f, t);
    g = add(b, g, u);
  }
  Value mid = sub(b, mul(b, f, k(b, c1, x)), mul(b, g, k(b, c2, x)));

  Value xp = clampTo(b, x, hi, INFINITY);
  Value zp = mul(b, k(b, 2.0 / 3, x), mul(b, xp, un(b, "sqrt", xp)));
  Value pos = mul(b, mul(b, un(b, "sqrt", mul(b, xp, k(b, 1.0 / 3, x))), k(b, 1 / M_PI, x)),
                  mul(b, un(b, "exponential", b.unary("negate", zp)), kScaledTrapezoid(b, zp, 1.0 / 3)));

  Value xn = b.unary("negate", clampTo(b, x, -INFINITY, lo));
  Value zn = mul(b, k(b, 2.0 / 3, x), mul(b, xn, un(b, "sqrt", xn)));
  std::vector<double> uk{1.0};
  for (int j = 1; j < kHankelTerms; ++j)
    uk.push_back(uk.back() * (6.0 * j - 5) * (6.0 * j - 3) * (6.0 * j - 1) / ((2.0 * j - 1) * 216.0 * j));
  Value iz = div(b, k(b, 1, x), zn), iz2 = mul(b, iz, iz);
  Value P, Q;
  for (int j = kHankelTerms - 1; j >= 0; --j) {
    double cf = uk[j] * (((j / 2) % 2) ? -1.0 : 1.0);
    Value& acc = (j % 2 == 0) ? P : Q;
    acc = acc.valid() ? add(b, mul(b, acc, iz2), k(b, cf, x)) : k(b, cf, x);
  }
  Q = mul(b, Q, iz);
  Value cz = un(b, "cosine", zn), sz = un(b, "sine", zn);
  Value cph = mul(b, add(b, cz, sz), k(b, M_SQRT1_2, x));  // cos(zeta - pi/4)
  Value sph = mul(b, sub(b, sz, cz), k(b, M_SQRT1_2, x));  // sin(zeta - pi/4)
  Value neg = mul(b, add(b, mul(b, cph, P), mul(b, sph, Q)),
                  mul(b, k(b, 1 / std::sqrt(M_PI), x), un(b, "rsqrt", un(b, "sqrt", xn))));

  Value r = b.select(cmp(b, x, hi, ir::Cmp::GT), pos, b.select(cmp(b, x, lo, ir::Cmp::LT), neg, mid));
  // PyTorch's CPU kernel gives nan at +-inf.
  r = b.select(cmp(b, un(b, "abs", x), INFINITY, ir::Cmp::EQ), k(b, NAN, x), r);
  return b.select(b.compare(x, x, ir::Cmp::NE), x, r);
}

// sin(x) / x, its Taylor series near 0.
Value sphericalJ0(ir::Builder& b, const Value& x) {
  Value x2 = mul(b, x, x);
  Value taylor = add(b, k(b, 1, x), mul(b, x2, add(b, k(b, -1.0 / 6, x), mul(b, x2, k(b, 1.0 / 120, x)))));
  Value small = cmp(b, un(b, "abs", x), 1e-3, ir::Cmp::LT);
  Value xs = b.select(small, k(b, 1, x), x);
  Value r = b.select(small, taylor, div(b, un(b, "sine", xs), xs));
  return b.select(cmp(b, un(b, "abs", x), INFINITY, ir::Cmp::EQ), k(b, 0, x), r);
}

Registrar reg_j0("special_bessel_j0",
                 [](Ctx& c) { return wideUnary(c, [](ir::Builder& b, const Value& x) { return besselJ(b, x, 0); }); });
Registrar reg_j1("special_bessel_j1",
                 [](Ctx& c) { return wideUnary(c, [](ir::Builder& b, const Value& x) { return besselJ(b, x, 1); }); });
Registrar reg_y0("special_bessel_y0",
                 [](Ctx& c) { return wideUnary(c, [](ir::Builder& b, const Value& x) { return besselY(b, x, 0); }); });
Registrar reg_y1("special_bessel_y1",
                 [](Ctx& c) { return wideUnary(c, [](ir::Builder& b, const Value& x) { return besselY(b, x, 1); }); });
Registrar reg_k0("special_modified_bessel_k0", [](Ctx& c) {
  return wideUnary(c, [](ir::Builder& b, const Value& x) { return besselK(b, x, 0, false); });
});
Registrar reg_k1("special_modified_bessel_k1", [](Ctx& c) {
  return wideUnary(c, [](ir::Builder& b, const Value& x) { return besselK(b, x, 1, false); });
});
Registrar reg_k0e("special_scaled_modified_bessel_k0", [](Ctx& c) {
  return wideUnary(c, [](ir::Builder& b, const Value& x) { return besselK(b, x, 0, true); });
});
Registrar reg_k1e("special_scaled_modified_bessel_k1", [](Ctx& c) {
  return wideUnary(c, [](ir::Builder& b, const Value& x) { return besselK(b, x, 1, true); });
});
Registrar reg_airy("special_airy_ai", [](Ctx& c) { return wideUnary(c, airyAi); });
Registrar reg_sj0("special_spherical_bessel_j0", [](Ctx& c) { return wideUnary(c, sphericalJ0); });

}  // namespace
}  // namespace tpu::ops
