// Planning an op, shared by every mode: its meta run (PyTorch's expected
// results and errors), its signature (the cache key), and the helpers that
// move arguments in and results out.
#include "op_steps/op_plan.h"

#include <torch/csrc/utils/pybind.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace tpu::aten {

namespace {
std::string exactDouble(double d) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", d);
  return buf;
}

// Formatted here, not with c10's operator<<: on the H200 machine (torch 2.11+cu130,
// Ubuntu's libstdc++) printing an int IValue through an ostringstream crashed inside
// the stream's number formatting; the common kinds need no stream at all.
std::string valueText(const IValue& v) {
  if (v.isInt()) return std::to_string(v.toInt());
  if (v.isDouble()) return exactDouble(v.toDouble());
  if (v.isBool()) return v.toBool() ? "True" : "False";
  if (v.isNone()) return "None";
  if (v.isString()) return v.toStringRef();
  if (v.isComplexDouble()) {
    auto c = v.toComplexDouble();
    return "(" + exactDouble(c.real()) + "," + exactDouble(c.imag()) + ")";
  }
  if (v.isDevice()) return v.toDevice().str();
  if (v.isIntList() || v.isDoubleList() || v.isBoolList()) {
    std::string s = "[";
    bool first = true;
    for (const IValue& e : v.toList()) {
      s += (first ? "" : ", ") + valueText(e);
      first = false;
    }
    return s + "]";
  }
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}
}  // namespace

std::string PlannedOp::name() const {
  const auto& s = op.schema();
  return s.name() + (s.overload_name().empty() ? "" : "." + s.overload_name());
}

bool isOutArg(const c10::Argument& a) { return a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite(); }

c10::TypePtr baseType(const c10::TypePtr& t) {
  if (auto o = t->cast<c10::OptionalType>()) return o->getElementType();
  return t;
}

bool isScalarType(const c10::TypePtr& t) { return baseType(t)->kind() == c10::TypeKind::NumberType; }

std::string describe(const c10::OperatorHandle& op, const std::vector<IValue>& args) {
  std::string s = op.schema().name();
  if (!op.schema().overload_name().empty()) s += "." + op.schema().overload_name();
  s += "(";
  for (size_t i = 0; i < args.size(); ++i) {
    if (i) s += ", ";
    const IValue& v = args[i];
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      s += t.defined() ? std::string(c10::toString(t.scalar_type())) + ir::shapeStr(t.sizes().vec()) : "None";
    } else if (v.isTensorList() || (v.isList() && v.toList().elementType()->kind() == c10::TypeKind::OptionalType)) {
      s += "[" + std::to_string(v.toList().size()) + " tensors]";
    } else {
      s += valueText(v);
    }
  }
  return s + ")";
}

namespace {

// --------------------------------------------------------------- meta run

at::Tensor toMeta(const at::Tensor& t) {
  if (!t.defined()) return t;
  // Wrapped Python numbers stay on the CPU: meta kernels accept them beside
  // meta tensors and Python meta kernels turn them back into numbers. Other
  // 0-d CPU tensors become meta: PyTorch accepts them beside tpu tensors
  // (masked_fill's value), but not beside meta ones.
  if (t.device().is_cpu() && t.dim() == 0 && t.unsafeGetTensorImpl()->is_wrapped_number()) return t;
  at::Tensor m = at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
  return m;
}

IValue metaOf(const IValue& v) {
  if (v.isTensor()) return IValue(toMeta(v.toTensor()));
  if (v.isTensorList()) {
    c10::List<at::Tensor> l;
    for (const at::Tensor& t : v.toTensorList()) l.push_back(toMeta(t));
    return IValue(l);
  }
  if (v.isList()) {
    auto lst = v.toList();
    if (lst.elementType()->kind() == c10::TypeKind::OptionalType) {
      c10::List<std::optional<at::Tensor>> l;
      for (const IValue& e : lst)
        l.push_back(e.isNone() ? std::nullopt : std::optional<at::Tensor>(toMeta(e.toTensor())));
      return IValue(l);
    }
    return v;
  }
  if (v.isDevice()) return IValue(c10::Device(at::kMeta));
  // A generator shapes nothing, and PyTorch's meta kernels of exponential_,
  // cauchy_, log_normal_ and geometric_ (refs) refuse any generator.
  if (v.isGenerator()) return IValue();
  return v;
}

// The dims of a dense, non-overlapping, permuted layout, outermost first;
// empty when contiguous or not such a layout.
std::vector<int64_t> densePermutation(const at::Tensor& t) {
  if (t.is_contiguous() || !t.is_non_overlapping_and_dense() || t.dim() < 2) return {};
  std::vector<int64_t> perm(t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) perm[i] = i;
  auto st = t.strides();
  auto sz = t.sizes();
  std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
    if (st[a] != st[b]) return st[a] > st[b];
    return sz[a] > sz[b];
  });
  return perm;
}

