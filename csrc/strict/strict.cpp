// Strict eager, the default mode: each op runs as a one-op program of its own,
// built once per signature (op, dtypes, shapes, attributes) and cached, and
// launched asynchronously; the host waits only when it reads data. Debug
// eager is this mode with every launch waited for (runtime::launchBlocking).
#include "strict/strict.h"

#include <cstring>
#include <mutex>
#include <unordered_map>

#include "op_steps/operand_layout.h"
#include "runtime/views.h"

namespace tpu::eager {

using namespace aten;

namespace {

struct Entry {
  std::shared_ptr<runtime::Program> prog;
  std::vector<InputSource> inputs;
  std::vector<OutputBinding> outputs;
  size_t num_returns = 0;
  bool data_dependent = false;  // the last program output is the length of dynamic_results
  std::vector<int> dynamic_results;
  bool bounds_check = false;  // an output (before the length) says all indices were in range
  uint32_t transposed = 0;    // operands passed as their stored matrix (transposedOperands)
  std::string op_name;
  // Params aliased to a result that overwrites their argument (donateWrites).
  std::vector<int> written_params;
  // The results of a program that reads no tensor and draws no random
  // numbers (a fill: zeros, ones_like, full), by device and scalar values.
  // Null for any other program. See ConstantResults.
  std::shared_ptr<struct ConstantResults> constants;
};

// A fill's results, kept and handed out again instead of recomputed: every
// torch.zeros(...) of a training step (autograd's zero gradients for outputs
// no loss reads, the seed of backward) was a program launch. A kept result is
// handed to one holder at a time (when the cache is its only other owner),
// so two live tensors never share a buffer: programs pass such a buffer once
// per array and could not write either in place. The holder cannot write the
// kept buffer either: execute() donates only buffers nobody else holds, and
// the cache holds these. Bounded: results up to kMaxBytes a call, a few value
// sets per program, kBudget in all; past that, fills run as before.
struct ConstantResults {
  static constexpr size_t kMaxBytes = 4 * 1024 * 1024, kSets = 4;
  static constexpr int64_t kBudget = 64 * 1024 * 1024;
  static std::atomic<int64_t>& used() {
    static std::atomic<int64_t> bytes{0};
    return bytes;
  }
  std::mutex mu;
  std::vector<std::pair<std::vector<int64_t>, std::vector<runtime::BufferPtr>>> sets;

