#include "fused/engine/fused_graph.h"

#include <cstdlib>

#include "runtime/collectives.h"
#include "runtime/env.h"
#include "runtime/pending.h"
#include "runtime/views.h"

namespace tpu::runtime {

LazyGraph::LazyGraph(int device) : device_(device) {
  donate_ = donationPolicy().enabled;
  donate_min_bytes_ = donationPolicy().min_bytes;
  reset();
}

void LazyGraph::reset() {
  b_ = std::make_unique<ir::Builder>();
  inputs_.clear();
  tags_.clear();
  input_owners_.clear();
  input_of_.clear();
  capture_params_.clear();
  values_.clear();
  checks_.clear();
  ops_ = 0;
  collective_timeout_ = std::chrono::milliseconds{0};
  channels_ = 0;
  sigs_.clear();
  keys_.clear();
}

ir::Value LazyGraph::input(const BufferPtr& buf, const ir::Type& type, const DeviceArray* owner) {
  auto it = input_of_.find(buf->raw());
  if (it != input_of_.end() && it->second.type == type) return it->second;
  ir::Value v = b_->param(type);
  inputs_.push_back(buf);
  tags_.emplace_back();
  input_owners_.push_back(owner ? owner->uid() : 0);
  input_of_[buf->raw()] = v;
  return v;
}

void LazyGraph::setCaptureInputs(std::unordered_map<const DeviceArray*, int> arrays) {
  capture_inputs_ = std::move(arrays);
  capture_params_.clear();
  external_reads_ = 0;
  capture_first_uid_ = DeviceArray::nextUid();
}

// Scalars are never deduplicated: whether two scalars happen to be equal (and
// share a cached buffer) changes from step to step, and the graph's
// structure must not.
ir::Value LazyGraph::scalar(const BufferPtr& buf, ir::DType t) {
  ir::Value v = b_->param(ir::Type{t, {}});
  inputs_.push_back(buf);
  tags_.emplace_back();
  input_owners_.push_back(0);
  return v;
}

ir::Value LazyGraph::offset(const ViewGeometry& g) {
  if (bake_scalars_) return b_->constantInt(g.offset, ir::DType::I64);
  return scalar(scalarBufferInt(ir::DType::I64, g.offset, device_), ir::DType::I64);
}

ir::Value LazyGraph::storage(DeviceArray& a, ir::DType t) {
  ir::Value flat;
  if (a.lazy() && a.lazyValue()->graph != this) a.lazyValue()->graph->materialize();
  if (!a.error().empty()) throw std::runtime_error(a.error());
  auto cap = capture_inputs_.empty() || a.lazy() ? capture_inputs_.end() : capture_inputs_.find(&a);
  if (cap != capture_inputs_.end()) {
    // A captured graph's argument: its own input (never deduplicated by
    // buffer, never folded to zeros), so a replay can pass another array.
    if (!a.materialized()) ensureTyped(a, t);  // unwritten: zeros
    auto it = capture_params_.find(&a);
    ir::Type ty{a.dtype(), {a.numel()}};
    if (it != capture_params_.end() && it->second.type == ty) {
      flat = it->second;
    } else {
      flat = b_->param(ty);
      inputs_.push_back(a.buffer());
      tags_.push_back(InputTag{InputTag::Kind::Input, cap->second});
      input_owners_.push_back(a.uid());
      capture_params_[&a] = flat;
    }
  } else if (a.lazy()) {
    flat = a.lazyValue()->value;
  } else if (a.materialized()) {
    if (!capture_inputs_.empty()) ++external_reads_;
    flat = input(a.buffer(), ir::Type{a.dtype(), {a.numel()}}, &a);
  } else {
    // Zeros now, maybe not at a replay; an array made while recording (torch.empty) is the graph's own.
    if (!capture_inputs_.empty() && a.uid() < capture_first_uid_) ++external_reads_;
    return b_->constant(0.0, t, {static_cast<int64_t>(a.nbytes() / ir::itemSize(t))});
  }
  return flat.dtype() == t ? flat : reinterpret(*b_, flat, t);
}

ir::Value LazyGraph::read(DeviceArray& a, const ViewGeometry& g) {
  ir::Value flat = storage(a, g.dtype);
  int64_t numel = g.numel();
  if (numel == 0) return b_->constant(0.0, g.dtype, g.sizes);
  if (g.offset == 0 && g.contiguous() && numel == flat.shape()[0]) return b_->reshape(flat, g.sizes);
  return b_->reshape(buildRead(*b_, flat, offset(g), g), g.sizes);
}

void LazyGraph::write(DeviceArray& a, const ViewGeometry& g, const ir::Value& v) {
  int64_t numel = g.numel();
  if (numel == 0) return;
  ir::Value vflat = b_->reshape(v, {numel});
  int64_t n_as = static_cast<int64_t>(a.nbytes() / ir::itemSize(g.dtype));
  if (g.offset == 0 && g.contiguous() && numel == n_as) {
    bind(a, vflat, g.dtype, g.sizes);
    return;
  }
  ir::Value flat = storage(a, g.dtype);
  bind(a, buildWrite(*b_, flat, vflat, offset(g), g), g.dtype);
}

void LazyGraph::bind(DeviceArray& a, const ir::Value& flat, ir::DType t, const ir::Shape& natural) {
  Fusion::markInUse();
  auto lv = std::make_shared<LazyValue>();
  lv->natural = natural;
  lv->graph = this;
  lv->value = flat;
  lv->owner = &a;
  a.setLazy(lv, t, flat.shape()[0]);
  values_.push_back(lv);
}

void LazyGraph::check(const ir::Value& ok, const std::string& op) { checks_.emplace_back(ok, op); }

std::string LazyGraph::describeOps() const {
  std::string s;
  for (size_t i = 0; i < keys_.size() && i < 20; ++i) s += (i ? ", " : "") + keys_[i].substr(0, keys_[i].find('|'));
  if (keys_.size() > 20) s += ", ...";
  return s;
}

bool LazyGraph::noteOp(const std::string& key) {
  uint64_t sig = ir::hash64(key, 0);
  keys_.push_back(key);
  ++ops_;
  sigs_.push_back(sig);
  if (Fusion::get().wholeGraph()) return false;
  if (ops_ >= Fusion::get().maxOps()) return true;
  size_t n = sigs_.size();
  if (!period_.empty() && n == period_.size()) {
    if (sigs_ == period_) return true;  // one more iteration of the known loop
  }
  // Learn a loop: the last p ops repeat the p before them (10 <= p <= 128).
  for (size_t p = 10; p <= 128 && 2 * p <= n; ++p) {
    if (sigs_[n - 1] != sigs_[n - 1 - p]) continue;
    bool same = true;
    for (size_t i = 0; i < p && same; ++i) same = sigs_[n - 1 - i] == sigs_[n - 1 - p - i];
    if (same) {
      period_.assign(sigs_.end() - p, sigs_.end());
      return true;
    }
  }
  return false;
}

void LazyGraph::materialize(CaptureResult* cap) {
  std::vector<std::shared_ptr<LazyValue>> outs;
  for (const auto& w : values_)
    if (auto lv = w.lock())
      if (lv->owner && lv->owner->lazyValue() == lv) outs.push_back(lv);
  if (outs.empty() && checks_.empty()) {
    reset();
    return;
  }
  // A captured graph donates every argument it overwrites, whatever its
  // size: its results are an optimizer's elementwise updates, which lose
  // nothing by staying flat, and the buffers it then neither allocates nor
  // frees made the compiled GPT step about 2% faster (3 alternating pairs,
  // the optimizer's launch 0.34 -> 0.22 ms).
  std::vector<std::pair<int, int>> donated;
  if (donate_) donated = donations(outs, cap ? 0 : donate_min_bytes_);
  std::vector<char> flat_out(outs.size());
  for (const auto& [input, j] : donated) flat_out[j] = 1;
  // A donated buffer is flat: its result stays flat too (an N-d result would
  // be computed apart and copied in). Updates written in place are
  // elementwise, so the flat loop loses nothing (see resultInShape).
  for (size_t j = 0; j < outs.size(); ++j)
    b_->output(flat_out[j] ? outs[j]->value : resultInShape(*b_, outs[j]->value, outs[j]->natural));
  for (const auto& [ok, op] : checks_) b_->output(ok);
  if (cap && cap->with_function) cap->fn = b_->asFunction();  // before the aliases: the caller donates
  for (const auto& [input, j] : donated) b_->alias(input, j);
  int64_t compiles_before = metrics().compiles;
  std::shared_ptr<Program> prog;
  try {
    prog = Runtime::get().compile(*b_, "fused graph");
  } catch (const std::exception& e) {
    // Nothing of this graph can be computed: its pending arrays carry the
    // error, and the device starts a fresh graph.
    std::string msg = std::string(e.what()) + " (ops of the failed graph: " + describeOps() + ")";
    for (auto& lv : outs) lv->owner->poison(msg);
    reset();
    throw std::runtime_error(msg);
  }
  if (metrics().compiles > compiles_before) {
    std::string why;
    size_t i = 0;
    while (i < keys_.size() && i < last_keys_.size() && keys_[i] == last_keys_[i]) ++i;
    if (last_keys_.empty())
      why = "first graph (" + std::to_string(keys_.size()) + " ops)";
    else if (i < keys_.size() && i < last_keys_.size())
      why = "op " + std::to_string(i) + " of " + std::to_string(keys_.size()) +
            " differs from the last compiled graph: " + last_keys_[i] + "  ->  " + keys_[i];
    else if (keys_.size() != last_keys_.size())
      why = "same ops as the last compiled graph up to op " + std::to_string(i) + ", but " +
            std::to_string(keys_.size()) + " ops instead of " + std::to_string(last_keys_.size());
    else
      why = "same ops as the last compiled graph; other outputs (" + std::to_string(outs.size()) +
            " live results) or input aliasing";
    noteCompile("fused graph", why);
    last_keys_ = keys_;
  }
  std::vector<BufferPtr> inputs = inputs_;
  auto checks = checks_;
  if (cap) {
    cap->prog = prog;
    // Only fixed inputs are kept for replays: holding the arguments' buffers
    // would keep this call's weights, optimizer state and activations alive
    // as long as the graph.
    cap->inputs.resize(inputs_.size());
    for (size_t i = 0; i < inputs_.size(); ++i)
      if (tags_[i].kind == InputTag::Kind::Fixed) cap->inputs[i] = inputs_[i];
    cap->tags = tags_;
    for (const auto& lv : outs) cap->out_owners.push_back(lv->owner);
    for (const auto& c : checks_) cap->checks.push_back(c.second);
  }
  ++materializations_;
  if (cap && !prog->participants.empty()) {
    // Run by the capture mode once the lock is let go (CaptureResult::deferred).
    cap->deferred = true;
    cap->deferred_inputs = inputs;
    cap->meet_within = collective_timeout_;
    for (const auto& lv : outs) cap->results.emplace_back(lv->value.dtype(), lv->value.shape()[0]);
    reset();
    return;
  }
  reset();  // before running: a failure must not leave a half-used graph
  auto results = execute(*prog, inputs, device_);
  for (size_t i = 0; i < outs.size(); ++i) {
    auto& lv = outs[i];
    lv->owner->set(results[i], lv->value.dtype(), lv->value.shape()[0]);
  }
  for (size_t j = 0; j < checks.size(); ++j) checkIndicesLater(results[outs.size() + j], checks[j].second, device_);
}

bool LazyGraph::call(const CaptureResult& ran, const std::vector<DeviceArray*>& args,
                     const std::vector<BufferPtr>& buffers, const std::vector<DeviceArray*>& results,
                     std::chrono::milliseconds timeout) {
  const ir::Function& f = *ran.fn;
  const auto& mine = b_->participants();
  if (!f.participants.empty() && !mine.empty() && mine != f.participants) return false;
  std::vector<ir::Value> operands;
  operands.reserve(f.params.size());
  for (size_t k = 0; k < f.params.size(); ++k) {
    const ir::Type& t = f.params[k];
    if (args[k]) {  // the whole storage, as the capture read it
      ir::Value v = storage(*args[k], t.dtype);
      if (v.type != t)
        throw std::runtime_error("a compiled graph's argument is " + v.type.str() + ", expected " + t.str());
      operands.push_back(v);
    } else {
      // Scalars never deduplicated (see scalar()); other fixed buffers are.
      operands.push_back(t.shape.empty() ? scalar(buffers[k], t.dtype) : input(buffers[k], t));
    }
  }
  const std::vector<ir::Value> out = b_->call(ir::withChannelsAfter(ran.fn, channels_), operands);
  channels_ += f.max_channel;
  for (size_t j = 0; j < results.size(); ++j) {
    if (!results[j]) continue;
    const ir::Value& v = out[j];
    bind(*results[j], b_->reshape(v, {v.type.numel()}), v.dtype(), v.shape());
    results[j]->lazyValue()->any_size = true;
  }
  for (size_t j = results.size(); j < out.size(); ++j) check(out[j], ran.checks[j - results.size()]);
  collective_timeout_ = std::max(collective_timeout_, timeout);
  return true;
}

std::vector<std::pair<int, int>> LazyGraph::donations(const std::vector<std::shared_ptr<LazyValue>>& outs,
                                                      size_t min_bytes) {
  // A buffer passed twice (as two dtypes) cannot be donated.
  std::unordered_map<PJRT_Buffer*, int> passes;
  for (const auto& b : inputs_) ++passes[b->raw()];
  std::unordered_map<uint64_t, int> old_input;
  for (size_t i = 0; i < inputs_.size(); ++i)
    if (input_owners_[i] && passes[inputs_[i]->raw()] == 1) old_input.emplace(input_owners_[i], static_cast<int>(i));
  std::vector<std::pair<int, ir::Value>> pairs;
  std::vector<int> index;  // in `outs`
  std::string key = b_->fingerprint();
  key += '/';
  ir::appendInt(key, static_cast<int64_t>(outs.size()));
  for (size_t j = 0; j < outs.size(); ++j) {
    auto it = old_input.find(outs[j]->owner->uid());
    if (it == old_input.end()) continue;
    const ir::Type& p = b_->paramTypes()[it->second];
    const ir::Type& o = outs[j]->value.type;
    if (p != o) continue;
    if (!outs[j]->any_size && static_cast<size_t>(p.numel()) * ir::itemSize(p.dtype) < min_bytes) continue;
    pairs.emplace_back(it->second, outs[j]->value);
    index.push_back(static_cast<int>(j));
    key += ' ';
    ir::appendInt(key, it->second);
    key += ':';
    ir::appendInt(key, static_cast<int64_t>(j));
  }
  if (pairs.empty()) return {};
  auto memo = donations_.find(key);
  if (memo == donations_.end()) {
    std::vector<ir::Value> results;
    results.reserve(outs.size() + checks_.size());
    for (const auto& lv : outs) results.push_back(lv->value);
    for (const auto& c : checks_) results.push_back(c.first);
    std::vector<bool> safe = b_->inPlaceSafe(pairs, results);
    std::vector<std::pair<int, int>> chosen;
    for (size_t k = 0; k < pairs.size(); ++k)
      if (safe[k]) chosen.emplace_back(pairs[k].first, index[k]);
    if (donations_.size() >= 256) donations_.clear();
    memo = donations_.emplace(std::move(key), std::move(chosen)).first;
  }
  return memo->second;
}

std::atomic<bool> Fusion::in_use_{false};

namespace {
void plainWait(const std::function<void()>& block) { block(); }
std::atomic<FusionMutex::WaitHook> g_wait_hook{plainWait};
}  // namespace

void FusionMutex::setWaitHook(WaitHook hook) { g_wait_hook.store(hook ? hook : plainWait); }

thread_local int FusionMutex::depth_ = 0;

void FusionMutex::lock() {
  if (!mu_.try_lock()) g_wait_hook.load()([this] { mu_.lock(); });
  ++depth_;
}

thread_local int Fusion::tl_whole_graph_ = 0;
thread_local int Fusion::tl_whole_graph_device_ = -1;

Fusion& Fusion::get() {
  // Never destroyed: arrays freed during exit (by autograd's device thread,
  // say) still take its mutex.
  static Fusion* f = new Fusion();
  return *f;
}

Fusion::Fusion() {
  enabled_ = env::enabled("TORCH_TPU_DEFER_AND_FUSE");
  const char* m = env::get("TORCH_TPU_FUSE_MAX_OPS");
  max_ops_ = m && std::atoi(m) > 0 ? std::atoi(m) : 1000;
}

void Fusion::setEnabled(bool on) {
  std::lock_guard<FusionMutex> g(mu_);
  if (enabled_ && !on) flush(-1);
  enabled_ = on;
}

bool Fusion::recordedElsewhere(int device) const {
  const auto me = std::this_thread::get_id();
  for (const auto& [d, owner] : whole_graph_devices_)
    if (owner != me && (d < 0 || device < 0 || d == device)) return true;
  return false;
}

bool Fusion::beginWholeGraph(int device) {
  std::lock_guard<FusionMutex> g(mu_);
  if (tl_whole_graph_ > 0) {
    ++tl_whole_graph_;
    return true;
  }
  if (recordedElsewhere(device)) return false;  // another thread's
  // A device's recording runs only that device's pending graph: another's
  // may belong to a rank's thread, and hold collectives that rank launches.
  flush(device);
  tl_whole_graph_ = 1;
  tl_whole_graph_device_ = device;
  whole_graph_devices_[device] = std::this_thread::get_id();
  if (device < 0 || device >= 64)
    whole_graph_all_.fetch_add(1, std::memory_order_acq_rel);
  else
    whole_graph_mask_.fetch_or(uint64_t{1} << static_cast<unsigned>(device), std::memory_order_acq_rel);
  whole_graph_threads_.fetch_add(1, std::memory_order_acq_rel);
  return true;
}

void Fusion::endWholeGraph(bool entered) {
  std::lock_guard<FusionMutex> g(mu_);
  if (!entered || tl_whole_graph_ == 0) return;
  if (--tl_whole_graph_ == 0) {
    // Whatever happens to the program, this thread stops recording.
    struct Restore {
      Fusion& f;
      ~Restore() {
        const int d = tl_whole_graph_device_;
        f.whole_graph_devices_.erase(d);
        if (d < 0 || d >= 64)
          f.whole_graph_all_.fetch_sub(1, std::memory_order_acq_rel);
        else
          f.whole_graph_mask_.fetch_and(~(uint64_t{1} << static_cast<unsigned>(d)), std::memory_order_acq_rel);
        f.whole_graph_threads_.fetch_sub(1, std::memory_order_acq_rel);
      }
    } restore{*this};
    flush(tl_whole_graph_device_);
  }
}

LazyGraph& Fusion::graph(int device) {
  while (static_cast<int>(graphs_.size()) <= device) graphs_.push_back(nullptr);
  if (!graphs_[device]) graphs_[device] = std::make_unique<LazyGraph>(device);
  return *graphs_[device];
}

void runDeferred(steps::CaptureResult& ran, int device, const std::string& what) {
  ran.deferred = false;
  std::vector<BufferPtr> results;
  try {
    if (ran.meet_within.count() > 0)
      arriveTogether(ran.prog->participants, device,
                     "a program with " + std::to_string(ran.prog->collectives) + " collectives", ran.meet_within);
    blocking([&] { results = execute(*ran.prog, ran.deferred_inputs, device); });
  } catch (const std::exception& e) {
    const std::string msg = what + e.what();
    std::lock_guard<FusionMutex> lock(Fusion::get().mutex());
    for (auto* owner : ran.out_owners) owner->poison(msg);
    throw std::runtime_error(msg);
  }
  ran.deferred_inputs.clear();
  std::lock_guard<FusionMutex> lock(Fusion::get().mutex());
  for (size_t i = 0; i < ran.out_owners.size(); ++i)
    ran.out_owners[i]->set(results[i], ran.results[i].first, ran.results[i].second);
  for (size_t j = 0; j < ran.checks.size(); ++j)
    checkIndicesLater(results[ran.out_owners.size() + j], ran.checks[j], device);
}

void Fusion::flush(int device) {
  std::unique_lock<FusionMutex> g(mu_);
  for (size_t i = 0; i < graphs_.size(); ++i) {
    if (!graphs_[i]) continue;
    if (device >= 0 && static_cast<int>(i) != device) continue;
    // Flushing every device leaves a graph another thread records whole.
    if (device < 0 && !whole_graph_devices_.empty() && recordedElsewhere(static_cast<int>(i))) continue;
    run(*graphs_[i], g);
  }
}

void Fusion::run(LazyGraph& graph, std::unique_lock<FusionMutex>& lock) {
  if (graph.builder().participants().empty() || !FusionMutex::heldOnceHere()) {
    graph.materialize();
    return;
  }
  // Collectives inside: the launch waits inside XLA for the other ranks',
  // and they need this lock to get to theirs. Run as a capture's deferred
  // program is, with the lock let go.
  steps::CaptureResult ran;
  graph.materialize(&ran);
  if (!ran.deferred) return;
  lock.unlock();
  struct Relock {
    std::unique_lock<FusionMutex>& l;
    ~Relock() { l.lock(); }
  } relock{lock};
  runDeferred(ran, graph.device(), "torch_tpu: ");
}

namespace {
// How the runtime reaches this engine (runtime/pending.h): it computes a
// pending array before its buffer is used, and a freed array detaches from
// its pending value under the fusion lock.
void flushPending(int device) { Fusion::get().flush(device); }
void detachPending(const DeviceArray* array, std::shared_ptr<LazyValue>& value) {
  if (!Fusion::inUse()) return;
  std::lock_guard<FusionMutex> lock(Fusion::get().mutex());
  if (value && value->owner == array) value->owner = nullptr;
  value.reset();
}
const bool g_pending_hooks_installed = (setPendingHooks({&flushPending, &detachPending}), true);
}  // namespace

}  // namespace tpu::runtime