thread_local std::vector<std::vector<int64_t>>* t_perms = nullptr;

void collectTypes(const IValue& v, std::vector<ir::Type>& out) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (t_perms) t_perms->push_back(t.defined() ? densePermutation(t) : std::vector<int64_t>{});
    // An undefined result (a masked-out gradient) keeps its slot.
    out.push_back(t.defined() ? ir::Type{toIr(t.scalar_type()), t.sizes().vec()} : ir::Type{ir::DType::F32, {-1}});
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) out.push_back(ir::Type{toIr(t.scalar_type()), t.sizes().vec()});
  }
}

// What the CPU says of an input a meta kernel refused.
enum class CpuVerdict { Accepts, NoKernel, TooLarge };

// Bad input found by a meta kernel: run the op on CPU tensors of the same
// shapes, so the user sees exactly the CPU's exception type and message (the
// call throws it). When the CPU accepts the input, `results` holds what it
// returned, or for an op without returns the arguments it writes.
CpuVerdict mirrorOnCpu(const c10::OperatorHandle& op, const std::vector<IValue>& args, torch::jit::Stack& results) {
  int64_t total = 0;
  auto toCpu = [&total](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || t.device().is_cpu()) return t;
    total += t.numel();
    return at::zeros(t.sizes(), t.options().device(at::kCPU));
  };
  torch::jit::Stack cs;
  for (const auto& v : args) {
    if (v.isTensor()) {
      cs.push_back(toCpu(v.toTensor()));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> l;
      for (const at::Tensor& t : v.toTensorList()) l.push_back(toCpu(t));
      cs.push_back(l);
    } else if (v.isList() && v.toList().elementType()->kind() == c10::TypeKind::OptionalType) {
      c10::List<std::optional<at::Tensor>> l;
      for (const IValue& e : v.toList())
        l.push_back(e.isNone() ? std::nullopt : std::optional<at::Tensor>(toCpu(e.toTensor())));
      cs.push_back(l);
    } else if (v.isDevice()) {
      cs.push_back(c10::Device(at::kCPU));
    } else if (v.isGenerator()) {
      cs.push_back(IValue());  // the CPU kernel takes only a CPU generator; the draws are not compared
    } else {
      cs.push_back(v);
    }
  }
  if (total > (int64_t(1) << 24)) return CpuVerdict::TooLarge;
  const std::vector<IValue> written = cs;  // the same tensors: what an op without returns wrote
  try {
    op.callBoxed(&cs);  // throws the CPU's own error
  } catch (const c10::NotImplementedError&) {
    // No CPU kernel (ops PyTorch runs only off the CPU, such as the fused
    // RNN cells): nothing to compare the meta kernel's complaint with.
    return CpuVerdict::NoKernel;
  }
  const auto& schema = op.schema();
  if (!schema.returns().empty()) {
    results = std::move(cs);
    return CpuVerdict::Accepts;
  }
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& a = schema.arguments()[i];
    if (a.alias_info() && a.alias_info()->isWrite()) results.push_back(written[i]);
  }
  return CpuVerdict::Accepts;
}

bool anyBarebonesUnsigned(const std::vector<IValue>& args) {
  auto is = [](const at::Tensor& t) {
    return t.defined() &&
           (t.scalar_type() == at::kUInt16 || t.scalar_type() == at::kUInt32 || t.scalar_type() == at::kUInt64);
  };
  for (const auto& v : args) {
    if (v.isTensor() && is(v.toTensor())) return true;
    if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList())
        if (is(t)) return true;
  }
  return false;
}

