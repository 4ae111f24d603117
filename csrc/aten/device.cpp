// The tpu device in PyTorch: allocator, device guard, hooks, generator, and
// the tensor <-> device-array helpers every other aten/ file uses.
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_set>

#include "aten/tpu.h"
#include "ops/lowering.h"
#include "runtime/env.h"

namespace tpu::aten {

// ---------------------------------------------------------------- dtypes

ir::DType toIr(at::ScalarType t) {
  switch (t) {
    case at::kBool:
      return ir::DType::Bool;
    case at::kByte:
      return ir::DType::U8;
    case at::kChar:
      return ir::DType::I8;
    case at::kShort:
      return ir::DType::I16;
    case at::kInt:
      return ir::DType::I32;
    case at::kLong:
      return ir::DType::I64;
    case at::kHalf:
      return ir::DType::F16;
    case at::kBFloat16:
      return ir::DType::BF16;
    case at::kFloat:
      return ir::DType::F32;
    case at::kDouble:
      return ir::DType::F64;
    case at::kComplexFloat:
      return ir::DType::C64;
    case at::kComplexDouble:
      return ir::DType::C128;
    case at::kUInt16:
      return ir::DType::U16;
    case at::kUInt32:
      return ir::DType::U32;
    case at::kUInt64:
      return ir::DType::U64;
    default:
      throw ir::Unsupported(std::string("dtype ") + c10::toString(t) + " is not supported on tpu");
  }
}

at::ScalarType toAten(ir::DType t) {
  switch (t) {
    case ir::DType::Bool:
      return at::kBool;
    case ir::DType::U8:
      return at::kByte;
    case ir::DType::I8:
      return at::kChar;
    case ir::DType::I16:
      return at::kShort;
    case ir::DType::I32:
      return at::kInt;
    case ir::DType::I64:
      return at::kLong;
    case ir::DType::F16:
      return at::kHalf;
    case ir::DType::BF16:
      return at::kBFloat16;
    case ir::DType::F32:
      return at::kFloat;
    case ir::DType::F64:
      return at::kDouble;
    case ir::DType::C64:
      return at::kComplexFloat;
    case ir::DType::C128:
      return at::kComplexDouble;
    case ir::DType::U16:
      return at::kUInt16;
    case ir::DType::U32:
      return at::kUInt32;
    case ir::DType::U64:
      return at::kUInt64;
  }
  return at::kFloat;
}

bool supported(at::ScalarType t) {
  ir::DType d;
  try {
    d = toIr(t);
  } catch (const ir::Unsupported&) {
    return false;
  }
  return runtime::Runtime::get().computes(d);  // the plugin's compiler decides (a TPU: no float64, no complex128)
}

std::string supportedDtypes() {
  std::string out;
  for (auto t : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kComplexFloat, at::kComplexDouble, at::kLong,
                 at::kInt, at::kShort, at::kChar, at::kByte, at::kUInt16, at::kUInt32, at::kUInt64, at::kBool})
    if (supported(t)) out += (out.empty() ? "" : ", ") + std::string(ir::dtypeName(toIr(t)));
  return out;
}

// ---------------------------------------------------------------- errors

void rethrow(const std::exception& e, const std::string& context) {
  if (auto* oom = dynamic_cast<const runtime::OutOfMemory*>(&e)) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, oom->what());
  }
  if (auto* pe = dynamic_cast<const pjrt::PluginError*>(&e)) {
    TORCH_CHECK(false, "torch_tpu: ", pe->what());
  }
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) throw *ce;  // keep PyTorch's own type
  if (dynamic_cast<const std::out_of_range*>(&e)) TORCH_CHECK_INDEX(false, e.what());
  if (dynamic_cast<const ir::NotImplementedForDtype*>(&e))
    TORCH_CHECK_NOT_IMPLEMENTED(false, context.empty() ? "" : context + ": ", e.what());
  TORCH_CHECK(false, context.empty() ? "" : context + ": ", e.what());
}

namespace {
std::atomic<int> g_fallback_error{-1};
}
bool fallbackIsError() {
  int v = g_fallback_error.load();
  if (v < 0) {
    const char* e = env::get("TORCH_TPU_FALLBACK");
    v = (e && std::string(e) == "error") ? 1 : 0;
    g_fallback_error = v;
  }
  return v == 1;
}
void setFallbackError(bool on) { g_fallback_error = on ? 1 : 0; }

