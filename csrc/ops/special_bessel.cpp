// Bessel-family special functions: special_bessel_{j0,j1,y0,y1},
// special_modified_bessel_{k0,k1}, special_scaled_modified_bessel_{k0,k1},
// special_spherical_bessel_j0 and special_airy_ai.
//
// Below a split point: float32 evaluates Chebyshev expansions (fitted for
// this file to float64 precision; Clenshaw's recurrence keeps float32
// rounding at the size of the function), float64 the power series (their
// cancellation stays far below its tolerance). Above it: Hankel's asymptotic
// expansions for J and Y and for K (and Ai on the positive axis, through
// K_{1/3}) the trapezoidal rule on K_nu(x) = int_0^inf exp(-x cosh t)
// cosh(nu t) dt, which converges geometrically and sums positive terms only.
#include <cmath>

#include "ops/common.h"

namespace tpu::ops {
namespace {

const double kEulerGamma = 0.57721566490153286061;
// Series below, Hankel expansion above (float64 error about 1e-10 at worst).
const double kHankelSplit = 12.0;
const int kSeriesTerms = 45;
const int kHankelTerms = 20;

// Chebyshev coefficients on [0, 12] in t = 2 (x/12)^2 - 1 of J0(x), J1(x)/x,
// Y0(x) - (2/pi) log(x) J0(x) and (Y1(x) - (2/pi) log(x) J1(x) + 2/(pi x))/x,
// and of Ai(x) on [-7, 2] in t = (2x + 5)/9: interpolants at 21 (37)
// Chebyshev nodes of 40-digit mpmath values; truncation below 1e-14.
const double kJ0Cheb[] = {0.022693993532219039,    -0.15310791469670965,    0.11797479223272855,
                          -0.026343564308738986,   0.25581502063493794,     -0.2622140996006978,
                          0.12087152677762086,     -0.033585400670970031,   0.0063917319975760421,
                          -0.00089594187822274456, 9.6994062814126242e-05,  -8.3881658907716819e-06,
                          5.9438673514413444e-07,  -3.5203583263573967e-08, 1.7708922246229791e-09,
                          -7.6673817270856432e-11, 2.8894152525473545e-12,  -9.5732031008077677e-14,
                          2.901734743522803e-15,   -3.603151269543877e-16,  -2.0034712156860294e-16};
const double kJ1Cheb[] = {0.049623975440286933,    -0.11314165454218229,    0.09074195561964557,
                          -0.10003334429410139,    0.086351361568189039,    -0.043185561930782011,
                          0.013514111679106329,    -0.0028950530049080929,  0.00045312252928460549,
                          -5.4283228207768799e-05, 5.1515901731077542e-06,  -3.976377552556524e-07,
                          2.5488795499280188e-08,  -1.379931829583177e-09,  6.3985159716667881e-11,
                          -2.5711642170255121e-12, 9.0476347089123616e-14,  -2.8840515387628201e-15,
                          1.1277179562368394e-16,  -1.2770294509847858e-16, -3.4457327338454608e-17};
const double kY0Cheb[] = {0.046284855562038853,    -0.11247673554895218,    -0.042166379994412376,
                          -0.29986311629349238,    -0.025897221251419376,   0.24752063669919055,
                          -0.15489079617415688,    0.049809331999403746,    -0.010393559057977045,
                          0.0015564818428383351,   -0.0001773568897424767,  1.5989768253613662e-05,
                          -1.1733497814448506e-06, 7.1616591961050488e-08,  -3.6989205081427304e-09,
                          1.6395232524059246e-10,  -6.3100621522051956e-12, 2.1279868679831669e-13,
                          -6.2803888141074825e-15, 2.3060315245281524e-16,  6.6282108874108212e-17};
const double kY1Cheb[] = {0.017458756103888626,    0.016465886602902151,    -0.0031887822377224114,
                          0.038844525430241771,    -0.07767765157752618,    0.052611611384192569,
                          -0.019283177043011905,   0.0045681626452271683,   -0.0007682997514164337,
                          9.7270630427954058e-05,  -9.6520275238240878e-06, 7.7325996544098834e-07,
                          -5.1170473050011349e-08, 2.8483650498677229e-09,  -1.3536476930490257e-10,
                          5.5607098847981555e-12,  -1.9957981406048502e-13, 6.3375009456692222e-15,
                          -2.0217459087707927e-16, 6.5143879904509276e-17,  5.593572498799606e-17};
const double kAiCheb[] = {
    0.077864761403660693,    0.11804166182338981,     -0.062485224879235857,   -0.154784144621744,
    -0.032881533802180049,   0.026925696942204619,    0.20540727786666618,     -0.15443477027289795,
    -0.06448873004738323,    0.11424538901789673,     -0.028771292490740591,   -0.024547293898254153,
    0.018086693904449804,    -0.0012902102769986761,  -0.0032484289127861022,  0.0013800855507600555,
    6.7245022376196555e-05,  -0.00022593008287906863, 6.0947322929901425e-05,  9.7423914654505478e-06,
    -9.7592402018214467e-06, 1.6923002211625339e-06,  5.0247647517569799e-07,  -2.873272966388799e-07,
    2.9982811562793003e-08,  1.5833317117815022e-08,  -6.1184330900166328e-09, 2.9961634934763767e-10,
    3.4964957627733426e-10,  -9.8133284592506368e-11, -2.2333887682987409e-14, 5.7873860067994442e-12,
    -1.2195573507446879e-12, -5.9225736577520337e-14, 7.5011977070992525e-14,  -1.1827383937337873e-14,
    -1.3006665687565189e-15};

Value k(ir::Builder& b, double v, const Value& like) { return full(b, v, like); }
Value cmp(ir::Builder& b, const Value& x, double v, ir::Cmp d) { return b.compare(x, k(b, v, x), d); }
Value un(ir::Builder& b, const char* op, const Value& x) { return b.unary(op, x); }
// x limited to [lo, hi] so that a branch not taken stays finite.
Value clampTo(ir::Builder& b, const Value& x, double lo, double hi) { return b.clamp(k(b, lo, x), x, k(b, hi, x)); }

bool isF32(const Value& x) { return x.dtype() == DType::F32; }
// The smallest positive normal number: a floor for logarithms.
double tinyOf(const Value& x) { return isF32(x) ? 1.1754944e-38 : 2.2250738585072014e-308; }

template <size_t N>
Value clenshaw(ir::Builder& b, const Value& t, const double (&c)[N]) {
  Value b1 = k(b, 0, t), b2 = k(b, 0, t);
  Value t2 = add(b, t, t);
  for (size_t i = N - 1; i >= 1; --i) {
    Value nb = add(b, sub(b, mul(b, t2, b1), b2), k(b, c[i], t));
    b2 = b1;
    b1 = nb;
  }
  return add(b, sub(b, mul(b, t, b1), b2), k(b, c[0], t));
}

// The even-function variable 2 (x/12)^2 - 1 for 0 <= x <= 12.
Value evenArg(ir::Builder& b, const Value& x) {
  Value u = mul(b, x, k(b, 1.0 / 12, x));
  return sub(b, mul(b, mul(b, u, u), k(b, 2, x)), k(b, 1, x));
}

using Fn = std::function<Value(ir::Builder&, const Value&)>;

std::vector<Value> besselUnary(Ctx& c, const Fn& f) {
  Value x = c.tensor(0);
  if (ir::isComplex(x.dtype())) throw ir::Unsupported("complex Bessel function");
  DType out = outType(c, floatOf(x.dtype()));
  // PyTorch has no half-precision kernels for these: the CPU raises.
  if (out == DType::F16 || out == DType::BF16) throw ir::Unsupported("Bessel function in half precision");
  return {c.b.convert(f(c.b, c.b.convert(x, out)), out)};
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

// Y_nu(x) for 0 < x <= 12 in float32: the logarithmic part plus a fit.
Value yCheb(ir::Builder& b, const Value& x, int nu) {
  Value t = evenArg(b, x);
  Value l = mul(b, un(b, "log", x), k(b, 2 / M_PI, x));
  if (nu == 0) return add(b, mul(b, l, clenshaw(b, t, kJ0Cheb)), clenshaw(b, t, kY0Cheb));
  Value j1 = mul(b, x, clenshaw(b, t, kJ1Cheb));
  return add(b, sub(b, mul(b, l, j1), div(b, k(b, 2 / M_PI, x), x)), mul(b, x, clenshaw(b, t, kY1Cheb)));
}

// The even and odd halves of an asymptotic series sum_j a_j (-1)^(j/2) z^j, as {P, Q}: both in
// Horner form over z^2 (Hankel's P and Q for the Bessel functions, the Airy function's for
// negative x), the signs folded into the coefficients. `like` gives the constants' dtype and shape.
std::pair<Value, Value> asymptoticPQ(ir::Builder& b, const std::vector<double>& a, const Value& z, const Value& like) {
  Value z2 = mul(b, z, z);
  Value P, Q;
  for (int j = static_cast<int>(a.size()) - 1; j >= 0; --j) {
    double cf = a[j] * (((j / 2) % 2) ? -1.0 : 1.0);
    Value& acc = (j % 2 == 0) ? P : Q;
    acc = acc.valid() ? add(b, mul(b, acc, z2), k(b, cf, like)) : k(b, cf, like);
  }
  return {P, mul(b, Q, z)};
}

// Hankel's expansions for large x > 0: {J_nu(x), Y_nu(x)}.
std::pair<Value, Value> hankel(ir::Builder& b, const Value& x, int nu) {
  double mu = 4.0 * nu * nu;
  std::vector<double> a{1.0};
  for (int j = 1; j < kHankelTerms; ++j) a.push_back(a.back() * (mu - (2.0 * j - 1) * (2.0 * j - 1)) / (8.0 * j));
  auto [P, Q] = asymptoticPQ(b, a, div(b, k(b, 1, x), x), x);
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
  Value xs = clampTo(b, ax, 0, kHankelSplit);
  Value ser = !isF32(x) ? besselSeries(b, xs, nu, -1)
              : nu == 0 ? clenshaw(b, evenArg(b, xs), kJ0Cheb)
                        : mul(b, xs, clenshaw(b, evenArg(b, xs), kJ1Cheb));
  Value big = hankel(b, clampTo(b, ax, kHankelSplit, INFINITY), nu).first;
  Value r = b.select(small, ser, big);
  // PyTorch's CPU kernels give nan at +-inf.
  r = b.select(cmp(b, ax, INFINITY, ir::Cmp::EQ), k(b, NAN, x), r);
  if (nu == 1) r = b.select(cmp(b, x, 0, ir::Cmp::LT), b.unary("negate", r), r);
  return r;
}

Value besselY(ir::Builder& b, const Value& x, int nu) {
  Value small = cmp(b, x, kHankelSplit, ir::Cmp::LE);
  Value ser = isF32(x) ? yCheb(b, clampTo(b, x, tinyOf(x), kHankelSplit), nu)
                       : ySeries(b, clampTo(b, x, tinyOf(x), kHankelSplit), nu);
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
    // cosh(t) - 1 = 2 sinh(t/2)^2, sinh from expm1 (no cancellation).
    Value th = mul(b, t, half);
    Value sh =
        mul(b, half, sub(b, un(b, "exponential_minus_one", th), un(b, "exponential_minus_one", b.unary("negate", th))));
    Value cosh_m1 = mul(b, k(b, 2, x), mul(b, sh, sh));
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
  // float32 moves the split down to 1, where the series barely cancels.
  double split = isF32(x) ? 1.0 : kKSplit;
  Value small = cmp(b, x, split, ir::Cmp::LE);
  Value xs = clampTo(b, x, tinyOf(x), split);
  Value lg = un(b, "log", mul(b, xs, k(b, 0.5, x)));
  Value acc = psiSeries(b, xs, nu, 1, 30);
  Value i = besselSeries(b, xs, nu, 1);
  Value ser = nu == 0 ? sub(b, mul(b, acc, k(b, 0.5, x)), mul(b, lg, i))
                      : sub(b, add(b, div(b, k(b, 1, x), xs), mul(b, lg, i)), mul(b, mul(b, xs, k(b, 0.25, x)), acc));
  Value xl = clampTo(b, x, split, INFINITY);
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
  Value mid;
  if (isF32(x)) {
    mid = clenshaw(b, mul(b, add(b, mul(b, xm, k(b, 2, x)), k(b, 5, x)), k(b, 1.0 / 9, x)), kAiCheb);
  } else {
    Value x3 = mul(b, mul(b, xm, xm), xm);
    Value t = k(b, 1, x), u = xm, f = t, g = u;
    for (int j = 1; j < kSeriesTerms; ++j) {
      t = mul(b, t, mul(b, x3, k(b, 1.0 / ((3.0 * j - 1) * (3.0 * j)), x)));
      u = mul(b, u, mul(b, x3, k(b, 1.0 / ((3.0 * j) * (3.0 * j + 1)), x)));
      f = add(b, f, t);
      g = add(b, g, u);
    }
    mid = sub(b, mul(b, f, k(b, c1, x)), mul(b, g, k(b, c2, x)));
  }

  Value xp = clampTo(b, x, hi, INFINITY);
  Value zp = mul(b, k(b, 2.0 / 3, x), mul(b, xp, un(b, "sqrt", xp)));
  Value pos = mul(b, mul(b, un(b, "sqrt", mul(b, xp, k(b, 1.0 / 3, x))), k(b, 1 / M_PI, x)),
                  mul(b, un(b, "exponential", b.unary("negate", zp)), kScaledTrapezoid(b, zp, 1.0 / 3)));

  Value xn = b.unary("negate", clampTo(b, x, -INFINITY, lo));
  Value zn = mul(b, k(b, 2.0 / 3, x), mul(b, xn, un(b, "sqrt", xn)));
  std::vector<double> uk{1.0};
  for (int j = 1; j < kHankelTerms; ++j)
    uk.push_back(uk.back() * (6.0 * j - 5) * (6.0 * j - 3) * (6.0 * j - 1) / ((2.0 * j - 1) * 216.0 * j));
  auto [P, Q] = asymptoticPQ(b, uk, div(b, k(b, 1, x), zn), x);
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

Registrar reg_j0("special_bessel_j0", [](Ctx& c) {
  return besselUnary(c, [](ir::Builder& b, const Value& x) { return besselJ(b, x, 0); });
});
Registrar reg_j1("special_bessel_j1", [](Ctx& c) {
  return besselUnary(c, [](ir::Builder& b, const Value& x) { return besselJ(b, x, 1); });
});
Registrar reg_y0("special_bessel_y0", [](Ctx& c) {
  return besselUnary(c, [](ir::Builder& b, const Value& x) { return besselY(b, x, 0); });
});
Registrar reg_y1("special_bessel_y1", [](Ctx& c) {
  return besselUnary(c, [](ir::Builder& b, const Value& x) { return besselY(b, x, 1); });
});
Registrar reg_k0("special_modified_bessel_k0", [](Ctx& c) {
  return besselUnary(c, [](ir::Builder& b, const Value& x) { return besselK(b, x, 0, false); });
});
Registrar reg_k1("special_modified_bessel_k1", [](Ctx& c) {
  return besselUnary(c, [](ir::Builder& b, const Value& x) { return besselK(b, x, 1, false); });
});
Registrar reg_k0e("special_scaled_modified_bessel_k0", [](Ctx& c) {
  return besselUnary(c, [](ir::Builder& b, const Value& x) { return besselK(b, x, 0, true); });
});
Registrar reg_k1e("special_scaled_modified_bessel_k1", [](Ctx& c) {
  return besselUnary(c, [](ir::Builder& b, const Value& x) { return besselK(b, x, 1, true); });
});
Registrar reg_airy("special_airy_ai", [](Ctx& c) { return besselUnary(c, airyAi); });
Registrar reg_sj0("special_spherical_bessel_j0", [](Ctx& c) { return besselUnary(c, sphericalJ0); });

}  // namespace
}  // namespace tpu::ops