// Called while a meta kernel's error is handled: whether the CPU accepts the
// input (its results in `results`); false where the CPU has no kernel either.
// Throws the CPU's own error, or rethrows the meta kernel's where the input is
// too large to mirror.
bool cpuAccepts(const c10::OperatorHandle& op, const std::vector<IValue>& args, torch::jit::Stack& results) {
  switch (mirrorOnCpu(op, args, results)) {
    case CpuVerdict::NoKernel:
      return false;
    case CpuVerdict::TooLarge:
      throw;
    case CpuVerdict::Accepts:
      break;
  }
  return true;
}

// Runs the op on meta tensors: PyTorch's own shape/dtype checks raise the
// same errors as on the CPU, and the results give the expected types.
// Returns false when the op has no meta kernel.
bool metaRun(const c10::OperatorHandle& op, const std::vector<IValue>& args, std::vector<ir::Type>& expected,
             std::vector<std::vector<int64_t>>* perms) {
  // PyTorch's Python meta kernels import torch._dynamo at their first call. A
  // thread doing that while another imports torch._inductor (torch.compile does)
  // meets it halfway through a circular import ("partially initialized module",
  // or a _DeadlockError in either thread). Importing torch._inductor first, as
  // torch.compile does, makes the second thread wait for the first's import.
  static std::once_flag imported;
  std::call_once(imported, [] {
    if (!Py_IsInitialized()) return;
    pybind11::gil_scoped_acquire gil;
    try {
      pybind11::module_::import("torch._inductor");
    } catch (const pybind11::error_already_set&) {
      // Without inductor the kernels import what they need themselves.
    }
  });
  const auto& schema = op.schema();
  torch::jit::Stack ms;
  ms.reserve(args.size());
  for (const auto& a : args) ms.push_back(metaOf(a));
  std::vector<IValue> meta_args = ms;  // keep the mutated args for void ops
  // A meta kernel that refuses what the CPU kernel accepts (upsample_nearest's
  // check of an empty batch is a TypeError in PyTorch's own meta kernel): the
  // CPU's results give the types.
  torch::jit::Stack cpu_results;
  bool from_cpu = false;
  try {
    op.callBoxed(&ms);
  } catch (const c10::NotImplementedError&) {
    return false;
  } catch (const c10::Error& e) {
    std::string m = e.what();
    // No meta kernel (or a data-dependent one): not the user's error.
    if (m.find("meta") != std::string::npos &&
        (m.find("not implemented") != std::string::npos || m.find("NotImplemented") != std::string::npos ||
         m.find("could not run") != std::string::npos || m.find("Could not run") != std::string::npos))
      return false;
    if (!cpuAccepts(op, args, cpu_results)) return false;
    from_cpu = true;
  } catch (const std::exception& e) {
    // A Python meta kernel's NotImplementedError arrives as a Python error.
    std::string m = e.what();
    if (m.find("NotImplemented") != std::string::npos || m.find("not implemented") != std::string::npos ||
        m.find("unimplemented") != std::string::npos)
      return false;
    // A meta kernel that fails where no CPU kernel could confirm the input
    // is bad (the fused LSTM cell's meta reads `.device` of its optional
    // biases) is treated as missing: the lowering's own checks apply.
    if (!cpuAccepts(op, args, cpu_results)) return false;
    from_cpu = true;
  }
  // PyTorch's Python meta kernels promote uint16/32/64 with other integer
  // types where its kernels refuse (c10::promoteTypes): tensors of those
  // dtypes, rare enough, are checked against the CPU once per signature.
  if (!from_cpu && anyBarebonesUnsigned(args)) {
    torch::jit::Stack ignored;
    mirrorOnCpu(op, args, ignored);  // throws the CPU's error
  }
  if (from_cpu) {
    t_perms = perms;
    for (const auto& r : cpu_results) collectTypes(r, expected);
    t_perms = nullptr;
  } else if (!schema.returns().empty()) {
    t_perms = perms;
    for (const auto& r : ms) collectTypes(r, expected);
    t_perms = nullptr;
  } else {
    for (size_t i = 0; i < schema.arguments().size(); ++i) {
      const auto& a = schema.arguments()[i];
      if (a.alias_info() && a.alias_info()->isWrite()) collectTypes(meta_args[i], expected);
    }
  }
  return true;
}

}  // namespace