namespace {
std::mutex g_disabled_mu;
std::shared_ptr<const std::unordered_set<std::string>> g_disabled;  // null until first use
std::shared_ptr<const std::unordered_set<std::string>> disabledSet() {
  std::lock_guard<std::mutex> lock(g_disabled_mu);
  if (!g_disabled) {
    const auto names = env::list("TORCH_TPU_DISABLE_LOWERINGS");
    g_disabled = std::make_shared<std::unordered_set<std::string>>(names.begin(), names.end());
  }
  return g_disabled;
}
}  // namespace
bool loweringDisabled(const std::string& base) {
  auto s = disabledSet();
  return !s->empty() && s->count(base) > 0;
}
void setDisabledLowerings(std::vector<std::string> names) {
  auto s = std::make_shared<std::unordered_set<std::string>>(names.begin(), names.end());
  {
    std::lock_guard<std::mutex> lock(g_disabled_mu);
    g_disabled = std::move(s);
  }
  opTablesChanged();
}
std::vector<std::string> disabledLowerings() {
  auto s = disabledSet();
  return {s->begin(), s->end()};
}

namespace {
std::atomic<uint64_t> g_op_tables_generation{1};
}  // namespace
void opTablesChanged() { g_op_tables_generation.fetch_add(1, std::memory_order_acq_rel); }
uint64_t opTablesGeneration() { return g_op_tables_generation.load(std::memory_order_acquire); }

// ---------------------------------------------------------------- devices

namespace {
thread_local c10::DeviceIndex t_current = -1;  // -1: the process's default device

runtime::Runtime& rt() {
  try {
    return runtime::Runtime::get();
  } catch (const std::exception& e) {
    rethrow(e, "torch_tpu could not start its runtime");
  }
}
}  // namespace

// The device a thread starts on: tpu:LOCAL_RANK where torchrun (or a launcher like it)
// started one process per device and this process sees them all, as
// `torch.cuda.set_device(local_rank)` would; else tpu:0 (also where the launcher gave the
// process its devices: TPU_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS, Ray's way).
c10::DeviceIndex defaultDevice() {
  static const c10::DeviceIndex d = [] {
    if (tpu::env::get("TPU_VISIBLE_DEVICES") || tpu::env::get("TPU_VISIBLE_CHIPS")) return c10::DeviceIndex{0};
    const char* v = tpu::env::get("LOCAL_RANK");
    char* end = nullptr;
    const long long local_rank = v && *v ? std::strtoll(v, &end, 10) : 0;
    if (v && *v && *end) return static_cast<c10::DeviceIndex>(0);  // not a number: not torchrun's
    return static_cast<c10::DeviceIndex>(local_rank > 0 && local_rank < rt().deviceCount() ? local_rank : 0);
  }();
  return d;
}

c10::DeviceIndex currentDevice() { return t_current >= 0 ? t_current : defaultDevice(); }

void checkDeviceIndex(c10::DeviceIndex d) {
  int n = rt().deviceCount();
  const std::string last = n > 1 ? " to tpu:" + std::to_string(n - 1) : std::string();
  TORCH_CHECK(d >= 0 && d < n, "Invalid device tpu:", static_cast<int>(d), ": torch_tpu has ", n, " device(s) (tpu:0",
              last, "). TORCH_TPU_CPU_DEVICES sets how many the CPU plugin exposes.");
}

// ---------------------------------------------------------------- allocator

