// Capture and replay of torch.compile graphs (compile/capture.h). The
// recording is fused eager's pending graph with whole-graph mode on: no loop
// or size cuts, scalars and view offsets baked in as constants, and the graph
// arguments' arrays read as inputs of their own, so that a replay can hand
// the program new arguments' buffers in their place. This mode reaches that
// engine only through op_steps/recording.h (the Recorder fused eager
// installs), never by including the fused mode.
#include "compile/capture.h"

#include <cstdio>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "op_steps/op_plan.h"
#include "op_steps/recording.h"
#include "runtime/collectives.h"
#include "runtime/env.h"

namespace tpu::compile {

using namespace aten;

namespace {

// What a captured graph's argument must look like for a replay: the program
// bakes the layout (sizes, strides, storage offset) and dtype of each one.
struct ArgSignature {
  bool defined = false;
  c10::Device device = c10::Device(c10::kCPU);
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  bool matches(const at::Tensor& t) const {
    if (t.defined() != defined) return false;
    if (!defined) return true;
    return t.device() == device && t.scalar_type() == dtype && t.storage_offset() == offset &&
           t.sizes().equals(sizes) && t.strides().equals(strides);
  }
  static ArgSignature of(const at::Tensor& t) {
    ArgSignature a;
    if (!t.defined()) return a;
    a.defined = true;
    a.device = t.device();
    a.dtype = t.scalar_type();
    a.sizes = t.sizes().vec();
    a.strides = t.strides().vec();
    a.offset = t.storage_offset();
    return a;
  }
};

// The graph this thread records (threads that drive a device each, the ranks
// of a local group, record at once; each step runs under the fusion mutex).
struct CaptureState {
  std::vector<ArgSignature> signature;
  bool active = false;
  std::thread::id owner;
  bool broken = false;      // an op ran on the CPU: the recording cannot be replayed
  bool all_inputs = false;  // reading another device tensor makes it not replayable
  int device = 0;
  bool was_fused = false;
  int materializations = 0;
  std::unordered_map<const c10::TensorImpl*, int> cpu_inputs;
  std::vector<const runtime::DeviceArray*> arrays;  // per argument (nullptr: CPU or undefined)
  std::vector<int> groups;
  std::chrono::milliseconds timeout{0};  // the longest of its collectives' groups
  int64_t collectives = 0;               // recorded so far
  std::vector<int> world;                // the replicas of its collectives (global device ids)
};
thread_local CaptureState g_capture;

}  // namespace

struct OutputSpec {
  enum class Kind { None, Result, AliasInput, Constant } kind = Kind::None;
  int index = -1;  // program result or argument
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;
  at::Tensor constant;
};

struct CapturedGraph {
  std::vector<ArgSignature> signature;  // per argument
  steps::CaptureResult run;
  int device = 0;
  std::vector<int> array_group;                   // per argument: the first argument sharing its storage (-1: CPU/none)
  std::vector<std::pair<int, int>> input_writes;  // (argument, program result)
  // Params of overwritten arguments whose buffers the program may write its
  // results into: the argument's array, replaced by the result, does not
  // stop execute() from donating them.
  std::vector<int> donated;
  std::vector<OutputSpec> outputs;
  int ops = 0;
  std::chrono::milliseconds timeout{0};  // a program with collectives: how long a replay waits for the others
};

namespace {

// Per argument: the index of the first argument on the same storage.
std::optional<std::vector<int>> arrayGroups(const std::vector<at::Tensor>& inputs, c10::DeviceIndex* dev) {
  std::vector<int> groups(inputs.size(), -1);
  std::unordered_map<const void*, int> first;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (!t.defined()) continue;
    if (t.device().is_cpu()) {
      if (t.numel() != 1) return std::nullopt;
      continue;
    }
    // Any layout: the caller's signature pins sizes, strides and offset, and a
    // replay checks that the storage still has the captured size and dtype.
    if (t.device().type() != kTpu) return std::nullopt;
    if (*dev < 0) *dev = t.device().index();
    if (t.device().index() != *dev) return std::nullopt;
    auto [it, fresh] = first.emplace(t.storage().unsafeGetStorageImpl(), static_cast<int>(i));
    groups[i] = it->second;
  }
  return groups;
}

}  // namespace

