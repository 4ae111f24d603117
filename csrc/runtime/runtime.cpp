#include "runtime/runtime.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "runtime/env.h"
#include "runtime/pending.h"
#include "runtime/slow_watch.h"
#include "runtime/views.h"

namespace tpu::runtime {

Metrics& metrics() {
  static Metrics m;
  return m;
}

void Metrics::reset() {
  compiles = cache_hits = cache_misses = disk_hits = same_text_hits = programs_unloaded = programs_reloaded =
      executions = donated_buffers = constant_reuses = 0;
  h2d_bytes = d2h_bytes = h2d_transfers = d2h_transfers = compile_ns = fused_lowerings = operands_in_place = 0;
  dist_collectives = dist_staged_bytes = dist_xla_collectives = dist_xla_bytes = 0;
  replicated_programs = collectives_in_programs = 0;
  std::lock_guard<std::mutex> g(mu);
  fallbacks.clear();
  compiles_by_op.clear();
}

int64_t Metrics::countCompile(const std::string& what, int64_t ns) {
  compiles++;
  compile_ns += ns;
  std::lock_guard<std::mutex> g(mu);
  return ++compiles_by_op[what];
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
  bool print = env::enabled("TORCH_TPU_LOG_RECOMPILES");
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
    case E::U16:
      return ir::DType::U16;
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
    case E::C128:
      return ir::DType::C128;
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
    case ir::DType::U16:
      return E::U16;
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
    case ir::DType::C128:
      return E::C128;
  }
  return E::F32;
}

namespace {
std::vector<std::string>& searchDirs() {
  static std::vector<std::string> d;
  return d;
}
std::function<std::optional<pjrt::ProcessSpan>()>& processSpan() {
  static std::function<std::optional<pjrt::ProcessSpan>()> provider;
  return provider;
}
std::atomic<bool> g_initialized{false};

}  // namespace

void Runtime::setProcessSpan(std::function<std::optional<pjrt::ProcessSpan>()> provider) {
  processSpan() = std::move(provider);
}
void Runtime::setSearchDirs(std::vector<std::string> dirs) { searchDirs() = std::move(dirs); }
bool Runtime::initialized() { return g_initialized.load(); }

Runtime& Runtime::get() {
  // Construction errors propagate to the caller each time (no half-built
  // runtime is kept), so a fixed environment can retry.
  static std::mutex init_mu;
  struct Holder {
    std::unique_ptr<Runtime> rt;
    ~Holder() {
      if (rt && !rt->plugin().destroyAtExit()) (void)rt.release();
    }
  };
  static Holder holder;
  auto& rt = holder.rt;
  if (g_initialized.load()) return *rt;
  std::lock_guard<std::mutex> g(init_mu);
  if (!rt) {
    rt.reset(new Runtime());
    g_initialized = true;
  }
  return *rt;
}

