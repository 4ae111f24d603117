// Collectives as XLA programs: the transport tpu_dist and torch.tpu.comm use
// where the plugin runs collectives itself (several devices of one process on
// every plugin; across processes where the plugin's client was created for it).
//
// Each collective is a small StableHLO program over flat 1-D operands, one
// replica per participating device, replica r on the device whose global id
// (pjrt::DeviceInfo::global_id: unique across the processes of a client) is
// participants[r]. Programs are
// compiled once per (collective, dtype, length, participants) and kept.
// No torch headers here.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ir/ir.h"
#include "runtime/runtime.h"

namespace tpu::runtime {

enum class Collective {
  AllReduce,      // n -> n
  AllGather,      // n -> world*n, replica r's block at r*n
  ReduceScatter,  // world*n -> n, replica r keeps block r
  AllToAll,       // world*n -> world*n, block s of replica r's output is block r of replica s's input
  Broadcast,      // n -> n, every replica gets the root's
  Permute,        // n -> n, each target gets its source's (others: zeros)
};

enum class Reduction { Sum, Prod, Min, Max, Avg, BitAnd, BitOr, BitXor };

struct CollectiveSpec {
  Collective kind = Collective::AllReduce;
  Reduction reduce = Reduction::Sum;
  ir::DType dtype = ir::DType::F32;
  int64_t n = 0;                           // elements of each replica's block
  int root = 0;                            // Broadcast: the replica that sends
  std::vector<std::pair<int, int>> pairs;  // Permute: (source replica, target replica)
  std::vector<int> participants;           // global device id of each replica
  std::string name() const;                // "all_reduce", ...
};

// The StableHLO module text for `spec` (exposed for tests).
std::string collectiveProgram(const CollectiveSpec& spec);

// The compiled program for `spec` (cached in memory for the process).
std::shared_ptr<pjrt::Executable> collectiveExecutable(const CollectiveSpec& spec);

// Runs `spec` over all participants in one launch (one process drives all of
// them): inputs[r] is replica r's operand, on the device of participants[r].
std::vector<BufferPtr> runCollective(const CollectiveSpec& spec, const std::vector<BufferPtr>& inputs);

// Runs this caller's replica of `spec` on local device index `device`; every other participant
// makes the same call with the same `launch_id` (from its own thread or
// process). Returns when the plugin has taken the launch.
BufferPtr runCollectiveShard(const CollectiveSpec& spec, const BufferPtr& input, int device, int launch_id);

// The global id of this process's device `index`.
int globalDeviceId(int index);

}  // namespace tpu::runtime
