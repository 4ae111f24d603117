// torch_tpu._C: the Python-facing entry points of the C++ core.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include "aten/kernels.h"
#include "aten/tpu.h"
#include "compile/capture.h"
#include "dispatch/fallback.h"
#include "distributed/tpu_dist.h"
#include "fused/engine/fused_graph.h"
#include "ops/kernel_slots.h"
#include "ops/lowering.h"
#include "runtime/collectives.h"
#include "runtime/env.h"
#include "strict/strict.h"

namespace tpu::aten {
int registerLoweredKernels();
// dispatcher.cpp: rows of (every overload?, op base name or overload, tensor dtypes, exception type, message).
void setDtypeRefusals(
    const std::vector<std::tuple<bool, std::string, std::vector<std::string>, std::string, std::string>>&);
// dispatcher.cpp: the ops (base names) that refuse overlapping writes.
void setOverlapChecks(std::vector<std::string> internal, std::vector<std::string> partial, std::vector<std::string> any,
                      std::vector<std::string> source);
}  // namespace tpu::aten

namespace {

using namespace tpu;

runtime::Runtime& rt() {
  try {
    return runtime::Runtime::get();
  } catch (const std::exception& e) {
    aten::rethrow(e, "torch_tpu could not start its runtime");
  }
}

// Counters into `d`, in the order given.
using Counter = std::pair<const char*, const std::atomic<int64_t>*>;
void putCounters(py::dict& d, std::initializer_list<Counter> counters) {
  for (const auto& [name, counter] : counters) d[name] = counter->load();
}

py::dict metricsDict() {
  auto& m = runtime::metrics();
  py::dict d;
  putCounters(d, {{"compiles", &m.compiles},
                  {"cache_hits", &m.cache_hits},
                  {"cache_misses", &m.cache_misses},
                  {"executions", &m.executions},
                  {"donated_buffers", &m.donated_buffers},
                  {"constant_reuses", &m.constant_reuses}});
  d["live_buffers"] = pjrt::Buffer::live();
  putCounters(d, {{"h2d_bytes", &m.h2d_bytes},
                  {"d2h_bytes", &m.d2h_bytes},
                  {"h2d_transfers", &m.h2d_transfers},
                  {"d2h_transfers", &m.d2h_transfers}});
  d["compile_seconds"] = m.compile_ns.load() / 1e9;
  py::dict fb, cb;
  {
    std::lock_guard<std::mutex> g(m.mu);
    for (const auto& [k, v] : m.fallbacks) fb[py::str(k)] = v;
    for (const auto& [k, v] : m.compiles_by_op) cb[py::str(k)] = v;
  }
  d["fallbacks"] = fb;
  d["compiles_by_op"] = cb;
  d["kernel_signatures"] = eager::strictCacheSize();
  putCounters(d, {{"fused_lowerings", &m.fused_lowerings},
                  {"operands_in_place", &m.operands_in_place},
                  {"dist_collectives", &m.dist_collectives},
                  {"dist_staged_bytes", &m.dist_staged_bytes},
                  {"dist_xla_collectives", &m.dist_xla_collectives},
                  {"dist_xla_bytes", &m.dist_xla_bytes},
                  {"replicated_programs", &m.replicated_programs},
                  {"collectives_in_programs", &m.collectives_in_programs},
                  {"disk_hits", &m.disk_hits},
                  {"same_text_hits", &m.same_text_hits},
                  {"programs_unloaded", &m.programs_unloaded},
                  {"programs_reloaded", &m.programs_reloaded}});
  d["recompile_reasons"] = runtime::recentCompileReasons();
  if (runtime::Runtime::initialized()) {
    auto& dc = runtime::Runtime::get().diskCache();
    py::dict disk;
    disk["dir"] = dc.dir();
    const auto& st = dc.stats();
    putCounters(disk, {{"hits", &st.hits},
                       {"misses", &st.misses},
                       {"writes", &st.writes},
                       {"corrupt", &st.corrupt},
                       {"evicted", &st.evicted}});
    d["disk_cache"] = disk;
  }
  return d;
}

}  // namespace

// A captured graph as Python holds it (the graph type stays opaque here).
struct CapturedHandle {
  std::shared_ptr<compile::CapturedGraph> g;
};

