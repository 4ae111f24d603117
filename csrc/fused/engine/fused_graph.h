// Fused eager: ops are recorded into a per-device pending graph instead of
// running. A device array whose contents are not computed yet holds a
// LazyValue (its flat storage value in the graph). The graph materialises as
// one program when the host needs data, at a sync, at a size limit, when
// the op stream repeats (a loop iteration) or at a phase change (fused eager:
// a backward pass starts or ends); values no live array refers to
// are never computed. Programs are cached by their text (memory and disk).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "op_steps/recording.h"
#include "runtime/runtime.h"
#include "runtime/views.h"

namespace tpu::runtime {

class LazyGraph;

// What a captured graph's recording reports (op_steps/recording.h: the
// capture mode reads it there, never including this engine).
using steps::CaptureResult;
using steps::InputTag;

// A storage's pending contents: a flat [numel] value of `dtype` in `graph`.
struct LazyValue {
  LazyGraph* graph = nullptr;
  ir::Value value;
  DeviceArray* owner = nullptr;
  ir::Shape natural;  // the tensor shape it was written as, when that covers the whole array
  // A captured program's result (LazyGraph::call): donated whatever its size,
  // as the program's own replay would.
  bool any_size = false;
};

class LazyGraph {
 public:
  explicit LazyGraph(int device);
  ir::Builder& builder() { return *b_; }
  int device() const { return device_; }
  int ops() const { return ops_; }

  // Graph inputs: a materialised buffer (deduplicated) or a 0-d scalar.
  // `owner`: the array whose contents the buffer holds, if any.
  ir::Value input(const BufferPtr& buf, const ir::Type& type, const DeviceArray* owner = nullptr);
  ir::Value scalar(const BufferPtr& buf, ir::DType t);

  // The flat storage value of `a` as dtype `t` (materialised arrays become
  // inputs; unwritten ones zeros).
  ir::Value storage(DeviceArray& a, ir::DType t);
  // A view of `a` as a value of the view's shape.
  ir::Value read(DeviceArray& a, const ViewGeometry& g);
  // Writes a value of the view's shape into the view of `a`.
  void write(DeviceArray& a, const ViewGeometry& g, const ir::Value& v);
  // A new array holding `flat` (memory order), pending.
  void bind(DeviceArray& a, const ir::Value& flat, ir::DType t, const ir::Shape& natural = {});
  // An index check: `ok` must hold, else `op` raises at materialisation.
  void check(const ir::Value& ok, const std::string& op);

  // Counts one ATen op with signature hash `sig`; returns true when the
  // graph should materialise now (size limit, or a loop iteration ended).
  bool noteOp(const std::string& key);
  // The next op belongs to `phase` (fused eager: 1 inside a backward pass);
  // true when recorded ops of another phase are pending, which then run as
  // their own program.
  bool enterPhase(int phase) {
    const bool cut = ops_ > 0 && phase != phase_;
    phase_ = phase;
    return cut;
  }
  // Compiles (cached) and runs the graph; pending arrays get their buffers.
  // With `cap`, also reports what ran (for replay).
  void materialize(CaptureResult* cap = nullptr);
  // A replay of a captured program recorded as a call of its function
  // (steps::Recorder::recordCall says what the arguments are). False, nothing
  // recorded, when the function's collectives span other devices than this
  // graph's pending ones (run what is pending first). Its channels come after
  // the graph's (ir::withChannelsAfter): programs recorded apart number
  // theirs from 1.
  bool call(const CaptureResult& ran, const std::vector<DeviceArray*>& args, const std::vector<BufferPtr>& buffers,
            const std::vector<DeviceArray*>& results, std::chrono::milliseconds timeout);
  // The channel of a collective recorded into this graph: past every channel
  // it holds (a called program's are raised past them too: call()).
  int64_t nextChannel(std::chrono::milliseconds timeout) {
    collective_timeout_ = std::max(collective_timeout_, timeout);
    return ++channels_;
  }
  // Capture: reads of these arrays (argument index) become their own inputs.
  void setCaptureInputs(std::unordered_map<const DeviceArray*, int> arrays);
  // Device arrays read since setCaptureInputs that are not capture inputs:
  // a replay would pass their buffers of the capture's time (or zeros, for
  // an array not yet written).
  int externalReads() const { return external_reads_; }
  // While a torch.compile graph is captured, Python scalars and view offsets
  // are fixed for every replay: they become constants of the program, which
  // lets XLA fold them (alpha = 1 multiplies, static slices instead of
  // dynamic ones). Fused eager keeps them as inputs, so new values reuse the
  // program.
  void setBakeScalars(bool on) { bake_scalars_ = on; }
  bool bakeScalars() const { return bake_scalars_; }
  void tagLastInput(InputTag t) { tags_.back() = t; }
  int materializations() const { return materializations_; }
  std::string describeOps() const;

