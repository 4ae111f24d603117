// The dispatcher: the boxed kernel every tpu op without a kernel of its own
// enters. It finds the op's lowering, prepares its arguments (indices on the
// device, lazy conj/neg bits resolved, one device), and hands the planned op
// to the mode in force: fused eager (fused/fused.h) when it is on and the op's
// result sizes do not depend on data, else strict eager (strict/strict.h). An
// op with no lowering, or one its lowering cannot take, runs on the CPU
// (fallback.cpp). This layer sits above the modes; the steps they share are
// below them (op_steps/).
//
// Every op pays for what is decided here, so what depends on the op alone (its
// lowering, its refusal rows, its overlap checks, which of its arguments it
// writes) is worked out once per op and thread (OpFacts, on first sight) and
// found again by one hash lookup keyed by the op; what depends on the
// arguments costs a pass over them and a few hash lookups, never a walk over a
// table. tpu::_dispatch_stats() counts both (tests/python/test_dispatch_cost.py
// holds them) and, when turned on, the host time per op the dispatcher and
// each mode add (benchmarks/host_cost.py).
#include <ATen/Dispatch_v2.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/native/DistributionTemplates.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "dispatch/fallback.h"
#include "dispatch/kernel_checks.h"
#include "fused/engine/fused_graph.h"
#include "fused/fused.h"
#include "op_steps/op_plan.h"
#include "strict/strict.h"

namespace tpu::aten {
namespace {

// Counters of the dispatcher's own work, for the calling thread
// (tpu::_dispatch_stats). Plain thread-local adds: no atomics on the op path.
struct DispatchStats {
  int64_t ops = 0;  // ops the dispatcher received (those it runs itself too)
  int64_t facts_lookups = 0, facts_built = 0;
  int64_t table_reads = 0;     // reads of the tables below and the lowering registry (buildFacts' only)
  int64_t refusal_probes = 0;  // hash lookups into an op's refusal rows
  int64_t strict_ops = 0, fused_ops = 0, fallback_ops = 0;
  // Host nanoseconds, counted only while timing is on (steady_clock reads):
  int64_t dispatch_ns = 0;              // entry to the mode (or to the fallback)
  int64_t strict_ns = 0, fused_ns = 0;  // in the mode, its launches included
  int64_t fallback_ns = 0;
};
thread_local DispatchStats t_stats;
thread_local int t_depth = 0;
std::atomic<bool> g_timing{false};

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
  ++t_stats.table_reads;
  return ops.count(base) > 0;
}

// Calls f on the tensors of one argument, inside lists too.
template <typename F>
void forEachTensorIn(const IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) f(t);
  } else if (v.isList()) {
    for (const IValue& e : v.toList())
      if (e.isTensor()) f(e.toTensor());
  }
}

