// The plugin seam: what the portable core asks of the PJRT plugin it drives,
// beyond the PJRT C API. Each plugin that adds something registers it here by
// its platform name (what PJRT_Client_PlatformName reports: "cpu", "cuda",
// "tpu"), from its own folder csrc/plugins/<name>/: the options its client is
// created with, and its PluginSupport, which the runtime holds while it
// lives. A support may also lower kernel slots its own way (a custom call to
// a kernel it registered with the plugin): it installs its ops::KernelSlots
// (ops/kernel_slots.h) for its lifetime. The core never asks which plugin it
// is, and nothing outside csrc/plugins/ includes anything there. A plugin with
// no registration gets the portable default: nothing added. No torch headers.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pjrt/pjrt.h"

namespace tpu::runtime {

class PluginSupport {
 public:
  virtual ~PluginSupport() = default;
  // "cpu", or "portable" for a plugin with nothing of its own.
  virtual const char* name() const = 0;
  // The custom-call targets it registered with the plugin (for reports; the
  // lowerings reach them through its kernel slots).
  virtual std::vector<std::string> kernels() const { return {}; }
  // XLA debug options every compile sets.
  virtual pjrt::OptionOverrides compileOverrides() const { return {}; }
  // Whether device buffers are host memory that can be read in place once
  // ready, without the plugin's copy.
  virtual bool readsInPlace() const { return false; }
  // Whether launchBegin/launchEnd need calling (a launch's end then waits for
  // its completion event).
  virtual bool wantsLaunchHooks() const { return false; }
  virtual void launchBegin() {}
  virtual void launchEnd() {}
  // Gives freed device memory the process still holds back to the system.
  virtual void releaseFreeMemory() {}
  // Whether the runtime is destroyed at exit. A GPU plugin's client must not be:
  // the CUDA driver tears itself down first, and destroying the client after
  // prints dozens of "CUDA error ... (4)" lines; the OS reclaims it instead.
  virtual bool destroyAtExit() const { return false; }
  // For tests and reports: whether malloc is tuned, how many core spinners run.
  virtual bool mallocTuned() const { return false; }
  // A collective program must finish before the next is launched: XLA:CPU runs
  // each participant on a thread of one pool, so launches left in flight could
  // fill it with parts of different runs, none complete (seen: the process
  // aborted after XLA's 40 s rendezvous limit).
  virtual bool collectivesOneAtATime() const { return false; }
  virtual int spinnerThreads() const { return 0; }
  // The newest XLA FFI API minor version whose handlers the plugin runs; it
  // drops a newer handler at registration without an error, so torch_tpu
  // checks first. -1: not known.
  virtual int ffiApiMinor() const { return -1; }
};

// One launch between launchBegin and launchEnd: until destruction, or until
// the completion event it is handed to fires. `s` null: no hooks.
class LaunchScope {
 public:
  explicit LaunchScope(PluginSupport* s) : s_(s) {
    if (s_) s_->launchBegin();
  }
  ~LaunchScope() {
    if (s_) s_->launchEnd();
  }
  LaunchScope(const LaunchScope&) = delete;
  LaunchScope& operator=(const LaunchScope&) = delete;
  // Ends the launch when `event` is ready instead (an asynchronous launch).
  template <typename Event>
  void endWhenReady(const Event& event) {
    if (!s_) return;
    event.onReady([s = s_] { s->launchEnd(); });
    s_ = nullptr;  // after: if onReady throws, the destructor still ends it
  }

 private:
  PluginSupport* s_;
};

// What the runtime knows before a client exists, for a plugin's options.
struct ClientRequest {
  int cpu_devices = 1;  // TORCH_TPU_CPU_DEVICES
  // This process's place in a client spanning processes; asked only by a
  // plugin that runs collectives across processes. Empty or nothing: one process.
  std::function<std::optional<pjrt::ProcessSpan>()> span;
};

// What one platform's plugin adds. Every member may be empty.
struct PluginRegistration {
  std::string platform;  // as PJRT_Client_PlatformName reports it
  // The options its client is created with.
  std::function<pjrt::ClientOptions(const ClientRequest&)> client_options;
  // Whether a plugin loaded from a path is this platform's, judged from its
  // API table alone (its extensions), before a client exists.
  std::function<bool(const pjrt::Api&)> recognizes;
  // Its support; registers its kernels with `api`. Empty: the portable default.
  std::function<std::unique_ptr<PluginSupport>(const pjrt::Api&)> make_support;
};

// Registers a plugin at static initialisation, one object per
// csrc/plugins/<name>/. Each binary links tpu_core whole (CMakeLists.txt), so
// no registration is dropped for being unreferenced.
struct RegisterPlugin {
  explicit RegisterPlugin(PluginRegistration registration);
};
// The registration for `platform`, or null.
const PluginRegistration* findPlugin(const std::string& platform);

// Creates the client of the plugin `api`, found by `location` (pjrt::locatePlugin),
// with the options of its platform's registration.
std::unique_ptr<pjrt::Client> createClient(const std::shared_ptr<pjrt::Api>& api, const pjrt::PluginLocation& location,
                                           const ClientRequest& request);

// The support for the plugin behind `client`: its platform's, or the
// portable default (nothing added). Registers what the plugin adds.
std::unique_ptr<PluginSupport> makePluginSupport(const pjrt::Api& api, const pjrt::Client& client);

}  // namespace tpu::runtime