bool captureBegin(const std::vector<at::Tensor>& inputs, bool all_inputs) {
  auto& rec = steps::recorder();
  std::lock_guard<steps::Recorder> lock(rec);
  if (g_capture.active) return false;
  c10::DeviceIndex dev = -1;
  auto groups = arrayGroups(inputs, &dev);
  if (!groups) return false;
  if (dev < 0) dev = currentDevice();
  if (!rec.beginWholeGraph(dev)) return false;  // another thread is recording this device
  g_capture = CaptureState{};
  g_capture.was_fused = true;
  g_capture.owner = std::this_thread::get_id();
  g_capture.active = true;
  g_capture.device = dev;
  g_capture.all_inputs = all_inputs;
  g_capture.groups = *groups;
  for (const at::Tensor& t : inputs) g_capture.signature.push_back(ArgSignature::of(t));
  g_capture.arrays.assign(inputs.size(), nullptr);
  std::unordered_map<const runtime::DeviceArray*, int> arrays;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (!t.defined()) continue;
    if (t.device().is_cpu()) {
      g_capture.cpu_inputs[t.unsafeGetTensorImpl()] = static_cast<int>(i);
    } else {
      g_capture.arrays[i] = &arrayOf(t);
      arrays.emplace(&arrayOf(t), static_cast<int>(i));
    }
  }
  rec.setCaptureInputs(dev, std::move(arrays));
  rec.setBakeScalars(dev, true);
  g_capture.materializations = rec.materializations(dev);
  return true;
}

void captureAbort() {
  auto& rec = steps::recorder();
  std::lock_guard<steps::Recorder> lock(rec);
  if (!g_capture.active || g_capture.owner != std::this_thread::get_id()) return;
  rec.setCaptureInputs(g_capture.device, {});
  rec.setBakeScalars(g_capture.device, false);
  g_capture.active = false;
  rec.endWholeGraph(g_capture.was_fused);
}

namespace {

// Runs a recording's program with collectives (CaptureResult::deferred) once
// the engine's lock is let go.
void runDeferred(CapturedGraph& g) { steps::recorder().runDeferred(g.device, g.run, "torch_tpu: compiled graph: "); }

std::shared_ptr<CapturedGraph> endRecording(const std::vector<at::Tensor>& outputs,
                                            std::shared_ptr<CapturedGraph>& recorded);

}  // namespace

std::shared_ptr<CapturedGraph> captureEnd(const std::vector<at::Tensor>& outputs) {
  std::shared_ptr<CapturedGraph> recorded;
  std::shared_ptr<CapturedGraph> replayable;
  try {
    replayable = endRecording(outputs, recorded);
  } catch (...) {
    if (recorded && recorded->run.deferred) runDeferred(*recorded);
    throw;
  }
  if (recorded && recorded->run.deferred) runDeferred(*recorded);
  return replayable;
}

