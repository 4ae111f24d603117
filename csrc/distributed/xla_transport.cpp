// tpu_dist's XLA transport, and the collectives torch.tpu.comm runs.
//
// Where the plugin runs collectives itself, a collective is an XLA program
// (runtime/collectives.h) with one replica per rank: each rank launches its
// replica on its own device with a launch id every rank derives from the
// group's collective count, and XLA pairs the launches and moves the data
// device to device. Ranks are threads of one process over several local
// devices (the CPU plugin can), or processes where the plugin's client spans
// them (a GPU or TPU cluster, process_span.cpp). Each rank's device is the one
// its first collective's tensors are on (as NCCL binds a group to a device),
// and its global id travels in the arrival record below, so both cases are
// the same code.
//
// Before each launch every rank posts to the group's store what it is about to
// run and waits, bounded by the group's timeout, for the others: a rank that
// never comes is named in an error instead of leaving the others blocked
// inside XLA, and ranks that disagree on the collective, dtype or shape raise.
//
// torch.tpu.comm is the other use: one thread drives every device and each
// collective is one launch over all of them.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <future>
#include <map>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "aten/tpu.h"
#include "distributed/common.h"
#include "distributed/tpu_dist.h"
#include "runtime/collectives.h"
#include "runtime/env.h"

namespace tpu::distributed {
namespace {

using c10d::ReduceOp;
using runtime::BufferPtr;
using runtime::Collective;
using runtime::CollectiveSpec;
using runtime::Reduction;

Reduction reductionOf(const ReduceOp& op) {
  switch (op.op_) {
    case ReduceOp::SUM:
      return Reduction::Sum;
    case ReduceOp::AVG:
      return Reduction::Avg;
    case ReduceOp::PRODUCT:
      return Reduction::Prod;
    case ReduceOp::MIN:
      return Reduction::Min;
    case ReduceOp::MAX:
      return Reduction::Max;
    case ReduceOp::BAND:
      return Reduction::BitAnd;
    case ReduceOp::BOR:
      return Reduction::BitOr;
    case ReduceOp::BXOR:
      return Reduction::BitXor;
    case ReduceOp::PREMUL_SUM:  // inputs scaled first (preMultiplied)
      return Reduction::Sum;
    default:
      TORCH_CHECK(false, "tpu_dist: unsupported ReduceOp ", static_cast<int>(op.op_));
  }
}

Reduction reductionNamed(const std::string& name) {
  static const std::map<std::string, Reduction> names = {
      {"sum", Reduction::Sum}, {"avg", Reduction::Avg},     {"prod", Reduction::Prod}, {"min", Reduction::Min},
      {"max", Reduction::Max}, {"band", Reduction::BitAnd}, {"bor", Reduction::BitOr}, {"bxor", Reduction::BitXor}};
  auto it = names.find(name);
  TORCH_CHECK_VALUE(it != names.end(), "unknown reduction '", name, "'");
  return it->second;
}

at::Tensor flat(const at::Tensor& t) { return t.reshape({-1}); }

at::Tensor wrapFlat(const BufferPtr& b, int64_t n, const at::Tensor& like) {
  return aten::wrapBuffer(b, {n}, like.scalar_type(), like.device().index());
}

// Writes a flat result into `dst` (any shape, any view). A collective writes its
// output's memory, as NCCL does: not an autograd op, no version bump.
void writeFlat(const at::Tensor& dst, const at::Tensor& src) {
  at::AutoDispatchBelowADInplaceOrView guard;
  dst.copy_(src.view(dst.sizes()));
}

// A point-to-point transfer in flight: its launch runs on a thread of its own (a
// send returns before its receiver has come, as batch_isend_irecv needs), and
// wait() waits for it, bounded by the group's timeout.
class P2PWork final : public c10d::Work {
 public:
  P2PWork(OpType type, std::shared_future<BufferPtr> result, at::Tensor target, std::chrono::milliseconds timeout,
          std::string what)
      : Work(-1, type),
        result_(std::move(result)),
        target_(std::move(target)),
        timeout_(timeout),
        what_(std::move(what)) {
    future_ =
        c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), devicesOf({target_}));
  }
  bool isCompleted() override {
    if (result_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
    finish();
    return true;
  }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds timeout) override {
    const auto limit = timeout == ::kNoTimeout ? timeout_ : timeout;
    TORCH_CHECK(result_.wait_for(limit) == std::future_status::ready, "tpu_dist: ", what_, " did not complete within ",
                limit.count(), " ms (the peer never posted its side)");
    finish();
    return true;
  }
  std::vector<at::Tensor> result() override { return {target_}; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  void finish() {
    std::call_once(once_, [this] {
      BufferPtr b = result_.get();                                               // rethrows the launch's error
      if (b && retrieveOpType() == OpType::RECV) aten::writeTensor(target_, b);  // null: nothing to move
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>{target_}));
    });
  }
  std::shared_future<BufferPtr> result_;
  at::Tensor target_;
  std::chrono::milliseconds timeout_;
  std::string what_;
  std::once_flag once_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class XlaDistBackend final : public PerTensorCoalescing {
 public:
  // `device`: this rank's tpu device index, or -1 for the device of its first
  // collective's tensors.
  // `local_devices`: every rank's device of this process (ranks as threads), or empty;
  // `world_devices`: those of every rank of their world (empty: local_devices).
  XlaDistBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
                 int device, std::vector<int> local_devices = {}, std::vector<int> world_devices = {})
      : PerTensorCoalescing(rank, size),
        store_(std::move(store)),
        timeout_(timeout),
        device_(device),
        local_devices_(std::move(local_devices)),
        world_devices_(world_devices.empty() ? local_devices_ : std::move(world_devices)),
        check_(env::notDisabled("TORCH_TPU_DIST_CHECK")) {}

  // Ranks as threads of this process: their collectives can join a compiled program.
  std::optional<InProgramGroup> inProgram() const {
    if (local_devices_.empty() || device_ < 0) return std::nullopt;
    InProgramGroup g;
    for (int d : local_devices_) g.participants.push_back(runtime::globalDeviceId(d));
    for (int d : world_devices_) g.world.push_back(runtime::globalDeviceId(d));
    g.device = device_;
    g.timeout = timeout_;
    return g;
  }

  const std::string getBackendName() const override { return "tpu_dist"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const at::Tensor& t = only(tensors, "broadcast");
    Arrival a = arrive("broadcast", agreementOf("broadcast", {t}));
    CollectiveSpec spec = specOf(Collective::Broadcast, t, t.numel(), a);
    spec.root = static_cast<int>(opts.rootRank);
    if (t.numel()) aten::writeTensor(t, run(spec, aten::readTensor(t), a.launch));
    return done(OpType::BROADCAST, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const at::Tensor& t = only(tensors, "all_reduce");
    Arrival a = arrive("all_reduce", agreementOf("all_reduce", {t}));
    CollectiveSpec spec = specOf(Collective::AllReduce, t, t.numel(), a);
    spec.reduce = reductionOf(opts.reduceOp);
    if (t.numel()) aten::writeTensor(t, run(spec, aten::readTensor(preMultiplied(opts.reduceOp, t)), a.launch));
    return done(OpType::ALLREDUCE, tensors);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    const at::Tensor& t = only(tensors, "reduce");
    Arrival a = arrive("reduce", agreementOf("reduce", {t}));
    CollectiveSpec spec = specOf(Collective::AllReduce, t, t.numel(), a);
    spec.reduce = reductionOf(opts.reduceOp);
    if (t.numel()) {
      BufferPtr out = run(spec, aten::readTensor(preMultiplied(opts.reduceOp, t)), a.launch);
      if (rank_ == opts.rootRank) aten::writeTensor(t, out);
    }
    return done(OpType::REDUCE, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& /*opts*/) override {
    const at::Tensor& in = only(inputs, "all_gather");
    TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                      "tpu_dist: all_gather needs one output list of ", size_, " tensors");
    gatherInto(in, outputs[0], "all_gather", /*root=*/-1);
    return done(OpType::ALLGATHER, outputs[0]);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& /*opts*/) override {
    checkDevice(input);
    checkDevice(output);
    TORCH_CHECK_VALUE(output.numel() == size_ * input.numel(), "tpu_dist: all_gather_into_tensor: the output has ",
                      output.numel(), " elements, expected ", size_, " x ", input.numel());
    Arrival a = arrive("all_gather_into_tensor", agreementOf("all_gather_into_tensor", {input, output}));
    CollectiveSpec spec = specOf(Collective::AllGather, input, input.numel(), a);
    if (input.numel()) aten::writeTensor(output, run(spec, aten::readTensor(input), a.launch));
    return done(OpType::_ALLGATHER_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    const at::Tensor& in = only(inputs, "gather");
    const int root = static_cast<int>(opts.rootRank);
    std::vector<at::Tensor> none;
    if (rank_ == root)
      TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                        "tpu_dist: gather needs one output list of ", size_, " tensors on the root");
    gatherInto(in, rank_ == root ? outputs[0] : none, "gather", root);
    return done(OpType::GATHER);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    const at::Tensor& out = only(outputs, "scatter");
    const int root = static_cast<int>(opts.rootRank);
    const int64_t n = out.numel();
    Arrival a = arrive("scatter", agreementOf("scatter", {out}));
    // An all-to-all in which only the root's blocks matter: block r of the
    // root's input reaches rank r.
    at::Tensor send;
    if (rank_ == root) {
      TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                        "tpu_dist: scatter needs one input list of ", size_, " tensors on the root");
      std::vector<at::Tensor> parts;
      for (const auto& p : inputs[0]) parts.push_back(flat(p));
      send = at::cat(parts);
    } else {
      send = at::zeros({size_ * n}, out.options());
    }
    if (n) {
      BufferPtr all = run(specOf(Collective::AllToAll, out, n, a), aten::readTensor(send), a.launch);
      writeFlat(out, wrapFlat(all, size_ * n, out).narrow(0, root * n, n));
    }
    return done(OpType::SCATTER, outputs);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    const at::Tensor& out = only(outputs, "reduce_scatter");
    TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                      "tpu_dist: reduce_scatter needs one input list of ", size_, " tensors");
    std::vector<at::Tensor> parts;
    for (const auto& p : inputs[0]) {
      TORCH_CHECK_VALUE(p.numel() == out.numel(), "tpu_dist: reduce_scatter inputs must match the output's size");
      parts.push_back(flat(p));
    }
    Arrival a = arrive("reduce_scatter", agreementOf("reduce_scatter", {out}));
    CollectiveSpec spec = specOf(Collective::ReduceScatter, out, out.numel(), a);
    spec.reduce = reductionOf(opts.reduceOp);
    if (out.numel())
      aten::writeTensor(out, run(spec, aten::readTensor(preMultiplied(opts.reduceOp, at::cat(parts))), a.launch));
    return done(OpType::REDUCE_SCATTER, outputs);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    checkDevice(input);
    checkDevice(output);
    TORCH_CHECK_VALUE(input.numel() == size_ * output.numel(), "tpu_dist: reduce_scatter_tensor: the input has ",
                      input.numel(), " elements, expected ", size_, " x ", output.numel());
    Arrival a = arrive("reduce_scatter_tensor", agreementOf("reduce_scatter_tensor", {input, output}));
    CollectiveSpec spec = specOf(Collective::ReduceScatter, output, output.numel(), a);
    spec.reduce = reductionOf(opts.reduceOp);
    if (output.numel())
      aten::writeTensor(output, run(spec, aten::readTensor(preMultiplied(opts.reduceOp, input)), a.launch));
    return done(OpType::_REDUCE_SCATTER_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits, std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& /*opts*/) override {
    checkDevice(input);
    checkDevice(output);
    if (output_splits.empty() && input_splits.empty()) {
      TORCH_CHECK_VALUE(input.numel() % size_ == 0 && input.numel() == output.numel(),
                        "tpu_dist: all_to_all_single: input and output must have the same size, divisible by ", size_);
      const int64_t n = input.numel() / size_;
      Arrival a = arrive("all_to_all_single", agreementOf("all_to_all_single", {input, output}));
      if (n)
        aten::writeTensor(output, run(specOf(Collective::AllToAll, input, n, a), aten::readTensor(input), a.launch));
      return done(OpType::ALLTOALL_BASE, {output});
    }
    // Uneven splits: every block padded to the largest any rank sends.
    std::vector<int64_t> in_rows = splitsOr(input_splits, input), out_rows = splitsOr(output_splits, output);
    std::vector<at::Tensor> in_blocks;
    int64_t off = 0;
    for (int64_t s : in_rows) {
      in_blocks.push_back(flat(input.narrow(0, off, s)));
      off += s;
    }
    std::vector<at::Tensor> out_views;
    off = 0;
    for (int64_t s : out_rows) {
      out_views.push_back(output.narrow(0, off, s));
      off += s;
    }
    exchangeBlocks(in_blocks, out_views, "all_to_all_single");
    return done(OpType::ALLTOALL_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& /*opts*/) override {
    TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
                      "tpu_dist: all_to_all needs ", size_, " inputs and ", size_, " outputs");
    std::vector<at::Tensor> in_blocks;
    for (const auto& t : inputs) {
      checkDevice(t);
      in_blocks.push_back(flat(t));
    }
    for (const auto& t : outputs) checkDevice(t);
    exchangeBlocks(in_blocks, outputs, "all_to_all");
    return done(OpType::ALLTOALL, outputs);
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int /*tag*/) override {
    const at::Tensor& t = only(tensors, "send");
    TORCH_CHECK_VALUE(dst >= 0 && dst < size_ && dst != rank_, "tpu_dist: send to invalid rank ", dst);
    return pointToPoint(OpType::SEND, t, rank_, dst);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int /*tag*/) override {
    const at::Tensor& t = only(tensors, "recv");
    TORCH_CHECK_VALUE(src >= 0 && src < size_ && src != rank_, "tpu_dist: recv from invalid rank ", src);
    return pointToPoint(OpType::RECV, t, src, rank_);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    storeBarrier(*store_, "xla_barrier/" + std::to_string(barriers_++) + "/", rank_, size_,
                 opts.timeout == c10d::kUnsetTimeout ? timeout_ : opts.timeout);
    return done(OpType::BARRIER);
  }

 private:
  // What every rank learns before a collective's launch.
  struct Arrival {
    int launch = 0;                 // the launch id all ranks use
    std::vector<int> participants;  // each rank's device, by global id
  };

  int device() const { return device_; }

  // A tensor must be on this rank's device; the first binds it where the
  // group was made without one.
  void checkDevice(const at::Tensor& t) {
    TORCH_CHECK_VALUE(onTpu(t), "tpu_dist: expected a tpu tensor, got one on ", t.device());
    if (device_ < 0) device_ = t.device().index();
    TORCH_CHECK_VALUE(t.device().index() == device_, "tpu_dist: rank ", rank_, " runs on tpu:", device_,
                      ", but got a tensor on ", t.device());
  }

  const at::Tensor& only(const std::vector<at::Tensor>& ts, const char* what) {
    TORCH_CHECK_VALUE(ts.size() == 1, "tpu_dist: ", what, " takes one tensor per rank (one device each), got ",
                      ts.size());
    checkDevice(ts[0]);
    return ts[0];
  }

  CollectiveSpec specOf(Collective kind, const at::Tensor& like, int64_t n, const Arrival& a) const {
    CollectiveSpec spec;
    spec.kind = kind;
    spec.dtype = aten::toIr(like.scalar_type());
    spec.n = n;
    spec.participants = a.participants;
    return spec;
  }

  BufferPtr run(const CollectiveSpec& spec, const BufferPtr& in, int launch) const {
    try {
      return runtime::runCollectiveShard(spec, in, device(), launch);
    } catch (const std::exception& e) {
      aten::rethrow(e, "tpu_dist");
    }
  }

  // Posts `mine` (what this rank is about to run), `extra` and this rank's
  // device, and waits for every rank's, bounded by the group's timeout.
  // `all_extra` receives every rank's `extra`.
  Arrival arrive(const char* what, const std::vector<int64_t>& mine, int64_t extra = 0,
                 std::vector<int64_t>* all_extra = nullptr) {
    TORCH_CHECK(device_ >= 0, "tpu_dist: rank ", rank_, " has no device yet");
    const int64_t seq = collectives_++;
    const std::string prefix = "xla/" + std::to_string(seq) + "/";
    std::vector<int64_t> post = mine;
    post.push_back(extra);
    post.push_back(runtime::globalDeviceId(device_));
    std::vector<uint8_t> bytes(post.size() * sizeof(int64_t));
    std::memcpy(bytes.data(), post.data(), bytes.size());
    const auto keys = postAndWait(*store_, prefix, rank_, size_, bytes, timeout_, what, "did not reach it");
    std::vector<int64_t> all(static_cast<size_t>(size_) * kAgreementSlots);
    Arrival a;
    if (all_extra) all_extra->assign(size_, 0);
    for (int r = 0; r < size_; ++r) {
      std::vector<uint8_t> got = r == rank_ ? bytes : store_->get(keys[r]);
      TORCH_CHECK(got.size() == bytes.size(), "tpu_dist: rank ", r, " posted a malformed collective record");
      std::vector<int64_t> record(post.size());
      std::memcpy(record.data(), got.data(), got.size());
      std::copy_n(record.begin(), kAgreementSlots, all.begin() + static_cast<std::ptrdiff_t>(r) * kAgreementSlots);
      if (all_extra) (*all_extra)[r] = record[kAgreementSlots];
      a.participants.push_back(static_cast<int>(record[kAgreementSlots + 1]));
    }
    // Every rank has posted this record, so all have finished reading the last.
    if (seq > 0) store_->deleteKey("xla/" + std::to_string(seq - 1) + "/" + std::to_string(rank_));
    if (check_) checkAgreement(what, mine, all.data(), size_);
    for (int r = 0; r < size_; ++r)
      for (int q = 0; q < r; ++q)
        TORCH_CHECK_VALUE(a.participants[q] != a.participants[r], "tpu_dist: ranks ", q, " and ", r,
                          " are on the same device (global id ", a.participants[r],
                          "); give each rank its own, e.g. torch.tpu.set_device(local_rank)");
    // Even and never 0 (0 asks the plugin for a fresh id per launch); sends and receives use odd ids.
    a.launch = static_cast<int>(((seq + 1) * 2) & 0x3ffffffe);
    return a;
  }

  // all_gather of `in` to every rank; `outs` (one per rank, any shapes of the
  // same size) receive the blocks where given; `root` -1: every rank.
  void gatherInto(const at::Tensor& in, const std::vector<at::Tensor>& outs, const char* what, int root) {
    const int64_t n = in.numel();
    for (const auto& o : outs) {
      checkDevice(o);
      TORCH_CHECK_VALUE(o.numel() == n, "tpu_dist: ", what, " outputs must match the input's size");
    }
    Arrival a = arrive(what, agreementOf(what, {in}));
    if (!n) return;
    BufferPtr b = run(specOf(Collective::AllGather, in, n, a), aten::readTensor(in), a.launch);
    if (root >= 0 && rank_ != root) return;
    at::Tensor all = wrapFlat(b, size_ * n, in);
    for (int r = 0; r < size_; ++r) writeFlat(outs[r], all.narrow(0, r * n, n));
  }

  // Rows per rank: the given splits, or size(0) in equal parts.
  std::vector<int64_t> splitsOr(const std::vector<int64_t>& splits, const at::Tensor& t) const {
    if (!splits.empty()) {
      TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == size_, "tpu_dist: all_to_all_single needs ", size_,
                        " split sizes, got ", splits.size());
      return splits;
    }
    TORCH_CHECK_VALUE(t.dim() > 0 && t.size(0) % size_ == 0, "tpu_dist: all_to_all_single: size(0) must divide by ",
                      size_, " without split sizes");
    return std::vector<int64_t>(size_, t.size(0) / size_);
  }

  // The general all-to-all: in_blocks[r] (flat) goes to rank r, out[s] receives
  // what rank s sent. Blocks are padded to the largest on any rank.
  void exchangeBlocks(const std::vector<at::Tensor>& in_blocks, const std::vector<at::Tensor>& out, const char* what) {
    int64_t largest = 0;
    for (const auto& b : in_blocks) largest = std::max(largest, b.numel());
    std::vector<int64_t> mine = agreementOf(what, {});
    mine[1] = 1;  // the dtype only: shapes differ between ranks by design
    mine[2] = static_cast<int64_t>(in_blocks.at(0).scalar_type());
    std::vector<int64_t> each;
    Arrival a = arrive(what, mine, largest, &each);
    int64_t m = *std::max_element(each.begin(), each.end());
    if (!m) return;
    std::vector<at::Tensor> padded;
    for (const auto& b : in_blocks)
      padded.push_back(b.numel() == m ? b : at::cat({b, at::zeros({m - b.numel()}, b.options())}));
    BufferPtr got = run(specOf(Collective::AllToAll, in_blocks[0], m, a), aten::readTensor(at::cat(padded)), a.launch);
    at::Tensor all = wrapFlat(got, size_ * m, in_blocks[0]);
    for (int s = 0; s < size_; ++s) {
      TORCH_CHECK_VALUE(out[s].numel() <= m, "tpu_dist: ", what, ": rank ", rank_, " expects ", out[s].numel(),
                        " elements from rank ", s, ", more than any rank sent");
      if (out[s].numel()) writeFlat(out[s], all.narrow(0, s * m, out[s].numel()));
    }
  }

  // send/recv as a two-replica collective_permute over the two ranks' devices.
  // The k-th send from a to b meets the k-th receive at b from a (tags are not
  // matched, as with NCCL).
  c10::intrusive_ptr<c10d::Work> pointToPoint(OpType type, const at::Tensor& t, int src, int dst) {
    const int64_t k = p2p_[{src, dst}]++;
    const int launch = static_cast<int>((((k * size_ + src) * size_ + dst) * 2 + 1) & 0x3fffffff);  // odd
    CollectiveSpec spec;
    spec.kind = Collective::Permute;
    spec.dtype = aten::toIr(t.scalar_type());
    spec.n = t.numel();
    spec.pairs = {{0, 1}};  // participants: the two ranks' devices, learnt from the handshake
    runtime::metrics().dist_collectives++;
    const std::string what = std::string(type == OpType::SEND ? "send to rank " : "recv from rank ") +
                             std::to_string(type == OpType::SEND ? dst : src);
    if (!t.numel()) {
      std::promise<BufferPtr> none;
      none.set_value(nullptr);
      return c10::make_intrusive<P2PWork>(type, none.get_future().share(), t, timeout_, what);
    }
    BufferPtr in = aten::readTensor(t);
    const int dev = device();
    const bool sending = type == OpType::SEND;
    // Both sides post their device to the store first and launch only once the other
    // has: XLA:CPU aborts the whole process when a collective's peer does not join
    // within 40 s.
    const std::string key = "p2p/" + std::to_string(src) + "/" + std::to_string(dst) + "/" + std::to_string(k) + "/";
    const std::string mine = key + (type == OpType::SEND ? "send" : "recv");
    const std::string theirs = key + (type == OpType::SEND ? "recv" : "send");
    auto task = std::make_shared<std::packaged_task<BufferPtr()>>(
        [store = store_, timeout = timeout_, mine, theirs, spec, in, dev, sending, launch, what]() mutable {
          const std::string me = std::to_string(runtime::globalDeviceId(dev));
          store->set(mine, std::vector<uint8_t>(me.begin(), me.end()));
          try {
            store->wait({theirs}, timeout);
          } catch (const std::exception& e) {
            TORCH_CHECK(false, "tpu_dist: ", what, " did not complete within ", timeout.count(),
                        " ms (the peer never posted its side)");
          }
          const std::vector<uint8_t> peer_bytes = store->get(theirs);
          const int peer = std::stoi(std::string(peer_bytes.begin(), peer_bytes.end()));
          store->deleteKey(theirs);  // nobody reads it again: its owner has seen ours or gives up
          const int self = std::stoi(me);
          spec.participants = sending ? std::vector<int>{self, peer} : std::vector<int>{peer, self};
          return runtime::runCollectiveShard(spec, in, dev, launch);
        });
    std::shared_future<BufferPtr> result = task->get_future().share();
    std::thread([task] { (*task)(); }).detach();
    return c10::make_intrusive<P2PWork>(type, result, t, timeout_, what);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  int device_;  // this rank's tpu device index; -1 until its first collective
  std::vector<int> local_devices_;
  std::vector<int> world_devices_;
  bool check_;
  int64_t collectives_ = 0;
  int64_t barriers_ = 0;
  std::map<std::pair<int, int>, int64_t> p2p_;
};

