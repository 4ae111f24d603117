// tpu_dist: the c10d backend for tpu tensors.
//
// PyTorch's distributed engine (c10d: ProcessGroup, DDP, FSDP2, DTensor,
// pipelining, torchrun) calls a Backend per device type. This one serves the
// "tpu" device. Its transport here is host staging, for plugins without
// cross-process collectives (the CPU plugin): all_reduce, all_gather,
// reduce_scatter and broadcast run in staging.cpp, over the point-to-point
// messages of an inner Backend (PyTorch's own ProcessGroupGloo, made by the
// Python side with this group's store, rank, size and timeout), reading tpu
// tensors in place where the device's memory is host memory and making results
// device buffers over the host blocks they were computed in. The other
// collectives copy the tensors to the host, run the inner backend's collective
// on the copies and copy the results back. Every byte of a tpu tensor taken to
// or brought from the host is counted in torch_tpu.metrics().
//
// Each collective finishes before its Work is returned (the results are on the
// device), so a Work never claims completion before the data is there; errors
// (a dead rank, a timeout, ranks that disagree on the collective) surface as
// exceptions from the call itself.
#include "distributed/tpu_dist.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ParallelGuard.h>
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "distributed/common.h"
#include "distributed/staging.h"
#include "runtime/env.h"
#include "runtime/runtime.h"

namespace tpu::distributed {
namespace {

using c10d::ReduceOp;

size_t bytesOf(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

// Bytes of `t` staged through the host, when it is a tpu tensor.
void countStaged(const at::Tensor& t) {
  if (onTpu(t)) runtime::metrics().dist_staged_bytes += static_cast<int64_t>(bytesOf(t));
}

// A host copy of `t` (the tensor itself when it already lives on the host).
at::Tensor toHost(const at::Tensor& t) {
  if (!onTpu(t)) return t;
  countStaged(t);
  return t.to(at::kCPU);
}

// A host tensor shaped like `t` to receive a result.
at::Tensor hostLike(const at::Tensor& t) { return onTpu(t) ? at::empty_like(t, t.options().device(at::kCPU)) : t; }

std::vector<at::Tensor> toHost(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(toHost(t));
  return out;
}

std::vector<at::Tensor> hostLike(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(hostLike(t));
  return out;
}

void backTo(const at::Tensor& dev, const at::Tensor& host) {
  if (!onTpu(dev)) return;
  countStaged(dev);
  // A collective writes its output's memory, as NCCL does: not an autograd op (a
  // pipeline stage receives into a leaf that requires grad) and no version bump.
  at::AutoDispatchBelowADInplaceOrView guard;
  dev.copy_(host);
}

void backTo(const std::vector<at::Tensor>& dev, const std::vector<at::Tensor>& host) {
  for (size_t i = 0; i < dev.size(); ++i) backTo(dev[i], host[i]);
}

void backTo(const std::vector<std::vector<at::Tensor>>& dev, const std::vector<std::vector<at::Tensor>>& host) {
  for (size_t i = 0; i < dev.size(); ++i) backTo(dev[i], host[i]);
}

std::vector<std::vector<at::Tensor>> hostLike(const std::vector<std::vector<at::Tensor>>& ts) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& v : ts) out.push_back(hostLike(v));
  return out;
}

std::vector<std::vector<at::Tensor>> toHost(const std::vector<std::vector<at::Tensor>>& ts) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& v : ts) out.push_back(toHost(v));
  return out;
}

// The op the host backend runs for `op`. Host backends have no AVG: it runs as
// SUM and finishAvg divides, as NCCL defines it (integers truncate).
// PREMUL_SUM runs as SUM over inputs scaled first (preMultiplied).
ReduceOp hostOp(const ReduceOp& op) {
  return op.op_ == ReduceOp::AVG || op.op_ == ReduceOp::PREMUL_SUM ? ReduceOp(ReduceOp::SUM) : op;
}

void finishAvg(const ReduceOp& op, const std::vector<at::Tensor>& ts, int64_t n) {
  if (op.op_ != ReduceOp::AVG) return;
  for (const auto& t : ts) {
    if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false))
      t.div_(n, "trunc");
    else
      t.div_(n);
  }
}

// What a rank contributes to a reduction: `t` on the host, scaled first for
// PREMUL_SUM (into a block of its own).
class Contribution {
 public:
  Contribution(const at::Tensor& t, const ReduceOp& op) : in_(t) {
    countStaged(t);
    if (op.op_ != ReduceOp::PREMUL_SUM || in_.bytes() == 0) return;
    c10::ParallelGuard serial(true);  // as the reductions (staging.cpp)
    scaled_ = staging::takeBlock(in_.bytes());
    at::Tensor host = at::from_blob(scaled_->data(), {t.numel()}, t.options().device(at::kCPU));
    host.copy_(at::from_blob(const_cast<uint8_t*>(in_.data()), {t.numel()}, host.options()));
    preMultiplied(op, host, /*in_place=*/true);
  }
  const uint8_t* data() const { return scaled_ ? scaled_->data() : in_.data(); }
  size_t bytes() const { return in_.bytes(); }

