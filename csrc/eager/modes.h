// The execution modes an op can run in, each behind the same small interface:
// it takes a planned op (signature, arguments, lowering; aten/op_plan.h),
// leaves the op's results on its stack, and returns nullopt, or returns why
// the op cannot run on tpu (an argument or result the lowering does not
// support): the dispatcher then runs it on the CPU.
//
//   strict (strict.cpp)  one-op programs, cached per signature, launched
//                        asynchronously; debug eager is strict with every
//                        launch waited for (TPU_LAUNCH_BLOCKING=1)
//   fused  (fused.cpp)   the op joins the device's pending graph
//                        (runtime/fused_graph.h), run as one program when the
//                        host needs data; torch.compile's capture
//                        (compile/capture.h) records through this mode
#pragma once

#include <optional>
#include <string>

#include "aten/op_plan.h"

namespace tpu::eager {

std::optional<std::string> runStrict(aten::PlannedOp& p);
std::optional<std::string> runFused(aten::PlannedOp& p);

// Op signatures strict eager has built programs for (metrics).
size_t strictCacheSize();

}  // namespace tpu::eager
