// Ops over segments of a flat list, each segment given by offsets: embedding_bag
// (pooled lookups, sum, mean, max, of rows of a table: the op behind
// nn.EmbeddingBag and TorchRec's embedding collections) and its backward, and
// the jagged <-> padded conversions of nested tensors. A position's segment is
// found with one scatter and a prefix sum, so none of them reads the host.
//
// embedding_bag's auxiliary results follow the layout PyTorch's meta kernel
// gives a non-CPU device (CUDA's): offset2bag per index, bag_size per offset,
// max_indices per bag and column in max mode. An index past the last bag
// (include_last_offset) gets bag number num_bags, so that the backward, which
// does not see the offsets, skips it.
#include "ops/common.h"

namespace tpu::ops {
namespace {

constexpr int64_t kSum = 0, kMean = 1, kMax = 2;

// Rows `ids` ([n] int64, in range) of the 2-d `table` -> [n, cols].
Value takeRows(ir::Builder& b, const Value& table, const Value& ids) {
  const int64_t n = ids.shape()[0];
  ir::Builder::GatherDims dn;
  dn.offset_dims = {1};
  dn.collapsed_slice_dims = {0};
  dn.start_index_map = {0};
  dn.index_vector_dim = 1;
  return b.gather(table, b.reshape(ids, {n, 1}), dn, {1, table.shape()[1]});
}

// Elements `ids` ([n] int64, in range) of the 1-d `v`.
Value takeRows1(ir::Builder& b, const Value& v, const Value& ids) {
  return b.reshape(takeRows(b, b.reshape(v, {v.shape()[0], 1}), ids), {ids.shape()[0]});
}

// Combines the rows of `updates` ([n] or [n, cols]) into `into` at rows `ids`.
Value scatterRows(ir::Builder& b, const Value& into, const Value& ids, const Value& updates, const char* op) {
  const int64_t n = ids.shape()[0];
  if (n == 0) return into;
  ir::Builder::ScatterDims dn;
  if (updates.rank() == 2) dn.update_window_dims = {1};
  dn.inserted_window_dims = {0};
  dn.scatter_dims_to_operand_dims = {0};
  dn.index_vector_dim = 1;
  std::string name = op;
  return b.scatter(into, b.reshape(ids, {n, 1}), updates, dn, [name](ir::Builder& bb, const std::vector<Value>& a) {
    return std::vector<Value>{bb.binary(name.c_str(), a[0], a[1])};
  });
}

Value ones(ir::Builder& b, DType t, int64_t n) { return b.constant(1.0, t, {n}); }

// The bag of each of `n` positions given the bags' start offsets ([>= bags]
// int64): a 1 at each later bag's start, prefix-summed. Positions at or past
// `end` (a 0-d int64) get `bags`.
Value bagOfPositions(ir::Builder& b, const Value& offsets, int64_t bags, int64_t n, const Value& end) {
  Value marks = b.zeros(Type{DType::I64, {n + 1}});
  if (bags > 1) {
    Value starts = b.slice(offsets, {1}, {bags}, {1});
    // Offsets past the end land in the spare slot n.
    starts = b.clamp(b.constantInt(0, DType::I64), starts, b.constantInt(n, DType::I64));
    marks = scatterRows(b, marks, starts, ones(b, DType::I64, bags - 1), "add");
  }
  Value bag = scan(b, b.slice(marks, {0}, {n}, {1}), 0, "add", 0.0);
  Value pos = b.iota(Type{DType::I64, {n}}, 0);
  Value past = b.compare(pos, b.broadcastTo(end, {n}), ir::Cmp::GE);
  return b.select(past, b.constantInt(bags, DType::I64, {n}), bag);
}

Type expectedOr(const Ctx& c, size_t i, Type dflt) { return c.hasExpected() ? c.expectedAt(i) : dflt; }

// _embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
//   per_sample_weights?, include_last_offset, padding_idx)
//   -> (output, offset2bag, bag_size, max_indices); also _embedding_bag_forward_only
std::vector<Value> embeddingBag(Ctx& c) {
  ir::Builder& b = c.b;
  Value w = c.tensor(0), idx = c.tensor(1), off = c.tensor(2);
  const int64_t mode = c.i64Or(4, kSum);
  const std::optional<Value> psw = c.optTensor(6);
  const bool include_last = c.flagOr(7, false);
  const int64_t pad = c.i64Or(8, -1);
  const int64_t rows = w.shape()[0], cols = w.shape()[1];
  const int64_t n = idx.type.numel(), noff = off.type.numel();
  const int64_t bags = include_last ? noff - 1 : noff;
  const DType it = idx.dtype(), acc = accOf(w.dtype());
  const Type t_o2b = expectedOr(c, 1, Type{it, {n}});
  const Type t_size = expectedOr(c, 2, Type{it, {noff}});
  const Type t_max = expectedOr(c, 3, Type{it, mode == kMax ? Shape{bags, cols} : Shape{0}});
  c.requireInRange(indicesInRange(b, idx, rows, false));

  Value ids = b.convert(b.reshape(idx, {n}), DType::I64);
  Value offs = b.convert(b.reshape(off, {noff}), DType::I64);
  if (noff > 0) {
    // The CPU refuses offsets that do not start at 0 or run past the indices (RuntimeError).
    Value starts_at_0 =
        b.compare(b.reshape(b.slice(offs, {0}, {1}, {1}), {}), b.constantInt(0, DType::I64), ir::Cmp::EQ);
    Value within = b.compare(reduceMax(b, offs, {0}), b.constantInt(n, DType::I64), ir::Cmp::LE);
    c.requireInRange(b.binary("and", starts_at_0, within));
  }
  Value end = include_last ? b.reshape(b.slice(offs, {bags}, {bags + 1}, {1}), {}) : b.constantInt(n, DType::I64);
  Value bag = bagOfPositions(b, offs, bags, n, end);
  Value valid = b.compare(bag, b.constantInt(bags, DType::I64, {n}), ir::Cmp::LT);
  if (pad >= 0) valid = b.binary("and", valid, b.compare(ids, b.constantInt(pad, DType::I64, {n}), ir::Cmp::NE));
  Value safe_bag = b.select(valid, bag, b.constantInt(0, DType::I64, {n}));
  Value safe_ids =
      b.clamp(b.constantInt(0, DType::I64), ids, b.constantInt(std::max<int64_t>(rows - 1, 0), DType::I64));
  Value count = scatterRows(b, b.zeros(Type{DType::I64, {bags}}), safe_bag, b.convert(valid, DType::I64), "add");

  Value gathered = b.convert(takeRows(b, w, safe_ids), acc);
  Value valid2 = b.broadcastInDim(valid, {n, cols}, {0});
  Value out, max_idx = b.zeros(t_max);
  if (mode == kMax) {
    Value lowest = extremeConst(b, acc, true, {n, cols});
    Value m = scatterRows(b, extremeConst(b, acc, true, {bags, cols}), safe_bag, b.select(valid2, gathered, lowest),
                          "maximum");
    // The first position that reaches its bag's maximum gives the row, as the
    // CPU's in-order scan with a strict comparison does.
    Value hit = b.binary("and", valid2, b.compare(gathered, takeRows(b, m, safe_bag), ir::Cmp::EQ));
    Value pos = b.iota(Type{DType::I64, {n, cols}}, 0);
    Value first = scatterRows(b, b.constantInt(n, DType::I64, {bags, cols}), safe_bag,
                              b.select(hit, pos, b.constantInt(n, DType::I64, {n, cols})), "minimum");
    Value found = b.compare(first, b.constantInt(n, DType::I64, {bags, cols}), ir::Cmp::LT);
    Value first_safe = b.select(found, first, b.constantInt(0, DType::I64, {bags, cols}));
    Value row = b.reshape(takeRows(b, b.reshape(ids, {n, 1}), b.reshape(first_safe, {bags * cols})), {bags, cols});
    max_idx = b.convert(b.select(found, row, b.constantInt(-1, DType::I64, {bags, cols})), t_max.dtype);
    out = b.select(found, m, b.zeros(Type{acc, {bags, cols}}));
  } else {
    Value contrib = gathered;
    if (psw) contrib = mul(b, contrib, b.broadcastInDim(b.convert(*psw, acc), {n, cols}, {0}));
    contrib = b.select(valid2, contrib, b.zeros(Type{acc, {n, cols}}));
    out = scatterRows(b, b.zeros(Type{acc, {bags, cols}}), safe_bag, contrib, "add");
    if (mode == kMean) {
      Value denom = b.convert(b.binary("maximum", count, b.constantInt(1, DType::I64, {bags})), acc);
      out = div(b, out, b.broadcastInDim(denom, {bags, cols}, {0}));
    }
  }
  Value size = count;
  if (t_size.numel() > bags) size = b.concatenate({count, b.zeros(Type{DType::I64, {t_size.numel() - bags}})}, 0);
  return {b.convert(out, w.dtype()), b.convert(b.reshape(bag, t_o2b.shape), t_o2b.dtype),
          b.convert(b.reshape(size, t_size.shape), t_size.dtype), max_idx};
}
Registrar reg_embedding_bag("_embedding_bag", embeddingBag);
Registrar reg_embedding_bag_fwd_only("_embedding_bag_forward_only", embeddingBag);

// The gradient row of each index: grad at its bag, zero for an index past the
// last bag or equal to padding_idx.
struct PerIndex {
  Value ids, bag, keep;  // [n] int64, [n] int64 (in range), [n] bool
};
PerIndex perIndex(ir::Builder& b, const Value& indices, const Value& offset2bag, int64_t bags, int64_t pad) {
  const int64_t n = indices.type.numel();
  PerIndex p;
  p.ids = b.convert(b.reshape(indices, {n}), DType::I64);
  Value bag = b.convert(b.reshape(offset2bag, {n}), DType::I64);
  p.keep = b.compare(bag, b.constantInt(bags, DType::I64, {n}), ir::Cmp::LT);
  if (pad >= 0) p.keep = b.binary("and", p.keep, b.compare(p.ids, b.constantInt(pad, DType::I64, {n}), ir::Cmp::NE));
  p.bag = b.select(p.keep, bag, b.constantInt(0, DType::I64, {n}));
  return p;
}

// Where the dense backward's arguments sit: _embedding_bag_dense_backward(grad,
// indices, offset2bag, bag_size, maximum_indices, num_weights,
// scale_grad_by_freq, mode, per_sample_weights?, padding_idx), and
// _embedding_bag_backward, which adds offsets (after indices) and sparse
// (after mode).
struct DenseBackwardArgs {
  size_t offset2bag, bag_size, max_indices, num_weights, by_freq, mode, psw, pad;
};
constexpr DenseBackwardArgs kDenseArgs{2, 3, 4, 5, 6, 7, 8, 9};
constexpr DenseBackwardArgs kBackwardArgs{3, 4, 5, 6, 7, 8, 10, 11};

std::vector<Value> embeddingBagDenseBackward(Ctx& c, const DenseBackwardArgs& at) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0), idx = c.tensor(1);
  const int64_t rows = c.i64(at.num_weights), mode = c.i64(at.mode), pad = c.i64Or(at.pad, -1);
  const bool by_freq = c.flagOr(at.by_freq, false);
  const std::optional<Value> psw = c.optTensor(at.psw);
  const int64_t bags = g.shape()[0], cols = g.shape()[1], n = idx.type.numel();
  const DType acc = accOf(g.dtype());
  Value ga = b.convert(g, acc);
  Value grad_w = b.zeros(Type{acc, {rows, cols}});
  if (mode == kMax) {
    Value mi = b.convert(c.tensor(at.max_indices), DType::I64);
    Value found = b.compare(mi, b.constantInt(0, DType::I64, {bags, cols}), ir::Cmp::GE);
    Value coords =
        b.concatenate({b.reshape(b.select(found, mi, b.constantInt(0, DType::I64, {bags, cols})), {bags, cols, 1}),
                       b.reshape(b.iota(Type{DType::I64, {bags, cols}}, 1), {bags, cols, 1})},
                      2);
    ir::Builder::ScatterDims dn;
    dn.inserted_window_dims = {0, 1};
    dn.scatter_dims_to_operand_dims = {0, 1};
    dn.index_vector_dim = 2;
    Value upd = b.select(found, ga, b.zeros(Type{acc, {bags, cols}}));
    if (bags * cols > 0)
      grad_w = b.scatter(grad_w, coords, upd, dn, [](ir::Builder& bb, const std::vector<Value>& a) {
        return std::vector<Value>{add(bb, a[0], a[1])};
      });
    return std::vector<Value>{b.convert(grad_w, g.dtype())};
  }
  if (n == 0 || bags == 0) return std::vector<Value>{b.convert(grad_w, g.dtype())};
  PerIndex p = perIndex(b, idx, c.tensor(at.offset2bag), bags, pad);
  Value scale = b.convert(p.keep, acc);
  if (mode == kMean) {
    Value size = b.convert(b.reshape(c.tensor(at.bag_size), {c.tensor(at.bag_size).type.numel()}), DType::I64);
    Value per = takeRows(b, b.reshape(size, {size.shape()[0], 1}), p.bag);
    per = b.convert(b.binary("maximum", b.reshape(per, {n}), b.constantInt(1, DType::I64, {n})), acc);
    scale = div(b, scale, per);
  }
  if (psw) scale = mul(b, scale, b.convert(b.reshape(*psw, {n}), acc));
  if (by_freq) {
    Value freq = scatterRows(b, b.zeros(Type{DType::I64, {rows}}), p.ids, ones(b, DType::I64, n), "add");
    scale = div(b, scale, b.convert(b.reshape(takeRows(b, b.reshape(freq, {rows, 1}), p.ids), {n}), acc));
  }
  Value upd = mul(b, takeRows(b, ga, p.bag), b.broadcastInDim(scale, {n, cols}, {0}));
  grad_w = scatterRows(b, grad_w, p.ids, upd, "add");
  return std::vector<Value>{b.convert(grad_w, g.dtype())};
}
Registrar reg_embedding_bag_dense_backward("_embedding_bag_dense_backward",
                                           [](Ctx& c) { return embeddingBagDenseBackward(c, kDenseArgs); });
