// unique and unique_consecutive: data-dependent lengths. The distinct values
// are computed on the device into a buffer as long as the input; the host
// reads the count back and cuts values and counts to it.
#include "ops/common.h"

namespace tpu::ops {
namespace {

struct Groups {
  Value values;  // [n] each element's value in group order (sorted or not)
  Value order;   // [n] int64: original position of each element
  Value group;   // [n] int64: group id of each element (in `values` order)
  Value is_new;  // [n] bool: first element of its group
  Value count;   // int64 scalar: number of groups
};

// Groups runs of equal values in `v` (1-d). NaN never equals NaN, so each
// NaN is a group of its own, as on the CPU.
Groups runs(ir::Builder& b, const Value& v, const Value& order) {
  int64_t n = v.shape()[0];
  Groups g{v, order, {}, {}, {}};
  Value differs = b.compare(b.slice(v, {1}, {n}, {1}), b.slice(v, {0}, {n - 1}, {1}), ir::Cmp::NE);
  g.is_new = b.concatenate({b.constantInt(1, DType::Bool, {1}), differs}, 0);
  Value inc = scan(b, b.convert(g.is_new, DType::I64), 0, "add", 0.0);
  g.group = sub(b, inc, b.constantInt(1, DType::I64, {n}));
  g.count = reduceSum(b, b.convert(g.is_new, DType::I64), {0});
  return g;
}

// Scatters per-element data into per-group slots (padded to n).
Value toGroups(ir::Builder& b, const Value& group, const Value& data, bool accumulate) {
  int64_t n = group.shape()[0];
  ir::Builder::ScatterDims dn;
  dn.inserted_window_dims = {0};
  dn.scatter_dims_to_operand_dims = {0};
  dn.index_vector_dim = 1;
  return b.scatter(b.zeros(Type{data.dtype(), {n}}), b.reshape(group, {n, 1}), data, dn,
                   [accumulate](ir::Builder& bb, const std::vector<Value>& a) {
                     return std::vector<Value>{accumulate ? add(bb, a[0], a[1]) : a[1]};
                   });
}

// The three results of _unique2 / unique_consecutive from grouped runs.
std::vector<Value> finish(Ctx& c, const Groups& g, const Shape& in_shape, bool want_inverse, bool want_counts,
                          bool with_counts_result) {
  ir::Builder& b = c.b;
  int64_t n = g.values.shape()[0];
  std::vector<Value> out{toGroups(b, g.group, g.values, false)};
  if (want_inverse) {
    // inverse[order[i]] = group[i]
    Value inv = toGroups(b, g.order, g.group, false);
    out.push_back(b.reshape(inv, in_shape));
  } else {
    out.push_back(b.constantInt(0, DType::I64, {0}));
  }
  if (with_counts_result)
    out.push_back(want_counts ? toGroups(b, g.group, b.constantInt(1, DType::I64, {n}), true)
                              : b.constantInt(0, DType::I64, {0}));
  c.setDynamicLength(g.count, {0, 2});
  return out;
}

std::vector<Value> emptyResults(Ctx& c, DType t, const Shape& in_shape, bool want_inverse, bool with_counts) {
  ir::Builder& b = c.b;
  std::vector<Value> out{b.zeros(Type{t, {0}}),
                         want_inverse ? b.zeros(Type{DType::I64, in_shape}) : b.zeros(Type{DType::I64, {0}})};
  if (with_counts) out.push_back(b.zeros(Type{DType::I64, {0}}));
  c.setDynamicLength(b.constantInt(0, DType::I64), {0, 2});
  return out;
}

// Sorted unique (the CPU sorts for sorted=False too).
std::vector<Value> uniqueSorted(Ctx& c, bool want_inverse, bool want_counts, bool with_counts_result) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  if (ir::isComplex(x.dtype())) throw ir::Unsupported("unique of a complex tensor");
  int64_t n = x.type.numel();
  if (n == 0) return emptyResults(c, x.dtype(), x.shape(), want_inverse, with_counts_result);
  Value flat = b.reshape(x, {n});
  // Bool sorts as uint8 (the comparator needs an order).
  Value key = x.dtype() == DType::Bool ? b.convert(flat, DType::U8) : flat;
  auto s = sortImpl(b, key, 0, false);
  Value sorted = x.dtype() == DType::Bool ? b.convert(s[0], DType::Bool) : s[0];
  return finish(c, runs(b, sorted, s[1]), x.shape(), want_inverse, want_counts, with_counts_result);
}

// _unique2(self, sorted, return_inverse, return_counts) -> (values, inverse, counts)
Registrar reg_unique2(
    "_unique2", [](Ctx& c) { return uniqueSorted(c, c.flagOr(2, false), c.flagOr(3, false), true); }, {}, true);
// _unique(self, sorted, return_inverse) -> (values, inverse)
Registrar reg_unique(
    "_unique", [](Ctx& c) { return uniqueSorted(c, c.flagOr(2, false), false, false); }, {}, true);

// unique_consecutive(self, return_inverse, return_counts, dim?)
Registrar reg_unique_consecutive(
    "unique_consecutive",
    [](Ctx& c) {
      if (c.has(3)) throw ir::Unsupported("unique_consecutive along a dim");
      ir::Builder& b = c.b;
      Value x = c.tensor(0);
      if (ir::isComplex(x.dtype())) throw ir::Unsupported("unique_consecutive of a complex tensor");
      bool inv = c.flagOr(1, false), cnt = c.flagOr(2, false);
      int64_t n = x.type.numel();
      if (n == 0) return emptyResults(c, x.dtype(), x.shape(), inv, true);
      Value flat = b.reshape(x, {n});
      Value key = x.dtype() == DType::Bool ? b.convert(flat, DType::U8) : flat;
      Groups g = runs(b, key, b.iota(Type{DType::I64, {n}}, 0));
      g.values = flat;
      return finish(c, g, x.shape(), inv, cnt, true);
    },
    {}, true);

}  // namespace
}  // namespace tpu::ops
