// Recording a whole graph (torch.compile's capture, compile/capture.h) through
// the engine that defers ops (fused eager's pending graph,
// fused/engine/fused_graph.h). Two modes meet here, so neither includes the
// other: the fused mode installs the Recorder, the capture mode installs the
// CPU-scalar hook, and each calls the other only through this header.
// No torch headers: the engine (tpu_core) includes it for the two types below.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/runtime.h"

namespace tpu::steps {

// Where a graph input comes from, for replaying a captured graph: a fixed
// buffer, a graph argument's array, a CPU scalar argument, or a fresh
// random-number state.
struct InputTag {
  enum class Kind { Fixed, Input, CpuInput, Rng };
  Kind kind = Kind::Fixed;
  int index = -1;
};

// What a captured graph's final materialisation ran: enough to run it again
// with other arguments without lowering anything.
struct CaptureResult {
  std::shared_ptr<runtime::Program> prog;
  std::vector<runtime::BufferPtr> inputs;  // per param: the buffer of a Fixed one, else null
  std::vector<InputTag> tags;
  std::vector<runtime::DeviceArray*> out_owners;
  std::vector<std::string> checks;
  // A program with collectives is not run where its recording ends: the
  // engine's lock is held there, and its launch waits for the other ranks',
  // who need that lock to get to theirs. The capture mode runs it after
  // letting go (`deferred`: this run's buffers; `results`: per out_owner, the
  // dtype and element count it takes).
  bool deferred = false;
  std::vector<runtime::BufferPtr> deferred_inputs;
  std::vector<std::pair<ir::DType, int64_t>> results;
  // Set by the caller: also keep the program's body as a function (same
  // params and results), which a replay under fused eager calls inside the
  // pending graph instead of launching the program (Recorder::recordCall).
  bool with_function = false;
  std::shared_ptr<const ir::Function> fn;
  // Set for a deferred program whose collectives no recording has met yet
  // (fused eager's calls of captured programs): the ranks meet within it
  // before the launch (runtime::arriveTogether).
  std::chrono::milliseconds meet_within{0};
};

// What the capture mode asks of the engine that defers ops. lock()/unlock():
// the engine's (recursive) lock, held across each capture step; the other
// calls are made under it. Per device: the device's pending graph.
class Recorder {
 public:
  virtual ~Recorder() = default;
  virtual void lock() = 0;
  virtual void unlock() = 0;
  // Enters whole-graph recording of `device`'s graph on this thread (no loop
  // or size cuts): runs what is pending; false while another thread records
  // that device (then this thread's ops run strict). endWholeGraph runs the
  // recorded graph as one program.
  virtual bool beginWholeGraph(int device) = 0;
  virtual void endWholeGraph(bool entered) = 0;
  // Reads of these arrays (argument index) become inputs of their own.
  virtual void setCaptureInputs(int device, std::unordered_map<const runtime::DeviceArray*, int> arrays) = 0;
  // Python scalars and view offsets become constants of the program.
  virtual void setBakeScalars(int device, bool on) = 0;
  virtual int ops(int device) = 0;
  virtual int materializations(int device) = 0;
  // Device arrays read since setCaptureInputs that are not capture inputs.
  virtual int externalReads(int device) = 0;
  // Runs the graph as one program and reports what ran.
  virtual void materialize(int device, CaptureResult& ran) = 0;
  // Runs what materialize deferred (CaptureResult::deferred); called without the
  // lock: its launch returns when every rank's has come. A failure carries
  // `what` and the error into the results' arrays, and is thrown.
  virtual void runDeferred(int device, CaptureResult& ran, const std::string& what) = 0;
  // Whether this thread's ops on `device` are deferred into its pending graph
  // (fused eager on, no whole graph recorded here): then a replay is recorded
  // as a call (recordCall), so that a compiled step's forward, backward and
  // the eager optimizer around them become one program.
  virtual bool defersCalls(int device) = 0;
  // Records a call of ran.fn into `device`'s pending graph. Per param, in
  // order: `args[k]`, the array an Input param reads (its whole storage), else
  // `buffers[k]`, the buffer the param takes. Per result before the index
  // checks: `results[j]`, the array whose storage becomes it (null: unused).
  // `timeout`: its collectives' groups' (the ranks meet within it before the
  // launch). `key` names the program for the graph's loop detection. Called
  // under the lock, held once.
  virtual void recordCall(int device, const CaptureResult& ran, const std::vector<runtime::DeviceArray*>& args,
                          const std::vector<runtime::BufferPtr>& buffers,
                          const std::vector<runtime::DeviceArray*>& results, std::chrono::milliseconds timeout,
                          const std::string& key) = 0;
  // A collective of a group whose replicas are `world` joins `device`'s pending
  // graph (fused eager): runs what is pending first if that holds collectives
  // of another world, notes the group's timeout, and returns the collective's
  // channel (unique in the graph, the same on every rank).
  virtual int64_t pendingCollective(int device, const std::vector<int>& world, std::chrono::milliseconds timeout) = 0;
};
// The installed recorder (fused eager's, installed at static initialisation).
Recorder& recorder();
void setRecorder(Recorder* r);

// The capture mode's answer, while this thread records a graph, to "which
// graph argument is the CPU scalar tensor `impl` (its TensorImpl) that fused
// eager just made the graph's last input": its index, or -1 (then, if the
// graph has CPU arguments, the recording cannot be replayed). -1 when no
// capture mode is installed. Called under the recorder's lock.
using CpuScalarArgument = int (*)(const void* impl);
void setCpuScalarArgument(CpuScalarArgument f);
int cpuScalarArgument(const void* impl);

}  // namespace tpu::steps
