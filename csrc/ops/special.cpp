// Special functions: log-gamma and its derivatives, inverse error function,
// modified Bessel functions, normal-distribution helpers and small
// elementwise extras (sinc, entr, heaviside, logaddexp2, ...). Low-precision
// floats compute in float32 and round once, like PyTorch's CPU kernels.
#include <cmath>

#include "ops/common.h"

namespace tpu::ops {
namespace {

using Fn1 = std::function<Value(ir::Builder&, const Value&)>;
using Fn2 = std::function<Value(ir::Builder&, const Value&, const Value&)>;

std::vector<Value> floatUnary(Ctx& c, const Fn1& f) {
  Value x = c.tensor(0);
  if (ir::isComplex(x.dtype())) throw ir::Unsupported("complex special function");
  DType out = outType(c, floatOf(x.dtype()));
  DType comp = accOf(out);
  return {c.b.convert(f(c.b, c.b.convert(x, comp)), out)};
}

std::vector<Value> floatBinary(Ctx& c, const Fn2& f) {
  DType t = resultType(c, {0, 1});
  DType out = outType(c, floatOf(t));
  if (ir::isComplex(out)) throw ir::Unsupported("complex special function");
  DType comp = accOf(out);
  auto vs = broadcastAll(c.b, {c.b.convert(c.tensor(0), comp), c.b.convert(c.tensor(1), comp)});
  return {c.b.convert(f(c.b, vs[0], vs[1]), out)};
}

Value k(ir::Builder& b, double v, const Value& like) { return full(b, v, like); }
Value lt(ir::Builder& b, const Value& x, double v) { return b.compare(x, k(b, v, x), ir::Cmp::LT); }
Value eq(ir::Builder& b, const Value& x, double v) { return b.compare(x, k(b, v, x), ir::Cmp::EQ); }
Value neg(ir::Builder& b, const Value& x) { return b.unary("negate", x); }
Value poly(ir::Builder& b, const Value& x, std::initializer_list<double> coeffs) {
  Value p;
  for (double cf : coeffs) p = p.valid() ? add(b, mul(b, p, x), k(b, cf, x)) : k(b, cf, x);
  return p;
}

// --- log-gamma and digamma (Lanczos, g = 7, as XLA does)

const double kLanczosG = 7;
const double kLanczosBase = 0.99999999999980993227684700473478;
const double kLanczosCoef[] = {676.520368121885098567009190444019, -1259.13921672240287047156078755283,
                               771.3234287776530788486528258894,   -176.61502916214059906584551354,
                               12.507343278686904814458936853,     -0.13857109526572011689554707,
                               9.984369578019570859563e-6,         1.50563273514931155834e-7};

Value lgamma(ir::Builder& b, const Value& x) {
  Value reflect = lt(b, x, 0.5);
  Value z = b.select(reflect, neg(b, x), sub(b, x, k(b, 1, x)));
  Value acc = k(b, kLanczosBase, x);
  for (int i = 0; i < 8; ++i) acc = add(b, acc, div(b, k(b, kLanczosCoef[i], x), add(b, z, k(b, i + 1, x))));
  double gh = kLanczosG + 0.5;
  Value t = add(b, z, k(b, gh, x));
  Value log_t = add(b, k(b, std::log(gh), x), b.unary("log_plus_one", div(b, z, k(b, gh, x))));
  Value log_y = add(b, add(b, k(b, 0.5 * std::log(2 * M_PI), x), sub(b, mul(b, add(b, z, k(b, 0.5, x)), log_t), t)),
                    b.unary("log", acc));
  Value ax = b.unary("abs", x);
  Value frac = sub(b, ax, b.unary("floor", ax));
  Value red = b.select(b.compare(frac, k(b, 0.5, x), ir::Cmp::GT), sub(b, k(b, 1, x), frac), frac);
  Value denom = b.unary("log", b.unary("sine", mul(b, k(b, M_PI, x), red)));
  Value refl =
      b.select(b.unary("is_finite", denom), sub(b, sub(b, k(b, std::log(M_PI), x), denom), log_y), neg(b, denom));
  Value r = b.select(reflect, refl, log_y);
  return b.select(b.compare(ax, k(b, INFINITY, x), ir::Cmp::EQ), k(b, INFINITY, x), r);
}

Value digamma(ir::Builder& b, const Value& x) {
  Value reflect = lt(b, x, 0.5);
  Value z = b.select(reflect, neg(b, x), sub(b, x, k(b, 1, x)));
  Value num = k(b, 0, x), den = k(b, kLanczosBase, x);
  for (int i = 0; i < 8; ++i) {
    Value zi = add(b, z, k(b, i + 1, x));
    Value ci = k(b, kLanczosCoef[i], x);
    num = sub(b, num, div(b, ci, mul(b, zi, zi)));
    den = add(b, den, div(b, ci, zi));
  }
  double gh = kLanczosG + 0.5;
  Value t = add(b, z, k(b, gh, x));
  Value log_t = add(b, k(b, std::log(gh), x), b.unary("log_plus_one", div(b, z, k(b, gh, x))));
  Value y = sub(b, add(b, log_t, div(b, num, den)), div(b, k(b, kLanczosG, x), t));
  Value red = add(b, x, b.unary("abs", b.unary("floor", add(b, x, k(b, 0.5, x)))));
  Value pr = mul(b, k(b, M_PI, x), red);
  Value refl = sub(b, y, div(b, mul(b, k(b, M_PI, x), b.unary("cosine", pr)), b.unary("sine", pr)));
  Value r = b.select(reflect, refl, y);
  Value nonpos_int =
      b.binary("and", b.compare(x, k(b, 0, x), ir::Cmp::LE), b.compare(x, b.unary("floor", x), ir::Cmp::EQ));
  r = b.select(nonpos_int, k(b, NAN, x), r);
  r = b.select(eq(b, x, 0), k(b, -INFINITY, x), r);
  return b.select(b.compare(x, k(b, INFINITY, x), ir::Cmp::EQ), k(b, INFINITY, x), r);
}

// PyTorch's trigamma (reflection, six recurrence steps, asymptotic tail).
Value trigamma(ir::Builder& b, const Value& x0) {
  Value reflect = lt(b, x0, 0.5);
  Value sinpx = b.unary("sine", mul(b, k(b, M_PI, x0), x0));
  Value refl_term = neg(b, div(b, k(b, M_PI * M_PI, x0), mul(b, sinpx, sinpx)));
  Value x = b.select(reflect, sub(b, k(b, 1, x0), x0), x0);
  Value r = k(b, 0, x0);
  for (int i = 0; i < 6; ++i) {
    r = add(b, r, div(b, k(b, 1, x), mul(b, x, x)));
    x = add(b, x, k(b, 1, x));
  }
  Value ixx = div(b, k(b, 1, x), mul(b, x, x));
  Value tail = sub(b, k(b, 1.0 / 30, x), mul(b, ixx, k(b, 1.0 / 42, x)));
  tail = sub(b, k(b, 1.0 / 6, x), mul(b, ixx, tail));
  tail = add(b, add(b, k(b, 1, x), div(b, k(b, 1, x), mul(b, k(b, 2, x), x))), mul(b, ixx, tail));
  r = add(b, r, div(b, tail, x));
  return b.select(reflect, neg(b, add(b, refl_term, r)), r);
}

// Hurwitz zeta(s, q) (Cephes: direct sum of 9 terms, Euler-Maclaurin tail).
Value zeta(ir::Builder& b, const Value& s, const Value& q) {
  const double A[] = {12.0,
                      -720.0,
                      30240.0,
                      -1209600.0,
                      47900160.0,
                      -1.8924375803183791606e9,
                      7.47242496e10,
                      -2.950130727918164224e12,
                      1.1646782814350067249e14,
                      -4.5979787224074726105e15,
                      1.8152105401943546773e17,
                      -7.1661652561756670113e18};
  auto pw = [&](const Value& a) { return b.binary("power", a, neg(b, s)); };
  Value sum = pw(q);
  Value a = q;
  Value term;
  // Cephes sums while (i < 9 || a <= 9): the first 9 terms always, then
  // more while a <= 9 (negative q), masked here up to q > -30.
  for (int i = 1; i <= 40; ++i) {
    Value an = add(b, a, k(b, 1, q));
    Value tn = pw(an);
    if (i <= 9) {
      a = an;
      term = tn;
      sum = add(b, sum, tn);
    } else {
      Value more = b.compare(a, k(b, 9, q), ir::Cmp::LE);
      a = b.select(more, an, a);
      term = b.select(more, tn, term);
      sum = b.select(more, add(b, sum, tn), sum);
    }
  }
  Value w = a;
  sum = add(b, sum, div(b, mul(b, term, w), sub(b, s, k(b, 1, q))));
  sum = sub(b, sum, mul(b, k(b, 0.5, q), term));
  Value fa = k(b, 1, q), kk = k(b, 0, q);
  for (int i = 0; i < 12; ++i) {
    fa = mul(b, fa, add(b, s, kk));
    term = div(b, term, w);
    sum = add(b, sum, div(b, mul(b, fa, term), k(b, A[i], q)));
    kk = add(b, kk, k(b, 1, q));
    fa = mul(b, fa, add(b, s, kk));
    term = div(b, term, w);
    kk = add(b, kk, k(b, 1, q));
  }
  Value r = sum;
  Value qint = b.compare(q, b.unary("floor", q), ir::Cmp::EQ);
  Value sint = b.compare(s, b.unary("floor", s), ir::Cmp::EQ);
  Value qle0 = b.compare(q, k(b, 0, q), ir::Cmp::LE);
  r = b.select(b.binary("and", qle0, qint), k(b, INFINITY, q), r);
  r = b.select(b.binary("and", qle0, b.unary("not", sint)), k(b, NAN, q), r);
  r = b.select(lt(b, s, 1), k(b, NAN, q), r);
  return b.select(eq(b, s, 1), k(b, INFINITY, q), r);
}

Registrar reg_lgamma("lgamma", [](Ctx& c) { return floatUnary(c, lgamma); });
Registrar reg_digamma("digamma", [](Ctx& c) { return floatUnary(c, digamma); });
Registrar reg_special_digamma("special_digamma", [](Ctx& c) { return floatUnary(c, digamma); });
Registrar reg_special_psi("special_psi", [](Ctx& c) { return floatUnary(c, digamma); });
Registrar reg_special_gammaln("special_gammaln", [](Ctx& c) { return floatUnary(c, lgamma); });

// polygamma(int n, Tensor self)
Registrar reg_polygamma("polygamma", [](Ctx& c) {
  int64_t n = c.i64(0);
  Value x = c.tensor(1);
  if (n < 0) throw ir::Unsupported("polygamma: negative order");
  if (ir::isComplex(x.dtype())) throw ir::Unsupported("complex polygamma");
  DType out = outType(c, floatOf(x.dtype()));
  DType comp = accOf(out);
  ir::Builder& b = c.b;
  Value xx = b.convert(x, comp);
  Value r;
  if (n == 0) {
    r = digamma(b, xx);
  } else if (n == 1) {
    r = trigamma(b, xx);
  } else {
    // (-1)^(n+1) n! zeta(n+1, x)
    double fact = 1;
    for (int64_t i = 2; i <= n; ++i) fact *= i;
    double sgn = (n % 2 == 0) ? -1.0 : 1.0;
    r = mul(b, k(b, sgn * fact, xx), zeta(b, k(b, n + 1.0, xx), xx));
  }
  return std::vector<Value>{b.convert(r, out)};
});

Registrar reg_special_zeta("special_zeta", [](Ctx& c) { return floatBinary(c, zeta); });

// --- inverse error function (Giles' approximations, written in terms of
// w = -log((1 - y)(1 + y)) so ndtri can pass an accurate w).

Value erfinvW(ir::Builder& b, const Value& y, const Value& w0) {
  Value p;
  if (y.dtype() == DType::F64) {
    Value w1 = sub(b, w0, k(b, 3.125, y));
    Value p1 = poly(
        b, w1,
        {-3.6444120640178196996e-21, -1.685059138182016589e-19,  1.2858480715256400167e-18,  1.115787767802518096e-17,
         -1.333171662854620906e-16,  2.0972767875968561637e-17,  6.6376381343583238325e-15,  -4.0545662729752068639e-14,
         -8.1519341976054721522e-14, 2.6335093153082322977e-12,  -1.2975133253453532498e-11, -5.4154120542946279317e-11,
         1.051212273321532285e-09,   -4.1126339803469836976e-09, -2.9070369957882005086e-08, 4.2347877827932403518e-07,
         -1.3654692000834678645e-06, -1.3882523362786468719e-05, 0.0001867342080340571352,   -0.00074070253416626697512,
         -0.0060336708714301490533,  0.24015818242558961693,     1.6536545626831027356});
    Value sw = b.unary("sqrt", w0);
    Value w2 = sub(b, sw, k(b, 3.25, y));
    Value p2 = poly(
        b, w2,
        {2.2137376921775787049e-09, 9.0756561938885390979e-08, -2.7517406297064545428e-07, 1.8239629214389227755e-08,
         1.5027403968909827627e-06, -4.013867526981545969e-06, 2.9234449089955446044e-06, 1.2475304481671778723e-05,
         -4.7318229009055733981e-05, 6.8284851459573175448e-05, 2.4031110387097893999e-05, -0.0003550375203628474796,
         0.00095328937973738049703, -0.0016882755560235047313, 0.0024914420961078508066, -0.0037512085075692412107,
         0.005370914553590063617, 1.0052589676941592334, 3.0838856104922207635});
    Value w3 = sub(b, sw, k(b, 5.0, y));
    Value p3 = poly(
        b, w3,
        {-2.7109920616438573243e-11, -2.5556418169965252055e-10, 1.5076572693500548083e-09, -3.7894654401267369937e-09,
         7.6157012080783393804e-09, -1.4960026627149240478e-08, 2.9147953450901080826e-08, -6.7711997758452339498e-08,
         2.2900482228026654717e-07, -9.9298272942317002539e-07, 4.5260625972231537039e-06, -1.9681778105531670567e-05,
         7.5995277030017761139e-05, -0.00021503011930044477347, -0.00013871931833623122026, 1.0103004648645343977,
         4.8499064014085844221});
    p = b.select(lt(b, w0, 6.25), p1, b.select(lt(b, w0, 16.0), p2, p3));
  } else {
    Value w1 = sub(b, w0, k(b, 2.5, y));
    Value p1 = poly(b, w1,
                    {2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
                     -0.00417768164, 0.246640727, 1.50140941});
    Value w2 = sub(b, b.unary("sqrt", w0), k(b, 3.0, y));
    Value p2 = poly(b, w2,
                    {-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
                     0.00943887047, 1.00167406, 2.83297682});
    p = b.select(lt(b, w0, 5.0), p1, p2);
  }
  return mul(b, p, y);
}

Value erfinv(ir::Builder& b, const Value& y) {
  Value one = k(b, 1, y);
  Value w = neg(b, b.unary("log", mul(b, sub(b, one, y), add(b, one, y))));
  Value r = erfinvW(b, y, w);
  if (y.dtype() != DType::F64) {
    // One Newton step on erf(r) = y where erf is well conditioned.
    Value e = erf(b, r);
    Value d = mul(b, k(b, 2.0 / std::sqrt(M_PI), y), b.unary("exponential", neg(b, mul(b, r, r))));
    Value nr = sub(b, r, div(b, sub(b, e, y), d));
    r = b.select(lt(b, b.unary("abs", y), 0.9), nr, r);
  }
  Value ay = b.unary("abs", y);
  r = b.select(eq(b, ay, 1), mul(b, y, k(b, INFINITY, y)), r);
  return b.select(b.compare(ay, one, ir::Cmp::GT), k(b, NAN, y), r);
}

Registrar reg_erfinv("erfinv", [](Ctx& c) { return floatUnary(c, erfinv); });

// ndtri(p) = sqrt(2) erfinv(2p - 1), with w = -log(4 p (1 - p)) computed
// from p directly (no cancellation in 1 - (2p - 1)).
Value ndtri(ir::Builder& b, const Value& p) {
  Value y = sub(b, mul(b, k(b, 2, p), p), k(b, 1, p));
  Value w = neg(b, b.unary("log", mul(b, mul(b, k(b, 4, p), p), sub(b, k(b, 1, p), p))));
  Value r = mul(b, k(b, M_SQRT2, p), erfinvW(b, y, w));
  r = b.select(eq(b, p, 0), k(b, -INFINITY, p), r);
  r = b.select(eq(b, p, 1), k(b, INFINITY, p), r);
  Value bad = b.binary("or", lt(b, p, 0), b.compare(p, k(b, 1, p), ir::Cmp::GT));
  return b.select(bad, k(b, NAN, p), r);
}
Registrar reg_special_ndtri("special_ndtri", [](Ctx& c) { return floatUnary(c, ndtri); });

// --- modified Bessel functions I0, I1 (power series for |x| <= 15, the
// asymptotic expansion of exp(-|x|) I_nu(|x|) beyond).

const double kBesselSplit = 15.0;

// exp(-|x|) I_nu(|x|) for nu in {0, 1}.
Value besselIe(ir::Builder& b, const Value& x, int nu) {
  Value ax = b.unary("abs", x);
  // Series on the clamped argument.
  Value xs = b.select(b.compare(ax, k(b, kBesselSplit, x), ir::Cmp::GT), k(b, kBesselSplit, x), ax);
  Value q = mul(b, mul(b, xs, xs), k(b, 0.25, x));
  // Nested (Horner) form of sum_j q^j / (j! (j + nu)!), times (x/2)^nu.
  int nterms = x.dtype() == DType::F64 ? 40 : 26;
  Value sum = k(b, 1, x);
  for (int j = nterms; j >= 1; --j)
    sum = add(b, k(b, 1, x), mul(b, sum, mul(b, q, k(b, 1.0 / (double(j) * (j + nu)), x))));
  if (nu == 1) sum = mul(b, sum, mul(b, xs, k(b, 0.5, x)));
  Value series = mul(b, sum, b.unary("exponential", neg(b, xs)));
  // Asymptotic on the clamped-from-below argument.
  Value xa = b.select(lt(b, ax, kBesselSplit), k(b, kBesselSplit, x), ax);
  Value inv8x = div(b, k(b, 0.125, x), xa);
  double mu = 4.0 * nu * nu;
  Value t = k(b, 1, x), s = k(b, 1, x);
  for (int j = 1; j <= 30; ++j) {
    double cj = -(mu - (2.0 * j - 1) * (2.0 * j - 1)) / j;
    t = mul(b, t, mul(b, inv8x, k(b, cj, x)));
    s = add(b, s, t);
  }
  Value asym = mul(b, s, b.unary("rsqrt", mul(b, k(b, 2 * M_PI, x), xa)));
  Value r = b.select(b.compare(ax, k(b, kBesselSplit, x), ir::Cmp::GT), asym, series);
  if (nu == 1) r = b.select(lt(b, x, 0), neg(b, r), r);
  return r;
}

Value besselI(ir::Builder& b, const Value& x, int nu) {
  Value ax = b.unary("abs", x);
  // Below the split the series without the exp(-|x|) factor is exact enough;
  // above it exp(|x|) * the scaled asymptotic.
  Value r = mul(b, besselIe(b, x, nu), b.unary("exponential", ax));
  return r;
}

Registrar reg_i0("i0",
                 [](Ctx& c) { return floatUnary(c, [](ir::Builder& b, const Value& x) { return besselI(b, x, 0); }); });
Registrar reg_special_i0e("special_i0e", [](Ctx& c) {
  return floatUnary(c, [](ir::Builder& b, const Value& x) { return besselIe(b, x, 0); });
});
Registrar reg_special_i1("special_i1", [](Ctx& c) {
  return floatUnary(c, [](ir::Builder& b, const Value& x) { return besselI(b, x, 1); });
});
Registrar reg_special_mbi0("special_modified_bessel_i0", [](Ctx& c) {
  return floatUnary(c, [](ir::Builder& b, const Value& x) { return besselI(b, x, 0); });
});
Registrar reg_special_mbi1("special_modified_bessel_i1", [](Ctx& c) {
  return floatUnary(c, [](ir::Builder& b, const Value& x) { return besselI(b, x, 1); });
});
Registrar reg_special_i1e("special_i1e", [](Ctx& c) {
  return floatUnary(c, [](ir::Builder& b, const Value& x) { return besselIe(b, x, 1); });
});

// --- normal distribution helpers

// erfcx(x) = exp(x^2) erfc(x): continued fraction for x >= 1 (f32) / 2 (f64),
// exp(x^2) (1 - erf(x)) below, 2 exp(x^2) - erfcx(-x) for negative x.
Value erfcxPos(ir::Builder& b, const Value& ax) {
  bool f64 = ax.dtype() == DType::F64;
  double split = f64 ? 2.0 : 1.0;
  int depth = f64 ? 60 : 50;
  Value xc = b.select(lt(b, ax, split), k(b, split, ax), ax);
  // erfcx(x) = 1/sqrt(pi) * 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + ...))))
  Value f = xc;
  for (int n = depth; n >= 1; --n) f = add(b, xc, div(b, k(b, 0.5 * n, ax), f));
  Value cf = div(b, k(b, 1.0 / std::sqrt(M_PI), ax), f);
  Value xs = b.select(lt(b, ax, split), ax, k(b, split, ax));
  Value direct = mul(b, b.unary("exponential", mul(b, xs, xs)), sub(b, k(b, 1, ax), erf(b, xs)));
  return b.select(lt(b, ax, split), direct, cf);
}
Value erfcx(ir::Builder& b, const Value& x) {
  Value ax = b.unary("abs", x);
  Value pos = erfcxPos(b, ax);
  Value negv = sub(b, mul(b, k(b, 2, x), b.unary("exponential", mul(b, x, x))), pos);
  Value r = b.select(lt(b, x, 0), negv, pos);
  return b.select(eq(b, x, INFINITY), k(b, 0, x), r);
}
Registrar reg_special_erfcx("special_erfcx", [](Ctx& c) { return floatUnary(c, erfcx); });

// log_ndtr(x): log(erfcx(-x/sqrt2)/2) - x^2/2 for x < -1, else
// log1p(-erfc(x/sqrt2)/2).
Value logNdtr(ir::Builder& b, const Value& x) {
  Value t = mul(b, x, k(b, M_SQRT1_2, x));
  Value lo = sub(b, b.unary("log", mul(b, erfcx(b, neg(b, t)), k(b, 0.5, x))), mul(b, mul(b, x, x), k(b, 0.5, x)));
  // erfc(t) for t >= -1/sqrt2: exp(-t^2) erfcx(t) keeps relative accuracy.
  Value erfc = mul(b, b.unary("exponential", neg(b, mul(b, t, t))), erfcx(b, t));
  Value hi = b.unary("log_plus_one", mul(b, erfc, k(b, -0.5, x)));
  return b.select(lt(b, x, -1), lo, hi);
}
Registrar reg_special_log_ndtr("special_log_ndtr", [](Ctx& c) { return floatUnary(c, logNdtr); });

// --- small elementwise extras

Registrar reg_sinc("sinc", [](Ctx& c) {
  return floatUnary(c, [](ir::Builder& b, const Value& x) {
    Value px = mul(b, x, k(b, M_PI, x));
    return b.select(eq(b, x, 0), k(b, 1, x), div(b, b.unary("sine", px), px));
  });
});

Registrar reg_special_entr("special_entr", [](Ctx& c) {
  return floatUnary(c, [](ir::Builder& b, const Value& x) {
    Value r = neg(b, mul(b, x, b.unary("log", x)));
    r = b.select(eq(b, x, 0), k(b, 0, x), r);
    r = b.select(lt(b, x, 0), k(b, -INFINITY, x), r);
    return b.select(b.compare(x, x, ir::Cmp::NE), x, r);
  });
});

Registrar reg_special_xlog1py("special_xlog1py", [](Ctx& c) {
  return floatBinary(c, [](ir::Builder& b, const Value& x, const Value& y) {
    Value r = mul(b, x, b.unary("log_plus_one", y));
    r = b.select(eq(b, x, 0), k(b, 0, x), r);
    return b.select(b.compare(y, y, ir::Cmp::NE), y, r);
  });
});

Registrar reg_logaddexp2("logaddexp2", [](Ctx& c) {
  return floatBinary(c, [](ir::Builder& b, const Value& x, const Value& y) {
    Value m = b.binary("maximum", x, y);
    Value d = neg(b, b.unary("abs", sub(b, x, y)));
    Value r = add(
        b, m, mul(b, b.unary("log_plus_one", b.unary("exponential", mul(b, d, k(b, M_LN2, x)))), k(b, 1.0 / M_LN2, x)));
    // Equal infinities: the difference is nan, the result is that infinity.
    return b.select(b.binary("and", b.unary("not", b.unary("is_finite", m)), b.compare(x, y, ir::Cmp::EQ)), x, r);
  });
});

Registrar reg_heaviside("heaviside", [](Ctx& c) {
  DType t = outType(c, resultType(c, {0, 1}));
  ir::Builder& b = c.b;
  auto vs = broadcastAll(b, {b.convert(c.tensor(0), t), b.convert(c.tensor(1), t)});
  Value x = vs[0];
  Value zero = b.zeros(x.type);
  Value r = b.select(b.compare(x, zero, ir::Cmp::GT), b.constant(1, t, x.shape()), zero);
  r = b.select(b.compare(x, zero, ir::Cmp::EQ), vs[1], r);
  if (ir::isFloat(t)) r = b.select(b.compare(x, x, ir::Cmp::NE), x, r);
  return std::vector<Value>{r};
});

Registrar reg_angle("angle", [](Ctx& c) {
  Value z = c.tensor(0);  // complex: atan2(im, re)
  if (ir::isComplex(z.dtype())) return std::vector<Value>{c.b.binary("atan2", c.b.imag(z), c.b.real(z))};
  return floatUnary(c, [](ir::Builder& b, const Value& x) {
    Value r = b.select(lt(b, x, 0), k(b, M_PI, x), k(b, 0, x));
    return b.select(b.compare(x, x, ir::Cmp::NE), x, r);
  });
});

Registrar reg_deg2rad("deg2rad", [](Ctx& c) {
  return floatUnary(c, [](ir::Builder& b, const Value& x) { return mul(b, x, k(b, M_PI / 180.0, x)); });
});
Registrar reg_rad2deg("rad2deg", [](Ctx& c) {
  return floatUnary(c, [](ir::Builder& b, const Value& x) { return mul(b, x, k(b, 180.0 / M_PI, x)); });
});

// nextafter(x, y): step the bit pattern of x by one towards y.
Registrar reg_nextafter("nextafter", [](Ctx& c) {
  DType t = outType(c, resultType(c, {0, 1}));
  if (!ir::isFloat(t)) throw ir::Unsupported("nextafter: not a float");
  ir::Builder& b = c.b;
  auto vs = broadcastAll(b, {b.convert(c.tensor(0), t), b.convert(c.tensor(1), t)});
  Value x = vs[0], y = vs[1];
  DType it = t == DType::F32 ? DType::I32 : t == DType::F64 ? DType::I64 : DType::I16;
  Type ity{it, x.shape()};
  Value bits = b.bitcast(x, ity);
  Value one = b.constantInt(1, it, x.shape());
  Value zero = k(b, 0, x);
  // Away from zero when |y| > |x| on x's side: for x > 0 that is y > x.
  Value up = b.compare(b.compare(y, x, ir::Cmp::GT), b.compare(x, zero, ir::Cmp::GT), ir::Cmp::EQ);
  Value stepped = b.bitcast(b.select(up, add(b, bits, one), sub(b, bits, one)), x.type);
  // From +-0: the smallest subnormal with y's sign.
  Value tiny = b.bitcast(one, x.type);
  Value from0 = b.select(lt(b, y, 0), neg(b, tiny), tiny);
  Value r = b.select(b.compare(x, zero, ir::Cmp::EQ), from0, stepped);
  r = b.select(b.compare(x, y, ir::Cmp::EQ), y, r);
  Value nan = b.binary("or", b.compare(x, x, ir::Cmp::NE), b.compare(y, y, ir::Cmp::NE));
  return std::vector<Value>{b.select(nan, add(b, x, y), r)};
});

}  // namespace
}  // namespace tpu::ops
