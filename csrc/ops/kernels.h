// User kernels as ops. A kernel is a StableHLO function (lowered by JAX from a
// JAX or Pallas function, or module text written elsewhere) that joins the
// programs calling it, or an XLA FFI custom call whose handler the plugin
// holds. Each is registered per signature under a key; the ops
// tpu::stablehlo_call and tpu::ffi_call name that key, and their one lowering
// each serves strict eager, fused eager and compiled graphs alike.
// No torch headers here.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ir/ir.h"

namespace tpu::ops {

struct Kernel {
  std::string name;  // the user's name, for messages
  std::vector<ir::Type> params, results;
  std::shared_ptr<const ir::Function> function;  // a StableHLO body, or
  std::string ffi_target;                        // a custom-call target
};

// The StableHLO kernel whose body is `funcs` (one or more private func.func
// definitions, in either MLIR syntax, their names unique to this body) and
// whose entry is the function `entry` with these params and results.
std::shared_ptr<const Kernel> stablehloKernel(std::string name, std::string entry, std::string funcs,
                                              std::vector<ir::Type> params, std::vector<ir::Type> results);
std::shared_ptr<const Kernel> ffiKernel(std::string name, std::string target, std::vector<ir::Type> params,
                                        std::vector<ir::Type> results);

// Registered kernels by key. A key names one signature of one kernel body.
void registerKernel(const std::string& key, std::shared_ptr<const Kernel> k);
void unregisterKernel(const std::string& key);
// Throws std::invalid_argument for a key never registered.
std::shared_ptr<const Kernel> findKernel(const std::string& key);

// Appends the kernel's call to `b`: its results. Throws std::invalid_argument
// when `args` do not match the kernel's params.
std::vector<ir::Value> callKernel(ir::Builder& b, const Kernel& k, const std::vector<ir::Value>& args);

}  // namespace tpu::ops
