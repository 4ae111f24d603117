// The dispatcher: the boxed kernel every tpu op without a kernel of its own
// enters. It finds the op's lowering, prepares its arguments (indices on the
// device, lazy conj/neg bits resolved, one device), and hands the planned op
// to the mode in force (eager/modes.h): fused eager when it is on and the op's
// result sizes do not depend on data, else strict eager. An op with no
// lowering, or one its lowering cannot take, runs on the CPU (fallback.cpp).
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <algorithm>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "aten/op_plan.h"
#include "eager/modes.h"
#include "runtime/fused_graph.h"

namespace tpu::aten {
namespace {

// Ops whose lowerings compute in the promoted (complex) type, so a complex
// scalar keeps its imaginary part; elsewhere (linspace computes in float)
// complex scalars still go to the CPU.
bool complexScalarsAllowed(const std::string& base) {
  static const std::set<std::string> ops = {"add",
                                            "sub",
                                            "rsub",
                                            "mul",
                                            "div",
                                            "true_divide",
                                            "divide",
                                            "pow",
                                            "fill",
                                            "full",
                                            "where",
                                            "masked_fill",
                                            "addcmul",
                                            "addcdiv",
                                            "lerp",
                                            "eq",
                                            "ne",
                                            "index_put",
                                            "_index_put_impl",
                                            "copy"};
  return ops.count(base) > 0;
}

// Calls f on every tensor argument, inside lists too.
template <typename F>
void forEachTensor(const std::vector<IValue>& args, F&& f) {
  for (const auto& v : args) {
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) f(t);
    } else if (v.isList()) {
      for (const IValue& e : v.toList())
        if (e.isTensor()) f(e.toTensor());
    }
  }
}

// What PyTorch's CPU kernels refuse: an op overload with these tensor dtypes
// raises there ("... not implemented for 'Bool'"), and CUDA's does too, so tpu
// raises the same instead of computing something (torch_tpu/_dtype_rejections.json,
// written by tools/dtype_rejections.py, handed over at import).
// A dtype argument (cumsum(t, 0, dtype=torch.bool)) is told apart from a tensor of that dtype:
// the CPU computes a bool tensor's cumsum (in int64) but refuses dtype=torch.bool.
constexpr int kDtypeArgument = 1000;

struct Refusal {
  std::vector<int> dtypes;  // ScalarType codes (+kDtypeArgument for a dtype argument) in schema order;
                            // for a whole op, as a sorted set
  bool not_implemented;     // NotImplementedError, else RuntimeError
  std::string message;
};

struct Refusals {
  std::unordered_map<c10::OperatorName, std::vector<Refusal>> overloads;
  std::unordered_map<std::string, std::vector<Refusal>> ops;  // by base name: every overload
};

Refusals& refusals() {
  static Refusals table;
  return table;
}

void raise(const Refusal& r) {
  TORCH_CHECK_NOT_IMPLEMENTED(!r.not_implemented, r.message);
  TORCH_CHECK(false, r.message);
}

std::vector<int> asSet(std::vector<int> dtypes) {
  std::sort(dtypes.begin(), dtypes.end());
  dtypes.erase(std::unique(dtypes.begin(), dtypes.end()), dtypes.end());
  return dtypes;
}

void refuseLikeCpu(const c10::OperatorHandle& op, const std::string& base, const std::vector<IValue>& args) {
  const Refusals& table = refusals();
  auto exact = table.overloads.find(op.operator_name());
  auto whole = table.ops.find(base);
  if (exact == table.overloads.end() && whole == table.ops.end()) return;
  // The tensors' dtypes and dtype arguments, in schema order (as the table's writer lists them).
  // `unwrapped` leaves out Python numbers made tensors (torch.floor_divide(t, 2)):
  // the kernel computes them in the other operands' dtype.
  std::vector<int> dtypes, unwrapped;
  const auto& formals = op.schema().arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const IValue& v = args[i];
    if (v.isInt() && i < formals.size() && baseType(formals[i].real_type())->kind() == c10::TypeKind::ScalarTypeType) {
      dtypes.push_back(static_cast<int>(v.toInt()) + kDtypeArgument);
      unwrapped.push_back(dtypes.back());
    } else {
      forEachTensor({v}, [&](const at::Tensor& t) {
        if (!t.defined()) return;
        dtypes.push_back(static_cast<int>(t.scalar_type()));
        if (!t.unsafeGetTensorImpl()->is_wrapped_number()) unwrapped.push_back(dtypes.back());
      });
    }
  }
  const auto set = asSet(dtypes), unwrapped_set = asSet(unwrapped);
  const auto matches = [&](const std::vector<int>& row) {
    return row == set || (!unwrapped_set.empty() && row == unwrapped_set);
  };
  if (exact != table.overloads.end())
    for (const Refusal& r : exact->second)
      if (r.dtypes == dtypes || matches(asSet(r.dtypes))) raise(r);
  if (whole != table.ops.end())
    for (const Refusal& r : whole->second)
      if (matches(r.dtypes)) raise(r);
}