// Calls f on every tensor argument, inside lists too.
template <typename F>
void forEachTensor(const std::vector<IValue>& args, F&& f) {
  for (const auto& v : args) forEachTensorIn(v, f);
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

std::vector<int> asSet(std::vector<int> dtypes) {
  std::sort(dtypes.begin(), dtypes.end());
  dtypes.erase(std::unique(dtypes.begin(), dtypes.end()), dtypes.end());
  return dtypes;
}

// A set of dtypes as two bit masks (tensors' ScalarTypes, dtype arguments'):
// a call's set is built without allocating and found by one hash lookup.
static_assert(static_cast<int>(c10::ScalarType::NumOptions) <= 64, "ScalarType codes must fit a 64-bit mask");
struct DtypeSet {
  uint64_t tensors = 0, arguments = 0;
  void add(int code) {
    if (code >= kDtypeArgument)
      arguments |= uint64_t{1} << (code - kDtypeArgument);
    else
      tensors |= uint64_t{1} << code;
  }
  bool empty() const { return tensors == 0 && arguments == 0; }
  bool operator==(const DtypeSet& o) const { return tensors == o.tensors && arguments == o.arguments; }
};
struct DtypeSetHash {
  size_t operator()(const DtypeSet& s) const noexcept {
    return std::hash<uint64_t>{}(s.tensors * 0x9E3779B97F4A7C15ull ^ s.arguments);
  }
};

// A dtype sequence's hash (schema order).
template <typename Seq>
uint64_t sequenceHash(const Seq& codes) {
  uint64_t h = 1469598103934665603ull;
  for (int c : codes) h = (h ^ static_cast<uint64_t>(c)) * 1099511628211ull;
  return h;
}

// One op's (or overload's) rows, indexed: a call's dtypes find the first row
// that refuses them in a few hash lookups, however many rows the op has.
struct RefusalRows {
  std::vector<Refusal> rows;
  std::unordered_map<DtypeSet, size_t, DtypeSetHash> by_set;   // every row by its dtypes as a set: the first row
  std::unordered_map<uint64_t, std::vector<size_t>> by_order;  // an overload's rows by sequenceHash, in order
  bool add(Refusal r, bool whole_op) {
    DtypeSet set;
    for (int d : r.dtypes) {
      const int code = d >= kDtypeArgument ? d - kDtypeArgument : d;
      if (code < 0 || code >= 64) return false;  // no ScalarType: nothing could match it
      set.add(d);
    }
    const size_t i = rows.size();
    by_set.emplace(set, i);  // emplace keeps the first row's index
    if (!whole_op) by_order[sequenceHash(r.dtypes)].push_back(i);
    rows.push_back(std::move(r));
    return true;
  }
};

struct Refusals {
  std::unordered_map<c10::OperatorName, RefusalRows> overloads;
  std::unordered_map<std::string, RefusalRows> ops;  // by base name: every overload
};

Refusals& refusals() {
  static Refusals table;
  ++t_stats.table_reads;
  return table;
}

void raise(const Refusal& r) {
  TORCH_CHECK_NOT_IMPLEMENTED(!r.not_implemented, r.message);
  TORCH_CHECK(false, r.message);
}

// Ops whose PyTorch kernels refuse to write through memory that overlaps
// itself (x.expand(2, 3).add_(1)) or partly overlaps an input
// (x[1:].add_(x[:-1])): torch_tpu/_overlap_checks.json, by base name
// (tools/overlap_checks.py). tpu writes through views its own way and would
// give some answer instead.
struct OverlapChecks {
  // `any`: kernels that call assert_no_overlap on every input (cat(out=) one
  // of its inputs): the same memory is refused too. `source`: on every input
  // but self (x.index_copy_(0, i, x) is refused, index_copy(x, .., out=x) is
  // not).
  std::set<std::string> internal, partial, any, source;
};

OverlapChecks& overlapChecks() {
  static OverlapChecks checks;
  ++t_stats.table_reads;
  return checks;
}

// ---------------------------------------------------------------- per-op facts

// What the dispatcher needs to know about an op that does not depend on its
// arguments, worked out on first sight (buildFacts) from the tables above and
// the lowering registry. The tables change only when torch_tpu hands them over
// (import), when lowerings are turned off or on, and when an op's schema is
// removed (its OperatorHandle's address may be reused): each bumps
// the tables' generation (opTablesChanged, aten/tpu.h), and every thread's
// cache starts again.
struct OpFacts {
  bool ours = false;                   // aten:: or tpu:: (others' ops have no lowering here)
  std::string base;                    // "add" for aten::add_.Tensor
  std::string overload;                // "Tensor" for aten::add_.Tensor
  const ops::Lowering* low = nullptr;  // null: none, or turned off
  bool foreach_expand = false;
  bool complex_ok = false;        // complexScalarsAllowed
  bool moves_indices = false;     // index, index_put, ...: CPU indices and masks are moved first
  bool fill_value_check = false;  // fill_.Scalar and its relatives: the value must fit the dtype
  bool random_bounds = false;     // random_.from / random_.to: PyTorch's range checks and warnings
  // Checks PyTorch's CPU and CUDA kernels make and its meta kernels do not (checkLikeKernels).
  KernelCheck kernel_check = KernelCheck::None;
  bool fill_range = false;  // aten::fill_.Scalar and aten::zero_: the strict-only range shortcut
  bool zero = false;        // aten::zero_
  bool arange = false;      // aten::arange.start_out / .out: the strict-only host upload
  bool overlap_internal = false, overlap_partial = false, overlap_any = false, overlap_source = false;
  std::vector<char> writes;            // per schema argument: the op writes it
  std::vector<char> dtype_arg;         // per schema argument: a ScalarType (dtype=) argument
  const RefusalRows* exact = nullptr;  // this overload's refusal rows, if any
  const RefusalRows* whole = nullptr;  // the base op's, if any
};

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
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
  ++t_stats.table_reads;
  if (loweringDisabled(base)) return nullptr;
  if (const ops::Lowering* low = ops::findLowering(base, overload)) return low;
  if (base.rfind("_foreach_", 0) != 0) return nullptr;
  const ops::Lowering* low = ops::findLowering(base.substr(9), "");
  foreach_expand = low != nullptr;
  return low;
}

