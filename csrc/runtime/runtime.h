// The portable runtime, the layer between the modes and PJRT. This header:
// the process-wide Runtime (the loaded plugin and client, the compilation
// cache in memory and on disk, memory accounting, metrics) and DeviceArray
// (the contents of a tensor storage). Beside it: views.h (strided reads and
// writes, launching programs), pending.h (the hooks through which the
// pending graph of fused eager, fused/engine/, computes what an array holds),
// disk_cache.h, env.h (the environment registry) and plugin.h (the seam to
// what one plugin adds). No torch headers here.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ir/ir.h"
#include "pjrt/pjrt.h"
#include "runtime/disk_cache.h"
#include "runtime/plugin.h"

namespace tpu::runtime {

// A request larger than the device's free memory.
class OutOfMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Metrics {
  std::atomic<int64_t> compiles{0};
  std::atomic<int64_t> cache_hits{0};    // program found in memory
  std::atomic<int64_t> cache_misses{0};  // not in memory (then: disk hit, or compile)
  std::atomic<int64_t> disk_hits{0};
  std::atomic<int64_t> same_text_hits{0};     // a new fingerprint whose program text was loaded already
  std::atomic<int64_t> programs_unloaded{0};  // executables unloaded past TORCH_TPU_MAX_PROGRAMS
  std::atomic<int64_t> programs_reloaded{0};  // ... and loaded again to run
  std::atomic<int64_t> executions{0};
  std::atomic<int64_t> donated_buffers{0};  // inputs whose buffers outputs reused
  std::atomic<int64_t> constant_reuses{0};  // fills (zeros, ones, full) answered with kept results
  std::atomic<int64_t> h2d_bytes{0};
  std::atomic<int64_t> d2h_bytes{0};
  std::atomic<int64_t> h2d_transfers{0};
  std::atomic<int64_t> d2h_transfers{0};
  std::atomic<int64_t> compile_ns{0};
  std::atomic<int64_t> fused_lowerings{0};          // op signatures lowered for fused eager
  std::atomic<int64_t> operands_in_place{0};        // views a kernel read from their storage, not a copy
  std::atomic<int64_t> dist_collectives{0};         // tpu_dist collectives run
  std::atomic<int64_t> dist_staged_bytes{0};        // bytes tpu_dist copied between device and host
  std::atomic<int64_t> dist_xla_collectives{0};     // collectives run as XLA programs
  std::atomic<int64_t> dist_xla_bytes{0};           // bytes those programs took in, all devices
  std::atomic<int64_t> replicated_programs{0};      // launches of programs with collectives inside
  std::atomic<int64_t> collectives_in_programs{0};  // collectives those launches ran
  std::mutex mu;
  std::map<std::string, int64_t> fallbacks;  // op name -> count
  std::map<std::string, int64_t> compiles_by_op;
  void reset();
  std::string report();
  // Counts a compile of `what` that took `ns`; returns how many `what` has had.
  int64_t countCompile(const std::string& what, int64_t ns);
};
Metrics& metrics();

// The program cached under `key` in a memory tier guarded by `mu`, counted as
// a hit; null, counted as a miss, when there is none.
template <typename Cache>
typename Cache::mapped_type cachedProgram(std::mutex& mu, const Cache& cache, const std::string& key) {
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      metrics().cache_hits++;
      return it->second;
    }
  }
  metrics().cache_misses++;
  return nullptr;
}

// "Why did it compile?": each compile's reason (the difference from the
// closest program compiled before). TORCH_TPU_LOG_RECOMPILES=1 prints them.
void noteCompile(const std::string& what, const std::string& reason);
std::vector<std::string> recentCompileReasons();

ir::DType elementDType(pjrt::ElementType t);
pjrt::ElementType elementType(ir::DType t);

