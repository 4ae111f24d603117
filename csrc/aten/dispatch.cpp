// The boxed kernel behind every tpu op without an explicit kernel: it looks
// the op up in the lowering table, builds (once per signature) a one-op
// StableHLO program, and runs it; in-place and out= variants write the
// functional results back. Ops without a lowering run on the CPU (counted,
// warned once) unless TORCH_TPU_FALLBACK=error.
#include <ATen/native/CPUFallback.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "aten/capture.h"
#include "aten/tpu.h"
#include "ops/lowering.h"
#include "runtime/lazy.h"

namespace tpu::aten {
namespace {

// The graph being captured for torch.compile (under the fusion mutex).
// What a captured graph's argument must look like for a replay: the program
// bakes the layout (sizes, strides, storage offset) and dtype of each one.
struct ArgSignature {
  bool defined = false;
  c10::Device device = c10::Device(c10::kCPU);
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  bool matches(const at::Tensor& t) const {
    if (t.defined() != defined) return false;
    if (!defined) return true;
    return t.device() == device && t.scalar_type() == dtype && t.storage_offset() == offset &&
           t.sizes().equals(sizes) && t.strides().equals(strides);
  }
  static ArgSignature of(const at::Tensor& t) {
    ArgSignature a;
    if (!t.defined()) return a;
    a.defined = true;
    a.device = t.device();
    a.dtype = t.scalar_type();
    a.sizes = t.sizes().vec();
    a.strides = t.strides().vec();
    a.offset = t.storage_offset();
    return a;
  }
};

struct CaptureState {
  std::vector<ArgSignature> signature;
  bool active = false;
  bool broken = false;  // an op ran on the CPU: the recording cannot be replayed
  int device = 0;
  bool was_fused = false;
  int materializations = 0;
  std::unordered_map<const c10::TensorImpl*, int> cpu_inputs;
  std::vector<const runtime::DeviceArray*> arrays;  // per argument (nullptr: CPU or undefined)
  std::vector<int> groups;
};
CaptureState g_capture;

using c10::IValue;

struct InputSource {
  enum class Kind { Tensor, ListElem, Scalar, ScalarListElem, CpuScalar, Rng } kind;
  int arg = -1;
  int elem = -1;
  ir::DType dtype = ir::DType::F32;  // Scalar / CpuScalar element type in the program
};

struct OutputBinding {
  enum class Kind { Return, ReturnList, WriteArg, ReturnNone } kind;
  int index = -1;  // return index, or argument index for WriteArg
  int elem = -1;   // list element for WriteArg on a list
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes;
  // Memory order of a new result when PyTorch's kernel would not make it
  // contiguous (elementwise ops keep a permuted input's layout): the dims
  // outermost first. Empty: contiguous.
  std::vector<int64_t> perm;
};

struct Plan {
  bool have_expected = false;
  std::vector<ir::Type> expected;
  std::vector<std::vector<int64_t>> perms;
};

// How tensor and scalar arguments (and random states) become values.
struct Sources {
  std::function<ir::Value(const at::Tensor&, InputSource)> tensor;
  std::function<ir::Value(const IValue&, ir::DType, InputSource)> scalar;
  std::function<ir::Value(ir::Builder&)> rng;
};

struct Entry {
  std::shared_ptr<runtime::Program> prog;
  std::vector<InputSource> inputs;
  std::vector<OutputBinding> outputs;
  size_t num_returns = 0;
  bool data_dependent = false;  // the last program output is the length of dynamic_results
  std::vector<int> dynamic_results;
  bool bounds_check = false;  // an output (before the length) says all indices were in range
  uint32_t transposed = 0;    // operands passed as their stored matrix (transposedOperands)
  std::string op_name;
  // The results of a program that reads no tensor and draws no random
  // numbers (a fill: zeros, ones_like, full), by device and scalar values.
  // Null for any other program. See ConstantResults.
  std::shared_ptr<struct ConstantResults> constants;
};

// A fill's results, kept and handed out again instead of recomputed: every
// torch.zeros(...) of a training step (autograd's zero gradients for outputs
// no loss reads, the seed of backward) was a program launch. A kept result is
// handed to one holder at a time (when the cache is its only other owner),
// so two live tensors never share a buffer: programs pass such a buffer once
// per array and could not write either in place. The holder cannot write the
// kept buffer either: execute() donates only buffers nobody else holds, and
// the cache holds these. Bounded: results up to kMaxBytes a call, a few value
// sets per program, kBudget in all; past that, fills run as before.
struct ConstantResults {
  static constexpr size_t kMaxBytes = 4 * 1024 * 1024, kSets = 4;
  static constexpr int64_t kBudget = 64 * 1024 * 1024;
  static std::atomic<int64_t>& used() {
    static std::atomic<int64_t> bytes{0};
    return bytes;
  }
  std::mutex mu;
  std::vector<std::pair<std::vector<int64_t>, std::vector<runtime::BufferPtr>>> sets;

  // The kept results for `key` if nobody holds them now, else none.
  std::vector<runtime::BufferPtr> find(const std::vector<int64_t>& key) {
    std::lock_guard<std::mutex> g(mu);
    for (const auto& [k, bufs] : sets) {
      if (k != key) continue;
      for (const auto& b : bufs)
        if (b.use_count() > 1) return {};
      return bufs;
    }
    return {};
  }
  void keep(std::vector<int64_t> key, const std::vector<runtime::BufferPtr>& bufs, size_t bytes) {
    std::lock_guard<std::mutex> g(mu);
    for (const auto& set : sets)
      if (set.first == key) return;  // kept already (and held now)
    const auto n = static_cast<int64_t>(bytes);
    if (sets.size() >= kSets || used().load() + n > kBudget) return;
    used() += n;
    sets.emplace_back(std::move(key), bufs);
  }
};

// An op lowered onto a builder: each bound result's value is flat, in the
// result's dtype and memory order.
struct Lowered {
  std::vector<std::pair<OutputBinding, ir::Value>> bound;
  std::vector<int> none_returns;
  ir::Value bounds_ok, dynamic_len;
  std::vector<int> dynamic_results;
  size_t num_returns = 0;
};

std::mutex g_cache_mu;
std::unordered_map<std::string, std::shared_ptr<Entry>> g_cache;

bool isOutArg(const c10::Argument& a) { return a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite(); }

c10::TypePtr baseType(const c10::TypePtr& t) {
  if (auto o = t->cast<c10::OptionalType>()) return o->getElementType();
  return t;
}

bool isScalarType(const c10::TypePtr& t) { return baseType(t)->kind() == c10::TypeKind::NumberType; }

std::string shortDtype(at::ScalarType t) { return c10::toString(t); }

// "aten::add.Tensor(float32[2, 3], float32[3])" for error messages.
std::string describe(const c10::OperatorHandle& op, const std::vector<IValue>& args) {
  std::string s = op.schema().name();
  if (!op.schema().overload_name().empty()) s += "." + op.schema().overload_name();
  s += "(";
  for (size_t i = 0; i < args.size(); ++i) {
    if (i) s += ", ";
    const IValue& v = args[i];
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      s += t.defined() ? shortDtype(t.scalar_type()) + ir::shapeStr(t.sizes().vec()) : "None";
    } else if (v.isTensorList() || (v.isList() && v.toList().elementType()->kind() == c10::TypeKind::OptionalType)) {
      s += "[" + std::to_string(v.toList().size()) + " tensors]";
    } else {
      std::ostringstream os;
      os << v;
      s += os.str();
    }
  }
  return s + ")";
}

// --------------------------------------------------------------- fallback

std::mutex g_warn_mu;
std::set<std::string> g_warned;

void cpuFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why) {
  if (g_capture.active) g_capture.broken = true;
  std::string name =
      op.schema().name() + (op.schema().overload_name().empty() ? "" : "." + op.schema().overload_name());
  if (fallbackIsError()) {
    TORCH_CHECK(false, "torch_tpu: ", name, " has no tpu lowering", why.empty() ? "" : " (" + why + ")",
                ", and TORCH_TPU_FALLBACK=error forbids running it on the CPU. Unset TORCH_TPU_FALLBACK to allow "
                "the CPU fallback.");
  }
  {
    std::lock_guard<std::mutex> g(runtime::metrics().mu);
    runtime::metrics().fallbacks[name]++;
  }
  {
    std::lock_guard<std::mutex> g(g_warn_mu);
    if (g_warned.insert(name).second)
      TORCH_WARN("torch_tpu: ", name, " has no tpu lowering", why.empty() ? "" : " (" + why + ")",
                 "; it runs on the CPU (copying its inputs and outputs). Set TORCH_TPU_FALLBACK=error to make this "
                 "an error.");
  }
  // Factory ops name the tpu device in an argument: run them on the CPU and
  // move the results.
  const auto& schema = op.schema();
  size_t n = schema.arguments().size();
  auto args = torch::jit::last(*stack, n);
  std::optional<c10::Device> target;
  for (size_t i = 0; i < n; ++i) {
    IValue& v = (*stack)[stack->size() - n + i];
    if (v.isDevice() && v.toDevice().type() == kTpu) {
      target = v.toDevice();
      v = IValue(c10::Device(c10::kCPU));
    }
  }
  if (target) {
    op.callBoxed(stack);
    c10::Device dev(kTpu, target->index() < 0 ? currentDevice() : target->index());
    for (size_t i = stack->size() - schema.returns().size(); i < stack->size(); ++i) {
      IValue& r = (*stack)[i];
      if (r.isTensor() && r.toTensor().defined()) r = IValue(r.toTensor().to(dev));
    }
    return;
  }
  at::native::cpu_fallback(op, stack, /*error_on_views=*/false);
}

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