std::shared_ptr<const OpFacts> buildFacts(const c10::OperatorHandle& op) {
  auto f = std::make_shared<OpFacts>();
  const auto& schema = op.schema();
  const std::string& name = schema.name();
  const std::string& overload = schema.overload_name();
  f->ours = name.rfind("aten::", 0) == 0 || name.rfind("tpu::", 0) == 0;
  f->base = baseName(name);
  f->overload = overload;
  const std::string& base = f->base;
  if (f->ours) f->low = loweringFor(base, overload, f->foreach_expand);
  f->complex_ok = complexScalarsAllowed(base);
  f->moves_indices = base == "index" || base == "index_put" || base == "_index_put_impl" || base == "_unsafe_index" ||
                     base == "_unsafe_index_put";
  f->fill_value_check = base == "fill" && overload == "Scalar";
  f->random_bounds = base == "random" && (overload == "from" || overload == "to");
  {
    using K = KernelCheck;
    // Not elementwise: their other tensors are not broadcast against self.
    static const std::set<std::string> products = {"addmm",      "addmv",       "addbmm",         "baddbmm",
                                                   "addr",       "put",         "index_put",      "masked_scatter",
                                                   "scatter",    "scatter_add", "scatter_reduce", "index_add",
                                                   "index_copy", "index_fill",  "index_reduce"};
    const bool in_place = !name.empty() && name.back() == '_' && !schema.arguments().empty() &&
                          schema.arguments()[0].alias_info() && schema.arguments()[0].alias_info()->isWrite();
    if ((base == "all" || base == "any") && overload.find("out") != std::string::npos)
      f->kernel_check = K::BoolResult;
    else if (base == "elu_backward")
      f->kernel_check = K::EluBackward;
    else if (base == "index_select")
      f->kernel_check = K::IndexSelect;
    else if (base == "gather")
      f->kernel_check = K::Gather;
    else if (emptyIndexedOps().count(base) || base == "index_add")
      f->kernel_check = K::EmptyIndexed;
    else if (base == "nansum" || base == "argmax" || base == "argmin" || base == "max" || base == "min")
      f->kernel_check = K::ReductionDims;
    else if (base == "var" || base == "std" || base == "var_mean" || base == "std_mean")
      f->kernel_check = K::DegreesOfFreedom;
    else if ((overload.find("values") != std::string::npos || overload.find("out") != std::string::npos) &&
             (base == "mode" || base == "sort" || base == "kthvalue" || base == "cummax" || base == "cummin" ||
              base == "median" || base == "nanmedian"))
      f->kernel_check = K::ValuesIndicesOut;
    else if (base == "histc" || base == "uniform" || base == "bernoulli")
      f->kernel_check = K::ScalarRanges;
    else if (base == "convolution" || base == "convolution_overrideable")
      f->kernel_check = K::ConvWeight;
    else if (overload.find("out") != std::string::npos && sameDtypeUnary().count(base))
      f->kernel_check = K::SameDtypeOut;
    else if (in_place && overlapChecks().internal.count(base) && !products.count(base))
      f->kernel_check = K::InPlaceBroadcast;  // TensorIterator's in-place ops (they check internal overlap)
    else if (base == "add" || base == "sub")
      f->kernel_check = K::BoolAlpha;
  }
  f->zero = name == "aten::zero_";
  f->fill_range = f->zero || (name == "aten::fill_" && overload == "Scalar");
  f->arange = name == "aten::arange" && (overload == "start_out" || overload == "out");
  const OverlapChecks& checks = overlapChecks();
  f->overlap_internal = checks.internal.count(base) > 0;
  f->overlap_partial = checks.partial.count(base) > 0;
  f->overlap_any = checks.any.count(base) > 0;
  f->overlap_source = checks.source.count(base) > 0;
  for (const auto& a : schema.arguments()) {
    f->writes.push_back(a.alias_info() && a.alias_info()->isWrite());
    f->dtype_arg.push_back(baseType(a.real_type())->kind() == c10::TypeKind::ScalarTypeType);
  }
  const Refusals& table = refusals();
  if (auto it = table.overloads.find(op.operator_name()); it != table.overloads.end()) f->exact = &it->second;
  if (auto it = table.ops.find(base); it != table.ops.end()) f->whole = &it->second;
  return f;
}

// The op's facts: one hash lookup by the op's address in this thread's cache.
// Held by a shared pointer: a table handed over by another thread while this
// op runs starts the cache again, and the facts stay valid until the op ends.
std::shared_ptr<const OpFacts> factsOf(const c10::OperatorHandle& op) {
  struct Cache {
    uint64_t generation = 0;
    std::unordered_map<const void*, std::shared_ptr<const OpFacts>> by_op;
  };
  thread_local Cache cache;
  const uint64_t generation = opTablesGeneration();
  if (cache.generation != generation) {
    cache.by_op.clear();
    cache.generation = generation;
  }
  ++t_stats.facts_lookups;
  const void* key = &op.operator_name();
  if (auto it = cache.by_op.find(key); it != cache.by_op.end()) return it->second;
  ++t_stats.facts_built;
  return cache.by_op.emplace(key, buildFacts(op)).first->second;
}

// An op's schema removed: its handle's address may come back as another op's.
struct SchemaRemovals final : c10::OpRegistrationListener {
  void onOperatorRegistered(const c10::OperatorHandle&) override {}
  void onOperatorDeregistered(const c10::OperatorHandle&) override { opTablesChanged(); }
};
[[maybe_unused]] const bool kListening = [] {
  // Never destroyed: at exit the dispatcher may be gone first.
  new c10::RegistrationHandleRAII(
      c10::Dispatcher::singleton().addRegistrationListener(std::make_unique<SchemaRemovals>()));
  return true;
}();

size_t firstRow(const RefusalRows& rows, const DtypeSet& key) {
  ++t_stats.refusal_probes;
  auto it = rows.by_set.find(key);
  return it == rows.by_set.end() ? SIZE_MAX : it->second;
}

template <typename Seq>
size_t firstRowInOrder(const RefusalRows& rows, const Seq& codes) {
  ++t_stats.refusal_probes;
  auto it = rows.by_order.find(sequenceHash(codes));
  if (it == rows.by_order.end()) return SIZE_MAX;
  for (size_t i : it->second)  // the rows whose sequences hash alike: almost always one
    if (std::equal(codes.begin(), codes.end(), rows.rows[i].dtypes.begin(), rows.rows[i].dtypes.end())) return i;
  return SIZE_MAX;
}

