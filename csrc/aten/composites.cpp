// tpu kernels written in terms of other ATen ops, for ops whose result is not
// a tensor (equal) or that PyTorch routes to a special tensor kind
// (_efficientzerotensor). Everything they call runs on the device.
#include <torch/library.h>

#include "aten/tpu.h"

namespace tpu::aten {
namespace {

bool equal(const at::Tensor& self, const at::Tensor& other) {
  TORCH_CHECK(self.device() == other.device(), "Expected all tensors to be on the same device, but found ",
              self.device(), " and ", other.device());
  if (!self.is_same_size(other)) return false;
  if (self.numel() == 0) return true;
  // Values compare after type promotion, as on the CPU; NaN != NaN.
  return at::eq(self, other).all().item<bool>();
}

// PyTorch's zero tensors are a CPU/CUDA optimisation; plain zeros behave the same.
at::Tensor efficient_zero_tensor(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                                 std::optional<at::Layout> layout, std::optional<at::Device> device,
                                 std::optional<bool> pin_memory) {
  return at::zeros(size, at::TensorOptions().dtype(dtype).layout(layout).device(device).pinned_memory(pin_memory));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("equal", equal);
  m.impl("_efficientzerotensor", efficient_zero_tensor);
}

}  // namespace tpu::aten
