#include "runtime/runtime.h"

#include <malloc.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "ops/lowering.h"
#include "runtime/host_kernels.h"
#include "runtime/lazy.h"
#include "runtime/views.h"

namespace tpu::runtime {

Metrics& metrics() {
  static Metrics m;
  return m;
}

void Metrics::reset() {
  compiles = cache_hits = cache_misses = disk_hits = executions = donated_buffers = constant_reuses = 0;
  h2d_bytes = d2h_bytes = h2d_transfers = d2h_transfers = compile_ns = fused_lowerings = operands_in_place = 0;
  std::lock_guard<std::mutex> g(mu);
  fallbacks.clear();
  compiles_by_op.clear();
}

std::string Metrics::report() {
  std::ostringstream os;
  os << "torch_tpu metrics\n"
     << "  compiles:          " << compiles << " (" << compile_ns / 1e9 << " s)\n"
     << "  cache hits/misses: " << cache_hits << " / " << cache_misses << " (disk hits " << disk_hits << ")\n"
     << "  executions:        " << executions << " (buffers donated: " << donated_buffers
     << ", fills reused: " << constant_reuses << ")\n"
     << "  host->device:      " << h2d_transfers << " transfers, " << h2d_bytes << " bytes\n"
     << "  device->host:      " << d2h_transfers << " transfers, " << d2h_bytes << " bytes\n";
  std::lock_guard<std::mutex> g(mu);
  os << "  CPU fallbacks:     " << (fallbacks.empty() ? "none" : "") << "\n";
  for (const auto& [op, n] : fallbacks) os << "    " << op << ": " << n << "\n";
  return os.str();
}

namespace {
struct CompileLog {
  std::mutex mu;
  std::vector<std::string> recent;
  bool print = [] {
    const char* e = std::getenv("TORCH_TPU_LOG_RECOMPILES");
    return e && std::string(e) == "1";
  }();
};
CompileLog& compileLog() {
  static CompileLog l;
  return l;
}
}  // namespace

void noteCompile(const std::string& what, const std::string& reason) {
  auto& l = compileLog();
  std::string line = what + ": " + reason;
  if (l.print) std::fprintf(stderr, "torch_tpu: compiling %s\n", line.c_str());
  std::lock_guard<std::mutex> g(l.mu);
  l.recent.push_back(std::move(line));
  if (l.recent.size() > 200) l.recent.erase(l.recent.begin());
}

std::vector<std::string> recentCompileReasons() {
  auto& l = compileLog();
  std::lock_guard<std::mutex> g(l.mu);
  return l.recent;
}

ir::DType elementDType(pjrt::ElementType t) {
  using E = pjrt::ElementType;
  switch (t) {
    case E::PRED:
      return ir::DType::Bool;
    case E::U8:
      return ir::DType::U8;
    case E::S8:
      return ir::DType::I8;
    case E::S16:
      return ir::DType::I16;
    case E::S32:
      return ir::DType::I32;
    case E::S64:
      return ir::DType::I64;
    case E::U32:
      return ir::DType::U32;
    case E::U64:
      return ir::DType::U64;
    case E::F16:
      return ir::DType::F16;
    case E::BF16:
      return ir::DType::BF16;
    case E::F32:
      return ir::DType::F32;
    case E::F64:
      return ir::DType::F64;
    case E::C64:
      return ir::DType::C64;
    default:
      throw std::runtime_error("torch_tpu: unsupported PJRT element type");
  }
}

pjrt::ElementType elementType(ir::DType t) {
  using E = pjrt::ElementType;
  switch (t) {
    case ir::DType::Bool:
      return E::PRED;
    case ir::DType::U8:
      return E::U8;
    case ir::DType::I8:
      return E::S8;
    case ir::DType::I16:
      return E::S16;
    case ir::DType::I32:
      return E::S32;
    case ir::DType::I64:
      return E::S64;
    case ir::DType::U32:
      return E::U32;
    case ir::DType::U64:
      return E::U64;
    case ir::DType::F16:
      return E::F16;
    case ir::DType::BF16:
      return E::BF16;
    case ir::DType::F32:
      return E::F32;
    case ir::DType::F64:
      return E::F64;
    case ir::DType::C64:
      return E::C64;
  }
  return E::F32;
}

namespace {
std::vector<std::string>& searchDirs() {
  static std::vector<std::string> d;
  return d;
}
std::atomic<bool> g_initialized{false};

int envInt(const char* name, int dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end || x <= 0) throw std::invalid_argument(std::string(name) + "='" + v + "' must be a positive integer");
  return static_cast<int>(x);
}

// XLA:CPU's code uses 256-bit vectors unless told otherwise. Where the host
// has AVX-512, 512-bit vectors ran elementwise-heavy programs in 0.6-0.85x
// the time (a GELU backward over [16,64,256]: 221 -> 155 us; silu, softmax,
// cross-entropy: docs/vector_width.md). TORCH_TPU_CPU_VECTOR_WIDTH picks the
// width (128, 256 or 512); a width in XLA_FLAGS is left to XLA.
pjrt::OptionOverrides cpuOptionOverrides() {
  constexpr const char* kFlag = "xla_cpu_prefer_vector_width";
  const char* flags = std::getenv("XLA_FLAGS");
  if (flags && std::string(flags).find(kFlag) != std::string::npos) return {};
  int64_t width = __builtin_cpu_supports("avx512f") ? 512 : 0;
  if (const char* v = std::getenv("TORCH_TPU_CPU_VECTOR_WIDTH"); v && *v) {
    const std::string s = v;
    if (s != "128" && s != "256" && s != "512")
      throw std::invalid_argument("TORCH_TPU_CPU_VECTOR_WIDTH='" + s + "' must be 128, 256 or 512");
    width = std::stoi(s);
  }
  if (width == 0) return {};
  return {{kFlag, width}};
}

// A switch that is on unless the variable is "0".
bool envOn(const char* name) {
  const char* v = std::getenv(name);
  return !(v && std::string(v) == "0");
}

// The CPU plugin's device buffers come from malloc. By default glibc serves
// blocks of 128 KB and more with fresh mmaps (raising that bound only as big
// blocks are freed) and trims freed memory at the heap top back to the
// kernel, so a new program output page-faults on first touch: an x + 1 on
// [256,512] took 66 us, 36 us with freed memory kept. Blocks up to 32 MB now
// come from the heap, and up to 256 MB of free heap stays in the process.
bool tuneHostMalloc() {
#ifdef __GLIBC__
  constexpr int kMiB = 1024 * 1024;
  return mallopt(M_MMAP_THRESHOLD, 32 * kMiB) == 1 && mallopt(M_TRIM_THRESHOLD, 256 * kMiB) == 1 &&
         mallopt(M_TOP_PAD, 16 * kMiB) == 1;
#else
  return false;
#endif
}

// TORCH_TPU_MEMORY_LIMIT: bytes, or with a K/M/G suffix.
int64_t envBytes(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  char* end = nullptr;
  double x = std::strtod(v, &end);
  int64_t mult = 1;
  if (*end == 'K' || *end == 'k') mult = 1LL << 10;
  if (*end == 'M' || *end == 'm') mult = 1LL << 20;
  if (*end == 'G' || *end == 'g') mult = 1LL << 30;
  if (x <= 0) throw std::invalid_argument(std::string(name) + "='" + v + "' must be a positive size");
  return static_cast<int64_t>(x * mult);
}
}  // namespace