void refuseLikeCpu(const OpFacts& f, const std::vector<IValue>& args) {
  if (!f.exact && !f.whole) return;
  // The tensors' dtypes and dtype arguments, in schema order (as the table's writer lists them),
  // and as sets; `unwrapped` leaves out Python numbers made tensors (torch.floor_divide(t, 2)):
  // the kernel computes them in the other operands' dtype.
  c10::SmallVector<int, 16> dtypes;
  DtypeSet all, unwrapped;
  bool wrapped = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const IValue& v = args[i];
    if (v.isInt() && i < f.dtype_arg.size() && f.dtype_arg[i]) {
      const int code = static_cast<int>(v.toInt()) + kDtypeArgument;
      dtypes.push_back(code);
      all.add(code);
      unwrapped.add(code);
    } else {
      forEachTensorIn(v, [&](const at::Tensor& t) {
        if (!t.defined()) return;
        const int code = static_cast<int>(t.scalar_type());
        dtypes.push_back(code);
        all.add(code);
        if (t.unsafeGetTensorImpl()->is_wrapped_number())
          wrapped = true;
        else
          unwrapped.add(code);
      });
    }
  }
  // The first row (in the table's order) whose dtypes are the call's as a set,
  // or without its Python numbers; an overload's rows also by schema order.
  const auto first = [&](const RefusalRows& rows, bool by_order) {
    size_t i = firstRow(rows, all);
    if (wrapped && !unwrapped.empty()) i = std::min(i, firstRow(rows, unwrapped));
    if (by_order) i = std::min(i, firstRowInOrder(rows, dtypes));
    return i;
  };
  if (f.exact)
    if (size_t i = first(*f.exact, true); i != SIZE_MAX) raise(f.exact->rows[i]);
  if (f.whole)
    if (size_t i = first(*f.whole, false); i != SIZE_MAX) raise(f.whole->rows[i]);
}

void checkOverlaps(const OpFacts& f, const std::vector<IValue>& args) {
  if (!f.overlap_internal && !f.overlap_partial && !f.overlap_any && !f.overlap_source) return;
  for (size_t i = 0; i < args.size() && i < f.writes.size(); ++i) {
    if (!f.writes[i] || !args[i].isTensor()) continue;
    const at::Tensor& written = args[i].toTensor();
    if (f.overlap_internal) at::assert_no_internal_overlap(written);
    if (!f.overlap_partial && !f.overlap_any && !f.overlap_source) continue;
    auto check = [&](const at::Tensor& other, bool any) {
      if (!other.defined()) return;
      if (any)
        at::assert_no_overlap(written, other);
      else
        at::assert_no_partial_overlap(written, other);
    };
    for (size_t j = 0; j < args.size(); ++j) {
      if (j == i) continue;
      if (args[j].isTensor()) check(args[j].toTensor(), f.overlap_any || (f.overlap_source && j != 0));
      if (f.overlap_any && args[j].isTensorList())
        for (const at::Tensor& t : args[j].toTensorList()) check(t, true);
    }
  }
}

