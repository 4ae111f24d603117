// tpu_dist, the c10d backend for the tpu device (tpu_dist.cpp says how it works).
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <optional>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <vector>

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

// A group whose collectives can run inside a compiled program: every rank is a
// thread of this process driving a device of its own (local_group).
struct InProgramGroup {
  std::vector<int> participants;  // each rank's device, by global id
  // The devices of every rank of its world (the threads whose groups this one is
  // among: a DeviceMesh's dimensions), by global id; a program's replicas.
  std::vector<int> world;
  int device = 0;  // this rank's local device index
  std::chrono::milliseconds timeout{0};
};
// `backend` (a group's tpu backend) as such a group; nullopt for any other.
std::optional<InProgramGroup> inProgramGroup(const c10::intrusive_ptr<c10d::Backend>& backend);

}  // namespace tpu::distributed