namespace {
// The live arrays by address: PyTorch's own code wraps a tpu storage's address
// in a storage it does not own (legacy torch.save and pickling use from_blob
// on the device), and such a storage at a live array's address is that array.
std::mutex g_live_mu;
std::unordered_set<const void*> g_live;

void deleteArray(void* p) {
  {
    std::lock_guard<std::mutex> g(g_live_mu);
    g_live.erase(p);
  }
  delete static_cast<runtime::DeviceArray*>(p);
}

// Allocation is lazy: a device array gets its buffer on first write, so
// `empty` of any size is cheap (transformers' allocator warm-up relies on it).
// A DeviceAllocator, so that torch.accelerator's memory API (memory_stats,
// memory_allocated, empty_cache, ...) and what calls it (accelerate's
// clear_device_cache, the Trainer) work on tpu as on cuda.
struct TpuAllocator final : public c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex d = currentDevice();
    runtime::DeviceArray* a = nullptr;
    try {
      a = new runtime::DeviceArray(d, nbytes);
    } catch (const std::exception& e) {
      rethrow(e, "");
    }
    {
      std::lock_guard<std::mutex> g(g_live_mu);
      g_live.insert(a);
    }
    return {a, a, &deleteArray, c10::Device(kTpu, d)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &deleteArray; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    TORCH_CHECK(false, "torch_tpu: device memory cannot be copied through raw pointers");
  }

  bool initialized() override { return runtime::Runtime::initialized(); }
  // Device buffers are freed when their last tensor dies; what stays cached
  // is the CPU plugin's freed heap memory, which goes back to the system.
  void emptyCache(c10::MempoolId_t /*pool*/) override {
    if (initialized()) rt().releaseFreeMemory();
  }
  // A program holds the buffers it reads until it finishes, whichever stream
  // launched it, so a freed tensor's memory is never reused under it.
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex d) override {
    checkDeviceIndex(d);
    const runtime::Runtime::MemoryStats m = rt().memoryStats(d);
    c10::CachingDeviceAllocator::DeviceStats s;
    // Every array is its own allocation (no pool): reserved, active and
    // requested bytes are the allocated bytes, and segments are arrays.
    c10::CachingAllocator::Stat bytes{m.bytes, m.peak_bytes, m.allocated_bytes, m.freed_bytes};
    c10::CachingAllocator::Stat arrays{m.arrays, m.peak_arrays, m.allocations, m.frees};
    constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    for (auto* stat : {&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes, &s.requested_bytes})
      (*stat)[kAll] = bytes;
    for (auto* stat : {&s.allocation, &s.segment, &s.active}) (*stat)[kAll] = arrays;
    s.num_device_alloc = m.allocations;
    s.num_device_free = m.frees;
    return s;
  }
  void resetAccumulatedStats(c10::DeviceIndex d) override {
    checkDeviceIndex(d);
    rt().resetAccumulated(d);
  }
  void resetPeakStats(c10::DeviceIndex d) override {
    checkDeviceIndex(d);
    rt().resetPeak(d);
  }
  // (free, total): the memory limit is the total (TORCH_TPU_MEMORY_LIMIT).
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex d) override {
    checkDeviceIndex(d);
    const auto total = static_cast<size_t>(rt().memoryLimit(d));
    return {total - static_cast<size_t>(rt().allocated(d)), total};
  }
};
TpuAllocator g_allocator;
}  // namespace

c10::Allocator* allocator() { return &g_allocator; }

// ---------------------------------------------------------------- DLPack

namespace {
// Tensors exported through DLPack, by the address the capsule carries (the
// tensor's data_ptr: its array's address plus its offset): torch.from_dlpack
// makes a tpu tensor over that address with the capsule as owner, and
// adoptExported turns it back into a view of the exporter's storage. Weak: an
// entry keeps nothing alive (the capsule does); dead entries are pruned.
std::mutex g_exported_mu;
std::unordered_map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>> g_exported;

c10::intrusive_ptr<c10::StorageImpl> exportedStorage(const void* p) {
  std::lock_guard<std::mutex> g(g_exported_mu);
  auto it = g_exported.find(p);
  return it == g_exported.end() ? c10::intrusive_ptr<c10::StorageImpl>() : it->second.lock();
}

// The array behind a storage, or null for a zero-byte storage without one.
// Memory torch_tpu did not allocate is an error, never a read through a
// pointer that is not an array; a storage over an exported tensor's address
// at offset 0 is that tensor's array.
runtime::DeviceArray* arrayOfStorage(const c10::StorageImpl& s) {
  const c10::DataPtr& dp = s.data_ptr();
  if (dp.get_deleter() == &deleteArray) return static_cast<runtime::DeviceArray*>(dp.get_context());
  if (s.nbytes() == 0) return nullptr;  // nothing to read: arrayOf gives it an array of its own
  if (auto src = exportedStorage(dp.get()); src && src->data() == dp.get()) return arrayOfStorage(*src);
  {
    std::lock_guard<std::mutex> g(g_live_mu);
    if (g_live.count(dp.get())) return static_cast<runtime::DeviceArray*>(dp.get());
  }
  TORCH_CHECK(false, "torch_tpu: this tpu tensor's memory was not allocated by torch_tpu (from_blob on a tpu ",
              "device, a storage slice, or a DLPack capsule that torch.from_dlpack did not take in); only tpu ",
              "tensors made by torch_tpu, or shared from one whole, can be read or written");
}
}  // namespace

