#include "runtime/views.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <list>
#include <numeric>
#include <optional>

#include "runtime/collectives.h"
#include "runtime/env.h"
#include "runtime/pending.h"

namespace tpu::runtime {

namespace {
std::atomic<bool> g_blocking{false};

using ProgramCache = std::unordered_map<std::string, std::shared_ptr<Program>>;

std::shared_ptr<Program> cached(ProgramCache& cache, const std::string& key,
                                const std::function<void(ir::Builder&)>& build, const char* what) {
  static std::mutex mu;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  ir::Builder b;
  build(b);
  auto p = Runtime::get().compile(b, what);
  noteCompile(what, "first use of its shape key " + key);
  std::lock_guard<std::mutex> g(mu);
  cache[key] = p;
  return p;
}

std::string geomKey(const ViewGeometry& g, int64_t n) {
  std::string k = std::to_string(static_cast<int>(g.dtype)) + ":" + std::to_string(n) + ":";
  for (auto s : g.sizes) k += std::to_string(s) + ",";
  k += ":";
  for (auto s : g.strides) k += std::to_string(s) + ",";
  return k;
}

}  // namespace

namespace {
PendingHooks g_pending_hooks;  // constant-initialised: engines install theirs at static initialisation
}  // namespace
void setPendingHooks(const PendingHooks& hooks) { g_pending_hooks = hooks; }
const PendingHooks& pendingHooks() { return g_pending_hooks; }

ir::Value resultInShape(ir::Builder& b, const ir::Value& flat, const ir::Shape& shape) {
  if (!ir::xlaCpuTuning() || shape.size() < 2) return flat;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n == flat.type.numel() ? b.reshape(flat, shape) : flat;
}

// Reinterprets a flat array's bytes as another dtype.
ir::Value reinterpret(ir::Builder& b, const ir::Value& v, ir::DType to) {
  using ir::DType;
  ir::DType from = v.dtype();
  if (from == to) return v;
  if (from == DType::Bool) return reinterpret(b, b.convert(v, DType::U8), to);
  if (to == DType::Bool) return b.convert(reinterpret(b, v, DType::U8), DType::Bool);
  // bitcast_convert rejects complex types: a complex element is its (real,
  // imag) f32 pair in memory, so go through that pair.
  if (ir::isComplex(from)) {
    int64_t n = v.shape()[0];
    ir::Value re = b.reshape(b.real(v), {n, 1}), im = b.reshape(b.imag(v), {n, 1});
    return reinterpret(b, b.reshape(b.concatenate({re, im}, 1), {2 * n}), to);
  }
  if (ir::isComplex(to)) {
    ir::Value f = reinterpret(b, v, ir::complexPart(to));
    int64_t m = f.shape()[0] / 2;
    if (2 * m != f.shape()[0]) f = b.slice(f, {0}, {2 * m}, {1});
    f = b.reshape(f, {m, 2});
    ir::Value re = b.reshape(b.slice(f, {0, 0}, {m, 1}, {1, 1}), {m});
    ir::Value im = b.reshape(b.slice(f, {0, 1}, {m, 2}, {1, 1}), {m});
    return b.complex(re, im);
  }
  size_t fs = ir::itemSize(from), ts = ir::itemSize(to);
  int64_t n = v.shape()[0];
  if (fs == ts) return b.bitcast(v, {to, {n}});
  if (fs > ts) {
    int64_t r = static_cast<int64_t>(fs / ts);
    ir::Value w = b.bitcast(v, {to, {n, r}});
    return b.reshape(w, {n * r});
  }
  int64_t r = static_cast<int64_t>(ts / fs);
  int64_t m = n / r;
  ir::Value x = v;
  if (m * r != n) x = b.slice(x, {0}, {m * r}, {1});
  x = b.reshape(x, {m, r});
  return b.bitcast(x, {to, {m}});
}

namespace {

// Memory-order description of a view: dims with stride 0 are broadcast; the
// rest are "dense permuted" when some ordering of them tiles a contiguous
// block exactly (transposes, permutes, contiguous slices).
struct Layout {
  bool dense = false;
  std::vector<int64_t> order;  // non-broadcast dims, outermost first
  std::vector<int64_t> bcast;  // dims with stride 0 (size > 1)
  int64_t span = 0;            // elements covered in memory
};

Layout analyze(const ViewGeometry& g) {
  Layout l;
  std::vector<int64_t> dims;
  for (size_t i = 0; i < g.sizes.size(); ++i) {
    if (g.sizes[i] == 1) continue;
    if (g.strides[i] == 0)
      l.bcast.push_back(i);
    else
      dims.push_back(i);
  }
  std::stable_sort(dims.begin(), dims.end(), [&](int64_t a, int64_t b) { return g.strides[a] > g.strides[b]; });
  int64_t expect = 1;
  bool ok = true;
  for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
    if (g.strides[*it] != expect) ok = false;
    expect *= g.sizes[*it];
  }
  l.dense = ok;
  l.order = dims;
  l.span = expect;
  return l;
}

// Flat element index of every position of the view (i64, view-shaped),
// without the offset.
ir::Value viewIndices(ir::Builder& b, const ViewGeometry& g) {
  ir::Type t{ir::DType::I64, g.sizes};
  ir::Value acc = b.constantInt(0, ir::DType::I64, g.sizes);
  for (size_t d = 0; d < g.sizes.size(); ++d) {
    if (g.sizes[d] == 1 || g.strides[d] == 0) continue;
    ir::Value io = b.iota(t, static_cast<int>(d));
    ir::Value st = b.constantInt(g.strides[d], ir::DType::I64, g.sizes);
    acc = b.binary("add", acc, b.binary("multiply", io, st));
  }
  return acc;
}

// A view that is not dense but whose memory-ordered dims nest without overlap
// (each dim's extent fits inside the next outer stride: stepped slices, column
// blocks) is a static slice of its memory window reshaped to a box
// [s_0, t_0/t_1, ..., t_{k-1}/t_k, t_k]. XLA reads that as a strided copy; the
// fallback gathers single elements, which is slow everywhere and slowest on TPUs.
struct Box {
  ir::Shape shape;   // the window as a box
  ir::Shape limit;   // the view's corner of it: [s_0, s_1, ..., s_k(, 1)]
  int64_t span = 0;  // elements from the first to the last one of the view
  int64_t len = 0;   // the box's elements (span padded to whole rows)
};

std::optional<Box> boxOf(const ViewGeometry& g, const Layout& l, bool transposed_ok) {
  // A box read that also transposes (the per-head split of a fused QKV
  // projection) is a slice and a transpose. Read alone on XLA:CPU that
  // measured 2.5x slower than the gather (118-146 vs 47-49 us), while a
  // stepped slice (x[:, ::2] of 512x512) was 2.5x faster; inside a graph the
  // transpose usually cancels against the consumer's (attention's kernels
  // take the sequence-major layout), so only standalone reads on XLA:CPU
  // keep the gather.
  if (l.order.empty() || (!transposed_ok && !std::is_sorted(l.order.begin(), l.order.end()))) return std::nullopt;
  Box box;
  box.span = 1;
  for (size_t i = 0; i < l.order.size(); ++i) {
    int64_t s = g.sizes[l.order[i]], t = g.strides[l.order[i]];
    if (t <= 0) return std::nullopt;
    box.span += (s - 1) * t;
    if (i == 0) {
      box.shape.push_back(s);
    } else {
      int64_t outer = g.strides[l.order[i - 1]];
      if (outer <= t || outer % t != 0 || s > outer / t) return std::nullopt;  // overlapping or ragged
      box.shape.push_back(outer / t);
    }
    box.limit.push_back(s);
  }
  int64_t inner = g.strides[l.order.back()];
  if (inner > 1) {
    box.shape.push_back(inner);
    box.limit.push_back(1);
  }
  box.len = g.sizes[l.order[0]] * g.strides[l.order[0]];
  // A sparse view (a column of a wide matrix) would read a window many times
  // its size: the gather is cheaper there.
  if (box.len > 16 * g.numel() + 1024) return std::nullopt;
  return box;
}

// The view's memory window [offset, offset + span) padded to the box and
// reshaped to it (a valid view's span is in bounds; the box may not be).
ir::Value boxWindow(ir::Builder& b, const ir::Value& flat, const ir::Value& offset, const Box& box) {
  ir::Value w = b.dynamicSlice(flat, {offset}, {box.span});
  if (box.len > box.span) w = b.pad(w, b.zeros(ir::Builder::scalarType(w.dtype())), {0}, {box.len - box.span}, {0});
  return b.reshape(w, box.shape);
}

// A block holding the view's elements in memory order (any shape with that
// element order) -> the view as a flat value in logical order, broadcast
// dims expanded.
ir::Value toLogical(ir::Builder& b, const ir::Value& block, const ViewGeometry& g, const Layout& l) {
  ir::Shape mem;
  for (auto d : l.order) mem.push_back(g.sizes[d]);
  ir::Value v = b.reshape(block, mem);
  std::vector<int64_t> logical;  // non-broadcast, non-unit dims in logical order
  for (size_t i = 0; i < g.sizes.size(); ++i)
    if (std::find(l.order.begin(), l.order.end(), static_cast<int64_t>(i)) != l.order.end()) logical.push_back(i);
  std::vector<int64_t> perm;
  for (auto d : logical) perm.push_back(std::find(l.order.begin(), l.order.end(), d) - l.order.begin());
  v = b.transpose(v, perm);
  ir::Value full = b.broadcastInDim(v, g.sizes, logical);
  return b.reshape(full, {g.numel()});
}

// A flat value in the view's logical order -> its elements in memory order,
// shaped [sizes of the memory-ordered dims] (no broadcast dims).
ir::Value toMemoryOrder(ir::Builder& b, const ir::Value& value, const ViewGeometry& g, const Layout& l) {
  std::vector<int64_t> logical;
  ir::Shape logical_shape;
  for (size_t i = 0; i < g.sizes.size(); ++i)
    if (g.sizes[i] != 1) {
      logical.push_back(i);
      logical_shape.push_back(g.sizes[i]);
    }
  ir::Value v = b.reshape(value, logical_shape);
  std::vector<int64_t> perm;  // logical(non-unit) -> memory order
  for (auto d : l.order) perm.push_back(std::find(logical.begin(), logical.end(), d) - logical.begin());
  return b.transpose(v, perm);
}

}  // namespace