// Bad input found by a meta kernel: run the op on CPU tensors of the same
// shapes so the user sees exactly the CPU's exception type and message.
// Returns true if the CPU accepts the input (the caller rethrows the meta
// error), false if the CPU has no kernel for the op.
bool raiseAsCpu(const c10::OperatorHandle& op, const std::vector<IValue>& args) {
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
    } else {
      cs.push_back(v);
    }
  }
  if (total > (int64_t(1) << 24)) return true;  // too large to mirror: keep the meta error
  try {
    op.callBoxed(&cs);  // throws the CPU's own error
  } catch (const c10::NotImplementedError&) {
    // No CPU kernel (ops PyTorch runs only off the CPU, such as the fused
    // RNN cells): nothing to compare the meta kernel's complaint with.
    return false;
  }
  return true;
}

// Runs the op on meta tensors: PyTorch's own shape/dtype checks raise the
// same errors as on the CPU, and the results give the expected types.
// Returns false when the op has no meta kernel.
bool metaRun(const c10::OperatorHandle& op, const std::vector<IValue>& args, std::vector<ir::Type>& expected,
             std::vector<std::vector<int64_t>>* perms) {
  const auto& schema = op.schema();
  torch::jit::Stack ms;
  ms.reserve(args.size());
  for (const auto& a : args) ms.push_back(metaOf(a));
  std::vector<IValue> meta_args = ms;  // keep the mutated args for void ops
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
    if (!raiseAsCpu(op, args)) return false;
    throw;
  } catch (const std::exception& e) {
    // A Python meta kernel's NotImplementedError arrives as a Python error.
    std::string m = e.what();
    if (m.find("NotImplemented") != std::string::npos || m.find("not implemented") != std::string::npos ||
        m.find("unimplemented") != std::string::npos)
      return false;
    // A meta kernel that fails where no CPU kernel could confirm the input
    // is bad (the fused LSTM cell's meta reads `.device` of its optional
    // biases) is treated as missing: the lowering's own checks apply.
    if (!raiseAsCpu(op, args)) return false;
    throw;
  }
  if (!schema.returns().empty()) {
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

// --------------------------------------------------------------- signature

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
      if (is_const || v.isComplexDouble()) {  // complex scalars are program constants
        std::ostringstream os;
        os.precision(17);
        os << v;
        k += os.str();
      }
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
      std::ostringstream os;
      os.precision(17);
      os << v;
      k += os.str();
      k += ';';
    }
  }
  return k;
}

// --------------------------------------------------------------- lowering

struct Built {
  std::shared_ptr<Entry> entry;
};

// A Python complex number arrives as a 0-d complex128 CPU tensor (wrapped,
// or conj() of one in autograd): the program takes it as complex64, the
// precision the device computes in. Where PyTorch's result would be
// complex128 the expected types already send the op to the CPU.
bool isComplexNumber(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kComplexDouble && t.dim() == 0;
}
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
ir::DType cpuScalarIr(const at::Tensor& t) { return isComplexNumber(t) ? ir::DType::C64 : toIr(t.scalar_type()); }

ir::DType scalarIrType(const IValue& v) {
  if (v.isDouble()) return ir::DType::F64;
  if (v.isBool()) return ir::DType::Bool;
  if (v.isComplexDouble()) return ir::DType::C64;
  return ir::DType::I64;
}