Plan planFor(const PlannedOp& p) {
  Plan plan;
  plan.have_expected = !p.low->data_dependent && metaRun(p.op, p.args, plan.expected, &plan.perms);
  return plan;
}

// --------------------------------------------------------------- signature

namespace {
void keyTensor(std::string& k, const at::Tensor& t) {
  if (!t.defined()) {
    k += "N";
    return;
  }
  k += t.device().is_cpu() ? (t.unsafeGetTensorImpl()->is_wrapped_number() ? 'w' : 'c') : 't';
  ir::appendInt(k, static_cast<int>(t.scalar_type()));
  for (auto s : t.sizes()) {
    k += ',';
    ir::appendInt(k, s);
  }
  if (!t.is_contiguous()) {
    // The layout decides the strides of elementwise results: key the order
    // of the strides (and broadcast dims), not their values.
    auto st = t.strides();
    std::vector<int64_t> order(t.dim());
    for (int64_t i = 0; i < t.dim(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return st[a] > st[b]; });
    k += 'p';
    for (auto o : order) {
      ir::appendInt(k, o);
      if (st[o] == 0) k += 'z';
    }
  }
  k += ';';
}
}  // namespace

std::string signature(const c10::OperatorHandle& op, const std::vector<IValue>& args, const ops::Lowering* low) {
  std::string k;
  k.reserve(160);  // most keys fit: one allocation per op
  k += op.schema().name();
  k += '.';
  k += op.schema().overload_name();
  k += '|';
  const auto& sargs = op.schema().arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const IValue& v = args[i];
    if (v.isTensor()) {
      keyTensor(k, v.toTensor());
    } else if (v.isTensorList()) {
      k += "L";
      for (const at::Tensor& t : v.toTensorList()) keyTensor(k, t);
    } else if (v.isList() && v.toList().elementType()->kind() == c10::TypeKind::OptionalType) {
      k += "O";
      for (const IValue& e : v.toList()) {
        if (e.isNone())
          k += "N;";
        else
          keyTensor(k, e.toTensor());
      }
    } else if (isScalarType(sargs[i].type()) && !v.isNone() && !v.isList()) {
      bool is_const = std::find(low->const_scalars.begin(), low->const_scalars.end(), static_cast<int>(i)) !=
                      low->const_scalars.end();
      k += v.isDouble() ? "sd" : (v.isBool() ? "sb" : (v.isComplexDouble() ? "sc" : "si"));
      if (is_const || v.isComplexDouble()) k += valueText(v);  // complex scalars are program constants
      k += ';';
    } else if (v.isList() && baseType(sargs[i].type())->cast<c10::ListType>() &&
               baseType(sargs[i].type())->castRaw<c10::ListType>()->getElementType()->kind() ==
                   c10::TypeKind::NumberType) {
      k += "S" + std::to_string(v.toList().size()) + ";";
    } else if (v.isGenerator()) {
      k += "g;";
    } else if (v.isDevice()) {
      k += "d;";
    } else {
      k += valueText(v);
      k += ';';
    }
  }
  // Process state that changes what an op returns without being one of its
  // arguments: the default dtype (the result type of an integer division or
  // of a factory without a dtype). A program cached under one default must not
  // serve another.
  k += 'G';
  k += static_cast<char>('a' + static_cast<int>(c10::typeMetaToScalarType(c10::get_default_dtype())));
  k += ';';
  return k;
}

// Arguments in schema order; a bounded history per op.
std::string explainSignature(const std::string& op, const std::string& key) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::vector<std::string>> seen;
  auto split = [](const std::string& k) {
    std::vector<std::string> parts;
    size_t start = k.find('|') + 1, pos;
    while ((pos = k.find(';', start)) != std::string::npos) {
      parts.push_back(k.substr(start, pos - start));
      start = pos + 1;
    }
    return parts;
  };
  std::lock_guard<std::mutex> g(mu);
  auto& prev = seen[op];
  std::string why = "first call with this signature";
  auto now = split(key);
  size_t best = 0;
  bool found = false;
  std::vector<std::string> closest;
  for (const auto& k : prev) {
    auto parts = split(k);
    size_t same = 0;
    for (size_t i = 0; i < std::min(parts.size(), now.size()); ++i) same += parts[i] == now[i];
    if (!found || same > best) {
      best = same;
      closest = std::move(parts);
      found = true;
    }
  }
  if (found) {
    why = "differs from an earlier signature in";
    for (size_t i = 0; i < std::min(closest.size(), now.size()); ++i)
      if (closest[i] != now[i]) why += " [" + closest[i] + " -> " + now[i] + "]";
    why += " (t=tensor dtype-code,shape; s=scalar kind)";
  }
  prev.push_back(key);
  if (prev.size() > 64) prev.erase(prev.begin());
  return why;
}