// Builds view = storage[offset + ...] as a flat value.
ir::Value buildRead(ir::Builder& b, const ir::Value& flat, const ir::Value& offset, const ViewGeometry& g,
                    bool standalone) {
  int64_t numel = g.numel();
  Layout l = analyze(g);
  if (l.dense) {
    ir::Value block = b.dynamicSlice(flat, {offset}, {l.span});
    return toLogical(b, block, g, l);
  }
  if (auto box = boxOf(g, l, !(standalone && ir::xlaCpuTuning()))) {
    ir::Value window = boxWindow(b, flat, offset, *box);
    ir::Value block = b.slice(window, ir::Shape(box->shape.size(), 0), box->limit, ir::Shape(box->shape.size(), 1));
    return toLogical(b, block, g, l);
  }
  ir::Value idx = b.binary("add", viewIndices(b, g), b.broadcastInDim(offset, g.sizes, {}));
  idx = b.reshape(idx, {numel, 1});
  ir::Builder::GatherDims dn;
  dn.collapsed_slice_dims = {0};
  dn.start_index_map = {0};
  dn.index_vector_dim = 1;
  return b.gather(flat, idx, dn, {1});
}

ir::Value buildWrite(ir::Builder& b, const ir::Value& flat, const ir::Value& value, const ir::Value& offset,
                     const ViewGeometry& g) {
  int64_t numel = g.numel();
  Layout l = analyze(g);
  if (l.dense && l.bcast.empty()) {
    ir::Value v = b.reshape(toMemoryOrder(b, value, g, l), {numel});
    return b.dynamicUpdateSlice(flat, v, {offset});
  }
  // Other views scatter, boxes too: a box write (read the window, update its
  // corner, write it back) was not faster for x[:, ::2] = 0 on XLA:CPU (358 vs
  // 258 us, within this machine's run-to-run noise).
  ir::Value idx = b.binary("add", viewIndices(b, g), b.broadcastInDim(offset, g.sizes, {}));
  idx = b.reshape(idx, {numel, 1});
  ir::Builder::ScatterDims dn;
  dn.inserted_window_dims = {0};
  dn.scatter_dims_to_operand_dims = {0};
  dn.index_vector_dim = 1;
  return b.scatter(flat, idx, value, dn,
                   [](ir::Builder&, const std::vector<ir::Value>& a) { return std::vector<ir::Value>{a[1]}; });
}