  // The kept results for `key` if nobody holds them now, else none.
  std::vector<runtime::BufferPtr> find(const std::vector<int64_t>& key) {
    std::lock_guard<std::mutex> g(mu);
    for (const auto& [k, bufs] : sets) {
      if (k != key) continue;
      for (const auto& b : bufs)
        if (b.use_count() > 1) return {};
      return bufs;
    }
    return {};
  }
  void keep(std::vector<int64_t> key, const std::vector<runtime::BufferPtr>& bufs, size_t bytes) {
    std::lock_guard<std::mutex> g(mu);
    for (const auto& set : sets)
      if (set.first == key) return;  // kept already (and held now)
    const auto n = static_cast<int64_t>(bytes);
    if (sets.size() >= kSets || used().load() + n > kBudget) return;
    used() += n;
    sets.emplace_back(std::move(key), bufs);
  }
};

// An op lowered onto a builder: each bound result's value is flat, in the

std::mutex g_cache_mu;
std::unordered_map<std::string, std::shared_ptr<Entry>> g_cache;

// An in-place op writes a big argument's buffer in place (input-output
// aliasing, and the buffer donated at the launch) instead of into a new
// buffer: without it, index_put_ of a few rows into a 256 MiB KV cache took
// 104-197 ms, a copy of the whole cache per call (docs/vllm_probe.md).
// The program's results [0, bound) are entry.outputs' first ones.
void donateWrites(ir::Builder& b, Entry& e) {
  const auto& policy = runtime::donationPolicy();
  std::vector<std::pair<int, ir::Value>> pairs;
  std::vector<int> results;
  for (size_t o = 0; o < e.outputs.size() && o < b.outputs().size(); ++o) {
    const OutputBinding& ob = e.outputs[o];
    if (ob.kind != OutputBinding::Kind::WriteArg) continue;
    for (size_t p = 0; p < e.inputs.size(); ++p) {
      const InputSource& is = e.inputs[p];
      const bool same = is.arg == ob.index && ((is.kind == InputSource::Kind::Tensor && ob.elem < 0) ||
                                               (is.kind == InputSource::Kind::ListElem && is.elem == ob.elem));
      if (!same || arrivesTransposed(e.transposed, is)) continue;
      const ir::Type& param = b.paramTypes()[p];
      const ir::Value& v = b.outputs()[o];
      if (param.dtype == v.dtype() && param.numel() == v.type.numel() &&
          policy.allows(static_cast<size_t>(param.numel()) * ir::itemSize(param.dtype))) {
        pairs.emplace_back(static_cast<int>(p), v);
        results.push_back(static_cast<int>(o));
      }
      break;
    }
  }
  if (pairs.empty()) return;
  const std::vector<bool> safe = b.inPlaceSafe(pairs, b.outputs());
  for (size_t k = 0; k < pairs.size(); ++k) {
    if (!safe[k]) continue;
    b.alias(pairs[k].first, results[k]);
    e.written_params.push_back(pairs[k].first);
  }
}

size_t resultBytes(const runtime::Program& p) {
  size_t n = 0;
  for (const auto& t : p.out_types) n += static_cast<size_t>(t.numel()) * ir::itemSize(t.dtype);
  return n;
}

// Strict eager: a one-op program whose parameters are the flat inputs; a
// transposed operand of a matrix product is its stored matrix, transposed in
// the program (see transposedOperands). A tensor argument no result reads
// (fill_'s and zero_'s self) becomes a constant of its type in a second
// lowering, so the program takes no buffer for it: an unwritten argument is
// not first filled with zeros, nor a view argument gathered.
std::shared_ptr<Entry> build(const PlannedOp& p, uint32_t transposed) {
  const auto& schema = p.op.schema();
  const ops::Lowering* low = p.low;
  std::vector<int> param_of_call;  // per tensor argument lowered: its param, or -1 (a CPU scalar)
  std::vector<bool> unread_call;   // per tensor argument lowered: a constant in the second lowering
  for (int pass = 0;; ++pass) {
    auto entry = std::make_shared<Entry>();
    entry->data_dependent = low->data_dependent;
    entry->transposed = transposed;
    const aten::Plan plan = aten::planFor(p);
    ir::Builder b;
    Sources src;
    size_t call = 0;
    src.tensor = [&](const at::Tensor& t, InputSource is) {
      const size_t c = call++;
      ir::Type ty{cpuScalarIr(t), {t.numel()}};
      if (t.device().is_cpu()) {
        if (pass == 0) param_of_call.push_back(-1);
        is.kind = InputSource::Kind::CpuScalar;
        is.dtype = ty.dtype;
        entry->inputs.push_back(is);
        return b.param({ty.dtype, {}});
      }
      if (pass == 1 && c < unread_call.size() && unread_call[c]) return b.constant(0.0, ty.dtype, t.sizes().vec());
      if (pass == 0) param_of_call.push_back(static_cast<int>(entry->inputs.size()));
      ir::Value v = b.param(ty);
      entry->inputs.push_back(is);
      if (arrivesTransposed(transposed, is)) return b.transpose(b.reshape(v, {t.size(1), t.size(0)}), {1, 0});
      return b.reshape(v, t.sizes().vec());
    };
    paramScalarSources(src, b, entry->inputs);
    const aten::Lowered l = aten::lowerOp(p, plan, b, src);
    entry->num_returns = l.num_returns;
    for (const auto& [ob, v] : l.bound) {
      b.output(l.dynamic_results.empty() ? runtime::resultInShape(b, v, memorySizes(ob)) : v);
      entry->outputs.push_back(ob);
    }
    for (int r : l.none_returns) entry->outputs.push_back({OutputBinding::Kind::ReturnNone, r, -1, at::kFloat, {}});
    if (l.bounds_ok.valid()) {
      b.output(l.bounds_ok);
      entry->bounds_check = true;
    }
    if (l.dynamic_len.valid()) b.output(b.convert(l.dynamic_len, ir::DType::I64));
    if (pass == 0 && b.aliases().empty()) {
      const std::vector<bool> read = b.paramsRead();
      bool any = false;
      for (int param : param_of_call) {
        unread_call.push_back(param >= 0 && !read[param]);
        any = any || unread_call.back();
      }
      if (any) continue;
    }
    entry->dynamic_results = l.dynamic_results;
    entry->op_name = p.name();
    if (!entry->data_dependent) donateWrites(b, *entry);
    entry->prog = runtime::Runtime::get().compile(b, schema.name());
    const bool fill = std::all_of(entry->inputs.begin(), entry->inputs.end(), [](const InputSource& is) {
      return is.kind == InputSource::Kind::Scalar || is.kind == InputSource::Kind::ScalarListElem;
    });
    if (fill && !entry->data_dependent && !entry->bounds_check && !entry->outputs.empty() &&
        resultBytes(*entry->prog) <= ConstantResults::kMaxBytes)
      // Never destroyed: the program cache outlives the runtime at exit, and
      // a buffer must not outlive its plugin client.
      entry->constants = std::shared_ptr<ConstantResults>(new ConstantResults, [](ConstantResults*) {});
    return entry;
  }
}

IValue scalarArg(const InputSource& src, const std::vector<IValue>& args) {
  return src.kind == InputSource::Kind::Scalar ? args[src.arg] : args[src.arg].toList().get(src.elem);
}

// What a fill's results depend on: the device and its scalars, as the program
// receives them.
std::vector<int64_t> constantKey(const Entry& e, const std::vector<IValue>& args, c10::DeviceIndex dev) {
  std::vector<int64_t> key{dev};
  for (const auto& src : e.inputs) {
    IValue v = scalarArg(src, args);
    if (src.dtype == ir::DType::F64) {
      double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      key.push_back(bits);
    } else {
      key.push_back(src.dtype == ir::DType::Bool ? v.toBool() : v.toInt());
    }
  }
  return key;
}

std::vector<runtime::BufferPtr> runProgram(const Entry& e, const std::vector<IValue>& args, c10::DeviceIndex dev) {
  std::vector<runtime::BufferPtr> inputs;
  inputs.reserve(e.inputs.size());
  std::optional<at::Generator> gen;
  for (const auto& src : e.inputs) {
    switch (src.kind) {
      case InputSource::Kind::Tensor: {
        const at::Tensor& t = args[src.arg].toTensor();
        if (arrivesTransposed(e.transposed, src)) {  // the stored matrix: no transposing read
          runtime::ViewGeometry g = geometryOf(t);
          std::swap(g.sizes[0], g.sizes[1]);
          std::swap(g.strides[0], g.strides[1]);
          inputs.push_back(runtime::readView(arrayOf(t), g));
        } else {
          inputs.push_back(readTensor(t));
        }
        break;
      }
      case InputSource::Kind::ListElem:
        inputs.push_back(readTensor(listElem(args, src.arg, src.elem)));
        break;
      case InputSource::Kind::CpuScalar:
        inputs.push_back(cpuScalarBuffer(listElem(args, src.arg, src.elem), src.dtype, dev));
        break;
      case InputSource::Kind::Scalar:
      case InputSource::Kind::ScalarListElem: {
        IValue v = scalarArg(src, args);
        if (src.dtype == ir::DType::F64)
          inputs.push_back(runtime::scalarBuffer(ir::DType::F64, v.toDouble(), dev));
        else if (src.dtype == ir::DType::Bool)
          inputs.push_back(runtime::scalarBufferInt(ir::DType::Bool, v.toBool(), dev));
        else
          inputs.push_back(runtime::scalarBufferInt(ir::DType::I64, v.toInt(), dev));
        break;
      }
      case InputSource::Kind::Rng: {
        if (!gen) gen = aten::generatorFor(args, dev);
        const std::array<uint64_t, 2> st = aten::nextRngState(*gen);
        inputs.push_back(runtime::Runtime::get().upload(st.data(), ir::DType::U64, {2}, dev));
        break;
      }
    }
  }
  // A written argument's own buffer may go to the program: its array is
  // replaced by the result right after. Gathered copies of views are
  // donated anyway (nobody else holds them).
  std::vector<int> overwritten;
  for (int param : e.written_params) {
    const InputSource& src = e.inputs[param];
    const at::Tensor& t =
        src.kind == InputSource::Kind::Tensor ? args[src.arg].toTensor() : listElem(args, src.arg, src.elem);
    if (arrayOf(t).buffer() == inputs[param]) overwritten.push_back(param);
  }
  return runtime::execute(*e.prog, inputs, dev, overwritten);
}

void runEntry(const Entry& e, const PlannedOp& p) {
  const auto& args = p.args;
  const c10::DeviceIndex dev = p.device;
  std::vector<runtime::BufferPtr> outs;
  if (e.constants) {
    std::vector<int64_t> key = constantKey(e, args, dev);
    outs = e.constants->find(key);
    if (outs.empty()) {
      outs = runProgram(e, args, dev);
      e.constants->keep(std::move(key), outs, resultBytes(*e.prog));
    } else {
      runtime::metrics().constant_reuses++;
    }
  } else {
    outs = runProgram(e, args, dev);
  }
  if (e.bounds_check) {
    size_t pos = outs.size() - (e.data_dependent ? 2 : 1);
    runtime::checkIndicesLater(outs[pos], e.op_name, dev);
  }
  int64_t dynamic_len = -1;
  if (e.data_dependent) {  // the host needs the length: read it back
    runtime::Runtime::get().download(*outs.back(), &dynamic_len, sizeof(dynamic_len));
  }

  std::vector<IValue> returns(e.num_returns);
  std::vector<c10::List<at::Tensor>> lists(e.num_returns);
  for (size_t i = 0; i < e.outputs.size(); ++i) {
    const auto& ob = e.outputs[i];
    if (ob.kind == OutputBinding::Kind::WriteArg) {
      at::Tensor t = listElem(args, ob.index, ob.elem);
      if (t.sizes().vec() != ob.sizes) t.resize_(ob.sizes);
      writeTensor(t, outs[i]);
    } else if (ob.kind == OutputBinding::Kind::ReturnNone) {
      returns[ob.index] = IValue(at::Tensor());
    } else if (ob.kind == OutputBinding::Kind::Return) {
      at::Tensor t = ob.perm.empty() ? wrapBuffer(outs[i], ob.sizes, ob.dtype, dev)
                                     : wrapBuffer(outs[i], ob.sizes, ob.dtype, dev, permutedStrides(ob));
      bool dynamic = e.data_dependent &&
                     std::find(e.dynamic_results.begin(), e.dynamic_results.end(), ob.index) != e.dynamic_results.end();
      // A result the op left empty (counts not requested) stays empty.
      if (dynamic && t.dim() > 0 && t.size(0) >= dynamic_len) t = t.narrow(0, 0, dynamic_len);
      returns[ob.index] = IValue(t);
    } else {
      lists[ob.index].push_back(wrapBuffer(outs[i], ob.sizes, ob.dtype, dev));
    }
  }
  aten::pushReturns(p.op, p.stack, args, returns, lists);
}

}  // namespace

std::optional<std::string> runStrict(PlannedOp& p) {
  const uint32_t transposed = transposedOperands(p.base, p.args);
  const std::string key = p.key + transposedKey(transposed);
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> g(g_cache_mu);
    auto it = g_cache.find(key);
    if (it != g_cache.end()) entry = it->second;
  }
  if (!entry) {
    try {
      const int64_t compiles_before = runtime::metrics().compiles;
      entry = build(p, transposed);
      if (runtime::metrics().compiles > compiles_before)
        runtime::noteCompile(p.op.schema().name(), aten::explainSignature(p.op.schema().name(), key));
    } catch (const ir::Unsupported& e) {
      return std::string(e.what());
    }
    std::lock_guard<std::mutex> g(g_cache_mu);
    g_cache[key] = entry;
  } else {
    runtime::metrics().cache_hits++;
  }
  runEntry(*entry, p);
  return std::nullopt;
}

size_t strictCacheSize() {
  std::lock_guard<std::mutex> g(g_cache_mu);
  return g_cache.size();
}

}  // namespace tpu::eager