// torch.tpu.comm's collectives: one launch over the devices of `tensors` (one
// tensor per device, all the same dtype and size, flattened); returns one flat
// result per device.
std::vector<at::Tensor> commCollective(const std::string& kind, const std::vector<at::Tensor>& tensors,
                                       const std::string& op, int root) {
  TORCH_CHECK_VALUE(!tensors.empty(), "torch.tpu.comm: no tensors");
  static const std::map<std::string, Collective> kinds = {{"all_reduce", Collective::AllReduce},
                                                          {"all_gather", Collective::AllGather},
                                                          {"reduce_scatter", Collective::ReduceScatter},
                                                          {"all_to_all", Collective::AllToAll},
                                                          {"broadcast", Collective::Broadcast}};
  auto k = kinds.find(kind);
  TORCH_CHECK_VALUE(k != kinds.end(), "torch.tpu.comm: unknown collective '", kind, "'");
  const int world = static_cast<int>(tensors.size());
  const at::Tensor& first = tensors[0];
  CollectiveSpec spec;
  spec.kind = k->second;
  spec.reduce = reductionNamed(op);
  spec.dtype = aten::toIr(first.scalar_type());
  spec.root = root;
  const bool blocked = spec.kind == Collective::ReduceScatter || spec.kind == Collective::AllToAll;
  TORCH_CHECK_VALUE(!blocked || first.numel() % world == 0, "torch.tpu.comm: ", kind, " needs a size divisible by ",
                    world);
  spec.n = blocked ? first.numel() / world : first.numel();
  std::vector<BufferPtr> inputs;
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(onTpu(t), "torch.tpu.comm: expected tpu tensors, got one on ", t.device());
    TORCH_CHECK_VALUE(t.scalar_type() == first.scalar_type() && t.numel() == first.numel(),
                      "torch.tpu.comm: every device's tensor must have the same dtype and size");
    const int d = runtime::globalDeviceId(t.device().index());
    for (int seen : spec.participants)
      TORCH_CHECK_VALUE(seen != d, "torch.tpu.comm: device ", t.device(), " appears twice");
    spec.participants.push_back(d);
  }
  const int64_t out_len =
      spec.kind == Collective::AllGather || spec.kind == Collective::AllToAll ? world * spec.n : spec.n;
  std::vector<at::Tensor> result;
  if (!spec.n) {
    for (const auto& t : tensors) result.push_back(at::empty({out_len}, t.options()));
    return result;
  }
  for (const auto& t : tensors) inputs.push_back(aten::readTensor(t));
  std::vector<BufferPtr> outs;
  try {
    outs = runtime::runCollective(spec, inputs);
  } catch (const std::exception& e) {
    aten::rethrow(e, "torch.tpu.comm");
  }
  for (int r = 0; r < world; ++r) result.push_back(wrapFlat(outs[r], out_len, tensors[r]));
  return result;
}

}  // namespace