void trackPending(int device, std::shared_ptr<pjrt::Event> done);
void setLaunchBlocking(bool on) { g_blocking = on; }
bool launchBlocking() { return g_blocking; }

int64_t ViewGeometry::numel() const {
  int64_t n = 1;
  for (auto s : sizes) n *= s;
  return n;
}

bool ViewGeometry::contiguous() const {
  int64_t expect = 1;
  for (int i = static_cast<int>(sizes.size()) - 1; i >= 0; --i) {
    if (sizes[i] != 1 && strides[i] != expect) return false;
    expect *= sizes[i];
  }
  return true;
}

const DonationPolicy& donationPolicy() {
  static const DonationPolicy policy = [] {
    DonationPolicy d;
    d.enabled = env::notDisabled("TORCH_TPU_DONATE");
    // Donation saves memory; for small buffers that is nothing, while the
    // copies XLA may insert for an aliased param cost time (MLP fused step,
    // buffers of at most 256 KB: 1.62 -> 1.75 ms with all of them donated).
    const char* m = env::get("TORCH_TPU_DONATE_MIN_BYTES");
    if (m && *m) d.min_bytes = std::strtoull(m, nullptr, 10);
    return d;
  }();
  return policy;
}

std::vector<BufferPtr> execute(const Program& p, const std::vector<BufferPtr>& inputs, int device,
                               const std::vector<int>& overwritten) {
  std::vector<PJRT_Buffer*> raw;
  raw.reserve(inputs.size());
  for (const auto& b : inputs) raw.push_back(b->raw());
  // Anyone else holding an aliased input keeps it: the plugin copies it.
  // `donates`, per input: first the references allowed besides `inputs`'
  // (1 for an overwritten argument's array), then whether it is donated.
  std::vector<char> donates;
  std::vector<int64_t> keep;
  if (!p.aliased_params.empty()) {
    donates.assign(inputs.size(), 0);
    for (int i : overwritten) donates[i] = 1;
    for (int i : p.aliased_params) {
      donates[i] = inputs[i].use_count() <= 1 + donates[i];
      if (!donates[i]) keep.push_back(i);
    }
    metrics().donated_buffers += static_cast<int64_t>(p.aliased_params.size() - keep.size());
  }
  std::shared_ptr<pjrt::Event> done;
  bool sync = g_blocking || p.synchronous;
  LaunchScope in_flight(Runtime::get().launchHooks());
  const std::shared_ptr<pjrt::Executable> exe = Runtime::get().executable(p);
  // A program with collectives: this device's replica of the run every participant launches.
  const bool replicated = !p.participants.empty();
  if (replicated) sync = false;
  const int launch = replicated ? nextProgramLaunch(p.participants, device) : 0;
  auto outs = exe->execute(raw, Runtime::get().device(device), sync ? nullptr : &done, keep, launch);
  if (!sync) in_flight.endWhenReady(*done);
  metrics().executions++;
  if (replicated) {
    metrics().replicated_programs++;
    metrics().collectives_in_programs += p.collectives;
    noteProgramLaunch(device, done);
  }
  std::vector<BufferPtr> result;
  result.reserve(outs.size());
  for (auto& o : outs) result.emplace_back(std::move(o));
  if (sync) {
    for (const auto& r : result) r->awaitReady();
    return result;
  }
  // The plugin's handle of a donated buffer blocks its destruction until the
  // program that took the buffer has finished (xla-cpu-pjrt: a compiled
  // optimizer step's launch waited for the step itself). Held here, the
  // handles die when the program is done, and the launch returns at once.
  std::vector<BufferPtr> donated;
  for (int i : p.aliased_params)
    if (donates[i]) donated.push_back(inputs[i]);
  if (!donated.empty()) done->onReady([held = std::move(donated)]() mutable { held.clear(); });
  trackPending(device, std::move(done));
  return result;
}