// Written tensors (out=, an in-place self) are on the op's device: a 0-d CPU
// tensor may join as an input scalar, never as the result (CUDA's rule).
void checkWrittenOnDevice(const OpFacts& f, const c10::OperatorHandle& op, const std::vector<IValue>& args,
                          c10::DeviceIndex dev) {
  for (size_t i = 0; i < args.size() && i < f.writes.size(); ++i) {
    if (!f.writes[i] || !args[i].isTensor() || !args[i].toTensor().defined()) continue;
    const c10::Device d = args[i].toTensor().device();
    TORCH_CHECK(d.type() == kTpu, "Expected all tensors to be on the same device, but found at least two devices, ",
                c10::Device(kTpu, dev), " and ", d, "! (when checking arguments for ", op.schema().name(), ")");
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
void moveIndicesToDevice(torch::jit::Stack* stack, size_t n, bool puts) {
  IValue& self = (*stack)[stack->size() - n];
  IValue& idx = (*stack)[stack->size() - n + 1];
  if (!self.isTensor() || !idx.isList()) return;
  const at::Tensor& st = self.toTensor();
  c10::Device dev = st.device();
  auto lst = idx.toList();
  // `x[mask] = v` with one value and a mask of x's leading dims is a select (the
  // lowering's): no size read back from the device, so a compiled graph stays
  // one program (DTensor masks a sharded embedding's input so).
  if (puts && lst.size() == 1 && lst.get(0).isTensor()) {
    const at::Tensor mask = lst.get(0).toTensor();
    const IValue& values = (*stack)[stack->size() - n + 2];
    const IValue& accumulate = (*stack)[stack->size() - n + 3];
    if (mask.defined() && mask.scalar_type() == at::kBool && mask.dim() <= st.dim() &&
        mask.sizes().equals(st.sizes().slice(0, mask.dim())) && values.isTensor() && values.toTensor().numel() == 1 &&
        values.toTensor().dim() == 0 && accumulate.isBool() && !accumulate.toBool()) {
      if (mask.device().is_cpu()) {
        c10::List<std::optional<at::Tensor>> moved;
        moved.push_back(mask.to(dev));
        idx = IValue(moved);
      }
      return;
    }
  }
  bool changed = false;
  c10::List<std::optional<at::Tensor>> out;
  int64_t pos = 0;  // the indexed tensor's dim the next index starts at
  for (const IValue& e : lst) {
    if (!e.isTensor() || !e.toTensor().defined()) {
      out.push_back(std::nullopt);
      ++pos;
      continue;
    }
    at::Tensor t = e.toTensor();
    if (t.device().is_cpu()) {
      t = t.to(dev);
      changed = true;
    }
    if (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte) {
      if (t.scalar_type() == at::kByte)
        TORCH_WARN("indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead.");
      // A mask covers as many dims as it has, each of the indexed tensor's size.
      for (int64_t j = 0; j < t.dim(); ++j)
        TORCH_CHECK_INDEX(pos + j < st.dim() && t.size(j) == st.size(pos + j), "The shape of the mask ", t.sizes(),
                          " at index ", j, " does not match the shape of the indexed tensor ", st.sizes(), " at index ",
                          pos + j);
      pos += t.dim();
      at::Tensor nz = at::nonzero(t);
      for (int64_t j = 0; j < t.dim(); ++j) out.push_back(nz.select(1, j));
      changed = true;
    } else {
      out.push_back(t);
      ++pos;
    }
  }
  if (changed) idx = IValue(out);
}

// PyTorch lets some ops (copies, matrix products) see tensors with a lazy
// conj/neg bit; lowerings read raw memory, so read-only arguments with a bit
// are materialized first (copyInto applies the bit on the device).
void resolveMathBits(const OpFacts& f, std::vector<IValue>& args) {
  auto resolve = [](const at::Tensor& t) {
    at::Tensor r = emptyTpu(t.sizes(), t.scalar_type(), t.device().index());
    copyInto(r, t);
    return r;
  };
  auto has_bit = [](const at::Tensor& t) {
    return t.defined() && t.device().type() == kTpu && (t.is_conj() || t.is_neg());
  };
  for (size_t i = 0; i < args.size() && i < f.writes.size(); ++i) {
    if (f.writes[i]) continue;
    if (args[i].isTensor()) {
      if (has_bit(args[i].toTensor())) args[i] = resolve(args[i].toTensor());
    } else if (args[i].isTensorList()) {
      bool any = false;
      for (const at::Tensor& t : args[i].toTensorList()) any |= has_bit(t);
      if (!any) continue;
      c10::List<at::Tensor> list;  // a new list: the caller's stays as it was
      for (const at::Tensor& t : args[i].toTensorList()) list.push_back(has_bit(t) ? resolve(t) : t);
      args[i] = IValue(list);
    }
  }
}

// Why the op's arguments keep it off tpu (dtypes the device cannot hold,
// complex scalars its lowering would drop); empty when nothing does.
std::string unsupportedArguments(const OpFacts& f, const std::vector<IValue>& args) {
  for (const auto& v : args) {
    if (v.isTensor() && v.toTensor().defined() && !supported(v.toTensor().scalar_type()) &&
        !(f.complex_ok && isComplexNumber(v.toTensor())))
      return std::string("dtype ") + c10::toString(v.toTensor().scalar_type());
    if (v.isComplexDouble() && !f.complex_ok) return "complex scalar";
  }
  return "";
}

// An integer Scalar's 64 bits: uint64 values past int64's range keep their bits
// (deterministic mode fills new uint64 memory with the uint64 maximum).
int64_t integerBits(const at::Scalar& v) {
  if (v.isBoolean()) return v.toBool();
  if (v.isUnsigned()) return static_cast<int64_t>(v.toUInt64());
  return v.toLong();
}

// x[a:b].fill_(v) or .zero_() where the view is one contiguous run of a
// larger tensor: the range and the value are the program's arguments, so
// every length shares one program per tensor size (serving fills the padded
// tail of a per-step buffer, a new length each step; the op's own program
// is per view shape). False when the op takes the general path.
bool fillContiguousRange(const OpFacts& f, torch::jit::Stack* stack, const std::vector<IValue>& args) {
  if (!f.fill_range) return false;
  const at::Tensor& self = args[0].toTensor();
  if (self.is_complex() || self.numel() == 0 || !self.is_contiguous() || self.is_neg() || self.is_conj()) return false;
  runtime::DeviceArray& a = arrayOf(self);
  const ir::DType t = toIr(self.scalar_type());
  if (static_cast<int64_t>(a.nbytes() / ir::itemSize(t)) <= self.numel()) return false;  // the whole tensor
  const at::Scalar v = f.zero ? at::Scalar(0) : args[1].toScalar();
  if (v.isComplex()) return false;
  const int dev = self.device().index();
  runtime::BufferPtr value =
      ir::isFloat(t) ? runtime::scalarBuffer(t, v.toDouble(), dev) : runtime::scalarBufferInt(t, integerBits(v), dev);
  runtime::fillRange(a, t, self.storage_offset(), self.storage_offset() + self.numel(), value);
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, self);
  return true;
}

// Whole small tensors whose values the host knows: fill_(v) or zero_() of a
// whole tensor, and arange into one (strict eager). Their bytes are uploaded
// and no program runs; a program for them is compiled per shape and dtype
// (an arange's per start, end and step too): 9 of the GPT's 65 cold-start
// compiles were fills (AdamW's zeros_like states, the backward's seed) and one
// its position ids' arange, each 10-70 ms of compiling on this machine and
// more on an accelerator, while an upload of at most kMaxBytes costs
// microseconds. As strict eager keeps a fill program's results, the uploaded
// buffers are kept and handed to a later request for the same values once
// nobody holds them (then no transfer at all); a holder cannot write a kept
// buffer in place, since execute() donates only buffers nobody else holds.
// Kept buffers are found by what they hold: the kind, device, dtype, length
// and the values' bits, with whether each value is a double (1 and the
// double whose bits are 1 are different values).
struct KeptUploads {
  static constexpr int64_t kMaxBytes = 256 * 1024, kBudget = 16 * 1024 * 1024;
  using Key = std::array<int64_t, 6>;  // kind, device, dtype, numel, value bits (a fill's; an arange's start, step)
  std::mutex mu;
  std::map<Key, runtime::BufferPtr> kept;
  int64_t bytes = 0;
};

int64_t scalarBits(const at::Scalar& v) {
  if (!v.isFloatingPoint()) return integerBits(v);
  const double d = v.toDouble();
  int64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  return bits;
}

// `self` holds its whole storage, contiguous, at most kMaxBytes: what an upload can replace.
bool wholeSmall(const at::Tensor& self) {
  if (self.is_complex() || self.numel() == 0 || !self.is_contiguous() || self.is_neg() || self.is_conj() ||
      self.storage_offset() != 0)
    return false;
  const int64_t bytes = self.numel() * static_cast<int64_t>(self.element_size());
  return bytes <= KeptUploads::kMaxBytes && static_cast<int64_t>(arrayOf(self).nbytes()) == bytes;
}

// Writes the bytes `key` names into `self` (wholeSmall): a kept buffer nobody
// holds, else `host`'s bytes uploaded (and kept, within the budget).
template <typename MakeHost>
void writeKept(const at::Tensor& self, const KeptUploads::Key& key, MakeHost&& host) {
  static KeptUploads* kept = new KeptUploads;  // never destroyed: buffers must not outlive the plugin's client
  runtime::BufferPtr buffer;
  {
    std::lock_guard<std::mutex> g(kept->mu);
    auto it = kept->kept.find(key);
    if (it != kept->kept.end() && it->second.use_count() == 1) buffer = it->second;
  }
  if (buffer) {
    runtime::metrics().constant_reuses++;
  } else {
    const at::Tensor h = host();
    buffer =
        runtime::Runtime::get().upload(h.data_ptr(), toIr(self.scalar_type()), {self.numel()}, self.device().index());
    const int64_t bytes = self.numel() * static_cast<int64_t>(self.element_size());
    std::lock_guard<std::mutex> g(kept->mu);
    if (!kept->kept.count(key) && kept->bytes + bytes <= KeptUploads::kBudget) {
      kept->kept.emplace(key, buffer);
      kept->bytes += bytes;
    }
  }
  writeTensor(self, buffer);
}

bool fillWhole(const OpFacts& f, torch::jit::Stack* stack, const std::vector<IValue>& args) {
  if (!f.fill_range) return false;
  const at::Tensor& self = args[0].toTensor();
  if (!wholeSmall(self)) return false;
  const at::Scalar v = f.zero ? at::Scalar(0) : args[1].toScalar();
  if (v.isComplex()) return false;
  const KeptUploads::Key key{v.isFloatingPoint() ? 1 : 0,
                             self.device().index(),
                             static_cast<int64_t>(self.scalar_type()),
                             self.numel(),
                             scalarBits(v),
                             0};
  writeKept(self, key, [&] { return at::full({self.numel()}, v, at::TensorOptions().dtype(self.scalar_type())); });
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, self);
  return true;
}

