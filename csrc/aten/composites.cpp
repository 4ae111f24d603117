// tpu kernels written in terms of other ATen ops: ops PyTorch routes to a
// special tensor kind (_efficientzerotensor) or whose result size needs a
// host read first (repeat_interleave). Everything they call runs on the device.
#include <torch/library.h>

#include "aten/tpu.h"

namespace tpu::aten {
namespace {

// PyTorch's zero tensors are a CPU/CUDA optimisation; plain zeros behave the same.
at::Tensor efficient_zero_tensor(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                                 std::optional<at::Layout> layout, std::optional<at::Device> device,
                                 std::optional<bool> pin_memory) {
  return at::zeros(size, at::TensorOptions().dtype(dtype).layout(layout).device(device).pinned_memory(pin_memory));
}

// repeat_interleave(repeats, output_size?): index i repeated repeats[i]
// times. Without output_size the length is the sum of repeats, read back
// (with the minimum, for PyTorch's negative-repeats check) in one transfer.
at::Tensor repeat_interleave(const at::Tensor& repeats, std::optional<c10::SymInt> output_size) {
  TORCH_CHECK(repeats.dim() == 1, "repeat_interleave only accept 1D vector as repeat");
  TORCH_CHECK(repeats.scalar_type() == at::kLong || repeats.scalar_type() == at::kInt,
              "repeats has to be Long or Int tensor");
  int64_t total = 0;
  if (repeats.numel() > 0) {
    if (output_size) {
      total = output_size->expect_int();
    } else {
      at::Tensor stats = at::stack({repeats.sum().to(at::kLong), repeats.min().to(at::kLong)}).cpu();
      total = stats[0].item<int64_t>();
      TORCH_CHECK(stats[1].item<int64_t>() >= 0, "repeats can not be negative");
    }
  }
  at::Tensor positions = at::arange(total, repeats.options());
  if (total == 0) return positions;
  return at::searchsorted(repeats.cumsum(0), positions, /*out_int32=*/repeats.scalar_type() == at::kInt,
                          /*right=*/true);
}

// bincount(self, weights?, minlength): the length (max + 1) is read back
// together with PyTorch's checks (non-negative input) in one transfer; the
// counting is a device scatter-add (index_add).
at::Tensor bincount(const at::Tensor& self, const std::optional<at::Tensor>& weights, int64_t minlength) {
  TORCH_CHECK(minlength >= 0, "minlength should be >= 0");
  // As PyTorch's kernels: a floating or complex input is a dtype the kernel has no code for.
  TORCH_CHECK_NOT_IMPLEMENTED(!c10::isFloatingType(self.scalar_type()) && !c10::isComplexType(self.scalar_type()),
                              "\"bincount\" not implemented for '", c10::toString(self.scalar_type()), "'");
  TORCH_CHECK(self.dim() == 1 && self.scalar_type() != at::kBool,
              "bincount only supports 1-d non-negative integral inputs.");
  bool has_w = weights && weights->defined();
  TORCH_CHECK(!has_w || (weights->dim() == 1 && weights->size(0) == self.size(0)),
              "weights should be 1-d and have the same length as input");
  at::ScalarType out_t = has_w ? (weights->scalar_type() == at::kFloat ? at::kFloat : at::kDouble) : at::kLong;
  int64_t len = minlength;
  if (self.numel() > 0) {
    at::Tensor stats = at::stack({self.max().to(at::kLong), self.min().to(at::kLong)}).cpu();
    TORCH_CHECK(stats[1].item<int64_t>() >= 0, "bincount only supports 1-d non-negative integral inputs.");
    len = std::max(len, stats[0].item<int64_t>() + 1);
  }
  at::Tensor out = at::zeros({len}, self.options().dtype(out_t));
  if (self.numel() == 0) return out;
  at::Tensor src = has_w ? weights->to(out_t) : at::ones({self.size(0)}, self.options().dtype(out_t));
  return out.index_add_(0, self.to(at::kLong), src);
}

// _assert_async(self, msg?): raises when the one-element tensor is zero. CUDA
// checks it on the device later; here the value is read back at the call.
void assert_async_msg(const at::Tensor& self, c10::string_view msg) {
  TORCH_CHECK(self.numel() == 1, "Boolean value of Tensor with more than one value is ambiguous");
  const bool ok = self.ne(0).any().cpu().item<bool>();
  TORCH_CHECK(ok,
              msg.empty() ? std::string("Expected Tensor with single nonzero value, but got zero") : std::string(msg));
}

void assert_async(const at::Tensor& self) { assert_async_msg(self, ""); }

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_assert_async", assert_async);
  m.impl("_assert_async.msg", assert_async_msg);
  m.impl("_efficientzerotensor", efficient_zero_tensor);
  m.impl("repeat_interleave.Tensor", repeat_interleave);
  m.impl("bincount", bincount);
}

}  // namespace tpu::aten