Registrar reg_embedding_bag_backward("_embedding_bag_backward", [](Ctx& c) {
  if (c.flagOr(9, false)) throw ir::Unsupported("embedding_bag backward with sparse=True (sparse gradients)");
  return embeddingBagDenseBackward(c, kBackwardArgs);
});

// _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets,
//   offset2bag, mode, padding_idx): d output / d per_sample_weights[i] is the
//   dot of index i's row with its bag's gradient (sum mode only).
Registrar reg_embedding_bag_psw_backward("_embedding_bag_per_sample_weights_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value g = c.tensor(0), w = c.tensor(1), idx = c.tensor(2);
  const int64_t mode = c.i64(5), pad = c.i64Or(6, -1);
  if (mode != kSum)
    throw std::invalid_argument("embedding_bag_backward: per_sample_weights only supported for mode='sum'");
  const int64_t bags = g.shape()[0], n = idx.type.numel();
  const DType acc = accOf(g.dtype());
  if (n == 0) return std::vector<Value>{b.zeros(Type{g.dtype(), {0}})};
  PerIndex p = perIndex(b, idx, c.tensor(4), bags, pad);
  Value rows = b.convert(takeRows(b, w, p.ids), acc);
  Value grads = b.convert(takeRows(b, g, p.bag), acc);
  Value dot = reduceSum(b, mul(b, rows, grads), {1});
  return std::vector<Value>{b.convert(b.select(p.keep, dot, b.zeros(Type{acc, {n}})), g.dtype())};
});

