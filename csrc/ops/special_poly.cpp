// Orthogonal polynomials special_{chebyshev,shifted_chebyshev}_polynomial_
// {t,u,v,w}, special_hermite_polynomial_{h,he}, special_laguerre_polynomial_l
// and special_legendre_polynomial_p: f(x, n) elementwise with broadcasting,
// the degree n per element. A while loop runs the three-term recurrence up to
// the largest degree any element needs and keeps each element's value when
// the loop reaches its degree. Special cases (negative n, |x| == 1, the
// trigonometric forms PyTorch uses for large n inside (-1, 1)) follow
// PyTorch's CPU results.
#include <cmath>

#include "ops/common.h"

namespace tpu::ops {
namespace {

Value k(ir::Builder& b, double v, const Value& like) { return full(b, v, like); }
Value cmp(ir::Builder& b, const Value& x, double v, ir::Cmp d) { return b.compare(x, k(b, v, x), d); }
Value band(ir::Builder& b, const Value& p, const Value& q) { return b.binary("and", p, q); }

// Degree-j term from the two previous ones: step(b, j as float, x, p = P_{j-2}, q = P_{j-1}).
using Step = std::function<Value(ir::Builder&, const Value& j, const Value& x, const Value& p, const Value& q)>;

// P_n(x) for every element, n >= 2, from P_0 = q0 and P_1 = q1; elements with
// `skip` set do not extend the loop (their value is taken elsewhere).
Value recurrence(ir::Builder& b, const Value& x, const Value& n, const Value& q0, const Value& q1, const Value& skip,
                 const Step& step) {
  DType it = DType::I64;
  Value need = b.select(skip, b.constantInt(0, it, n.shape()), n);
  Value maxn = reduceMax(b, need, [&] {
    std::vector<int64_t> d(n.rank());
    for (int i = 0; i < n.rank(); ++i) d[i] = i;
    return d;
  }());
  Value res = b.select(b.compare(n, b.constantInt(1, it, n.shape()), ir::Cmp::EQ), q1, q0);
  std::vector<Value> init = {b.constantInt(2, it), maxn, x, n, q0, q1, res};
  auto out = b.whileLoop(
      init,
      [&](ir::Builder& bb, const std::vector<Value>& st) {
        const Value &j = st[0], &mx = st[1], &nn = st[3], &q = st[5];
        Value more = bb.compare(j, mx, ir::Cmp::LE);
        // Stop early once every element still running is nan: it stays nan
        // (huge degrees where the values overflowed).
        Value running = bb.compare(nn, bb.broadcastTo(j, nn.shape()), ir::Cmp::GE);
        Value live = band(bb, running, bb.compare(q, q, ir::Cmp::EQ));
        std::vector<int64_t> dims(nn.rank());
        for (int i = 0; i < nn.rank(); ++i) dims[i] = i;
        return std::vector<Value>{band(bb, more, reduceMax(bb, live, dims))};
      },
      [&](ir::Builder& bb, const std::vector<Value>& st) {
        const Value &j = st[0], &xx = st[2], &nn = st[3], &p = st[4], &q = st[5];
        Value jf = bb.broadcastTo(bb.convert(j, xx.dtype()), xx.shape());
        Value r = step(bb, jf, xx, p, q);
        Value at = bb.compare(nn, bb.broadcastTo(j, nn.shape()), ir::Cmp::EQ);
        Value res2 = bb.select(at, r, st[6]);
        Value j2 = bb.binary("add", j, bb.constantInt(1, DType::I64));
        return std::vector<Value>{j2, st[1], xx, nn, q, r, res2};
      });
  // Elements the early stop left behind hold nan.
  Value left = b.compare(n, b.broadcastTo(out[0], n.shape()), ir::Cmp::GE);
  return b.select(left, out[5], out[6]);
}

struct PolyArgs {
  Value x, n;  // x in the compute type, n as int64 (PyTorch truncates)
  DType out;
};

PolyArgs polyArgs(Ctx& c) {
  DType t = resultType(c, {0, 1});
  DType out = outType(c, floatOf(t));
  // PyTorch has no half-precision kernels for these: the CPU raises.
  if (!ir::isFloat(out) || out == DType::F16 || out == DType::BF16)
    throw ir::Unsupported("orthogonal polynomial: float32/float64 only");
  DType comp = accOf(out);
  ir::Builder& b = c.b;
  auto vs = broadcastAll(b, {b.convert(c.tensor(0), comp), b.convert(c.tensor(1), comp)});
  Value nf = vs[1];
  // Like a C++ cast on x86: nan, inf and out-of-range degrees become
  // INT64_MIN, i.e. negative (the result is 0).
  Value ok = cmp(b, b.unary("abs", nf), 9.2e18, ir::Cmp::LT);
  Value n =
      b.select(ok, b.convert(b.select(ok, nf, k(b, 0, nf)), DType::I64), b.constantInt(-1, DType::I64, nf.shape()));
  return {vs[0], n, out};
}

Value nEq(ir::Builder& b, const Value& n, int64_t v) {
  return b.compare(n, b.constantInt(v, DType::I64, n.shape()), ir::Cmp::EQ);
}
Value nLt(ir::Builder& b, const Value& n, int64_t v) {
  return b.compare(n, b.constantInt(v, DType::I64, n.shape()), ir::Cmp::LT);
}
Value nGt(ir::Builder& b, const Value& n, int64_t v) {
  return b.compare(n, b.constantInt(v, DType::I64, n.shape()), ir::Cmp::GT);
}
Value nEven(ir::Builder& b, const Value& n) {
  Value r = b.binary("remainder", n, b.constantInt(2, DType::I64, n.shape()));
  return nEq(b, r, 0);
}

// Negative degrees give 0.
Value finish(ir::Builder& b, const PolyArgs& a, const Value& r) {
  Value v = b.select(nLt(b, a.n, 0), k(b, 0, r), r);
  return b.convert(v, a.out);
}

enum class Kind { T, U, V, W };

// Chebyshev polynomials of the four kinds at y (y = x, or 2x - 1 shifted).
// `big` is the degree above which PyTorch switches to the trigonometric form
// inside (-1, 1).
Value chebyshev(ir::Builder& b, const Value& y, const Value& n, Kind kind, int64_t big) {
  Value nf = b.convert(n, y.dtype());
  Value one = k(b, 1, y);
  Value ay = b.unary("abs", y);
  Value q1 = kind == Kind::T   ? y
             : kind == Kind::U ? add(b, y, y)
             : kind == Kind::V ? sub(b, add(b, y, y), one)
                               : add(b, add(b, y, y), one);
  Value trig_zone = band(b, nGt(b, n, big), cmp(b, ay, 1, ir::Cmp::LT));
  Value r = recurrence(b, y, n, one, q1, trig_zone,
                       [](ir::Builder& bb, const Value&, const Value& yy, const Value& p, const Value& q) {
                         return sub(bb, mul(bb, add(bb, yy, yy), q), p);
                       });
  // Trigonometric forms with theta = acos(y), on a clamped y (nan-free).
  Value yc = b.select(trig_zone, y, k(b, 0, y));
  // acos(y) = atan2(sqrt((1 - y)(1 + y)), y), accurate near |y| = 1.
  Value th = b.binary("atan2", b.unary("sqrt", mul(b, sub(b, one, yc), add(b, one, yc))), yc);
  // Where the half angle rounds to the end point PyTorch returns the value at
  // y = -1 (V) or y = +1 (W).
  Value snap;
  Value tr;
  switch (kind) {
    case Kind::T:
      tr = b.unary("cosine", mul(b, nf, th));
      break;
    case Kind::U:
      tr = div(b, b.unary("sine", mul(b, add(b, nf, one), th)), b.unary("sine", th));
      break;
    case Kind::V: {
      Value h = mul(b, th, k(b, 0.5, y));
      tr = div(b, b.unary("cosine", mul(b, add(b, nf, k(b, 0.5, y)), th)), b.unary("cosine", h));
      snap = band(b, trig_zone, cmp(b, b.unary("sine", h), 1, ir::Cmp::EQ));
      break;
    }
    case Kind::W: {
      Value h = mul(b, th, k(b, 0.5, y));
      tr = div(b, b.unary("sine", mul(b, add(b, nf, k(b, 0.5, y)), th)), b.unary("sine", h));
      snap = band(b, trig_zone, cmp(b, b.unary("cosine", h), 1, ir::Cmp::EQ));
      break;
    }
  }
  r = b.select(trig_zone, tr, r);
  // y == +-1: closed forms (+1 for the sign pattern, counts of 2n+1 / n+1).
  Value pos = cmp(b, y, 1, ir::Cmp::EQ), negv = cmp(b, y, -1, ir::Cmp::EQ);
  Value even = nEven(b, n);
  Value sgn = b.select(even, one, k(b, -1, y));
  Value np1 = add(b, nf, one), tnp1 = add(b, add(b, nf, nf), one);
  Value at_pos, at_neg;
  switch (kind) {
    case Kind::T:
      at_pos = one, at_neg = sgn;
      break;
    case Kind::U:
      at_pos = np1, at_neg = mul(b, sgn, np1);
      break;
    case Kind::V:
      at_pos = one, at_neg = mul(b, sgn, tnp1);
      break;
    case Kind::W:
      at_pos = tnp1, at_neg = sgn;
      break;
  }
  if (kind == Kind::V) negv = b.binary("or", negv, snap);
  if (kind == Kind::W) pos = b.binary("or", pos, snap);
  r = b.select(pos, at_pos, r);
  return b.select(negv, at_neg, r);
}

void regChebyshev(const char* name, Kind kind, bool shifted) {
  registerLowering(name, [kind, shifted](Ctx& c) {
    PolyArgs a = polyArgs(c);
    ir::Builder& b = c.b;
    Value y = shifted ? sub(b, add(b, a.x, a.x), k(b, 1, a.x)) : a.x;
    int64_t big = (shifted || kind == Kind::T) ? 6 : 8;
    return std::vector<Value>{finish(b, a, chebyshev(b, y, a.n, kind, big))};
  });
}

struct RegisterAll {
  RegisterAll() {
    regChebyshev("special_chebyshev_polynomial_t", Kind::T, false);
    regChebyshev("special_chebyshev_polynomial_u", Kind::U, false);
    regChebyshev("special_chebyshev_polynomial_v", Kind::V, false);
    regChebyshev("special_chebyshev_polynomial_w", Kind::W, false);
    regChebyshev("special_shifted_chebyshev_polynomial_t", Kind::T, true);
    regChebyshev("special_shifted_chebyshev_polynomial_u", Kind::U, true);
    regChebyshev("special_shifted_chebyshev_polynomial_v", Kind::V, true);
    regChebyshev("special_shifted_chebyshev_polynomial_w", Kind::W, true);
  }
} register_all;

Value noSkip(ir::Builder& b, const Value& n) { return b.constantInt(0, DType::Bool, n.shape()); }

// Physicists' Hermite: H_j = 2x H_{j-1} - 2(j-1) H_{j-2}.
Registrar reg_hermite_h("special_hermite_polynomial_h", [](Ctx& c) {
  PolyArgs a = polyArgs(c);
  ir::Builder& b = c.b;
  Value r = recurrence(b, a.x, a.n, k(b, 1, a.x), add(b, a.x, a.x), noSkip(b, a.n),
                       [](ir::Builder& bb, const Value& j, const Value& x, const Value& p, const Value& q) {
                         Value c2 = mul(bb, sub(bb, j, k(bb, 1, j)), k(bb, 2, j));
                         return sub(bb, mul(bb, add(bb, x, x), q), mul(bb, c2, p));
                       });
  return std::vector<Value>{finish(b, a, r)};
});

// Probabilists' Hermite: He_j = x He_{j-1} - (j-1) He_{j-2}.
Registrar reg_hermite_he("special_hermite_polynomial_he", [](Ctx& c) {
  PolyArgs a = polyArgs(c);
  ir::Builder& b = c.b;
  Value r = recurrence(b, a.x, a.n, k(b, 1, a.x), a.x, noSkip(b, a.n),
                       [](ir::Builder& bb, const Value& j, const Value& x, const Value& p, const Value& q) {
                         return sub(bb, mul(bb, x, q), mul(bb, sub(bb, j, k(bb, 1, j)), p));
                       });
  return std::vector<Value>{finish(b, a, r)};
});

// Laguerre: j L_j = (2(j-1) + 1 - x) L_{j-1} - (j-1) L_{j-2}; L_n(0) = 1.
Registrar reg_laguerre("special_laguerre_polynomial_l", [](Ctx& c) {
  PolyArgs a = polyArgs(c);
  ir::Builder& b = c.b;
  Value one = k(b, 1, a.x);
  Value zero_x = cmp(b, a.x, 0, ir::Cmp::EQ);
  Value r = recurrence(b, a.x, a.n, one, sub(b, one, a.x), zero_x,
                       [](ir::Builder& bb, const Value& j, const Value& x, const Value& p, const Value& q) {
                         Value km = sub(bb, j, k(bb, 1, j));
                         Value cq = add(bb, add(bb, km, km), sub(bb, k(bb, 1, x), x));
                         return div(bb, sub(bb, mul(bb, cq, q), mul(bb, km, p)), j);
                       });
  r = b.select(zero_x, one, r);
  return std::vector<Value>{finish(b, a, r)};
});

// Legendre: j P_j = (2j - 1) x P_{j-1} - (j-1) P_{j-2}; P_n(+-1) = (+-1)^n.
Registrar reg_legendre("special_legendre_polynomial_p", [](Ctx& c) {
  PolyArgs a = polyArgs(c);
  ir::Builder& b = c.b;
  Value one = k(b, 1, a.x);
  Value unit = cmp(b, b.unary("abs", a.x), 1, ir::Cmp::EQ);
  Value r = recurrence(b, a.x, a.n, one, a.x, unit,
                       [](ir::Builder& bb, const Value& j, const Value& x, const Value& p, const Value& q) {
                         Value km = sub(bb, j, k(bb, 1, j));
                         Value cx = add(bb, add(bb, km, km), k(bb, 1, j));
                         return div(bb, sub(bb, mul(bb, mul(bb, cx, x), q), mul(bb, km, p)), j);
                       });
  Value at_unit = b.select(b.binary("or", cmp(b, a.x, 0, ir::Cmp::GT), nEven(b, a.n)), one, k(b, -1, a.x));
  r = b.select(unit, at_unit, r);
  return std::vector<Value>{finish(b, a, r)};
});

}  // namespace
}  // namespace tpu::ops