// The module's table of entry points, one binding each: long by nature, and
// each binding is a line or a few.
PYBIND11_MODULE(_C, m) {
  m.def("_set_search_dirs", [](std::vector<std::string> dirs) { runtime::Runtime::setSearchDirs(std::move(dirs)); });
  m.def("_init", []() { rt(); });
  m.def("_initialized", []() { return runtime::Runtime::initialized(); });
  m.def("_device_count", []() {
    try {
      return runtime::Runtime::get().deviceCount();
    } catch (...) {
      return 0;
    }
  });
  m.def("_init_error", []() -> std::string {
    try {
      runtime::Runtime::get();
      return "";
    } catch (const std::exception& e) {
      return e.what();
    }
  });
  m.def("_dlpack_note", [](const at::Tensor& t) { aten::noteExported(t); });
  m.def("_dlpack_adopt", [](const at::Tensor& t) { return aten::adoptExported(t); });
  m.def("_platform", []() { return rt().client().platformName(); });
  m.def("_platform_version", []() { return rt().client().platformVersion(); });
  m.def("_plugin_path", []() { return rt().pluginPath(); });
  m.def("_plugin_support", []() { return std::string(rt().plugin().name()); });
  m.def("_plugin_kernels", []() { return rt().plugin().kernels(); });
  m.def("_host_malloc_tuned", []() { return rt().plugin().mallocTuned(); });
  m.def("_compile_option_overrides", []() { return rt().optionOverrides(); });
  m.def("_core_spinner_threads", []() { return rt().plugin().spinnerThreads(); });
  m.def("_device_kind", [](int d) {
    aten::checkDeviceIndex(d);
    return rt().client().devices().at(d).kind;
  });
  m.def("_current_device", []() { return static_cast<int>(aten::currentDevice()); });
  m.def("_set_device", [](int d) {
    aten::checkDeviceIndex(d);
    c10::impl::getDeviceGuardImpl(aten::kTpu)->setDevice(c10::Device(aten::kTpu, d));
  });
  m.def("_synchronize", [](int d) {
    aten::checkDeviceIndex(d);
    py::gil_scoped_release nogil;
    c10::impl::getDeviceGuardImpl(aten::kTpu)->synchronizeDevice(d);
  });
  m.def("_memory_allocated", [](int d) {
    aten::checkDeviceIndex(d);
    return rt().allocated(d);
  });
  m.def("_max_memory_allocated", [](int d) {
    aten::checkDeviceIndex(d);
    return rt().peak(d);
  });
  m.def("_reset_peak_memory_stats", [](int d) {
    aten::checkDeviceIndex(d);
    rt().resetPeak(d);
  });
  m.def("_memory_limit", [](int d) {
    aten::checkDeviceIndex(d);
    return rt().memoryLimit(d);
  });
  m.def("_program_stats", []() {
    // (what, compile seconds, launches, last launch as Unix ns) per distinct program.
    py::list out;
    if (!runtime::Runtime::initialized()) return out;
    for (const auto& p : rt().programStats())
      out.append(py::make_tuple(p.what, p.compile_seconds, p.runs, p.last_run_unix_ns));
    return out;
  });
  m.def("_default_generator", [](int d) {
    aten::checkDeviceIndex(d);
    return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(aten::defaultGenerator(d)));
  });
  m.def("_set_launch_blocking", [](bool on) { runtime::setLaunchBlocking(on); });
  m.def("_launch_blocking", []() { return runtime::launchBlocking(); });
  m.def("_set_fused", [](bool on) { runtime::Fusion::get().setEnabled(on); });
  py::class_<CapturedHandle>(m, "_CapturedGraph").def_property_readonly("ops", [](const CapturedHandle& h) {
    return compile::capturedOps(*h.g);
  });
  m.def(
      "_capture_begin",
      [](const std::vector<std::optional<at::Tensor>>& inputs, bool all_inputs) {
        std::vector<at::Tensor> ts;
        for (const auto& t : inputs) ts.push_back(t ? *t : at::Tensor());
        return compile::captureBegin(ts, all_inputs);
      },
      py::arg("inputs"), py::arg("all_inputs") = false);
  m.def("_capture_end", [](const std::vector<std::optional<at::Tensor>>& outputs) {
    std::vector<at::Tensor> ts;
    for (const auto& t : outputs) ts.push_back(t ? *t : at::Tensor());
    auto g = compile::captureEnd(ts);
    return g ? py::cast(CapturedHandle{std::move(g)}) : py::none();
  });
  m.def("_capture_abort", [] { compile::captureAbort(); });
  // One backward through the device's autograd thread, on tensors that have
  // no Python objects: its release never needs the GIL (see _shutdown.py).
  m.def("_drain_autograd_device", [](int d) {
    aten::checkDeviceIndex(d);
    py::gil_scoped_release nogil;
    const auto opts = at::TensorOptions().device(aten::kTpu, static_cast<c10::DeviceIndex>(d));
    at::Tensor leaf = at::empty({}, opts).requires_grad_(true);
    const torch::autograd::variable_list outputs{leaf.view(at::IntArrayRef{})}, inputs{leaf},
        seeds{at::empty({}, opts)};
    torch::autograd::grad(outputs, inputs, seeds, /*retain_graph=*/false, /*create_graph=*/false,
                          /*allow_unused=*/true);
  });
  m.def("_replay", [](CapturedHandle& h, const std::vector<std::optional<at::Tensor>>& inputs) {
    compile::CapturedGraph& g = *h.g;
    std::vector<at::Tensor> ts;
    for (const auto& t : inputs) ts.push_back(t ? *t : at::Tensor());
    py::object res = py::none();
    std::optional<std::vector<at::Tensor>> outs;
    {
      py::gil_scoped_release nogil;
      outs = compile::replay(g, ts);
    }
    if (!outs) return res;
    py::list l;
    for (auto& t : *outs) l.append(t.defined() ? py::cast(t) : py::none());
    return py::object(l);
  });
  // A thread that holds the GIL lets it go while it waits for the fusion mutex:
  // the holder may need the GIL (a Python meta kernel) to finish.
  auto releasing_gil = [](const std::function<void()>& block) {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release release;
      block();
    } else {
      block();
    }
  };
  runtime::FusionMutex::setWaitHook(releasing_gil);
  runtime::setBlockingWait(releasing_gil);
  m.def("_begin_whole_graph", [] { return runtime::Fusion::get().beginWholeGraph(); });
  m.def("_end_whole_graph", [](bool was_enabled) {
    try {
      runtime::Fusion::get().endWholeGraph(was_enabled);
    } catch (const std::exception& e) {
      aten::rethrow(e, "torch_tpu compiled graph");
    }
  });
  m.def("_fused", []() { return runtime::Fusion::get().enabled(); });
  m.def("_flush", [](int d) {
    py::gil_scoped_release nogil;
    runtime::Fusion::get().flush(d);
  });
  m.def("_set_fallback_error", [](bool on) { aten::setFallbackError(on); });
  m.def("_set_disabled_lowerings",
        [](std::vector<std::string> names) { aten::setDisabledLowerings(std::move(names)); });
  m.def("_disabled_lowerings", [] { return aten::disabledLowerings(); });
  m.def("_fallback_is_error", []() { return aten::fallbackIsError(); });
  // The CPU fallback for a Python kernel's case it has no tpu program for (a
  // library op registered from Python): counted, warned and refused like any
  // other fallback. Returns the op's results as the op itself would.
  m.def("_cpu_fallback", [](const std::string& name, const std::string& overload, const std::string& why, py::args args,
                            const py::kwargs& kwargs) {
    torch::PyWarningHandler warnings;  // its warning reaches Python's warnings (as an op's does)
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    torch::jit::Stack stack = torch::jit::createStackForSchema(op.schema(), args, kwargs, std::nullopt);
    {
      py::gil_scoped_release no_gil;
      aten::cpuFallback(op, &stack, why);
    }
    return torch::jit::createPyObjectForStack(std::move(stack));
  });
  // User kernels (torch_tpu.kernels): types as (dtype name, shape) pairs.
  using TypeList = std::vector<std::pair<std::string, std::vector<int64_t>>>;
  auto irTypes = [](const TypeList& ts) {
    std::vector<ir::Type> out;
    for (const auto& [d, s] : ts) out.push_back(aten::kernelType(d, s));
    return out;
  };
  m.def("_register_stablehlo_kernel",
        [irTypes](const std::string& key, const std::string& name, const std::string& entry, const std::string& funcs,
                  const TypeList& params, const TypeList& results) {
          rt();
          py::gil_scoped_release no_gil;  // the compile may take a while
          aten::registerStablehloKernel(key, name, entry, funcs, irTypes(params), irTypes(results));
        });
  m.def("_register_ffi_kernel", [irTypes](const std::string& key, const std::string& name, const std::string& target,
                                          const TypeList& params, const TypeList& results) {
    rt();
    py::gil_scoped_release no_gil;
    aten::registerFfiKernel(key, name, target, irTypes(params), irTypes(results));
  });
  m.def("_register_ffi_handler", [](const std::string& target, const std::string& platform, const std::string& library,
                                    const std::string& symbol) {
    rt();
    aten::registerFfiHandler(target, platform, library, symbol);
  });
  m.def("_plugin_attributes", []() { return rt().client().api()->attributes(); });
  m.def("_metrics", &metricsDict);
  m.def("_metrics_report", []() { return runtime::metrics().report(); });
  m.def("_reset_metrics", []() { runtime::metrics().reset(); });
  m.def("_lowered_ops", []() { return ops::loweredOps(); });
  // Whether the plugin lowers attention (and layer norm, softmax), or matrix
  // products, through kernels of its own (ops/kernel_slots.h).
  m.def("_host_kernels", []() {
    rt();  // the plugin's support installs its slots when the runtime starts
    return ops::kernelSlots().fills(ops::KernelSlot::Attention);
  });
  m.def("_host_gemm", []() {
    rt();
    return ops::kernelSlots().fills(ops::KernelSlot::Matmul);
  });
  // The environment registry (runtime/env.h): name, type, default, scope, meaning.
  m.def("_env_vars", []() {
    py::list l;
    for (const auto& v : env::all()) l.append(py::make_tuple(v.name, v.type, v.dflt, v.scope, v.meaning));
    return l;
  });
  m.def("_register_lowered_kernels", &aten::registerLoweredKernels);
  m.def("_set_dtype_refusals", &aten::setDtypeRefusals,
        "The (op, tensor dtypes) PyTorch's CPU and CUDA kernels refuse: tpu raises the same.");
  m.def("_set_overlap_checks", &aten::setOverlapChecks,
        "The ops that refuse to write through internally or partly overlapping memory, as PyTorch's do.");
  distributed::registerPython(m);
  distributed::registerXlaTransport(m);
  distributed::registerProcessSpan(m);
}
