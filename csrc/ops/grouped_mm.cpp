// torch._grouped_mm: the matrix products of a mixture of experts, one per group
// of rows (or columns, or of the contraction), the groups given by `offs`
// (cumulative ends, int32). Each form is one dense product over every group
// and a per-row (column, contraction slice) choice of its group's result: G
// times the arithmetic, no size read back from the device, so a compiled MoE
// layer stays one program. A grouped-GEMM kernel (megablox on a TPU) would
// skip the other groups' work.
#include "ops/common.h"

namespace tpu::ops {
namespace {

using ir::Builder;

// For each of `n` positions along a grouped dim: its group (the number of
// group ends at or before it; G for positions past the last end).
Value groupOf(Builder& b, const Value& offs, int64_t n) {
  const int64_t g = offs.shape().at(0);
  const Value pos = b.iota(Type{DType::I64, {n, g}}, 0);
  const Value ends = b.broadcastInDim(b.convert(offs, DType::I64), {n, g}, {1});
  const Value past = b.convert(b.compare(ends, pos, ir::Cmp::LE), DType::I64);
  return reduceSum(b, past, {1});  // [n]
}

// `per_group` [.., G at `gdim`, ..] -> the entry of each position's group along
// the grouped dim `pdim` of the result (zeros past the last group).
Value pickGroup(Builder& b, const Value& per_group, int64_t gdim, int64_t pdim, const Value& group) {
  const Shape& s = per_group.shape();
  const Value idx = b.broadcastInDim(group, s, {pdim});
  const Value mine = b.compare(b.iota(Type{DType::I64, s}, static_cast<int>(gdim)), idx, ir::Cmp::EQ);
  const Value kept = b.select(mine, per_group, b.zeros(per_group.type));
  return reduceSum(b, kept, {gdim});
}

std::vector<Value> groupedMm(Ctx& c) {
  const Value a = c.tensor(0), w = c.tensor(1);
  const std::optional<Value> offs = c.optTensor(2);
  if (c.has(3)) throw ir::Unsupported("_grouped_mm with a bias");
  const DType out = c.optDType(4).value_or(a.dtype());
  const DType acc = DType::F32;
  const Value x = c.b.convert(a, acc), y = c.b.convert(w, acc);
  Value r;
  if (a.rank() == 3 && w.rank() == 3) {  // [G, M, K] x [G, K, N]: a batch of products
    r = c.b.dotGeneral(x, y, {0}, {0}, {2}, {1}, acc);
  } else if (!offs) {
    throw ir::Unsupported("_grouped_mm of " + a.type.str() + " and " + w.type.str() + " without offs");
  } else if (a.rank() == 2 && w.rank() == 3) {                      // [M, K] x [G, K, N], rows grouped
    const Value all = c.b.dotGeneral(x, y, {}, {}, {1}, {1}, acc);  // [M, G, N]
    r = pickGroup(c.b, all, 1, 0, groupOf(c.b, *offs, a.shape()[0]));
  } else if (a.rank() == 3 && w.rank() == 2) {                      // [G, M, K] x [K, N], columns grouped
    const Value all = c.b.dotGeneral(x, y, {}, {}, {2}, {0}, acc);  // [G, M, N]
    r = pickGroup(c.b, all, 0, 2, groupOf(c.b, *offs, w.shape()[1]));
  } else if (a.rank() == 2 && w.rank() == 2) {  // [M, K] x [K, N] -> [G, M, N], the contraction grouped
    const int64_t g = offs->shape().at(0), m = a.shape()[0], k = a.shape()[1];
    const Value group = groupOf(c.b, *offs, k);  // [K]
    const Shape gmk = {g, m, k};
    const Value mine =
        c.b.compare(c.b.iota(Type{DType::I64, gmk}, 0), c.b.broadcastInDim(group, gmk, {2}), ir::Cmp::EQ);
    const Value masked = c.b.select(mine, c.b.broadcastInDim(x, gmk, {1, 2}), c.b.zeros(Type{acc, gmk}));
    r = c.b.dotGeneral(masked, y, {}, {}, {2}, {0}, acc);  // [G, M, N]
  } else {
    throw ir::Unsupported("_grouped_mm of " + a.type.str() + " and " + w.type.str());
  }
  return {c.b.convert(r, out)};
}

const Registrar kGroupedMm("_grouped_mm", groupedMm);

}  // namespace
}  // namespace tpu::ops