void noteExported(const at::Tensor& t) {
  if (t.numel() == 0) return;
  std::lock_guard<std::mutex> g(g_exported_mu);
  if (g_exported.size() >= 64) {
    for (auto it = g_exported.begin(); it != g_exported.end();) it = it->second.expired() ? g_exported.erase(it) : ++it;
  }
  g_exported.insert_or_assign(t.data_ptr(), t.storage().getWeakStorageImpl());
}

at::Tensor adoptExported(const at::Tensor& t) {
  if (t.device().type() != kTpu || t.numel() == 0 || t.storage().data_ptr().get_deleter() == allocator()->raw_deleter())
    return t;
  const char* p = static_cast<const char*>(t.storage().data_ptr().get());
  auto src = exportedStorage(p);
  if (!src) return t;  // reading it raises arrayOfStorage's error
  const auto item = static_cast<int64_t>(t.dtype().itemsize());
  const int64_t bytes = p - static_cast<const char*>(src->data());
  if (bytes % item != 0) return t;
  at::Tensor out = at::empty({0}, t.options());
  out.set_(c10::Storage(std::move(src)), bytes / item + t.storage_offset(), t.sizes(), t.strides());
  return out;
}

runtime::DeviceArray& arrayOf(const at::Tensor& t) {
  void* p = arrayOfStorage(*t.storage().unsafeGetStorageImpl());
  TORCH_CHECK(p != nullptr || t.storage().nbytes() == 0, "torch_tpu: tensor has no device storage");
  if (!p) {
    // A zero-byte storage created outside the allocator: give it one.
    auto dp = g_allocator.allocate(0);
    t.storage().unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(dp));
    p = t.storage().data_ptr().get_context();
  }
  return *static_cast<runtime::DeviceArray*>(p);
}

runtime::ViewGeometry geometryOf(const at::Tensor& t) {
  runtime::ViewGeometry g;
  g.dtype = toIr(t.scalar_type());
  g.sizes = t.sizes().vec();
  g.strides = t.strides().vec();
  g.offset = t.storage_offset();
  return g;
}

runtime::BufferPtr readTensor(const at::Tensor& t) {
  try {
    return runtime::readView(arrayOf(t), geometryOf(t));
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e, "torch_tpu: reading a tensor");
  }
}

void writeTensor(const at::Tensor& t, const runtime::BufferPtr& b) {
  try {
    runtime::writeView(arrayOf(t), geometryOf(t), b);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e, "torch_tpu: writing a tensor");
  }
}

at::Tensor emptyTpu(at::IntArrayRef sizes, at::ScalarType dtype, c10::DeviceIndex device) {
  c10::DeviceIndex prev = t_current;
  t_current = device;
  at::Tensor t;
  try {
    t = at::detail::empty_generic(sizes, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype,
                                  std::nullopt);
  } catch (...) {
    t_current = prev;
    throw;
  }
  t_current = prev;
  return t;
}

at::Tensor wrapBuffer(runtime::BufferPtr b, at::IntArrayRef sizes, at::ScalarType dtype, c10::DeviceIndex device,
                      at::OptionalIntArrayRef strides) {
  at::Tensor t = emptyTpu(sizes, dtype, device);
  if (strides) t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, *strides);
  int64_t n = t.numel();
  if (n > 0) arrayOf(t).set(std::move(b), toIr(dtype), n);
  return t;
}

// ---------------------------------------------------------------- copies

ir::Value applyMathBits(ir::Builder& b, ir::Value x, bool conj, bool neg) {
  if (conj && ir::isComplex(x.dtype())) x = b.complex(b.real(x), b.unary("negate", b.imag(x)));
  if (neg) x = b.unary("negate", x);
  return x;
}