// Lowers one op onto `b`: converts the arguments (tensors and scalars become
// values through `src`), runs the lowering, and binds each result to a return
// or a written argument, converted to PyTorch's dtype, laid out in memory
// order and flattened. Shared by strict eager (one-op programs) and fused
// eager (one graph for many ops).
Lowered lowerOp(const c10::OperatorHandle& op, const std::vector<IValue>& args, const ops::Lowering* low,
                bool foreach_expand, const std::string& base, const Plan& plan, ir::Builder& b, Sources& src) {
  const auto& schema = op.schema();
  const auto& sargs = schema.arguments();
  Lowered out;
  const bool have_expected = plan.have_expected;
  const auto& expected = plan.expected;
  const auto& perms = plan.perms;
  std::vector<ops::Arg> largs;
  auto tensorParam = [&](const at::Tensor& t, InputSource is) { return src.tensor(t, is); };

  for (size_t i = 0; i < args.size(); ++i) {
    const IValue& v = args[i];
    const auto& sa = sargs[i];
    ops::Arg a;
    if (isOutArg(sa)) {
      largs.push_back(a);  // out= tensors are written, not read
      continue;
    }
    if (v.isNone()) {
      a.kind = ops::Arg::Kind::None;
    } else if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        a.kind = ops::Arg::Kind::None;
      } else if (t.device().is_cpu() && t.unsafeGetTensorImpl()->is_wrapped_number()) {
        a.kind = ops::Arg::Kind::Scalar;
        a.scalar_is_float = at::isFloatingType(t.scalar_type());
        a.value = tensorParam(t, {InputSource::Kind::CpuScalar, static_cast<int>(i)});
      } else {
        a.kind = ops::Arg::Kind::Tensor;
        a.value = tensorParam(t, {InputSource::Kind::Tensor, static_cast<int>(i)});
        a.contiguous = t.is_contiguous();
      }
    } else if (v.isTensorList() || (v.isList() && v.toList().elementType()->kind() == c10::TypeKind::OptionalType)) {
      a.kind = ops::Arg::Kind::TensorList;
      auto lst = v.toList();
      for (size_t j = 0; j < lst.size(); ++j) {
        IValue e = lst.get(j);
        if (e.isNone() || !e.toTensor().defined()) {
          a.values.push_back(ir::Value{});
        } else {
          a.values.push_back(
              tensorParam(e.toTensor(), {InputSource::Kind::ListElem, static_cast<int>(i), static_cast<int>(j)}));
        }
      }
    } else if (isScalarType(sa.type()) && (v.isDouble() || v.isInt() || v.isBool() || v.isComplexDouble())) {
      a.kind = ops::Arg::Kind::Scalar;
      a.scalar_is_float = v.isDouble();
      bool is_const = std::find(low->const_scalars.begin(), low->const_scalars.end(), static_cast<int>(i)) !=
                      low->const_scalars.end();
      ir::DType st = scalarIrType(v);
      if (v.isComplexDouble()) {
        // A constant of the program (the signature holds its value): scalar
        // inputs travel as f64/i64/i1 only. complex64, like the device.
        auto z = v.toComplexDouble();
        a.scalar_is_float = true;
        a.value = b.complex(b.constant(z.real(), ir::DType::F32), b.constant(z.imag(), ir::DType::F32));
      } else if (is_const) {
        a.const_value = v.isDouble() ? v.toDouble() : (v.isBool() ? double(v.toBool()) : double(v.toInt()));
        a.value = v.isInt() ? b.constantInt(v.toInt(), st) : b.constant(*a.const_value, st);
      } else {
        a.value = src.scalar(v, st, {InputSource::Kind::Scalar, static_cast<int>(i), -1, st});
      }
    } else if (v.isList() && baseType(sa.type())->castRaw<c10::ListType>() &&
               baseType(sa.type())->castRaw<c10::ListType>()->getElementType()->kind() == c10::TypeKind::NumberType) {
      a.kind = ops::Arg::Kind::ScalarList;
      auto lst = v.toList();
      for (size_t j = 0; j < lst.size(); ++j) {
        if (lst.get(j).isComplexDouble()) throw ir::Unsupported("complex scalar lists");
        ir::DType st = scalarIrType(lst.get(j));
        a.values.push_back(src.scalar(
            lst.get(j), st, {InputSource::Kind::ScalarListElem, static_cast<int>(i), static_cast<int>(j), st}));
      }
      a.scalar_is_float = !lst.empty() && lst.get(0).isDouble();
    } else if (v.isInt() && baseType(sa.real_type())->kind() == c10::TypeKind::ScalarTypeType) {
      a.kind = ops::Arg::Kind::DType;
      a.dtype = toIr(static_cast<at::ScalarType>(v.toInt()));
    } else if (v.isInt() || v.isSymInt()) {
      a.kind = ops::Arg::Kind::Int;
      a.i = v.isInt() ? v.toInt() : v.toSymInt().expect_int();
    } else if (v.isDouble()) {
      a.kind = ops::Arg::Kind::Double;
      a.d = v.toDouble();
    } else if (v.isBool()) {
      a.kind = ops::Arg::Kind::Bool;
      a.b = v.toBool();
    } else if (v.isIntList() ||
               (v.isList() && baseType(sa.type())->castRaw<c10::ListType>() &&
                (baseType(sa.type())->castRaw<c10::ListType>()->getElementType()->kind() == c10::TypeKind::IntType ||
                 baseType(sa.type())->castRaw<c10::ListType>()->getElementType()->kind() ==
                     c10::TypeKind::SymIntType))) {
      a.kind = ops::Arg::Kind::IntList;
      if (v.isIntList()) {
        a.ints = v.toIntVector();
      } else {
        for (const IValue& e : v.toList()) a.ints.push_back(e.isInt() ? e.toInt() : e.toSymInt().expect_int());
      }
    } else if (v.isDoubleList()) {
      a.kind = ops::Arg::Kind::DoubleList;
      a.doubles = v.toDoubleVector();
    } else if (v.isBoolList()) {
      a.kind = ops::Arg::Kind::BoolList;
      for (bool x : v.toBoolList()) a.ints.push_back(x);
    } else if (v.isString()) {
      a.kind = ops::Arg::Kind::String;
      a.s = v.toStringRef();
    } else {
      a.kind = ops::Arg::Kind::Other;  // layout, device, memory format, generator
    }
    largs.push_back(std::move(a));
  }

  auto make_rng = [&src](ir::Builder& bb) { return src.rng(bb); };

  std::vector<ir::Value> results;
  std::vector<ops::Ctx::Mutation> mutations;
  ir::Value dynamic_len, bounds_ok;
  std::vector<int> dynamic_results;
  bool all_empty = have_expected && !expected.empty() && !low->data_dependent;
  for (const auto& t : expected) all_empty &= t.shape != ir::Shape{-1} && t.numel() == 0;
  if (all_empty && !foreach_expand) {
    // Every result is empty: nothing to compute (and XLA rejects some
    // zero-size windows and gathers).
    for (const auto& t : expected) results.push_back(b.constant(0.0, t.dtype, t.shape));
  } else if (!foreach_expand) {
    ops::Ctx ctx(b, base, largs, have_expected ? expected : std::vector<ir::Type>{});
    ctx.make_rng_state = make_rng;
    results = low->fn(ctx);
    mutations = ctx.mutations();
    dynamic_len = ctx.dynamicLength();
    dynamic_results = ctx.dynamicResults();
    bounds_ok = ctx.boundsOk();
    bool aliased_return = false;
    for (const auto& r : schema.returns()) aliased_return |= r.alias_info() != nullptr;
    if (low->data_dependent && (!dynamic_len.valid() || aliased_return))
      throw ir::Unsupported("data-dependent result here");
  } else {
    // _foreach_X(list, list|scalar|scalars, ...) = X on each element.
    size_t len = 0;
    for (const auto& a : largs)
      if (a.kind == ops::Arg::Kind::TensorList) len = std::max(len, a.values.size());
    for (size_t j = 0; j < len; ++j) {
      std::vector<ops::Arg> el;
      for (const auto& a : largs) {
        ops::Arg e = a;
        if (a.kind == ops::Arg::Kind::TensorList) {
          e.kind = ops::Arg::Kind::Tensor;
          e.value = a.values.at(j);
          e.values.clear();
        } else if (a.kind == ops::Arg::Kind::ScalarList) {
          e.kind = ops::Arg::Kind::Scalar;
          e.value = a.values.at(j);
          e.values.clear();
        }
        el.push_back(std::move(e));
      }
      std::vector<ir::Type> ex;
      if (have_expected && expected.size() == len) ex.push_back(expected[j]);
      ops::Ctx ctx(b, base, std::move(el), ex);
      ctx.make_rng_state = make_rng;
      auto r = low->fn(ctx);
      if (r.size() != 1) throw ir::Unsupported("foreach over a multi-result op");
      results.push_back(r[0]);
    }
  }

  // Bind results to returns / written arguments.
  const auto& rets = schema.returns();
  out.num_returns = rets.size();
  size_t ri = 0;
  auto take = [&]() -> ir::Value {
    if (ri >= results.size())
      throw std::logic_error("torch_tpu internal: the lowering of " + schema.name() + " returned too few results");
    return results[ri++];
  };
  auto& bound = out.bound;
  auto& none_returns = out.none_returns;
  std::vector<size_t> expected_skip;  // positions (in return order) of undefined results
  auto argTensor = [&](int idx, int elem) -> at::Tensor {
    const IValue& v = args[idx];
    if (elem < 0) return v.toTensor();
    return v.toList().get(elem).toTensor();
  };
  auto bindWrite = [&](int idx, int elem, const ir::Value& val) {
    at::Tensor t = argTensor(idx, elem);
    OutputBinding ob{OutputBinding::Kind::WriteArg, idx, elem, t.scalar_type(), {}};
    bound.push_back({ob, val});
  };
  if (rets.empty()) {
    for (size_t i = 0; i < sargs.size() && ri < results.size(); ++i) {
      if (!(sargs[i].alias_info() && sargs[i].alias_info()->isWrite())) continue;
      const IValue& v = args[i];
      if (v.isTensor()) {
        bindWrite(static_cast<int>(i), -1, take());
      } else if (v.isTensorList() || v.isList()) {
        auto lst = v.toList();
        for (size_t j = 0; j < lst.size(); ++j)
          if (!lst.get(j).isNone()) bindWrite(static_cast<int>(i), static_cast<int>(j), take());
      }
    }
  } else {
    for (size_t r = 0; r < rets.size(); ++r) {
      const auto& ret = rets[r];
      if (ret.alias_info() && ret.alias_info()->isWrite()) {
        int target = -1;
        for (size_t i = 0; i < sargs.size(); ++i)
          if (sargs[i].alias_info() && sargs[i].alias_info()->beforeSets() == ret.alias_info()->beforeSets())
            target = static_cast<int>(i);
        if (target < 0) throw ir::Unsupported("unmatched alias in " + schema.name());
        const IValue& v = args[target];
        if (v.isTensor()) {
          bindWrite(target, -1, take());
        } else {
          auto lst = v.toList();
          for (size_t j = 0; j < lst.size(); ++j) bindWrite(target, static_cast<int>(j), take());
        }
      } else if (ret.type()->kind() == c10::TypeKind::ListType) {
        while (ri < results.size()) {
          ir::Value val = take();
          OutputBinding ob{OutputBinding::Kind::ReturnList, static_cast<int>(r), -1, toAten(val.dtype()), val.shape()};
          bound.push_back({ob, val});
        }
      } else {
        ir::Value val = take();
        if (!val.valid()) {  // the lowering leaves this result undefined
          none_returns.push_back(static_cast<int>(r));
          expected_skip.push_back(r);
          continue;
        }
        OutputBinding ob{OutputBinding::Kind::Return, static_cast<int>(r), -1, toAten(val.dtype()), val.shape()};
        bound.push_back({ob, val});
      }
    }
  }
  if (ri != results.size())
    throw std::logic_error("torch_tpu internal: the lowering of " + schema.name() + " returned " +
                           std::to_string(results.size()) + " results, the schema binds " + std::to_string(ri));
  for (const auto& m : mutations) bindWrite(static_cast<int>(m.arg), m.elem, m.value);

  // Expected types of the bound results (undefined results removed).
  std::vector<ir::Type> ex_bound;
  std::vector<std::vector<int64_t>> perm_bound;
  for (size_t i = 0; i < expected.size(); ++i)
    if (std::find(expected_skip.begin(), expected_skip.end(), i) == expected_skip.end()) {
      ex_bound.push_back(expected[i]);
      perm_bound.push_back(i < perms.size() ? perms[i] : std::vector<int64_t>{});
    }
  // Check against the meta results, convert dtypes, flatten.
  for (size_t i = 0; i < bound.size(); ++i) {
    auto& [ob, val] = bound[i];
    bool from_mutation = i >= bound.size() - mutations.size();
    if (have_expected && !from_mutation && i < ex_bound.size() && ex_bound[i].shape != ir::Shape{-1}) {
      const ir::Type& ex = ex_bound[i];
      // A lowering may return [0] for a result the CPU kernel leaves empty
      // where the meta kernel sizes it (batch-norm eval statistics).
      bool empty_placeholder = ob.kind == OutputBinding::Kind::Return && val.shape() == ir::Shape{0};
      if (empty_placeholder) {
        ob.dtype = toAten(ex.dtype);
        ob.sizes = val.shape();
      } else if (ex.shape != val.shape())
        throw std::logic_error("torch_tpu internal: the lowering of " + schema.name() + " produced shape " +
                               ir::shapeStr(val.shape()) + ", PyTorch expects " + ir::shapeStr(ex.shape));
      if (!empty_placeholder) {
        if (ob.kind != OutputBinding::Kind::WriteArg) ob.dtype = toAten(ex.dtype);
        ob.sizes = ex.shape;
        if (ob.kind == OutputBinding::Kind::Return && i < perm_bound.size()) ob.perm = perm_bound[i];
      }
    } else if (ob.kind == OutputBinding::Kind::WriteArg) {
      ob.sizes = val.shape();
    }
    ir::Value v = b.convert(val, toIr(ob.dtype));
    if (!ob.perm.empty()) v = b.transpose(v, ob.perm);  // into memory order
    val = b.reshape(v, {v.type.numel()});
  }
  out.bounds_ok = bounds_ok;
  out.dynamic_len = dynamic_len;
  out.dynamic_results = dynamic_results;
  return out;
}

