#include "ops/common.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>

#include "ops/kernel_slots.h"

namespace tpu::ops {

// ---------------------------------------------------------------- registry

namespace {
std::map<std::string, Lowering>& table() {
  static std::map<std::string, Lowering> t;
  return t;
}
}  // namespace

void registerLowering(const std::string& name, LowerFn fn, std::vector<int> const_scalars, bool data_dependent) {
  table()[name] = Lowering{std::move(fn), std::move(const_scalars), data_dependent};
}

const Lowering* findLowering(const std::string& name, const std::string& overload) {
  auto& t = table();
  if (!overload.empty()) {
    auto it = t.find(name + "." + overload);
    if (it != t.end()) return &it->second;
  }
  auto it = t.find(name);
  return it == t.end() ? nullptr : &it->second;
}

namespace {
const KernelSlots kNoSlots;
// Written when the runtime starts, before anything is lowered.
std::atomic<const KernelSlots*> g_slots{&kNoSlots};
}  // namespace
const KernelSlots& kernelSlots() { return *g_slots.load(std::memory_order_acquire); }
void setKernelSlots(const KernelSlots* slots) { g_slots.store(slots ? slots : &kNoSlots, std::memory_order_release); }

namespace {
thread_local bool t_multi_op = false;
}  // namespace
bool inMultiOpProgram() { return t_multi_op; }
MultiOpProgram::MultiOpProgram() : was_(t_multi_op) { t_multi_op = true; }
MultiOpProgram::~MultiOpProgram() { t_multi_op = was_; }

std::vector<std::string> loweredOps() {
  std::vector<std::string> out;
  for (const auto& [k, v] : table()) out.push_back(k);
  return out;
}

// ---------------------------------------------------------------- Ctx

const Arg& Ctx::arg(size_t i) const {
  if (i >= args_.size()) throw ir::Unsupported(op_ + ": argument " + std::to_string(i) + " missing");
  return args_[i];
}

Value Ctx::tensor(size_t i) const {
  const Arg& a = arg(i);
  if (a.kind == Arg::Kind::Tensor || a.kind == Arg::Kind::Scalar) return a.value;
  throw ir::Unsupported(op_ + ": argument " + std::to_string(i) + " is not a tensor");
}

std::optional<Value> Ctx::optTensor(size_t i) const {
  if (!has(i)) return std::nullopt;
  return tensor(i);
}

std::vector<Value> Ctx::tensors(size_t i) const {
  const Arg& a = arg(i);
  if (a.kind != Arg::Kind::TensorList && a.kind != Arg::Kind::ScalarList)
    throw ir::Unsupported(op_ + ": argument " + std::to_string(i) + " is not a tensor list");
  return a.values;
}

int64_t Ctx::i64(size_t i) const {
  const Arg& a = arg(i);
  if (a.kind == Arg::Kind::Int) return a.i;
  if (a.kind == Arg::Kind::Bool) return a.b;
  if (a.kind == Arg::Kind::IntList && a.ints.size() == 1) return a.ints[0];
  throw ir::Unsupported(op_ + ": argument " + std::to_string(i) + " is not an int");
}

double Ctx::f64(size_t i) const {
  const Arg& a = arg(i);
  if (a.kind == Arg::Kind::Double) return a.d;
  if (a.kind == Arg::Kind::Int) return static_cast<double>(a.i);
  if (a.kind == Arg::Kind::Bool) return a.b;
  if (a.kind == Arg::Kind::Scalar && a.const_value) return *a.const_value;
  throw ir::Unsupported(op_ + ": argument " + std::to_string(i) + " is not a float");
}

bool Ctx::flag(size_t i) const {
  const Arg& a = arg(i);
  if (a.kind == Arg::Kind::Bool) return a.b;
  if (a.kind == Arg::Kind::Int) return a.i != 0;
  throw ir::Unsupported(op_ + ": argument " + std::to_string(i) + " is not a bool");
}

std::vector<int64_t> Ctx::ints(size_t i) const {
  const Arg& a = arg(i);
  if (a.kind == Arg::Kind::IntList) return a.ints;
  if (a.kind == Arg::Kind::Int) return {a.i};
  throw ir::Unsupported(op_ + ": argument " + std::to_string(i) + " is not an int list");
}

std::optional<std::vector<int64_t>> Ctx::optInts(size_t i) const {
  if (!has(i)) return std::nullopt;
  return ints(i);
}

std::string Ctx::str(size_t i) const {
  const Arg& a = arg(i);
  if (a.kind == Arg::Kind::String) return a.s;
  throw ir::Unsupported(op_ + ": argument " + std::to_string(i) + " is not a string");
}

std::optional<DType> Ctx::optDType(size_t i) const {
  if (!has(i)) return std::nullopt;
  const Arg& a = arg(i);
  if (a.kind != Arg::Kind::DType) throw ir::Unsupported(op_ + ": argument " + std::to_string(i) + " is not a dtype");
  return a.dtype;
}

Value Ctx::scalar(size_t i, DType t) const {
  const Arg& a = arg(i);
  if (a.kind == Arg::Kind::Scalar || a.kind == Arg::Kind::Tensor) {
    if (a.value.rank() != 0) throw ir::Unsupported(op_ + ": expected a scalar at argument " + std::to_string(i));
    return b.convert(a.value, t);
  }
  if (a.kind == Arg::Kind::Double) return b.constant(a.d, t);
  if (a.kind == Arg::Kind::Int) return b.constantInt(a.i, t);
  if (a.kind == Arg::Kind::Bool) return b.constantInt(a.b, t);
  throw ir::Unsupported(op_ + ": argument " + std::to_string(i) + " is not a scalar");
}

Value Ctx::scalarOr(size_t i, DType t, double dflt) const { return has(i) ? scalar(i, t) : b.constant(dflt, t); }

double Ctx::constScalar(size_t i) const {
  const Arg& a = arg(i);
  if (a.const_value) return *a.const_value;
  return f64(i);
}

const Type& Ctx::expectedAt(size_t i) const {
  if (i >= expected_.size()) throw ir::Unsupported(op_ + ": no expected type for result " + std::to_string(i));
  return expected_[i];
}

Value Ctx::rngState() {
  if (!make_rng_state) throw ir::Unsupported(op_ + ": random numbers are not available here");
  ++rng_states_;
  return make_rng_state(b);
}

// ---------------------------------------------------------------- helpers

Shape broadcastShapes(const Shape& a, const Shape& b) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1)
      throw std::invalid_argument("The size of tensor a (" + std::to_string(da) +
                                  ") must match the size of tensor b (" + std::to_string(db) +
                                  ") at non-singleton dimension " + std::to_string(i));
    out[i] = da == 1 ? db : da;
  }
  return out;
}

