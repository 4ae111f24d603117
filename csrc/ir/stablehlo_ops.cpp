// The Builder's StableHLO operations: each appends one line of the program
// (constants, shape ops, elementwise ops, regions and reductions, dots,
// convolutions, gathers and scatters, sorting, random numbers, custom calls,
// loops and linear algebra). The Builder's core (values, params, outputs,
// functions, dataflow, emitting the module) is ir.cpp.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "ir/ir.h"

namespace tpu::ir {

namespace {
// The strides of a view (`sizes`, `strides`) reshaped to `target` when the
// reshape moves no data, else nullopt. The view's dims fall into runs that
// are contiguous with one another (a run's outer stride is its inner stride
// times the inner sizes); each run must be exactly covered by consecutive
// dims of `target`, which then step through it from the run's inner stride.
std::optional<std::vector<int64_t>> reshapedStrides(const Shape& sizes, const std::vector<int64_t>& strides,
                                                    const Shape& target) {
  std::vector<int64_t> out(target.size(), 1);
  int64_t numel = 1;
  for (auto n : sizes) numel *= n;
  if (numel == 0) return std::nullopt;
  int next = static_cast<int>(target.size()) - 1;  // innermost target dim not yet placed
  for (int i = static_cast<int>(sizes.size()) - 1; i >= 0;) {
    if (sizes[i] == 1) {
      --i;
      continue;
    }
    const int64_t inner = strides[i];
    int64_t run = sizes[i];
    int k = i - 1;
    for (; k >= 0 && (sizes[k] == 1 || strides[k] == inner * run); --k) run *= sizes[k];
    int64_t covered = 1;
    for (; next >= 0 && covered < run; --next) {
      out[next] = inner * covered;
      covered *= target[next];
    }
    if (covered != run) return std::nullopt;
    i = k;
  }
  for (; next >= 0; --next)
    if (target[next] != 1) return std::nullopt;
  return out;
}

std::string i64Array(const std::vector<int64_t>& v) {
  std::string s = "array<i64";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : ": ") + std::to_string(v[i]);
  return s + ">";
}
std::string list(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
std::string padAttr(const std::vector<std::pair<int64_t, int64_t>>& p) {
  std::string s = "dense<[";
  for (size_t i = 0; i < p.size(); ++i)
    s += (i ? ", [" : "[") + std::to_string(p[i].first) + ", " + std::to_string(p[i].second) + "]";
  s += "]> : tensor<" + std::to_string(p.size()) + "x2xi64>";
  if (p.empty()) s = "dense<> : tensor<0x2xi64>";
  return s;
}
const char* cmpName(Cmp c) {
  switch (c) {
    case Cmp::EQ:
      return "EQ";
    case Cmp::NE:
      return "NE";
    case Cmp::LT:
      return "LT";
    case Cmp::LE:
      return "LE";
    case Cmp::GT:
      return "GT";
    case Cmp::GE:
      return "GE";
  }
  return "EQ";
}
void fail(const std::string& m) { throw std::invalid_argument("torch_tpu IR: " + m); }
}  // namespace

// ---------------------------------------------------------------- constants

Value Builder::constant(double v, DType t, const Shape& shape) {
  if (!isFloat(t) && !isComplex(t)) {
    if (t == DType::Bool) return constantInt(v != 0.0 ? 1 : 0, t, shape);
    return constantInt(static_cast<int64_t>(v), t, shape);
  }
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  char hex[32];
  std::snprintf(hex, sizeof hex, "0x%016llX", static_cast<unsigned long long>(bits));
  Value c = fresh(scalarType(DType::F64));
  emitLine(ref(c) + " = \"stablehlo.constant\"() {value = dense<" + hex + "> : tensor<f64>} : () -> tensor<f64>");
  Value r = t == DType::F64 ? c : convert(c, t);
  return shape.empty() ? r : broadcastInDim(r, shape, {});
}

Value Builder::constantInt(int64_t v, DType t, const Shape& shape) {
  if (isFloat(t) || isComplex(t)) return constant(static_cast<double>(v), t, shape);
  Value c = fresh(scalarType(t));
  std::string lit = t == DType::Bool ? (v ? "true" : "false") : std::to_string(v);
  emitLine(ref(c) + " = \"stablehlo.constant\"() {value = dense<" + lit + "> : " + c.type.str() + "} : () -> " +
           c.type.str());
  return shape.empty() ? c : broadcastInDim(c, shape, {});
}

Value Builder::constantInts(const std::vector<int64_t>& vs, DType t) {
  Value c = fresh(Type{t, {static_cast<int64_t>(vs.size())}});
  std::string lit = "[";
  for (size_t i = 0; i < vs.size(); ++i) {
    if (i) lit += ", ";
    appendInt(lit, vs[i]);
  }
  lit += ']';
  emitLine(ref(c) + " = \"stablehlo.constant\"() {value = dense<" + lit + "> : " + c.type.str() + "} : () -> " +
           c.type.str());
  return c;
}

Value Builder::convert(const Value& v, DType t) {
  if (v.dtype() == t) return v;
  Value r = fresh(Type{t, v.shape()});
  if (t == DType::Bool && !isComplex(v.dtype())) {
    // PyTorch: x != 0. stablehlo.convert to i1 also means != 0; be explicit.
    Value z = constant(0.0, v.dtype(), v.shape());
    return compare(v, z, Cmp::NE);
  }
  if (isFloat(v.dtype())) {
    // PyTorch's CPU casts are C++ casts as x86 runs them: to 8- and 16-bit
    // integers through int32, wrapping (300.0 -> int8 44, -1.0 -> uint8 255);
    // to int32/int64, NaN and values out of range give the type's minimum.
    // stablehlo.convert saturates instead.
    if (t == DType::I8 || t == DType::I16 || t == DType::U8) return convert(convert(v, DType::I32), t);
    if (t == DType::I32 || t == DType::I64) {
      const double bound = t == DType::I32 ? 2147483648.0 : 9223372036854775808.0;
      Value in = binary("and", compare(v, constant(-bound, v.dtype(), v.shape()), Cmp::GE),
                        compare(v, constant(bound, v.dtype(), v.shape()), Cmp::LT));
      emitLine(ref(r) + " = \"stablehlo.convert\"(" + ref(v) + ") : (" + v.type.str() + ") -> " + r.type.str());
      const int64_t lowest = t == DType::I32 ? INT32_MIN : INT64_MIN;
      return select(in, r, constantInt(lowest, t, v.shape()));
    }
  }
  emitLine(ref(r) + " = \"stablehlo.convert\"(" + ref(v) + ") : (" + v.type.str() + ") -> " + r.type.str());
  return r;
}

Value Builder::bitcast(const Value& v, const Type& t) {
  Value r = fresh(t);
  emitLine(ref(r) + " = \"stablehlo.bitcast_convert\"(" + ref(v) + ") : (" + v.type.str() + ") -> " + t.str());
  return r;
}

Value Builder::iota(const Type& t, int dim) {
  Value r = fresh(t);
  emitLine(ref(r) + " = \"stablehlo.iota\"() {iota_dimension = " + std::to_string(dim) + " : i64} : () -> " + t.str());
  return r;
}

// ---------------------------------------------------------------- shape ops

Value Builder::reshape(const Value& v, const Shape& shape) {
  if (v.shape() == shape) return v;
  Type t{v.dtype(), shape};
  if (t.numel() != v.type.numel()) fail("reshape " + v.type.str() + " to " + t.str());
  Value r = fresh(t);
  emitLine(ref(r) + " = \"stablehlo.reshape\"(" + ref(v) + ") : (" + v.type.str() + ") -> " + t.str());
  if (auto view = viewOf(v)) {
    if (auto strides = reshapedStrides(v.shape(), view->strides, shape))
      views_[r.id] = StridedView{view->base, view->offset, std::move(*strides)};
  }
  return r;
}

namespace {
bool g_xla_cpu_tuning = false;
}  // namespace

void setXlaCpuTuning(bool on) { g_xla_cpu_tuning = on; }
bool xlaCpuTuning() { return g_xla_cpu_tuning; }

Value Builder::barrier(const Value& v) {
  Value r = fresh(v.type);
  emitLine(ref(r) + " = \"stablehlo.optimization_barrier\"(" + ref(v) + ") : (" + v.type.str() + ") -> " +
           v.type.str());
  return r;
}

Value Builder::broadcastInDim(const Value& v, const Shape& shape, const std::vector<int64_t>& dims) {
  if (static_cast<int>(dims.size()) != v.rank()) fail("broadcast_in_dim rank");
  if (v.shape() == shape) {
    bool ident = true;
    for (size_t i = 0; i < dims.size(); ++i) ident &= dims[i] == static_cast<int64_t>(i);
    if (ident) return v;
  }
  Value r = fresh(Type{v.dtype(), shape});
  emitLine(ref(r) + " = \"stablehlo.broadcast_in_dim\"(" + ref(v) + ") {broadcast_dimensions = " + i64Array(dims) +
           "} : (" + v.type.str() + ") -> " + r.type.str());
  return r;
}

Value Builder::broadcastTo(const Value& v, const Shape& shape) {
  if (v.shape() == shape) return v;
  int off = static_cast<int>(shape.size()) - v.rank();
  if (off < 0) fail("broadcastTo: rank");
  std::vector<int64_t> dims;
  Shape squeezed;
  std::vector<int64_t> keep;
  for (int i = 0; i < v.rank(); ++i) {
    int64_t d = v.shape()[i];
    if (d == shape[i + off]) {
      dims.push_back(i + off);
      squeezed.push_back(d);
    } else if (d != 1) {
      fail("broadcastTo: " + v.type.str() + " to " + shapeStr(shape));
    }
  }
  Value s = reshape(v, squeezed);
  return broadcastInDim(s, shape, dims);
}

Value Builder::transpose(const Value& v, const std::vector<int64_t>& perm) {
  bool ident = true;
  for (size_t i = 0; i < perm.size(); ++i) ident &= perm[i] == static_cast<int64_t>(i);
  if (ident) return v;
  Shape s;
  for (auto p : perm) s.push_back(v.shape().at(p));
  Value r = fresh(Type{v.dtype(), s});
  emitLine(ref(r) + " = \"stablehlo.transpose\"(" + ref(v) + ") {permutation = " + i64Array(perm) + "} : (" +
           v.type.str() + ") -> " + r.type.str());
  if (perm.size() == 2) transposed_from_.emplace(r.id, v);
  if (auto view = viewOf(v)) {
    StridedView t{view->base, view->offset, {}};
    for (auto p : perm) t.strides.push_back(view->strides[p]);
    views_[r.id] = std::move(t);
  }
  return r;
}

void Builder::noteView(const Value& v, StridedView view) {
  if (static_cast<int>(view.strides.size()) != v.rank()) fail("noteView: strides do not match " + v.type.str());
  views_[v.id] = std::move(view);
}

std::optional<StridedView> Builder::viewOf(const Value& v) const {
  auto it = views_.find(v.id);
  if (it == views_.end()) return std::nullopt;
  return it->second;
}

std::optional<Value> Builder::transposeSource(const Value& v) const {
  auto it = transposed_from_.find(v.id);
  if (it == transposed_from_.end()) return std::nullopt;
  return it->second;
}

Value Builder::slice(const Value& v, const Shape& start, const Shape& limit, const Shape& strides) {
  Shape s;
  bool ident = true;
  for (int i = 0; i < v.rank(); ++i) {
    int64_t n = limit[i] > start[i] ? (limit[i] - start[i] + strides[i] - 1) / strides[i] : 0;
    s.push_back(n);
    ident &= start[i] == 0 && limit[i] == v.shape()[i] && strides[i] == 1;
  }
  if (ident) return v;
  Value r = fresh(Type{v.dtype(), s});
  emitLine(ref(r) + " = \"stablehlo.slice\"(" + ref(v) + ") {start_indices = " + i64Array(start) +
           ", limit_indices = " + i64Array(limit) + ", strides = " + i64Array(strides) + "} : (" + v.type.str() +
           ") -> " + r.type.str());
  if (auto view = viewOf(v)) {
    StridedView t{view->base, view->offset, {}};
    for (int i = 0; i < v.rank(); ++i) {
      t.offset += start[i] * view->strides[i];
      t.strides.push_back(view->strides[i] * strides[i]);
    }
    views_[r.id] = std::move(t);
  }
  return r;
}

Value Builder::dynamicSlice(const Value& v, const std::vector<Value>& starts, const Shape& sizes) {
  Value r = fresh(Type{v.dtype(), sizes});
  std::string args = ref(v), tys = v.type.str();
  for (const auto& s : starts) {
    args += ", " + ref(s);
    tys += ", " + s.type.str();
  }
  emitLine(ref(r) + " = \"stablehlo.dynamic_slice\"(" + args + ") {slice_sizes = " + i64Array(sizes) + "} : (" + tys +
           ") -> " + r.type.str());
  return r;
}

Value Builder::dynamicUpdateSlice(const Value& v, const Value& update, const std::vector<Value>& starts) {
  Value r = fresh(v.type);
  std::string args = ref(v) + ", " + ref(update), tys = v.type.str() + ", " + update.type.str();
  for (const auto& s : starts) {
    args += ", " + ref(s);
    tys += ", " + s.type.str();
  }
  emitLine(ref(r) + " = \"stablehlo.dynamic_update_slice\"(" + args + ") : (" + tys + ") -> " + r.type.str());
  return r;
}

void Builder::setParticipants(const std::vector<int>& ids) {
  if (ids.empty()) throw Unsupported("a collective needs at least one participant");
  if (participants_ == ids) return;
  if (!participants_.empty())
    throw Unsupported("collectives over the devices of different worlds in one program (" +
                      std::to_string(participants_.size()) + " and " + std::to_string(ids.size()) + " devices)");
  participants_ = ids;
  std::string key = "replicas";
  for (int id : ids) {
    key += ' ';
    appendInt(key, id);
  }
  mix(key);
}

std::string Builder::replicaGroups(const std::vector<int>& group, int64_t channel) {
  if (participants_.empty()) throw Unsupported("a collective before setParticipants");
  if (channel < 1) throw Unsupported("a collective's channel starts at 1");
  max_channel_ = std::max(max_channel_, channel);
  const size_t n = participants_.size(), k = group.size();
  if (k == 0 || n % k) throw Unsupported("a collective's group does not divide the program's replicas");
  std::vector<bool> taken(n, false);
  std::vector<std::vector<size_t>> groups(1);
  for (int id : group) {
    const auto it = std::find(participants_.begin(), participants_.end(), id);
    if (it == participants_.end() || taken[it - participants_.begin()])
      throw Unsupported("a collective's group is not a set of the program's replicas");
    groups[0].push_back(static_cast<size_t>(it - participants_.begin()));
    taken[groups[0].back()] = true;
  }
  for (size_t r = 0; r < n; ++r) {
    if (taken[r]) continue;
    if (groups.back().size() == k) groups.emplace_back();
    groups.back().push_back(r);
  }
  // In the order of their first replica: every rank of a regular mesh writes the same groups.
  std::sort(groups.begin(), groups.end());
  std::string text;
  for (size_t g = 0; g < groups.size(); ++g) {
    text += g ? ", [" : "[";
    for (size_t i = 0; i < k; ++i) {
      if (i) text += ", ";
      appendInt(text, static_cast<int64_t>(groups[g][i]));
    }
    text += ']';
  }
  mix("groups " + text);
  return "channel_handle = #stablehlo.channel_handle<handle = " + std::to_string(channel) +
         ", type = 1>, replica_groups = dense<[" + text + "]> : tensor<" + std::to_string(groups.size()) + "x" +
         std::to_string(k) + "xi64>";
}

Shape Builder::splitAmongGroup(const char* what, const Value& v, int64_t dim, int64_t n) {
  Shape out = v.shape();
  if (n == 0 || out.at(dim) % n)
    throw Unsupported(std::string(what) + ": dim " + std::to_string(dim) + " of " + v.type.str() +
                      " does not split into " + std::to_string(n) + " blocks");
  out[dim] /= n;
  return out;
}

Value Builder::allReduce(const Value& v, const std::vector<int>& group, const BodyFn& combine, int64_t channel) {
  const std::string groups = replicaGroups(group, channel);
  const Type s = scalarType(v.dtype());
  std::string reg = region({s, s}, combine);
  Value r = fresh(v.type);
  emitLine(ref(r) + " = \"stablehlo.all_reduce\"(" + ref(v) + ") " + reg + " {" + groups + "} : (" + v.type.str() +
           ") -> " + r.type.str());
  ++collectives_;
  return r;
}

Value Builder::allGather(const Value& v, const std::vector<int>& group, int64_t dim, int64_t channel) {
  const std::string groups = replicaGroups(group, channel);
  Shape s = v.shape();
  s.at(dim) *= static_cast<int64_t>(group.size());
  Value r = fresh(Type{v.dtype(), s});
  emitLine(ref(r) + " = \"stablehlo.all_gather\"(" + ref(v) + ") {all_gather_dim = " + std::to_string(dim) +
           " : i64, " + groups + "} : (" + v.type.str() + ") -> " + r.type.str());
  ++collectives_;
  return r;
}

Value Builder::reduceScatter(const Value& v, const std::vector<int>& group, int64_t dim, const BodyFn& combine,
                             int64_t channel) {
  const Shape out = splitAmongGroup("reduce_scatter", v, dim, static_cast<int64_t>(group.size()));
  const std::string groups = replicaGroups(group, channel);
  const Type s = scalarType(v.dtype());
  std::string reg = region({s, s}, combine);
  Value r = fresh(Type{v.dtype(), out});
  emitLine(ref(r) + " = \"stablehlo.reduce_scatter\"(" + ref(v) + ") " + reg + " {" + groups +
           ", scatter_dimension = " + std::to_string(dim) + " : i64} : (" + v.type.str() + ") -> " + r.type.str());
  ++collectives_;
  return r;
}

Value Builder::allToAll(const Value& v, const std::vector<int>& group, int64_t split_dim, int64_t concat_dim,
                        int64_t channel) {
  const auto n = static_cast<int64_t>(group.size());
  Shape out = splitAmongGroup("all_to_all", v, split_dim, n);
  out.at(concat_dim) *= n;
  const std::string groups = replicaGroups(group, channel);
  Value r = fresh(Type{v.dtype(), out});
  emitLine(ref(r) + " = \"stablehlo.all_to_all\"(" + ref(v) + ") {concat_dimension = " + std::to_string(concat_dim) +
           " : i64, " + groups + ", split_count = " + std::to_string(n) + " : i64, split_dimension = " +
           std::to_string(split_dim) + " : i64} : (" + v.type.str() + ") -> " + r.type.str());
  ++collectives_;
  return r;
}

Value Builder::concatenate(const std::vector<Value>& vs, int64_t dim) {
  if (vs.size() == 1) return vs[0];
  Shape s = vs.at(0).shape();
  s[dim] = 0;
  std::string args;
  for (size_t i = 0; i < vs.size(); ++i) {
    s[dim] += vs[i].shape()[dim];
    args += (i ? ", " : "") + ref(vs[i]);
  }
  Value r = fresh(Type{vs[0].dtype(), s});
  emitLine(ref(r) + " = \"stablehlo.concatenate\"(" + args + ") {dimension = " + std::to_string(dim) + " : i64} : (" +
           types(vs) + ") -> " + r.type.str());
  return r;
}

Value Builder::pad(const Value& v, const Value& pv, const Shape& lo, const Shape& hi, const Shape& interior) {
  Shape s;
  for (int i = 0; i < v.rank(); ++i) {
    int64_t d = v.shape()[i];
    s.push_back(lo[i] + hi[i] + d + (d > 0 ? (d - 1) * interior[i] : 0));
  }
  Value r = fresh(Type{v.dtype(), s});
  emitLine(ref(r) + " = \"stablehlo.pad\"(" + ref(v) + ", " + ref(pv) + ") {edge_padding_low = " + i64Array(lo) +
           ", edge_padding_high = " + i64Array(hi) + ", interior_padding = " + i64Array(interior) + "} : (" +
           v.type.str() + ", " + pv.type.str() + ") -> " + r.type.str());
  return r;
}

Value Builder::reverse(const Value& v, const std::vector<int64_t>& dims) {
  if (dims.empty()) return v;
  Value r = fresh(v.type);
  emitLine(ref(r) + " = \"stablehlo.reverse\"(" + ref(v) + ") {dimensions = " + i64Array(dims) + "} : (" +
           v.type.str() + ") -> " + r.type.str());
  return r;
}

// ---------------------------------------------------------------- elementwise

Value Builder::unary(const char* op, const Value& v) {
  Type t = v.type;
  if (std::strcmp(op, "is_finite") == 0) t.dtype = DType::Bool;
  if (std::strcmp(op, "abs") == 0 && isComplex(t.dtype)) t.dtype = complexPart(t.dtype);  // |z| is real
  Value r = fresh(t);
  emitLine(ref(r) + " = \"stablehlo." + op + "\"(" + ref(v) + ") : (" + v.type.str() + ") -> " + t.str());
  return r;
}

Value Builder::binary(const char* op, const Value& a, const Value& b) {
  if (a.type != b.type) fail(std::string("binary ") + op + " on " + a.type.str() + " and " + b.type.str());
  Value r = fresh(a.type);
  emitLine(ref(r) + " = \"stablehlo." + op + "\"(" + ref(a) + ", " + ref(b) + ") : (" + a.type.str() + ", " +
           b.type.str() + ") -> " + r.type.str());
  return r;
}

Value Builder::compare(const Value& a, const Value& b, Cmp dir) {
  if (a.type != b.type) fail("compare on " + a.type.str() + " and " + b.type.str());
  Value r = fresh(Type{DType::Bool, a.shape()});
  const char* ct =
      isFloat(a.dtype()) || isComplex(a.dtype()) ? "FLOAT" : (isUnsigned(a.dtype()) ? "UNSIGNED" : "SIGNED");
  emitLine(ref(r) + " = \"stablehlo.compare\"(" + ref(a) + ", " + ref(b) +
           ") {comparison_direction = #stablehlo<comparison_direction " + cmpName(dir) +
           ">, compare_type = #stablehlo<comparison_type " + ct + ">} : (" + a.type.str() + ", " + b.type.str() +
           ") -> " + r.type.str());
  return r;
}

Value Builder::select(const Value& pred, const Value& a, const Value& b) {
  if (a.type != b.type) fail("select on " + a.type.str() + " and " + b.type.str());
  Value r = fresh(a.type);
  emitLine(ref(r) + " = \"stablehlo.select\"(" + ref(pred) + ", " + ref(a) + ", " + ref(b) + ") : (" + pred.type.str() +
           ", " + a.type.str() + ", " + b.type.str() + ") -> " + r.type.str());
  return r;
}

Value Builder::clamp(const Value& lo, const Value& x, const Value& hi) {
  Value r = fresh(x.type);
  emitLine(ref(r) + " = \"stablehlo.clamp\"(" + ref(lo) + ", " + ref(x) + ", " + ref(hi) + ") : (" + lo.type.str() +
           ", " + x.type.str() + ", " + hi.type.str() + ") -> " + r.type.str());
  // A NaN stays NaN, as in PyTorch's clamps (relu6, hardtanh): XLA:CPU's clamp
  // returned a bound for it.
  if (isFloat(x.dtype())) r = select(compare(x, x, Cmp::NE), x, r);
  return r;
}

// ---------------------------------------------------------------- regions

std::string Builder::region(const std::vector<Type>& arg_types, const BodyFn& body) {
  blocks_.emplace_back();
  std::vector<Value> args;
  std::string header = "^bb0(";
  for (size_t i = 0; i < arg_types.size(); ++i) {
    Value a = fresh(arg_types[i]);
    args.push_back(a);
    header += (i ? ", " : "") + ref(a) + ": " + a.type.str();
  }
  header += "):";
  std::vector<Value> rets = body(*this, args);
  std::string text = "({\n      " + header + "\n";
  for (const auto& l : blocks_.back().lines) text += "        " + l + "\n";
  std::string retargs, rettys;
  for (size_t i = 0; i < rets.size(); ++i) {
    retargs += (i ? ", " : "") + ref(rets[i]);
    rettys += (i ? ", " : "") + rets[i].type.str();
  }
  text += "        \"stablehlo.return\"(" + retargs + ") : (" + rettys + ") -> ()\n    })";
  blocks_.pop_back();
  return text;
}

namespace {
std::string multiName(const std::string& base, size_t i) { return base + "#" + std::to_string(i); }
}  // namespace

std::vector<Value> Builder::reduce(const std::vector<Value>& inputs, const std::vector<Value>& inits,
                                   const std::vector<int64_t>& dims, const BodyFn& body, bool lane_body) {
  // Adjacent dims that are all reduced (or all kept) merge into one: XLA:CPU
  // reduces [16,64,256] over {0,1} 3.5x slower than the same data as
  // [1024,256] over {0}. The reshapes are free on row-major values.
  const Shape& in_shape = inputs[0].shape();
  const int rank = inputs[0].rank();
  std::vector<bool> reduced(rank, false);
  for (auto d : dims)
    if (d >= 0 && d < rank) reduced[d] = true;
  Shape merged;
  std::vector<int64_t> merged_dims;
  for (int i = 0; i < rank; ++i) {
    if (i > 0 && reduced[i] == reduced[i - 1]) {
      merged.back() *= in_shape[i];
    } else {
      if (reduced[i]) merged_dims.push_back(static_cast<int64_t>(merged.size()));
      merged.push_back(in_shape[i]);
    }
  }
  const bool distinct_dims = static_cast<int64_t>(dims.size()) == std::count(reduced.begin(), reduced.end(), true);
  const bool mergeable = static_cast<int>(merged.size()) < rank && distinct_dims;
  Shape out;
  for (int i = 0; i < rank; ++i)
    if (!reduced[i]) out.push_back(in_shape[i]);
  // XLA:CPU emits a reduction over the minor dim as one scalar add chain per
  // output (4 cycles an element). Split the minor extent into [groups, lanes]
  // and reduce the groups first: that reduction keeps a contiguous minor dim,
  // which LLVM vectorizes across the lanes; the barrier stops the simplifier
  // from merging the two reductions back. At most 32 groups, as XLA rewrites a
  // longer reduced dim into an unvectorized reduce-window. Sums of [256,512]
  // over the last dim: 66 -> 25 us for (x*x).sum(-1), var 80 -> 38 us.
  if (lane_body && xlaCpuTuning() && inputs.size() == 1 && rank > 0 && reduced[rank - 1] && distinct_dims) {
    const int64_t extent = merged.back();
    const int64_t groups = std::min<int64_t>(32, extent / 16);
    if (extent % 16 == 0 && groups >= 2 && extent % groups == 0 && (extent / groups) % 8 == 0) {
      Shape split = merged;
      split.back() = groups;
      split.push_back(extent / groups);
      Value part = reduceOp({reshape(inputs[0], split)}, inits, merged_dims, body)[0];
      Value r = reduceOp({barrier(part)}, inits, {part.rank() - 1}, body)[0];
      return {reshape(r, out)};
    }
  }
  // On XLA:CPU a reduction that keeps the minor dim (a column sum: bias
  // gradients) is fast on a row-major [rows, cols] operand, but the
  // simplifier folds a merging reshape back into a multi-dim reduce of the
  // producer. A barrier keeps the merged operand: 450 -> 140 us for a
  // [16,64,256] sum over {0,1} fed by an elementwise producer.
  const bool barrier_first = xlaCpuTuning() && rank > 1 && !reduced[rank - 1] && !dims.empty();
  if (mergeable || barrier_first) {
    std::vector<Value> operands;
    for (const auto& v : inputs) {
      Value m = mergeable ? reshape(v, merged) : v;
      operands.push_back(barrier_first ? barrier(m) : m);
    }
    std::vector<Value> res = reduceOp(operands, inits, mergeable ? merged_dims : dims, body);
    for (auto& r : res) r = reshape(r, out);
    return res;
  }
  return reduceOp(inputs, inits, dims, body);
}

std::vector<Value> Builder::reduceOp(const std::vector<Value>& inputs, const std::vector<Value>& inits,
                                     const std::vector<int64_t>& dims, const BodyFn& body) {
  std::vector<Type> argt;
  for (const auto& v : inits) argt.push_back(scalarType(v.dtype()));
  for (const auto& v : inits) argt.push_back(scalarType(v.dtype()));
  std::string reg = region(argt, body);
  Shape out;
  for (int i = 0; i < inputs[0].rank(); ++i) {
    bool red = false;
    for (auto d : dims) red |= d == i;
    if (!red) out.push_back(inputs[0].shape()[i]);
  }
  std::vector<Value> all = inputs;
  all.insert(all.end(), inits.begin(), inits.end());
  std::vector<Value> results;
  std::string args;
  for (size_t i = 0; i < all.size(); ++i) args += (i ? ", " : "") + ref(all[i]);
  std::string outtys;
  for (size_t i = 0; i < inputs.size(); ++i) {
    results.push_back(fresh(Type{inits[i].dtype(), out}));
    outtys += (i ? ", " : "") + results.back().type.str();
  }
  emitMulti(results, "\"stablehlo.reduce\"(" + args + ") " + reg + " {dimensions = " + i64Array(dims) + "} : (" +
                         types(all) + ") -> (" + outtys + ")");
  return results;
}

std::vector<Value> Builder::reduceWindow(const std::vector<Value>& inputs, const std::vector<Value>& inits,
                                         const Shape& window, const Shape& strides, const Shape& base_dil,
                                         const Shape& win_dil, const std::vector<std::pair<int64_t, int64_t>>& padding,
                                         const BodyFn& body) {
  std::vector<Type> argt;
  for (const auto& v : inits) argt.push_back(scalarType(v.dtype()));
  for (const auto& v : inits) argt.push_back(scalarType(v.dtype()));
  std::string reg = region(argt, body);
  Shape out;
  for (int i = 0; i < inputs[0].rank(); ++i) {
    int64_t d = inputs[0].shape()[i];
    int64_t dilated = d > 0 ? (d - 1) * base_dil[i] + 1 : 0;
    int64_t padded = dilated + padding[i].first + padding[i].second;
    int64_t wext = (window[i] - 1) * win_dil[i] + 1;
    out.push_back(padded >= wext ? (padded - wext) / strides[i] + 1 : 0);
  }
  std::vector<Value> all = inputs;
  all.insert(all.end(), inits.begin(), inits.end());
  std::string args;
  for (size_t i = 0; i < all.size(); ++i) args += (i ? ", " : "") + ref(all[i]);
  std::vector<Value> results;
  std::string outtys;
  for (size_t i = 0; i < inputs.size(); ++i) {
    results.push_back(fresh(Type{inits[i].dtype(), out}));
    outtys += (i ? ", " : "") + results.back().type.str();
  }
  emitMulti(results, "\"stablehlo.reduce_window\"(" + args + ") " + reg + " {window_dimensions = " + i64Array(window) +
                         ", window_strides = " + i64Array(strides) + ", base_dilations = " + i64Array(base_dil) +
                         ", window_dilations = " + i64Array(win_dil) + ", padding = " + padAttr(padding) + "} : (" +
                         types(all) + ") -> (" + outtys + ")");
  return results;
}

namespace {
// The precision that keeps a product of `t` values as exact as on PyTorch's CPU:
// HIGHEST for float32 and wider; none (the plugin's default) for 16-bit floats and integers.
const char* fullPrecision(DType t) { return t == DType::F32 || t == DType::F64 || isComplex(t) ? "HIGHEST" : nullptr; }
}  // namespace

Value Builder::dotGeneral(const Value& lhs, const Value& rhs, const std::vector<int64_t>& lb,
                          const std::vector<int64_t>& rb, const std::vector<int64_t>& lc,
                          const std::vector<int64_t>& rc, DType out, const char* precision) {
  Shape s;
  for (auto d : lb) s.push_back(lhs.shape()[d]);
  auto contains = [](const std::vector<int64_t>& v, int64_t x) {
    for (auto y : v)
      if (y == x) return true;
    return false;
  };
  for (int i = 0; i < lhs.rank(); ++i)
    if (!contains(lb, i) && !contains(lc, i)) s.push_back(lhs.shape()[i]);
  for (int i = 0; i < rhs.rank(); ++i)
    if (!contains(rb, i) && !contains(rc, i)) s.push_back(rhs.shape()[i]);
  Value r = fresh(Type{out, s});
  std::string dn = "#stablehlo.dot<";
  std::vector<std::string> parts;
  if (!lb.empty()) parts.push_back("lhs_batching_dimensions = " + list(lb));
  if (!rb.empty()) parts.push_back("rhs_batching_dimensions = " + list(rb));
  if (!lc.empty()) parts.push_back("lhs_contracting_dimensions = " + list(lc));
  if (!rc.empty()) parts.push_back("rhs_contracting_dimensions = " + list(rc));
  for (size_t i = 0; i < parts.size(); ++i) dn += (i ? ", " : "") + parts[i];
  dn += ">";
  // PyTorch multiplies float32 in float32 unless told otherwise
  // (torch.get_float32_matmul_precision() is "highest"); XLA's default lets a GPU
  // use TF32 and a TPU bf16 passes, which differ from PyTorch by up to 1e-2.
  if (!precision) precision = fullPrecision(lhs.dtype());
  if (precision)
    dn += std::string(", precision_config = [#stablehlo<precision ") + precision + ">, #stablehlo<precision " +
          precision + ">]";
  emitLine(ref(r) + " = \"stablehlo.dot_general\"(" + ref(lhs) + ", " + ref(rhs) + ") {dot_dimension_numbers = " + dn +
           "} : (" + lhs.type.str() + ", " + rhs.type.str() + ") -> " + r.type.str());
  return r;
}

Value Builder::convolution(const Value& lhs, const Value& rhs, const ConvDims& dn, const Shape& strides,
                           const std::vector<std::pair<int64_t, int64_t>>& padding, const Shape& lhs_dil,
                           const Shape& rhs_dil, int64_t fgc, int64_t bgc, DType out) {
  size_t ns = dn.in_spatial.size();
  auto layout = [&](size_t rank, int64_t a, const char* an, int64_t b, const char* bn, const std::vector<int64_t>& sp) {
    std::vector<std::string> lab(rank);
    lab[a] = an;
    lab[b] = bn;
    for (size_t i = 0; i < sp.size(); ++i) lab[sp[i]] = std::to_string(i);
    std::string s = "[";
    for (size_t i = 0; i < rank; ++i) s += (i ? ", " : "") + lab[i];
    return s + "]";
  };
  Shape os(ns + 2);
  os[dn.out_batch] = lhs.shape()[dn.in_batch] / bgc;
  os[dn.out_feature] = rhs.shape()[dn.k_out];
  for (size_t i = 0; i < ns; ++i) {
    int64_t in = lhs.shape()[dn.in_spatial[i]];
    int64_t k = rhs.shape()[dn.k_spatial[i]];
    int64_t din = in > 0 ? (in - 1) * lhs_dil[i] + 1 : 0;
    int64_t padded = din + padding[i].first + padding[i].second;
    int64_t dk = (k - 1) * rhs_dil[i] + 1;
    os[dn.out_spatial[i]] = padded >= dk ? (padded - dk) / strides[i] + 1 : 0;
  }
  Value r = fresh(Type{out, os});
  std::string dims = "#stablehlo.conv<" + layout(ns + 2, dn.in_batch, "b", dn.in_feature, "f", dn.in_spatial) + "x" +
                     layout(ns + 2, dn.k_out, "o", dn.k_in, "i", dn.k_spatial) + "->" +
                     layout(ns + 2, dn.out_batch, "b", dn.out_feature, "f", dn.out_spatial) + ">";
  std::string prec;
  if (const char* p = fullPrecision(lhs.dtype()))  // as for dot_general
    prec = std::string(", precision_config = [#stablehlo<precision ") + p + ">, #stablehlo<precision " + p + ">]";
  emitLine(ref(r) + " = \"stablehlo.convolution\"(" + ref(lhs) + ", " + ref(rhs) + ") {dimension_numbers = " + dims +
           prec + ", window_strides = " + i64Array(strides) + ", padding = " + padAttr(padding) +
           ", lhs_dilation = " + i64Array(lhs_dil) + ", rhs_dilation = " + i64Array(rhs_dil) +
           ", feature_group_count = " + std::to_string(fgc) + " : i64, batch_group_count = " + std::to_string(bgc) +
           " : i64} : (" + lhs.type.str() + ", " + rhs.type.str() + ") -> " + r.type.str());
  return r;
}

Value Builder::gather(const Value& operand, const Value& indices, const GatherDims& dn, const Shape& slice_sizes) {
  // Result shape: batch dims of indices (all but index_vector_dim) with the
  // offset dims (slice dims not collapsed or batching) inserted at offset_dims.
  auto contains = [](const std::vector<int64_t>& v, int64_t x) {
    for (auto y : v)
      if (y == x) return true;
    return false;
  };
  Shape batch;
  for (int i = 0; i < indices.rank(); ++i)
    if (i != dn.index_vector_dim) batch.push_back(indices.shape()[i]);
  Shape offs;
  for (size_t i = 0; i < slice_sizes.size(); ++i)
    if (!contains(dn.collapsed_slice_dims, i) && !contains(dn.operand_batching_dims, i)) offs.push_back(slice_sizes[i]);
  size_t rank = batch.size() + offs.size();
  Shape s;
  size_t bi = 0, oi = 0;
  for (size_t i = 0; i < rank; ++i) s.push_back(contains(dn.offset_dims, i) ? offs[oi++] : batch[bi++]);
  Value r = fresh(Type{operand.dtype(), s});
  std::string d = "#stablehlo.gather<offset_dims = " + list(dn.offset_dims) +
                  ", collapsed_slice_dims = " + list(dn.collapsed_slice_dims);
  if (!dn.operand_batching_dims.empty())
    d += ", operand_batching_dims = " + list(dn.operand_batching_dims) +
         ", start_indices_batching_dims = " + list(dn.start_indices_batching_dims);
  d += ", start_index_map = " + list(dn.start_index_map) +
       ", index_vector_dim = " + std::to_string(dn.index_vector_dim) + ">";
  emitLine(ref(r) + " = \"stablehlo.gather\"(" + ref(operand) + ", " + ref(indices) + ") {dimension_numbers = " + d +
           ", slice_sizes = " + i64Array(slice_sizes) + ", indices_are_sorted = false} : (" + operand.type.str() +
           ", " + indices.type.str() + ") -> " + r.type.str());
  return r;
}

Value Builder::scatter(const Value& operand, const Value& indices, const Value& updates, const ScatterDims& dn,
                       const BodyFn& body) {
  std::string reg = region({scalarType(operand.dtype()), scalarType(operand.dtype())}, body);
  Value r = fresh(operand.type);
  std::string d = "#stablehlo.scatter<update_window_dims = " + list(dn.update_window_dims) +
                  ", inserted_window_dims = " + list(dn.inserted_window_dims);
  if (!dn.input_batching_dims.empty())
    d += ", input_batching_dims = " + list(dn.input_batching_dims) +
         ", scatter_indices_batching_dims = " + list(dn.scatter_indices_batching_dims);
  d += ", scatter_dims_to_operand_dims = " + list(dn.scatter_dims_to_operand_dims) +
       ", index_vector_dim = " + std::to_string(dn.index_vector_dim) + ">";
  emitLine(ref(r) + " = \"stablehlo.scatter\"(" + ref(operand) + ", " + ref(indices) + ", " + ref(updates) + ") " +
           reg + " {scatter_dimension_numbers = " + d + ", indices_are_sorted = false, unique_indices = false} : (" +
           operand.type.str() + ", " + indices.type.str() + ", " + updates.type.str() + ") -> " + r.type.str());
  return r;
}

std::vector<Value> Builder::sort(const std::vector<Value>& inputs, int64_t dim, bool stable, const BodyFn& cmp) {
  std::vector<Type> argt;
  for (const auto& v : inputs) {
    argt.push_back(scalarType(v.dtype()));
    argt.push_back(scalarType(v.dtype()));
  }
  std::string reg = region(argt, cmp);
  std::vector<Value> results;
  std::string args;
  for (size_t i = 0; i < inputs.size(); ++i) {
    results.push_back(fresh(inputs[i].type));
    args += (i ? ", " : "") + ref(inputs[i]);
  }
  emitMulti(results, "\"stablehlo.sort\"(" + args + ") " + reg + " {dimension = " + std::to_string(dim) +
                         " : i64, is_stable = " + (stable ? "true" : "false") + "} : (" + types(inputs) + ") -> (" +
                         types(results) + ")");
  return results;
}

std::vector<Value> Builder::rngBitGenerator(const Value& state, const Type& out) {
  std::vector<Value> results{fresh(state.type), fresh(out)};
  emitMulti(results, "\"stablehlo.rng_bit_generator\"(" + ref(state) +
                         ") {rng_algorithm = #stablehlo<rng_algorithm THREE_FRY>} : (" + state.type.str() + ") -> (" +
                         types(results) + ")");
  return results;
}

std::vector<Value> Builder::customCall(const std::string& target, const std::vector<Value>& args,
                                       const std::vector<Type>& results) {
  std::string operands, rtypes;
  for (size_t i = 0; i < args.size(); ++i) operands += (i ? ", " : "") + ref(args[i]);
  std::vector<Value> out;
  for (size_t i = 0; i < results.size(); ++i) {
    out.push_back(fresh(results[i]));
    rtypes += (i ? ", " : "") + results[i].str();
  }
  std::string rhs = "\"stablehlo.custom_call\"(" + operands + ") {api_version = 4 : i32, call_target_name = \"" +
                    target + "\"} : (" + types(args) + ") -> (" + rtypes + ")";
  if (out.size() == 1)
    emitLine(ref(out[0]) + " = " + rhs);
  else
    emitMulti(out, rhs);
  return out;
}

void Builder::emitMulti(const std::vector<Value>& results, const std::string& rhs) {
  std::string group = "%g" + std::to_string(next_id_++);
  emitLine(group + ":" + std::to_string(results.size()) + " = " + rhs);
  for (size_t i = 0; i < results.size(); ++i) names_[results[i].id] = multiName(group, i);
}

// ---------------------------------------------------------------- control flow and linear algebra
std::vector<Value> Builder::whileLoop(const std::vector<Value>& init, const BodyFn& cond, const BodyFn& body) {
  std::vector<Type> argt;
  for (const auto& v : init) argt.push_back(v.type);
  std::string creg = region(argt, cond);
  std::string breg = region(argt, [&](Builder& bb, const std::vector<Value>& st) {
    std::vector<Value> next = body(bb, st);
    if (next.size() != st.size())
      fail("while body returns " + std::to_string(next.size()) + " values for a state of " + std::to_string(st.size()));
    for (size_t i = 0; i < next.size(); ++i)
      if (next[i].type != st[i].type)
        fail("while body changes state " + std::to_string(i) + " from " + st[i].type.str() + " to " +
             next[i].type.str());
    return next;
  });
  // region() wraps one region in "( ... )"; while takes two.
  std::string regs = creg.substr(0, creg.size() - 1) + ", " + breg.substr(1);
  std::vector<Value> results;
  std::string args;
  for (size_t i = 0; i < init.size(); ++i) {
    results.push_back(fresh(init[i].type));
    args += (i ? ", " : "") + ref(init[i]);
  }
  emitMulti(results,
            "\"stablehlo.while\"(" + args + ") " + regs + " : (" + types(init) + ") -> (" + types(results) + ")");
  return results;
}

Value Builder::cholesky(const Value& a, bool lower) {
  Value r = fresh(a.type);
  emitLine(ref(r) + " = \"stablehlo.cholesky\"(" + ref(a) + ") {lower = " + (lower ? "true" : "false") + "} : (" +
           a.type.str() + ") -> " + r.type.str());
  return r;
}

Value Builder::triangularSolve(const Value& a, const Value& rhs, bool left_side, bool lower, bool unit_diagonal,
                               bool transpose_a) {
  Value r = fresh(rhs.type);
  emitLine(ref(r) + " = \"stablehlo.triangular_solve\"(" + ref(a) + ", " + ref(rhs) +
           ") {left_side = " + (left_side ? "true" : "false") + ", lower = " + (lower ? "true" : "false") +
           ", transpose_a = #stablehlo<transpose " + (transpose_a ? "TRANSPOSE" : "NO_TRANSPOSE") +
           ">, unit_diagonal = " + (unit_diagonal ? "true" : "false") + "} : (" + a.type.str() + ", " + rhs.type.str() +
           ") -> " + r.type.str());
  return r;
}

Value Builder::fft(const Value& v, const char* kind, const Shape& lengths) {
  Type t = v.type;
  std::string k(kind);
  if (k == "RFFT") {
    t.dtype = complexOf(v.dtype());
    t.shape.back() = lengths.back() / 2 + 1;
  } else if (k == "IRFFT") {
    t.dtype = complexPart(v.dtype());
    t.shape.back() = lengths.back();
  }
  Value r = fresh(t);
  emitLine(ref(r) + " = \"stablehlo.fft\"(" + ref(v) + ") {fft_length = array<i64" +
           (lengths.empty() ? std::string() : ": ") +
           [&] {
             std::string s;
             for (size_t i = 0; i < lengths.size(); ++i) s += (i ? ", " : "") + std::to_string(lengths[i]);
             return s;
           }() +
           ">, fft_type = #stablehlo<fft_type " + k + ">} : (" + v.type.str() + ") -> " + t.str());
  return r;
}

Value Builder::real(const Value& v) {
  if (!isComplex(v.dtype())) return v;
  Value r = fresh(Type{complexPart(v.dtype()), v.shape()});
  emitLine(ref(r) + " = \"stablehlo.real\"(" + ref(v) + ") : (" + v.type.str() + ") -> " + r.type.str());
  return r;
}

Value Builder::imag(const Value& v) {
  if (!isComplex(v.dtype())) return zeros(v.type);
  Value r = fresh(Type{complexPart(v.dtype()), v.shape()});
  emitLine(ref(r) + " = \"stablehlo.imag\"(" + ref(v) + ") : (" + v.type.str() + ") -> " + r.type.str());
  return r;
}

Value Builder::complex(const Value& re, const Value& im) {
  if (re.type != im.type || (re.dtype() != DType::F32 && re.dtype() != DType::F64))
    fail("complex of " + re.type.str() + " and " + im.type.str());
  Value r = fresh(Type{complexOf(re.dtype()), re.shape()});
  emitLine(ref(r) + " = \"stablehlo.complex\"(" + ref(re) + ", " + ref(im) + ") : (" + re.type.str() + ", " +
           im.type.str() + ") -> " + r.type.str());
  return r;
}

}  // namespace tpu::ir
