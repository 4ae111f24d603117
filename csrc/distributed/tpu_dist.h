// tpu_dist, the c10d backend for the tpu device (tpu_dist.cpp says how it works).
#pragma once

#include <pybind11/pybind11.h>

namespace tpu::distributed {

// Adds _C._tpu_dist_backend(host_backend, rank, size), which the Python
// creator registered with torch.distributed calls.
void registerPython(pybind11::module& m);
// Adds _C._tpu_dist_xla_backend (the XLA transport) and _C._comm_collective
// (torch.tpu.comm's launches); xla_transport.cpp.
void registerXlaTransport(pybind11::module& m);
// Hands the runtime this process's place among torchrun's processes (for a
// plugin whose client spans them) and adds the _C functions that report it;
// process_span.cpp.
void registerProcessSpan(pybind11::module& m);

}  // namespace tpu::distributed