// The sizes of a result in memory order (its layout's permutation applied).
std::vector<int64_t> memorySizes(const OutputBinding& ob) {
  if (ob.perm.empty()) return ob.sizes;
  std::vector<int64_t> sizes;
  for (int64_t d : ob.perm) sizes.push_back(ob.sizes[d]);
  return sizes;
}

// PyTorch's view of the op for this signature (meta kernel results).
Plan planFor(const c10::OperatorHandle& op, const std::vector<IValue>& args, const ops::Lowering* low) {
  Plan p;
  p.have_expected = !low->data_dependent && metaRun(op, args, p.expected, &p.perms);
  return p;
}

// Scalar arguments and random states as parameters of `b`, each recorded in
// `inputs` (strict programs and fused-eager fragments take them alike).
void paramScalarSources(Sources& src, ir::Builder& b, std::vector<InputSource>& inputs) {
  src.scalar = [&b, &inputs](const IValue&, ir::DType st, InputSource is) {
    inputs.push_back(is);
    return b.param({st, {}});
  };
  src.rng = [&inputs](ir::Builder& bb) {
    inputs.push_back({InputSource::Kind::Rng, -1, -1, ir::DType::U64});
    return bb.param({ir::DType::U64, {2}});
  };
}

uint32_t transposedOperands(const std::string& base, const std::vector<IValue>& args);
bool arrivesTransposed(uint32_t transposed, const InputSource& is);
// The cache-key suffix of a program or fragment built with `transposed`.
std::string transposedKey(uint32_t transposed) { return transposed ? "|T" + std::to_string(transposed) : ""; }

size_t resultBytes(const runtime::Program& p) {
  size_t n = 0;
  for (const auto& t : p.out_types) n += static_cast<size_t>(t.numel()) * ir::itemSize(t.dtype);
  return n;
}

// Strict eager: a one-op program whose parameters are the flat inputs; a
// transposed operand of a matrix product is its stored matrix, transposed in
// the program (see transposedOperands). A tensor argument no result reads
// (fill_'s and zero_'s self) becomes a constant of its type in a second
// lowering, so the program takes no buffer for it: an unwritten argument is
// not first filled with zeros, nor a view argument gathered.
std::shared_ptr<Entry> build(const c10::OperatorHandle& op, const std::vector<IValue>& args, const ops::Lowering* low,
                             bool foreach_expand, const std::string& base, uint32_t transposed) {
  const auto& schema = op.schema();
  std::vector<int> param_of_call;  // per tensor argument lowered: its param, or -1 (a CPU scalar)
  std::vector<bool> unread_call;   // per tensor argument lowered: a constant in the second lowering
  for (int pass = 0;; ++pass) {
    auto entry = std::make_shared<Entry>();
    entry->data_dependent = low->data_dependent;
    entry->transposed = transposed;
    Plan plan = planFor(op, args, low);
    ir::Builder b;
    Sources src;
    size_t call = 0;
    src.tensor = [&](const at::Tensor& t, InputSource is) {
      const size_t c = call++;
      ir::Type ty{cpuScalarIr(t), {t.numel()}};
      if (t.device().is_cpu()) {
        if (pass == 0) param_of_call.push_back(-1);
        is.kind = InputSource::Kind::CpuScalar;
        is.dtype = ty.dtype;
        entry->inputs.push_back(is);
        return b.param({ty.dtype, {}});
      }
      if (pass == 1 && c < unread_call.size() && unread_call[c]) return b.constant(0.0, ty.dtype, t.sizes().vec());
      if (pass == 0) param_of_call.push_back(static_cast<int>(entry->inputs.size()));
      ir::Value v = b.param(ty);
      entry->inputs.push_back(is);
      if (arrivesTransposed(transposed, is)) return b.transpose(b.reshape(v, {t.size(1), t.size(0)}), {1, 0});
      return b.reshape(v, t.sizes().vec());
    };
    paramScalarSources(src, b, entry->inputs);
    Lowered l = lowerOp(op, args, low, foreach_expand, base, plan, b, src);
    entry->num_returns = l.num_returns;
    for (const auto& [ob, v] : l.bound) {
      b.output(l.dynamic_results.empty() ? runtime::resultInShape(b, v, memorySizes(ob)) : v);
      entry->outputs.push_back(ob);
    }
    for (int r : l.none_returns) entry->outputs.push_back({OutputBinding::Kind::ReturnNone, r, -1, at::kFloat, {}});
    if (l.bounds_ok.valid()) {
      b.output(l.bounds_ok);
      entry->bounds_check = true;
    }
    if (l.dynamic_len.valid()) b.output(b.convert(l.dynamic_len, ir::DType::I64));
    if (pass == 0 && b.aliases().empty()) {
      const std::vector<bool> read = b.paramsRead();
      bool any = false;
      for (int p : param_of_call) {
        unread_call.push_back(p >= 0 && !read[p]);
        any = any || unread_call.back();
      }
      if (any) continue;
    }
    entry->dynamic_results = l.dynamic_results;
    entry->op_name = schema.name() + (schema.overload_name().empty() ? "" : "." + schema.overload_name());
    entry->prog = runtime::Runtime::get().compile(b, schema.name());
    const bool fill = std::all_of(entry->inputs.begin(), entry->inputs.end(), [](const InputSource& is) {
      return is.kind == InputSource::Kind::Scalar || is.kind == InputSource::Kind::ScalarListElem;
    });
    if (fill && !entry->data_dependent && !entry->bounds_check && !entry->outputs.empty() &&
        resultBytes(*entry->prog) <= ConstantResults::kMaxBytes)
      // Never destroyed: the program cache outlives the runtime at exit, and
      // a buffer must not outlive its plugin client.
      entry->constants = std::shared_ptr<ConstantResults>(new ConstantResults, [](ConstantResults*) {});
    return entry;
  }
}

// --------------------------------------------------------------- run

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

runtime::BufferPtr cpuScalarBuffer(const at::Tensor& t, ir::DType dt, int device) {
  if (ir::isComplex(dt)) {
    at::Tensor z = t.resolve_conj().resolve_neg().to(at::kComplexFloat).contiguous();
    return runtime::Runtime::get().upload(z.data_ptr(), ir::DType::C64, {}, device);
  }
  if (ir::isFloat(dt)) return runtime::scalarBuffer(dt, t.item<double>(), device);
  return runtime::scalarBufferInt(dt, t.item<int64_t>(), device);
}

// Replaces the op's arguments on the stack by its returns: new tensors
// (`returns`, `lists`), or the written arguments they alias.
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

// Strides of a result laid out in memory order `perm` (outermost first).
std::vector<int64_t> permutedStrides(const OutputBinding& ob) {
  std::vector<int64_t> strides(ob.sizes.size());
  int64_t s = 1;
  for (auto it = ob.perm.rbegin(); it != ob.perm.rend(); ++it) {
    strides[*it] = s;
    s *= ob.sizes[*it];
  }
  return strides;
}

IValue scalarArg(const InputSource& src, const std::vector<IValue>& args) {
  return src.kind == InputSource::Kind::Scalar ? args[src.arg] : args[src.arg].toList().get(src.elem);
}

// What a fill's results depend on: the device and its scalars, as the program
// receives them.
std::vector<int64_t> constantKey(const Entry& e, const std::vector<IValue>& args, c10::DeviceIndex dev) {
  std::vector<int64_t> key{dev};
  for (const auto& src : e.inputs) {
    IValue v = scalarArg(src, args);
    if (src.dtype == ir::DType::F64) {
      double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      key.push_back(bits);
    } else {
      key.push_back(src.dtype == ir::DType::Bool ? v.toBool() : v.toInt());
    }
  }
  return key;
}