std::optional<InProgramGroup> inProgramGroup(const c10::intrusive_ptr<c10d::Backend>& backend) {
  const auto* xla = dynamic_cast<const XlaDistBackend*>(backend.get());
  return xla ? xla->inProgram() : std::nullopt;
}

void registerXlaTransport(pybind11::module& m) {
  m.def(
      "_tpu_dist_xla_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
         int device, std::vector<int> local_devices,
         std::vector<int> world_devices) -> c10::intrusive_ptr<c10d::Backend> {
        return c10::make_intrusive<XlaDistBackend>(store, rank, size, timeout, device, std::move(local_devices),
                                                   std::move(world_devices));
      },
      pybind11::arg("store"), pybind11::arg("rank"), pybind11::arg("size"), pybind11::arg("timeout"),
      pybind11::arg("device"), pybind11::arg("local_devices") = std::vector<int>{},
      pybind11::arg("world_devices") = std::vector<int>{},
      "The tpu_dist backend over XLA collectives; this rank runs on tpu:device (-1: its first collective's). "
      "local_devices: every rank's device, for ranks that are threads of this process; world_devices: those of "
      "every rank of their world (a DeviceMesh's), default local_devices.");
  m.def("_comm_collective", &commCollective, pybind11::arg("kind"), pybind11::arg("tensors"),
        pybind11::arg("op") = "sum", pybind11::arg("root") = 0, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "One XLA collective over the devices of `tensors` (one flat result per device).");
}

}  // namespace tpu::distributed