namespace {
struct Pending {
  std::mutex mu;
  std::unordered_map<int, PendingSet> by_device;
};
Pending& pending() {
  static Pending p;
  return p;
}
}  // namespace

void trackPending(int device, std::shared_ptr<pjrt::Event> done) {
  auto& p = pending();
  std::lock_guard<std::mutex> g(p.mu);
  auto& v = p.by_device[device];
  v.push_back(std::move(done));
  if (v.size() >= 1024) {  // drop the executions that have finished
    PendingSet keep;
    for (auto& e : v)
      if (!e->isReady()) keep.push_back(e);
    v.swap(keep);
  }
}

PendingSet pendingSnapshot(int device) {
  auto& p = pending();
  std::lock_guard<std::mutex> g(p.mu);
  return p.by_device[device];
}

bool allReady(const PendingSet& s) {
  for (const auto& e : s)
    if (!e->isReady()) return false;
  return true;
}

void awaitAll(const PendingSet& s) {
  for (const auto& e : s) e->await("device computation");
}

namespace {
struct IndexChecks {
  std::mutex mu;
  std::vector<std::pair<BufferPtr, std::string>> pending;
};
IndexChecks& indexChecks() {
  static IndexChecks c;
  return c;
}
}  // namespace

void checkIndicesLater(const BufferPtr& ok, const std::string& op, int device) {
  {
    auto& c = indexChecks();
    std::lock_guard<std::mutex> g(c.mu);
    c.pending.emplace_back(ok, op);
  }
  if (g_blocking) checkPendingIndices();
}

