#include "op_steps/recording.h"

#include <stdexcept>

namespace tpu::steps {
namespace {
// Both installed at static initialisation, before any op runs.
Recorder* g_recorder = nullptr;
CpuScalarArgument g_cpu_scalar_argument = nullptr;
}  // namespace

Recorder& recorder() {
  if (!g_recorder) throw std::logic_error("torch_tpu: no recorder installed (fused eager registers it)");
  return *g_recorder;
}
void setRecorder(Recorder* r) { g_recorder = r; }

void setCpuScalarArgument(CpuScalarArgument f) { g_cpu_scalar_argument = f; }
int cpuScalarArgument(const void* impl) { return g_cpu_scalar_argument ? g_cpu_scalar_argument(impl) : -1; }

}  // namespace tpu::steps
