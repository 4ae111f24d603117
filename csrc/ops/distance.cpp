// p-norm distances between row vectors: cdist and pdist, and their
// gradients. Computed from the differences directly (not via matrix
// products), which is exact for every p.
#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/common.h"

namespace tpu::ops {
namespace {

// x1 [..., P, M], x2 [..., R, M] (batch dims equal) -> diff [..., P, R, M].
Value pairDiff(ir::Builder& b, const Value& x1, const Value& x2) {
  int r = x1.rank();
  Shape s(x1.shape().begin(), x1.shape().end() - 1);
  s.push_back(x2.shape()[r - 2]);
  s.push_back(x1.shape()[r - 1]);
  std::vector<int64_t> d1, d2;
  for (int i = 0; i < r - 2; ++i) {
    d1.push_back(i);
    d2.push_back(i);
  }
  d1.push_back(r - 2);
  d1.push_back(r);
  d2.push_back(r - 1);
  d2.push_back(r);
  return sub(b, b.broadcastInDim(x1, s, d1), b.broadcastInDim(x2, s, d2));
}

Value distances(ir::Builder& b, const Value& diff, double p) {
  DType t = diff.dtype();
  int64_t last = diff.rank() - 1;
  Value a = b.unary("abs", diff);
  if (p == 0) return reduceSum(b, b.convert(b.compare(a, b.zeros(a.type), ir::Cmp::NE), t), {last});
  if (std::isinf(p)) return reduceMax(b, a, {last});
  if (p == 1) return reduceSum(b, a, {last});
  if (p == 2) return b.unary("sqrt", reduceSum(b, mul(b, diff, diff), {last}));
  Value s = reduceSum(b, b.binary("power", a, b.constant(p, t, a.shape())), {last});
  return b.binary("power", s, b.constant(1.0 / p, t, s.shape()));
}

// d dist_ij / d x1_i for every pair, times g_ij, summed over j.
Value distanceGrad(ir::Builder& b, const Value& g, const Value& x1, const Value& x2, double p, const Value& dist) {
  Value diff = pairDiff(b, x1, x2);
  DType t = diff.dtype();
  const Shape& s = diff.shape();
  int r = diff.rank();
  std::vector<int64_t> lead;
  for (int i = 0; i < r - 1; ++i) lead.push_back(i);
  Value dd = b.broadcastInDim(dist, s, lead);
  Value zero = b.zeros(diff.type);
  Value sign = b.unary("sign", diff);
  Value a = b.unary("abs", diff);
  Value w;
  if (p == 0) {
    w = zero;
  } else if (p == 1) {
    w = sign;
  } else if (std::isinf(p)) {
    w = mul(b, sign, b.convert(b.compare(a, dd, ir::Cmp::EQ), t));
  } else if (p == 2) {
    w = div(b, diff, dd);
  } else {
    // sign(d) |d|^(p-1) / dist^(p-1)
    w = div(b, mul(b, sign, b.binary("power", a, b.constant(p - 1, t, s))),
            b.binary("power", dd, b.constant(p - 1, t, s)));
  }
  // A zero distance (and, below p = 1, a zero difference) contributes nothing.
  Value undefined = b.compare(dd, zero, ir::Cmp::EQ);
  if (p < 1) undefined = b.binary("or", undefined, b.compare(a, zero, ir::Cmp::EQ));
  w = b.select(undefined, zero, w);
  Value gw = mul(b, w, b.broadcastInDim(g, s, lead));
  return reduceSum(b, gw, {static_cast<int64_t>(r - 2)});  // sum over j -> [..., P, M]
}

// _cdist_forward(x1, x2, p, compute_mode)
Registrar reg_cdist("_cdist_forward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x1 = c.tensor(0), x2 = c.tensor(1);
  double p = c.f64(2);
  if (!ir::isFloat(x1.dtype()) || x1.rank() < 2 || x1.rank() != x2.rank()) throw ir::Unsupported("cdist arguments");
  if (!c.hasExpected()) throw ir::Unsupported("cdist without a known result");
  const Type& out = c.expectedAt(0);
  // Broadcast the batch dims to the result's.
  Shape s1(out.shape.begin(), out.shape.end() - 2), s2 = s1;
  s1.push_back(x1.shape()[x1.rank() - 2]);
  s1.push_back(x1.shape()[x1.rank() - 1]);
  s2.push_back(x2.shape()[x2.rank() - 2]);
  s2.push_back(x2.shape()[x2.rank() - 1]);
  DType acc = accOf(out.dtype);
  Value a = b.broadcastTo(b.convert(x1, acc), s1), bb = b.broadcastTo(b.convert(x2, acc), s2);
  if (Type{acc, out.shape}.numel() == 0) return std::vector<Value>{b.zeros(out)};
  return std::vector<Value>{b.convert(distances(b, pairDiff(b, a, bb), p), out.dtype)};
});

// _euclidean_dist(x1, x2): the matrix-product form torch.cdist takes for p = 2
// past 25 rows, as one program (PyTorch's decomposition was ten, each compiled
// per shape): [-2 x1, |x1|^2, 1] . [x2, 1, |x2|^2], clamped at 0, square root.
Registrar reg_euclidean_dist("_euclidean_dist", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x1 = c.tensor(0), x2 = c.tensor(1);
  const int r = x1.rank();
  if (!ir::isFloat(x1.dtype()) || r < 2 || x2.rank() != r ||
      !std::equal(x1.shape().begin(), x1.shape().end() - 2, x2.shape().begin()))
    throw ir::Unsupported("_euclidean_dist arguments");
  const DType out = outType(c, ir::promote(x1.dtype(), x2.dtype()));
  const DType acc = accOf(out);
  Value a = b.convert(x1, acc), bb = b.convert(x2, acc);
  const int64_t last = r - 1;
  auto norms = [&](const Value& v) { return keepDims(b, reduceSum(b, mul(b, v, v), {last}), v.shape(), {last}); };
  Value na = norms(a), nb = norms(bb);
  Value lhs = b.concatenate({mul(b, a, b.constant(-2.0, acc, a.shape())), na, b.constant(1.0, acc, na.shape())}, last);
  Value rhs = b.concatenate({bb, b.constant(1.0, acc, nb.shape()), nb}, last);
  std::vector<int64_t> batch;
  for (int i = 0; i < r - 2; ++i) batch.push_back(i);
  Value d = b.dotGeneral(lhs, rhs, batch, batch, {last}, {last}, acc);
  d = b.binary("maximum", d, b.zeros(d.type));
  return std::vector<Value>{b.convert(b.unary("sqrt", d), out)};
});