// Ops whose PyTorch kernels refuse to write through memory that overlaps
// itself (x.expand(2, 3).add_(1)) or partly overlaps an input
// (x[1:].add_(x[:-1])): torch_tpu/_overlap_checks.json, by base name
// (tools/overlap_checks.py). tpu writes through views its own way and would
// give some answer instead.
struct OverlapChecks {
  std::set<std::string> internal, partial;
};

OverlapChecks& overlapChecks() {
  static OverlapChecks checks;
  return checks;
}

void checkOverlaps(const c10::OperatorHandle& op, const std::string& base, const std::vector<IValue>& args) {
  const OverlapChecks& checks = overlapChecks();
  const bool internal = checks.internal.count(base) > 0, partial = checks.partial.count(base) > 0;
  if (!internal && !partial) return;
  const auto& formals = op.schema().arguments();
  for (size_t i = 0; i < args.size() && i < formals.size(); ++i) {
    const auto* alias = formals[i].alias_info();
    if (!alias || !alias->isWrite() || !args[i].isTensor()) continue;
    const at::Tensor& written = args[i].toTensor();
    if (internal) at::assert_no_internal_overlap(written);
    if (partial)
      for (size_t j = 0; j < args.size(); ++j)
        if (j != i && args[j].isTensor() && args[j].toTensor().defined())
          at::assert_no_partial_overlap(written, args[j].toTensor());
  }
}

// The one tpu device the op's tensors are on (CPU tensors may join only as
// 0-d scalars), else the device a factory names, else the current one.
c10::DeviceIndex findDevice(const c10::OperatorHandle& op, const std::vector<IValue>& args) {
  std::optional<c10::Device> dev;
  auto see = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    if (t.device().type() == kTpu) {
      if (dev && *dev != t.device())
        TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", *dev,
                    " and ", t.device(), "! (when checking arguments for ", op.schema().name(), ")");
      dev = t.device();
    }
  };
  forEachTensor(args, see);
  // CPU tensors may only join as 0-d scalars.
  auto check_cpu = [&](const at::Tensor& t) {
    if (t.defined() && t.device().is_cpu() && t.dim() != 0 && dev)
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", *dev,
                  " and cpu! (when checking arguments for ", op.schema().name(), ")");
    if (t.defined() && !t.device().is_cpu() && t.device().type() != kTpu)
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ",
                  dev ? *dev : c10::Device(kTpu, 0), " and ", t.device(), "!");
  };
  forEachTensor(args, check_cpu);
  if (!dev)
    for (const auto& v : args)
      if (v.isDevice() && v.toDevice().type() == kTpu) dev = v.toDevice();
  c10::DeviceIndex d = dev ? dev->index() : currentDevice();
  if (d < 0) d = currentDevice();
  checkDeviceIndex(d);
  return d;
}

// Advanced indexing accepts index tensors on the CPU (as on CUDA): move
// them. A boolean mask becomes the integer indices of its true elements (its
// nonzero columns), as in PyTorch: the size is computed on the device and
// read back.
void moveIndicesToDevice(torch::jit::Stack* stack, size_t n) {
  IValue& self = (*stack)[stack->size() - n];
  IValue& idx = (*stack)[stack->size() - n + 1];
  if (!self.isTensor() || !idx.isList()) return;
  c10::Device dev = self.toTensor().device();
  auto lst = idx.toList();
  bool changed = false;
  c10::List<std::optional<at::Tensor>> out;
  for (const IValue& e : lst) {
    if (!e.isTensor() || !e.toTensor().defined()) {
      out.push_back(std::nullopt);
      continue;
    }
    at::Tensor t = e.toTensor();
    if (t.device().is_cpu()) {
      t = t.to(dev);
      changed = true;
    }
    if (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte) {
      at::Tensor nz = at::nonzero(t);
      for (int64_t j = 0; j < t.dim(); ++j) out.push_back(nz.select(1, j));
      changed = true;
    } else {
      out.push_back(t);
    }
  }
  if (changed) idx = IValue(out);
}