std::vector<runtime::BufferPtr> runProgram(const Entry& e, std::vector<IValue>& args, c10::DeviceIndex dev) {
  std::vector<runtime::BufferPtr> inputs;
  inputs.reserve(e.inputs.size());
  std::optional<at::Generator> gen;
  for (const auto& src : e.inputs) {
    switch (src.kind) {
      case InputSource::Kind::Tensor: {
        const at::Tensor& t = args[src.arg].toTensor();
        if (arrivesTransposed(e.transposed, src)) {  // the stored matrix: no transposing read
          runtime::ViewGeometry g = geometryOf(t);
          std::swap(g.sizes[0], g.sizes[1]);
          std::swap(g.strides[0], g.strides[1]);
          inputs.push_back(runtime::readView(arrayOf(t), g));
        } else {
          inputs.push_back(readTensor(t));
        }
        break;
      }
      case InputSource::Kind::ListElem: {
        at::Tensor t = args[src.arg].toList().get(src.elem).toTensor();
        inputs.push_back(readTensor(t));
        break;
      }
      case InputSource::Kind::CpuScalar: {
        const IValue& v = args[src.arg];
        at::Tensor t = src.elem < 0 ? v.toTensor() : v.toList().get(src.elem).toTensor();
        inputs.push_back(cpuScalarBuffer(t, src.dtype, dev));
        break;
      }
      case InputSource::Kind::Scalar:
      case InputSource::Kind::ScalarListElem: {
        IValue v = scalarArg(src, args);
        if (src.dtype == ir::DType::F64)
          inputs.push_back(runtime::scalarBuffer(ir::DType::F64, v.toDouble(), dev));
        else if (src.dtype == ir::DType::Bool)
          inputs.push_back(runtime::scalarBufferInt(ir::DType::Bool, v.toBool(), dev));
        else
          inputs.push_back(runtime::scalarBufferInt(ir::DType::I64, v.toInt(), dev));
        break;
      }
      case InputSource::Kind::Rng: {
        if (!gen) gen = generatorFor(args, dev);
        std::array<uint64_t, 2> st;
        {
          std::lock_guard<std::mutex> lock(gen->mutex());
          st = gen->get<TpuGenerator>()->next();
        }
        inputs.push_back(runtime::Runtime::get().upload(st.data(), ir::DType::U64, {2}, dev));
        break;
      }
    }
  }
  return runtime::execute(*e.prog, inputs, dev);
}