// A compiled program and what it returns.
struct Program {
  // Loaded while it is among the most recently run: past TORCH_TPU_MAX_PROGRAMS
  // the runtime unloads the least recently run (every loaded XLA:CPU
  // executable holds 3 to 6 memory maps, and a process has 65,530: one of
  // PyTorch's index tests alone makes 5,000 programs, and the JIT's mmap
  // failed); Runtime::executable() loads one again, from the disk cache or by
  // compiling `text`.
  mutable std::shared_ptr<pjrt::Executable> exe;  // under load_mu once published
  mutable std::mutex load_mu;
  mutable std::atomic<uint64_t> last_used{0};
  // For torch.tpu._get_cache_stats: compile (or disk load) seconds, launches,
  // and the wall-clock time of the last one.
  double compile_seconds = 0;
  mutable std::atomic<uint64_t> runs{0};
  mutable std::atomic<int64_t> last_run_unix_ns{0};
  std::string text, key, what;
  std::vector<ir::Type> param_types;
  std::vector<ir::Type> out_types;
  int op_count = 0;
  // Programs with an FFT run to completion before the next launch: XLA:CPU
  // (xla-cpu-pjrt 0.0.1) crashed about once in six test runs when FFT
  // programs completed asynchronously (in CpuAsyncExecutionTracker), never
  // with launches serialized.
  bool synchronous = false;
  // Params whose buffers outputs may be written into (input-output aliasing):
  // execute() donates them unless someone else still holds the buffer.
  std::vector<int> aliased_params;
  // A program with collectives: one replica per device of `participants`
  // (global ids), compiled with their device assignment (`options`), each
  // replica launched by its own device's thread (runtime/collectives.h).
  std::vector<int> participants;
  int collectives = 0;
  std::string options;
};

using BufferPtr = std::shared_ptr<pjrt::Buffer>;

class Runtime {
 public:
  // Folders to search for named plugins (site-packages); set by Python
  // before first use. TORCH_TPU_PLUGIN_PATH adds more.
  static void setSearchDirs(std::vector<std::string> dirs);
  // Where this process sits among the processes of a job (torchrun's ranks)
  // and the store they share; asked once, when the client is created, and only
  // by a plugin that runs collectives across processes. Set by the torch layer.
  static void setProcessSpan(std::function<std::optional<pjrt::ProcessSpan>()> provider);
  static Runtime& get();
  static bool initialized();

  pjrt::Client& client() { return *client_; }
  struct ProgramStats {
    std::string what;
    double compile_seconds;
    uint64_t runs;
    int64_t last_run_unix_ns;
  };
  // One entry per distinct program held (loaded or not).
  std::vector<ProgramStats> programStats();
  int deviceCount() const { return static_cast<int>(client_->devices().size()); }
  PJRT_Device* device(int i) const { return client_->devices().at(i).raw; }
  const std::string& pluginPath() const { return client_->api()->path(); }
  DiskCache& diskCache() { return *disk_; }
  // Plugin path, build (size, mtime), platform and API version: executables
  // serialized by one plugin build are only loaded by the same build.
  const std::string& pluginIdentity() const { return identity_; }
  // What the plugin adds to the portable core (runtime/plugin.h).
  PluginSupport& plugin() const { return *plugin_; }
  // The plugin's launch hooks, or null when it has none.
  PluginSupport* launchHooks() const { return launch_hooks_; }
  // The XLA debug options every compile sets (the plugin's).
  const pjrt::OptionOverrides& optionOverrides() const { return option_overrides_; }

  // Compiles the builder's program, or returns the cached executable for the
  // same text. `what` names the program in metrics (an op name).
  std::shared_ptr<Program> compile(const ir::Builder& b, const std::string& what);
  // The program's executable, loaded again if it was unloaded; the caller holds
  // it while it launches.
  std::shared_ptr<pjrt::Executable> executable(const Program& p);
  // Whether the plugin computes with this element type: asked of its compiler
  // once per type (a program that adds two arrays of it), outside metrics and
  // caches. A TPU refuses float64 and complex128; the CPU and CUDA plugins
  // compute every type the IR has.
  bool computes(ir::DType t);

  BufferPtr upload(const void* data, ir::DType t, const std::vector<int64_t>& dims, int device);
  // Copies a buffer's value to dst once computed; raises a deferred index
  // error first (checkPendingIndices).
  void download(const pjrt::Buffer& b, void* dst, size_t bytes);
  // The copy alone: no index checks, no transfer metrics.
  void read(const pjrt::Buffer& b, void* dst, size_t bytes) const;