// _cdist_backward(grad, x1, x2, p, cdist) -> grad of x1
Registrar reg_cdist_backward("_cdist_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0), x1 = c.tensor(1), x2 = c.tensor(2), dist = c.tensor(4);
  double p = c.f64(3);
  DType out = outType(c, x1.dtype());
  DType acc = accOf(out);
  if (x1.rank() != x2.rank() || g.rank() != x1.rank()) throw ir::Unsupported("cdist backward with broadcast batches");
  if (x1.type.numel() == 0 || x2.type.numel() == 0) return std::vector<Value>{b.zeros(Type{out, x1.shape()})};
  Value r = distanceGrad(b, b.convert(g, acc), b.convert(x1, acc), b.convert(x2, acc), p, b.convert(dist, acc));
  return std::vector<Value>{b.convert(r, out)};
});

// Flat positions (row-major) of the strict upper triangle of an n x n matrix.
Value upperPositions(ir::Builder& b, int64_t n) {
  Type t{DType::I64, {n, n}};
  Value upper = b.compare(b.iota(t, 1), b.iota(t, 0), ir::Cmp::GT);
  Value pos = b.iota(Type{DType::I64, {n * n}}, 0);
  Value keys = b.select(b.reshape(upper, {n * n}), pos, b.constantInt(n * n, DType::I64, {n * n}));
  Value sorted = b.sort({keys}, 0, false, [](ir::Builder& bb, const std::vector<Value>& a) {
    return std::vector<Value>{bb.compare(a[0], a[1], ir::Cmp::LT)};
  })[0];
  return b.slice(sorted, {0}, {n * (n - 1) / 2}, {1});
}

// _pdist_forward(self [N, M], p) -> [N (N - 1) / 2], pairs i < j in order.
Registrar reg_pdist("_pdist_forward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  double p = c.f64Or(1, 2.0);
  if (!ir::isFloat(x.dtype()) || x.rank() != 2) throw ir::Unsupported("pdist arguments");
  int64_t n = x.shape()[0];
  DType acc = accOf(x.dtype());
  if (n < 2) return std::vector<Value>{b.zeros(Type{x.dtype(), {0}})};
  Value xx = b.convert(x, acc);
  Value full = b.reshape(distances(b, pairDiff(b, xx, xx), p), {n * n});
  ir::Builder::GatherDims dn;
  dn.collapsed_slice_dims = {0};
  dn.start_index_map = {0};
  dn.index_vector_dim = 1;
  int64_t k = n * (n - 1) / 2;
  Value picked = b.gather(full, b.reshape(upperPositions(b, n), {k, 1}), dn, {1});
  return std::vector<Value>{b.convert(picked, x.dtype())};
});

// _pdist_backward(grad, self, p, pdist) -> grad of self: the pair gradients
// as a symmetric matrix, then the cdist gradient of x against itself.
Registrar reg_pdist_backward("_pdist_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0), x = c.tensor(1);
  double p = c.f64(2);
  if (x.rank() != 2) throw ir::Unsupported("pdist backward arguments");
  int64_t n = x.shape()[0];
  DType acc = accOf(x.dtype());
  if (n < 2 || x.type.numel() == 0) return std::vector<Value>{b.zeros(x.type)};
  int64_t k = n * (n - 1) / 2;
  ir::Builder::ScatterDims dn;
  dn.inserted_window_dims = {0};
  dn.scatter_dims_to_operand_dims = {0};
  dn.index_vector_dim = 1;
  Value upper = b.scatter(b.zeros(Type{acc, {n * n}}), b.reshape(upperPositions(b, n), {k, 1}), b.convert(g, acc), dn,
                          [](ir::Builder& bb, const std::vector<Value>& a) { return std::vector<Value>{a[1]}; });
  Value gm = b.reshape(upper, {n, n});
  gm = add(b, gm, b.transpose(gm, {1, 0}));
  Value xx = b.convert(x, acc);
  Value dist = distances(b, pairDiff(b, xx, xx), p);
  return std::vector<Value>{b.convert(distanceGrad(b, gm, xx, xx, p, dist), x.dtype())};
});

}  // namespace
}  // namespace tpu::ops
