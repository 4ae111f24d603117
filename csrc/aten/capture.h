// Captured graphs for torch.compile: the first call of a compiled graph
// records it as one program; later calls with arguments of the same kinds
// run that program again with the new arguments, lowering nothing.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <vector>

namespace tpu::aten {

struct CapturedGraph;

// Starts recording a graph called with `inputs` (undefined tensors allowed).
// Returns false when the arguments cannot be captured (then the graph simply
// runs as a whole-graph fused program each call).
bool captureBegin(const std::vector<at::Tensor>& inputs);
// Ends the recording (runs the graph as one program) and returns what a
// replay needs, or nullptr when the graph cannot be replayed (it read data on
// the host, split into several programs, or ran an op on the CPU).
std::shared_ptr<CapturedGraph> captureEnd(const std::vector<at::Tensor>& outputs);
// Ends a recording after an exception.
void captureAbort();
// Runs a captured graph on new arguments; nullopt when they do not fit it
// (another dtype, device, size, stride, storage offset or aliasing): the
// caller records again.
std::optional<std::vector<at::Tensor>> replay(CapturedGraph& g, const std::vector<at::Tensor>& inputs);
// How many programs the graph's recording compiled, and its op count.
int capturedOps(const CapturedGraph& g);

}  // namespace tpu::aten