// Fused eager: a whole small fill of a tensor that holds nothing yet (a
// fresh zeros_like, the backward's seed) is an upload too, so the pending
// graph reads it as an input, as it reads that tensor in later steps. AdamW
// makes its states with zeros_like in its first step: as constants of the
// graph, the first update was a program of its own and the second step
// compiled the update again. A tensor with contents (grad.zero_()) or a
// pending value keeps the fill in the graph, a constant XLA folds; so does a
// whole graph being recorded (torch.compile's capture computes its own fills).
bool fillWholeDeferred(const OpFacts& f, torch::jit::Stack* stack, const std::vector<IValue>& args,
                       runtime::Fusion& fusion) {
  if (!f.fill_range || fusion.wholeGraph() || args[0].toTensor().numel() == 0) return false;
  std::unique_lock<runtime::FusionMutex> lock(fusion.mutex());
  const runtime::DeviceArray& a = arrayOf(args[0].toTensor());
  if (a.lazy() || a.materialized()) return false;
  return fillWhole(f, stack, args);
}

// arange.start_out(start, end, step, *, out) or arange.out(end, *, out) of
// at most kMaxBytes, strict eager: PyTorch's CPU kernel computes it (its
// checks, length and values) and the bytes are uploaded into a whole out,
// kept like a fill's, or copied into an out that is a view. Longer ones take
// the program's path.
bool arangeWhole(const OpFacts& f, torch::jit::Stack* stack, const std::vector<IValue>& args) {
  if (!f.arange) return false;
  const size_t n = args.size();
  if (n != 2 && n != 4) return false;
  const bool has_start = n == 4;
  const at::Tensor& out = args[n - 1].toTensor();
  const at::Scalar start = has_start ? args[0].toScalar() : at::Scalar(int64_t{0});
  const at::Scalar end = args[has_start ? 1 : 0].toScalar();
  const at::Scalar step = has_start ? args[2].toScalar() : at::Scalar(int64_t{1});
  if (start.isComplex() || end.isComplex() || step.isComplex() || out.is_complex() || out.is_neg() || out.is_conj())
    return false;
  const double len = std::ceil((end.toDouble() - start.toDouble()) / step.toDouble());
  if (std::isfinite(len) && len * static_cast<double>(out.element_size()) > KeptUploads::kMaxBytes) return false;
  at::Tensor host = at::empty({0}, at::TensorOptions().dtype(out.scalar_type()));
  at::arange_out(host, start, end, step);  // raises as the CPU does (step 0, a bound the step never reaches)
  if (out.sizes() != host.sizes()) out.resize_(host.sizes());  // as the program's path does
  if (host.numel() > 0) {
    if (wholeSmall(out)) {
      const KeptUploads::Key key{2 + (start.isFloatingPoint() ? 1 : 0) + (step.isFloatingPoint() ? 2 : 0),
                                 out.device().index(),
                                 static_cast<int64_t>(out.scalar_type()),
                                 out.numel(),
                                 scalarBits(start),
                                 scalarBits(step)};
      writeKept(out, key, [&] { return host; });
    } else {
      copyInto(out, host);
    }
  }
  torch::jit::drop(*stack, args.size());
  torch::jit::push(*stack, out);
  return true;
}

