// What both tpu_dist transports share: the Work objects they return, the
// agreement check that runs before a collective, and the store barrier.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

namespace tpu::distributed {

using c10d::OpType;

inline bool onTpu(const at::Tensor& t) { return t.device().type() == c10::DeviceType::PrivateUse1; }

// The devices a result's future must know (the tpu ones its tensors are on).
inline std::vector<c10::Device> devicesOf(const std::vector<at::Tensor>& ts) {
  std::vector<c10::Device> d;
  for (const auto& t : ts)
    if (onTpu(t) && std::find(d.begin(), d.end(), t.device()) == d.end()) d.push_back(t.device());
  return d;
}

// A collective that has finished: its results are on the device.
class DoneWork final : public c10d::Work {
 public:
  DoneWork(OpType type, std::vector<at::Tensor> result) : Work(-1, type), result_(std::move(result)) {
    future_ =
        c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), devicesOf(result_));
    future_->markCompleted(c10::IValue(result_));
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A point-to-point transfer still in flight on the host backend: a send must not
// wait for its receiver inside the call (batch_isend_irecv posts both sides first).
// wait() waits for the inner work, then copies a received value to the device.
class PendingWork final : public c10d::Work {
 public:
  PendingWork(OpType type, c10::intrusive_ptr<c10d::Work> inner, std::function<void()> finish,
              std::vector<at::Tensor> result)
      : Work(-1, type), inner_(std::move(inner)), finish_(std::move(finish)), result_(std::move(result)) {
    future_ =
        c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), devicesOf(result_));
  }
  bool isCompleted() override {
    if (!inner_->isCompleted()) return false;
    finishOnce();
    return true;
  }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  bool wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    finishOnce();
    return true;
  }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  void finishOnce() {
    std::call_once(once_, [this] {
      if (finish_) finish_();
      future_->markCompleted(c10::IValue(result_));
    });
  }
  c10::intrusive_ptr<c10d::Work> inner_;
  std::function<void()> finish_;
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::once_flag once_;
};

// PREMUL_SUM (FSDP2's gradient reduction): `t` times the op's factor, as each rank
// contributes it to the SUM; `t` itself for every other op. `in_place` scales `t`.
at::Tensor preMultiplied(const c10d::ReduceOp& op, const at::Tensor& t, bool in_place = false);

// A Work for a collective whose results are on the device (counted in metrics).
c10::intrusive_ptr<c10d::Work> done(OpType type, std::vector<at::Tensor> result = {});

// Both transports' coalesced collectives: one call per tensor of the single-tensor
// collective the transport defines, each finished before the next.
class PerTensorCoalescing : public c10d::Backend {
 public:
  using c10d::Backend::Backend;

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    c10d::AllreduceOptions o;
    o.reduceOp = opts.reduceOp;
    o.timeout = opts.timeout;
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{t};
      allreduce(one, o);
    }
    return done(OpType::ALLREDUCE_COALESCED, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::vector<std::vector<at::Tensor>> out{outputs.at(i)};
      std::vector<at::Tensor> in{inputs[i]};
      allgather(out, in, opts);
    }
    return done(OpType::ALLGATHER_COALESCED);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    for (size_t i = 0; i < inputs.size(); ++i) _allgather_base(outputs.at(i), inputs[i], opts);
    return done(OpType::COALESCED, outputs);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    for (size_t i = 0; i < inputs.size(); ++i) _reduce_scatter_base(outputs.at(i), inputs[i], opts);
    return done(OpType::COALESCED, outputs);
  }
};

// What every rank must agree on before a collective: the collective, then per
// tensor its dtype and shape (a host backend given different sizes on two ranks
// aborts the process or reads garbage). Encoded in kAgreementSlots int64s.
constexpr int kAgreementSlots = 16;
std::vector<int64_t> agreementOf(const char* what, const std::vector<at::Tensor>& ts);
// "float32[4, 2], int64[3]": the tensors an agreement vector describes.
std::string describeAgreement(const int64_t* v);
// Raises naming every rank's tensors unless all `size` vectors at `all` (each
// kAgreementSlots long) equal `mine`.
void checkAgreement(const char* what, const std::vector<int64_t>& mine, const int64_t* all, int size);

// Sets this rank's key under `prefix` to `value`, then waits up to `timeout` for
// every rank's key; returns the keys (rank order). A timeout raises "<what> timed
// out ...: rank(s) <the absent> of <size> <missing>".
std::vector<std::string> postAndWait(c10d::Store& store, const std::string& prefix, int rank, int size,
                                     const std::vector<uint8_t>& value, std::chrono::milliseconds timeout,
                                     const std::string& what, const char* missing);

// Device work queued before it finishes first (as a CUDA barrier orders it), then
// every rank sets its key under `prefix` and waits for the others'; a timeout
// names the ranks that did not arrive.
void storeBarrier(c10d::Store& store, const std::string& prefix, int rank, int size, std::chrono::milliseconds timeout);

}  // namespace tpu::distributed