void runEntry(const Entry& e, const c10::OperatorHandle& op, torch::jit::Stack* stack, std::vector<IValue>& args,
              c10::DeviceIndex dev) {
  std::vector<runtime::BufferPtr> outs;
  if (e.constants) {
    std::vector<int64_t> key = constantKey(e, args, dev);
    outs = e.constants->find(key);
    if (outs.empty()) {
      outs = runProgram(e, args, dev);
      e.constants->keep(std::move(key), outs, resultBytes(*e.prog));
    } else {
      runtime::metrics().constant_reuses++;
    }
  } else {
    outs = runProgram(e, args, dev);
  }
  if (e.bounds_check) {
    size_t pos = outs.size() - (e.data_dependent ? 2 : 1);
    runtime::checkIndicesLater(outs[pos], e.op_name, dev);
  }
  int64_t dynamic_len = -1;
  if (e.data_dependent) {  // the host needs the length: read it back
    runtime::Runtime::get().download(*outs.back(), &dynamic_len, sizeof(dynamic_len));
  }

  std::vector<IValue> returns(e.num_returns);
  std::vector<c10::List<at::Tensor>> lists(e.num_returns);
  for (size_t i = 0; i < e.outputs.size(); ++i) {
    const auto& ob = e.outputs[i];
    if (ob.kind == OutputBinding::Kind::WriteArg) {
      at::Tensor t = ob.elem < 0 ? args[ob.index].toTensor() : args[ob.index].toList().get(ob.elem).toTensor();
      if (t.sizes().vec() != ob.sizes) t.resize_(ob.sizes);
      writeTensor(t, outs[i]);
    } else if (ob.kind == OutputBinding::Kind::ReturnNone) {
      returns[ob.index] = IValue(at::Tensor());
    } else if (ob.kind == OutputBinding::Kind::Return) {
      at::Tensor t = ob.perm.empty() ? wrapBuffer(outs[i], ob.sizes, ob.dtype, dev)
                                     : wrapBuffer(outs[i], ob.sizes, ob.dtype, dev, permutedStrides(ob));
      bool dynamic = e.data_dependent &&
                     std::find(e.dynamic_results.begin(), e.dynamic_results.end(), ob.index) != e.dynamic_results.end();
      // A result the op left empty (counts not requested) stays empty.
      if (dynamic && t.dim() > 0 && t.size(0) >= dynamic_len) t = t.narrow(0, 0, dynamic_len);
      returns[ob.index] = IValue(t);
    } else {
      lists[ob.index].push_back(wrapBuffer(outs[i], ob.sizes, ob.dtype, dev));
    }
  }
  pushReturns(op, stack, args, returns, lists);
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

// The difference between a new signature and the closest one seen before for
// the same op (arguments in schema order).
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

// " (issued at file:line)" of the innermost Python frame outside torch, so a
// deferred error points at the user's code; empty without Python. It takes
// the GIL, so never call it under the fusion lock: the GIL's holder may be
// waiting for that lock (freeing a tensor, recording an op).
std::string userLocation() {
  if (!Py_IsInitialized()) return "";
  pybind11::gil_scoped_acquire gil;
  PyFrameObject* f = PyEval_GetFrame();
  if (f) Py_INCREF(f);
  while (f) {
    PyCodeObject* code = PyFrame_GetCode(f);
    std::string file = PyUnicode_AsUTF8(code->co_filename);
    int line = PyFrame_GetLineNumber(f);
    Py_DECREF(code);
    bool internal = file.find("/torch/") != std::string::npos || file.find("/torch_tpu/") != std::string::npos;
    if (!internal) {
      Py_DECREF(f);
      return " (issued at " + file + ":" + std::to_string(line) + ")";
    }
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  return "";
}

at::Tensor listElem(const std::vector<IValue>& args, int idx, int elem) {
  return elem < 0 ? args[idx].toTensor() : args[idx].toList().get(elem).toTensor();
}

// Fused eager's form of an op signature: its lowering as a function the
// pending graph calls (built once; a later op with this signature costs a
// call line, not a lowering), and where the function's params come from.
struct Fragment {
  std::shared_ptr<const ir::Function> fn;
  std::vector<InputSource> inputs;     // one per param, in order
  std::vector<OutputBinding> outputs;  // one per result before the bounds check
  std::vector<int> none_returns;
  bool bounds_check = false;  // the last result says all indices were in range
  size_t num_returns = 0;
};

std::mutex g_fragment_mu;
std::unordered_map<std::string, std::shared_ptr<const Fragment>> g_fragments;

// Matrix products whose operand is a transposed view (the weight of a
// linear layer, the activations of its weight gradient) take that operand in
// memory order: the caller passes the stored matrix and the fragment (fused
// eager) or one-op program (strict eager) transposes it back, so the lowering
// sees the transpose and the GEMM kernel reads the stored matrix with its
// transpose flag (the transpose in the caller cancels against the view's).
// Without this XLA had to materialise each transpose for the kernel, fused
// into the producer of the operand: transposed writes that made the GPT step
// 1.7x slower; strict eager ran a transposing read, a program of its own
// (55 us more per 1024x64x256 linear). Bit i: argument i.
uint32_t transposedOperands(const std::string& base, const std::vector<IValue>& args) {
  if (!ops::hostGemm() || (base != "mm" && base != "addmm")) return 0;
  uint32_t mask = 0;
  for (size_t i = 0; i < args.size() && i < 32; ++i) {
    if (!args[i].isTensor()) continue;
    const at::Tensor& t = args[i].toTensor();
    if (t.defined() && !t.device().is_cpu() && t.dim() == 2 && t.size(0) > 1 && t.size(1) > 1 && t.stride(0) == 1 &&
        t.stride(1) == t.size(0))
      mask |= 1u << i;
  }
  return mask;
}

bool arrivesTransposed(uint32_t transposed, const InputSource& is) {
  return is.kind == InputSource::Kind::Tensor && (transposed >> is.arg & 1u);
}

// Attention's q, k and v [B, H, L, E] that are head splits of a wider
// projection (a model's packed q/k/v linear: rows of 3*H*E, one row per
// position) arrive as their whole storage, and the fragment notes where each
// lies in it, so the attention kernel reads them in place (ops/attention.cpp).
// Without this XLA copied each out of the projection, forward and backward:
// 12 copies of [16, 64, 64] per step of the benchmark GPT. Bit i: argument i.
uint32_t packedAttentionOperands(const std::string& base, const std::vector<IValue>& args) {
  int first = -1;
  if (base == "_scaled_dot_product_flash_attention_for_cpu") first = 0;
  if (base == "_scaled_dot_product_flash_attention_for_cpu_backward") first = 1;
  if (first < 0 || args.size() < static_cast<size_t>(first + 3)) return 0;
  uint32_t mask = 0;
  for (int i = first; i < first + 3; ++i) {
    if (!args[i].isTensor()) return 0;
    const at::Tensor& t = args[i].toTensor();
    if (!t.defined() || t.device().type() != kTpu || t.scalar_type() != at::kFloat || t.dim() != 4) return 0;
    // [B, H, L, E] as the kernels' sequence-major [B, L, H, E].
    const auto sz = t.sizes(), st = t.strides();
    if (ops::attentionRowStride({sz[0], sz[2], sz[1], sz[3]}, {st[0], st[2], st[1], st[3]}) &&
        arrayOf(t).dtype() == ir::DType::F32)
      mask |= 1u << i;
  }
  const bool on_kernels =
      ops::attentionOnHostKernels(args[first].toTensor().size(3), args[first + 2].toTensor().size(3), first == 1);
  return on_kernels ? mask : 0;
}

// The first packed operand before `i` that shares operand i's storage (i
// itself when none does): operands of one storage (q, k and v split from one
// projection) share the fragment's param, so the lowering sees one buffer.
size_t packedStorageOwner(uint32_t packed, const std::vector<IValue>& args, size_t i) {
  const void* storage = args[i].toTensor().storage().unsafeGetStorageImpl();
  for (size_t j = 0; j < i; ++j)
    if ((packed >> j & 1u) && args[j].toTensor().storage().unsafeGetStorageImpl() == storage) return j;
  return i;
}

// The fragment key's part for packed operands: each one's storage size,
// where it lies there (the fragment's param is the storage) and which
// operand's storage it shares.
std::string packedKey(uint32_t packed, const std::vector<IValue>& args) {
  std::string k;
  for (size_t i = 0; i < args.size() && i < 32; ++i) {
    if (!(packed >> i & 1u)) continue;
    const at::Tensor& t = args[i].toTensor();
    k += "|P";
    ir::appendInt(k, static_cast<int64_t>(i));
    k += ',';
    ir::appendInt(k, arrayOf(t).numel());
    k += ',';
    ir::appendInt(k, t.storage_offset());
    k += ',';
    ir::appendInt(k, t.stride(2));
    k += ',';
    ir::appendInt(k, static_cast<int64_t>(packedStorageOwner(packed, args, i)));
  }
  return k;
}

bool arrivesPacked(uint32_t packed, const InputSource& is) {
  return is.kind == InputSource::Kind::Tensor && (packed >> is.arg & 1u);
}

std::shared_ptr<const Fragment> buildFragment(const c10::OperatorHandle& op, const std::vector<IValue>& args,
                                              const ops::Lowering* low, bool foreach_expand, const std::string& base,
                                              uint32_t transposed, uint32_t packed) {
  runtime::metrics().fused_lowerings++;
  auto frag = std::make_shared<Fragment>();
  Plan plan = planFor(op, args, low);
  ir::Builder b;
  Sources src;
  std::map<size_t, ir::Value> packed_storage;  // by owning operand (packedStorageOwner)
  src.tensor = [&](const at::Tensor& t, InputSource is) {
    if (arrivesPacked(packed, is)) {
      const runtime::ViewGeometry g = geometryOf(t);
      const size_t owner = packedStorageOwner(packed, args, static_cast<size_t>(is.arg));
      auto it = packed_storage.find(owner);
      if (it == packed_storage.end()) {  // a shared storage is one input of the call
        frag->inputs.push_back(is);
        it = packed_storage.emplace(owner, b.param({ir::DType::F32, {arrayOf(t).numel()}})).first;
      }
      ir::Value storage = it->second;
      ir::Value v = b.reshape(runtime::buildRead(b, storage, b.constantInt(g.offset, ir::DType::I64), g), g.sizes);
      b.noteView(v, ir::StridedView{storage, g.offset, g.strides});
      return v;
    }
    frag->inputs.push_back(is);
    if (t.device().is_cpu()) return b.param({cpuScalarIr(t), {}});
    if (arrivesTransposed(transposed, is))
      return b.transpose(b.param({toIr(t.scalar_type()), {t.size(1), t.size(0)}}), {1, 0});
    return b.param({toIr(t.scalar_type()), t.sizes().vec()});
  };
  paramScalarSources(src, b, frag->inputs);
  ops::MultiOpProgram multi_op;
  Lowered l = lowerOp(op, args, low, foreach_expand, base, plan, b, src);
  for (const auto& [ob, v] : l.bound) {
    b.output(v);
    frag->outputs.push_back(ob);
  }
  if (l.bounds_ok.valid()) {
    b.output(l.bounds_ok);
    frag->bounds_check = true;
  }
  frag->none_returns = l.none_returns;
  frag->num_returns = l.num_returns;
  if (!b.outputs().empty()) frag->fn = b.asFunction();
  return frag;
}

// Fused eager: the op joins the device's pending graph as a call of its
// signature's fragment; results are tensors whose storage is a pending value.
void runFused(const c10::OperatorHandle& op, torch::jit::Stack* stack, std::vector<IValue>& args,
              const ops::Lowering* low, bool foreach_expand, const std::string& base, const std::string& key,
              c10::DeviceIndex dev) {
  auto& fusion = runtime::Fusion::get();
  std::unique_lock<std::recursive_mutex> lock(fusion.mutex());
  const uint32_t transposed = transposedOperands(base, args);
  const uint32_t packed = packedAttentionOperands(base, args);
  std::string frag_key = key + transposedKey(transposed);
  if (packed) frag_key += packedKey(packed, args);
  std::shared_ptr<const Fragment> frag;
  {
    std::lock_guard<std::mutex> g(g_fragment_mu);
    auto it = g_fragments.find(frag_key);
    if (it != g_fragments.end()) frag = it->second;
  }
  // Where a bounds-checked op was issued, for its deferred error (a new
  // signature may turn out checked). It needs the GIL, so the lock is let go
  // meanwhile: the GIL's holder may be waiting for it. Nothing of the graph
  // has been touched yet.
  std::string location;
  if (!frag || frag->bounds_check) {
    lock.unlock();
    location = userLocation();
    lock.lock();
  }
  if (!frag) {
    frag = buildFragment(op, args, low, foreach_expand, base, transposed, packed);
    std::lock_guard<std::mutex> g(g_fragment_mu);
    g_fragments[frag_key] = frag;
  }
  auto& graph = fusion.graph(dev);
  auto& b = graph.builder();
  std::optional<at::Generator> gen;
  auto tensorValue = [&](const at::Tensor& t) -> ir::Value {
    if (t.device().is_cpu()) {
      ir::DType dt = cpuScalarIr(t);
      ir::Value v = graph.scalar(cpuScalarBuffer(t, dt, dev), dt);
      if (g_capture.active) {
        auto it = g_capture.cpu_inputs.find(t.unsafeGetTensorImpl());
        if (it != g_capture.cpu_inputs.end())
          graph.tagLastInput({runtime::InputTag::Kind::CpuInput, it->second});
        else if (!g_capture.cpu_inputs.empty())
          // A CPU value computed inside the graph may derive from a CPU
          // argument; without CPU arguments it is a constant of the graph.
          g_capture.broken = true;
      }
      return v;
    }
    return graph.read(arrayOf(t), geometryOf(t));
  };
  auto scalarValue = [&](const IValue& v, ir::DType st) -> ir::Value {
    if (graph.bakeScalars())
      return st == ir::DType::F64 ? b.constant(v.toDouble(), st)
                                  : b.constantInt(st == ir::DType::Bool ? v.toBool() : v.toInt(), st);
    runtime::BufferPtr buf = st == ir::DType::F64    ? runtime::scalarBuffer(st, v.toDouble(), dev)
                             : st == ir::DType::Bool ? runtime::scalarBufferInt(st, v.toBool(), dev)
                                                     : runtime::scalarBufferInt(st, v.toInt(), dev);
    return graph.scalar(buf, st);
  };
  auto rngValue = [&]() -> ir::Value {
    if (!gen) gen = generatorFor(args, dev);
    std::array<uint64_t, 2> st;
    {
      std::lock_guard<std::mutex> g(gen->mutex());
      st = gen->get<TpuGenerator>()->next();
    }
    ir::Value v =
        graph.input(runtime::Runtime::get().upload(st.data(), ir::DType::U64, {2}, dev), {ir::DType::U64, {2}});
    graph.tagLastInput({runtime::InputTag::Kind::Rng, -1});
    return v;
  };
  std::vector<ir::Value> operands;
  operands.reserve(frag->inputs.size());
  for (const InputSource& is : frag->inputs) {
    switch (is.kind) {
      case InputSource::Kind::Tensor:
      case InputSource::Kind::CpuScalar: {
        const at::Tensor& t = args[is.arg].toTensor();
        if (arrivesPacked(packed, is)) {  // the whole storage
          const int64_t n = arrayOf(t).numel();
          operands.push_back(graph.read(arrayOf(t), runtime::ViewGeometry{ir::DType::F32, {n}, {1}, 0}));
          runtime::metrics().operands_in_place++;
          break;
        }
        ir::Value v = tensorValue(t);
        if (arrivesTransposed(transposed, is))
          v = b.transpose(b.reshape(v, {t.size(0), t.size(1)}), {1, 0});  // the stored matrix
        operands.push_back(v);
        break;
      }
      case InputSource::Kind::ListElem:
        operands.push_back(tensorValue(listElem(args, is.arg, is.elem)));
        break;
      case InputSource::Kind::Scalar:
        operands.push_back(scalarValue(args[is.arg], is.dtype));
        break;
      case InputSource::Kind::ScalarListElem:
        operands.push_back(scalarValue(args[is.arg].toList().get(is.elem), is.dtype));
        break;
      case InputSource::Kind::Rng:
        operands.push_back(rngValue());
        break;
    }
  }
  std::vector<ir::Value> results;
  if (frag->fn) results = b.call(frag->fn, operands);
  std::vector<IValue> returns(frag->num_returns);
  std::vector<c10::List<at::Tensor>> lists(frag->num_returns);
  for (size_t i = 0; i < frag->outputs.size(); ++i) {
    const OutputBinding& ob = frag->outputs[i];
    const ir::Value& v = results[i];
    if (ob.kind == OutputBinding::Kind::WriteArg) {
      at::Tensor t = listElem(args, ob.index, ob.elem);
      if (t.sizes().vec() != ob.sizes) t.resize_(ob.sizes);
      graph.write(arrayOf(t), geometryOf(t), b.reshape(v, ob.sizes));
      continue;
    }
    at::Tensor t = emptyTpu(ob.sizes, ob.dtype, dev);
    if (!ob.perm.empty()) t.unsafeGetTensorImpl()->set_sizes_and_strides(ob.sizes, permutedStrides(ob));
    if (t.numel() > 0) graph.bind(arrayOf(t), v, toIr(ob.dtype), memorySizes(ob));
    if (ob.kind == OutputBinding::Kind::Return)
      returns[ob.index] = IValue(t);
    else
      lists[ob.index].push_back(t);
  }
  for (int r : frag->none_returns) returns[r] = IValue(at::Tensor());
  if (frag->bounds_check) graph.check(results.back(), op.schema().name() + location);
  pushReturns(op, stack, args, returns, lists);
  if (graph.noteOp(key)) graph.materialize();
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

void boxedKernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const std::string& full = schema.name();
  if (full.rfind("aten::", 0) != 0) return cpuFallback(op, stack, "");
  std::string base = full.substr(6);
  if (base.size() > 1 && base.back() == '_' && base.rfind("__", 0) != 0) base.pop_back();
  const ops::Lowering* low = loweringDisabled(base) ? nullptr : ops::findLowering(base, schema.overload_name());
  bool foreach_expand = false;
  if (!low && base.rfind("_foreach_", 0) == 0 && !loweringDisabled(base)) {
    low = ops::findLowering(base.substr(9), "");
    foreach_expand = low != nullptr;
  }
  size_t n = schema.arguments().size();
  if (!low) {
    std::vector<IValue> args(stack->end() - n, stack->end());
    findDevice(op, args);  // mixing devices is an error on the fallback path too
    return cpuFallback(op, stack, "");
  }

  if (base == "index" || base == "index_put" || base == "_index_put_impl" || base == "_unsafe_index" ||
      base == "_unsafe_index_put")
    moveIndicesToDevice(stack, n);
  std::vector<IValue> args(stack->end() - n, stack->end());
  resolveMathBits(schema, args);
  c10::DeviceIndex dev = findDevice(op, args);
  bool complex_ok = complexScalarsAllowed(base);
  for (const auto& v : args) {  // unsupported dtypes go to the CPU
    if (v.isTensor() && v.toTensor().defined() && !supported(v.toTensor().scalar_type()) &&
        !(complex_ok && isComplexNumber(v.toTensor())))
      return cpuFallback(op, stack, std::string("dtype ") + c10::toString(v.toTensor().scalar_type()));
    if (v.isComplexDouble() && !complex_ok) return cpuFallback(op, stack, "complex scalar");
  }

  std::string key = signature(op, args, low);
  if (runtime::Fusion::get().enabled() && !low->data_dependent) {
    try {
      return runFused(op, stack, args, low, foreach_expand, base, key, dev);
    } catch (const ir::Unsupported& e) {
      return cpuFallback(op, stack, e.what());
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      rethrow(e, "torch_tpu: " + describe(op, args));
    }
  }
  if (runtime::Fusion::get().enabled()) runtime::Fusion::get().flush(dev);  // data-dependent: run now
  const uint32_t transposed = transposedOperands(base, args);
  key += transposedKey(transposed);
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> g(g_cache_mu);
    auto it = g_cache.find(key);
    if (it != g_cache.end()) entry = it->second;
  }
  if (!entry) {
    try {
      int64_t compiles_before = runtime::metrics().compiles;
      entry = build(op, args, low, foreach_expand, base, transposed);
      if (runtime::metrics().compiles > compiles_before) runtime::noteCompile(full, explainSignature(full, key));
    } catch (const ir::Unsupported& e) {
      return cpuFallback(op, stack, e.what());
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      rethrow(e, "torch_tpu: " + describe(op, args));
    }
    std::lock_guard<std::mutex> g(g_cache_mu);
    g_cache[key] = entry;
  } else {
    runtime::metrics().cache_hits++;
  }
  try {
    runEntry(*entry, op, stack, args, dev);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e, "torch_tpu: " + describe(op, args));
  }
}

}  // namespace