namespace {

// Converts and broadcasts a dense buffer (cached per signature), applying
// the conj/neg bits asked for.
runtime::BufferPtr convertBuffer(const runtime::BufferPtr& b, ir::DType from, const std::vector<int64_t>& from_shape,
                                 ir::DType to, const std::vector<int64_t>& to_shape, int device, bool conj = false,
                                 bool neg = false) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<runtime::Program>> cache;
  std::string key = std::to_string(int(from)) + ">" + std::to_string(int(to)) + ":" + ir::shapeStr(from_shape) + ">" +
                    ir::shapeStr(to_shape) + (conj ? "c" : "") + (neg ? "n" : "");
  std::shared_ptr<runtime::Program> p;
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = cache.find(key);
    if (it != cache.end()) p = it->second;
  }
  if (!p) {
    ir::Builder bl;
    int64_t n = 1;
    for (auto d : from_shape) n *= d;
    int64_t m = 1;
    for (auto d : to_shape) m *= d;
    ir::Value x = bl.reshape(bl.param({from, {n}}), from_shape);
    x = bl.broadcastTo(bl.convert(applyMathBits(bl, x, conj, neg), to), to_shape);
    bl.output(bl.reshape(x, {m}));
    p = runtime::Runtime::get().compile(bl, "copy_");
    runtime::noteCompile("copy_", "first conversion " + key);
    std::lock_guard<std::mutex> g(mu);
    cache[key] = p;
  }
  return runtime::execute(*p, {b}, device)[0];
}
}  // namespace

namespace {
DeferredCopies g_deferred;  // constant-initialised; fused eager installs its hooks at static initialisation
}  // namespace

void setDeferredCopies(const DeferredCopies& hooks) { g_deferred = hooks; }

void copyInto(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.numel() == 0) return;
  try {
    if (g_deferred.record && g_deferred.record(dst, src)) return;
    if (dst.device().type() == kTpu && src.device().type() == kTpu && dst.device() == src.device()) {
      runtime::BufferPtr b = readTensor(src);
      auto sd = toIr(src.scalar_type()), dd = toIr(dst.scalar_type());
      bool conj = src.is_conj() != dst.is_conj(), neg = src.is_neg() != dst.is_neg();
      if (sd != dd || src.sizes() != dst.sizes() || conj || neg)
        b = convertBuffer(b, sd, src.sizes().vec(), dd, dst.sizes().vec(), dst.device().index(), conj, neg);
      writeTensor(dst, b);
      return;
    }
    if (dst.device().type() == kTpu) {
      // From the host (or another tpu device, through the host).
      at::Tensor host = src.device().type() == kTpu ? src.to(at::kCPU) : src;
      TORCH_CHECK(host.device().is_cpu(), "torch_tpu: cannot copy from ", src.device(), " to ", dst.device());
      at::Tensor c = host.resolve_conj().resolve_neg().to(dst.scalar_type());
      if (dst.is_conj()) c = c.conj_physical();
      if (dst.is_neg()) c = c.neg();
      c = c.expand(dst.sizes()).contiguous();
      auto b = rt().upload(c.data_ptr(), toIr(dst.scalar_type()), {c.numel()}, dst.device().index());
      writeTensor(dst, b);
      return;
    }
    TORCH_CHECK(dst.device().is_cpu(), "torch_tpu: cannot copy from ", src.device(), " to ", dst.device());
    // Fused eager: the host is about to wait, so whatever is pending starts
    // now, even if `src` does not need it. In a training loop that reads the
    // loss, the backward and optimizer ops recorded after the loss then run
    // while the host records the next step, instead of joining its graph.
    if (g_deferred.host_read) g_deferred.host_read(src.device().index());
    runtime::BufferPtr b = readTensor(src);
    at::Tensor host = at::empty(src.sizes(), src.options().device(at::kCPU).dtype(src.scalar_type()));
    if (host.numel() > 0) rt().download(*b, host.data_ptr(), host.nbytes());
    // The download holds src's memory; its bits say what that memory means.
    if (src.is_conj()) host = host.conj();
    if (src.is_neg()) host = host._neg_view();
    dst.copy_(host);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e, "torch_tpu: copy");
  }
}