 private:
  staging::HostInput in_;
  staging::BlockPtr scaled_;
};

// `out` from the block it was computed in, counted.
void deliver(const at::Tensor& out, const staging::BlockPtr& block, size_t offset = 0) {
  staging::writeResult(out, block, offset);
  countStaged(out);
}

class TpuDistBackend final : public PerTensorCoalescing {
 public:
  TpuDistBackend(c10::intrusive_ptr<c10d::Backend> host, c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                 std::chrono::milliseconds timeout)
      : PerTensorCoalescing(rank, size),
        host_(std::move(host)),
        store_(std::move(store)),
        timeout_(timeout),
        check_(env::notDisabled("TORCH_TPU_DIST_CHECK")) {}

  const std::string getBackendName() const override { return "tpu_dist"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const at::Tensor& t = single("broadcast", tensors);
    auto out = staging::takeBlock(bytesOf(t));
    std::optional<staging::HostInput> in;
    if (rank_ == opts.rootRank) {
      in.emplace(t);
      countStaged(t);
    }
    staging::broadcast(group(), call("broadcast", tensors), static_cast<int>(opts.rootRank), in ? in->data() : nullptr,
                       out->data(), bytesOf(t));
    if (rank_ != opts.rootRank) deliver(t, out);
    return done(OpType::BROADCAST, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const at::Tensor& t = single("all_reduce", tensors);
    Contribution in(t, opts.reduceOp);
    auto out = staging::takeBlock(in.bytes());
    staging::allReduce(group(), call("all_reduce", tensors), in.data(), out->data(), t.numel(), t.scalar_type(),
                       opts.reduceOp.op_);
    deliver(t, out);
    return done(OpType::ALLREDUCE, tensors);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    c10d::ReduceOptions o = opts;
    o.reduceOp = hostOp(opts.reduceOp);
    agree("reduce", tensors);
    auto h = toHost(tensors);
    for (auto& t : h) preMultiplied(opts.reduceOp, t, /*in_place=*/true);
    host_->reduce(h, o)->wait();
    if (rank_ == opts.rootRank) {
      finishAvg(opts.reduceOp, h, size_);
      backTo(tensors, h);
    }
    return done(OpType::REDUCE, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    const at::Tensor& t = single("all_gather", inputs);
    TORCH_CHECK(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(size_),
                "tpu_dist: all_gather takes one output per rank");
    for (const auto& o : outputs[0])
      TORCH_CHECK(o.scalar_type() == t.scalar_type() && o.numel() == t.numel(),
                  "tpu_dist: all_gather's outputs must have the input's dtype and size");
    staging::HostInput in(t);
    countStaged(t);
    // Each rank's part at an aligned offset: each output is a buffer over its part.
    const size_t stride = staging::aligned(in.bytes());
    auto out = staging::takeBlock(stride * size_);
    staging::allGather(group(), call("all_gather", inputs), in.data(), in.bytes(), out->data(), stride);
    for (int r = 0; r < size_; ++r) deliver(outputs[0][r], out, r * stride);
    return done(OpType::ALLGATHER, outputs[0]);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK(output.scalar_type() == input.scalar_type() && output.numel() == input.numel() * size_,
                "tpu_dist: all_gather_into_tensor's output must hold world_size inputs of its dtype");
    auto c = call("all_gather_into_tensor", {input, output});
    staging::HostInput in(input);
    countStaged(input);
    auto out = staging::takeBlock(bytesOf(output));
    staging::allGather(group(), c, in.data(), in.bytes(), out->data(), in.bytes());
    deliver(output, out);
    return done(OpType::_ALLGATHER_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    auto hin = toHost(inputs);
    auto hout = hostLike(outputs);
    host_->gather(hout, hin, opts)->wait();
    backTo(outputs, hout);
    return done(OpType::GATHER);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    auto hin = toHost(inputs);
    auto hout = hostLike(outputs);
    host_->scatter(hout, hin, opts)->wait();
    backTo(outputs, hout);
    return done(OpType::SCATTER, outputs);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    const at::Tensor& output = single("reduce_scatter", outputs);
    TORCH_CHECK(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_),
                "tpu_dist: reduce_scatter takes one input per rank");
    const std::vector<at::Tensor>& parts = inputs[0];
    for (const auto& p : parts)
      TORCH_CHECK(p.scalar_type() == output.scalar_type() && p.numel() == output.numel(),
                  "tpu_dist: reduce_scatter's inputs must have the output's dtype and size");
    auto c = call("reduce_scatter", parts);
    std::vector<std::unique_ptr<Contribution>> in;
    std::vector<const uint8_t*> data;
    for (const auto& p : parts) {
      in.push_back(std::make_unique<Contribution>(p, opts.reduceOp));
      data.push_back(in.back()->data());
    }
    auto out = staging::takeBlock(bytesOf(output));
    staging::reduceScatter(group(), c, data, out->data(), output.numel(), output.scalar_type(), opts.reduceOp.op_);
    deliver(output, out);
    return done(OpType::REDUCE_SCATTER, outputs);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(output.scalar_type() == input.scalar_type() && input.numel() == output.numel() * size_,
                "tpu_dist: reduce_scatter_tensor's input must hold world_size outputs of its dtype");
    auto c = call("reduce_scatter_tensor", {input, output});
    Contribution in(input, opts.reduceOp);
    std::vector<const uint8_t*> parts;
    for (int r = 0; r < size_; ++r) parts.push_back(in.data() + r * bytesOf(output));
    auto out = staging::takeBlock(bytesOf(output));
    staging::reduceScatter(group(), c, parts, out->data(), output.numel(), output.scalar_type(), opts.reduceOp.op_);
    deliver(output, out);
    return done(OpType::_REDUCE_SCATTER_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits, std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    auto hin = toHost(input);
    auto hout = hostLike(output);
    host_->alltoall_base(hout, hin, output_splits, input_splits, opts)->wait();
    backTo(output, hout);
    return done(OpType::ALLTOALL_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    auto hin = toHost(inputs);
    auto hout = hostLike(outputs);
    host_->alltoall(hout, hin, opts)->wait();
    backTo(outputs, hout);
    return done(OpType::ALLTOALL, outputs);
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    auto h = toHost(tensors);
    auto inner = host_->send(h, dst, tag);
    runtime::metrics().dist_collectives++;
    // The host copies stay alive until the send has finished.
    return c10::make_intrusive<PendingWork>(OpType::SEND, inner, [h] {}, std::vector<at::Tensor>{});
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto h = hostLike(tensors);
    auto inner = host_->recv(h, src, tag);
    runtime::metrics().dist_collectives++;
    std::vector<at::Tensor> dev = tensors;
    return c10::make_intrusive<PendingWork>(OpType::RECV, inner, [dev, h] { backTo(dev, h); }, dev);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    // Through the store, so that a timeout can say who did not arrive.
    storeBarrier(*store_, "barrier/" + std::to_string(barriers_++) + "/", rank_, size_,
                 opts.timeout == c10d::kUnsetTimeout ? timeout_ : opts.timeout);
    return done(OpType::BARRIER);
  }

 private:
  staging::Group group() { return {*host_, rank_, size_, check_}; }
  staging::Call call(const char* what, const std::vector<at::Tensor>& ts) { return {what, agreementOf(what, ts)}; }

  // Raises on every rank if the ranks disagree on the collective, dtypes or shapes.
  void agree(const char* what, const std::vector<at::Tensor>& ts) { staging::agree(group(), call(what, ts)); }

  static const at::Tensor& single(const char* what, const std::vector<at::Tensor>& ts) {
    TORCH_CHECK(ts.size() == 1, "tpu_dist: ", what, " takes one tensor per rank, not ", ts.size());
    return ts[0];
  }

  c10::intrusive_ptr<c10d::Backend> host_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  bool check_;
  int64_t barriers_ = 0;
};

}  // namespace

void registerPython(pybind11::module& m) {
  m.def(
      "_tpu_dist_backend",
      [](const c10::intrusive_ptr<c10d::Backend>& host, const c10::intrusive_ptr<c10d::Store>& store, int rank,
         int size, std::chrono::milliseconds timeout) -> c10::intrusive_ptr<c10d::Backend> {
        return c10::make_intrusive<TpuDistBackend>(host, store, rank, size, timeout);
      },
      "The tpu_dist backend over an inner host backend (ProcessGroupGloo) for the same group.");
  m.def(
      "_tpu_dist_staging_stats",
      [] {
        const staging::PoolStats s = staging::poolStats();
        return std::map<std::string, int64_t>{
            {"cached_blocks", s.cached_blocks}, {"cached_bytes", s.cached_bytes},
            {"allocations", s.allocations},     {"reuses", s.reuses},
            {"blocks_in_use", s.blocks_in_use}, {"zero_copy_results", s.zero_copy_results}};
      },
      "tpu_dist's host staging blocks: free ones held, allocated, reused; results made buffers over them.");
}

}  // namespace tpu::distributed
