// The CPU fallback, the dispatcher's route for an op with no tpu program.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <string>

namespace tpu::aten {

// Runs the op on the CPU (inputs copied in, results back), counted and warned
// once per op; raises instead under TORCH_TPU_FALLBACK=error. `why` says why
// it has no tpu program (empty: no lowering at all).
void cpuFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why);

}  // namespace tpu::aten