 private:
  void reset();
  ir::Value offset(const ViewGeometry& g);  // a view's storage offset
  // Donation: pairs each result that overwrites an array with the input that
  // held the array's old contents, where XLA can write it in place (see
  // ir::Builder::inPlaceSafe). Returns (input, index in `outs`) pairs; the
  // program aliases them, and execute() donates those inputs nobody else holds.
  // Buffers under `min_bytes` are left alone.
  std::vector<std::pair<int, int>> donations(const std::vector<std::shared_ptr<LazyValue>>& outs, size_t min_bytes);
  int device_;
  std::unique_ptr<ir::Builder> b_;
  std::vector<BufferPtr> inputs_;
  std::vector<InputTag> tags_;
  // The uid of the array each input's buffer belongs to (0: none). Not its
  // address: a dead array's address, reused by a new one, would pair buffers
  // by chance and change the program's text from step to step.
  std::vector<uint64_t> input_owners_;
  std::unordered_map<PJRT_Buffer*, ir::Value> input_of_;
  std::unordered_map<const DeviceArray*, int> capture_inputs_;
  std::unordered_map<const DeviceArray*, ir::Value> capture_params_;
  int external_reads_ = 0;
  uint64_t capture_first_uid_ = 0;  // arrays made since setCaptureInputs have this uid or more
  int materializations_ = 0;
  bool bake_scalars_ = false;
  bool donate_;
  size_t donate_min_bytes_;  // fused eager: smaller buffers are not donated
  // declareDonations' analysis, by graph fingerprint and candidate pairs.
  std::unordered_map<std::string, std::vector<std::pair<int, int>>> donations_;
  std::vector<std::weak_ptr<LazyValue>> values_;
  std::vector<std::pair<ir::Value, std::string>> checks_;
  int ops_ = 0;
  int phase_ = 0;
  // The longest timeout of the groups whose collectives the recorded calls
  // hold: the ranks meet within it before the launch (runDeferred).
  std::chrono::milliseconds collective_timeout_{0};
  int64_t channels_ = 0;  // the highest channel of the graph's collectives
  // Loop detection: op signatures since the last cut, and the learned period.
  std::vector<uint64_t> sigs_;
  std::vector<uint64_t> period_;
  std::vector<std::string> keys_;       // this graph's op signatures
  std::vector<std::string> last_keys_;  // those of the last graph that compiled
};

// The process-wide fused-eager state.
// The fusion mutex. A thread that finds it taken waits through a hook the
// Python layer sets (setWaitHook): a thread holding the GIL lets it go while
// it waits, because the holder may need the GIL to finish (a Python meta
// kernel); waiting here with the GIL held deadlocked a compiling thread
// against an eager one.
class FusionMutex {
 public:
  // Runs `block` (which waits for the mutex) the hook's way.
  using WaitHook = void (*)(const std::function<void()>& block);
  static void setWaitHook(WaitHook hook);
  void lock();
  void unlock() {
    --depth_;
    mu_.unlock();
  }
  bool try_lock() {
    if (!mu_.try_lock()) return false;
    ++depth_;
    return true;
  }
  // This thread holds it once (no caller up its stack holds it too).
  static bool heldOnceHere() { return depth_ == 1; }

