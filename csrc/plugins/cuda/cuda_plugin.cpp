// What the CUDA PJRT plugin adds to the portable core (runtime/plugin.h): its
// client options only. Its lowerings stay the portable StableHLO ones, and
// its support is the portable default; its own kernels would go here, behind
// kernel slots (ops/kernel_slots.h), as the CPU plugin's do. No torch headers.
#include "pjrt/pjrt.h"
#include "runtime/plugin.h"

namespace tpu::plugins::cuda {
namespace {

// A growing allocator instead of taking 75% of the card at start, so that
// several processes (and PyTorch's own CUDA allocator) can share one GPU.
// Across processes (how JAX runs NCCL): this process's node id, the node
// count, and the key-value store the nodes meet through.
pjrt::ClientOptions clientOptions(const runtime::ClientRequest& request) {
  pjrt::ClientOptions o;
  o.values.push_back({"preallocate", false});
  std::optional<pjrt::ProcessSpan> s = request.span ? request.span() : std::nullopt;
  if (s && s->process_count > 1 && s->store) {
    o.values.push_back({"node_id", int64_t{s->process_id}});
    o.values.push_back({"num_nodes", int64_t{s->process_count}});
    o.kv = s->store;
  }
  return o;
}

// A plugin given by path is the GPU plugin when its API table has the GPU
// custom-call extension, which only XLA's GPU plugins carry. This matters
// before a client exists: a first client with the plugin's defaults would
// take 75% of every visible GPU.
bool recognizes(const pjrt::Api& api) {
  for (const PJRT_Extension_Base* e = api.raw()->extension_start; e; e = e->next)
    if (e->type == PJRT_Extension_Type_Gpu_Custom_Call) return true;
  return false;
}

const runtime::RegisterPlugin kRegistration({"cuda", clientOptions, recognizes, {}});

}  // namespace
}  // namespace tpu::plugins::cuda