std::vector<Value> broadcastAll(ir::Builder& b, std::vector<Value> vs) {
  Shape s;
  for (const auto& v : vs) s = broadcastShapes(s, v.shape());
  for (auto& v : vs) v = b.broadcastTo(v, s);
  return vs;
}

namespace {
// c10's combine_categories.
std::optional<DType> combine(std::optional<DType> higher, std::optional<DType> lower) {
  if (!higher) return lower;
  if (!lower) return higher;
  if (ir::isComplex(*higher)) return higher;
  if (ir::isFloat(*higher)) return higher;
  if (*higher == DType::Bool || ir::isFloat(*lower) || ir::isComplex(*lower)) return ir::promote(*higher, *lower);
  return higher;
}
std::optional<DType> promoteOpt(std::optional<DType> a, DType b) { return a ? ir::promote(*a, b) : b; }
}  // namespace

DType resultType(const Ctx& c, const std::vector<size_t>& idx) {
  std::optional<DType> dim, zero, wrapped;
  for (size_t i : idx) {
    if (!c.has(i)) continue;
    const Arg& a = c.arg(i);
    if (a.kind == Arg::Kind::Scalar) {
      DType t = a.scalar_is_float ? DType::F32 : (a.value.dtype() == DType::Bool ? DType::Bool : DType::I64);
      if (ir::isComplex(a.value.dtype())) t = DType::C64;  // a Python complex: complex64 with float32
      wrapped = promoteOpt(wrapped, t);
    } else if (a.kind == Arg::Kind::Tensor) {
      if (a.value.rank() == 0)
        zero = promoteOpt(zero, a.value.dtype());
      else
        dim = promoteOpt(dim, a.value.dtype());
    } else if (a.kind == Arg::Kind::Double) {
      wrapped = promoteOpt(wrapped, DType::F32);
    } else if (a.kind == Arg::Kind::Int) {
      wrapped = promoteOpt(wrapped, DType::I64);
    }
  }
  auto r = combine(dim, combine(zero, wrapped));
  return r ? *r : DType::F32;
}