void checkPendingIndices(bool finished_only) {
  std::vector<std::pair<BufferPtr, std::string>> todo;
  {
    auto& c = indexChecks();
    std::lock_guard<std::mutex> g(c.mu);
    if (c.pending.empty()) return;
    if (finished_only) {
      // Checks of programs still running stay pending, so that a read does
      // not wait for work queued after what it reads.
      auto running = std::stable_partition(c.pending.begin(), c.pending.end(),
                                           [](const auto& check) { return !check.first->isReady(); });
      todo.assign(std::make_move_iterator(running), std::make_move_iterator(c.pending.end()));
      c.pending.erase(running, c.pending.end());
    } else {
      todo.swap(c.pending);
    }
  }
  for (const auto& [buf, op] : todo) {
    uint8_t ok = 1;
    Runtime::get().read(*buf, &ok, 1);  // in place on the CPU plugin: no copy task, no thread hand-off
    if (ok) continue;
    const std::string msg = "index out of range in " + op +
                            ": an index is outside the size of the dimension it indexes (the check ran at a "
                            "host read after the op; set TPU_LAUNCH_BLOCKING=1 to raise at the op itself)";
    // These CPU kernels refuse such an index with a RuntimeError, not an IndexError.
    if (op.find("embedding_bag") != std::string::npos || op.find("padded_dense_to_jagged") != std::string::npos)
      throw std::runtime_error(msg);
    throw std::out_of_range(msg);
  }
}

void synchronize(int device) {
  if (auto flush = pendingHooks().flush) flush(device);
  checkPendingIndices();
  PendingSet s;
  {
    auto& p = pending();
    std::lock_guard<std::mutex> g(p.mu);
    s.swap(p.by_device[device]);
  }
  awaitAll(s);
}

// A pending array (fused eager) is computed before its buffer is used.
void flushIfLazy(DeviceArray& a) {
  if (a.lazy()) pendingHooks().flush(a.device());
  if (!a.error().empty()) throw std::runtime_error(a.error());
}