// ---------------------------------------------------------------- storage resize

void resizeStorageBytes(c10::StorageImpl* storage, size_t nbytes) {
  size_t old = storage->nbytes();
  if (nbytes == old) return;
  runtime::DeviceArray* old_arr = arrayOfStorage(*storage);
  if (old_arr) runtime::flushIfLazy(*old_arr);
  c10::DeviceIndex dev = storage->device().index();
  c10::DeviceIndex prev = t_current;
  t_current = dev;
  c10::DataPtr dp;
  try {
    dp = g_allocator.allocate(nbytes);
  } catch (...) {
    t_current = prev;
    throw;
  }
  t_current = prev;
  auto* arr = static_cast<runtime::DeviceArray*>(dp.get_context());
  if (old_arr && old_arr->materialized() && nbytes > 0) {
    // Keep the old contents: pad or truncate in the old element type.
    ir::DType t = old_arr->dtype();
    size_t isz = ir::itemSize(t);
    int64_t n_old = old_arr->numel();
    int64_t n_new = static_cast<int64_t>(nbytes / isz);
    if (n_new * isz == nbytes) {
      ir::Builder b;
      ir::Value x = b.param({t, {n_old}});
      ir::Value y =
          n_new >= n_old ? b.pad(x, b.constant(0.0, t), {0}, {n_new - n_old}, {0}) : b.slice(x, {0}, {n_new}, {1});
      b.output(y);
      auto p = rt().compile(b, "resize_");
      arr->set(runtime::execute(*p, {old_arr->buffer()}, dev)[0], t, n_new);
    }
  }
  storage->set_data_ptr_noswap(std::move(dp));
  storage->set_nbytes(nbytes);
}

// ---------------------------------------------------------------- generator

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

