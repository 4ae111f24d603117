// Special functions: log-gamma and its derivatives, inverse error function,
// modified Bessel functions, normal-distribution helpers and small
// elementwise extras (sinc, entr, heaviside, logaddexp2, ...). Low-precision
// floats compute in float32 and round once, like PyTorch's CPU kernels.
#include <cmath>

#include "ops/common.h"

namespace tpu::ops {
namespace {

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

// The special_* Bessel functions have no half-precision CPU kernels (the CPU
// raises): leave those to the fallback so the error is the same.
void noHalf(const Ctx& c) {
  DType out = outType(c, floatOf(c.tensor(0).dtype()));
  if (out == DType::F16 || out == DType::BF16) throw ir::Unsupported("no half-precision kernel");
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
  noHalf(c);
  return floatUnary(c, [](ir::Builder& b, const Value& x) { return besselI(b, x, 0); });
});
Registrar reg_special_mbi1("special_modified_bessel_i1", [](Ctx& c) {
  noHalf(c);
  return floatUnary(c, [](ir::Builder& b, const Value& x) { return besselI(b, x, 1); });
});
Registrar reg_special_i1e("special_i1e", [](Ctx& c) {
  return floatUnary(c, [](ir::Builder& b, const Value& x) { return besselIe(b, x, 1); });
});

// --- regularized incomplete gamma P(a, x) (igamma) and Q(a, x) (igammac),
// in float64: the power series of P for x < a + 1, the continued fraction
// of Q (modified Lentz) above, each a while loop until every element has
// converged.

const int kIgammaMaxIter = 5000;

std::vector<int64_t> allDims(const Value& v) {
  std::vector<int64_t> d(v.rank());
  for (int i = 0; i < v.rank(); ++i) d[i] = i;
  return d;
}

// Runs `step` (state -> state, its last entry the per-element done mask)
// until every element is done or the iteration limit is hit.
std::vector<Value> untilDone(ir::Builder& b, std::vector<Value> init, const ir::Builder::BodyFn& step) {
  init.insert(init.begin(), b.constantInt(0, DType::I64));
  auto out = b.whileLoop(
      init,
      [](ir::Builder& bb, const std::vector<Value>& st) {
        Value more = bb.compare(st[0], bb.constantInt(kIgammaMaxIter, DType::I64), ir::Cmp::LT);
        Value pending = reduceMax(bb, bb.unary("not", st.back()), allDims(st.back()));
        return std::vector<Value>{bb.binary("and", more, pending)};
      },
      [&](ir::Builder& bb, const std::vector<Value>& st) {
        std::vector<Value> next = step(bb, std::vector<Value>(st.begin() + 1, st.end()));
        next.insert(next.begin(), bb.binary("add", st[0], bb.constantInt(1, DType::I64)));
        return next;
      });
  out.erase(out.begin());
  return out;
}

// sum_n x^n / ((a+1)...(a+n)); P = that * x^a e^-x / Gamma(a+1).
Value igammaSeries(ir::Builder& b, const Value& a, const Value& x) {
  Value one = k(b, 1, a);
  Value done0 = b.compare(x, k(b, 0, x), ir::Cmp::EQ);
  auto out = untilDone(b, {a, x, a, one, one, done0}, [](ir::Builder& bb, const std::vector<Value>& st) {
    const Value &aa = st[0], &xx = st[1], &ap = st[2], &term = st[3], &sum = st[4], &done = st[5];
    Value ap2 = add(bb, ap, k(bb, 1, ap));
    Value t2 = div(bb, mul(bb, term, xx), ap2);
    Value s2 = add(bb, sum, t2);
    Value conv = bb.compare(bb.unary("abs", t2), mul(bb, bb.unary("abs", s2), k(bb, 1e-17, s2)), ir::Cmp::LE);
    return std::vector<Value>{aa,
                              xx,
                              bb.select(done, ap, ap2),
                              bb.select(done, term, t2),
                              bb.select(done, sum, s2),
                              bb.binary("or", done, conv)};
  });
  return out[4];
}

// The continued fraction of Gamma(a) e^x x^-a Q(a, x), x >= a + 1.
Value igammacFraction(ir::Builder& b, const Value& a, const Value& x) {
  const double tiny = 1e-300;
  Value bb0 = add(b, sub(b, x, a), k(b, 1, x));
  Value c0 = k(b, 1.0 / tiny, x);
  Value d0 = div(b, k(b, 1, x), bb0);
  Value i0 = k(b, 0, x);
  Value done0 = b.compare(x, x, ir::Cmp::NE);
  auto out = untilDone(b, {a, x, i0, bb0, c0, d0, d0, done0}, [tiny](ir::Builder& bb, const std::vector<Value>& st) {
    const Value &aa = st[0], &xx = st[1], &i = st[2], &bv = st[3], &c = st[4], &d = st[5], &h = st[6], &done = st[7];
    Value i2 = add(bb, i, k(bb, 1, i));
    Value an = mul(bb, bb.unary("negate", i2), sub(bb, i2, aa));
    Value b2 = add(bb, bv, k(bb, 2, bv));
    auto guard = [&](const Value& v) {
      return bb.select(bb.compare(bb.unary("abs", v), k(bb, tiny, v), ir::Cmp::LT), k(bb, tiny, v), v);
    };
    Value d2 = div(bb, k(bb, 1, d), guard(add(bb, mul(bb, an, d), b2)));
    Value c2 = guard(add(bb, b2, div(bb, an, c)));
    Value del = mul(bb, d2, c2);
    Value h2 = mul(bb, h, del);
    Value conv = bb.compare(bb.unary("abs", sub(bb, del, k(bb, 1, del))), k(bb, 1e-16, del), ir::Cmp::LE);
    auto keep = [&](const Value& old, const Value& nw) { return bb.select(done, old, nw); };
    return std::vector<Value>{aa,          xx,          keep(i, i2), keep(bv, b2),
                              keep(c, c2), keep(d, d2), keep(h, h2), bb.binary("or", done, conv)};
  });
  return out[6];
}

Value erfcxPos(ir::Builder& b, const Value& ax);

// Temme's uniform asymptotic expansion (two terms) for large a:
// Q = erfc(y)/2 + R, P = erfc(-y)/2 - R, y = eta sqrt(a/2),
// R = exp(-y^2) (c0(eta) + c1(eta)/a) / sqrt(2 pi a),
// eta^2 / 2 = mu - log(1 + mu), mu = x/a - 1. Relative error below 1e-7
// for a > kTemmeMinA at every x.
const double kTemmeMinA = 500;

std::pair<Value, Value> igammaTemme(ir::Builder& b, const Value& a, const Value& x) {
  Value one = k(b, 1, a);
  Value mu = div(b, sub(b, x, a), a);
  Value half_eta2 = b.binary("maximum", sub(b, mu, b.unary("log_plus_one", mu)), k(b, 0, a));
  Value eta = mul(b, b.unary("sign", mu), b.unary("sqrt", mul(b, half_eta2, k(b, 2, a))));
  // c0 and c1 cancel badly near mu = 0: their Taylor series there.
  Value near = lt(b, b.unary("abs", mu), 0.01);
  Value ms = b.select(near, one, mu), es = b.select(near, one, eta);
  Value ims = div(b, one, ms), ies = div(b, one, es);
  Value c0 = sub(b, ims, ies);
  Value c1 = sub(b, sub(b, sub(b, mul(b, mul(b, ies, ies), ies), mul(b, mul(b, ims, ims), ims)), mul(b, ims, ims)),
                 mul(b, ims, k(b, 1.0 / 12, a)));
  c0 = b.select(near, poly(b, eta, {1.0 / 864, -2.0 / 135, 1.0 / 12, -1.0 / 3}), c0);
  c1 = b.select(near, poly(b, eta, {1.0 / 378, -1.0 / 288, -1.0 / 540}), c1);
  Value r = div(b, add(b, c0, div(b, c1, a)), b.unary("sqrt", mul(b, a, k(b, 2 * M_PI, a))));
  Value y = mul(b, eta, b.unary("sqrt", mul(b, a, k(b, 0.5, a))));
  Value ey2 = b.unary("exponential", neg(b, mul(b, y, y)));
  // The small one of P and Q directly, the other as its complement.
  Value small =
      mul(b, ey2, add(b, mul(b, erfcxPos(b, b.unary("abs", y)), k(b, 0.5, a)), b.select(lt(b, y, 0), neg(b, r), r)));
  Value upper = b.compare(y, k(b, 0, y), ir::Cmp::GE);
  return {b.select(upper, sub(b, one, small), small), b.select(upper, small, sub(b, one, small))};
}

// {P, Q} for positive finite a and x (other elements give garbage).
std::pair<Value, Value> incompleteGamma(ir::Builder& b, const Value& a, const Value& x) {
  Value ok = b.binary("and", b.binary("and", b.unary("is_finite", a), b.unary("is_finite", x)),
                      b.binary("and", b.compare(a, k(b, 0, a), ir::Cmp::GT), b.compare(x, k(b, 0, x), ir::Cmp::GT)));
  Value temme = b.binary("and", ok, b.compare(a, k(b, kTemmeMinA, a), ir::Cmp::GT));
  Value loops = b.binary("and", ok, b.unary("not", temme));
  Value use_series = b.binary("and", loops, b.compare(x, add(b, a, k(b, 1, a)), ir::Cmp::LT));
  Value use_cf = b.binary("and", loops, b.unary("not", use_series));
  // Inputs of the other branches become ones that finish at once.
  Value one = k(b, 1, a);
  Value sa = b.select(use_series, a, one), sx = b.select(use_series, x, k(b, 0, x));
  Value ca = b.select(use_cf, a, one), cx = b.select(use_cf, x, k(b, 1e300, x));
  // One log-gamma serves both branches: Gamma(a + 1) (series) or Gamma(a).
  Value lg = lgamma(b, b.select(use_series, add(b, a, one), ca));
  Value logpre_s = sub(b, sub(b, mul(b, sa, b.unary("log", b.select(use_series, sx, one))), sx), lg);
  Value p = mul(b, igammaSeries(b, sa, sx), b.unary("exponential", logpre_s));
  Value logpre_c = sub(b, sub(b, mul(b, ca, b.unary("log", cx)), cx), lg);
  Value q = mul(b, igammacFraction(b, ca, cx), b.unary("exponential", logpre_c));
  Value big = k(b, 2 * kTemmeMinA, a);
  auto tpq = igammaTemme(b, b.select(temme, a, big), b.select(temme, x, big));
  Value rp = b.select(use_series, p, sub(b, one, q)), rq = b.select(use_series, sub(b, one, p), q);
  return {b.select(temme, tpq.first, rp), b.select(temme, tpq.second, rq)};
}

// PyTorch's order of special cases; `upper` selects Q.
Value igammaOp(ir::Builder& b, const Value& a, const Value& x, bool upper) {
  auto pq = incompleteGamma(b, a, x);
  Value r = upper ? pq.second : pq.first;
  double at_zero_x = upper ? 1 : 0, at_inf = upper ? 0 : 1;
  Value nan = k(b, NAN, a);
  Value xinf = b.compare(x, k(b, INFINITY, x), ir::Cmp::EQ);
  r = b.select(b.binary("or", b.compare(a, a, ir::Cmp::NE), b.compare(x, x, ir::Cmp::NE)), nan, r);
  r = b.select(xinf, k(b, at_inf, x), r);
  r = b.select(b.compare(a, k(b, INFINITY, a), ir::Cmp::EQ), b.select(xinf, nan, k(b, at_zero_x, a)), r);
  r = b.select(b.compare(x, k(b, 0, x), ir::Cmp::EQ), k(b, at_zero_x, x), r);
  r = b.select(b.compare(a, k(b, 0, a), ir::Cmp::EQ),
               b.select(b.compare(x, k(b, 0, x), ir::Cmp::GT), k(b, at_inf, a), nan), r);
  Value neg = b.binary("or", lt(b, a, 0), lt(b, x, 0));
  return b.select(neg, nan, r);
}

std::vector<Value> igammaLowering(Ctx& c, bool upper) {
  DType t = resultType(c, {0, 1});
  DType out = outType(c, floatOf(t));
  if (!ir::isFloat(out)) throw ir::Unsupported("igamma: not a float");
  ir::Builder& b = c.b;
  auto vs = broadcastAll(b, {b.convert(c.tensor(0), DType::F64), b.convert(c.tensor(1), DType::F64)});
  return {b.convert(igammaOp(b, vs[0], vs[1], upper), out)};
}

Registrar reg_igamma("igamma", [](Ctx& c) { return igammaLowering(c, false); });
Registrar reg_igammac("igammac", [](Ctx& c) { return igammaLowering(c, true); });

// --- frexp: mantissa in [0.5, 1) with x's sign and an int32 exponent,
// all from the bits (the CPU plugin flushes subnormal arithmetic to zero);
// 0, inf and nan give (x, 0) like the C library.
Registrar reg_frexp("frexp", [](Ctx& c) {
  Value x0 = c.tensor(0);
  if (!ir::isFloat(x0.dtype())) throw ir::Unsupported("frexp: not a float");
  DType out = c.hasExpected() ? c.expectedAt(0).dtype : x0.dtype();
  ir::Builder& b = c.b;
  bool f64 = x0.dtype() == DType::F64;
  DType ft = f64 ? DType::F64 : DType::F32, it = f64 ? DType::I64 : DType::I32;
  int width = f64 ? 64 : 32, mbits = f64 ? 52 : 23;
  int64_t emask = f64 ? 0x7ff : 0xff, bias = f64 ? 1022 : 126;
  Value x = b.convert(x0, ft);
  Shape sh = x.shape();
  auto ic = [&](int64_t v) { return b.constantInt(v, it, sh); };
  auto band = [&](const Value& p, const Value& q) { return b.binary("and", p, q); };
  auto bor = [&](const Value& p, const Value& q) { return b.binary("or", p, q); };
  Value bits = b.bitcast(x, Type{it, sh});
  Value frac_mask = sub(b, b.binary("shift_left", ic(1), ic(mbits)), ic(1));
  Value sign = band(bits, b.binary("shift_left", ic(1), ic(width - 1)));
  Value field = band(b.binary("shift_right_logical", bits, ic(mbits)), ic(emask));
  Value frac = band(bits, frac_mask);
  // Normal numbers: replace the exponent field by the bias.
  Value e_norm = sub(b, field, ic(bias));
  Value m_norm = bor(bor(sign, frac), b.binary("shift_left", ic(bias), ic(mbits)));
  // Subnormals: shift the leading one of the fraction up to the hidden bit.
  Value clz = b.unary("count_leading_zeros", frac);
  Value lead = sub(b, ic(width - 1), clz);  // position of the leading one
  Value e_sub = sub(b, lead, ic(bias + mbits - 1));
  Value shifted = band(b.binary("shift_left", frac, sub(b, ic(mbits), lead)), frac_mask);
  Value m_sub = bor(bor(sign, shifted), b.binary("shift_left", ic(bias), ic(mbits)));
  Value is_sub = band(b.compare(field, ic(0), ir::Cmp::EQ), b.compare(frac, ic(0), ir::Cmp::NE));
  Value m = b.bitcast(b.select(is_sub, m_sub, m_norm), x.type);
  Value e = b.select(is_sub, e_sub, e_norm);
  // Zeros, inf and nan.
  Value special = bor(b.compare(field, ic(emask), ir::Cmp::EQ),
                      band(b.compare(field, ic(0), ir::Cmp::EQ), b.compare(frac, ic(0), ir::Cmp::EQ)));
  m = b.select(special, x, m);
  e = b.select(special, ic(0), e);
  return std::vector<Value>{b.convert(m, out), b.convert(e, DType::I32)};
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
  // NaN is neither 0 nor above it: 0, as PyTorch's CPU and CUDA kernels give.
  r = b.select(b.compare(x, zero, ir::Cmp::EQ), vs[1], r);
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
