// aten/ is the PyTorch side of the device (PrivateUse1, renamed "tpu"):
// device.cpp (allocator, guard, hooks, generator, copies), tensors.cpp,
// dispatcher.cpp (the boxed kernel every op enters, which picks a mode),
// op_plan.h (the steps the modes share) and fallback.cpp. This header is the
// glue they share: dtype mapping, the storage's device array, tensor <->
// buffer, the device's generator.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GeneratorImpl.h>

#include "ir/ir.h"
#include "runtime/runtime.h"
#include "runtime/views.h"

namespace tpu::aten {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;

// Throws ir::Unsupported for dtypes the device cannot hold.
ir::DType toIr(at::ScalarType t);
at::ScalarType toAten(ir::DType t);
bool supported(at::ScalarType t);
// The dtypes tpu holds on this plugin, for messages ("float32, float64, ...").
std::string supportedDtypes();

c10::Allocator* allocator();
c10::DeviceIndex currentDevice();
void checkDeviceIndex(c10::DeviceIndex d);

runtime::DeviceArray& arrayOf(const at::Tensor& t);
// DLPack: note a tpu tensor a capsule is made of; a tensor torch.from_dlpack
// made over such a capsule's address, as a view of the exporter's storage (any
// other tensor as it is).
void noteExported(const at::Tensor& t);
at::Tensor adoptExported(const at::Tensor& t);
runtime::ViewGeometry geometryOf(const at::Tensor& t);
// The tensor's elements as a flat dense buffer.
runtime::BufferPtr readTensor(const at::Tensor& t);
// Writes a flat dense buffer into the tensor (through any view).
void writeTensor(const at::Tensor& t, const runtime::BufferPtr& b);
// A new tpu tensor holding `b` (elements in memory order), contiguous or
// with the given dense strides.
at::Tensor wrapBuffer(runtime::BufferPtr b, at::IntArrayRef sizes, at::ScalarType dtype, c10::DeviceIndex device,
                      at::OptionalIntArrayRef strides = std::nullopt);
at::Tensor emptyTpu(at::IntArrayRef sizes, at::ScalarType dtype, c10::DeviceIndex device);

// Copies between cpu and tpu or tpu and tpu; dst and src may be views,
// differ in dtype, and src broadcasts to dst.
void copyInto(const at::Tensor& dst, const at::Tensor& src);
// A mode that defers ops (fused eager) installs these at static
// initialisation, so that this layer never includes it: `record` makes a copy
// into a tpu tensor a step of its pending graph (false: not deferred, and
// copyInto copies now); `host_read` runs before a copy to the host waits for
// the device's data.
struct DeferredCopies {
  bool (*record)(const at::Tensor& dst, const at::Tensor& src) = nullptr;
  void (*host_read)(c10::DeviceIndex device) = nullptr;
};
void setDeferredCopies(const DeferredCopies& hooks);
// Physically applies a source's conjugate / negative bits (PyTorch's lazy
// conj() and _neg_view()) to its elements, in the source dtype.
ir::Value applyMathBits(ir::Builder& b, ir::Value x, bool conj, bool neg);

// Grows or shrinks a storage's bytes, keeping its contents.
void resizeStorageBytes(c10::StorageImpl* storage, size_t nbytes);

// The device's default generator: (seed, offset); each random op takes a
// fresh state derived from both and advances the offset.
class TpuGenerator : public c10::GeneratorImpl {
 public:
  explicit TpuGenerator(c10::DeviceIndex device);
  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  static c10::DeviceType device_type() { return kTpu; }
  // Returns the state words for the next random op.
  std::array<uint64_t, 2> next();

 private:
  TpuGenerator* clone_impl() const override;
  uint64_t seed_ = 67280421310721ull;
  uint64_t offset_ = 0;
};
const at::Generator& defaultGenerator(c10::DeviceIndex device);

// Converts runtime errors into the exception types PyTorch raises.
[[noreturn]] void rethrow(const std::exception& e, const std::string& context);

// Fallback policy: TORCH_TPU_FALLBACK=error raises instead of running on CPU.
bool fallbackIsError();
void setFallbackError(bool on);

// Lowerings turned off by name (ATen base names, e.g. "linalg_det"): those ops
// run through the CPU fallback. For bisecting a suspected wrong lowering and
// for tests of the fallback path. TORCH_TPU_DISABLE_LOWERINGS=a,b sets it.
bool loweringDisabled(const std::string& base);
void setDisabledLowerings(std::vector<std::string> names);
std::vector<std::string> disabledLowerings();

// The tables the dispatcher consults per op changed (dtype refusals, overlap
// checks, lowerings turned off, an op's schema removed): it works each op's
// facts out again on next sight (dispatch/dispatcher.cpp), which compares the
// generation it built them at with opTablesGeneration().
void opTablesChanged();
uint64_t opTablesGeneration();

}  // namespace tpu::aten