namespace {
std::shared_ptr<CapturedGraph> endRecording(const std::vector<at::Tensor>& outputs,
                                            std::shared_ptr<CapturedGraph>& recorded) {
  auto& rec = steps::recorder();
  std::lock_guard<steps::Recorder> lock(rec);
  if (!g_capture.active || g_capture.owner != std::this_thread::get_id()) return nullptr;
  const int dev = g_capture.device;
  auto cg = std::make_shared<CapturedGraph>();
  recorded = cg;
  cg->device = dev;
  cg->ops = rec.ops(dev);
  bool split = rec.materializations(dev) != g_capture.materializations;
  const int external = g_capture.all_inputs ? rec.externalReads(dev) : 0;
  struct Finish {  // the caller's mode comes back whatever happens
    steps::Recorder& r;
    int device;
    ~Finish() {
      r.setCaptureInputs(device, {});
      r.setBakeScalars(device, false);
      g_capture.active = false;
      r.endWholeGraph(g_capture.was_fused);
    }
  } finish{rec, dev};
  cg->run.with_function = true;  // fused eager records replays as calls of it
  try {
    rec.materialize(dev, cg->run);
  } catch (const std::exception& e) {
    rethrow(e, "torch_tpu: compiled graph");
  }
  static const bool debug = env::get("TORCH_TPU_DEBUG_CAPTURE") != nullptr;
  if (split || g_capture.broken || !cg->run.prog || external > 0) {
    if (debug)
      std::fprintf(stderr,
                   "torch_tpu capture: not replayable (split %d, cpu values %d, program %d, other device tensors "
                   "read %d)\n",
                   split, g_capture.broken, static_cast<bool>(cg->run.prog), external);
    return nullptr;
  }
  // Arguments the graph wrote, and where each output lives.
  cg->timeout = g_capture.timeout;
  cg->array_group = g_capture.groups;
  cg->signature = g_capture.signature;
  std::unordered_map<const runtime::DeviceArray*, int> result_of, arg_of;
  for (size_t k = 0; k < cg->run.out_owners.size(); ++k) result_of[cg->run.out_owners[k]] = static_cast<int>(k);
  for (size_t i = 0; i < g_capture.arrays.size(); ++i)
    if (g_capture.arrays[i]) arg_of.emplace(g_capture.arrays[i], static_cast<int>(i));
  for (size_t k = 0; k < cg->run.out_owners.size(); ++k) {
    auto it = arg_of.find(cg->run.out_owners[k]);
    if (it != arg_of.end()) cg->input_writes.emplace_back(it->second, static_cast<int>(k));
  }
  for (int p : cg->run.prog->aliased_params) {
    const auto& tag = cg->run.tags[p];
    bool written = std::any_of(cg->input_writes.begin(), cg->input_writes.end(),
                               [&](const auto& w) { return w.first == tag.index; });
    if (tag.kind == steps::InputTag::Kind::Input && written) cg->donated.push_back(p);
  }
  for (const at::Tensor& t : outputs) {
    OutputSpec o;
    if (t.defined()) {
      if (t.device().type() != kTpu) {
        if (debug)
          std::fprintf(stderr, "torch_tpu capture: not replayable (an output on %s)\n", t.device().str().c_str());
        return nullptr;
      }
      o.sizes = t.sizes().vec();
      o.strides = t.strides().vec();
      o.offset = t.storage_offset();
      o.dtype = t.scalar_type();
      const runtime::DeviceArray* a = &arrayOf(t);
      if (auto r = result_of.find(a); r != result_of.end()) {
        o.kind = OutputSpec::Kind::Result;
        o.index = r->second;
      } else if (auto g = arg_of.find(a); g != arg_of.end()) {
        o.kind = OutputSpec::Kind::AliasInput;
        o.index = g->second;
      } else {
        o.kind = OutputSpec::Kind::Constant;
        o.constant = t;
      }
    }
    cg->outputs.push_back(std::move(o));
  }
  return cg;
}
}  // namespace

namespace {
// A tensor on `holder`'s storage with `o`'s dtype and geometry, built
// directly (no dispatch) and not a view of `holder`.
at::Tensor onStorageOf(const at::Tensor& holder, const OutputSpec& o) {
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(holder.storage()), holder.key_set(),
                                                            c10::scalarTypeToTypeMeta(o.dtype));
  out.unsafeGetTensorImpl()->set_sizes_and_strides(o.sizes, o.strides, o.offset);
  return out;
}
}  // namespace