// _jagged_to_padded_dense_forward(values [total, ...], offsets [1 x (B + 1)],
//   max_lengths [1], padding_value) -> [B, max_length, ...]: segment b's rows,
//   padded (or cut) to max_length.
Registrar reg_jagged_to_padded("_jagged_to_padded_dense_forward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value vals = c.tensor(0);
  const std::vector<Value> offsets = c.tensors(1);
  const std::vector<int64_t> max_len = c.ints(2);
  if (offsets.size() != 1 || max_len.size() != 1) throw ir::Unsupported("more than one jagged dim");
  const int64_t total = vals.shape()[0], width = max_len[0], bags = offsets[0].type.numel() - 1;
  Shape rest(vals.shape().begin() + 1, vals.shape().end());
  int64_t row = 1;
  for (int64_t d : rest) row *= d;
  Shape out_shape{bags, width};
  out_shape.insert(out_shape.end(), rest.begin(), rest.end());
  Value pad = b.constant(c.f64Or(3, 0.0), vals.dtype(), out_shape);
  if (total == 0 || bags <= 0 || width == 0) return std::vector<Value>{pad};
  Value offs = b.convert(b.reshape(offsets[0], {bags + 1}), DType::I64);
  Value starts = b.slice(offs, {0}, {bags}, {1});
  Value lengths = sub(b, b.slice(offs, {1}, {bags + 1}, {1}), starts);
  Value j = b.iota(Type{DType::I64, {bags, width}}, 1);
  Value valid = b.compare(j, b.broadcastInDim(lengths, {bags, width}, {0}), ir::Cmp::LT);
  Value src = add(b, b.broadcastInDim(starts, {bags, width}, {0}), j);
  src = b.clamp(b.constantInt(0, DType::I64), b.select(valid, src, b.zeros(Type{DType::I64, {bags, width}})),
                b.constantInt(total - 1, DType::I64));
  Value rows = takeRows(b, b.reshape(vals, {total, row}), b.reshape(src, {bags * width}));
  rows = b.reshape(rows, out_shape);
  return std::vector<Value>{b.select(b.broadcastInDim(valid, out_shape, {0, 1}), rows, pad)};
});

