#include "plugins/cpu/cpu_plugin.h"

#include <malloc.h>
#include <sched.h>

#include <stdexcept>
#include <string>

#include "ir/ir.h"
#include "plugins/cpu/core_spinner.h"
#include "plugins/cpu/host_kernels.h"
#include "runtime/env.h"
#include "runtime/plugin.h"

namespace tpu::plugins::cpu {
namespace {

// XLA:CPU's code uses 256-bit vectors unless told otherwise. Where the host
// has AVX-512, 512-bit vectors ran elementwise-heavy programs in 0.6-0.85x
// the time (a GELU backward over [16,64,256]: 221 -> 155 us; silu, softmax,
// cross-entropy: docs/vector_width.md). TORCH_TPU_CPU_VECTOR_WIDTH picks the
// width (128, 256 or 512); a width in XLA_FLAGS is left to XLA.
pjrt::OptionOverrides vectorWidthOverrides() {
  constexpr const char* kFlag = "xla_cpu_prefer_vector_width";
  const char* flags = env::get("XLA_FLAGS");
  if (flags && std::string(flags).find(kFlag) != std::string::npos) return {};
  int64_t width = __builtin_cpu_supports("avx512f") ? 512 : 0;
  if (const char* v = env::get("TORCH_TPU_CPU_VECTOR_WIDTH"); v && *v) {
    const std::string s = v;
    if (s != "128" && s != "256" && s != "512")
      throw std::invalid_argument("TORCH_TPU_CPU_VECTOR_WIDTH='" + s + "' must be 128, 256 or 512");
    width = std::stoi(s);
  }
  if (width == 0) return {};
  return {{kFlag, width}};
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

class CpuSupport final : public runtime::PluginSupport {
 public:
  explicit CpuSupport(const pjrt::Api& api) {
    // Attention, layer norm, softmax and float32 products run as host
    // kernels unless TORCH_TPU_HOST_KERNELS=0 keeps their StableHLO forms;
    // products need a host BLAS (MKL from torch), and TORCH_TPU_HOST_GEMM=0
    // keeps XLA's dots.
    if (!hostBlas().available()) useTorchBlas();
    if (env::notDisabled("TORCH_TPU_HOST_KERNELS") && registerHostKernels(api)) {
      kernels_ = {kAttentionForward, kAttentionBackward, kLayerNormForward, kLayerNormBackward, kSoftmaxForward};
      const bool gemm = hostBlas().available() && env::notDisabled("TORCH_TPU_HOST_GEMM");
      if (gemm) kernels_.push_back(kGemm);
      slots_ = makeKernelSlots(gemm);
      ops::setKernelSlots(slots_.get());  // the lowerings call the kernels from now on
    }
    ir::setXlaCpuTuning(true);
    reads_in_place_ = env::notDisabled("TORCH_TPU_HOST_READS");
    malloc_tuned_ = env::notDisabled("TORCH_TPU_MALLOC_TUNING") && tuneHostMalloc();
    overrides_ = vectorWidthOverrides();
    const auto linger = CoreSpinner::lingerFromEnv();
    cpu_set_t set;
    const int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
    if (linger.count() > 0 && cores > 0) spinner_ = std::make_unique<CoreSpinner>(cores, linger);
  }

  ~CpuSupport() override {
    if (slots_) ops::setKernelSlots(nullptr);
  }
  CpuSupport(const CpuSupport&) = delete;
  CpuSupport& operator=(const CpuSupport&) = delete;

  const char* name() const override { return "cpu"; }
  std::vector<std::string> kernels() const override { return kernels_; }
  pjrt::OptionOverrides compileOverrides() const override { return overrides_; }
  bool readsInPlace() const override { return reads_in_place_; }
  bool wantsLaunchHooks() const override { return spinner_ != nullptr; }
  void launchBegin() override { spinner_->begin(); }
  void launchEnd() override { spinner_->end(); }
  void releaseFreeMemory() override {
#ifdef __GLIBC__
    if (malloc_tuned_) malloc_trim(0);
#endif
  }
  bool mallocTuned() const override { return malloc_tuned_; }
  bool collectivesOneAtATime() const override { return true; }
  // xla-cpu-pjrt 0.0.1 takes handlers built against FFI API 0.2 headers
  // (jaxlib 0.8.x); 0.3 ones (jaxlib 0.10) it drops (checked).
  int ffiApiMinor() const override { return 2; }
  int spinnerThreads() const override { return spinner_ ? spinner_->activeThreads() : 0; }
  // Its spinner threads are joined at exit, as before.
  bool destroyAtExit() const override { return true; }

 private:
  std::vector<std::string> kernels_;
  std::unique_ptr<ops::KernelSlots> slots_;
  pjrt::OptionOverrides overrides_;
  bool reads_in_place_ = false;
  bool malloc_tuned_ = false;
  std::unique_ptr<CoreSpinner> spinner_;
};

// The CPU plugin's client: TORCH_TPU_CPU_DEVICES devices (it would make 4),
// dispatching asynchronously.
pjrt::ClientOptions clientOptions(const runtime::ClientRequest& request) {
  pjrt::ClientOptions o;
  o.values = {{"cpu_device_count", int64_t{request.cpu_devices}}, {"asynchronous", true}};
  return o;
}

// Chosen by name, or by its platform once a client exists: its API table has
// nothing only a CPU plugin has.
const runtime::RegisterPlugin kRegistration({"cpu", clientOptions, {}, [](const pjrt::Api& api) {
                                               return std::unique_ptr<runtime::PluginSupport>(new CpuSupport(api));
                                             }});

}  // namespace

}  // namespace tpu::plugins::cpu
