// Checks PyTorch's CPU and CUDA kernels make that its meta kernels skip (the
// dispatcher runs the meta kernels for PyTorch's own checks, op_steps/op_plan.cpp),
// made here with the same exception type and words, in every mode; and the
// value checks of fill_ and random_.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace tpu::aten {

// Which check an op needs (worked out once per op by the dispatcher).
enum class KernelCheck : uint8_t {
  None,
  InPlaceBroadcast,
  BoolResult,
  EluBackward,
  IndexSelect,
  Gather,
  SameDtypeOut,
  BoolAlpha,
  EmptyIndexed,
  ReductionDims,
  DegreesOfFreedom,
  ValuesIndicesOut,
  ScalarRanges,  // histc, uniform_, bernoulli: checks on scalar arguments that are not part of a
                 // program's signature, so a cached program would skip the meta kernel's check
  ConvWeight     // convolution: at least `groups` output (or, transposed, input) channels
};

// Ops with an index into self's dim: a non-empty index into a dim of size 0 raises.
const std::set<std::string>& emptyIndexedOps();
// Unary ops whose TensorIterator keeps one dtype: out= of another dtype raises.
const std::set<std::string>& sameDtypeUnary();

void checkLikeKernels(KernelCheck check, const std::string& base, const std::string& overload,
                      const std::vector<c10::IValue>& args);
// fill_ with a value the tensor's dtype cannot hold raises, as on the CPU.
void checkFillValue(const std::vector<c10::IValue>& args);
// random_(from, to) / random_(to): PyTorch's range checks and precision warnings.
void checkRandomBounds(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args);

}  // namespace tpu::aten