// ------------------------------------------------------------- captured graphs

struct OutputSpec {
  enum class Kind { None, Result, AliasInput, Constant } kind = Kind::None;
  int index = -1;  // program result or argument
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;
  at::Tensor constant;
};

struct CapturedGraph {
  std::vector<ArgSignature> signature;  // per argument
  runtime::CaptureResult run;
  int device = 0;
  std::vector<int> array_group;                   // per argument: the first argument sharing its storage (-1: CPU/none)
  std::vector<std::pair<int, int>> input_writes;  // (argument, program result)
  // Params of overwritten arguments whose buffers the program may write its
  // results into: the argument's array, replaced by the result, does not
  // stop execute() from donating them.
  std::vector<int> donated;
  std::vector<OutputSpec> outputs;
  int ops = 0;
};

namespace {

// Per argument: the index of the first argument on the same storage.
std::optional<std::vector<int>> arrayGroups(const std::vector<at::Tensor>& inputs, c10::DeviceIndex* dev) {
  std::vector<int> groups(inputs.size(), -1);
  std::unordered_map<const void*, int> first;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (!t.defined()) continue;
    if (t.device().is_cpu()) {
      if (t.numel() != 1) return std::nullopt;
      continue;
    }
    // Any layout: the caller's signature pins sizes, strides and offset, and a
    // replay checks that the storage still has the captured size and dtype.
    if (t.device().type() != kTpu) return std::nullopt;
    if (*dev < 0) *dev = t.device().index();
    if (t.device().index() != *dev) return std::nullopt;
    auto [it, fresh] = first.emplace(t.storage().unsafeGetStorageImpl(), static_cast<int>(i));
    groups[i] = it->second;
  }
  return groups;
}

}  // namespace

bool captureBegin(const std::vector<at::Tensor>& inputs) {
  auto& fusion = runtime::Fusion::get();
  std::lock_guard<std::recursive_mutex> lock(fusion.mutex());
  if (g_capture.active) return false;
  c10::DeviceIndex dev = -1;
  auto groups = arrayGroups(inputs, &dev);
  if (!groups) return false;
  if (dev < 0) dev = currentDevice();
  g_capture = CaptureState{};
  g_capture.was_fused = fusion.beginWholeGraph();
  g_capture.active = true;
  g_capture.device = dev;
  g_capture.groups = *groups;
  for (const at::Tensor& t : inputs) g_capture.signature.push_back(ArgSignature::of(t));
  g_capture.arrays.assign(inputs.size(), nullptr);
  std::unordered_map<const runtime::DeviceArray*, int> arrays;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (!t.defined()) continue;
    if (t.device().is_cpu()) {
      g_capture.cpu_inputs[t.unsafeGetTensorImpl()] = static_cast<int>(i);
    } else {
      g_capture.arrays[i] = &arrayOf(t);
      arrays.emplace(&arrayOf(t), static_cast<int>(i));
    }
  }
  auto& graph = fusion.graph(dev);
  graph.setCaptureInputs(std::move(arrays));
  graph.setBakeScalars(true);
  g_capture.materializations = graph.materializations();
  return true;
}

void captureAbort() {
  auto& fusion = runtime::Fusion::get();
  std::lock_guard<std::recursive_mutex> lock(fusion.mutex());
  if (!g_capture.active) return;
  fusion.graph(g_capture.device).setCaptureInputs({});
  fusion.graph(g_capture.device).setBakeScalars(false);
  g_capture.active = false;
  fusion.endWholeGraph(g_capture.was_fused);
}

