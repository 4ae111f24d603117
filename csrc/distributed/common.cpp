#include "distributed/common.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "compile/capture.h"
#include "runtime/runtime.h"

namespace tpu::distributed {

c10::intrusive_ptr<c10d::Work> done(OpType type, std::vector<at::Tensor> result) {
  runtime::metrics().dist_collectives++;
  // A compiled graph's collective made as a call while the graph records: a replay
  // would reuse this call's result.
  compile::noteUnreplayable();
  return c10::make_intrusive<DoneWork>(type, std::move(result));
}

at::Tensor preMultiplied(const c10d::ReduceOp& op, const at::Tensor& t, bool in_place) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return t;
  const auto* sup = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(sup, "tpu_dist: ReduceOp.PREMUL_SUM without its factor");
  if (sup->tensor_factor.defined()) {
    at::Tensor f = sup->tensor_factor.to(t.device(), t.scalar_type());
    return in_place ? t.mul_(f) : t.mul(f);
  }
  return in_place ? t.mul_(sup->double_factor) : t.mul(sup->double_factor);
}

std::vector<int64_t> agreementOf(const char* what, const std::vector<at::Tensor>& ts) {
  std::vector<int64_t> v(kAgreementSlots, 0);
  size_t h = std::hash<std::string>{}(what);
  v[0] = static_cast<int64_t>(h & 0x7fffffffffffLL);
  v[1] = static_cast<int64_t>(ts.size());
  size_t i = 2;
  for (const auto& t : ts) {
    if (i + 2 > v.size()) break;
    v[i++] = static_cast<int64_t>(t.scalar_type());
    v[i++] = t.dim();
    for (int64_t d : t.sizes())
      if (i < v.size()) v[i++] = d;
  }
  return v;
}

std::string describeAgreement(const int64_t* v) {
  std::string s;
  size_t i = 2;
  for (int64_t n = 0; n < v[1] && i + 2 <= kAgreementSlots; ++n) {
    auto dtype = static_cast<c10::ScalarType>(v[i++]);
    int64_t dim = v[i++];
    s += (n ? ", " : "") + std::string(c10::toString(dtype)) + "[";
    for (int64_t d = 0; d < dim && i < kAgreementSlots; ++d) s += (d ? ", " : "") + std::to_string(v[i++]);
    s += "]";
  }
  return s;
}

void checkAgreement(const char* what, const std::vector<int64_t>& mine, const int64_t* all, int size) {
  for (int r = 0; r < size; ++r) {
    if (std::equal(mine.begin(), mine.end(), all + r * kAgreementSlots)) continue;
    std::string ranks;
    for (int q = 0; q < size; ++q)
      ranks += "\n  rank " + std::to_string(q) + ": " + describeAgreement(all + q * kAgreementSlots) +
               (all[q * kAgreementSlots] == mine[0] ? "" : " (another collective)");
    TORCH_CHECK(false, "tpu_dist: ", what, " was called with different tensors on different ranks:", ranks,
                "\n(set TORCH_TPU_DIST_CHECK=0 to skip this check)");
  }
}

std::vector<std::string> postAndWait(c10d::Store& store, const std::string& prefix, int rank, int size,
                                     const std::vector<uint8_t>& value, std::chrono::milliseconds timeout,
                                     const std::string& what, const char* missing) {
  store.set(prefix + std::to_string(rank), value);
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(prefix + std::to_string(r));
  try {
    store.wait(keys, timeout);
  } catch (const std::exception& e) {
    std::string absent;
    for (int r = 0; r < size; ++r)
      if (!store.check({keys[r]})) absent += (absent.empty() ? "" : ", ") + std::to_string(r);
    TORCH_CHECK(false, "tpu_dist: ", what, " timed out after ", timeout.count(), " ms on rank ", rank, ": rank(s) ",
                absent.empty() ? std::string("?") : absent, " of ", size, " ", missing, " (", e.what(), ")");
  }
  return keys;
}

void storeBarrier(c10d::Store& store, const std::string& prefix, int rank, int size,
                  std::chrono::milliseconds timeout) {
  auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1);
  for (int d = 0; d < guard->deviceCount(); ++d) guard->synchronizeDevice(static_cast<c10::DeviceIndex>(d));
  postAndWait(store, prefix, rank, size, {1}, timeout, "barrier", "did not arrive");
}

}  // namespace tpu::distributed
