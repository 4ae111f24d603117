// tpu_dist: the c10d backend for tpu tensors.
//
// PyTorch's distributed engine (c10d: ProcessGroup, DDP, FSDP2, DTensor,
// pipelining, torchrun) calls a Backend per device type. This one serves the
// "tpu" device. Its transport here is host staging: the tpu tensors are copied
// to the host, an inner Backend (PyTorch's own ProcessGroupGloo, made by the
// Python side with this group's store, rank, size and timeout) runs the
// collective on the host copies, and the results are copied back. It is for
// plugins without cross-process collectives (the CPU plugin); every staged byte
// is counted in torch_tpu.metrics().
//
// Each collective finishes before its Work is returned (the inner work is
// waited on and the results are back on the device), so a Work never claims
// completion before the data is there; errors from the inner backend (a dead
// rank, a timeout) surface as exceptions from the call itself.
#include "distributed/tpu_dist.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include <functional>
#include <mutex>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "distributed/common.h"
#include "runtime/env.h"
#include "runtime/runtime.h"

namespace tpu::distributed {
namespace {

using c10d::ReduceOp;

// A host copy of `t` (the tensor itself when it already lives on the host).
at::Tensor toHost(const at::Tensor& t) {
  if (!onTpu(t)) return t;
  runtime::metrics().dist_staged_bytes += static_cast<int64_t>(t.numel() * t.element_size());
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
  runtime::metrics().dist_staged_bytes += static_cast<int64_t>(host.numel() * host.element_size());
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
    agree("broadcast", tensors);
    auto h = toHost(tensors);
    host_->broadcast(h, opts)->wait();
    backTo(tensors, h);
    return done(OpType::BROADCAST, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    c10d::AllreduceOptions o = opts;
    o.reduceOp = hostOp(opts.reduceOp);
    agree("all_reduce", tensors);
    auto h = toHost(tensors);
    for (auto& t : h) preMultiplied(opts.reduceOp, t, /*in_place=*/true);  // a host copy, or the output itself
    host_->allreduce(h, o)->wait();
    finishAvg(opts.reduceOp, h, size_);
    backTo(tensors, h);
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
    agree("all_gather", inputs);
    auto hin = toHost(inputs);
    auto hout = hostLike(outputs);
    host_->allgather(hout, hin, opts)->wait();
    backTo(outputs, hout);
    return done(OpType::ALLGATHER, outputs.empty() ? std::vector<at::Tensor>{} : outputs[0]);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    agree("all_gather_into_tensor", {input, output});
    auto hin = toHost(input);
    auto hout = hostLike(output);
    host_->_allgather_base(hout, hin, opts)->wait();
    backTo(output, hout);
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
    c10d::AllreduceOptions o;
    o.reduceOp = hostOp(opts.reduceOp);
    o.timeout = opts.timeout;
    // Gloo has no list reduce_scatter: reduce the stacked inputs, keep this rank's part.
    std::vector<at::Tensor> parts = inputs.at(0);
    agree("reduce_scatter", parts);
    at::Tensor flat = preMultiplied(opts.reduceOp, at::cat(flatten(parts)).to(at::kCPU), /*in_place=*/true);
    runtime::metrics().dist_staged_bytes += static_cast<int64_t>(flat.numel() * flat.element_size());
    std::vector<at::Tensor> h{flat};
    host_->allreduce(h, o)->wait();
    finishAvg(opts.reduceOp, h, size_);
    int64_t offset = 0;
    for (int r = 0; r < rank_; ++r) offset += parts[r].numel();
    at::Tensor mine = flat.narrow(0, offset, parts[rank_].numel()).view(outputs[0].sizes());
    backTo(outputs[0], mine);
    return done(OpType::REDUCE_SCATTER, outputs);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    c10d::ReduceScatterOptions o = opts;
    o.reduceOp = hostOp(opts.reduceOp);
    agree("reduce_scatter_tensor", {input, output});
    auto hin = preMultiplied(opts.reduceOp, toHost(input));
    auto hout = hostLike(output);
    host_->_reduce_scatter_base(hout, hin, o)->wait();
    finishAvg(opts.reduceOp, {hout}, size_);
    backTo(output, hout);
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
    return c10::make_intrusive<PendingWork>(
        OpType::SEND, inner, [h] {}, std::vector<at::Tensor>{});
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto h = hostLike(tensors);
    auto inner = host_->recv(h, src, tag);
    runtime::metrics().dist_collectives++;
    std::vector<at::Tensor> dev = tensors;
    return c10::make_intrusive<PendingWork>(
        OpType::RECV, inner, [dev, h] { backTo(dev, h); }, dev);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    // Through the store, so that a timeout can say who did not arrive.
    storeBarrier(*store_, "barrier/" + std::to_string(barriers_++) + "/", rank_, size_,
                 opts.timeout == c10d::kUnsetTimeout ? timeout_ : opts.timeout);
    return done(OpType::BARRIER);
  }

 private:
  static std::vector<at::Tensor> flatten(const std::vector<at::Tensor>& ts) {
    std::vector<at::Tensor> out;
    for (const auto& t : ts) out.push_back(t.reshape({-1}));
    return out;
  }

  // Raises on every rank if the ranks disagree on the collective, dtypes or shapes.
  void agree(const char* what, const std::vector<at::Tensor>& ts) {
    if (!check_ || size_ == 1) return;
    auto mine = agreementOf(what, ts);
    at::Tensor local = at::tensor(mine, at::kLong);
    at::Tensor all = at::empty({size_ * kAgreementSlots}, at::kLong);
    host_->_allgather_base(all, local, c10d::AllgatherOptions())->wait();
    checkAgreement(what, mine, all.data_ptr<int64_t>(), size_);
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
}

}  // namespace tpu::distributed