void ensureTyped(DeviceArray& a, ir::DType t) {
  flushIfLazy(a);
  int64_t n = static_cast<int64_t>(a.nbytes() / ir::itemSize(t));
  if (!a.materialized()) {
    static ProgramCache zeros;
    std::string key = std::to_string(static_cast<int>(t)) + ":" + std::to_string(n);
    auto p = cached(zeros, key, [&](ir::Builder& b) { b.output(b.constant(0.0, t, {n})); }, "zeros");
    a.set(execute(*p, {}, a.device())[0], t, n);
    return;
  }
  if (a.dtype() == t) return;
  static ProgramCache casts;
  int64_t from_n = a.numel();
  ir::DType from = a.dtype();
  std::string key =
      std::to_string(static_cast<int>(from)) + ">" + std::to_string(static_cast<int>(t)) + ":" + std::to_string(from_n);
  auto p = cached(
      casts, key, [&](ir::Builder& b) { b.output(reinterpret(b, b.param({from, {from_n}}), t)); }, "reinterpret");
  auto out = execute(*p, {a.buffer()}, a.device())[0];
  a.set(out, t, p->out_types[0].shape[0]);
}

BufferPtr readView(DeviceArray& a, const ViewGeometry& g) {
  flushIfLazy(a);
  ensureTyped(a, g.dtype);
  int64_t numel = g.numel();
  if (numel == a.numel() && g.offset == 0 && g.contiguous()) return a.buffer();
  static ProgramCache reads;
  int64_t n = a.numel();
  auto p = cached(
      reads, geomKey(g, n),
      [&](ir::Builder& b) {
        ir::Value flat = b.param({g.dtype, {n}});
        ir::Value off = b.param({ir::DType::I64, {}});
        b.output(numel == 0 ? b.constant(0.0, g.dtype, {0}) : buildRead(b, flat, off, g, /*standalone=*/true));
      },
      "view_read");
  return execute(*p, {a.buffer(), scalarBufferInt(ir::DType::I64, g.offset, a.device())}, a.device())[0];
}

void writeView(DeviceArray& a, const ViewGeometry& g, const BufferPtr& value) {
  int64_t numel = g.numel();
  int64_t n_as = static_cast<int64_t>(a.nbytes() / ir::itemSize(g.dtype));
  if (numel == 0) return;
  if (numel == n_as && g.offset == 0 && g.contiguous()) {
    a.set(value, g.dtype, numel);  // a full overwrite needs none of the old contents
    return;
  }
  flushIfLazy(a);
  ensureTyped(a, g.dtype);
  static ProgramCache writes;
  int64_t n = a.numel();
  auto p = cached(
      writes, geomKey(g, n),
      [&](ir::Builder& b) {
        ir::Value flat = b.param({g.dtype, {n}});
        ir::Value val = b.param({g.dtype, {numel}});
        ir::Value off = b.param({ir::DType::I64, {}});
        b.output(buildWrite(b, flat, val, off, g));
      },
      "view_write");
  auto out = execute(*p, {a.buffer(), value, scalarBufferInt(ir::DType::I64, g.offset, a.device())}, a.device())[0];
  a.set(out, g.dtype, n);
}

void fillRange(DeviceArray& a, ir::DType t, int64_t begin, int64_t end, const BufferPtr& value) {
  if (begin >= end) return;
  flushIfLazy(a);
  ensureTyped(a, t);
  static ProgramCache fills;
  const int64_t n = a.numel();
  auto p = cached(
      fills, std::to_string(static_cast<int>(t)) + ":" + std::to_string(n),
      [&](ir::Builder& b) {
        ir::Value flat = b.param({t, {n}});
        ir::Value lo = b.broadcastTo(b.param({ir::DType::I64, {}}), {n});
        ir::Value hi = b.broadcastTo(b.param({ir::DType::I64, {}}), {n});
        ir::Value v = b.broadcastTo(b.param({t, {}}), {n});
        ir::Value i = b.iota({ir::DType::I64, {n}}, 0);
        ir::Value inside = b.binary("and", b.compare(i, lo, ir::Cmp::GE), b.compare(i, hi, ir::Cmp::LT));
        b.output(b.select(inside, v, flat));
      },
      "fill_range");
  auto out = execute(*p,
                     {a.buffer(), scalarBufferInt(ir::DType::I64, begin, a.device()),
                      scalarBufferInt(ir::DType::I64, end, a.device()), value},
                     a.device())[0];
  a.set(out, t, n);
}

