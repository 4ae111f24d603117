// The plugin seam: what the portable core asks of the PJRT plugin it drives,
// beyond the PJRT C API. The runtime holds one PluginSupport, chosen by the
// plugin's platform when it starts; the core never asks which plugin it is.
// The CPU plugin's support (csrc/plugins/cpu/) adds host kernels as XLA FFI
// custom calls, a GEMM on the host BLAS, core spinners, malloc tuning, in-place
// host reads and a vector width; a CUDA or TPU plugin's own kernels go in
// csrc/plugins/<name>/ behind the same interface. No torch headers here.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "pjrt/pjrt.h"

namespace tpu::runtime {

class PluginSupport {
 public:
  virtual ~PluginSupport() = default;
  // "cpu", or "portable" for a plugin with nothing of its own.
  virtual const char* name() const = 0;
  // The custom-call targets registered with the plugin: a lowering with a
  // custom-call form emits it only for a target listed here (ops::pluginKernel).
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

// The support for the plugin behind `client`: its platform's, or the
// portable default (nothing added). Registers what the plugin adds.
std::unique_ptr<PluginSupport> makePluginSupport(const pjrt::Api& api, const pjrt::Client& client);

}  // namespace tpu::runtime
