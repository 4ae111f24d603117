// Helpers shared by the lowerings: broadcasting, PyTorch type promotion,
// dimension wrapping, and common reduction bodies.
#pragma once

#include "ops/lowering.h"

namespace tpu::ops {

// The dtype of result 0: PyTorch's (from the meta kernel) when known.
inline DType outType(const Ctx& c, DType fallback) { return c.hasExpected() ? c.expectedAt(0).dtype : fallback; }

// Elementwise bodies, over operands already in the compute type.
using Fn1 = std::function<Value(ir::Builder&, const Value&)>;
using Fn2 = std::function<Value(ir::Builder&, const Value&, const Value&)>;

// Unary math whose result is a float: ints and bools promote to float32,
// complex stays complex; computed in the result's compute type and rounded
// once, as PyTorch's CPU kernels do. A dtype PyTorch refuses for an op
// (complex, for most special functions) raises before any lowering (the
// dispatcher's dtype refusals), so every dtype that gets here is computed:
// complex sinc as PyTorch computes it, for one.
std::vector<Value> floatUnary(Ctx& c, const Fn1& f);

Shape broadcastShapes(const Shape& a, const Shape& b);
// Broadcasts all values to their common shape (dtypes untouched).
std::vector<Value> broadcastAll(ir::Builder& b, std::vector<Value> vs);

// PyTorch's result_type over the tensor/scalar arguments at `idx`:
// dimensioned tensors win over 0-d tensors, which win over Python scalars,
// except across categories (bool < int < float).
DType resultType(const Ctx& c, const std::vector<size_t>& idx);

// Converts to `t` and broadcasts to `shape`.
Value cast(ir::Builder& b, const Value& v, DType t);
Value castTo(ir::Builder& b, const Value& v, DType t, const Shape& shape);

int64_t wrapDim(int64_t d, int64_t rank);
std::vector<int64_t> wrapDims(const std::vector<int64_t>& dims, int64_t rank);
// All dims when `dims` is empty or absent.
std::vector<int64_t> reductionDims(const std::optional<std::vector<int64_t>>& dims, int64_t rank);

// Scalar reductions.
Value reduceSum(ir::Builder& b, const Value& v, const std::vector<int64_t>& dims);
Value reduceMax(ir::Builder& b, const Value& v, const std::vector<int64_t>& dims);
Value reduceMin(ir::Builder& b, const Value& v, const std::vector<int64_t>& dims);
// Re-inserts reduced dims as size 1 (keepdim).
Value keepDims(ir::Builder& b, const Value& reduced, const Shape& in_shape, const std::vector<int64_t>& dims);

double lowestValue(DType t);    // -inf for floats, min for ints
double highestValue(DType t);   // +inf for floats, max for ints
double largestFinite(DType t);  // a float dtype's largest finite value
// maximum or minimum that is NaN when either operand is: XLA:CPU's scatter
// bodies drop a NaN operand of stablehlo.maximum/minimum.
Value nanPropagating(ir::Builder& b, const char* op, const Value& x, const Value& y);
// The reduction body of a max pool over (value, flat index) pairs.
ir::Builder::BodyFn maxWithIndex(bool is_float);
// lowestValue/highestValue as a constant of dtype t (int64's ends exactly).
Value extremeConst(ir::Builder& b, DType t, bool lowest, const Shape& shape = {});

// Elementwise helpers taking operands of equal type.
Value add(ir::Builder& b, const Value& x, const Value& y);
Value sub(ir::Builder& b, const Value& x, const Value& y);
Value mul(ir::Builder& b, const Value& x, const Value& y);
Value div(ir::Builder& b, const Value& x, const Value& y);
// A constant like `like` (same dtype and shape).
Value full(ir::Builder& b, double v, const Value& like);

// Matrix product with PyTorch's matmul broadcasting (1-d, 2-d, batched).
Value matmul(ir::Builder& b, const Value& x, const Value& y);

// True (a bool scalar) when every index is in [0, size), or in [-size, size)
// with `allow_negative` (advanced indexing).
Value indicesInRange(ir::Builder& b, const Value& idx, int64_t size, bool allow_negative);

// The float type math on `t` computes in (integers and bool become float32).
inline DType floatOf(DType t) { return ir::isFloat(t) || ir::isComplex(t) ? t : DType::F32; }
// Low-precision floats compute in float32 internally, like PyTorch's CPU.
inline DType accOf(DType t) { return (t == DType::F16 || t == DType::BF16) ? DType::F32 : t; }

// Inclusive scan along `dim` with a binary StableHLO op ("add", "multiply").
Value scan(ir::Builder& b, const Value& x, int64_t dim, const char* op, double init);
// Stable sort along `dim` -> {values, int64 indices}; NaN sorts as largest.
std::vector<Value> sortImpl(ir::Builder& b, const Value& x, int64_t dim, bool descending);

// erf(x) on a float value (f32 rational approximation; f64 series).
Value erf(ir::Builder& b, const Value& x);

}  // namespace tpu::ops