void Runtime::setSearchDirs(std::vector<std::string> dirs) { searchDirs() = std::move(dirs); }
bool Runtime::initialized() { return g_initialized.load(); }

Runtime& Runtime::get() {
  // Construction errors propagate to the caller each time (no half-built
  // runtime is kept), so a fixed environment can retry.
  static std::mutex init_mu;
  static std::unique_ptr<Runtime> rt;
  if (g_initialized.load()) return *rt;
  std::lock_guard<std::mutex> g(init_mu);
  if (!rt) {
    rt.reset(new Runtime());
    g_initialized = true;
  }
  return *rt;
}

Runtime::Runtime() {
  std::vector<std::string> dirs;
  if (const char* p = std::getenv("TORCH_TPU_PLUGIN_PATH")) {
    std::string s(p);
    size_t start = 0;
    while (start <= s.size()) {
      size_t end = s.find(':', start);
      if (end == std::string::npos) end = s.size();
      if (end > start) dirs.push_back(s.substr(start, end - start));
      start = end + 1;
    }
  }
  for (const auto& d : searchDirs()) dirs.push_back(d);
  const char* name = std::getenv("TORCH_TPU_PLUGIN");
  std::string path = pjrt::resolvePluginPath(name ? name : "", dirs);
  auto api = pjrt::Api::load(path);
  client_ = pjrt::Client::create(api, envInt("TORCH_TPU_CPU_DEVICES", 1));
  if (client_->devices().empty()) throw pjrt::PluginError("The PJRT plugin '" + path + "' reports no devices.");
  // The CPU plugin runs attention, layer norm and float32 products as the
  // runtime's own kernels (runtime/host_kernels.h); TORCH_TPU_HOST_KERNELS=0
  // keeps StableHLO.
  const bool cpu = client_->platformName() == "cpu";
  // Float32 products run on the host BLAS where one is set (MKL from torch);
  // TORCH_TPU_HOST_GEMM=0 keeps XLA's dots.
  if (cpu && envOn("TORCH_TPU_HOST_KERNELS")) {
    const bool registered = registerHostKernels(*api);
    ops::setHostKernels(registered);
    ops::setHostGemm(registered && hostBlas().available() && envOn("TORCH_TPU_HOST_GEMM"));
  }
  ir::setXlaCpuTuning(cpu);
  // TORCH_TPU_HOST_READS=0 keeps the plugin's copy (as other plugins do).
  host_memory_ = cpu && envOn("TORCH_TPU_HOST_READS");
  host_malloc_tuned_ = cpu && envOn("TORCH_TPU_MALLOC_TUNING") && tuneHostMalloc();
  if (cpu) {
    option_overrides_ = cpuOptionOverrides();
    auto linger = CoreSpinner::lingerFromEnv();
    cpu_set_t set;
    int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
    if (linger.count() > 0 && cores > 0) spinner_ = std::make_unique<CoreSpinner>(cores, linger);
  }
  options_ = pjrt::compileOptions(/*portable=*/true, option_overrides_);
  struct stat st{};
  ::stat(path.c_str(), &st);
  identity_ = path + "|" + std::to_string(st.st_size) + "|" + std::to_string(st.st_mtime) + "|" +
              client_->platformName() + "|" + client_->platformVersion() + "|" + std::to_string(api->majorVersion()) +
              "." + std::to_string(api->minorVersion());
  // Compiler flags from the environment change what the plugin builds as much
  // as the compile options do: an executable is reused only under the same ones.
  for (const char* var : {"XLA_FLAGS", "LIBTPU_INIT_ARGS"})
    if (const char* v = std::getenv(var); v && *v) identity_ += std::string("|") + var + "=" + v;
  disk_ = std::make_unique<DiskCache>(DiskCache::defaultDir(), DiskCache::defaultMaxBytes());
  int n = deviceCount();
  mem_.reset(new Mem[n]);
  int64_t env_limit = envBytes("TORCH_TPU_MEMORY_LIMIT");
  for (int i = 0; i < n; ++i) {
    auto st = client_->memoryStats(i);
    int64_t lim = st.bytes_limit > 0 ? st.bytes_limit : 0;
    if (lim == 0) {  // host memory for the CPU plugin
      long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGE_SIZE);
      lim = static_cast<int64_t>(pages) * psize;
    }
    if (env_limit > 0) lim = env_limit;
    mem_[i].limit = lim;
  }
}