// Where an op's host time goes (DispatchStats): the dispatcher's own work up
// to the mode, then the mode (or the CPU fallback). Only an op entered from
// outside the dispatcher is timed; ops it runs itself are part of its time.
class OpTimer {
 public:
  enum class Route { Dispatch, Strict, Fused, Fallback };
  OpTimer() : outer_(t_depth++ == 0) {
    ++t_stats.ops;
    timing_ = outer_ && g_timing.load(std::memory_order_relaxed);
    if (timing_) mark_ = nowNs();
  }
  ~OpTimer() {
    --t_depth;
    if (timing_) close(nowNs());
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;
  void enter(Route r) {
    ++(r == Route::Strict ? t_stats.strict_ops : r == Route::Fused ? t_stats.fused_ops : t_stats.fallback_ops);
    if (timing_) close(nowNs());
    route_ = r;
  }

 private:
  void close(int64_t now) {
    int64_t& slot = route_ == Route::Dispatch ? t_stats.dispatch_ns
                    : route_ == Route::Strict ? t_stats.strict_ns
                    : route_ == Route::Fused  ? t_stats.fused_ns
                                              : t_stats.fallback_ns;
    slot += now - mark_;
    mark_ = now;
  }
  bool outer_, timing_ = false;
  Route route_ = Route::Dispatch;
  int64_t mark_ = 0;
};
using Route = OpTimer::Route;

void boxedKernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  OpTimer timer;
  const std::shared_ptr<const OpFacts> facts = factsOf(op);
  const OpFacts& f = *facts;
  if (!f.ours) {  // others' ops have no lowering here
    timer.enter(Route::Fallback);
    return cpuFallback(op, stack, "");
  }
  const size_t n = f.writes.size();
  // Before the CPU fallback too: its copies of the arguments no longer overlap.
  if (f.overlap_internal || f.overlap_partial || f.overlap_any || f.overlap_source)
    checkOverlaps(f, std::vector<IValue>(stack->end() - n, stack->end()));
  if (!f.low) {
    const std::vector<IValue> args(stack->end() - n, stack->end());
    checkWrittenOnDevice(f, op, args, findDevice(op, args));  // mixing devices is an error here too
    timer.enter(Route::Fallback);
    return cpuFallback(op, stack, "");
  }
  if (f.moves_indices) moveIndicesToDevice(stack, n, f.base == "index_put" || f.base == "_index_put_impl");
  PlannedOp p{op, stack, std::vector<IValue>(stack->end() - n, stack->end())};
  refuseLikeCpu(f, p.args);
  resolveMathBits(f, p.args);
  p.device = findDevice(op, p.args);
  checkWrittenOnDevice(f, op, p.args, p.device);
  if (std::string why = unsupportedArguments(f, p.args); !why.empty()) {
    timer.enter(Route::Fallback);
    return cpuFallback(op, stack, why);
  }
  p.low = f.low;
  p.foreach_expand = f.foreach_expand;
  p.base = f.base;
  p.key = signature(op, p.args, f.low);
  if (f.fill_value_check) checkFillValue(p.args);
  if (f.random_bounds) checkRandomBounds(op, p.args);
  if (f.kernel_check != KernelCheck::None) checkLikeKernels(f.kernel_check, f.base, f.overload, p.args);
  auto& fusion = runtime::Fusion::get();
  // The mode: fused eager when it is on, unless the op's result sizes depend
  // on data (then what is pending runs first, and the op runs strict).
  const bool deferring = fusion.enabled(p.device);
  const bool fused = deferring && !f.low->data_dependent;
  timer.enter(fused ? Route::Fused : Route::Strict);
  if (!deferring ? fillWhole(f, stack, p.args) || fillContiguousRange(f, stack, p.args) || arangeWhole(f, stack, p.args)
                 : fillWholeDeferred(f, stack, p.args, fusion))
    return;
  if (deferring && !fused) fusion.flush(p.device);
  std::optional<std::string> why;
  try {
    why = fused ? eager::runFused(p) : eager::runStrict(p);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e, "torch_tpu: " + describe(op, p.args));
  }
  if (why) {
    timer.enter(Route::Fallback);
    cpuFallback(op, stack, *why);
  }
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
  const std::shared_ptr<const OpFacts> facts = factsOf(op);
  const size_t n = facts->writes.size();
  refuseLikeCpu(*facts, std::vector<IValue>(stack->end() - n, stack->end()));
  // The ops the composite calls are dispatched from the top again, autograd included.
  op.callBoxedForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd, *stack);
}