Value cast(ir::Builder& b, const Value& v, DType t) { return b.convert(v, t); }

Value castTo(ir::Builder& b, const Value& v, DType t, const Shape& shape) {
  return b.broadcastTo(b.convert(v, t), shape);
}

int64_t wrapDim(int64_t d, int64_t rank) {
  int64_t r = rank == 0 ? 1 : rank;
  if (d < -r || d >= r)
    throw std::out_of_range("Dimension out of range (expected to be in range of [" + std::to_string(-r) + ", " +
                            std::to_string(r - 1) + "], but got " + std::to_string(d) + ")");
  return d < 0 ? d + r : d;
}

std::vector<int64_t> wrapDims(const std::vector<int64_t>& dims, int64_t rank) {
  std::vector<int64_t> out;
  for (auto d : dims) out.push_back(rank == 0 ? 0 : wrapDim(d, rank));
  if (rank == 0) out.clear();
  return out;
}

std::vector<int64_t> reductionDims(const std::optional<std::vector<int64_t>>& dims, int64_t rank) {
  if (!dims || dims->empty()) {
    std::vector<int64_t> all;
    for (int64_t i = 0; i < rank; ++i) all.push_back(i);
    return all;
  }
  return wrapDims(*dims, rank);
}

namespace {
template <typename T>
double limit(bool lowest) {
  return lowest ? static_cast<double>(std::numeric_limits<T>::lowest())
                : static_cast<double>(std::numeric_limits<T>::max());
}
// An integer dtype's (or bool's) lowest or highest value; infinity otherwise.
double extremeValue(DType t, bool lowest) {
  switch (t) {
    case DType::Bool:
      return lowest ? 0 : 1;
    case DType::U8:
      return limit<uint8_t>(lowest);
    case DType::I8:
      return limit<int8_t>(lowest);
    case DType::I16:
      return limit<int16_t>(lowest);
    case DType::I32:
      return limit<int32_t>(lowest);
    case DType::I64:
      return limit<int64_t>(lowest);
    default:
      return lowest ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
  }
}
}  // namespace

double lowestValue(DType t) { return extremeValue(t, true); }
double highestValue(DType t) { return extremeValue(t, false); }

double largestFinite(DType t) {
  switch (t) {
    case DType::F16:
      return 65504.0;
    case DType::BF16:
      return 3.3895313892515355e38;
    case DType::F64:
      return 1.7976931348623157e308;
    default:
      return 3.4028234663852886e38;
  }
}

Value extremeConst(ir::Builder& b, DType t, bool lowest, const Shape& shape) {
  if (t == DType::I64)
    return b.constantInt(lowest ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int64_t>::max(), t, shape);
  return b.constant(lowest ? lowestValue(t) : highestValue(t), t, shape);
}

namespace {
// `lane_body`: see ir::Builder::reduce (true for the float and integer add).
Value reduceWith(ir::Builder& b, const Value& v, const std::vector<int64_t>& dims, const char* op, const Value& init,
                 bool lane_body = false) {
  if (dims.empty()) return v;
  return b.reduce(
      {v}, {init}, dims,
      [op](ir::Builder& bb, const std::vector<Value>& a) { return std::vector<Value>{bb.binary(op, a[0], a[1])}; },
      lane_body)[0];
}
}  // namespace

Value reduceSum(ir::Builder& b, const Value& v, const std::vector<int64_t>& dims) {
  if (v.dtype() == DType::Bool) return reduceWith(b, v, dims, "or", b.constantInt(0, DType::Bool));
  return reduceWith(b, v, dims, "add", b.constant(0.0, v.dtype()), /*lane_body=*/true);
}

Value reduceMax(ir::Builder& b, const Value& v, const std::vector<int64_t>& dims) {
  if (v.dtype() == DType::Bool) return reduceWith(b, v, dims, "or", b.constantInt(0, DType::Bool));
  return reduceWith(b, v, dims, "maximum", extremeConst(b, v.dtype(), true));
}

Value reduceMin(ir::Builder& b, const Value& v, const std::vector<int64_t>& dims) {
  if (v.dtype() == DType::Bool) return reduceWith(b, v, dims, "and", b.constantInt(1, DType::Bool));
  return reduceWith(b, v, dims, "minimum", extremeConst(b, v.dtype(), false));
}