std::optional<std::vector<at::Tensor>> replay(CapturedGraph& g, const std::vector<at::Tensor>& inputs) {
  auto& rec = steps::recorder();
  if (inputs.size() != g.signature.size()) return std::nullopt;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (!g.signature[i].matches(inputs[i])) return std::nullopt;
  std::unique_lock<steps::Recorder> lock(rec);
  c10::DeviceIndex dev = -1;
  auto groups = arrayGroups(inputs, &dev);
  if (!groups || *groups != g.array_group || (dev >= 0 && dev != g.device)) return std::nullopt;
  const auto& prog = *g.run.prog;
  // Fused eager on this thread: the run joins the pending graph as a call of
  // the program's function; its results are pending arrays.
  const bool deferred = g.run.fn && rec.defersCalls(g.device);
  std::vector<runtime::BufferPtr> bufs(g.run.tags.size());
  std::vector<runtime::DeviceArray*> args(g.run.tags.size(), nullptr);
  for (size_t k = 0; k < g.run.tags.size(); ++k) {
    const auto& tag = g.run.tags[k];
    const ir::Type& want = prog.param_types[k];
    switch (tag.kind) {
      case steps::InputTag::Kind::Fixed:
        bufs[k] = g.run.inputs[k];
        break;
      case steps::InputTag::Kind::Input: {
        runtime::DeviceArray& a = arrayOf(inputs[tag.index]);
        if (deferred) {
          if ((a.lazy() || a.materialized()) && (a.dtype() != want.dtype || a.numel() != want.numel()))
            return std::nullopt;
          args[k] = &a;
          break;
        }
        runtime::flushIfLazy(a);
        if (!a.materialized()) runtime::ensureTyped(a, want.dtype);  // unwritten: zeros
        if (a.dtype() != want.dtype || a.numel() != want.numel()) return std::nullopt;
        bufs[k] = a.buffer();
        break;
      }
      case steps::InputTag::Kind::CpuInput:
        bufs[k] = cpuScalarBuffer(inputs[tag.index], want.dtype, g.device);
        break;
      case steps::InputTag::Kind::Rng: {
        at::Generator gen = defaultGenerator(g.device);
        const std::array<uint64_t, 2> st = nextRngState(gen);
        bufs[k] = runtime::Runtime::get().upload(st.data(), ir::DType::U64, {2}, g.device);
        break;
      }
    }
  }
  const size_t n_out = g.run.out_owners.size();
  std::vector<runtime::BufferPtr> results;
  std::unordered_map<int, at::Tensor> bases;
  if (deferred) {
    // Per result: the argument it overwrites, or a fresh array for an output.
    std::vector<runtime::DeviceArray*> targets(n_out, nullptr);
    for (const auto& [arg, k] : g.input_writes) {
      targets[k] = &arrayOf(inputs[arg]);
      // An output that is the written argument (`t.add_(1)` returned) lives on
      // that argument's storage: a fresh array would take the result from it.
      bases.emplace(k, inputs[arg]);
    }
    for (const auto& o : g.outputs) {
      if (o.kind != OutputSpec::Kind::Result || bases.count(o.index)) continue;
      const ir::Type& t = prog.out_types[o.index];
      at::Tensor base = emptyTpu({t.numel()}, toAten(t.dtype), g.device);
      targets[o.index] = &arrayOf(base);
      bases.emplace(o.index, std::move(base));
    }
    try {
      rec.recordCall(g.device, g.run, args, bufs, targets, g.timeout, "compiled graph @" + g.run.fn->name);
    } catch (const std::exception& e) {
      rethrow(e, "torch_tpu: compiled graph");
    }
  } else {
    if (!prog.participants.empty()) {
      // A program with collectives: every rank launches its replica of the same
      // run, so they meet first, outside the lock (the others need it to get here).
      lock.unlock();
      // (Ranks' programs may differ in their own constants: what must agree is their collectives.)
      runtime::arriveTogether(prog.participants, g.device,
                              "a compiled step's program with " + std::to_string(prog.collectives) + " collectives",
                              g.timeout);
    }
    try {
      if (prog.participants.empty())
        results = runtime::execute(prog, bufs, g.device, g.donated);
      else
        runtime::blocking([&] { results = runtime::execute(prog, bufs, g.device, g.donated); });
    } catch (const std::exception& e) {
      rethrow(e, "torch_tpu: compiled graph");
    }
    for (const auto& [arg, k] : g.input_writes) {
      const ir::Type& t = prog.out_types[k];
      arrayOf(inputs[arg]).set(results[k], t.dtype, t.numel());
    }
    for (size_t j = 0; j < g.run.checks.size(); ++j)
      runtime::checkIndicesLater(results[n_out + j], g.run.checks[j], g.device);
  }
  std::vector<at::Tensor> outs;
  outs.reserve(g.outputs.size());
  for (const auto& o : g.outputs) {
    switch (o.kind) {
      case OutputSpec::Kind::None:
        outs.emplace_back();
        break;
      case OutputSpec::Kind::Result: {
        auto it = bases.find(o.index);
        if (it == bases.end()) {
          const ir::Type& t = prog.out_types[o.index];
          it = bases.emplace(o.index, wrapBuffer(results[o.index], {t.numel()}, toAten(t.dtype), g.device)).first;
        }
        // A fresh tensor on the result's storage, not a view of it: autograd
        // refuses in-place updates of a custom Function's view outputs (the
        // Trainer scales the loss with `loss *= n`), and aliasing between
        // outputs is AOTAutograd's to regenerate. Built directly: through
        // the dispatcher (empty + set_) it was a third of a replay's host time.
        outs.push_back(onStorageOf(it->second, o));
        break;
      }
      case OutputSpec::Kind::AliasInput: {
        // AOTAutograd rebuilds a returned alias of an input as a view of the
        // input from this tensor's geometry; as_strided through the
        // dispatcher was a quarter of a forward replay's host time. The
        // version counter is the input's, as a view's would be, so that a
        // tensor saved for backward still sees in-place updates of it.
        const at::Tensor& in = inputs[o.index];
        at::Tensor out = onStorageOf(in, o);
        out.unsafeGetTensorImpl()->set_version_counter(in.unsafeGetTensorImpl()->version_counter());
        outs.push_back(std::move(out));
        break;
      }
      case OutputSpec::Kind::Constant:
        outs.push_back(o.constant);
        break;
    }
  }
  return outs;
}