// PyTorch lets some ops (copies, matrix products) see tensors with a lazy
// conj/neg bit; lowerings read raw memory, so read-only arguments with a bit
// are materialized first (copyInto applies the bit on the device).
void resolveMathBits(const c10::FunctionSchema& schema, std::vector<IValue>& args) {
  auto resolve = [](const at::Tensor& t) {
    if (!t.defined() || t.device().type() != kTpu || (!t.is_conj() && !t.is_neg())) return t;
    at::Tensor r = emptyTpu(t.sizes(), t.scalar_type(), t.device().index());
    copyInto(r, t);
    return r;
  };
  for (size_t i = 0; i < args.size() && i < schema.arguments().size(); ++i) {
    const auto& a = schema.arguments()[i];
    if (a.alias_info() && a.alias_info()->isWrite()) continue;
    if (args[i].isTensor()) {
      args[i] = resolve(args[i].toTensor());
    } else if (args[i].isTensorList()) {
      bool any = false;
      for (const at::Tensor& t : args[i].toTensorList()) any |= t.defined() && (t.is_conj() || t.is_neg());
      if (!any) continue;
      c10::List<at::Tensor> list;  // a new list: the caller's stays as it was
      for (const at::Tensor& t : args[i].toTensorList()) list.push_back(resolve(t));
      args[i] = IValue(list);
    }
  }
}

// The base name of an op: "add" for aten::add and aten::add_,
// "stablehlo_call" for tpu::stablehlo_call.
std::string baseName(const std::string& full) {
  std::string base = full.substr(full.find("::") + 2);
  if (base.size() > 1 && base.back() == '_' && base.rfind("__", 0) != 0) base.pop_back();
  return base;
}

// The lowering of `base` (`foreach_expand`: of X for _foreach_X, run on each
// element); null when it has none or it is turned off.
const ops::Lowering* loweringFor(const std::string& base, const std::string& overload, bool& foreach_expand) {
  foreach_expand = false;
  if (loweringDisabled(base)) return nullptr;
  if (const ops::Lowering* low = ops::findLowering(base, overload)) return low;
  if (base.rfind("_foreach_", 0) != 0) return nullptr;
  const ops::Lowering* low = ops::findLowering(base.substr(9), "");
  foreach_expand = low != nullptr;
  return low;
}

// Why the op's arguments keep it off tpu (dtypes the device cannot hold,
// complex scalars its lowering would drop); empty when nothing does.
std::string unsupportedArguments(const std::string& base, const std::vector<IValue>& args) {
  const bool complex_ok = complexScalarsAllowed(base);
  for (const auto& v : args) {
    if (v.isTensor() && v.toTensor().defined() && !supported(v.toTensor().scalar_type()) &&
        !(complex_ok && isComplexNumber(v.toTensor())))
      return std::string("dtype ") + c10::toString(v.toTensor().scalar_type());
    if (v.isComplexDouble() && !complex_ok) return "complex scalar";
  }
  return "";
}

// fill_ with a value the tensor's dtype cannot hold raises, as on the CPU
// (PyTorch's checked conversion), in every mode.
void checkFillValue(const c10::OperatorHandle& op, const std::vector<IValue>& args) {
  if (op.schema().overload_name() != "Scalar" || !args[0].isTensor() || !args[1].isScalar()) return;
  const at::Tensor& self = args[0].toTensor();
  const at::Scalar v = args[1].toScalar();
  if (self.is_complex() || v.isComplex()) return;
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, self.scalar_type(), "fill_",
                             [&] { (void)v.to<scalar_t>(); });
}

