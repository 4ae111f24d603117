// The CPU fallback, never silent: an op with no tpu program runs on the CPU
// (its tpu inputs copied in, its results copied back), counted in metrics()
// and warned once per op; TORCH_TPU_FALLBACK=error raises instead.
#include "dispatch/fallback.h"

#include <ATen/native/CPUFallback.h>

#include <mutex>
#include <set>

#include "aten/tpu.h"
#include "compile/capture.h"

namespace tpu::aten {

using c10::IValue;

namespace {
std::mutex g_warn_mu;
std::set<std::string> g_warned;
}  // namespace

void cpuFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why) {
  compile::noteUnreplayable();
  const std::string name =
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
  // LAPACK's general eigensolver (MKL's sgebal) crashes the process on NaN or
  // infinite input (on the CPU too): refuse it instead.
  if (schema.name() == "aten::linalg_eig" || schema.name() == "aten::_linalg_eigvals") {
    const IValue& a = args[0];
    TORCH_CHECK(!a.isTensor() || at::isfinite(a.toTensor()).all().item<bool>(), "torch_tpu: ", name,
                ": the input has NaN or infinite values; the CPU kernel it falls back to (LAPACK geev) crashes on "
                "them");
  }
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

}  // namespace tpu::aten
