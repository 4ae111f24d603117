// torch.compile(backend="tpu"): the first call of a compiled graph records it
// through fused eager's engine (whole-graph, scalars baked in; reached through
// op_steps/recording.h) as one program; later
// calls with arguments of the same kinds replay that program with the new
// arguments, lowering nothing. The Dynamo backend (torch_tpu/_compile.py)
// drives these calls.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <optional>
#include <vector>

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

// Whether this thread is recording a graph (its functional collectives can
// join the program: distributed/in_program.cpp).
bool capturingHere();
// The recording holds collectives of a group with this timeout: replays meet
// the other ranks within it before each launch.
void noteProgramTimeout(std::chrono::milliseconds timeout);
// The channel of the next collective this thread records: 1, 2, ... from the
// start of each recording (the same on every rank for the same step).
int64_t nextProgramCollective();
// Whether a collective whose program replicas are `world` (global device ids)
// can join this thread's recording: the first one sets the recording's world,
// a collective of another world stays a call.
bool joinProgramWorld(const std::vector<int>& world);

// Something ran outside the recording on this thread (the dispatcher ran an op
// on the CPU, a collective ran as a call between programs): a recording in
// progress cannot be replayed, since a replay would reuse that result (a no-op
// when none is).
void noteUnreplayable();

}  // namespace tpu::compile