// x[a:b].fill_(v) or .zero_() where the view is one contiguous run of a
// larger tensor: the range and the value are the program's arguments, so
// every length shares one program per tensor size (serving fills the padded
// tail of a per-step buffer, a new length each step; the op's own program
// is per view shape). False when the op takes the general path.
bool fillContiguousRange(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::vector<IValue>& args) {
  const std::string& name = op.schema().name();
  const bool zero = name == "aten::zero_";
  if (!zero && !(name == "aten::fill_" && op.schema().overload_name() == "Scalar")) return false;
  const at::Tensor& self = args[0].toTensor();
  if (self.is_complex() || self.numel() == 0 || !self.is_contiguous() || self.is_neg() || self.is_conj()) return false;
  runtime::DeviceArray& a = arrayOf(self);
  const ir::DType t = toIr(self.scalar_type());
  if (static_cast<int64_t>(a.nbytes() / ir::itemSize(t)) <= self.numel()) return false;  // the whole tensor
  const at::Scalar v = zero ? at::Scalar(0) : args[1].toScalar();
  if (v.isComplex()) return false;
  const int dev = self.device().index();
  runtime::BufferPtr value = ir::isFloat(t) ? runtime::scalarBuffer(t, v.toDouble(), dev)
                                            : runtime::scalarBufferInt(t, v.isBoolean() ? v.toBool() : v.toLong(), dev);
  runtime::fillRange(a, t, self.storage_offset(), self.storage_offset() + self.numel(), value);
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, self);
  return true;
}

void boxedKernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  // ATen's ops, and the device's own (tpu::, user kernels); others' ops have
  // no lowering here.
  if (schema.name().rfind("aten::", 0) != 0 && schema.name().rfind("tpu::", 0) != 0) return cpuFallback(op, stack, "");
  const std::string base = baseName(schema.name());
  bool foreach_expand = false;
  const ops::Lowering* low = loweringFor(base, schema.overload_name(), foreach_expand);
  const size_t n = schema.arguments().size();
  // Before the CPU fallback too: its copies of the arguments no longer overlap.
  checkOverlaps(op, base, std::vector<IValue>(stack->end() - n, stack->end()));
  if (!low) {
    findDevice(op, std::vector<IValue>(stack->end() - n, stack->end()));  // mixing devices is an error here too
    return cpuFallback(op, stack, "");
  }
  if (base == "index" || base == "index_put" || base == "_index_put_impl" || base == "_unsafe_index" ||
      base == "_unsafe_index_put")
    moveIndicesToDevice(stack, n);
  PlannedOp p{op, stack, std::vector<IValue>(stack->end() - n, stack->end())};
  refuseLikeCpu(op, base, p.args);
  resolveMathBits(schema, p.args);
  p.device = findDevice(op, p.args);
  if (std::string why = unsupportedArguments(base, p.args); !why.empty()) return cpuFallback(op, stack, why);
  p.low = low;
  p.foreach_expand = foreach_expand;
  p.base = base;
  p.key = signature(op, p.args, low);
  if (base == "fill") checkFillValue(op, p.args);
  auto& fusion = runtime::Fusion::get();
  if (!fusion.enabled() && fillContiguousRange(op, stack, p.args)) return;
  // The mode: fused eager when it is on, unless the op's result sizes depend
  // on data (then what is pending runs first, and the op runs strict).
  const bool fused = fusion.enabled() && !low->data_dependent;
  if (fusion.enabled() && !fused) fusion.flush(p.device);
  std::optional<std::string> why;
  try {
    why = fused ? eager::runFused(p) : eager::runStrict(p);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e, "torch_tpu: " + describe(op, p.args));
  }
  if (why) cpuFallback(op, stack, *why);
}

}  // namespace

// Ops with a lowering whose default kernel for every backend is a composite
// (CompositeExplicitAutograd, or a structured op calling its out= variant)
// get the lowering directly: one program instead of the composite's detour,
// and the "overrideable" ops (convolution) are implemented at all. Ops that
// decompose before autograd (CompositeImplicitAutograd) and factories that
// take a device argument keep PyTorch's own path.
int registerLoweredKernels() {
  static torch::Library lib(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  static int count = -1;
  if (count >= 0) return count;
  count = 0;
  auto& d = c10::Dispatcher::singleton();
  for (const auto& name : d.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = d.findOp(name);
    if (!op || !op->hasSchema()) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
      continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    const auto& schema = op->schema();
    bool has_device = false;
    for (const auto& a : schema.arguments()) has_device |= baseType(a.type())->kind() == c10::TypeKind::DeviceObjType;
    if (has_device) continue;
    const std::string base = baseName(name.name);
    const bool lowered = ops::findLowering(base, name.overload_name) != nullptr ||
                         (base.rfind("_foreach_", 0) == 0 && ops::findLowering(base.substr(9), "") != nullptr);
    if (!lowered) continue;
    std::string full = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    lib.impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&boxedKernel>());
    ++count;
  }
  return count;
}

