// Strict eager, the default mode: the op becomes a one-op program cached per
// signature and launched asynchronously; debug eager is strict with every
// launch waited for (TPU_LAUNCH_BLOCKING=1). Like every mode, it takes a
// planned op (op_steps/op_plan.h), leaves the op's results on its stack and
// returns nullopt, or returns why the op cannot run on tpu (an argument or
// result the lowering does not support): the dispatcher then runs it on the
// CPU.
#pragma once

#include <optional>
#include <string>

#include "op_steps/op_plan.h"

namespace tpu::eager {

std::optional<std::string> runStrict(aten::PlannedOp& p);

// Op signatures strict eager has built programs for (metrics).
size_t strictCacheSize();

}  // namespace tpu::eager
