// Spectral decompositions computed fully on the device, batched over the
// leading dims: SVD by one-sided (Hestenes) Jacobi and symmetric
// eigendecomposition by two-sided Jacobi, both with a parallel
// (round-robin) pair ordering so that each step rotates n/2 disjoint pairs
// with elementwise ops only; Householder QR (geqrf, orgqr, ormqr) with
// LAPACK's sign convention so Q and R match the CPU's; least squares
// through the SVD; the matrix exponential by scaling and squaring.
#include <algorithm>
#include <cmath>

#include "ops/common.h"

namespace tpu::ops {
namespace {

using ir::Builder;
using ir::Cmp;

constexpr int kMaxSweeps = 40;

double epsOf(DType t) { return t == DType::F64 ? 2.220446049250313e-16 : 1.1920928955078125e-07; }

DType checkReal(const Value& v, const char* what) {
  if (v.dtype() != DType::F32 && v.dtype() != DType::F64)
    throw ir::Unsupported(std::string(what) + " on " + ir::dtypeName(v.dtype()));
  return v.dtype();
}

Value K(Builder& b, double v, DType t, const Shape& s = {}) { return b.constant(v, t, s); }
Value KI(Builder& b, int64_t v, const Shape& s = {}) { return b.constantInt(v, DType::I64, s); }

// Leading dims collapsed into one, so the algorithms see (B, rows, cols).
struct Batched {
  Shape batch;
  int64_t count = 1;
};
Batched batchOf(const Value& v, int trailing) {
  Batched r;
  r.batch.assign(v.shape().begin(), v.shape().end() - trailing);
  for (auto d : r.batch) r.count *= d;
  return r;
}
Shape withBatch(const Shape& batch, std::initializer_list<int64_t> tail) {
  Shape s = batch;
  s.insert(s.end(), tail);
  return s;
}

Value sliceDim(Builder& b, const Value& v, int64_t dim, int64_t lo, int64_t hi) {
  Shape start(v.rank(), 0), limit = v.shape(), strides(v.rank(), 1);
  start[dim] = lo;
  limit[dim] = hi;
  return b.slice(v, start, limit, strides);
}
Value swapLast(Builder& b, const Value& v) {
  std::vector<int64_t> perm;
  for (int i = 0; i < v.rank(); ++i) perm.push_back(i);
  std::swap(perm[v.rank() - 1], perm[v.rank() - 2]);
  return b.transpose(v, perm);
}
Value bcast(Builder& b, const Value& v, const Shape& s, const std::vector<int64_t>& dims) {
  return b.broadcastInDim(v, s, dims);
}
Value sumDim(Builder& b, const Value& v, int64_t d) { return reduceSum(b, v, {d}); }
Value maxAll(Builder& b, const Value& v) {
  std::vector<int64_t> all;
  for (int i = 0; i < v.rank(); ++i) all.push_back(i);
  return reduceMax(b, v, all);
}
Value iotaI(Builder& b, const Shape& s, int dim) { return b.iota({DType::I64, s}, dim); }
// (B, r, c) identity-like matrix.
Value eye(Builder& b, DType t, int64_t B, int64_t r, int64_t c) {
  Shape s{B, r, c};
  return b.convert(b.compare(iotaI(b, s, 1), iotaI(b, s, 2), Cmp::EQ), t);
}
Value safeDiv(Builder& b, const Value& x, const Value& y) {
  Value zero = full(b, 0.0, y);
  Value nz = b.compare(y, zero, Cmp::NE);
  return b.select(nz, div(b, x, b.select(nz, y, full(b, 1.0, y))), full(b, 0.0, x));
}
// sqrt(x^2 + y^2) without overflow or underflow.
Value hypot(Builder& b, const Value& x, const Value& y) {
  Value ax = b.unary("abs", x), ay = b.unary("abs", y);
  Value hi = b.binary("maximum", ax, ay), lo = b.binary("minimum", ax, ay);
  Value r = safeDiv(b, lo, hi);
  return mul(b, hi, b.unary("sqrt", add(b, full(b, 1.0, r), mul(b, r, r))));
}
// Euclidean norm along `dim`, scaled by the largest magnitude first.
Value norm2(Builder& b, const Value& v, int64_t d) {
  Value a = b.unary("abs", v);
  Value mx = reduceMax(b, a, {d});
  std::vector<int64_t> keep;
  for (int i = 0; i < v.rank(); ++i)
    if (i != d) keep.push_back(i);
  Value q = safeDiv(b, v, bcast(b, mx, v.shape(), keep));
  return mul(b, mx, b.unary("sqrt", sumDim(b, mul(b, q, q), d)));
}
// max |v| over the last two dims of (B, r, c), 1 where the matrix is zero,
// so that dividing by it keeps squares of entries in range.
Value matrixScale(Builder& b, const Value& v) {
  Value mx = reduceMax(b, b.unary("abs", v), {1, 2});
  return b.select(b.compare(mx, full(b, 0.0, mx), Cmp::GT), mx, full(b, 1.0, mx));
}

// The round-robin ordering along `dim` of size 2h, laid out as tops [0, h)
// and bottoms [h, 2h): position 0 stays, the others move one place around a
// cycle, so every pair meets once in 2h-1 steps and the order then repeats.
Value tournament(Builder& b, const Value& x, int64_t dim) {
  int64_t np = x.shape()[dim], h = np / 2;
  if (h < 2) return x;
  std::vector<Value> parts{sliceDim(b, x, dim, 0, 1), sliceDim(b, x, dim, h, h + 1)};
  if (h > 2) parts.push_back(sliceDim(b, x, dim, 1, h - 1));
  parts.push_back(sliceDim(b, x, dim, h + 1, np));
  parts.push_back(sliceDim(b, x, dim, h - 1, h));
  return b.concatenate(parts, dim);
}

// Jacobi rotation (c, s) that zeroes the off-diagonal entry `apq` of the
// symmetric 2x2 [[app, apq], [apq, aqq]] (smaller angle); identity where
// `rotate` is false.
std::pair<Value, Value> jacobiRotation(Builder& b, const Value& app, const Value& aqq, const Value& apq,
                                       const Value& rotate) {
  auto k = [&](double v) { return full(b, v, app); };
  Value zeta = div(b, sub(b, aqq, app), mul(b, k(2), b.select(rotate, apq, k(1))));
  Value az = b.unary("abs", zeta);
  Value big = b.compare(az, k(1), Cmp::GT);
  Value inv = div(b, k(1), b.select(big, az, k(1)));
  // sqrt(1 + zeta^2), written so that a huge zeta does not overflow.
  Value root = b.select(big, mul(b, az, b.unary("sqrt", add(b, k(1), mul(b, inv, inv)))),
                        b.unary("sqrt", add(b, k(1), mul(b, az, az))));
  Value t = div(b, k(1), add(b, az, root));
  t = b.select(b.compare(zeta, k(0), Cmp::LT), b.unary("negate", t), t);
  Value c = b.unary("rsqrt", add(b, k(1), mul(b, t, t)));
  return {b.select(rotate, c, k(1)), b.select(rotate, mul(b, c, t), k(0))};
}

// Rotates column pairs (i, h+i) of x (B, r, 2h): [p q] <- [c p - s q, s p + c q].
Value rotateColumns(Builder& b, const Value& x, const Value& c, const Value& s) {
  int64_t h = x.shape()[2] / 2;
  Shape hs{x.shape()[0], x.shape()[1], h};
  Value p = sliceDim(b, x, 2, 0, h), q = sliceDim(b, x, 2, h, 2 * h);
  Value cb = bcast(b, c, hs, {0, 2}), sb = bcast(b, s, hs, {0, 2});
  return b.concatenate({sub(b, mul(b, cb, p), mul(b, sb, q)), add(b, mul(b, sb, p), mul(b, cb, q))}, 2);
}
Value rotateRows(Builder& b, const Value& x, const Value& c, const Value& s) {
  int64_t h = x.shape()[1] / 2;
  Shape hs{x.shape()[0], h, x.shape()[2]};
  Value p = sliceDim(b, x, 1, 0, h), q = sliceDim(b, x, 1, h, 2 * h);
  Value cb = bcast(b, c, hs, {0, 1}), sb = bcast(b, s, hs, {0, 1});
  return b.concatenate({sub(b, mul(b, cb, p), mul(b, sb, q)), add(b, mul(b, sb, p), mul(b, cb, q))}, 1);
}

// x (B, r, k) @ y (B, k, c) at full float32 precision: these products feed
// singular values, eigenvalues, least-squares solutions and matrix
// exponentials, which a bf16/tf32 default on an accelerator would ruin.
Value batchedProduct(Builder& b, const Value& x, const Value& y) {
  return b.dotGeneral(x, y, {0}, {0}, {2}, {1}, x.dtype(), "HIGHEST");
}

// Rotations' rounding drifts the columns' lengths (a first-order error in
// anything read from them): rescale each to unit length.
Value normalizeColumns(Builder& b, const Value& v) {
  return safeDiv(b, v, bcast(b, norm2(b, v, 1), v.shape(), {0, 2}));
}

// Sorts the columns of x (B, r, n) by `key` (B, n): stable, so equal keys
// permute every matrix the same way.
Value sortColumns(Builder& b, const Value& key, const Value& x, bool descending) {
  Value kb = bcast(b, key, x.shape(), {0, 2});
  return b.sort({kb, x}, 2, true, [descending](Builder& bb, const std::vector<Value>& a) {
    return std::vector<Value>{bb.compare(a[0], a[1], descending ? Cmp::GT : Cmp::LT)};
  })[1];
}
// Sorts `x` (B, n) by `key` (B, n), permuting like sortColumns.
Value sortByKey(Builder& b, const Value& key, const Value& x, bool descending) {
  return b.sort({key, x}, 1, true, [descending](Builder& bb, const std::vector<Value>& a) {
    return std::vector<Value>{bb.compare(a[0], a[1], descending ? Cmp::GT : Cmp::LT)};
  })[1];
}
Value sortValues(Builder& b, const Value& key, bool descending) {
  return b.sort({key}, 1, true, [descending](Builder& bb, const std::vector<Value>& a) {
    return std::vector<Value>{bb.compare(a[0], a[1], descending ? Cmp::GT : Cmp::LT)};
  })[0];
}

// Runs `sweep` (state -> state, state[0] = sweep counter, state[1] = "still
// rotating" measure) until a sweep does no rotation or kMaxSweeps.
std::vector<Value> sweepUntilConverged(Builder& b, std::vector<Value> state, const Builder::BodyFn& sweep) {
  return b.whileLoop(
      state,
      [](Builder& bb, const std::vector<Value>& st) {
        Value more = bb.compare(st[1], bb.constant(0.0, st[1].dtype()), Cmp::GT);
        Value left = bb.compare(st[0], bb.constantInt(kMaxSweeps, DType::I64), Cmp::LT);
        return std::vector<Value>{bb.binary("and", more, left)};
      },
      sweep);
}
// A loop of `steps` iterations of body(step, state...) -> state.
std::vector<Value> countedLoop(
    Builder& b, int64_t steps, const std::vector<Value>& state,
    const std::function<std::vector<Value>(Builder&, const Value&, const std::vector<Value>&)>& body) {
  std::vector<Value> init{b.constantInt(0, DType::I64)};
  init.insert(init.end(), state.begin(), state.end());
  auto r = b.whileLoop(
      init,
      [steps](Builder& bb, const std::vector<Value>& st) {
        return std::vector<Value>{bb.compare(st[0], bb.constantInt(steps, DType::I64), Cmp::LT)};
      },
      [&body](Builder& bb, const std::vector<Value>& st) {
        std::vector<Value> rest(st.begin() + 1, st.end());
        std::vector<Value> next = body(bb, st[0], rest);
        next.insert(next.begin(), bb.binary("add", st[0], bb.constantInt(1, DType::I64)));
        return next;
      });
  return std::vector<Value>(r.begin() + 1, r.end());
}

// ------------------------------------------------------------------ QR

// Householder QR of a (B, m, n) in geqrf's layout: R on and above the
// diagonal, reflector j's vector below it (its leading 1 implied), and tau
// (B, min(m, n)). H_j = I - tau_j v_j v_j^T with beta = -sign(alpha) * norm,
// as LAPACK's larfg, so R's diagonal signs match LAPACK's.
std::pair<Value, Value> geqrf(Builder& b, const Value& a) {
  DType t = a.dtype();
  int64_t B = a.shape()[0], m = a.shape()[1], n = a.shape()[2], k = std::min(m, n);
  Value tau0 = K(b, 0.0, t, {B, k});
  if (k == 0 || B == 0) return {a, tau0};
  auto r = countedLoop(b, k, {a, tau0}, [=](Builder& bb, const Value& j, const std::vector<Value>& st) {
    Value A = st[0], tau = st[1];
    Value z = bb.constantInt(0, DType::I64);
    Value col = bb.reshape(bb.dynamicSlice(A, {z, z, j}, {B, m, 1}), {B, m});
    Value rows = iotaI(bb, {B, m}, 1), jb = bb.broadcastTo(j, {B, m});
    Value zero = full(bb, 0.0, col);
    Value alpha = sumDim(bb, bb.select(bb.compare(rows, jb, Cmp::EQ), col, zero), 1);
    Value below = bb.select(bb.compare(rows, jb, Cmp::GT), col, zero);
    Value xnorm = norm2(bb, below, 1);
    Value nz = bb.compare(xnorm, full(bb, 0.0, xnorm), Cmp::NE);
    Value sgn =
        bb.select(bb.compare(alpha, full(bb, 0.0, alpha), Cmp::LT), full(bb, -1.0, alpha), full(bb, 1.0, alpha));
    Value beta = bb.unary("negate", mul(bb, sgn, hypot(bb, alpha, xnorm)));
    Value safe_beta = bb.select(nz, beta, full(bb, 1.0, beta));
    Value tj = bb.select(nz, div(bb, sub(bb, beta, alpha), safe_beta), full(bb, 0.0, beta));
    Value scale = bb.select(nz, div(bb, full(bb, 1.0, beta), sub(bb, alpha, safe_beta)), full(bb, 0.0, beta));
    Value v =
        bb.select(bb.compare(rows, jb, Cmp::EQ), full(bb, 1.0, col), mul(bb, below, bcast(bb, scale, {B, m}, {0})));
    // Apply H_j to the trailing columns: A -= tau v (v^T A).
    Shape s3{B, m, n};
    Value vb = bcast(bb, v, s3, {0, 1});
    Value w = sumDim(bb, mul(bb, vb, A), 1);
    Value upd = sub(bb, A, mul(bb, mul(bb, bcast(bb, tj, s3, {0}), vb), bcast(bb, w, s3, {0, 2})));
    Value r3 = iotaI(bb, s3, 1), c3 = iotaI(bb, s3, 2), j3 = bb.broadcastTo(j, s3);
    Value diag = bcast(bb, bb.select(nz, beta, alpha), s3, {0});
    Value colj = bb.select(bb.compare(r3, j3, Cmp::LT), A, bb.select(bb.compare(r3, j3, Cmp::EQ), diag, vb));
    Value next = bb.select(bb.compare(c3, j3, Cmp::GT), upd, bb.select(bb.compare(c3, j3, Cmp::EQ), colj, A));
    tau = bb.dynamicUpdateSlice(tau, bb.reshape(tj, {B, 1}), {z, j});
    return std::vector<Value>{next, tau};
  });
  return {r[0], r[1]};
}

// Applies the reflectors stored in `a` (B, m, >=k) with tau (B, k) to x:
// Q x (left) or x Q (right), Q^T with `transpose`, Q = H_0 H_1 ... H_{k-1}.
Value applyReflectors(Builder& b, const Value& a, const Value& tau, const Value& x, bool left, bool transpose) {
  int64_t B = a.shape()[0], m = a.shape()[1], k = tau.shape()[1];
  if (k == 0 || B == 0 || x.type.numel() == 0) return x;
  // Q x applies H_{k-1} first; Q^T x applies H_0 first; x Q applies H_0 first.
  bool forward = left == transpose;
  auto r = countedLoop(b, k, {x, a, tau}, [=](Builder& bb, const Value& cnt, const std::vector<Value>& st) {
    Value X = st[0], A = st[1], T = st[2];
    Value i = forward ? cnt : bb.binary("subtract", bb.constantInt(k - 1, DType::I64), cnt);
    Value z = bb.constantInt(0, DType::I64);
    Value col = bb.reshape(bb.dynamicSlice(A, {z, z, i}, {B, m, 1}), {B, m});
    Value rows = iotaI(bb, {B, m}, 1), ib = bb.broadcastTo(i, {B, m});
    Value v = bb.select(bb.compare(rows, ib, Cmp::LT), full(bb, 0.0, col),
                        bb.select(bb.compare(rows, ib, Cmp::EQ), full(bb, 1.0, col), col));
    Value ti = bb.reshape(bb.dynamicSlice(T, {z, i}, {B, 1}), {B});
    const Shape& s = X.shape();
    if (left) {  // X -= tau v (v^T X)
      Value vb = bcast(bb, v, s, {0, 1});
      Value w = sumDim(bb, mul(bb, vb, X), 1);
      X = sub(bb, X, mul(bb, mul(bb, bcast(bb, ti, s, {0}), vb), bcast(bb, w, s, {0, 2})));
    } else {  // X -= tau (X v) v^T
      Value vb = bcast(bb, v, s, {0, 2});
      Value w = sumDim(bb, mul(bb, vb, X), 2);
      X = sub(bb, X, mul(bb, mul(bb, bcast(bb, ti, s, {0}), vb), bcast(bb, w, s, {0, 1})));
    }
    return std::vector<Value>{X, A, T};
  });
  return r[0];
}

// The first `cols` columns of Q = H_0 ... H_{k-1} (orgqr).
Value householderProduct(Builder& b, const Value& a, const Value& tau, int64_t cols) {
  return applyReflectors(b, a, tau, eye(b, a.dtype(), a.shape()[0], a.shape()[1], cols), true, false);
}

// Upper triangle (col >= row) of x (B, r, c).
Value triu(Builder& b, const Value& x) {
  Value keep = b.compare(iotaI(b, x.shape(), 2), iotaI(b, x.shape(), 1), Cmp::GE);
  return b.select(keep, x, full(b, 0.0, x));
}

// Extends u (B, m, k), orthonormal columns, to an orthonormal basis (B, m, m):
// the trailing columns of the Q of u's own QR span u's complement.
Value completeBasis(Builder& b, const Value& u) {
  int64_t m = u.shape()[1], k = u.shape()[2];
  if (k >= m) return u;
  auto [a, tau] = geqrf(b, u);
  Value q = householderProduct(b, a, tau, m);
  return b.concatenate({u, sliceDim(b, q, 2, k, m)}, 2);
}

// ------------------------------------------------------------------ SVD

// Makes the columns of u (B, m, n) orthonormal when they are not quite:
// zero columns (a rank-deficient A) or columns of negligible singular
// values, whose directions are rounding noise. Householder QR orthogonalizes
// them in order (columns of large singular values first, so those barely
// move), R's diagonal signs keep the orientation, and a zero column gets a
// unit vector orthogonal to the others. The loop runs once, and only when
// some matrix's U^T U is off the identity by more than `tol`.
Value orthonormalizeColumns(Builder& b, const Value& u, double tol) {
  int64_t B = u.shape()[0], n = u.shape()[2];
  DType t = u.dtype();
  Value gram = b.dotGeneral(u, u, {0}, {0}, {1}, {1}, t, "HIGHEST");
  Value off = maxAll(b, b.unary("abs", sub(b, gram, eye(b, t, B, n, n))));
  auto r = b.whileLoop(
      {b.constantInt(0, DType::I64), u, off},
      [tol](Builder& bb, const std::vector<Value>& st) {
        Value first = bb.compare(st[0], bb.constantInt(0, DType::I64), Cmp::EQ);
        return std::vector<Value>{bb.binary("and", first, bb.compare(st[2], bb.constant(tol, st[2].dtype()), Cmp::GT))};
      },
      [n, B](Builder& bb, const std::vector<Value>& st) {
        auto [a, tau] = geqrf(bb, st[1]);
        Value q = householderProduct(bb, a, tau, n);
        Shape s3{B, n, n};
        Value top = sliceDim(bb, a, 1, 0, n);  // R's diagonal, (B, n)
        Value d =
            sumDim(bb, bb.select(bb.compare(iotaI(bb, s3, 1), iotaI(bb, s3, 2), Cmp::EQ), top, full(bb, 0.0, top)), 1);
        Value sgn = bb.select(bb.compare(d, full(bb, 0.0, d), Cmp::LT), full(bb, -1.0, d), full(bb, 1.0, d));
        q = mul(bb, q, bcast(bb, sgn, q.shape(), {0, 2}));
        return std::vector<Value>{bb.constantInt(1, DType::I64), q, st[2]};
      });
  return r[1];
}

struct SvdParts {
  Value u, s, v;  // u (B, m, n), s (B, n) descending, v (B, n, n); u, v only with want_uv
};

// One-sided Jacobi on a (B, m, n), m >= n: right rotations V make the
// columns of G = A V orthogonal; then s_j = |A v_j| and u_j = g_j / |g_j|.
SvdParts jacobiSvd(Builder& b, const Value& a, bool want_uv) {
  DType t = a.dtype();
  int64_t B = a.shape()[0], m = a.shape()[1], n = a.shape()[2];
  int64_t np = n + (n & 1), h = np / 2;
  Value scale = matrixScale(b, a);
  Value g0 = div(b, a, bcast(b, scale, a.shape(), {0}));
  // An odd n gets a zero column: it never rotates (its dot products are 0).
  Value g = np != n ? b.pad(g0, K(b, 0.0, t), {0, 0, 0}, {0, 0, 1}, {0, 0, 0}) : g0;
  double tol = std::max(1.0, std::sqrt(static_cast<double>(m))) * epsOf(t);
  // V is always accumulated: the singular values are read from A V.
  std::vector<Value> state{b.constantInt(0, DType::I64), K(b, 1.0, t), g, eye(b, t, B, np, np)};
  auto out = sweepUntilConverged(b, state, [=](Builder& bb, const std::vector<Value>& st) {
    std::vector<Value> inner(st.begin() + 2, st.end());
    inner.insert(inner.begin(), bb.constant(0.0, t));
    auto r = countedLoop(bb, np - 1, inner, [=](Builder& b2, const Value&, const std::vector<Value>& s) {
      Value G = s[1];
      Value p = sliceDim(b2, G, 2, 0, h), q = sliceDim(b2, G, 2, h, np);
      Value alpha = sumDim(b2, mul(b2, p, p), 1), beta = sumDim(b2, mul(b2, q, q), 1);
      Value gamma = sumDim(b2, mul(b2, p, q), 1);
      Value rel = safeDiv(b2, b2.unary("abs", gamma), mul(b2, b2.unary("sqrt", alpha), b2.unary("sqrt", beta)));
      Value rotate = b2.compare(rel, full(b2, tol, rel), Cmp::GT);
      auto [c, sn] = jacobiRotation(b2, alpha, beta, gamma, rotate);
      std::vector<Value> next{b2.binary("maximum", s[0], maxAll(b2, rel)),
                              tournament(b2, rotateColumns(b2, G, c, sn), 2)};
      next.push_back(tournament(b2, rotateColumns(b2, s[2], c, sn), 2));
      return next;
    });
    // Measure > tol means this sweep rotated: run another.
    Value more = bb.select(bb.compare(r[0], bb.constant(tol, t), Cmp::GT), bb.constant(1.0, t), bb.constant(0.0, t));
    std::vector<Value> next{bb.binary("add", st[0], bb.constantInt(1, DType::I64)), more};
    next.insert(next.end(), r.begin() + 1, r.end());
    return next;
  });
  // Whole sweeps restore the original column order; drop the padding. The
  // singular values are the column norms of A V from the final (unit) V:
  // accurate to second order in V's error, while the rotated G carries
  // every rotation's rounding. U comes from the rotated G, whose columns
  // the sweeps made orthogonal.
  Value v = normalizeColumns(b, sliceDim(b, sliceDim(b, out[3], 2, 0, n), 1, 0, n));
  Value norms = norm2(b, batchedProduct(b, g0, v), 1);
  SvdParts res;
  Value s = mul(b, norms, bcast(b, scale, {B, n}, {0}));
  double noise = static_cast<double>(std::max(m, n)) * epsOf(t);
  if (!want_uv) {
    res.s = sortValues(b, s, true);
  } else {
    // Columns of G at rounding-noise level carry no direction: zero them
    // and sort them last, for orthonormalizeColumns to replace.
    Value g = sliceDim(b, out[2], 2, 0, n);
    Value gn = norm2(b, g, 1);
    Value floor = mul(b, bcast(b, reduceMax(b, gn, {1}), {B, n}, {0}), K(b, noise, t, {B, n}));
    Value null = b.compare(gn, floor, Cmp::LE);
    Value key = b.select(null, K(b, -1.0, t, {B, n}), norms);
    Value u = b.select(bcast(b, null, g.shape(), {0, 2}), full(b, 0.0, g), normalizeColumns(b, g));
    res.u = orthonormalizeColumns(b, sortColumns(b, key, u, true), noise * 8);
    res.v = sortColumns(b, key, v, true);
    res.s = sortByKey(b, key, s, true);
  }
  return res;
}

// _linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None) -> (U, S, Vh)
std::vector<Value> linalgSvd(Ctx& c) {
  Builder& b = c.b;
  Value A = c.tensor(0);
  DType t = checkReal(A, "svd");
  bool full_m = c.flagOr(1, false), uv = c.flagOr(2, true);
  // PyTorch accepts a driver only for cuSOLVER; the CPU raises, and so do we.
  if (c.has(3))
    throw std::runtime_error(
        "torch.linalg.svd: keyword argument `driver=` is only supported on CUDA inputs with "
        "cuSOLVER backend.");
  Batched bt = batchOf(A, 2);
  int64_t B = bt.count, m = A.shape()[A.rank() - 2], n = A.shape()[A.rank() - 1], k = std::min(m, n);
  auto zerosOf = [&](size_t i) { return b.zeros(c.expectedAt(i)); };
  auto eyeOf = [&](int64_t r, int64_t cc) { return b.reshape(eye(b, t, B, r, cc), withBatch(bt.batch, {r, cc})); };
  if (B == 0 || k == 0) {
    Value s = K(b, 0.0, t, withBatch(bt.batch, {k}));
    if (!uv) return {zerosOf(0), s, zerosOf(2)};
    return {full_m ? eyeOf(m, m) : eyeOf(m, k), s, full_m ? eyeOf(n, n) : eyeOf(k, n)};
  }
  Value a3 = b.reshape(A, {B, m, n});
  bool wide = m < n;  // work on A^T = V S U^T so that rows >= cols
  if (wide) a3 = swapLast(b, a3);
  SvdParts p = jacobiSvd(b, a3, uv);
  Value s = b.reshape(p.s, withBatch(bt.batch, {k}));
  if (!uv) return {zerosOf(0), s, zerosOf(2)};
  Value u = p.u, v = p.v;
  if (full_m) u = completeBasis(b, u);
  Value U = wide ? v : u, Vh = swapLast(b, wide ? u : v);
  return {b.reshape(U, withBatch(bt.batch, {U.shape()[1], U.shape()[2]})), s,
          b.reshape(Vh, withBatch(bt.batch, {Vh.shape()[1], Vh.shape()[2]}))};
}
Registrar reg_svd("_linalg_svd", linalgSvd);

// linalg_lstsq(A, B, rcond=None, *, driver=None) -> (solution, residuals,
// rank, singular_values). Every driver solves through the SVD: for full-rank
// A that is the unique least-squares (m >= n) or minimum-norm (m < n)
// solution LAPACK's QR-based drivers return; gelsd/gelss drop singular
// values below rcond * s_max as LAPACK does, gelsy's rank is estimated the
// same way. Outputs a driver does not compute are empty, as on the CPU.
std::vector<Value> linalgLstsq(Ctx& c) {
  Builder& b = c.b;
  Value A = c.tensor(0), X = c.tensor(1);
  DType t = checkReal(A, "lstsq");
  if (X.dtype() != t) throw ir::Unsupported("lstsq with mixed dtypes");
  std::string driver = c.has(3) ? c.str(3) : "gelsy";
  int64_t m = A.shape()[A.rank() - 2], n = A.shape()[A.rank() - 1];
  Shape a_lead(A.shape().begin(), A.shape().end() - 1);
  bool vec = X.rank() == 1 || (X.rank() == A.rank() - 1 && X.shape() == a_lead);
  if (vec) {
    Shape s = X.shape();
    s.push_back(1);
    X = b.reshape(X, s);
  }
  Batched bt = batchOf(A, 2);
  if (batchOf(X, 2).batch != bt.batch || X.shape()[X.rank() - 2] != m)
    throw ir::Unsupported("lstsq with broadcast batch dims");
  int64_t k = X.shape().back(), B = bt.count, r = std::min(m, n);
  bool svd_driver = driver == "gelsd" || driver == "gelss";
  Shape sol_shape = withBatch(bt.batch, {n, k});
  if (vec) sol_shape.pop_back();
  if (B == 0 || r == 0 || k == 0) {  // nothing to solve: a zero solution
    // As on the CPU: gels reports zero residuals for an empty A, the SVD
    // drivers |B|^2 (an empty A has full rank).
    Value residuals = K(b, 0.0, t, {0});
    if (m > n && driver != "gelsy") {
      residuals = sumDim(b, mul(b, X, X), X.rank() - 2);
      if (driver == "gels") residuals = full(b, 0.0, residuals);
    }
    Value rank = driver == "gels" ? b.constantInt(0, DType::I64, {0}) : b.constantInt(0, DType::I64, bt.batch);
    Value sv = svd_driver ? K(b, 0.0, t, withBatch(bt.batch, {r})) : K(b, 0.0, t, {0});
    return {K(b, 0.0, t, sol_shape), residuals, rank, sv};
  }
  // The SVD drivers return residuals only when every matrix has full rank:
  // a data-dependent shape.
  if (svd_driver && m > n) throw ir::Unsupported("lstsq residuals of " + driver);
  double rcond = c.has(2) ? c.f64(2) : epsOf(t) * static_cast<double>(std::max(m, n));
  // A negative rcond means machine precision to gelsd/gelss; gelsy then
  // truncates nothing.
  if (rcond < 0) rcond = driver == "gelsy" ? 0.0 : epsOf(t);
  Value a3 = b.reshape(A, {B, m, n}), x3 = b.reshape(X, {B, m, k});
  bool wide = m < n;
  SvdParts p = jacobiSvd(b, wide ? swapLast(b, a3) : a3, true);
  Value U = wide ? p.v : p.u, V = wide ? p.u : p.v;  // (B, m, r), (B, n, r)
  Value s = p.s;                                     // (B, r) descending
  Value thr = driver == "gels" ? K(b, 0.0, t, {B, r})
                               : bcast(b, mul(b, sliceDim(b, s, 1, 0, 1), K(b, rcond, t, {B, 1})), {B, r}, {0, 1});
  Value keep = b.compare(s, thr, Cmp::GT);
  Value sinv = b.select(keep, div(b, full(b, 1.0, s), b.select(keep, s, full(b, 1.0, s))), full(b, 0.0, s));
  Value utb = b.dotGeneral(U, x3, {0}, {0}, {1}, {1}, t, "HIGHEST");  // (B, r, k)
  utb = mul(b, utb, bcast(b, sinv, {B, r, k}, {0, 1}));
  Value sol = batchedProduct(b, V, utb);  // (B, n, k)
  Value residuals = K(b, 0.0, t, {0});
  if (driver == "gels" && m > n) {
    Value e = sub(b, batchedProduct(b, a3, sol), x3);
    residuals = b.reshape(sumDim(b, mul(b, e, e), 1), withBatch(bt.batch, {k}));
  }
  Value rank = b.constantInt(0, DType::I64, {0});
  if (driver != "gels") rank = b.reshape(sumDim(b, b.convert(keep, DType::I64), 1), bt.batch);
  Value sv = svd_driver ? b.reshape(s, withBatch(bt.batch, {r})) : K(b, 0.0, t, {0});
  return {b.reshape(sol, sol_shape), residuals, rank, sv};
}
Registrar reg_lstsq("linalg_lstsq", linalgLstsq);

// ------------------------------------------------------------------ QR ops

// geqrf(self) -> (a, tau)
Registrar reg_geqrf("geqrf", [](Ctx& c) {
  Builder& b = c.b;
  Value A = c.tensor(0);
  DType t = checkReal(A, "geqrf");
  Batched bt = batchOf(A, 2);
  int64_t m = A.shape()[A.rank() - 2], n = A.shape()[A.rank() - 1], k = std::min(m, n);
  if (bt.count == 0) return std::vector<Value>{A, K(b, 0.0, t, withBatch(bt.batch, {k}))};
  auto [a, tau] = geqrf(b, b.reshape(A, {bt.count, m, n}));
  return std::vector<Value>{b.reshape(a, A.shape()), b.reshape(tau, withBatch(bt.batch, {k}))};
});

// linalg_qr(A, mode='reduced') -> (Q, R)
Registrar reg_qr("linalg_qr", [](Ctx& c) {
  Builder& b = c.b;
  Value A = c.tensor(0);
  DType t = checkReal(A, "qr");
  std::string mode = c.has(1) ? c.str(1) : "reduced";
  Batched bt = batchOf(A, 2);
  int64_t B = bt.count, m = A.shape()[A.rank() - 2], n = A.shape()[A.rank() - 1], k = std::min(m, n);
  bool complete = mode == "complete";
  int64_t qcols = complete ? m : k, rrows = complete ? m : k;
  if (B == 0) {
    Value q = mode == "r" ? b.zeros(c.expectedAt(0)) : K(b, 0.0, t, withBatch(bt.batch, {m, qcols}));
    return std::vector<Value>{q, K(b, 0.0, t, withBatch(bt.batch, {rrows, n}))};
  }
  auto [a, tau] = geqrf(b, b.reshape(A, {B, m, n}));
  Value r = triu(b, sliceDim(b, a, 1, 0, rrows));
  Value R = b.reshape(r, withBatch(bt.batch, {rrows, n}));
  if (mode == "r") return std::vector<Value>{b.zeros(c.expectedAt(0)), R};
  Value q = householderProduct(b, a, tau, qcols);
  return std::vector<Value>{b.reshape(q, withBatch(bt.batch, {m, qcols})), R};
});

// linalg_householder_product(input (m, n), tau (k)) -> Q[:, :n]
Registrar reg_hh("linalg_householder_product", [](Ctx& c) {
  Builder& b = c.b;
  Value A = c.tensor(0), tau = c.tensor(1);
  checkReal(A, "householder_product");
  Batched bt = batchOf(A, 2);
  int64_t m = A.shape()[A.rank() - 2], n = A.shape()[A.rank() - 1], k = tau.shape().back();
  if (bt.count == 0) return std::vector<Value>{A};
  Value a3 = b.reshape(A, {bt.count, m, n});
  Value t2 = b.reshape(b.convert(tau, A.dtype()), {bt.count, k});
  return std::vector<Value>{b.reshape(householderProduct(b, a3, t2, n), A.shape())};
});

// ormqr(self (m, k'), tau (k), other, left=True, transpose=False) -> op(Q) other
Registrar reg_ormqr("ormqr", [](Ctx& c) {
  Builder& b = c.b;
  Value A = c.tensor(0), tau = c.tensor(1), X = c.tensor(2);
  DType t = checkReal(A, "ormqr");
  bool left = c.flagOr(3, true), transpose = c.flagOr(4, false);
  Batched bt = batchOf(A, 2);
  int64_t m = A.shape()[A.rank() - 2], n = A.shape()[A.rank() - 1], k = tau.shape().back();
  int64_t xr = X.shape()[X.rank() - 2], xc = X.shape()[X.rank() - 1];
  if (bt.count == 0 || batchOf(X, 2).count != bt.count) {
    if (bt.count == 0) return std::vector<Value>{X};
    throw ir::Unsupported("ormqr with broadcast batch dims");
  }
  Value r = applyReflectors(b, b.reshape(A, {bt.count, m, n}), b.reshape(b.convert(tau, t), {bt.count, k}),
                            b.reshape(b.convert(X, t), {bt.count, xr, xc}), left, transpose);
  return std::vector<Value>{b.reshape(r, X.shape())};
});

// ------------------------------------------------------------------ eigh

// Two-sided cyclic Jacobi on symmetric a (B, n, n): eigenvalues ascending
// (B, n) and, with want_v, eigenvectors as columns (B, n, n).
std::pair<Value, Value> jacobiEigh(Builder& b, const Value& a, bool want_v) {
  DType t = a.dtype();
  int64_t B = a.shape()[0], n = a.shape()[1], np = n + (n & 1), h = np / 2;
  Value scale = matrixScale(b, a);
  Value x0 = div(b, a, bcast(b, scale, a.shape(), {0}));
  // An odd n gets a zero row and column: decoupled, it never rotates.
  Value x = np != n ? b.pad(x0, K(b, 0.0, t), {0, 0, 0}, {0, 1, 1}, {0, 0, 0}) : x0;
  // Off-diagonal entries below eps * |A|_F are negligible (LAPACK's
  // backward error is of that size too).
  Value fro = b.unary("sqrt", reduceSum(b, mul(b, x, x), {1, 2}));
  Value thr = mul(b, fro, K(b, epsOf(t), t, {B}));
  std::vector<Value> state{b.constantInt(0, DType::I64), K(b, 1.0, t), x, thr, eye(b, t, B, np, np)};
  auto out = sweepUntilConverged(b, state, [=](Builder& bb, const std::vector<Value>& st) {
    std::vector<Value> inner(st.begin() + 2, st.end());
    inner.insert(inner.begin(), bb.constant(0.0, t));
    auto r = countedLoop(bb, np - 1, inner, [=](Builder& b2, const Value&, const std::vector<Value>& s) {
      Value X = s[1], T = s[2];
      Shape hh{B, h, h};
      Value d = b2.compare(iotaI(b2, hh, 1), iotaI(b2, hh, 2), Cmp::EQ);
      auto diagOf = [&](int64_t r0, int64_t c0) {
        Value blk = b2.slice(X, {0, r0, c0}, {B, r0 + h, c0 + h}, {1, 1, 1});
        return sumDim(b2, b2.select(d, blk, full(b2, 0.0, blk)), 2);
      };
      Value app = diagOf(0, 0), aqq = diagOf(h, h), apq = diagOf(0, h);
      Value rotate = b2.compare(b2.unary("abs", apq), bcast(b2, T, {B, h}, {0}), Cmp::GT);
      auto [c, sn] = jacobiRotation(b2, app, aqq, apq, rotate);
      X = rotateColumns(b2, rotateRows(b2, X, c, sn), c, sn);
      // The rotated pairs' off-diagonal entries are zero by construction.
      Shape s3{B, np, np};
      Value ri = iotaI(b2, s3, 1), ci = iotaI(b2, s3, 2);
      Value diff = b2.binary("subtract", ri, ci);
      Value pair = b2.binary("or", b2.compare(diff, KI(b2, h, s3), Cmp::EQ), b2.compare(diff, KI(b2, -h, s3), Cmp::EQ));
      Value rot2 = bcast(b2, b2.concatenate({rotate, rotate}, 1), s3, {0, 1});
      X = b2.select(b2.binary("and", pair, rot2), full(b2, 0.0, X), X);
      Value any = maxAll(b2, b2.convert(rotate, t));
      std::vector<Value> next{b2.binary("maximum", s[0], any), tournament(b2, tournament(b2, X, 1), 2), T};
      next.push_back(tournament(b2, rotateColumns(b2, s[3], c, sn), 2));
      return next;
    });
    std::vector<Value> next{bb.binary("add", st[0], bb.constantInt(1, DType::I64))};
    next.insert(next.end(), r.begin(), r.end());
    return next;
  });
  // Eigenvalues as Rayleigh quotients v^T A v of the final vectors: second
  // order in the vectors' error, unlike the diagonal, which carries the
  // rounding of every rotation.
  Value v = normalizeColumns(b, sliceDim(b, sliceDim(b, out[4], 2, 0, n), 1, 0, n));
  Value w = sumDim(b, mul(b, v, batchedProduct(b, x0, v)), 1);
  w = mul(b, w, bcast(b, scale, {B, n}, {0}));
  if (want_v) v = sortColumns(b, w, v, false);
  return {sortValues(b, w, false), v};
}

// _linalg_eigh(A, UPLO='L', compute_v=True) -> (eigenvalues, eigenvectors)
Registrar reg_eigh("_linalg_eigh", [](Ctx& c) {
  Builder& b = c.b;
  Value A = c.tensor(0);
  DType t = checkReal(A, "eigh");
  std::string uplo = c.has(1) ? c.str(1) : "L";
  bool want_v = c.flagOr(2, true);
  Batched bt = batchOf(A, 2);
  int64_t B = bt.count, n = A.shape().back();
  if (B == 0 || n == 0) {
    Value w = K(b, 0.0, t, withBatch(bt.batch, {n}));
    return std::vector<Value>{w, want_v ? K(b, 0.0, t, A.shape()) : b.zeros(c.expectedAt(1))};
  }
  Value a3 = b.reshape(A, {B, n, n});
  // Only the UPLO triangle is read: mirror it.
  Value ri = iotaI(b, a3.shape(), 1), ci = iotaI(b, a3.shape(), 2);
  Value mine = b.compare(ri, ci, uplo == "U" || uplo == "u" ? Cmp::LE : Cmp::GE);
  a3 = b.select(mine, a3, swapLast(b, a3));
  auto [w, v] = jacobiEigh(b, a3, want_v);
  Value W = b.reshape(w, withBatch(bt.batch, {n}));
  return std::vector<Value>{W, want_v ? b.reshape(v, A.shape()) : b.zeros(c.expectedAt(1))};
});

}  // namespace
}  // namespace tpu::ops