std::shared_ptr<Program> Runtime::compile(const ir::Builder& b, const std::string& what) {
  // The memory tier is keyed by the builder's running fingerprint: a hit
  // never prints the program.
  std::string fp = b.fingerprint();
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = programs_.find(fp);
    if (it != programs_.end()) {
      metrics().cache_hits++;
      return it->second;
    }
  }
  metrics().cache_misses++;
  std::string text = b.emit();
  auto prog = std::make_shared<Program>();
  prog->param_types = b.paramTypes();
  for (const auto& v : b.outputs()) prog->out_types.push_back(v.type);
  prog->op_count = b.opCount();
  for (const auto& [param, output] : b.aliases()) prog->aliased_params.push_back(param);
  prog->synchronous = text.find("stablehlo.fft") != std::string::npos;
  std::string key = disk_->enabled() ? DiskCache::key(text, identity_, options_) : "";
  if (disk_->enabled()) {
    if (auto payload = disk_->load(key)) {
      try {
        prog->exe = client_->deserialize(*payload);
        metrics().disk_hits++;
      } catch (const pjrt::Error&) {
        disk_->discard(key);  // written by another plugin build: recompile
      }
    }
  }
  if (!prog->exe) {
    auto t0 = std::chrono::steady_clock::now();
    try {
      prog->exe = client_->compile(text, options_);
    } catch (const pjrt::Error& e) {
      throw std::runtime_error(std::string("torch_tpu: compiling the program for ") + what + " failed: " + e.what());
    }
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    prog->compile_seconds = ns / 1e9;
    metrics().compiles++;
    metrics().compile_ns += ns;
    {
      std::lock_guard<std::mutex> g(metrics().mu);
      metrics().compiles_by_op[what]++;
    }
    if (disk_->enabled()) {
      try {
        disk_->store(key, prog->exe->serialize());
      } catch (const pjrt::Error&) {
        // The plugin cannot serialize: memory cache only.
      }
    }
  }
  std::lock_guard<std::mutex> g(mu_);
  programs_.emplace(std::move(fp), prog);
  return prog;
}

