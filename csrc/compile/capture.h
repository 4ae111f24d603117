// torch.compile(backend="tpu"): the first call of a compiled graph records it
// through fused eager (whole-graph, scalars baked in) as one program; later
// calls with arguments of the same kinds replay that program with the new
// arguments, lowering nothing. The Dynamo backend (torch_tpu/_compile.py)
// drives these calls.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <vector>

namespace tpu::runtime {
class LazyGraph;
}

namespace tpu::compile {

struct CapturedGraph;

// Starts recording a graph called with `inputs` (undefined tensors allowed).
// Returns false when the arguments cannot be captured (then the graph simply
// runs as a whole-graph fused program each call). With `all_inputs`, the
// recording is replayable only if it reads no device tensor but `inputs`
// (the caller names every tensor that can change between calls: the vLLM
// runner's step); otherwise other tensors read are taken as constants.
bool captureBegin(const std::vector<at::Tensor>& inputs, bool all_inputs = false);
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
// How many ops the graph's recording held.
int capturedOps(const CapturedGraph& g);

// What the modes tell a recording in progress (no-ops when none is):
// an op ran on the CPU, so the recording cannot be replayed;
void noteCpuFallback();
// fused eager made the CPU scalar tensor `t` the graph's last input: it is
// tagged as the argument it is, or the recording cannot be replayed.
// Called under the fusion lock.
void noteCpuScalarInput(runtime::LazyGraph& graph, const at::Tensor& t);

}  // namespace tpu::compile