namespace tpu::ops {
namespace {

// linalg_matrix_exp(A): scaling and squaring. Each matrix is scaled by 2^-s
// so that its 1-norm is at most 2, a degree-18 Taylor polynomial (Horner)
// approximates exp to far below float32 rounding (2^19/19! ~ 4e-12), and s
// squarings undo the scaling; s differs per matrix, so the squaring loop
// runs to the largest and each matrix stops at its own s.
Registrar reg_matrix_exp("linalg_matrix_exp", [](Ctx& c) {
  Builder& b = c.b;
  Value A = c.tensor(0);
  DType t = checkReal(A, "matrix_exp");
  if (A.type.numel() == 0) return std::vector<Value>{A};
  Batched bt = batchOf(A, 2);
  int64_t B = bt.count, n = A.shape().back();
  Value a = b.reshape(A, {B, n, n});
  Value norm1 = reduceMax(b, sumDim(b, b.unary("abs", a), 1), {1});  // (B)
  Value s = b.unary("ceil", div(b, b.unary("log", div(b, norm1, full(b, 2.0, norm1))), full(b, std::log(2.0), norm1)));
  // NaN fails the comparison and stays unscaled; inf is capped.
  s = b.select(b.compare(s, full(b, 0.0, s), Cmp::GT), b.binary("minimum", s, full(b, 100.0, s)), full(b, 0.0, s));
  // 2^-s built from its exponent bits: exact, unlike exp(-s log 2).
  bool f64 = t == DType::F64;
  DType bits = f64 ? DType::I64 : DType::I32;
  Value si = b.convert(s, bits);
  Value expo = b.binary("subtract", b.constantInt(f64 ? 1023 : 127, bits, {B}), si);
  Value pow2 = b.bitcast(b.binary("shift_left", expo, b.constantInt(f64 ? 52 : 23, bits, {B})), Type{t, {B}});
  Value scaled = mul(b, a, bcast(b, pow2, {B, n, n}, {0}));
  Value I = eye(b, t, B, n, n);
  Value e = I;
  for (int k = 18; k >= 1; --k) e = add(b, I, mul(b, batchedProduct(b, scaled, e), K(b, 1.0 / k, t, {B, n, n})));
  Value smax = reduceMax(b, si, {0});
  auto r = b.whileLoop(
      {b.constantInt(0, bits), e, si, smax},
      [](Builder& bb, const std::vector<Value>& st) { return std::vector<Value>{bb.compare(st[0], st[3], Cmp::LT)}; },
      [=](Builder& bb, const std::vector<Value>& st) {
        Value sq = batchedProduct(bb, st[1], st[1]);
        Value more = bcast(bb, bb.compare(bb.broadcastTo(st[0], {B}), st[2], Cmp::LT), {B, n, n}, {0});
        return std::vector<Value>{bb.binary("add", st[0], bb.constantInt(1, bits)), bb.select(more, sq, st[1]), st[2],
                                  st[3]};
      });
  return std::vector<Value>{b.reshape(r[1], A.shape())};
});

}  // namespace
}  // namespace tpu::ops
