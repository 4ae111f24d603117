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

#include <chrono>
#include <functional>
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

// --- Programs with collectives inside (a compiled step whose collectives XLA
// runs): one replica per participant, each launched by the thread that drives
// its device, all in this process.

// The launch id of local device `device`'s next run of a multi-replica program
// over `participants`: every participant counts its own runs, and they run the
// same programs in the same order. Apart from the ids tpu_dist's own
// collectives use.
int nextProgramLaunch(const std::vector<int>& participants, int device);
// The completion of device `device`'s last multi-replica launch (awaited
// before its next one: see arriveTogether).
void noteProgramLaunch(int device, std::shared_ptr<pjrt::Event> done);
// Waits, at most `timeout`, until every participant (global device ids) has
// come here as often as local device `device` has, and checks that all came
// for the same `what` (a collective, a program). A participant that does not
// come within `timeout`, or came for something else, is an error raised on
// every participant that waited: nobody is left inside XLA waiting for a
// launch that never comes (XLA:CPU aborts the process after 40 s of that).
// First waits for this device's last multi-replica launch to finish: on the
// CPU plugin runs left in flight fill XLA's thread pool.
void arriveTogether(const std::vector<int>& participants, int device, const std::string& what,
                    std::chrono::milliseconds timeout);
// How a thread waits in arriveTogether: the Python layer releases the GIL
// (the others may need it to get here).
using BlockingWait = void (*)(const std::function<void()>& block);
void setBlockingWait(BlockingWait wait);
// Runs `block`, which may wait for other ranks' threads, that way.
void blocking(const std::function<void()>& block);

}  // namespace tpu::runtime