BufferPtr Runtime::upload(const void* data, ir::DType t, const std::vector<int64_t>& dims, int device) {
  size_t bytes = ir::itemSize(t);
  for (auto d : dims) bytes *= d;
  metrics().h2d_transfers++;
  metrics().h2d_bytes += bytes;
  return BufferPtr(client_->fromHost(data, elementType(t), dims, device));
}

void Runtime::download(const pjrt::Buffer& b, void* dst, size_t bytes) {
  // The value first (read waits for it): then the checks of the programs it
  // came from have finished too. Waiting for every check instead made a
  // training loop's loss.item() wait for the backward queued after the loss
  // (embedding gradients check their indices), and the device idled while
  // the host prepared the next step.
  read(b, dst, bytes);
  checkPendingIndices(/*finished_only=*/true);
  metrics().d2h_transfers++;
  metrics().d2h_bytes += bytes;
}

void Runtime::read(const pjrt::Buffer& b, void* dst, size_t bytes) const {
  // The CPU plugin's buffers are host memory, dense and row-major: once the
  // value is computed it is read in place. The plugin's own copy runs as a
  // task on its thread pool and costs two thread hand-offs, 36 us for a
  // ready scalar's .item() against about 1 us here.
  if (host_memory_) {
    b.awaitReady();
    const void* p = b.unsafePointer();
    if (p && b.onDeviceBytes() == bytes) {
      std::memcpy(dst, p, bytes);
      return;
    }
  }
  b.toHost(dst, bytes);
}

namespace {
// a = max(a, v), atomically.
void raiseTo(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load();
  while (v > cur && !a.compare_exchange_weak(cur, v)) {
  }
}
}  // namespace

void Runtime::reserve(int device, size_t bytes) {
  Mem& m = mem_[device];
  int64_t now = m.in_use.fetch_add(bytes) + bytes;
  if (now > m.limit) {
    m.in_use -= bytes;
    std::ostringstream os;
    os << "tpu out of memory: tried to allocate " << bytes << " bytes on tpu:" << device << ", "
       << (now - static_cast<int64_t>(bytes)) << " bytes in use of a " << m.limit
       << "-byte limit (TORCH_TPU_MEMORY_LIMIT sets the limit). Free tensors or use a smaller batch.";
    throw OutOfMemory(os.str());
  }
  const int64_t arrays = ++m.count;
  m.allocations++;
  m.allocated_bytes += static_cast<int64_t>(bytes);
  raiseTo(m.peak, now);
  raiseTo(m.peak_count, arrays);
}

void Runtime::release(int device, size_t bytes) {
  Mem& m = mem_[device];
  m.in_use -= bytes;
  m.count--;
  m.frees++;
  m.freed_bytes += static_cast<int64_t>(bytes);
}
int64_t Runtime::allocated(int device) const { return mem_[device].in_use; }
int64_t Runtime::peak(int device) const { return mem_[device].peak; }
void Runtime::resetPeak(int device) {
  mem_[device].peak = mem_[device].in_use.load();
  mem_[device].peak_count = mem_[device].count.load();
}
Runtime::MemoryStats Runtime::memoryStats(int device) const {
  const Mem& m = mem_[device];
  return {m.in_use, m.peak, m.count, m.peak_count, m.allocated_bytes, m.freed_bytes, m.allocations, m.frees};
}
void Runtime::resetAccumulated(int device) {
  Mem& m = mem_[device];
  m.allocated_bytes = 0;
  m.freed_bytes = 0;
  m.allocations = 0;
  m.frees = 0;
}
void Runtime::releaseFreeMemory() {
#ifdef __GLIBC__
  if (host_malloc_tuned_) malloc_trim(0);
#endif
}
int64_t Runtime::memoryLimit(int device) const { return mem_[device].limit; }

namespace {
std::atomic<uint64_t> g_next_array_uid{1};
}  // namespace

DeviceArray::DeviceArray(int device, size_t nbytes)
    : device_(device), uid_(g_next_array_uid.fetch_add(1, std::memory_order_relaxed)), nbytes_(nbytes) {
  Runtime::get().reserve(device, nbytes);
}

DeviceArray::~DeviceArray() {
  // A graph materialising on another thread reaches its pending arrays through
  // their values' owner pointers (autograd's device thread frees tensors while
  // the main thread replays a compiled graph): detach under the graph's lock,
  // so the materialisation either finishes first or no longer sees this array.
  if (Fusion::inUse()) {
    std::lock_guard<std::recursive_mutex> lock(Fusion::get().mutex());
    if (lazy_ && lazy_->owner == this) lazy_->owner = nullptr;
    lazy_.reset();
  }
  Runtime::get().release(device_, nbytes_);
}

}  // namespace tpu::runtime
