// Registration of user kernels (ops/kernels.h) from Python: torch_tpu.kernels.
#pragma once

#include <string>
#include <vector>

#include "ir/ir.h"

namespace tpu::aten {

// `dtype` as PyTorch names it without "torch." ("float32"); throws TypeError.
ir::Type kernelType(const std::string& dtype, const std::vector<int64_t>& shape);
// Each compiles the kernel once; a rejection raises RuntimeError naming it.
void registerStablehloKernel(const std::string& key, const std::string& name, const std::string& entry,
                             const std::string& funcs, std::vector<ir::Type> params, std::vector<ir::Type> results);
void registerFfiKernel(const std::string& key, const std::string& name, const std::string& target,
                       std::vector<ir::Type> params, std::vector<ir::Type> results);
// Loads `library` and registers its handler `symbol` with the plugin as
// custom-call `target` for `platform` ("Host", "CUDA").
void registerFfiHandler(const std::string& target, const std::string& platform, const std::string& library,
                        const std::string& symbol);

}  // namespace tpu::aten