  // Memory accounting for device arrays.
  void reserve(int device, size_t bytes);  // throws OutOfMemory
  void release(int device, size_t bytes);
  int64_t allocated(int device) const;
  int64_t peak(int device) const;
  void resetPeak(int device);
  int64_t memoryLimit(int device) const;
  // What torch.accelerator.memory_stats reports: bytes and arrays now, at
  // their peak, and allocated and freed since the last resetAccumulated.
  struct MemoryStats {
    int64_t bytes = 0, peak_bytes = 0, arrays = 0, peak_arrays = 0;
    int64_t allocated_bytes = 0, freed_bytes = 0, allocations = 0, frees = 0;
  };
  MemoryStats memoryStats(int device) const;
  void resetAccumulated(int device);
  // Gives freed device memory the process still holds back to the system:
  // first the host memory other layers keep for the device (addCacheRelease),
  // then the plugin's freed heap.
  void releaseFreeMemory();
  // Registers `release`, which frees a cache of host memory kept for the
  // device (tpu_dist's staging blocks): torch.tpu.empty_cache() empties it.
  void addCacheRelease(std::function<void()> release);

 private:
  Runtime();
  // Before client_: destroyed after it, once no execution can still finish
  // (a launch's end hook runs when its event fires).
  std::unique_ptr<PluginSupport> plugin_;
  PluginSupport* launch_hooks_ = nullptr;
  std::unique_ptr<pjrt::Client> client_;
  std::string options_;
  pjrt::OptionOverrides option_overrides_;  // XLA debug options set through options_
  std::string identity_;
  std::unique_ptr<DiskCache> disk_;
  bool reads_in_place_ = false;  // device buffers are host memory: downloads read them in place
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Program>> programs_;          // by builder fingerprint
  std::unordered_map<std::string, std::shared_ptr<Program>> programs_by_text_;  // by the program's disk key
  std::atomic<uint64_t> clock_{0};                                              // a tick per launch: Program::last_used
  std::atomic<int64_t> loaded_{0};                                              // programs whose executable is loaded
  int64_t max_loaded_ = 2048;                                                   // TORCH_TPU_MAX_PROGRAMS
  std::unique_ptr<pjrt::Executable> build(const Program& p);                    // from the disk cache, else compiled
  void unloadLeastRecent(const Program* keep);
  std::array<std::atomic<int8_t>, 32> computes_{};  // by DType: 0 not asked, 1 yes, -1 no
  struct Mem {
    std::atomic<int64_t> in_use{0};
    std::atomic<int64_t> peak{0};
    std::atomic<int64_t> count{0};
    std::atomic<int64_t> peak_count{0};
    std::atomic<int64_t> allocated_bytes{0}, freed_bytes{0}, allocations{0}, frees{0};
    int64_t limit = 0;
  };
  std::unique_ptr<Mem[]> mem_;
  std::mutex releases_mu_;
  std::vector<std::function<void()>> cache_releases_;
};

// The contents of one tensor storage on one device: a flat PJRT buffer of
// `numel` elements of `dtype`, or nothing yet (reads as zeros). An in-place
// op replaces the buffer, so every tensor sharing the storage sees it.
struct LazyValue;

class DeviceArray {
 public:
  DeviceArray(int device, size_t nbytes);
  ~DeviceArray();
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  int device() const { return device_; }
  // Unique in the process (an address may be reused by a later array), and
  // increasing: an array made after another has a larger uid.
  uint64_t uid() const { return uid_; }
  // The uid the next array will get.
  static uint64_t nextUid();
  size_t nbytes() const { return nbytes_; }
  bool materialized() const { return static_cast<bool>(buffer_); }
  const BufferPtr& buffer() const { return buffer_; }
  ir::DType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  void set(BufferPtr b, ir::DType t, int64_t numel) {
    buffer_ = std::move(b);
    dtype_ = t;
    numel_ = numel;
    lazy_.reset();
    error_.clear();
  }
  // Fused eager: the graph that was to compute this array failed; reading
  // it raises `msg` until the array is overwritten.
  void poison(std::string msg) {
    lazy_.reset();
    buffer_.reset();
    error_ = std::move(msg);
  }
  const std::string& error() const { return error_; }
  // Fused eager: the contents are a value of a pending graph.
  bool lazy() const { return static_cast<bool>(lazy_); }
  const std::shared_ptr<LazyValue>& lazyValue() const { return lazy_; }
  void setLazy(std::shared_ptr<LazyValue> v, ir::DType t, int64_t numel) {
    lazy_ = std::move(v);
    buffer_.reset();
    dtype_ = t;
    numel_ = numel;
  }

 private:
  int device_;
  uint64_t uid_;
  size_t nbytes_;
  BufferPtr buffer_;
  std::shared_ptr<LazyValue> lazy_;
  std::string error_;
  ir::DType dtype_ = ir::DType::U8;
  int64_t numel_ = 0;
};

}  // namespace tpu::runtime
