// Fused eager (TORCH_TPU_DEFER_AND_FUSE=1): the op joins the device's pending
// graph (fused/engine/fused_graph.h), run as one program when the host needs
// data. Like every mode, it takes a planned op (op_steps/op_plan.h), leaves
// the op's results on its stack and returns nullopt, or returns why the op
// cannot run on tpu: the dispatcher then runs it on the CPU. torch.compile's
// capture (compile/capture.h) records through this mode, reaching its engine
// through op_steps/recording.h.
#pragma once

#include <optional>
#include <string>

#include "op_steps/op_plan.h"

namespace tpu::eager {

std::optional<std::string> runFused(aten::PlannedOp& p);

}  // namespace tpu::eager