// --------------------------------------------------------------- arguments and results

// A Python complex number arrives as a 0-d complex128 CPU tensor (wrapped,
// or conj() of one in autograd): the program takes it as complex128 where
// the plugin computes that (a complex128 op keeps its precision; a
// complex64 op converts it), else as complex64 (a TPU).
bool isComplexNumber(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kComplexDouble && t.dim() == 0;
}
ir::DType complexNumberIr() {
  static const ir::DType t = runtime::Runtime::get().computes(ir::DType::C128) ? ir::DType::C128 : ir::DType::C64;
  return t;
}
ir::DType cpuScalarIr(const at::Tensor& t) { return isComplexNumber(t) ? complexNumberIr() : toIr(t.scalar_type()); }

at::Generator generatorFor(const std::vector<IValue>& args, c10::DeviceIndex d) {
  for (const auto& v : args)
    if (v.isGenerator()) {
      at::Generator g = v.toGenerator();
      TORCH_CHECK(g.device().type() == kTpu, "Expected a 'tpu' device type for generator but found '",
                  g.device().type(), "'");
      return g;
    }
  return defaultGenerator(d);
}

std::array<uint64_t, 2> nextRngState(at::Generator& gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get<TpuGenerator>()->next();
}

runtime::BufferPtr cpuScalarBuffer(const at::Tensor& t, ir::DType dt, int device) {
  if (ir::isComplex(dt)) {
    at::Tensor z =
        t.resolve_conj().resolve_neg().to(dt == ir::DType::C128 ? at::kComplexDouble : at::kComplexFloat).contiguous();
    return runtime::Runtime::get().upload(z.data_ptr(), dt, {}, device);
  }
  if (ir::isFloat(dt)) return runtime::scalarBuffer(dt, t.item<double>(), device);
  return runtime::scalarBufferInt(dt, t.item<int64_t>(), device);
}

void pushReturns(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::vector<IValue>& args,
                 std::vector<IValue>& returns, std::vector<c10::List<at::Tensor>>& lists) {
  const auto& schema = op.schema();
  for (size_t r = 0; r < returns.size(); ++r) {
    const auto& ret = schema.returns()[r];
    if (ret.alias_info() && ret.alias_info()->isWrite()) {
      for (size_t i = 0; i < schema.arguments().size(); ++i)
        if (schema.arguments()[i].alias_info() &&
            schema.arguments()[i].alias_info()->beforeSets() == ret.alias_info()->beforeSets())
          returns[r] = args[i];
    } else if (ret.type()->kind() == c10::TypeKind::ListType) {
      returns[r] = IValue(lists[r]);
    }
  }
  torch::jit::drop(*stack, schema.arguments().size());
  for (auto& r : returns) stack->push_back(std::move(r));
}

std::vector<int64_t> permutedStrides(const OutputBinding& ob) {
  std::vector<int64_t> strides(ob.sizes.size());
  int64_t s = 1;
  for (auto it = ob.perm.rbegin(); it != ob.perm.rend(); ++it) {
    strides[*it] = s;
    s *= ob.sizes[*it];
  }
  return strides;
}

at::Tensor listElem(const std::vector<IValue>& args, int idx, int elem) {
  return elem < 0 ? args[idx].toTensor() : args[idx].toList().get(elem).toTensor();
}

std::vector<int64_t> memorySizes(const OutputBinding& ob) {
  if (ob.perm.empty()) return ob.sizes;
  std::vector<int64_t> sizes;
  for (int64_t d : ob.perm) sizes.push_back(ob.sizes[d]);
  return sizes;
}

}  // namespace tpu::aten