Value keepDims(ir::Builder& b, const Value& reduced, const Shape& in_shape, const std::vector<int64_t>& dims) {
  Shape s = in_shape;
  for (auto d : dims) s[d] = 1;
  return b.reshape(reduced, s);
}

Value indicesInRange(ir::Builder& b, const Value& idx, int64_t size, bool allow_negative) {
  Value i = b.convert(idx, DType::I64);
  Value lo = b.constantInt(allow_negative ? -size : 0, DType::I64, i.shape());
  Value hi = b.constantInt(size, DType::I64, i.shape());
  Value ok = b.binary("and", b.compare(i, lo, ir::Cmp::GE), b.compare(i, hi, ir::Cmp::LT));
  std::vector<int64_t> all;
  for (int d = 0; d < ok.rank(); ++d) all.push_back(d);
  return reduceMin(b, ok, all);
}

std::vector<Value> floatUnary(Ctx& c, const Fn1& f) {
  Value x = c.tensor(0);
  DType out = outType(c, floatOf(x.dtype()));
  DType comp = accOf(out);
  return {c.b.convert(f(c.b, c.b.convert(x, comp)), out)};
}

Value add(ir::Builder& b, const Value& x, const Value& y) {
  if (x.dtype() == DType::Bool) return b.binary("or", x, y);
  return b.binary("add", x, y);
}
Value sub(ir::Builder& b, const Value& x, const Value& y) { return b.binary("subtract", x, y); }
Value mul(ir::Builder& b, const Value& x, const Value& y) {
  if (x.dtype() == DType::Bool) return b.binary("and", x, y);
  return b.binary("multiply", x, y);
}
Value div(ir::Builder& b, const Value& x, const Value& y) { return b.binary("divide", x, y); }
Value full(ir::Builder& b, double v, const Value& like) { return b.constant(v, like.dtype(), like.shape()); }

Value matmul(ir::Builder& b, const Value& x0, const Value& y0) {
  Value x = x0, y = y0;
  DType t = x.dtype();
  if (x.rank() == 1 && y.rank() == 1) return b.dotGeneral(x, y, {}, {}, {0}, {0}, t);
  if (x.rank() == 2 && y.rank() == 2) {
    if (auto r = kernelSlots().matmul(b, x, y)) return *r;
    return b.dotGeneral(x, y, {}, {}, {1}, {0}, t);
  }
  if (x.rank() == 2 && y.rank() == 1) return b.dotGeneral(x, y, {}, {}, {1}, {0}, t);
  if (x.rank() == 1 && y.rank() == 2) return b.dotGeneral(x, y, {}, {}, {0}, {0}, t);
  // Batched: promote 1-d operands, broadcast batch dims, dot, squeeze.
  bool xv = x.rank() == 1, yv = y.rank() == 1;
  if (xv) x = b.reshape(x, {1, x.shape()[0]});
  if (yv) y = b.reshape(y, {y.shape()[0], 1});
  Shape xb(x.shape().begin(), x.shape().end() - 2), yb(y.shape().begin(), y.shape().end() - 2);
  Shape batch = broadcastShapes(xb, yb);
  Shape xs = batch, ys = batch;
  xs.push_back(x.shape()[x.rank() - 2]);
  xs.push_back(x.shape()[x.rank() - 1]);
  ys.push_back(y.shape()[y.rank() - 2]);
  ys.push_back(y.shape()[y.rank() - 1]);
  x = b.broadcastTo(x, xs);
  y = b.broadcastTo(y, ys);
  int64_t nb = static_cast<int64_t>(batch.size());
  std::vector<int64_t> bd;
  for (int64_t i = 0; i < nb; ++i) bd.push_back(i);
  Value r = b.dotGeneral(x, y, bd, bd, {nb + 1}, {nb}, t);
  Shape out = batch;
  if (!xv) out.push_back(x.shape()[nb]);
  if (!yv) out.push_back(y.shape()[nb + 1]);
  return b.reshape(r, out);
}

// --- special functions shared by elementwise.cpp and special.cpp

