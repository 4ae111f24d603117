// Fused eager (TORCH_TPU_DEFER_AND_FUSE=1): an op does not run; it joins the
// device's pending graph (fused/engine/fused_graph.h) as a call of its signature's
// fragment, and its results are tensors whose storage is a pending value. The
// graph runs as one program when the host needs data, at a sync, at a size
// limit, when the op stream repeats or where a backward pass starts or ends.
// torch.compile's capture records a whole graph through this mode
// (compile/capture.cpp), reaching the engine through the Recorder this file
// installs (op_steps/recording.h), and replays a captured graph as one call of
// its program in the pending graph; copies into tpu tensors join the graph
// through the hooks it installs in aten/tpu.h (DeferredCopies).
#include "fused/fused.h"

#include <torch/csrc/autograd/graph_task.h>

#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "fused/engine/fused_graph.h"
#include "op_steps/operand_layout.h"
#include "op_steps/recording.h"

namespace tpu::eager {

using namespace aten;

namespace {

// Fused eager's form of an op signature: its lowering as a function the
// pending graph calls (built once; a later op with this signature costs a
// call line, not a lowering), and where the function's params come from.
struct Fragment {
  std::shared_ptr<const ir::Function> fn;
  std::vector<InputSource> inputs;     // one per param, in order
  std::vector<OutputBinding> outputs;  // one per result before the bounds check
  std::vector<int> none_returns;
  bool bounds_check = false;  // the last result says all indices were in range
  size_t num_returns = 0;
};

std::mutex g_fragment_mu;
std::unordered_map<std::string, std::shared_ptr<const Fragment>> g_fragments;

// " (issued at file:line)" of the innermost Python frame outside torch, so a
// deferred error points at the user's code; empty without Python. It takes
// the GIL, so never call it under the fusion lock: the GIL's holder may be
// waiting for that lock (freeing a tensor, recording an op).
std::string userLocation() {
  if (!Py_IsInitialized()) return "";
  pybind11::gil_scoped_acquire gil;
  PyFrameObject* f = PyEval_GetFrame();
  if (f) Py_INCREF(f);
  while (f) {
    PyCodeObject* code = PyFrame_GetCode(f);
    std::string file = PyUnicode_AsUTF8(code->co_filename);
    int line = PyFrame_GetLineNumber(f);
    Py_DECREF(code);
    bool internal = file.find("/torch/") != std::string::npos || file.find("/torch_tpu/") != std::string::npos;
    if (!internal) {
      Py_DECREF(f);
      return " (issued at " + file + ":" + std::to_string(line) + ")";
    }
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  return "";
}

std::shared_ptr<const Fragment> buildFragment(const PlannedOp& p, uint32_t transposed, uint32_t packed) {
  const auto& args = p.args;
  runtime::metrics().fused_lowerings++;
  auto frag = std::make_shared<Fragment>();
  const Plan plan = planFor(p);
  ir::Builder b;
  Sources src;
  std::map<size_t, ir::Value> packed_storage;  // by owning operand (packedStorageOwner)
  src.tensor = [&](const at::Tensor& t, InputSource is) {
    if (arrivesPacked(packed, is)) {
      const runtime::ViewGeometry g = geometryOf(t);
      const size_t owner = packedStorageOwner(packed, args, static_cast<size_t>(is.arg));
      auto it = packed_storage.find(owner);
      if (it == packed_storage.end()) {  // a shared storage is one input of the call
        frag->inputs.push_back(is);
        it = packed_storage.emplace(owner, b.param({ir::DType::F32, {arrayOf(t).numel()}})).first;
      }
      ir::Value storage = it->second;
      ir::Value v = b.reshape(runtime::buildRead(b, storage, b.constantInt(g.offset, ir::DType::I64), g), g.sizes);
      b.noteView(v, ir::StridedView{storage, g.offset, g.strides});
      return v;
    }
    frag->inputs.push_back(is);
    if (t.device().is_cpu()) return b.param({cpuScalarIr(t), {}});
    if (arrivesTransposed(transposed, is))
      return b.transpose(b.param({toIr(t.scalar_type()), {t.size(1), t.size(0)}}), {1, 0});
    return b.param({toIr(t.scalar_type()), t.sizes().vec()});
  };
  paramScalarSources(src, b, frag->inputs);
  ops::MultiOpProgram multi_op;
  const Lowered l = lowerOp(p, plan, b, src);
  for (const auto& [ob, v] : l.bound) {
    b.output(v);
    frag->outputs.push_back(ob);
  }
  if (l.bounds_ok.valid()) {
    b.output(l.bounds_ok);
    frag->bounds_check = true;
  }
  frag->none_returns = l.none_returns;
  frag->num_returns = l.num_returns;
  if (!b.outputs().empty()) frag->fn = b.asFunction();
  return frag;
}

// The fragment of the op's signature, built on first use. `location` gets
// where a bounds-checked op was issued, for its deferred error (a new
// signature may turn out checked). That needs the GIL, so the fusion lock is
// let go meanwhile: the GIL's holder may be waiting for it. Nothing of the
// graph has been touched yet.
std::shared_ptr<const Fragment> fragmentFor(const PlannedOp& p, const std::string& frag_key, uint32_t transposed,
                                            uint32_t packed, std::unique_lock<runtime::FusionMutex>& lock,
                                            std::string& location) {
  std::shared_ptr<const Fragment> frag;
  {
    std::lock_guard<std::mutex> g(g_fragment_mu);
    auto it = g_fragments.find(frag_key);
    if (it != g_fragments.end()) frag = it->second;
  }
  if (!frag || frag->bounds_check) {
    lock.unlock();
    location = userLocation();
    lock.lock();
  }
  if (!frag) {
    frag = buildFragment(p, transposed, packed);
    std::lock_guard<std::mutex> g(g_fragment_mu);
    g_fragments[frag_key] = frag;
  }
  return frag;
}

// The values the fragment's call takes, in its param order: graph reads of
// tpu tensors, CPU scalars and Python scalars as inputs (constants while a
// torch.compile graph is captured), fresh random states.
std::vector<ir::Value> callOperands(const PlannedOp& p, const Fragment& frag, runtime::LazyGraph& graph,
                                    uint32_t transposed, uint32_t packed) {
  const auto& args = p.args;
  const c10::DeviceIndex dev = p.device;
  auto& b = graph.builder();
  std::optional<at::Generator> gen;
  auto tensorValue = [&](const at::Tensor& t) -> ir::Value {
    if (t.device().is_cpu()) {
      const ir::DType dt = cpuScalarIr(t);
      ir::Value v = graph.scalar(cpuScalarBuffer(t, dt, dev), dt);
      // While a torch.compile graph is captured: the argument it is, if any.
      const int arg = steps::cpuScalarArgument(t.unsafeGetTensorImpl());
      if (arg >= 0) graph.tagLastInput({steps::InputTag::Kind::CpuInput, arg});
      return v;
    }
    return graph.read(arrayOf(t), geometryOf(t));
  };
  auto scalarValue = [&](const IValue& v, ir::DType st) -> ir::Value {
    if (graph.bakeScalars())
      return st == ir::DType::F64 ? b.constant(v.toDouble(), st)
                                  : b.constantInt(st == ir::DType::Bool ? v.toBool() : v.toInt(), st);
    runtime::BufferPtr buf = st == ir::DType::F64    ? runtime::scalarBuffer(st, v.toDouble(), dev)
                             : st == ir::DType::Bool ? runtime::scalarBufferInt(st, v.toBool(), dev)
                                                     : runtime::scalarBufferInt(st, v.toInt(), dev);
    return graph.scalar(buf, st);
  };
  auto rngValue = [&]() -> ir::Value {
    if (!gen) gen = generatorFor(args, dev);
    const std::array<uint64_t, 2> st = nextRngState(*gen);
    ir::Value v =
        graph.input(runtime::Runtime::get().upload(st.data(), ir::DType::U64, {2}, dev), {ir::DType::U64, {2}});
    graph.tagLastInput({steps::InputTag::Kind::Rng, -1});
    return v;
  };
  std::vector<ir::Value> operands;
  operands.reserve(frag.inputs.size());
  for (const InputSource& is : frag.inputs) {
    switch (is.kind) {
      case InputSource::Kind::Tensor:
      case InputSource::Kind::CpuScalar: {
        const at::Tensor& t = args[is.arg].toTensor();
        if (arrivesPacked(packed, is)) {  // the whole storage
          const int64_t n = arrayOf(t).numel();
          operands.push_back(graph.read(arrayOf(t), runtime::ViewGeometry{ir::DType::F32, {n}, {1}, 0}));
          runtime::metrics().operands_in_place++;
          break;
        }
        ir::Value v = tensorValue(t);
        if (arrivesTransposed(transposed, is))
          v = b.transpose(b.reshape(v, {t.size(0), t.size(1)}), {1, 0});  // the stored matrix
        operands.push_back(v);
        break;
      }
      case InputSource::Kind::ListElem:
        operands.push_back(tensorValue(listElem(args, is.arg, is.elem)));
        break;
      case InputSource::Kind::Scalar:
        operands.push_back(scalarValue(args[is.arg], is.dtype));
        break;
      case InputSource::Kind::ScalarListElem:
        operands.push_back(scalarValue(args[is.arg].toList().get(is.elem), is.dtype));
        break;
      case InputSource::Kind::Rng:
        operands.push_back(rngValue());
        break;
    }
  }
  return operands;
}

// Binds the call's results: written arguments get pending values in their
// views, new results become tensors whose storage is a pending value.
void bindCallResults(const PlannedOp& p, const Fragment& frag, runtime::LazyGraph& graph,
                     const std::vector<ir::Value>& results, const std::string& location) {
  const auto& args = p.args;
  auto& b = graph.builder();
  std::vector<IValue> returns(frag.num_returns);
  std::vector<c10::List<at::Tensor>> lists(frag.num_returns);
  for (size_t i = 0; i < frag.outputs.size(); ++i) {
    const OutputBinding& ob = frag.outputs[i];
    const ir::Value& v = results[i];
    if (ob.kind == OutputBinding::Kind::WriteArg) {
      at::Tensor t = listElem(args, ob.index, ob.elem);
      if (t.sizes().vec() != ob.sizes) t.resize_(ob.sizes);
      graph.write(arrayOf(t), geometryOf(t), b.reshape(v, ob.sizes));
      continue;
    }
    at::Tensor t = emptyTpu(ob.sizes, ob.dtype, p.device);
    if (!ob.perm.empty()) t.unsafeGetTensorImpl()->set_sizes_and_strides(ob.sizes, permutedStrides(ob));
    if (t.numel() > 0) graph.bind(arrayOf(t), v, toIr(ob.dtype), memorySizes(ob));
    if (ob.kind == OutputBinding::Kind::Return)
      returns[ob.index] = IValue(t);
    else
      lists[ob.index].push_back(t);
  }
  for (int r : frag.none_returns) returns[r] = IValue(at::Tensor());
  if (frag.bounds_check) graph.check(results.back(), p.op.schema().name() + location);
  pushReturns(p.op, p.stack, args, returns, lists);
}

// A copy into a tpu tensor is one more step of the pending graph.
bool copyLazy(const at::Tensor& dst, const at::Tensor& src) {
  auto& fusion = runtime::Fusion::get();
  if (dst.device().type() != kTpu || !fusion.enabled(dst.device().index())) return false;
  bool same = src.device() == dst.device();
  if (!same && !src.device().is_cpu()) return false;
  std::lock_guard<runtime::FusionMutex> lock(fusion.mutex());
  // From the host into a whole tensor that holds nothing yet (model.to("tpu"),
  // a batch's x.to("tpu")): an upload now (the caller's), not a step of the
  // graph, so the graph reads the tensor as an input, as later steps do.
  // Recorded, the first step's graph also computed each parameter and batch
  // as a result: a program no later step runs (the GPT's forward compiled
  // twice in its first two steps) and copies of the inputs every step.
  if (!same && !fusion.wholeGraph() && dst.numel() > 0 && src.numel() == dst.numel() && dst.storage_offset() == 0 &&
      dst.is_contiguous()) {
    const runtime::DeviceArray& a = arrayOf(dst);
    if (!a.lazy() && !a.materialized() && a.nbytes() == static_cast<size_t>(dst.numel()) * dst.element_size())
      return false;
  }
  auto& graph = fusion.graph(dst.device().index());
  ir::Builder& b = graph.builder();
  ir::DType dd = toIr(dst.scalar_type());
  ir::Value v;
  if (same) {
    v = graph.read(arrayOf(src), geometryOf(src));
  } else {
    at::Tensor c = src.resolve_conj().resolve_neg();
    if (dst.is_conj()) c = c.conj_physical();
    if (dst.is_neg()) c = c.neg();
    c = c.contiguous();
    auto buf = runtime::Runtime::get().upload(c.data_ptr(), toIr(c.scalar_type()), {c.numel()}, dst.device().index());
    v = b.reshape(graph.input(buf, {toIr(c.scalar_type()), {c.numel()}}), c.sizes().vec());
  }
  // dst's bits mean its memory holds conj/neg of its value: a bit set on
  // one side only is applied to the elements.
  v = applyMathBits(b, v, same && src.is_conj() != dst.is_conj(), same && src.is_neg() != dst.is_neg());
  v = b.broadcastTo(b.convert(v, dd), dst.sizes().vec());
  graph.write(arrayOf(dst), geometryOf(dst), v);
  return true;
}

// Before a copy to the host waits for data, whatever is pending starts, even
// if the copy's source does not need it. In a training loop that reads the
// loss, the backward and optimizer ops recorded after the loss then run while
// the host records the next step, instead of joining its graph.
void beforeHostRead(c10::DeviceIndex device) {
  auto& fusion = runtime::Fusion::get();
  if (fusion.enabled(device) && !fusion.wholeGraph()) fusion.flush(device);
}

// The engine as torch.compile's capture sees it (op_steps/recording.h).
class FusionRecorder final : public steps::Recorder {
 public:
  void lock() override { runtime::Fusion::get().mutex().lock(); }
  void unlock() override { runtime::Fusion::get().mutex().unlock(); }
  bool beginWholeGraph(int device) override { return runtime::Fusion::get().beginWholeGraph(device); }
  void endWholeGraph(bool entered) override { runtime::Fusion::get().endWholeGraph(entered); }
  void setCaptureInputs(int device, std::unordered_map<const runtime::DeviceArray*, int> arrays) override {
    graph(device).setCaptureInputs(std::move(arrays));
  }
  void setBakeScalars(int device, bool on) override { graph(device).setBakeScalars(on); }
  int ops(int device) override { return graph(device).ops(); }
  int materializations(int device) override { return graph(device).materializations(); }
  int externalReads(int device) override { return graph(device).externalReads(); }
  void materialize(int device, steps::CaptureResult& ran) override { graph(device).materialize(&ran); }
  void runDeferred(int device, steps::CaptureResult& ran, const std::string& what) override {
    runtime::runDeferred(ran, device, what);
  }
  bool defersCalls(int device) override {
    auto& fusion = runtime::Fusion::get();
    return fusion.enabled(device) && !fusion.wholeGraph();
  }
  // Called under the lock, held once (the replay's): a cut can run a program
  // with collectives with it let go.
  void recordCall(int device, const steps::CaptureResult& ran, const std::vector<runtime::DeviceArray*>& args,
                  const std::vector<runtime::BufferPtr>& buffers, const std::vector<runtime::DeviceArray*>& results,
                  std::chrono::milliseconds timeout, const std::string& key) override {
    auto& fusion = runtime::Fusion::get();
    std::unique_lock<runtime::FusionMutex> lock(fusion.mutex(), std::adopt_lock);
    struct Keep {  // the caller's hold stays the caller's
      std::unique_lock<runtime::FusionMutex>& l;
      ~Keep() { l.release(); }
    } keep{lock};
    auto& graph = fusion.graph(device);
    // No phase cut: the call is one line of the graph, and a step's forward,
    // backward and update then run as one program.
    if (!graph.call(ran, args, buffers, results, timeout)) {  // collectives of another world pending
      fusion.run(graph, lock);
      graph.call(ran, args, buffers, results, timeout);
    }
    if (graph.noteOp(key)) fusion.run(graph, lock);
  }
  int64_t pendingCollective(int device, const std::vector<int>& world, std::chrono::milliseconds timeout) override {
    auto& fusion = runtime::Fusion::get();
    std::unique_lock<runtime::FusionMutex> lock(fusion.mutex());
    auto& graph = fusion.graph(device);
    const auto& mine = graph.builder().participants();
    if (!mine.empty() && mine != world) fusion.run(graph, lock);
    return graph.nextChannel(timeout);
  }

 private:
  static runtime::LazyGraph& graph(int device) { return runtime::Fusion::get().graph(device); }
};

const bool g_installed = [] {
  steps::setRecorder(new FusionRecorder());  // never destroyed: arrays freed at exit may still reach it
  setDeferredCopies({&copyLazy, &beforeHostRead});
  return true;
}();

}  // namespace

std::optional<std::string> runFused(PlannedOp& p) {
  auto& fusion = runtime::Fusion::get();
  std::unique_lock<runtime::FusionMutex> lock(fusion.mutex());
  const uint32_t transposed = transposedOperands(p.base, p.args);
  const uint32_t packed = packedAttentionOperands(p.base, p.args);
  std::string frag_key = p.key + transposedKey(transposed);
  if (packed) frag_key += packedKey(packed, p.args);
  std::string location;
  std::shared_ptr<const Fragment> frag;
  try {
    frag = fragmentFor(p, frag_key, transposed, packed, lock, location);
  } catch (const ir::Unsupported& e) {
    return std::string(e.what());
  }
  auto& graph = fusion.graph(p.device);
  // A training step's forward, backward and optimizer update are separate
  // programs: what is pending is launched when recording enters or leaves a
  // backward pass, so the device runs the forward while the host records the
  // backward, and the backward while it records the update (launches are
  // asynchronous). The cuts fall at the same ops every step, so each phase is
  // one cached program. One program per step was slower: it starts only when
  // the host has recorded the whole step (docs/reliability.md).
  if (!fusion.wholeGraph() && graph.enterPhase(torch::autograd::get_current_graph_task_id() != -1 ? 1 : 0))
    fusion.run(graph, lock);
  const std::vector<ir::Value> operands = callOperands(p, *frag, graph, transposed, packed);
  std::vector<ir::Value> results;
  if (frag->fn) results = graph.builder().call(frag->fn, operands);
  bindCallResults(p, *frag, graph, results, location);
  if (graph.noteOp(p.key)) fusion.run(graph, lock);
  return std::nullopt;
}

}  // namespace tpu::eager
