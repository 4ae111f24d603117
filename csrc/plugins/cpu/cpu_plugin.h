// What the CPU PJRT plugin adds to the portable core (runtime/plugin.h), all
// in this folder: host kernels for attention, layer norm, softmax and float32
// products registered as XLA FFI custom calls (host_kernels.h), the GEMM on
// the host BLAS that torch bundles (host_blas.cpp), core spinners that keep
// the cores awake while programs run (core_spinner.h), malloc tuning, reading
// results in place from host memory, and the vector width XLA:CPU compiles
// for, registered for the platform "cpu" in cpu_plugin.cpp. docs/cpu_plugin.md
// gives each one's measurement; each has a switch in the environment registry
// (runtime/env.cpp). No torch headers here.
#pragma once

#include <memory>

#include "ops/kernel_slots.h"

namespace tpu::plugins::cpu {

// Its kernel slots (kernel_slots.cpp): attention, layer norm and softmax,
// and float32 products when `gemm` (the GEMM kernel is registered).
std::unique_ptr<ops::KernelSlots> makeKernelSlots(bool gemm);

// Finds MKL's sgemm in the torch library already loaded in the process and
// hands it to the GEMM kernel; false when there is none (no torch in the
// process, or a torch without MKL).
bool useTorchBlas();

}  // namespace tpu::plugins::cpu
