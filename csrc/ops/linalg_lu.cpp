// The Cholesky and LU families of torch.linalg, batched over leading dims.
// Cholesky and triangular solves map to stablehlo.cholesky and
// stablehlo.triangular_solve. LU is Gaussian elimination with partial
// pivoting as a stablehlo.while over the columns; the pivot is the first row
// of largest |a| in the column, as LAPACK's getrf picks it, so pivots and
// info agree with the CPU's. Only float32/float64 (what PyTorch's CPU
// linalg accepts among our real types); others fall back.
#include <algorithm>

#include "ops/common.h"

namespace tpu::ops {
namespace {

using ir::Builder;
using ir::Cmp;

void requireLinalgType(const Value& v) {
  if (v.dtype() != DType::F32 && v.dtype() != DType::F64)
    throw ir::Unsupported(std::string("linalg on ") + ir::dtypeName(v.dtype()));
}

Value i32(Builder& b, int64_t v, const Shape& shape = {}) { return b.constantInt(v, DType::I32, shape); }

int64_t product(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}
Shape batchOf(const Value& v, int trailing = 2) { return Shape(v.shape().begin(), v.shape().end() - trailing); }
Shape concat(Shape a, const Shape& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// [..., m, n] -> [B, m, n] and back.
Value flat(Builder& b, const Value& v) {
  const Shape& s = v.shape();
  return b.reshape(v, {product(batchOf(v)), s[s.size() - 2], s.back()});
}
Value unflat(Builder& b, const Value& v, const Shape& batch) {
  return b.reshape(v, concat(batch, {v.shape()[1], v.shape()[2]}));
}

// Swaps the last two dims.
Value mT(Builder& b, const Value& v) {
  std::vector<int64_t> perm;
  for (int64_t i = 0; i < v.rank(); ++i) perm.push_back(i);
  std::swap(perm[v.rank() - 1], perm[v.rank() - 2]);
  return b.transpose(v, perm);
}

// Broadcasts the batch dims of a matrix (or of a [..., n] vector) to `batch`.
Value toBatch(Builder& b, const Value& v, const Shape& batch, int trailing = 2) {
  Shape s = batch;
  for (int i = trailing; i > 0; --i) s.push_back(v.shape()[v.rank() - i]);
  return b.broadcastTo(v, s);
}

// Over the last two dims: col - row <= k (lower) or >= k (upper).
Value triMask(Builder& b, const Shape& shape, int64_t k, bool lower) {
  int r = static_cast<int>(shape.size());
  Value d = b.binary("subtract", b.iota({DType::I64, shape}, r - 1), b.iota({DType::I64, shape}, r - 2));
  return b.compare(d, b.constantInt(k, DType::I64, shape), lower ? Cmp::LE : Cmp::GE);
}
Value tri(Builder& b, const Value& x, int64_t k, bool lower) {
  return b.select(triMask(b, x.shape(), k, lower), x, b.zeros(x.type));
}
Value diagMask(Builder& b, const Shape& shape) {
  int r = static_cast<int>(shape.size());
  return b.compare(b.iota({DType::I64, shape}, r - 1), b.iota({DType::I64, shape}, r - 2), Cmp::EQ);
}
Value eye(Builder& b, DType t, const Shape& shape) { return b.convert(diagMask(b, shape), t); }
// The main diagonal of [..., n, n] as [..., n] (exact: the rest is selected away).
Value diagOf(Builder& b, const Value& x) {
  Value d = b.select(diagMask(b, x.shape()), x, b.zeros(x.type));
  return reduceSum(b, d, {x.rank() - 1});
}

// ---------------------------------------------------------------- Cholesky

// The factor of the lower (or upper) triangle of `a`, zero in the other one.
Value choleskyFactor(Builder& b, const Value& a, bool upper) {
  if (a.type.numel() == 0) return a;
  return tri(b, b.cholesky(a, !upper), 0, !upper);
}

// LAPACK's potrf info: the 1-based order of the first leading minor of the
// symmetric matrix read from `a`'s lower triangle that is not positive
// definite, else 0. stablehlo.cholesky turns a failed factor into NaNs
// everywhere, so the order comes from an elimination loop that runs only
// when some factor in the batch failed.
Value choleskyInfo(Builder& b, const Value& a, const Value& factor) {
  const Shape batch = batchOf(a);
  const int64_t n = a.shape().back(), bs = product(batch);
  if (n == 0 || bs == 0) return i32(b, 0, batch);
  Value fd = diagOf(b, factor);
  Value bad = b.unary("not", b.compare(fd, b.zeros(fd.type), Cmp::GT));
  std::vector<int64_t> all;
  for (int64_t i = 0; i < bad.rank(); ++i) all.push_back(i);
  Value failed = reduceMax(b, bad, all);
  Value s = flat(b, a);
  s = add(b, tri(b, s, 0, true), mT(b, tri(b, s, -1, true)));
  auto cond = [n](Builder& bb, const std::vector<Value>& st) {
    return std::vector<Value>{bb.binary("and", bb.compare(st[0], i32(bb, n), Cmp::LT), st[3])};
  };
  auto body = [=](Builder& bb, const std::vector<Value>& st) {
    Value j = st[0], S = st[1], info = st[2];
    Value zero = i32(bb, 0);
    const Shape full{bs, n, n};
    Value d = bb.dynamicSlice(S, {zero, j, j}, {bs, 1, 1});
    Value not_pd = bb.reshape(bb.unary("not", bb.compare(d, bb.zeros(d.type), Cmp::GT)), {bs});
    Value jb = bb.broadcastTo(j, {bs});
    Value first = bb.binary("and", bb.compare(info, i32(bb, 0, {bs}), Cmp::EQ), not_pd);
    info = bb.select(first, bb.binary("add", jb, i32(bb, 1, {bs})), info);
    // S[i, c] -= S[i, j] S[j, c] / d below and right of the pivot.
    Value col = bb.dynamicSlice(S, {zero, zero, j}, {bs, n, 1});
    Value row = bb.dynamicSlice(S, {zero, j, zero}, {bs, 1, n});
    Value lf = bb.broadcastTo(div(bb, col, bb.broadcastTo(d, {bs, n, 1})), full);
    Value R = bb.iota({DType::I32, full}, 1), C = bb.iota({DType::I32, full}, 2), jf = bb.broadcastTo(j, full);
    Value trailing = bb.binary("and", bb.compare(R, jf, Cmp::GT), bb.compare(C, jf, Cmp::GT));
    S = bb.select(trailing, sub(bb, S, mul(bb, lf, bb.broadcastTo(row, full))), S);
    return std::vector<Value>{bb.binary("add", j, i32(bb, 1)), S, info, st[3]};
  };
  auto r = b.whileLoop({i32(b, 0), s, i32(b, 0, {bs}), failed}, cond, body);
  return b.reshape(r[2], batch);
}

// Solves (F F^H) x = rhs for a lower factor, (F^H F) x = rhs for an upper one.
Value choleskySolve(Builder& b, const Value& factor, const Value& rhs, bool upper) {
  if (factor.type.numel() == 0 || rhs.type.numel() == 0) return b.zeros(rhs.type);
  Value f = tri(b, factor, 0, !upper);
  Value y = b.triangularSolve(f, rhs, true, !upper, false, upper);
  return b.triangularSolve(f, y, true, !upper, false, !upper);
}

std::vector<Value> linalgCholeskyEx(Ctx& c) {
  Value a = c.tensor(0);
  requireLinalgType(a);
  if (c.flagOr(2, false)) throw ir::Unsupported("check_errors raises on the host");
  bool upper = c.flagOr(1, false);
  Value l = choleskyFactor(c.b, a, upper);
  return {l, choleskyInfo(c.b, upper ? mT(c.b, a) : a, l)};
}
Registrar reg_linalg_cholesky_ex("linalg_cholesky_ex", linalgCholeskyEx);

Registrar reg_cholesky("cholesky", [](Ctx& c) {
  Value a = c.tensor(0);
  requireLinalgType(a);
  return std::vector<Value>{choleskyFactor(c.b, a, c.flagOr(1, false))};
});

// _cholesky_solve_helper(self=B, A=factor, upper): batch dims already broadcast.
Registrar reg_cholesky_solve_helper("_cholesky_solve_helper", [](Ctx& c) {
  Value rhs = c.tensor(0), f = c.tensor(1);
  requireLinalgType(f);
  Shape batch = broadcastShapes(batchOf(rhs), batchOf(f));
  return std::vector<Value>{choleskySolve(c.b, toBatch(c.b, f, batch), toBatch(c.b, rhs, batch), c.flag(2))};
});

Registrar reg_cholesky_inverse("cholesky_inverse", [](Ctx& c) {
  Value f = c.tensor(0);
  requireLinalgType(f);
  return std::vector<Value>{choleskySolve(c.b, f, eye(c.b, f.dtype(), f.shape()), c.flagOr(1, false))};
});

// linalg_solve_triangular(A, B, *, upper, left, unitriangular)
Registrar reg_linalg_solve_triangular("linalg_solve_triangular", [](Ctx& c) {
  Value a = c.tensor(0), rhs = c.tensor(1);
  requireLinalgType(a);
  bool upper = c.flag(2), left = c.flagOr(3, true), unit = c.flagOr(4, false);
  Shape batch = broadcastShapes(batchOf(a), batchOf(rhs));
  Value aa = tri(c.b, toBatch(c.b, a, batch), 0, !upper), bb = toBatch(c.b, rhs, batch);
  if (aa.type.numel() == 0 || bb.type.numel() == 0) return std::vector<Value>{c.b.zeros(bb.type)};
  return std::vector<Value>{c.b.triangularSolve(aa, bb, left, !upper, unit, false)};
});

// triangular_solve(B, A, upper, transpose, unitriangular) -> (X, A broadcast)
Registrar reg_triangular_solve("triangular_solve", [](Ctx& c) {
  Value rhs = c.tensor(0), a = c.tensor(1);
  requireLinalgType(a);
  bool upper = c.flagOr(2, true), trans = c.flagOr(3, false), unit = c.flagOr(4, false);
  Shape batch = broadcastShapes(batchOf(a), batchOf(rhs));
  Value ab = toBatch(c.b, a, batch), bb = toBatch(c.b, rhs, batch);
  Value x = ab.type.numel() == 0 || bb.type.numel() == 0
                ? c.b.zeros(bb.type)
                : c.b.triangularSolve(tri(c.b, ab, 0, !upper), bb, true, !upper, unit, trans);
  return std::vector<Value>{x, ab};
});

// ---------------------------------------------------------------- LU

// x[b, idx[b, i], :] for every row i (idx: i32 [B, r]).
Value takeRows(Builder& b, const Value& x, const Value& idx) {
  int64_t bs = x.shape()[0], m = x.shape()[1], n = x.shape()[2], r = idx.shape()[1];
  Value base = b.binary("multiply", b.iota({DType::I32, {bs, r}}, 0), i32(b, m, {bs, r}));
  Value at = b.reshape(b.binary("add", idx, base), {bs * r, 1});
  Builder::GatherDims dn;
  dn.offset_dims = {1};
  dn.collapsed_slice_dims = {0};
  dn.start_index_map = {0};
  dn.index_vector_dim = 1;
  return b.reshape(b.gather(b.reshape(x, {bs * m, n}), at, dn, {1, n}), {bs, r, n});
}

struct Factored {
  Value lu;    // [B, m, n]: unit-lower L below the diagonal, U on and above
  Value piv;   // i32 [B, k], 1-based rows swapped with row i at step i
  Value info;  // i32 [B]: 1-based index of the first exactly-zero pivot, else 0
};

Factored luFactor(Builder& b, const Value& a) {
  const int64_t bs = a.shape()[0], m = a.shape()[1], n = a.shape()[2], k = std::min(m, n);
  const DType t = a.dtype();
  Value piv0 = i32(b, 0, {bs, k}), info0 = i32(b, 0, {bs});
  if (k == 0) return {a, piv0, info0};
  auto cond = [k](Builder& bb, const std::vector<Value>& st) {
    return std::vector<Value>{bb.compare(st[0], i32(bb, k), Cmp::LT)};
  };
  auto body = [=](Builder& bb, const std::vector<Value>& st) {
    Value j = st[0], piv = st[2], info = st[3];
    // The previous step's update (see below).
    Value A = sub(bb, st[1], st[4]);
    Value zero = i32(bb, 0);
    const Shape bm{bs, m}, full{bs, m, n};
    Value rows = bb.iota({DType::I32, bm}, 1);
    Value jm = bb.broadcastTo(j, bm);
    // Pivot row: the first of the largest |a[i, j]| over rows i >= j.
    Value col = bb.reshape(bb.dynamicSlice(A, {zero, zero, j}, {bs, m, 1}), bm);
    Value mag = bb.select(bb.compare(rows, jm, Cmp::GE), bb.unary("abs", col), bb.constant(-1.0, t, bm));
    Value mx = bb.broadcastInDim(reduceMax(bb, mag, {1}), bm, {0});
    Value p = reduceMin(bb, bb.select(bb.compare(mag, mx, Cmp::EQ), rows, i32(bb, m, bm)), {1});
    Value jb = bb.broadcastTo(j, {bs});
    p = bb.select(bb.compare(p, i32(bb, m, {bs}), Cmp::EQ), jb, p);  // NaN column: no swap
    piv = bb.dynamicUpdateSlice(piv, bb.reshape(bb.binary("add", p, i32(bb, 1, {bs})), {bs, 1}), {zero, j});
    // Swap rows j and p (whole rows, as getrf does).
    Value pm = bb.broadcastInDim(p, bm, {0});
    Value sigma = bb.select(bb.compare(rows, jm, Cmp::EQ), pm, bb.select(bb.compare(rows, pm, Cmp::EQ), jm, rows));
    A = takeRows(bb, A, sigma);
    // Eliminate below the pivot. A zero pivot leaves its column unscaled
    // (it is all zeros below) and sets info, as LAPACK does.
    Value d = bb.dynamicSlice(A, {zero, j, j}, {bs, 1, 1});
    Value dz = bb.compare(d, bb.zeros(d.type), Cmp::EQ);
    Value dsafe = bb.select(dz, bb.constant(1.0, t, {bs, 1, 1}), d);
    Value a = bb.dynamicSlice(A, {zero, zero, j}, {bs, m, 1});
    Value u = bb.dynamicSlice(A, {zero, j, zero}, {bs, 1, n});
    // Scale by the reciprocal (by the pivot itself when that would
    // overflow) and update with the rounded product l * u, as getrf does.
    // The product is subtracted at the start of the next iteration (or
    // after the loop): a loop boundary keeps XLA from contracting the two
    // into a fused multiply-add, which rounds differently from the CPU's
    // LAPACK (there, e.g., a singular matrix with proportional rows gets an
    // exact zero pivot and det 0).
    Value sfmin = bb.constant(t == DType::F64 ? 2.2250738585072014e-308 : 1.17549435e-38, t, {bs, 1, 1});
    Value big = bb.compare(bb.unary("abs", dsafe), sfmin, Cmp::GE);
    Value dm = bb.broadcastTo(dsafe, {bs, m, 1});
    Value recip = bb.broadcastTo(div(bb, bb.constant(1.0, t, {bs, 1, 1}), dsafe), {bs, m, 1});
    Value l = bb.select(bb.broadcastTo(big, {bs, m, 1}), mul(bb, a, recip), div(bb, a, dm));
    Value lf = bb.broadcastTo(l, full);
    Value prod = mul(bb, lf, bb.broadcastTo(u, full));
    Value R = bb.iota({DType::I32, full}, 1), C = bb.iota({DType::I32, full}, 2), jf = bb.broadcastTo(j, full);
    Value below = bb.compare(R, jf, Cmp::GT);
    Value right = bb.binary("and", below, bb.compare(C, jf, Cmp::GT));
    Value oncol = bb.binary("and", below, bb.compare(C, jf, Cmp::EQ));
    Value pending = bb.select(right, prod, bb.zeros(prod.type));
    A = bb.select(oncol, lf, A);
    Value first = bb.binary("and", bb.compare(info, i32(bb, 0, {bs}), Cmp::EQ), bb.reshape(dz, {bs}));
    info = bb.select(first, bb.binary("add", jb, i32(bb, 1, {bs})), info);
    return std::vector<Value>{bb.binary("add", j, i32(bb, 1)), A, piv, info, pending};
  };
  auto r = b.whileLoop({i32(b, 0), a, piv0, info0, b.zeros(a.type)}, cond, body);
  return {sub(b, r[1], r[4]), r[2], r[3]};
}

// The row permutation of an LU: perm [B, m] (i32) with LU = A[perm], i.e.
// the swaps of `piv` ([B, k], 1-based) applied in order to 0..m-1.
Value permFromPivots(Builder& b, const Value& piv, int64_t m) {
  const int64_t bs = piv.shape()[0], k = piv.shape()[1];
  const Shape bm{bs, m};
  Value perm0 = b.iota({DType::I32, bm}, 1);
  if (k == 0 || m == 0) return perm0;
  auto cond = [k](Builder& bb, const std::vector<Value>& st) {
    return std::vector<Value>{bb.compare(st[0], i32(bb, k), Cmp::LT)};
  };
  auto body = [=](Builder& bb, const std::vector<Value>& st) {
    Value i = st[0], pv = st[1], perm = st[2];
    Value zero = i32(bb, 0);
    Value rows = bb.iota({DType::I32, bm}, 1);
    Value p = bb.binary("subtract", bb.reshape(bb.dynamicSlice(pv, {zero, i}, {bs, 1}), {bs}), i32(bb, 1, {bs}));
    p = bb.clamp(i32(bb, 0, {bs}), p, i32(bb, m - 1, {bs}));
    Value pm = bb.broadcastInDim(p, bm, {0}), im = bb.broadcastTo(i, bm);
    Value vi = bb.broadcastInDim(bb.reshape(bb.dynamicSlice(perm, {zero, i}, {bs, 1}), {bs}), bm, {0});
    Value at_p = bb.compare(rows, pm, Cmp::EQ);
    Value vp = bb.broadcastInDim(reduceSum(bb, bb.select(at_p, perm, i32(bb, 0, bm)), {1}), bm, {0});
    perm = bb.select(bb.compare(rows, im, Cmp::EQ), vp, bb.select(at_p, vi, perm));
    return std::vector<Value>{bb.binary("add", i, i32(bb, 1)), pv, perm};
  };
  return b.whileLoop({i32(b, 0), piv, perm0}, cond, body)[2];
}

// inv[b, perm[b, i]] = i
Value invertPerm(Builder& b, const Value& perm) {
  Value idx = b.iota(perm.type, 1);
  return b.sort({perm, idx}, 1, true, [](Builder& bb, const std::vector<Value>& a) {
    return std::vector<Value>{bb.compare(a[0], a[1], Cmp::LT)};
  })[1];
}

// P [B, m, m] with A = P L U: P[r, c] = (r == perm[c]).
Value permMatrix(Builder& b, const Value& perm, DType t) {
  int64_t bs = perm.shape()[0], m = perm.shape()[1];
  Shape s{bs, m, m};
  return b.convert(b.compare(b.iota({DType::I32, s}, 1), b.broadcastInDim(perm, s, {0, 2}), Cmp::EQ), t);
}

// Solves A x = rhs (or A^T x = rhs) with A = P L U; all [B, ...].
Value luSolve(Builder& b, const Value& lu, const Value& perm, const Value& rhs, bool adjoint) {
  if (lu.type.numel() == 0 || rhs.type.numel() == 0) return b.zeros(rhs.type);
  Value L = tri(b, lu, -1, true), U = tri(b, lu, 0, false);
  if (!adjoint) {
    Value y = b.triangularSolve(L, takeRows(b, rhs, perm), true, true, true, false);
    return b.triangularSolve(U, y, true, false, false, false);
  }
  Value y = b.triangularSolve(U, rhs, true, false, false, true);
  y = b.triangularSolve(L, y, true, true, true, true);
  return takeRows(b, y, invertPerm(b, perm));
}

// lu_solve with PyTorch's broadcasting and left/adjoint options.
// lu [..., n, n], piv [..., n], rhs [..., n, r] (or [..., r, n] when !left).
Value luSolveOp(Builder& b, const Value& lu, const Value& piv, Value rhs, bool left, bool adjoint) {
  if (!left) {
    adjoint = !adjoint;
    rhs = mT(b, rhs);
  }
  Shape batch = broadcastShapes(batchOf(lu), batchOf(rhs));
  int64_t n = lu.shape().back();
  Value luf = flat(b, toBatch(b, lu, batch));
  Value pf = b.reshape(b.convert(toBatch(b, piv, batch, 1), DType::I32), {product(batch), piv.shape().back()});
  Value x = unflat(b, luSolve(b, luf, permFromPivots(b, pf, n), flat(b, toBatch(b, rhs, batch)), adjoint), batch);
  return left ? x : mT(b, x);
}

Factored factorOp(Builder& b, const Value& a) {
  Shape batch = batchOf(a);
  Factored f = luFactor(b, flat(b, a));
  int64_t k = std::min(a.shape()[a.rank() - 2], a.shape().back());
  return {unflat(b, f.lu, batch), b.reshape(f.piv, concat(batch, {k})), b.reshape(f.info, batch)};
}

// det(P) from the pivots ([..., k]): -1 per actual swap.
Value pivotSign(Builder& b, const Value& piv, DType t) {
  int r = piv.rank();
  Value idx = b.binary("add", b.iota({DType::I32, piv.shape()}, r - 1), i32(b, 1, piv.shape()));
  Value swapped = b.convert(b.compare(piv, idx, Cmp::NE), DType::I32);
  Value odd = b.binary("remainder", reduceSum(b, swapped, {r - 1}), i32(b, 2, batchOf(piv, 1)));
  Value one = b.constant(1.0, t, odd.shape());
  return b.select(b.compare(odd, i32(b, 1, odd.shape()), Cmp::EQ), b.constant(-1.0, t, odd.shape()), one);
}

Value reduceProd(Builder& b, const Value& v, int64_t dim) {
  return b.reduce({v}, {b.constant(1.0, v.dtype())}, {dim}, [](Builder& bb, const std::vector<Value>& a) {
    return std::vector<Value>{bb.binary("multiply", a[0], a[1])};
  })[0];
}

// linalg_lu_factor_ex(A, *, pivot, check_errors) -> (LU, pivots, info)
Registrar reg_lu_factor_ex("linalg_lu_factor_ex", [](Ctx& c) {
  Value a = c.tensor(0);
  requireLinalgType(a);
  if (!c.flagOr(1, true)) throw ir::Unsupported("LU without pivoting");
  if (c.flagOr(2, false)) throw ir::Unsupported("check_errors raises on the host");
  Factored f = factorOp(c.b, a);
  return std::vector<Value>{f.lu, f.piv, f.info};
});

// P, L, U from a packed LU; parts not asked for are empty.
std::vector<Value> unpack(Ctx& c, const Value& lu, const Value& piv, bool data, bool pivots) {
  Builder& b = c.b;
  Shape batch = batchOf(lu);
  int64_t m = lu.shape()[lu.rank() - 2], n = lu.shape().back(), k = std::min(m, n);
  std::vector<Value> out;
  auto empty = [&](size_t i) { return b.zeros(c.hasExpected() ? c.expectedAt(i) : Type{lu.dtype(), {0}}); };
  if (pivots) {
    Value pf = b.reshape(b.convert(piv, DType::I32), {product(batch), piv.shape().back()});
    out.push_back(unflat(b, permMatrix(b, permFromPivots(b, pf, m), lu.dtype()), batch));
  } else {
    out.push_back(empty(0));
  }
  if (data) {
    Shape z(lu.rank(), 0), st(lu.rank(), 1);
    Shape lim_l = lu.shape(), lim_u = lu.shape();
    lim_l.back() = k;
    lim_u[lu.rank() - 2] = k;
    Value l = b.slice(lu, z, lim_l, st), u = b.slice(lu, z, lim_u, st);
    out.push_back(add(b, tri(b, l, -1, true), eye(b, lu.dtype(), l.shape())));
    out.push_back(tri(b, u, 0, false));
  } else {
    out.push_back(empty(1));
    out.push_back(empty(2));
  }
  return out;
}

Registrar reg_lu_unpack("lu_unpack", [](Ctx& c) {
  Value lu = c.tensor(0);
  requireLinalgType(lu);
  return unpack(c, lu, c.tensor(1), c.flagOr(2, true), c.flagOr(3, true));
});

// linalg_lu(A, *, pivot) -> (P, L, U)
Registrar reg_linalg_lu("linalg_lu", [](Ctx& c) {
  Value a = c.tensor(0);
  requireLinalgType(a);
  if (!c.flagOr(1, true)) throw ir::Unsupported("LU without pivoting");
  Factored f = factorOp(c.b, a);
  return unpack(c, f.lu, f.piv, true, true);
});

// linalg_lu_solve(LU, pivots, B, *, left, adjoint)
Registrar reg_linalg_lu_solve("linalg_lu_solve", [](Ctx& c) {
  Value lu = c.tensor(0), rhs = c.tensor(2);
  requireLinalgType(lu);
  return std::vector<Value>{luSolveOp(c.b, lu, c.tensor(1), rhs, c.flagOr(3, true), c.flagOr(4, false))};
});

// det and slogdet on the CPU factor A^T when A is contiguous (it is then
// column-major for LAPACK); their backward formulas make the same choice
// from A's layout, so the LU we return must be of the same matrix. (solve
// factors A itself in torch 2.13, whatever the layout.)
bool factorsTranspose(const Ctx& c, size_t i) { return c.arg(i).contiguous; }

// _linalg_solve_ex(A, B, *, left, check_errors) -> (result, LU, pivots, info)
Registrar reg_linalg_solve_ex("_linalg_solve_ex", [](Ctx& c) {
  Value a = c.tensor(0), rhs = c.tensor(1);
  requireLinalgType(a);
  if (c.flagOr(3, false)) throw ir::Unsupported("check_errors raises on the host");
  bool left = c.flagOr(2, true);
  Factored f = factorOp(c.b, a);
  // A vector B: [n] or A's batch shape + [n].
  bool vec = rhs.rank() == 1 || (rhs.rank() == a.rank() - 1 && rhs.shape() == batchOf(a, 1));
  Value bm = vec ? c.b.reshape(rhs, concat(rhs.shape(), {1})) : rhs;
  Value x = luSolveOp(c.b, f.lu, f.piv, c.b.convert(bm, a.dtype()), left, false);
  if (vec) x = c.b.reshape(x, batchOf(x, 1));
  return std::vector<Value>{x, f.lu, f.piv, f.info};
});

// linalg_inv_ex(A, *, check_errors) -> (inverse, info)
Registrar reg_linalg_inv_ex("linalg_inv_ex", [](Ctx& c) {
  Value a = c.tensor(0);
  requireLinalgType(a);
  if (c.flagOr(1, false)) throw ir::Unsupported("check_errors raises on the host");
  Factored f = factorOp(c.b, a);
  Value x = luSolveOp(c.b, f.lu, f.piv, eye(c.b, a.dtype(), a.shape()), true, false);
  return std::vector<Value>{x, f.info};
});

// _linalg_det(A) -> (det, LU, pivots)
Registrar reg_linalg_det("_linalg_det", [](Ctx& c) {
  Value a = c.tensor(0);
  requireLinalgType(a);
  Factored f = factorOp(c.b, factorsTranspose(c, 0) ? mT(c.b, a) : a);
  Value d = reduceProd(c.b, diagOf(c.b, f.lu), a.rank() - 2);
  return std::vector<Value>{mul(c.b, pivotSign(c.b, f.piv, a.dtype()), d), f.lu, f.piv};
});

// _linalg_slogdet(A) -> (sign, logabsdet, LU, pivots)
Registrar reg_linalg_slogdet("_linalg_slogdet", [](Ctx& c) {
  Value a = c.tensor(0);
  requireLinalgType(a);
  Builder& b = c.b;
  Factored f = factorOp(b, factorsTranspose(c, 0) ? mT(b, a) : a);
  Value d = diagOf(b, f.lu);
  int64_t last = d.rank() - 1;
  Value sign = mul(b, pivotSign(b, f.piv, a.dtype()), reduceProd(b, b.unary("sign", d), last));
  Value logabs = reduceSum(b, b.unary("log", b.unary("abs", d)), {last});
  return std::vector<Value>{sign, logabs, f.lu, f.piv};
});

}  // namespace
}  // namespace tpu::ops