// _padded_dense_to_jagged_forward(dense [B, L, ...], offsets [1 x (B + 1)], total_L)
//   -> [total_L, ...]: the rows of each segment taken back from the padded form
//   (the backward of the conversion above).
Registrar reg_padded_to_jagged("_padded_dense_to_jagged_forward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value dense = c.tensor(0);
  const std::vector<Value> offsets = c.tensors(1);
  if (offsets.size() != 1) throw ir::Unsupported("more than one jagged dim");
  if (!c.has(2)) throw ir::Unsupported("padded to jagged without total_L (a data-dependent size)");
  const int64_t total = c.i64(2), bags = dense.shape()[0], width = dense.shape()[1];
  Shape rest(dense.shape().begin() + 2, dense.shape().end());
  int64_t row = 1;
  for (int64_t d : rest) row *= d;
  Shape out_shape{total};
  out_shape.insert(out_shape.end(), rest.begin(), rest.end());
  if (total == 0 || bags * width == 0) return std::vector<Value>{b.zeros(Type{dense.dtype(), out_shape})};
  Value offs = b.convert(b.reshape(offsets[0], {bags + 1}), DType::I64);
  Value bag = bagOfPositions(b, offs, bags, total, b.constantInt(total, DType::I64));
  Value safe_bag = b.clamp(b.constantInt(0, DType::I64), bag, b.constantInt(bags - 1, DType::I64));
  Value pos = b.iota(Type{DType::I64, {total}}, 0);
  Value j = sub(b, pos, takeRows1(b, offs, safe_bag));
  // A segment longer than the padded width is refused, as the CPU refuses it (RuntimeError).
  Value fits = b.compare(j, b.constantInt(width, DType::I64, {total}), ir::Cmp::LT);
  Value past_end = b.compare(bag, b.constantInt(bags, DType::I64, {total}), ir::Cmp::GE);
  c.requireInRange(reduceMin(b, b.binary("or", fits, past_end), {0}));  // min of bools: all
  Value valid = b.binary("and", fits, b.compare(bag, b.constantInt(bags, DType::I64, {total}), ir::Cmp::LT));
  Value flat = add(b, b.binary("multiply", safe_bag, b.constantInt(width, DType::I64, {total})),
                   b.select(valid, j, b.zeros(Type{DType::I64, {total}})));
  Value rows = b.reshape(takeRows(b, b.reshape(dense, {bags * width, row}), flat), out_shape);
  return std::vector<Value>{
      b.select(b.broadcastInDim(valid, out_shape, {0}), rows, b.zeros(Type{dense.dtype(), out_shape}))};
});

}  // namespace
}  // namespace tpu::ops