namespace {

// An op that decomposes above the backends (CompositeImplicitAutograd) never reaches the tpu
// dispatcher itself, only the ops it calls; where the CPU refuses inside such an op's own code
// (max_pool1d's CPU-only max_pool1d_impl, while every other device calls
// max_pool2d_with_indices, which the CPU computes for integers), a kernel at the autograd key
// checks the table, then runs the composite as the dispatcher would have. It sits at the
// autograd key and at the backend key (inference mode skips the autograd key).
void compositeRefusalGuard(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  refuseLikeCpu(op, baseName(op.schema().name()), std::vector<IValue>(stack->end() - n, stack->end()));
  // The ops the composite calls are dispatched from the top again, autograd included.
  op.callBoxedForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd, *stack);
}

void guardCompositeRefusals() {
  static torch::Library autograd(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1, __FILE__,
                                 __LINE__);
  static torch::Library backend(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  static std::unordered_set<c10::OperatorName> guarded;
  const Refusals& table = refusals();
  auto& d = c10::Dispatcher::singleton();
  for (const auto& name : d.getAllOpNames()) {
    if (guarded.count(name) || name.name.rfind("aten::", 0) != 0) continue;
    if (!table.overloads.count(name) && !table.ops.count(baseName(name.name))) continue;
    auto op = d.findOp(name);
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::AutogradPrivateUse1) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1))
      continue;
    std::string full = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    autograd.impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&compositeRefusalGuard>());
    backend.impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&compositeRefusalGuard>());
    guarded.insert(name);
  }
}

}  // namespace

void setDtypeRefusals(
    const std::vector<std::tuple<bool, std::string, std::vector<std::string>, std::string, std::string>>& rows) {
  static const std::unordered_map<std::string, at::ScalarType> names = {{"bool", at::kBool},
                                                                        {"uint8", at::kByte},
                                                                        {"int8", at::kChar},
                                                                        {"int16", at::kShort},
                                                                        {"int32", at::kInt},
                                                                        {"int64", at::kLong},
                                                                        {"float16", at::kHalf},
                                                                        {"bfloat16", at::kBFloat16},
                                                                        {"float32", at::kFloat},
                                                                        {"float64", at::kDouble},
                                                                        {"complex64", at::kComplexFloat},
                                                                        {"complex128", at::kComplexDouble},
                                                                        {"uint16", at::kUInt16},
                                                                        {"uint32", at::kUInt32},
                                                                        {"uint64", at::kUInt64}};
  Refusals table;
  for (const auto& [whole_op, name, dtypes, type, message] : rows) {
    Refusal r{{}, type == "NotImplementedError", message};
    bool known = true;
    for (const auto& d : dtypes) {
      const bool argument = d.rfind("dtype=", 0) == 0;
      auto it = names.find(argument ? d.substr(6) : d);
      known = known && it != names.end();
      if (known) r.dtypes.push_back(static_cast<int>(it->second) + (argument ? kDtypeArgument : 0));
    }
    if (!known) continue;  // a dtype this build does not know: nothing to refuse
    if (whole_op) {
      r.dtypes = asSet(std::move(r.dtypes));
      // A factory's dtype (arange(3, dtype=torch.bool)) reaches its out= overload as the
      // dtype of the tensor written: the row holds for that too.
      if (std::all_of(r.dtypes.begin(), r.dtypes.end(), [](int d) { return d >= kDtypeArgument; })) {
        Refusal as_tensors = r;
        for (int& d : as_tensors.dtypes) d -= kDtypeArgument;
        table.ops[name].push_back(std::move(as_tensors));
      }
      table.ops[name].push_back(std::move(r));
    } else {
      const auto dot = name.find('.');
      c10::OperatorName op(name.substr(0, dot), dot == std::string::npos ? "" : name.substr(dot + 1));
      table.overloads[op].push_back(std::move(r));
    }
  }
  refusals() = std::move(table);
  guardCompositeRefusals();
}

void setOverlapChecks(std::vector<std::string> internal, std::vector<std::string> partial) {
  overlapChecks() = {{internal.begin(), internal.end()}, {partial.begin(), partial.end()}};
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&boxedKernel>()); }

}  // namespace tpu::aten
