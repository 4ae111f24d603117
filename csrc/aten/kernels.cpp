// The PyTorch side of user kernels (ops/kernels.h): the ops tpu::stablehlo_call
// and tpu::ffi_call, their meta kernels (result types from the registry), and
// registration, which compiles each kernel once on its own so that a body the
// plugin rejects fails where it is registered, naming the kernel, instead of
// inside some later program. Their tpu kernel is the boxed dispatcher's, as
// for every lowered op.
#include "aten/kernels.h"

#include <dlfcn.h>
#include <torch/library.h>

#include "aten/tpu.h"
#include "ops/kernels.h"
#include "pjrt/xla_ffi.h"

namespace tpu::aten {
namespace {

std::vector<at::Tensor> metaCall(at::TensorList args, c10::string_view kernel) {
  std::shared_ptr<const ops::Kernel> k;
  try {
    k = ops::findKernel(std::string(kernel));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  std::vector<at::Tensor> out;
  for (const auto& t : k->results)
    out.push_back(at::empty(t.shape, at::TensorOptions().device(c10::kMeta).dtype(toAten(t.dtype))));
  return out;
}

// The kernel compiled alone: params, the call, its results.
void compileAlone(const ops::Kernel& k) {
  ir::Builder b;
  std::vector<ir::Value> args;
  for (const auto& t : k.params) args.push_back(b.param(t));
  for (const auto& v : ops::callKernel(b, k, args)) b.output(v);
  runtime::Runtime::get().compile(b, "kernel " + k.name);
}

void registerChecked(const std::string& key, std::shared_ptr<const ops::Kernel> k, const char* what) {
  ops::registerKernel(key, k);
  try {
    compileAlone(*k);
  } catch (const std::exception& e) {
    ops::unregisterKernel(key);
    TORCH_CHECK(false, "torch_tpu kernel '", k->name, "': the plugin rejected its ", what, ": ", e.what());
  }
}

// The XLA FFI API version of the headers a handler was built against, asked
// as XLA asks: a call frame carrying the metadata extension.
std::pair<int, int> handlerApiVersion(void* handler) {
  struct {
    xla_ffi::FfiMetadata m;
    uint64_t newer_fields[8];  // later headers write more (state_type_id)
  } meta{};
  meta.m.struct_size = sizeof(xla_ffi::FfiMetadata);
  meta.m.api_version.struct_size = sizeof(xla_ffi::FfiApiVersion);
  xla_ffi::FfiMetadataExtension ext{{sizeof(xla_ffi::FfiMetadataExtension), xla_ffi::kFfiExtensionMetadata, nullptr},
                                    &meta.m};
  xla_ffi::FfiCallFrame frame{};
  frame.struct_size = xla_ffi::kFfiCallFrameSize;
  frame.extension_start = &ext.base;
  if (reinterpret_cast<void* (*)(xla_ffi::FfiCallFrame*)>(handler)(&frame) != nullptr) return {-1, -1};
  return {meta.m.api_version.major_version, meta.m.api_version.minor_version};
}

}  // namespace

ir::Type kernelType(const std::string& dtype, const std::vector<int64_t>& shape) {
  for (int d = 0; d <= static_cast<int>(ir::DType::U64); ++d)
    if (dtype == ir::dtypeName(static_cast<ir::DType>(d))) return ir::Type{static_cast<ir::DType>(d), shape};
  TORCH_CHECK_TYPE(false, "torch_tpu kernels: the device holds no dtype ", dtype);
}

void registerStablehloKernel(const std::string& key, const std::string& name, const std::string& entry,
                             const std::string& funcs, std::vector<ir::Type> params, std::vector<ir::Type> results) {
  registerChecked(key, ops::stablehloKernel(name, entry, funcs, std::move(params), std::move(results)), "StableHLO");
}

void registerFfiKernel(const std::string& key, const std::string& name, const std::string& target,
                       std::vector<ir::Type> params, std::vector<ir::Type> results) {
  registerChecked(key, ops::ffiKernel(name, target, std::move(params), std::move(results)), "custom call");
}

void registerFfiHandler(const std::string& target, const std::string& platform, const std::string& library,
                        const std::string& symbol) {
  // Loaded for the life of the process: the plugin keeps the handler.
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib, "torch_tpu: cannot load the FFI kernel library ", library, ": ", dlerror());
  void* handler = dlsym(lib, symbol.c_str());
  TORCH_CHECK(handler, "torch_tpu: the library ", library, " has no symbol ", symbol,
              " (export the handler with XLA_FFI_DEFINE_HANDLER_SYMBOL)");
  auto& rt = runtime::Runtime::get();
  const int plugin_minor = rt.plugin().ffiApiMinor();
  if (plugin_minor >= 0) {
    auto [major, minor] = handlerApiVersion(handler);
    TORCH_CHECK(major == 0 && minor <= plugin_minor, "torch_tpu: the FFI handler ", symbol, " in ", library,
                " was built against XLA FFI API ", major, ".", minor, " headers; this plugin runs handlers of API 0.",
                plugin_minor, " or older. Build it against torch_tpu.kernels.ffi_include_dir().");
  }
  try {
    rt.client().api()->registerFfiHandler(target, platform, handler);
  } catch (const std::exception& e) {
    rethrow(e, "");
  }
}

}  // namespace tpu::aten

TORCH_LIBRARY(tpu, m) {
  m.def("stablehlo_call(Tensor[] args, str kernel) -> Tensor[]");
  m.def("ffi_call(Tensor[] args, str kernel) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(tpu, Meta, m) {
  m.impl("stablehlo_call", &tpu::aten::metaCall);
  m.impl("ffi_call", &tpu::aten::metaCall);
}