namespace {
// A small LRU of scalar buffers: optimizers and schedulers pass the same few
// scalars to every op, and uploading them each time costs a transfer.
struct ScalarCache {
  std::mutex mu;
  std::list<std::string> order;
  std::unordered_map<std::string, std::pair<BufferPtr, std::list<std::string>::iterator>> map;
  BufferPtr get(const std::string& key, const std::function<BufferPtr()>& make) {
    std::lock_guard<std::mutex> g(mu);
    auto it = map.find(key);
    if (it != map.end()) {
      order.splice(order.begin(), order, it->second.second);
      return it->second.first;
    }
    BufferPtr b = make();
    order.push_front(key);
    map[key] = {b, order.begin()};
    if (map.size() > 4096) {
      map.erase(order.back());
      order.pop_back();
    }
    return b;
  }
};
ScalarCache& scalarCache() {
  static ScalarCache c;
  return c;
}

template <typename T>
BufferPtr uploadScalar(ir::DType t, T v, int device) {
  return Runtime::get().upload(&v, t, {}, device);
}
}  // namespace

BufferPtr scalarBuffer(ir::DType t, double v, int device) {
  if (!ir::isFloat(t)) return scalarBufferInt(t, static_cast<int64_t>(v), device);
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  std::string key =
      "f" + std::to_string(static_cast<int>(t)) + ":" + std::to_string(bits) + "@" + std::to_string(device);
  return scalarCache().get(key, [&]() -> BufferPtr {
    switch (t) {
      case ir::DType::F64:
        return uploadScalar<double>(t, v, device);
      case ir::DType::F32:
        return uploadScalar<float>(t, static_cast<float>(v), device);
      default: {
        // f16/bf16: upload as f64 and convert on the device.
        static ProgramCache conv;
        auto p = cached(
            conv, std::to_string(static_cast<int>(t)),
            [&](ir::Builder& b) { b.output(b.convert(b.param({ir::DType::F64, {}}), t)); }, "scalar_convert");
        return execute(*p, {uploadScalar<double>(ir::DType::F64, v, device)}, device)[0];
      }
    }
  });
}

BufferPtr scalarBufferInt(ir::DType t, int64_t v, int device) {
  if (ir::isFloat(t)) return scalarBuffer(t, static_cast<double>(v), device);
  std::string key = "i" + std::to_string(static_cast<int>(t)) + ":" + std::to_string(v) + "@" + std::to_string(device);
  return scalarCache().get(key, [&]() -> BufferPtr {
    switch (t) {
      case ir::DType::Bool:
        return uploadScalar<uint8_t>(t, v != 0, device);
      case ir::DType::U8:
        return uploadScalar<uint8_t>(t, static_cast<uint8_t>(v), device);
      case ir::DType::I8:
        return uploadScalar<int8_t>(t, static_cast<int8_t>(v), device);
      case ir::DType::I16:
        return uploadScalar<int16_t>(t, static_cast<int16_t>(v), device);
      case ir::DType::I32:
        return uploadScalar<int32_t>(t, static_cast<int32_t>(v), device);
      case ir::DType::U16:
        return uploadScalar<uint16_t>(t, static_cast<uint16_t>(v), device);
      case ir::DType::U32:
        return uploadScalar<uint32_t>(t, static_cast<uint32_t>(v), device);
      case ir::DType::U64:
        return uploadScalar<uint64_t>(t, static_cast<uint64_t>(v), device);
      default:
        return uploadScalar<int64_t>(t, v, device);
    }
  });
}

}  // namespace tpu::runtime
