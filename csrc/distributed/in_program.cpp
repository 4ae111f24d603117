// Collectives inside compiled programs.
//
// A compiled step (torch.compile(backend="tpu")) over DTensor, FSDP2 or
// compiled DDP calls PyTorch's functional collectives (_c10d_functional::*).
// While a thread records such a graph (compile/capture.h) over a group whose
// ranks are threads of this process, each driving a device (local_group), the
// collective becomes an op of the program (tpu::replica_*, lowered in
// ops/collectives.cpp): the step is one program per rank, its collectives run
// by XLA among the ranks' replicas, and no host round trip splits it. Before
// recording one, the ranks meet (runtime::arriveTogether): a rank that does not
// come, or comes with another collective, is an error on all of them. In fused
// eager (no recording) the collective joins the device's pending graph the same
// way, and the ranks meet where that graph launches (Recorder::pendingCollective).
// Everywhere else (strict eager, groups of processes, reductions or splits XLA
// cannot do inside a program) the call goes to PyTorch's own kernel, which
// calls the group's backend as before.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "compile/capture.h"
#include "distributed/tpu_dist.h"
#include "op_steps/recording.h"
#include "runtime/collectives.h"
#include "runtime/env.h"

namespace tpu::distributed {
namespace {

using torch::jit::Stack;

// The group a functional collective names (by name, or the group itself).
c10::intrusive_ptr<c10d::ProcessGroup> groupOf(const c10::IValue& v) {
  if (v.isString()) return c10d::resolve_process_group(std::string(v.toStringRef()));
  return v.toCustomClass<c10d::ProcessGroup>();
}

// The group's tpu backend, or none. getBackend throws where the group has none (torch 2.11's
// ProcessGroup has no hasBackendForDeviceType to ask first).
c10::intrusive_ptr<c10d::Backend> tpuBackendOf(c10d::ProcessGroup& pg) {
  try {
    return pg.getBackend(c10::DeviceType::PrivateUse1);
  } catch (const c10::Error&) {
    return {};
  }
}

// The group, when this collective can join the program being recorded.
std::optional<InProgramGroup> recordable(const at::Tensor& t, const c10::IValue& group) {
  static const bool enabled = env::notDisabled("TORCH_TPU_COLLECTIVES_IN_PROGRAM");
  if (!enabled || t.device().type() != c10::DeviceType::PrivateUse1) return std::nullopt;
  if (!compile::capturingHere() && !steps::recorder().defersCalls(t.device().index())) return std::nullopt;
  auto g = inProgramGroup(tpuBackendOf(*groupOf(group)));
  if (!g || g->device != t.device().index()) return std::nullopt;
  if (t.is_complex()) return std::nullopt;
  // The program's replicas are the world's devices: a group among them whose size divides theirs.
  for (int id : g->participants)
    if (std::find(g->world.begin(), g->world.end(), id) == g->world.end()) return std::nullopt;
  if (g->world.size() % g->participants.size()) return std::nullopt;
  return g;
}

// Bitwise and pre-multiplied reductions keep PyTorch's path (XLA:CPU's
// all_reduce takes no bitwise combiner).
bool reducible(const std::string& op) {
  return op == "sum" || op == "avg" || op == "min" || op == "max" || op == "product";
}

std::string describe(const std::string& what, const at::Tensor& t) {
  std::string s = what + " " + std::string(c10::toString(t.scalar_type())) + "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// Whether the collective joins the recording: its program's replicas are those of the
// recording's other collectives (a group of another world stays a call).
// (Fused eager's pending graph takes any: one of another world runs what is pending first.)
bool joins(const InProgramGroup& g) { return !compile::capturingHere() || compile::joinProgramWorld(g.world); }

// Meets the other ranks, then records tpu::replica_<name>(input, args..., channel)
// in the program in place of the functional collective's `n_args` arguments.
void record(Stack* stack, size_t n_args, const InProgramGroup& g, const std::string& name, const at::Tensor& input,
            Stack args) {
  int64_t channel = 0;
  if (compile::capturingHere()) {
    runtime::arriveTogether(g.participants, g.device, describe(name, input), g.timeout);
    compile::noteProgramTimeout(g.timeout);
    channel = compile::nextProgramCollective();
  } else {  // fused eager: the ranks meet where the pending graph launches
    channel = steps::recorder().pendingCollective(g.device, g.world, g.timeout);
  }
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(("tpu::replica_" + name).c_str(), "");
  Stack call;
  call.emplace_back(input);
  for (auto& a : args) call.push_back(std::move(a));
  call.emplace_back(std::vector<int64_t>(g.participants.begin(), g.participants.end()));
  call.emplace_back(std::vector<int64_t>(g.world.begin(), g.world.end()));
  call.emplace_back(channel);
  op.callBoxed(call);
  torch::jit::drop(*stack, n_args);
  stack->push_back(std::move(call.at(0)));
}

// PyTorch's own kernel for the op (registered for every backend).
void pytorchKernel(const c10::OperatorHandle& op, Stack* stack) {
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

// all_reduce(Tensor input, str reduce_op, Any group_name) -> Tensor
void allReduce(const c10::OperatorHandle& op, Stack* stack) {
  const at::Tensor input = (*stack)[stack->size() - 3].toTensor();
  const std::string reduce((*stack)[stack->size() - 2].toStringRef());
  auto g = recordable(input, stack->back());
  if (!g || !reducible(reduce) || !joins(*g)) return pytorchKernel(op, stack);
  record(stack, 3, *g, "all_reduce", input, {c10::IValue(reduce)});
}

// all_gather_into_tensor(Tensor input, int group_size, Any group_name) -> Tensor
void allGather(const c10::OperatorHandle& op, Stack* stack) {
  const at::Tensor input = (*stack)[stack->size() - 3].toTensor();
  auto g = recordable(input, stack->back());
  if (!g || input.dim() == 0 || !joins(*g)) return pytorchKernel(op, stack);
  record(stack, 3, *g, "all_gather", input, {});
}

// reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, Any group_name) -> Tensor
void reduceScatter(const c10::OperatorHandle& op, Stack* stack) {
  const at::Tensor input = (*stack)[stack->size() - 4].toTensor();
  const std::string reduce((*stack)[stack->size() - 3].toStringRef());
  auto g = recordable(input, stack->back());
  const auto n = g ? static_cast<int64_t>(g->participants.size()) : 1;
  if (!g || !reducible(reduce) || input.dim() == 0 || input.size(0) % n || !joins(*g)) return pytorchKernel(op, stack);
  record(stack, 4, *g, "reduce_scatter", input, {c10::IValue(reduce)});
}

// all_to_all_single(Tensor input, SymInt[] output_split_sizes, SymInt[] input_split_sizes, Any group_name)
// Even splits only: uneven ones size the result by data the other ranks hold.
void allToAll(const c10::OperatorHandle& op, Stack* stack) {
  const at::Tensor input = (*stack)[stack->size() - 4].toTensor();
  auto g = recordable(input, stack->back());
  const auto n = g ? static_cast<int64_t>(g->participants.size()) : 1;
  bool even = g && input.dim() > 0 && input.size(0) % n == 0;
  for (size_t k : {stack->size() - 3, stack->size() - 2}) {
    if (!even) break;
    const c10::IValue& v = (*stack)[k];
    if (v.isNone()) continue;
    for (const c10::IValue& s : v.toListRef()) even &= s.isInt() && s.toInt() == input.size(0) / n;
  }
  if (!even || !joins(*g)) return pytorchKernel(op, stack);
  record(stack, 4, *g, "all_to_all", input, {});
}

at::Tensor scaledFirstDim(const at::Tensor& x, int64_t factor, bool divide) {
  std::vector<int64_t> sizes = x.sizes().vec();
  if (sizes.empty()) sizes.push_back(1);
  sizes[0] = divide ? sizes[0] / factor : sizes[0] * factor;
  return at::empty(sizes, x.options());
}
at::Tensor allReduceMeta(const at::Tensor& x, c10::string_view, at::IntArrayRef, at::IntArrayRef, int64_t) {
  return at::empty_like(x);
}
at::Tensor allGatherMeta(const at::Tensor& x, at::IntArrayRef group, at::IntArrayRef, int64_t) {
  return scaledFirstDim(x, static_cast<int64_t>(group.size()), false);
}
at::Tensor reduceScatterMeta(const at::Tensor& x, c10::string_view, at::IntArrayRef group, at::IntArrayRef, int64_t) {
  return scaledFirstDim(x, static_cast<int64_t>(group.size()), true);
}
at::Tensor allToAllMeta(const at::Tensor& x, at::IntArrayRef, at::IntArrayRef, int64_t) { return at::empty_like(x); }

}  // namespace
}  // namespace tpu::distributed

TORCH_LIBRARY_FRAGMENT(tpu, m) {
  // group: the collective's devices; replicas: the program's (the rank's world), by global id.
  m.def("replica_all_reduce(Tensor self, str reduce, int[] group, int[] replicas, int channel) -> Tensor");
  m.def("replica_all_gather(Tensor self, int[] group, int[] replicas, int channel) -> Tensor");
  m.def("replica_reduce_scatter(Tensor self, str reduce, int[] group, int[] replicas, int channel) -> Tensor");
  m.def("replica_all_to_all(Tensor self, int[] group, int[] replicas, int channel) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpu, Meta, m) {
  m.impl("replica_all_reduce", &tpu::distributed::allReduceMeta);
  m.impl("replica_all_gather", &tpu::distributed::allGatherMeta);
  m.impl("replica_reduce_scatter", &tpu::distributed::reduceScatterMeta);
  m.impl("replica_all_to_all", &tpu::distributed::allToAllMeta);
}

TORCH_LIBRARY_IMPL(_c10d_functional, PrivateUse1, m) {
  using torch::CppFunction;
  m.impl("all_reduce", CppFunction::makeFromBoxedFunction<&tpu::distributed::allReduce>());
  m.impl("all_gather_into_tensor", CppFunction::makeFromBoxedFunction<&tpu::distributed::allGather>());
  m.impl("reduce_scatter_tensor", CppFunction::makeFromBoxedFunction<&tpu::distributed::reduceScatter>());
  m.impl("all_to_all_single", CppFunction::makeFromBoxedFunction<&tpu::distributed::allToAll>());
}