std::shared_ptr<CapturedGraph> captureEnd(const std::vector<at::Tensor>& outputs) {
  auto& fusion = runtime::Fusion::get();
  std::lock_guard<std::recursive_mutex> lock(fusion.mutex());
  if (!g_capture.active) return nullptr;
  auto& graph = fusion.graph(g_capture.device);
  auto cg = std::make_shared<CapturedGraph>();
  cg->device = g_capture.device;
  cg->ops = graph.ops();
  bool split = graph.materializations() != g_capture.materializations;
  struct Finish {  // the caller's mode comes back whatever happens
    runtime::Fusion& f;
    runtime::LazyGraph& g;
    ~Finish() {
      g.setCaptureInputs({});
      g.setBakeScalars(false);
      g_capture.active = false;
      f.endWholeGraph(g_capture.was_fused);
    }
  } finish{fusion, graph};
  try {
    graph.materialize(&cg->run);
  } catch (const std::exception& e) {
    rethrow(e, "torch_tpu: compiled graph");
  }
  static const bool debug = std::getenv("TORCH_TPU_DEBUG_CAPTURE") != nullptr;
  if (split || g_capture.broken || !cg->run.prog) {
    if (debug)
      std::fprintf(stderr, "torch_tpu capture: not replayable (split %d, cpu values %d, program %d)\n", split,
                   g_capture.broken, static_cast<bool>(cg->run.prog));
    return nullptr;
  }
  // Arguments the graph wrote, and where each output lives.
  cg->array_group = g_capture.groups;
  cg->signature = g_capture.signature;
  std::unordered_map<const runtime::DeviceArray*, int> result_of, arg_of;
  for (size_t k = 0; k < cg->run.out_owners.size(); ++k) result_of[cg->run.out_owners[k]] = static_cast<int>(k);
  for (size_t i = 0; i < g_capture.arrays.size(); ++i)
    if (g_capture.arrays[i]) arg_of.emplace(g_capture.arrays[i], static_cast<int>(i));
  for (size_t k = 0; k < cg->run.out_owners.size(); ++k) {
    auto it = arg_of.find(cg->run.out_owners[k]);
    if (it != arg_of.end()) cg->input_writes.emplace_back(it->second, static_cast<int>(k));
  }
  for (int p : cg->run.prog->aliased_params) {
    const auto& tag = cg->run.tags[p];
    bool written = std::any_of(cg->input_writes.begin(), cg->input_writes.end(),
                               [&](const auto& w) { return w.first == tag.index; });
    if (tag.kind == runtime::InputTag::Kind::Input && written) cg->donated.push_back(p);
  }
  for (const at::Tensor& t : outputs) {
    OutputSpec o;
    if (t.defined()) {
      if (t.device().type() != kTpu) {
        if (debug)
          std::fprintf(stderr, "torch_tpu capture: not replayable (an output on %s)\n", t.device().str().c_str());
        return nullptr;
      }
      o.sizes = t.sizes().vec();
      o.strides = t.strides().vec();
      o.offset = t.storage_offset();
      o.dtype = t.scalar_type();
      const runtime::DeviceArray* a = &arrayOf(t);
      if (auto r = result_of.find(a); r != result_of.end()) {
        o.kind = OutputSpec::Kind::Result;
        o.index = r->second;
      } else if (auto g = arg_of.find(a); g != arg_of.end()) {
        o.kind = OutputSpec::Kind::AliasInput;
        o.index = g->second;
      } else {
        o.kind = OutputSpec::Kind::Constant;
        o.constant = t;
      }
    }
    cg->outputs.push_back(std::move(o));
  }
  return cg;
}

namespace {
// A tensor on `holder`'s storage with `o`'s dtype and geometry, built
// directly (no dispatch) and not a view of `holder`.
at::Tensor onStorageOf(const at::Tensor& holder, const OutputSpec& o) {
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(holder.storage()), holder.key_set(),
                                                            c10::scalarTypeToTypeMeta(o.dtype));
  out.unsafeGetTensorImpl()->set_sizes_and_strides(o.sizes, o.strides, o.offset);
  return out;
}
}  // namespace

std::optional<std::vector<at::Tensor>> replay(CapturedGraph& g, const std::vector<at::Tensor>& inputs) {
  auto& fusion = runtime::Fusion::get();
  if (inputs.size() != g.signature.size()) return std::nullopt;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (!g.signature[i].matches(inputs[i])) return std::nullopt;
  std::lock_guard<std::recursive_mutex> lock(fusion.mutex());
  c10::DeviceIndex dev = -1;
  auto groups = arrayGroups(inputs, &dev);
  if (!groups || *groups != g.array_group || (dev >= 0 && dev != g.device)) return std::nullopt;
  const auto& prog = *g.run.prog;
  std::vector<runtime::BufferPtr> bufs;
  bufs.reserve(g.run.tags.size());
  for (size_t k = 0; k < g.run.tags.size(); ++k) {
    const auto& tag = g.run.tags[k];
    const ir::Type& want = prog.param_types[k];
    switch (tag.kind) {
      case runtime::InputTag::Kind::Fixed:
        bufs.push_back(g.run.inputs[k]);
        break;
      case runtime::InputTag::Kind::Input: {
        runtime::DeviceArray& a = arrayOf(inputs[tag.index]);
        runtime::flushIfLazy(a);
        if (!a.materialized()) runtime::ensureTyped(a, want.dtype);  // unwritten: zeros
        if (a.dtype() != want.dtype || a.numel() != want.numel()) return std::nullopt;
        bufs.push_back(a.buffer());
        break;
      }
      case runtime::InputTag::Kind::CpuInput:
        bufs.push_back(cpuScalarBuffer(inputs[tag.index], want.dtype, g.device));
        break;
      case runtime::InputTag::Kind::Rng: {
        at::Generator gen = defaultGenerator(g.device);
        std::array<uint64_t, 2> st;
        {
          std::lock_guard<std::mutex> lg(gen.mutex());
          st = gen.get<TpuGenerator>()->next();
        }
        bufs.push_back(runtime::Runtime::get().upload(st.data(), ir::DType::U64, {2}, g.device));
        break;
      }
    }
  }
  std::vector<runtime::BufferPtr> results;
  try {
    results = runtime::execute(prog, bufs, g.device, g.donated);
  } catch (const std::exception& e) {
    rethrow(e, "torch_tpu: compiled graph");
  }
  for (const auto& [arg, k] : g.input_writes) {
    const ir::Type& t = prog.out_types[k];
    arrayOf(inputs[arg]).set(results[k], t.dtype, t.numel());
  }
  size_t n_out = g.run.out_owners.size();
  for (size_t j = 0; j < g.run.checks.size(); ++j)
    runtime::checkIndicesLater(results[n_out + j], g.run.checks[j], g.device);
  std::unordered_map<int, at::Tensor> bases;
  std::vector<at::Tensor> outs;
  outs.reserve(g.outputs.size());
  for (const auto& o : g.outputs) {
    switch (o.kind) {
      case OutputSpec::Kind::None:
        outs.emplace_back();
        break;
      case OutputSpec::Kind::Result: {
        auto it = bases.find(o.index);
        if (it == bases.end()) {
          const ir::Type& t = prog.out_types[o.index];
          it = bases.emplace(o.index, wrapBuffer(results[o.index], {t.numel()}, toAten(t.dtype), g.device)).first;
        }
        // A fresh tensor on the result's storage, not a view of it: autograd
        // refuses in-place updates of a custom Function's view outputs (the
        // Trainer scales the loss with `loss *= n`), and aliasing between
        // outputs is AOTAutograd's to regenerate. Built directly: through
        // the dispatcher (empty + set_) it was a third of a replay's host time.
        outs.push_back(onStorageOf(it->second, o));
        break;
      }
      case OutputSpec::Kind::AliasInput: {
        // AOTAutograd rebuilds a returned alias of an input as a view of the
        // input from this tensor's geometry; as_strided through the
        // dispatcher was a quarter of a forward replay's host time. The
        // version counter is the input's, as a view's would be, so that a
        // tensor saved for backward still sees in-place updates of it.
        const at::Tensor& in = inputs[o.index];
        at::Tensor out = onStorageOf(in, o);
        out.unsafeGetTensorImpl()->set_version_counter(in.unsafeGetTensorImpl()->version_counter());
        outs.push_back(std::move(out));
        break;
      }
      case OutputSpec::Kind::Constant:
        outs.push_back(o.constant);
        break;
    }
  }
  return outs;
}

int capturedOps(const CapturedGraph& g) { return g.ops; }

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
    std::string base = name.name.substr(6);
    if (base.size() > 1 && base.back() == '_' && base.rfind("__", 0) != 0) base.pop_back();
    bool lowered = ops::findLowering(base, name.overload_name) != nullptr;
    if (!lowered && base.rfind("_foreach_", 0) == 0) lowered = ops::findLowering(base.substr(9), "") != nullptr;
    if (!lowered) continue;
    std::string full = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    lib.impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&boxedKernel>());
    ++count;
  }
  return count;
}

size_t kernelCacheSize() {
  std::lock_guard<std::mutex> g(g_cache_mu);
  return g_cache.size();
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&boxedKernel>()); }

}  // namespace tpu::aten