TpuGenerator::TpuGenerator(c10::DeviceIndex device)
    : c10::GeneratorImpl(c10::Device(kTpu, device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}
void TpuGenerator::set_current_seed(uint64_t seed) {
  seed_ = seed;
  offset_ = 0;
}
void TpuGenerator::set_offset(uint64_t offset) { offset_ = offset; }
uint64_t TpuGenerator::get_offset() const { return offset_; }
uint64_t TpuGenerator::current_seed() const { return seed_; }
uint64_t TpuGenerator::seed() {
  uint64_t s = c10::detail::getNonDeterministicRandom();
  set_current_seed(s);
  return s;
}
void TpuGenerator::set_state(const c10::TensorImpl& new_state) {
  // As the CPU and CUDA generators: a CPU ByteTensor (TypeError otherwise), so
  // a state moved to the device (a checkpoint loaded with map_location="tpu")
  // is refused instead of read as the bytes of a device handle.
  at::detail::check_rng_state(new_state);
  TORCH_CHECK(new_state.numel() == 16 && new_state.dtype() == caffe2::TypeMeta::Make<uint8_t>(),
              "torch_tpu: an RNG state is a uint8 tensor of 16 bytes (seed, offset), got ", new_state.numel(),
              " elements");
  const auto* p = static_cast<const uint8_t*>(new_state.data());
  std::memcpy(&seed_, p, 8);
  std::memcpy(&offset_, p + 8, 8);
}
c10::intrusive_ptr<c10::TensorImpl> TpuGenerator::get_state() const {
  at::Tensor s = at::empty({16}, at::kByte);
  std::memcpy(s.data_ptr(), &seed_, 8);
  std::memcpy(static_cast<uint8_t*>(s.data_ptr()) + 8, &offset_, 8);
  return s.getIntrusivePtr();
}
TpuGenerator* TpuGenerator::clone_impl() const {
  auto* g = new TpuGenerator(device().index());
  g->seed_ = seed_;
  g->offset_ = offset_;
  return g;
}
std::array<uint64_t, 2> TpuGenerator::next() {
  uint64_t o = offset_++;
  return {splitmix64(seed_ ^ splitmix64(o)), 0};
}

const at::Generator& defaultGenerator(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::vector<at::Generator> gens;
  std::lock_guard<std::mutex> g(mu);
  if (gens.empty()) {
    int n = rt().deviceCount();
    for (int i = 0; i < n; ++i) gens.push_back(at::make_generator<TpuGenerator>(static_cast<c10::DeviceIndex>(i)));
  }
  c10::DeviceIndex d = device < 0 ? currentDevice() : device;
  TORCH_CHECK(d >= 0 && d < static_cast<int>(gens.size()), "Invalid device tpu:", static_cast<int>(d));
  return gens[d];
}

// ---------------------------------------------------------------- guard

namespace {
struct TpuEvent {
  runtime::PendingSet pending;
  std::chrono::steady_clock::time_point recorded;
  bool was_recorded = false;
};

struct TpuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kTpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old(kTpu, currentDevice());
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kTpu, currentDevice()); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kTpu, "torch_tpu: expected a tpu device, got ", d);
    if (d.index() >= 0) {
      checkDeviceIndex(d.index());
      t_current = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) t_current = d.index();
  }
  // PJRT orders work on a device by data dependencies; all streams of a
  // device share that order, so a stream is a name and waiting on it waits
  // for the device.
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kTpu, d.index() < 0 ? currentDevice() : d.index()));
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return getStream(d); }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    static std::atomic<int64_t> next{1};
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kTpu, d.index() < 0 ? currentDevice() : d.index()), next++);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high) const override { return getNewStream(d, 0); }
  c10::Stream exchangeStream(c10::Stream s) const override { return getStream(s.device()); }
  c10::DeviceIndex deviceCount() const noexcept override {
    try {
      return static_cast<c10::DeviceIndex>(runtime::Runtime::get().deviceCount());
    } catch (...) {
      return 0;
    }
  }
  bool queryStream(const c10::Stream& s) const override {
    return runtime::allReady(runtime::pendingSnapshot(s.device_index()));
  }
  void synchronizeStream(const c10::Stream& s) const override { synchronizeDevice(s.device_index()); }
  void synchronizeDevice(const c10::DeviceIndex d) const override {
    try {
      runtime::synchronize(d < 0 ? currentDevice() : d);
    } catch (const std::exception& e) {
      rethrow(e, "torch_tpu: a device computation failed");
    }
  }
  void record(void** event, const c10::Stream& s, const c10::DeviceIndex d, const c10::EventFlag) const override {
    auto* ev = static_cast<TpuEvent*>(*event);
    if (!ev) {
      ev = new TpuEvent();
      *event = ev;
    }
    ev->pending = runtime::pendingSnapshot(s.device_index());
    ev->was_recorded = true;
    ev->recorded = std::chrono::steady_clock::now();
  }
  void block(void* event, const c10::Stream& s) const override {
    // Work on any stream already follows its inputs' producers: nothing to do.
  }
  bool queryEvent(void* event) const override {
    auto* ev = static_cast<TpuEvent*>(event);
    return !ev || runtime::allReady(ev->pending);
  }
  void synchronizeEvent(void* event) const override {
    auto* ev = static_cast<TpuEvent*>(event);
    if (!ev) return;
    try {
      runtime::awaitAll(ev->pending);
    } catch (const std::exception& e) {
      rethrow(e, "torch_tpu: a device computation failed");
    }
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<TpuEvent*>(event);
  }
  double elapsedTime(void* e1, void* e2, const c10::DeviceIndex) const override {
    auto* a = static_cast<TpuEvent*>(e1);
    auto* b = static_cast<TpuEvent*>(e2);
    TORCH_CHECK(a && b && a->was_recorded && b->was_recorded,
                "Both events must be recorded before calculating elapsed time.");
    // Completion times: wait for both, then measure host-side record times
    // (the device executes in submission order per data dependency).
    runtime::awaitAll(a->pending);
    runtime::awaitAll(b->pending);
    return std::chrono::duration<double, std::milli>(b->recorded - a->recorded).count();
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

// Pinned host memory for tpu (Tensor.pin_memory(), DataLoader(pin_memory=True)):
// page-aligned host allocations the hooks recognise, interior pointers
// included, as cudaHostAlloc'd memory is recognised. On the CPU plugin a host
// buffer is what a transfer reads anyway; a GPU or TPU plugin's own pinned
// host memory space is not wired to it yet. It is the device type's host
// allocator too (torch.accelerator.empty_host_cache() and the host memory
// stats ask that one; without it PyTorch dereferenced null). It caches
// nothing: freed blocks go back to the system at once.
class PinnedAllocator final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* p = nullptr;
    if (n > 0 && posix_memalign(&p, kAlign, n) != 0)
      TORCH_CHECK_WITH(OutOfMemoryError, false, "pinned host memory: cannot allocate ", n, " bytes");
    if (p) {
      std::lock_guard<std::mutex> g(mu_);
      blocks_[reinterpret_cast<uintptr_t>(p)] = n;
      for (auto* s : {&stats_.active_requests, &stats_.allocations}) s->increase(1);
      for (auto* s : {&stats_.active_bytes, &stats_.allocated_bytes}) s->increase(n);
      stats_.num_host_alloc++;
    }
    return {p, p, &PinnedAllocator::release, c10::Device(c10::kCPU)};
  }
  // Transfers from pinned memory complete before the host sees them done.
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}  // nothing cached
  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> g(mu_);
    return stats_;
  }
  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> g(mu_);
    for (auto* s : {&stats_.active_requests, &stats_.active_bytes, &stats_.allocations, &stats_.allocated_bytes})
      s->reset_accumulated();
    stats_.num_host_alloc = stats_.num_host_free = 0;
  }
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> g(mu_);
    for (auto* s : {&stats_.active_requests, &stats_.active_bytes, &stats_.allocations, &stats_.allocated_bytes})
      s->reset_peak();
  }
  c10::DeleterFnPtr raw_deleter() const override { return &PinnedAllocator::release; }
  void copy_data(void* dst, const void* src, std::size_t n) const override { std::memcpy(dst, src, n); }
  bool owns(const void* ptr) {
    const auto at = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> g(mu_);
    auto it = blocks_.upper_bound(at);
    if (it == blocks_.begin()) return false;
    --it;
    return at < it->first + it->second;
  }
  static PinnedAllocator& get() {
    static PinnedAllocator* a = new PinnedAllocator();  // outlives tensors freed at exit
    return *a;
  }

 private:
  static constexpr size_t kAlign = 4096;
  static void release(void* p) {
    if (!p) return;
    {
      auto& self = get();
      std::lock_guard<std::mutex> g(self.mu_);
      auto it = self.blocks_.find(reinterpret_cast<uintptr_t>(p));
      if (it != self.blocks_.end()) {
        for (auto* st : {&self.stats_.active_requests, &self.stats_.allocations}) st->decrease(1);
        for (auto* st : {&self.stats_.active_bytes, &self.stats_.allocated_bytes}) st->decrease(it->second);
        self.stats_.num_host_free++;
        self.blocks_.erase(it);
      }
    }
    std::free(p);
  }
  std::mutex mu_;
  std::map<uintptr_t, size_t> blocks_;
  at::HostStats stats_;
};