int capturedOps(const CapturedGraph& g) { return g.ops; }

bool capturingHere() { return g_capture.active && g_capture.owner == std::this_thread::get_id(); }

int64_t nextProgramCollective() { return ++g_capture.collectives; }

bool joinProgramWorld(const std::vector<int>& world) {
  if (!capturingHere()) return false;
  if (g_capture.world.empty()) g_capture.world = world;
  return g_capture.world == world;
}

void noteProgramTimeout(std::chrono::milliseconds timeout) {
  if (capturingHere()) g_capture.timeout = std::max(g_capture.timeout, timeout);
}

void noteUnreplayable() {
  if (capturingHere()) g_capture.broken = true;
}

namespace {
// Fused eager made the CPU scalar tensor `impl` the graph's last input: the
// argument it is, or -1 (then the recording cannot be replayed if the graph
// has CPU arguments). Called under the recorder's lock (op_steps/recording.h).
int cpuScalarArgument(const void* impl) {
  if (!capturingHere()) return -1;
  auto it = g_capture.cpu_inputs.find(static_cast<const c10::TensorImpl*>(impl));
  if (it != g_capture.cpu_inputs.end()) return it->second;
  // A CPU value computed inside the graph may derive from a CPU argument;
  // without CPU arguments it is a constant of the graph.
  if (!g_capture.cpu_inputs.empty()) g_capture.broken = true;
  return -1;
}
const bool g_installed = (steps::setCpuScalarArgument(&cpuScalarArgument), true);
}  // namespace

}  // namespace tpu::compile