// The same for an op whose explicit composite (pixel_shuffle's math kernel,
// while the CPU's own kernel has no uint16 code) runs below autograd: at the
// backend key only, autograd keeps PyTorch's formula.
template <c10::DispatchKey Composite>
void explicitCompositeRefusalGuard(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const std::shared_ptr<const OpFacts> facts = factsOf(op);
  const size_t n = facts->writes.size();
  refuseLikeCpu(*facts, std::vector<IValue>(stack->end() - n, stack->end()));
  op.callBoxedForDispatchKey(Composite, *stack);
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
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::AutogradPrivateUse1) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1))
      continue;
    std::string full = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    using DK = c10::DispatchKey;
    if (op->hasKernelForDispatchKey(DK::CompositeImplicitAutograd)) {
      autograd.impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&compositeRefusalGuard>());
      backend.impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&compositeRefusalGuard>());
    } else if (op->hasKernelForDispatchKey(DK::CompositeExplicitAutogradNonFunctional)) {
      backend.impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<
                                     &explicitCompositeRefusalGuard<DK::CompositeExplicitAutogradNonFunctional>>());
    } else if (op->hasKernelForDispatchKey(DK::CompositeExplicitAutograd)) {
      backend.impl(
          full.c_str(),
          torch::CppFunction::makeFromBoxedFunction<&explicitCompositeRefusalGuard<DK::CompositeExplicitAutograd>>());
    } else {
      continue;
    }
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
        table.ops[name].add(std::move(as_tensors), true);
      }
      table.ops[name].add(std::move(r), true);
    } else {
      const auto dot = name.find('.');
      c10::OperatorName op(name.substr(0, dot), dot == std::string::npos ? "" : name.substr(dot + 1));
      table.overloads[op].add(std::move(r), false);
    }
  }
  refusals() = std::move(table);
  opTablesChanged();
  guardCompositeRefusals();
}

void setOverlapChecks(std::vector<std::string> internal, std::vector<std::string> partial, std::vector<std::string> any,
                      std::vector<std::string> source) {
  overlapChecks() = {{internal.begin(), internal.end()},
                     {partial.begin(), partial.end()},
                     {any.begin(), any.end()},
                     {source.begin(), source.end()}};
  opTablesChanged();
}

// tpu::_dispatch_stats(): the calling thread's DispatchStats, in the order of
// tpu::_dispatch_stat_names(); tpu::_dispatch_timing(on): turns the host-time
// counters on or off (off by default: three clock reads per op), returns the
// previous setting. benchmarks/host_cost.py and tests/python/test_dispatch_cost.py read them.
TORCH_LIBRARY_FRAGMENT(tpu, m) {
  m.def("_dispatch_stat_names() -> str[]", [] {
    return std::vector<std::string>{"ops",        "facts_lookups", "facts_built",  "table_reads", "refusal_probes",
                                    "strict_ops", "fused_ops",     "fallback_ops", "dispatch_ns", "strict_ns",
                                    "fused_ns",   "fallback_ns"};
  });
  m.def("_dispatch_stats() -> int[]", [] {
    const DispatchStats& s = t_stats;
    return std::vector<int64_t>{s.ops,        s.facts_lookups, s.facts_built,  s.table_reads, s.refusal_probes,
                                s.strict_ops, s.fused_ops,     s.fallback_ops, s.dispatch_ns, s.strict_ns,
                                s.fused_ns,   s.fallback_ns};
  });
  m.def("_dispatch_timing(bool on) -> bool", [](bool on) { return g_timing.exchange(on); });
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&boxedKernel>()); }

}  // namespace tpu::aten