struct TpuHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override {
    try {
      return runtime::Runtime::get().deviceCount() > 0;
    } catch (...) {
      return false;
    }
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex d) const override { return defaultGenerator(d); }
  at::Generator getNewGenerator(c10::DeviceIndex d) const override {
    return at::make_generator<TpuGenerator>(d < 0 ? currentDevice() : d);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    auto* a = static_cast<runtime::DeviceArray*>(data);
    return at::Device(kTpu, a ? a->device() : 0);
  }
  bool isPinnedPtr(const void* p) const override { return p && PinnedAllocator::get().owns(p); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &PinnedAllocator::get(); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override {
    try {
      return static_cast<c10::DeviceIndex>(runtime::Runtime::get().deviceCount());
    } catch (...) {
      return 0;
    }
  }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    checkDeviceIndex(d);
    t_current = d;
  }
  c10::DeviceIndex getCurrentDevice() const override { return currentDevice(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = currentDevice();
    setCurrentDevice(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resizeStorageBytes(storage.unsafeGetStorageImpl(), newsize);
  }
};

TpuHooks g_hooks;
}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, TpuGuardImpl);

struct Registration {
  Registration() {
    c10::register_privateuse1_backend("tpu");
    c10::SetAllocator(kTpu, &g_allocator);
    at::RegisterPrivateUse1HooksInterface(&g_hooks);
    at::setHostAllocator(kTpu, &PinnedAllocator::get());
  }
};
static Registration g_registration;

}  // namespace tpu::aten
