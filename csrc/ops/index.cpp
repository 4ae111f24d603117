// Indexing: index_select, gather/scatter (all reductions), advanced indexing
// (index / index_put), index_add/copy/fill, embedding backward.
// Negative indices wrap as in PyTorch.
#include <limits>
#include <numeric>
#include <stdexcept>

#include "ops/common.h"

namespace tpu::ops {
namespace {

// Wraps negative indices by `size`.
Value wrapIndex(ir::Builder& b, const Value& idx, int64_t size) {
  Value i = b.convert(idx, DType::I64);
  Value zero = b.constantInt(0, DType::I64, i.shape());
  Value n = b.constantInt(size, DType::I64, i.shape());
  return b.select(b.compare(i, zero, ir::Cmp::LT), add(b, i, n), i);
}

// Full coordinates for "along dim" ops: index tensor `idx` (same rank as x)
// gives the coordinate on `dim`; other coordinates are the positions.
Value coordinates(ir::Builder& b, const Value& idx, int64_t dim, int64_t dim_size) {
  Type it{DType::I64, idx.shape()};
  std::vector<Value> parts;
  Shape s = idx.shape();
  s.push_back(1);
  for (int d = 0; d < idx.rank(); ++d) {
    Value c = d == dim ? wrapIndex(b, idx, dim_size) : b.iota(it, d);
    parts.push_back(b.reshape(c, s));
  }
  return b.concatenate(parts, idx.rank());
}

Value gatherAlong(ir::Builder& b, const Value& x, int64_t dim, const Value& idx) {
  if (idx.type.numel() == 0) return b.zeros(Type{x.dtype(), idx.shape()});
  if (idx.rank() == 0 || x.rank() == 0) {
    return b.reshape(gatherAlong(b, b.reshape(x, {1}), 0, b.reshape(idx, {1})), idx.shape());
  }
  Value coords = coordinates(b, idx, dim, x.shape()[dim]);
  ir::Builder::GatherDims dn;
  for (int d = 0; d < x.rank(); ++d) {
    dn.collapsed_slice_dims.push_back(d);
    dn.start_index_map.push_back(d);
  }
  dn.index_vector_dim = idx.rank();
  return b.gather(x, coords, dn, Shape(x.rank(), 1));
}

using Combine = std::function<Value(ir::Builder&, const Value&, const Value&)>;

Value scatterAlong(ir::Builder& b, const Value& x, int64_t dim, const Value& idx, const Value& src,
                   const Combine& combine) {
  // PyTorch accepts an empty index of any rank and leaves self as it is.
  if (idx.type.numel() == 0) return x;
  if (x.rank() == 0) {
    Value r = scatterAlong(b, b.reshape(x, {1}), 0, b.reshape(idx, {1}), b.reshape(src, {1}), combine);
    return b.reshape(r, {});
  }
  // src may be larger than idx: use its leading idx-shaped block.
  Value upd = src;
  if (src.shape() != idx.shape()) {
    Shape start(src.rank(), 0), strides(src.rank(), 1);
    upd = b.slice(src, start, idx.shape(), strides);
  }
  // One index per line along `dim` (the one-hot of a loss gradient): every
  // element is written at most once, so the scatter is an elementwise select
  // that fuses into its consumers instead of a serial scatter loop over a
  // materialized copy of x.
  Shape line = x.shape();
  line[dim] = 1;
  if (idx.shape() == line) {
    Value at = b.broadcastTo(wrapIndex(b, idx, x.shape()[dim]), x.shape());
    Value hit = b.compare(b.iota(Type{DType::I64, x.shape()}, static_cast<int>(dim)), at, ir::Cmp::EQ);
    return b.select(hit, combine(b, x, b.broadcastTo(upd, x.shape())), x);
  }
  Value coords = coordinates(b, idx, dim, x.shape()[dim]);
  ir::Builder::ScatterDims dn;
  for (int d = 0; d < x.rank(); ++d) {
    dn.inserted_window_dims.push_back(d);
    dn.scatter_dims_to_operand_dims.push_back(d);
  }
  dn.index_vector_dim = idx.rank();
  return b.scatter(x, coords, upd, dn, [combine](ir::Builder& bb, const std::vector<Value>& a) {
    return std::vector<Value>{combine(bb, a[0], a[1])};
  });
}

Combine replaceFn() {
  return [](ir::Builder&, const Value&, const Value& n) { return n; };
}
Combine addFn() {
  return [](ir::Builder& b, const Value& o, const Value& n) { return add(b, o, n); };
}

Registrar reg_gather("gather", [](Ctx& c) {
  Value x = c.tensor(0), idx = c.tensor(2);
  int64_t dim = wrapDim(c.i64(1), x.rank());
  c.requireInRange(indicesInRange(c.b, idx, x.rank() ? x.shape()[dim] : 1, false));
  return std::vector<Value>{gatherAlong(c.b, x, dim, idx)};
});

// scatter(self, dim, index, src|value, *, reduce?) / scatter_add / scatter_reduce
Registrar reg_scatter("scatter", [](Ctx& c) {
  Value x = c.tensor(0), idx = c.tensor(2);
  int64_t dim = wrapDim(c.i64(1), x.rank());
  Value src = c.b.convert(c.tensor(3), x.dtype());
  if (src.rank() == 0) src = c.b.broadcastTo(src, idx.shape());
  c.requireInRange(indicesInRange(c.b, idx, x.rank() ? x.shape()[dim] : 1, false));
  Combine f = replaceFn();
  if (c.kind(4) == Arg::Kind::String) {
    std::string r = c.str(4);
    if (r == "add")
      f = addFn();
    else if (r == "multiply")
      f = [](ir::Builder& b, const Value& o, const Value& n) { return mul(b, o, n); };
    else
      throw ir::Unsupported("scatter reduce " + r);
  }
  return std::vector<Value>{scatterAlong(c.b, x, dim, idx, src, f)};
});
Registrar reg_scatter_add("scatter_add", [](Ctx& c) {
  Value x = c.tensor(0), idx = c.tensor(2);
  int64_t dim = wrapDim(c.i64(1), x.rank());
  c.requireInRange(indicesInRange(c.b, idx, x.rank() ? x.shape()[dim] : 1, false));
  return std::vector<Value>{scatterAlong(c.b, x, dim, idx, c.b.convert(c.tensor(3), x.dtype()), addFn())};
});
Registrar reg_scatter_reduce("scatter_reduce", [](Ctx& c) {
  Value x = c.tensor(0), idx = c.tensor(2);
  int64_t dim = wrapDim(c.i64(1), x.rank());
  Value src = c.b.convert(c.tensor(3), x.dtype());
  std::string r = c.str(4);
  bool include_self = c.flagOr(5, true);
  c.requireInRange(indicesInRange(c.b, idx, x.rank() ? x.shape()[dim] : 1, false));
  ir::Builder& b = c.b;
  Combine f;
  double init = 0;
  std::optional<int64_t> init_int;  // int64 limits are not exact as doubles
  // The CPU and CUDA kernels have no bool code for the mean (the other reductions have).
  if (r == "mean" && x.dtype() == DType::Bool)
    throw ir::NotImplementedForDtype("\"scatter_reduce\" with reduce=\"mean\" not implemented for 'Bool'");
  if (r == "sum" || r == "mean") {
    f = addFn();
  } else if (r == "prod") {
    f = [](ir::Builder& bb, const Value& o, const Value& n) { return mul(bb, o, n); };
    init = 1;
  } else if (r == "amax") {
    f = [](ir::Builder& bb, const Value& o, const Value& n) { return nanPropagating(bb, "maximum", o, n); };
    init = lowestValue(x.dtype());
    if (x.dtype() == DType::I64) init_int = std::numeric_limits<int64_t>::min();
  } else if (r == "amin") {
    f = [](ir::Builder& bb, const Value& o, const Value& n) { return nanPropagating(bb, "minimum", o, n); };
    init = highestValue(x.dtype());
    if (x.dtype() == DType::I64) init_int = std::numeric_limits<int64_t>::max();
  } else {
    throw ir::Unsupported("scatter_reduce " + r);
  }
  // Positions that receive any update.
  Value touched = scatterAlong(b, b.constant(0.0, DType::F32, x.shape()), dim, idx,
                               b.constant(1.0, DType::F32, idx.shape()), addFn());
  Value hit = b.compare(touched, b.constant(0.0, DType::F32, x.shape()), ir::Cmp::GT);
  Value init_v = init_int ? b.constantInt(*init_int, x.dtype(), x.shape()) : b.constant(init, x.dtype(), x.shape());
  Value base = include_self ? x : b.select(hit, init_v, x);
  Value res = scatterAlong(b, base, dim, idx, src, f);
  if (r == "mean") {
    Value cnt = include_self ? add(b, touched, b.constant(1.0, DType::F32, x.shape())) : touched;
    cnt = b.select(hit, cnt, b.constant(1.0, DType::F32, x.shape()));
    Value q = div(b, b.convert(res, accOf(floatOf(x.dtype()))), b.convert(cnt, accOf(floatOf(x.dtype()))));
    if (!ir::isFloat(x.dtype())) q = b.unary("floor", q);
    res = b.select(hit, b.convert(q, x.dtype()), res);
  }
  return std::vector<Value>{res};
});

// index_select(self, dim, index)
Value indexSelect(ir::Builder& b, const Value& x, int64_t dim, const Value& index) {
  if (x.rank() == 0) return b.reshape(gatherAlong(b, b.reshape(x, {1}), 0, b.reshape(index, {1})), {});
  Value idx = wrapIndex(b, b.reshape(index, {index.type.numel()}), x.shape()[dim]);
  int64_t k = idx.shape()[0];
  idx = b.reshape(idx, {k, 1});
  ir::Builder::GatherDims dn;
  for (int d = 0; d < x.rank(); ++d)
    if (d != dim) dn.offset_dims.push_back(d);
  dn.collapsed_slice_dims = {dim};
  dn.start_index_map = {dim};
  dn.index_vector_dim = 1;
  Shape sizes = x.shape();
  sizes[dim] = 1;
  return b.gather(x, idx, dn, sizes);
}
Registrar reg_index_select("index_select", [](Ctx& c) {
  Value x = c.tensor(0);
  int64_t dim = x.rank() == 0 ? 0 : wrapDim(c.i64(1), x.rank());
  c.requireInRange(indicesInRange(c.b, c.tensor(2), x.rank() ? x.shape()[dim] : 1, false));
  return std::vector<Value>{indexSelect(c.b, x, dim, c.tensor(2))};
});

// Scatters `src` (shaped like x with dim replaced by len(index)) along dim.
Value indexScatter(ir::Builder& b, const Value& x, int64_t dim, const Value& index, const Value& src,
                   const Combine& f) {
  Value idx = wrapIndex(b, b.reshape(index, {index.type.numel()}), x.shape()[dim]);
  int64_t k = idx.shape()[0];
  idx = b.reshape(idx, {k, 1});
  // Move dim of src to the front: updates [k, rest...].
  std::vector<int64_t> perm{dim};
  for (int d = 0; d < x.rank(); ++d)
    if (d != dim) perm.push_back(d);
  Value upd = b.transpose(src, perm);
  ir::Builder::ScatterDims dn;
  for (int d = 1; d < x.rank(); ++d) dn.update_window_dims.push_back(d);
  dn.inserted_window_dims = {dim};
  dn.scatter_dims_to_operand_dims = {dim};
  dn.index_vector_dim = 1;
  return b.scatter(x, idx, upd, dn,
                   [f](ir::Builder& bb, const std::vector<Value>& a) { return std::vector<Value>{f(bb, a[0], a[1])}; });
}

// index_add/copy/fill on a 0-d tensor act on it as a 1-element vector.
Value as1d(ir::Builder& b, const Value& v) { return v.rank() == 0 ? b.reshape(v, {1}) : v; }

Registrar reg_index_add("index_add", [](Ctx& c) {
  Value x0 = c.tensor(0);
  Value x = as1d(c.b, x0);
  int64_t dim = wrapDim(c.i64(1), x.rank());
  c.requireInRange(indicesInRange(c.b, c.tensor(2), x.shape()[dim], false));
  Value src = as1d(c.b, c.b.convert(c.tensor(3), x.dtype()));
  if (c.has(4)) src = mul(c.b, src, c.b.broadcastTo(c.scalar(4, x.dtype()), src.shape()));
  return std::vector<Value>{c.b.reshape(indexScatter(c.b, x, dim, c.tensor(2), src, addFn()), x0.shape())};
});
Registrar reg_index_copy("index_copy", [](Ctx& c) {
  Value x0 = c.tensor(0);
  Value x = as1d(c.b, x0);
  int64_t dim = wrapDim(c.i64(1), x.rank());
  c.requireInRange(indicesInRange(c.b, c.tensor(2), x.shape()[dim], false));
  Value src = as1d(c.b, c.b.convert(c.tensor(3), x.dtype()));
  return std::vector<Value>{c.b.reshape(indexScatter(c.b, x, dim, c.tensor(2), src, replaceFn()), x0.shape())};
});
Registrar reg_index_fill("index_fill", [](Ctx& c) {
  Value x0 = c.tensor(0);
  Value x = as1d(c.b, x0);
  int64_t dim = wrapDim(c.i64(1), x.rank());
  c.requireInRange(indicesInRange(c.b, c.tensor(2), x.shape()[dim], false));
  Value index = c.tensor(2);
  Shape s = x.shape();
  s[dim] = index.type.numel();
  Value src = c.b.broadcastTo(c.b.convert(c.tensor(3), x.dtype()), s);
  return std::vector<Value>{c.b.reshape(indexScatter(c.b, x, dim, index, src, replaceFn()), x0.shape())};
});

// Advanced indexing: the (broadcast) index tensors select along the indexed
// dims; the result has the broadcast index shape at the first indexed dim if
// they are adjacent, else in front.
struct AdvIndex {
  Value coords;  // [B..., k] int64
  std::vector<int64_t> indexed;
  Shape batch;        // broadcast index shape
  bool front = true;  // batch dims in front of the result
  int64_t first = 0;
};

AdvIndex advancedIndex(Ctx& c, const Value& x, const std::vector<Value>& indices) {
  ir::Builder& b = c.b;
  AdvIndex a;
  std::vector<Value> idx;
  for (size_t i = 0; i < indices.size(); ++i) {
    if (!indices[i].valid()) continue;
    if (indices[i].dtype() == DType::Bool || indices[i].dtype() == DType::U8)
      throw ir::Unsupported("boolean mask indexing (data-dependent shape)");
    a.indexed.push_back(static_cast<int64_t>(i));
    idx.push_back(indices[i]);
  }
  if (idx.empty()) throw ir::Unsupported("indexing without index tensors");
  try {
    for (const auto& v : idx) a.batch = broadcastShapes(a.batch, v.shape());
  } catch (const std::invalid_argument&) {  // PyTorch's IndexError and words
    std::string shapes;
    for (const auto& v : idx) shapes += (shapes.empty() ? "" : ", ") + ir::shapeStr(v.shape());
    throw std::out_of_range("shape mismatch: indexing tensors could not be broadcast together with shapes " + shapes);
  }
  // Any index into a dim of size 0 is out of bounds, known without the data
  // (and a zero-size gather window does not compile).
  int64_t picks = 1;
  for (int64_t d : a.batch) picks *= d;
  for (int64_t i : a.indexed)
    if (x.shape()[i] == 0 && picks > 0) throw std::out_of_range("index is out of bounds for dimension with size 0");
  Shape s = a.batch;
  s.push_back(1);
  std::vector<Value> parts;
  for (size_t j = 0; j < idx.size(); ++j) {
    c.requireInRange(indicesInRange(b, idx[j], x.shape()[a.indexed[j]], true));
    Value w = wrapIndex(b, b.broadcastTo(idx[j], a.batch), x.shape()[a.indexed[j]]);
    parts.push_back(b.reshape(w, s));
  }
  a.coords = b.concatenate(parts, static_cast<int64_t>(a.batch.size()));
  bool adjacent = true;
  for (size_t j = 1; j < a.indexed.size(); ++j) adjacent &= a.indexed[j] == a.indexed[j - 1] + 1;
  a.first = a.indexed[0];
  a.front = !adjacent || a.first == 0;
  return a;
}

Registrar reg_index("index", [](Ctx& c) {
  Value x = c.tensor(0);
  AdvIndex a = advancedIndex(c, x, c.tensors(1));
  int64_t nb = static_cast<int64_t>(a.batch.size());
  ir::Builder::GatherDims dn;
  Shape sizes = x.shape();
  int64_t pos = nb;
  for (int d = 0; d < x.rank(); ++d) {
    if (std::find(a.indexed.begin(), a.indexed.end(), d) != a.indexed.end()) {
      dn.collapsed_slice_dims.push_back(d);
      sizes[d] = 1;
    } else {
      dn.offset_dims.push_back(pos++);
    }
  }
  dn.start_index_map = a.indexed;
  dn.index_vector_dim = nb;
  Value r = c.b.gather(x, a.coords, dn, sizes);
  if (!a.front) {  // move batch dims to position `first`
    std::vector<int64_t> perm;
    int64_t nrest = r.rank() - nb;
    for (int64_t i = 0; i < a.first; ++i) perm.push_back(nb + i);
    for (int64_t i = 0; i < nb; ++i) perm.push_back(i);
    for (int64_t i = a.first; i < nrest; ++i) perm.push_back(nb + i);
    r = c.b.transpose(r, perm);
  }
  return std::vector<Value>{r};
});
Registrar reg_unsafe_index("_unsafe_index", [](Ctx& c) { return findLowering("index", "")->fn(c); });

// index_put(self, indices, values, accumulate) / _index_put_impl_(..., unsafe)
std::vector<Value> indexPut(Ctx& c) {
  Value x = c.tensor(0);
  const std::vector<Value> idx = c.tensors(1);
  // A mask of x's leading dims and one value (the dispatcher keeps such a mask as is).
  if (idx.size() == 1 && idx[0].valid() && idx[0].dtype() == DType::Bool && idx[0].rank() <= x.rank() &&
      std::equal(idx[0].shape().begin(), idx[0].shape().end(), x.shape().begin()) && c.tensor(2).rank() == 0 &&
      !c.flagOr(3, false)) {
    std::vector<int64_t> lead(idx[0].rank());
    std::iota(lead.begin(), lead.end(), 0);
    const Value mask = c.b.broadcastInDim(idx[0], x.shape(), lead);
    return {c.b.select(mask, c.b.broadcastTo(c.b.convert(c.tensor(2), x.dtype()), x.shape()), x)};
  }
  AdvIndex a = advancedIndex(c, x, idx);
  bool accumulate = c.flagOr(3, false);
  int64_t nb = static_cast<int64_t>(a.batch.size());
  ir::Builder::ScatterDims dn;
  Shape upd_shape = a.batch;
  for (int d = 0; d < x.rank(); ++d) {
    if (std::find(a.indexed.begin(), a.indexed.end(), d) != a.indexed.end()) {
      dn.inserted_window_dims.push_back(d);
    } else {
      dn.update_window_dims.push_back(static_cast<int64_t>(upd_shape.size()));
      upd_shape.push_back(x.shape()[d]);
    }
  }
  dn.scatter_dims_to_operand_dims = a.indexed;
  dn.index_vector_dim = nb;
  Value v = c.b.convert(c.tensor(2), x.dtype());
  // The values must broadcast to the indexing result, in PyTorch's layout (the
  // batch dims at `first` when the indexed dims are not adjacent).
  Shape result = upd_shape;
  if (!a.front) {
    result.clear();
    const int64_t nrest = static_cast<int64_t>(upd_shape.size()) - nb;
    for (int64_t i = 0; i < a.first; ++i) result.push_back(upd_shape[nb + i]);
    for (int64_t i = 0; i < nb; ++i) result.push_back(upd_shape[i]);
    for (int64_t i = a.first; i < nrest; ++i) result.push_back(upd_shape[nb + i]);
  }
  bool fits = v.rank() <= static_cast<int>(result.size());
  for (int i = 1; fits && i <= v.rank(); ++i) {
    const int64_t d = v.shape()[v.rank() - i];
    fits = d == 1 || d == result[result.size() - i];
  }
  if (!fits)
    throw std::invalid_argument("shape mismatch: value tensor of shape " + ir::shapeStr(v.shape()) +
                                " cannot be broadcast to indexing result of shape " + ir::shapeStr(result));
  if (!a.front) {
    // values are laid out with batch dims at `first`: broadcast there, then
    // move them to the front.
    Shape res_shape;
    int64_t nrest = static_cast<int64_t>(upd_shape.size()) - nb;
    for (int64_t i = 0; i < a.first; ++i) res_shape.push_back(upd_shape[nb + i]);
    for (int64_t i = 0; i < nb; ++i) res_shape.push_back(upd_shape[i]);
    for (int64_t i = a.first; i < nrest; ++i) res_shape.push_back(upd_shape[nb + i]);
    v = c.b.broadcastTo(v, res_shape);
    std::vector<int64_t> perm;
    for (int64_t i = 0; i < nb; ++i) perm.push_back(a.first + i);
    for (int64_t i = 0; i < a.first; ++i) perm.push_back(i);
    for (int64_t i = a.first + nb; i < static_cast<int64_t>(res_shape.size()); ++i) perm.push_back(i);
    v = c.b.transpose(v, perm);
  } else {
    v = c.b.broadcastTo(v, upd_shape);
  }
  Combine f = accumulate ? addFn() : replaceFn();
  Value r = c.b.scatter(x, a.coords, v, dn, [f](ir::Builder& bb, const std::vector<Value>& args) {
    return std::vector<Value>{f(bb, args[0], args[1])};
  });
  return {r};
}
Registrar reg_index_put("index_put", indexPut);
Registrar reg_index_put_impl("_index_put_impl", indexPut);

// embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
Registrar reg_embedding_dense_backward("embedding_dense_backward", [](Ctx& c) {
  Value g = c.tensor(0), idx = c.tensor(1);
  int64_t n = c.i64(2), pad = c.i64(3);
  c.requireInRange(indicesInRange(c.b, idx, n, false));
  if (c.flagOr(4, false)) throw ir::Unsupported("embedding backward with scale_grad_by_freq");
  ir::Builder& b = c.b;
  int64_t m = idx.type.numel();
  int64_t d = g.shape().back();
  DType acc = accOf(g.dtype());
  Value flat_idx = b.reshape(b.convert(idx, DType::I64), {m, 1});
  Value upd = b.reshape(b.convert(g, acc), {m, d});
  if (pad >= 0) {
    Value keep = b.compare(b.reshape(flat_idx, {m}), b.constantInt(pad, DType::I64, {m}), ir::Cmp::NE);
    upd = b.select(b.broadcastInDim(keep, {m, d}, {0}), upd, b.constant(0.0, acc, {m, d}));
  }
  ir::Builder::ScatterDims dn;
  dn.update_window_dims = {1};
  dn.inserted_window_dims = {0};
  dn.scatter_dims_to_operand_dims = {0};
  dn.index_vector_dim = 1;
  Value r =
      b.scatter(b.constant(0.0, acc, {n, d}), flat_idx, upd, dn,
                [](ir::Builder& bb, const std::vector<Value>& a) { return std::vector<Value>{add(bb, a[0], a[1])}; });
  return std::vector<Value>{b.convert(r, g.dtype())};
});

Registrar reg_take("take", [](Ctx& c) {
  Value x = c.tensor(0), idx = c.tensor(1);
  c.requireInRange(indicesInRange(c.b, idx, x.type.numel(), true));
  Value flat = c.b.reshape(x, {x.type.numel()});
  Value g = gatherAlong(c.b, flat, 0, c.b.reshape(idx, {idx.type.numel()}));
  return std::vector<Value>{c.b.reshape(g, idx.shape())};
});

// Flat positions where `mask` holds, first; the rest padded with numel.
Value selectedPositions(ir::Builder& b, const Value& flat_mask) {
  int64_t n = flat_mask.shape()[0];
  Value pos = b.iota({DType::I64, {n}}, 0);
  Value keys = b.select(flat_mask, pos, b.constantInt(n, DType::I64, {n}));
  return b.sort({keys}, 0, false, [](ir::Builder& bb, const std::vector<Value>& a) {
    return std::vector<Value>{bb.compare(a[0], a[1], ir::Cmp::LT)};
  })[0];
}

Value countTrue(ir::Builder& b, const Value& flat_mask) { return reduceSum(b, b.convert(flat_mask, DType::I64), {0}); }

// Coordinates [n, rank] of the nonzero elements of x, in row-major order,
// padded with rows of `numel`'s coordinates; and the mask.
std::pair<Value, Value> nonzeroCoords(ir::Builder& b, const Value& x) {
  int64_t n = x.type.numel();
  Value flat = b.reshape(x, {n});
  Value mask = flat.dtype() == DType::Bool ? flat : b.compare(flat, b.constant(0.0, flat.dtype(), {n}), ir::Cmp::NE);
  Value keys = selectedPositions(b, mask);
  std::vector<Value> cols;
  int64_t stride = 1;
  std::vector<int64_t> strides(x.rank());
  for (int d = x.rank() - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= x.shape()[d];
  }
  for (int d = 0; d < x.rank(); ++d) {
    Value q = b.binary("divide", keys, b.constantInt(strides[d], DType::I64, {n}));
    Value r = b.binary("remainder", q, b.constantInt(std::max<int64_t>(x.shape()[d], 1), DType::I64, {n}));
    cols.push_back(b.reshape(r, {n, 1}));
  }
  Value out = cols.empty() ? b.constantInt(0, DType::I64, {n, 0}) : b.concatenate(cols, 1);
  return {out, mask};
}

// nonzero(self) -> [count, rank] int64 (data-dependent length)
Registrar reg_nonzero(
    "nonzero",
    [](Ctx& c) {
      auto [out, mask] = nonzeroCoords(c.b, c.tensor(0));
      c.setDynamicLength(countTrue(c.b, mask));
      return std::vector<Value>{out};
    },
    {}, true);

// nonzero_static(self, *, size, fill_value) -> [size, rank]: the first `size`
// nonzero coordinates, the rest filled.
Registrar reg_nonzero_static("nonzero_static", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  int64_t size = c.i64(1), fill = c.i64Or(2, -1), rank = x.rank(), n = x.type.numel();
  if (n == 0 || size == 0) return std::vector<Value>{b.constantInt(fill, DType::I64, {size, rank})};
  auto [out, mask] = nonzeroCoords(b, x);
  Value rows = b.iota(Type{DType::I64, {n, rank}}, 0);
  Value valid = b.compare(rows, b.broadcastTo(countTrue(b, mask), {n, rank}), ir::Cmp::LT);
  out = b.select(valid, out, b.constantInt(fill, DType::I64, {n, rank}));
  if (size <= n) return std::vector<Value>{b.slice(out, {0, 0}, {size, rank}, {1, 1})};
  return std::vector<Value>{b.pad(out, b.constantInt(fill, DType::I64), {0, 0}, {size - n, 0}, {0, 0})};
});

// masked_select(self, mask) -> 1-d (data-dependent length)
Registrar reg_masked_select(
    "masked_select",
    [](Ctx& c) {
      ir::Builder& b = c.b;
      auto vs = broadcastAll(b, {c.tensor(0), b.convert(c.tensor(1), DType::Bool)});
      int64_t n = vs[0].type.numel();
      Value flat = b.reshape(vs[0], {n}), mask = b.reshape(vs[1], {n});
      if (n == 0) {
        c.setDynamicLength(b.constantInt(0, DType::I64));
        return std::vector<Value>{flat};
      }
      Value keys = selectedPositions(b, mask);
      Value safe = b.binary("minimum", keys, b.constantInt(n - 1, DType::I64, {n}));
      c.setDynamicLength(countTrue(b, mask));
      return std::vector<Value>{gatherAlong(b, flat, 0, safe)};
    },
    {}, true);

}  // namespace
}  // namespace tpu::ops
