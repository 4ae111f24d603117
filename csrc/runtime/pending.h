// Pending contents, as the runtime sees them. A device array may hold a value
// not computed yet (DeviceArray::lazyValue: fused eager's pending graph,
// fused/engine/fused_graph.h). The runtime never includes that engine: the
// engine installs these hooks (at static initialisation) and the runtime calls
// them where it needs an array's contents computed or an array lets go of its
// pending value. Without an engine there is nothing pending and they are no-ops.
#pragma once

#include <memory>

namespace tpu::runtime {

class DeviceArray;
struct LazyValue;

struct PendingHooks {
  // Computes what is pending on `device` (every device when device < 0).
  void (*flush)(int device) = nullptr;
  // `array` is being destroyed: detach it from its pending value `value`
  // (under the engine's lock, since a graph materialising on another thread
  // reaches its arrays through their values) and let the value go.
  void (*detach)(const DeviceArray* array, std::shared_ptr<LazyValue>& value) = nullptr;
};

// Installs the engine's hooks (once, at static initialisation).
void setPendingHooks(const PendingHooks& hooks);
const PendingHooks& pendingHooks();

}  // namespace tpu::runtime