 private:
  std::recursive_mutex mu_;
  static thread_local int depth_;
};

// Runs a program materialize(&ran) deferred (ran.deferred: it has collectives
// inside) on `device` with no lock held and the GIL let go, its launch waiting
// for the other ranks'; then, under the fusion mutex, its arrays take the
// results. A failure carries `what` and the error into them, and is thrown.
void runDeferred(steps::CaptureResult& ran, int device, const std::string& what);

class Fusion {
 public:
  static Fusion& get();
  // Whether this thread's ops are deferred: its own whole-graph recording, else
  // the mode set, unless another thread is recording a whole graph (then ops run
  // strict, so that they do not join that thread's program).
  bool enabled() const {
    if (tl_whole_graph_ > 0) return true;
    return enabled_ && whole_graph_threads_.load(std::memory_order_acquire) == 0;
  }
  // The same for this thread's ops on `device`: only another thread's whole
  // graph of that device (or of every device) makes them strict, so ranks of
  // a local group, a device each, defer the same ops whatever the others do.
  bool enabled(int device) const {
    if (tl_whole_graph_ > 0) return true;
    if (!enabled_) return false;
    if (whole_graph_threads_.load(std::memory_order_acquire) == 0) return true;
    if (whole_graph_all_.load(std::memory_order_acquire) > 0 || device < 0 || device >= 64) return false;
    return ((whole_graph_mask_.load(std::memory_order_acquire) >> static_cast<unsigned>(device)) & 1U) == 0;
  }
  // Turning it off materialises every pending graph.
  void setEnabled(bool on);
  LazyGraph& graph(int device);
  // Materialises the device's graph (all devices when device < 0). A graph
  // with collectives inside (a rank's thread recording a compiled step reads a
  // value mid-step) runs with the lock let go, when only this call holds it.
  void flush(int device = -1);
  // Materialises `graph`, whose caller holds the mutex through `lock`: as
  // flush does, letting it go while a program with collectives runs.
  void run(LazyGraph& graph, std::unique_lock<FusionMutex>& lock);
  FusionMutex& mutex() { return mu_; }
  // True once any array has been given a pending value. From then on a freed
  // array detaches from its value under mutex() (see ~DeviceArray).
  static bool inUse() { return in_use_.load(std::memory_order_acquire); }
  static void markInUse() { in_use_.store(true, std::memory_order_release); }
  int maxOps() const { return max_ops_; }
  // This thread is recording a whole captured graph (torch.compile): no loop
  // or size cuts, so the graph becomes one program when it ends.
  bool wholeGraph() const { return tl_whole_graph_ > 0; }
  // Enters whole-graph recording on this thread: runs what is pending; this
  // thread's ops are deferred until endWholeGraph. False (not entered; this
  // thread's ops run strict) while another thread records: on any device when
  // `device` < 0; with a device (a captured graph's), on that device, so that
  // threads driving a device each (ranks of a local group) record at once.
  bool beginWholeGraph(int device = -1);
  // Runs the recorded graph as one program; `entered`: what beginWholeGraph said.
  void endWholeGraph(bool entered);

 private:
  Fusion();
  bool enabled_ = false;
  static thread_local int tl_whole_graph_;
  static thread_local int tl_whole_graph_device_;  // -1: every device
  std::atomic<int> whole_graph_threads_{0};        // threads recording a whole graph
  std::atomic<int> whole_graph_all_{0};            // of them, those recording every device
  std::atomic<uint64_t> whole_graph_mask_{0};      // devices (< 64) recorded whole
  // Devices whose graph another thread records whole (-1: all of them).
  std::unordered_map<int, std::thread::id> whole_graph_devices_;
  bool recordedElsewhere(int device) const;
  int max_ops_;
  FusionMutex mu_;
  std::vector<std::unique_ptr<LazyGraph>> graphs_;
  static std::atomic<bool> in_use_;
};

}  // namespace tpu::runtime