static Value erfApprox(ir::Builder& b, const Value& x) {
  // chlo.erf is not core StableHLO: Abramowitz-Stegun 7.1.26 is too coarse,
  // so use the float32 rational approximation XLA itself uses for erf.
  Value xc = b.clamp(full(b, -4.0, x), x, full(b, 4.0, x));
  Value x2 = mul(b, xc, xc);
  const double alpha[] = {-2.72614225801306e-10, 2.77068142495902e-08,  -2.10102402082508e-06, -5.69250639462346e-05,
                          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02};
  const double beta[] = {-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
                         -1.42647390514189e-02};
  Value p = full(b, alpha[0], x);
  for (int i = 1; i < 7; ++i) p = add(b, mul(b, p, x2), full(b, alpha[i], x));
  p = mul(b, p, xc);
  Value q = full(b, beta[0], x);
  for (int i = 1; i < 5; ++i) q = add(b, mul(b, q, x2), full(b, beta[i], x));
  return div(b, p, q);
}

Value erf(ir::Builder& b, const Value& x) {
  if (x.dtype() == DType::F64) {
    // Double precision: the Taylor series for |x| < 2 (60 terms; its
    // cancellation is harmless there), and 1 - exp(-x^2) erfcx(|x|) with the
    // continued fraction of erfcx beyond (depth 60: relative error ~1e-16 at 2).
    Value ax = b.unary("abs", x);
    Value two = full(b, 2.0, x);
    Value lo = b.compare(ax, two, ir::Cmp::LT);
    Value xs = b.select(lo, x, full(b, 0.0, x));
    Value xx = mul(b, xs, xs);
    Value term = xs;
    Value sum = xs;
    for (int n = 1; n < 60; ++n) {
      term = mul(b, term, mul(b, b.unary("negate", xx), full(b, 1.0 / n, x)));
      sum = add(b, sum, mul(b, term, full(b, 1.0 / (2 * n + 1), x)));
    }
    Value small = mul(b, sum, full(b, 2.0 / std::sqrt(M_PI), x));
    Value xl = b.select(lo, two, ax);
    Value f = xl;
    for (int n = 60; n >= 1; --n) f = add(b, xl, div(b, full(b, 0.5 * n, x), f));
    Value erfc =
        div(b, mul(b, b.unary("exponential", b.unary("negate", mul(b, xl, xl))), full(b, 1.0 / std::sqrt(M_PI), x)), f);
    Value big = sub(b, full(b, 1.0, x), erfc);
    big = b.select(b.compare(x, full(b, 0.0, x), ir::Cmp::LT), b.unary("negate", big), big);
    return b.select(lo, small, b.select(b.compare(x, x, ir::Cmp::NE), x, big));
  }
  return erfApprox(b, x);
}

Value nanPropagating(ir::Builder& b, const char* op, const Value& x, const Value& y) {
  Value r = b.binary(op, x, y);
  if (!ir::isFloat(x.dtype())) return r;
  Value nan = b.binary("or", b.compare(x, x, ir::Cmp::NE), b.compare(y, y, ir::Cmp::NE));
  return b.select(nan, add(b, x, y), r);
}

// Reduction body for (value, flat index) pairs of a max pool: the larger
// value wins, ties keep the smaller index, NaN wins (the last among NaNs, as
// PyTorch's pooling kernels test `val > max || isnan(val)`); index -1 marks
// the identity (padding).
ir::Builder::BodyFn maxWithIndex(bool is_float) {
  return [is_float](ir::Builder& bb, const std::vector<Value>& a) {
    Value av = a[0], ai = a[1], cv = a[2], ci = a[3];
    Value ainit = bb.compare(ai, bb.constantInt(-1, DType::I64), ir::Cmp::EQ);
    Value cinit = bb.compare(ci, bb.constantInt(-1, DType::I64), ir::Cmp::EQ);
    Value gt = bb.compare(cv, av, ir::Cmp::GT);
    Value eq = bb.compare(cv, av, ir::Cmp::EQ);
    Value pick = bb.binary("or", gt, bb.binary("and", eq, bb.compare(ci, ai, ir::Cmp::LT)));
    if (is_float) {
      Value cn = bb.compare(cv, cv, ir::Cmp::NE), an = bb.compare(av, av, ir::Cmp::NE);
      pick = bb.select(an, bb.binary("and", cn, bb.compare(ci, ai, ir::Cmp::GT)), bb.binary("or", pick, cn));
    }
    pick = bb.select(ainit, bb.unary("not", cinit), bb.binary("and", pick, bb.unary("not", cinit)));
    return std::vector<Value>{bb.select(pick, cv, av), bb.select(pick, ci, ai)};
  };
}

}  // namespace tpu::ops