namespace {
// A process given some of the host's devices (Ray's workers, transformers' and
// vLLM's launchers set these): TPU_VISIBLE_DEVICES, else TPU_VISIBLE_CHIPS, a
// comma-separated list of device positions. libtpu applies TPU_VISIBLE_CHIPS
// itself on a TPU; on the other plugins torch_tpu does.
void keepVisibleDevices(pjrt::Client& client) {
  const char* var = env::get("TPU_VISIBLE_DEVICES") ? "TPU_VISIBLE_DEVICES" : "TPU_VISIBLE_CHIPS";
  const char* value = env::get(var);
  if (!value || (std::string(var) == "TPU_VISIBLE_CHIPS" && client.platformName() == "tpu")) return;
  std::vector<int> positions;
  for (const auto& item : env::list(var)) {
    if (item.empty()) continue;
    try {
      size_t used = 0;
      positions.push_back(std::stoi(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::logic_error&) {
      throw std::invalid_argument(std::string(var) + "=" + value + ": '" + item + "' is not a device number");
    }
  }
  try {
    client.keepDevices(positions);
  } catch (const std::out_of_range& e) {
    throw std::invalid_argument(std::string(var) + "=" + value + ": " + e.what());
  }
}
}  // namespace

Runtime::Runtime() {
  std::vector<std::string> dirs = env::list("TORCH_TPU_PLUGIN_PATH", ':');
  for (const auto& d : searchDirs()) dirs.push_back(d);
  const char* name = env::get("TORCH_TPU_PLUGIN");
  const pjrt::PluginLocation location = pjrt::locatePlugin(name ? name : "", dirs);
  const std::string& path = location.path;
  auto api = pjrt::Api::load(path);
  client_ = createClient(api, location,
                         ClientRequest{static_cast<int>(env::positiveInt("TORCH_TPU_CPU_DEVICES", 1)), processSpan()});
  keepVisibleDevices(*client_);
  if (client_->devices().empty())
    throw pjrt::PluginError("The PJRT plugin '" + path + "' reports no devices" +
                            (env::get("TPU_VISIBLE_DEVICES") || env::get("TPU_VISIBLE_CHIPS")
                                 ? " (TPU_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS left none visible)."
                                 : "."));
  plugin_ = makePluginSupport(*api, *client_);
  launch_hooks_ = plugin_->wantsLaunchHooks() ? plugin_.get() : nullptr;
  reads_in_place_ = plugin_->readsInPlace();
  option_overrides_ = plugin_->compileOverrides();
  options_ = pjrt::compileOptions(/*portable=*/true, option_overrides_);
  struct stat st{};
  ::stat(path.c_str(), &st);
  identity_ = path + "|" + std::to_string(st.st_size) + "|" + std::to_string(st.st_mtime) + "|" +
              client_->platformName() + "|" + client_->platformVersion() + "|" + std::to_string(api->majorVersion()) +
              "." + std::to_string(api->minorVersion());
  // Compiler flags from the environment change what the plugin builds as much
  // as the compile options do: an executable is reused only under the same ones.
  for (const char* var : {"XLA_FLAGS", "LIBTPU_INIT_ARGS"})
    if (const char* v = env::get(var); v && *v) identity_ += std::string("|") + var + "=" + v;
  disk_ = std::make_unique<DiskCache>(DiskCache::defaultDir(), DiskCache::defaultMaxBytes());
  max_loaded_ = env::positiveInt("TORCH_TPU_MAX_PROGRAMS", max_loaded_);
  int n = deviceCount();
  mem_.reset(new Mem[n]);
  int64_t env_limit = env::bytes("TORCH_TPU_MEMORY_LIMIT");
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

bool Runtime::computes(ir::DType t) {
  auto& known = computes_.at(static_cast<size_t>(t));
  if (int8_t v = known.load(std::memory_order_relaxed)) return v > 0;
  ir::Builder b;
  ir::Value x = b.param({t, {2}});
  b.output(b.binary(t == ir::DType::Bool ? "or" : "add", x, x));
  bool ok = true;
  try {
    client_->compile(b.emit(), options_);
  } catch (const pjrt::Error&) {
    ok = false;
  }
  known.store(ok ? 1 : -1, std::memory_order_relaxed);
  return ok;
}

std::shared_ptr<Program> Runtime::compile(const ir::Builder& b, const std::string& what) {
  // The memory tier is keyed by the builder's running fingerprint: a hit
  // never prints the program.
  std::string fp = b.fingerprint();
  if (auto hit = cachedProgram(mu_, programs_, fp)) return hit;
  auto prog = std::make_shared<Program>();
  prog->text = b.emit();
  prog->what = what;
  prog->param_types = b.paramTypes();
  for (const auto& v : b.outputs()) prog->out_types.push_back(v.type);
  prog->op_count = b.opCount();
  for (const auto& [param, output] : b.aliases()) prog->aliased_params.push_back(param);
  prog->synchronous = prog->text.find("stablehlo.fft") != std::string::npos;
  prog->participants = b.participants();
  prog->collectives = b.collectiveCount();
  if (!prog->participants.empty())
    prog->options = pjrt::replicatedCompileOptions(prog->participants, option_overrides_);
  prog->key = DiskCache::key(prog->text, identity_, prog->options.empty() ? options_ : prog->options);
  {
    // Builders whose fingerprints differ can emit the same text: that program
    // is the one already held, not a second copy of its code.
    std::lock_guard<std::mutex> g(mu_);
    if (auto it = programs_by_text_.find(prog->key); it != programs_by_text_.end()) {
      programs_.emplace(std::move(fp), it->second);
      metrics().same_text_hits++;
      return it->second;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  prog->exe = build(*prog);
  prog->compile_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  prog->last_used.store(++clock_, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> g(mu_);
    programs_.emplace(std::move(fp), prog);
    programs_by_text_.emplace(prog->key, prog);
  }
  if (loaded_.fetch_add(1) + 1 > max_loaded_) unloadLeastRecent(prog.get());
  return prog;
}

std::unique_ptr<pjrt::Executable> Runtime::build(const Program& p) {
  if (disk_->enabled()) {
    if (auto payload = disk_->load(p.key)) {
      try {
        auto exe = client_->deserialize(*payload);
        metrics().disk_hits++;
        return exe;
      } catch (const pjrt::Error&) {
        disk_->discard(p.key);  // written by another plugin build: recompile
      }
    }
  }
  auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<pjrt::Executable> exe;
  try {
    SlowWatch watch("the program for " + p.what + " (" + std::to_string(p.op_count) + " ops, " +
                    std::to_string(p.text.size() / 1024) + " KB of StableHLO)");
    exe = client_->compile(p.text, p.options.empty() ? options_ : p.options);
  } catch (const pjrt::Error& e) {
    throw std::runtime_error(std::string("torch_tpu: compiling the program for ") + p.what + " failed: " + e.what());
  }
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  const int64_t compiles_of_op = metrics().countCompile(p.what, ns);
  // Many programs for one op: its shapes change call after call (a loop over a
  // growing sequence), and each new one costs a compile. Said once at 100 and at 1000.
  if (compiles_of_op == 100 || compiles_of_op == 1000)
    std::fprintf(stderr,
                 "torch_tpu: %s has been compiled for %lld different shapes or arguments; a loop whose sizes "
                 "change each step compiles a program per step (pad to fixed sizes, or see "
                 "TORCH_TPU_LOG_RECOMPILES=1)\n",
                 p.what.c_str(), static_cast<long long>(compiles_of_op));
  if (disk_->enabled()) {
    try {
      disk_->store(p.key, exe->serialize());
    } catch (const pjrt::Error&) {
      // The plugin cannot serialize: memory cache only.
    }
  }
  return exe;
}

std::vector<Runtime::ProgramStats> Runtime::programStats() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<ProgramStats> out;
  out.reserve(programs_by_text_.size());
  for (const auto& [key, p] : programs_by_text_)
    out.push_back({p->what, p->compile_seconds, p->runs.load(std::memory_order_relaxed),
                   p->last_run_unix_ns.load(std::memory_order_relaxed)});
  return out;
}

std::shared_ptr<pjrt::Executable> Runtime::executable(const Program& p) {
  p.last_used.store(clock_.fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  p.runs.fetch_add(1, std::memory_order_relaxed);
  p.last_run_unix_ns.store(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count(),
      std::memory_order_relaxed);
  std::shared_ptr<pjrt::Executable> exe;
  bool reloaded = false;
  {
    std::lock_guard<std::mutex> g(p.load_mu);
    if (!p.exe) {
      p.exe = build(p);
      reloaded = true;
    }
    exe = p.exe;
  }
  if (reloaded) {
    metrics().programs_reloaded++;
    if (loaded_.fetch_add(1) + 1 > max_loaded_) unloadLeastRecent(&p);
  }
  return exe;
}

// Unloads the least recently run programs down to 7/8 of the bound (one scan
// per max_loaded_ / 8 loads). A launch still running may use one: what is in
// flight finishes before they go.
void Runtime::unloadLeastRecent(const Program* keep) {
  std::vector<std::shared_ptr<pjrt::Executable>> unloaded;
  {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::pair<uint64_t, Program*>> held;
    for (const auto& [key, prog] : programs_by_text_) {
      if (prog.get() == keep) continue;
      std::lock_guard<std::mutex> l(prog->load_mu);
      if (prog->exe) held.emplace_back(prog->last_used.load(std::memory_order_relaxed), prog.get());
    }
    const int64_t excess = loaded_.load() - max_loaded_ * 7 / 8;
    if (excess <= 0) return;
    const size_t n = std::min(held.size(), static_cast<size_t>(excess));
    std::nth_element(held.begin(), held.begin() + n, held.end());
    for (size_t i = 0; i < n; ++i) {
      std::lock_guard<std::mutex> l(held[i].second->load_mu);
      if (!held[i].second->exe) continue;
      unloaded.push_back(std::move(held[i].second->exe));
      held[i].second->exe = nullptr;
      loaded_--;
    }
  }
  for (int d = 0; d < deviceCount(); ++d) awaitAll(pendingSnapshot(d));
  metrics().programs_unloaded += static_cast<int64_t>(unloaded.size());
}

BufferPtr Runtime::upload(const void* data, ir::DType t, const std::vector<int64_t>& dims, int device) {
  size_t bytes = ir::itemSize(t);
  for (auto d : dims) bytes *= d;
  metrics().h2d_transfers++;
  metrics().h2d_bytes += bytes;
  return BufferPtr(client_->fromHost(data, elementType(t), dims, device));
}

void Runtime::releaseFreeMemory() {
  std::vector<std::function<void()>> releases;
  {
    std::lock_guard<std::mutex> g(releases_mu_);
    releases = cache_releases_;
  }
  for (const auto& release : releases) release();
  plugin_->releaseFreeMemory();
}

void Runtime::addCacheRelease(std::function<void()> release) {
  std::lock_guard<std::mutex> g(releases_mu_);
  cache_releases_.push_back(std::move(release));
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
  if (reads_in_place_) {
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
int64_t Runtime::memoryLimit(int device) const { return mem_[device].limit; }

namespace {
std::atomic<uint64_t> g_next_array_uid{1};
}  // namespace

uint64_t DeviceArray::nextUid() { return g_next_array_uid.load(std::memory_order_relaxed); }

DeviceArray::DeviceArray(int device, size_t nbytes)
    : device_(device), uid_(g_next_array_uid.fetch_add(1, std::memory_order_relaxed)), nbytes_(nbytes) {
  Runtime::get().reserve(device, nbytes);
}

DeviceArray::~DeviceArray() {
  // A graph materialising on another thread reaches its pending arrays through
  // their values' owner pointers (autograd's device thread frees tensors while
  // the main thread replays a compiled graph): detach under the graph's lock,
  // so the materialisation either finishes first or no longer sees this array.
  if (auto detach = pendingHooks().detach) detach(this, lazy_);
  Runtime::get().release(device_, nbytes_);
}

}  // namespace tpu::runtime
