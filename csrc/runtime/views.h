// Reading and writing strided views of a device array (a tensor storage).
// A view is (dtype, sizes, strides, offset) over the storage's elements, as in
// PyTorch. Programs are cached by geometry; the offset is a runtime input so
// that moving a window over a storage does not recompile.
#pragma once

#include <vector>

#include "runtime/runtime.h"

namespace tpu::runtime {

struct ViewGeometry {
  ir::DType dtype;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
  int64_t numel() const;
  bool contiguous() const;
};

// Program pieces shared with the fused (lazy) graph: reinterpret a flat
// array's bytes as another dtype; read a view of a flat storage value as a
// flat value; write a flat value into a view of a flat storage value. The
// offset is a 0-d i64 value.
ir::Value reinterpret(ir::Builder& b, const ir::Value& v, ir::DType to);
// `standalone`: the read is a program of its own (strict eager materialising
// a view), not part of a graph whose consumers may absorb a transpose.
ir::Value buildRead(ir::Builder& b, const ir::Value& flat, const ir::Value& offset, const ViewGeometry& g,
                    bool standalone = false);
ir::Value buildWrite(ir::Builder& b, const ir::Value& flat, const ir::Value& value, const ir::Value& offset,
                     const ViewGeometry& g);

// A program result: the flat storage value `flat`, given the shape of the
// tensor that holds it (`shape`, memory order) on the CPU plugin. XLA:CPU
// emits the fusion that computes a result as a loop over the result's shape:
// over a flat shape a broadcast operand is indexed modulo its size and the
// loop is not vectorized (x * w + b over [1024, 64] in a compiled graph:
// 8.3 us with flat results, 2.8 us with [1024, 64] ones). Later programs still
// take the buffer as flat storage, which the CPU plugin accepts because both
// are the same dense bytes; other plugins lay out an N-d buffer in tiles, so
// there (and where `shape` does not cover `flat`) the result stays flat.
ir::Value resultInShape(ir::Builder& b, const ir::Value& flat, const ir::Shape& shape);

// Runs a program: inputs in order; returns its outputs. Counts executions.
// In blocking mode (TPU_LAUNCH_BLOCKING) waits for the results. An aliased
// input is donated when `inputs` holds its only reference, or, for the
// params in `overwritten`, one more: that of the array the caller replaces
// with the program's result right after.
std::vector<BufferPtr> execute(const Program& p, const std::vector<BufferPtr>& inputs, int device,
                               const std::vector<int>& overwritten = {});
// Which overwritten arguments give their buffers to the program that
// overwrites them (TORCH_TPU_DONATE, TORCH_TPU_DONATE_MIN_BYTES): never when
// donation is off; otherwise buffers of at least min_bytes (eager modes;
// compiled graphs donate at any size).
struct DonationPolicy {
  bool enabled = true;
  size_t min_bytes = size_t{1} << 20;
  bool allows(size_t bytes) const { return enabled && bytes >= min_bytes; }
};
const DonationPolicy& donationPolicy();
void setLaunchBlocking(bool on);
// Waits for every program launched on `device` so far; rethrows the first
// failure. Events record the same set.
void synchronize(int device);
using PendingSet = std::vector<std::shared_ptr<pjrt::Event>>;  // completion events
PendingSet pendingSnapshot(int device);
bool allReady(const PendingSet& s);
void awaitAll(const PendingSet& s);
bool launchBlocking();

void flushIfLazy(DeviceArray& a);

// Makes sure the array holds a buffer whose element type is `t`
// (zero-filling an unwritten array, reinterpreting bytes of another dtype).
void ensureTyped(DeviceArray& a, ir::DType t);

// The view's elements as a flat, dense buffer of numel() elements.
BufferPtr readView(DeviceArray& a, const ViewGeometry& g);
// Writes a flat buffer of numel() elements into the view.
void writeView(DeviceArray& a, const ViewGeometry& g, const BufferPtr& value);
// Sets elements [begin, end) of the array, typed `t`, to the 0-d `value`:
// one program per array size and dtype, the range its argument (a serving
// step fills a per-step buffer's padded tail, a new length each step).
void fillRange(DeviceArray& a, ir::DType t, int64_t begin, int64_t end, const BufferPtr& value);

// Index checks: `ok` is a bool scalar computed by an indexing program. It is
// read at the first host read after the program finished, or at synchronize
// (at once in blocking mode); if false, that read throws std::out_of_range
// naming `op`. A read of a result waits for the programs it depends on, so
// their checks run at that read; `finished_only` leaves the checks of
// programs still running (queued after what is read) to a later read.
void checkIndicesLater(const BufferPtr& ok, const std::string& op, int device);
void checkPendingIndices(bool finished_only = false);

// A cached 0-d buffer holding `v` (scalars passed to programs).
BufferPtr scalarBuffer(ir::DType t, double v, int device);
BufferPtr scalarBufferInt(ir::DType t, int64_t v, int device);

}  // namespace tpu::runtime
