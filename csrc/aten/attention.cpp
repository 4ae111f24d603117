// F.scaled_dot_product_attention on tpu tensors: PyTorch asks the device's
// _fused_sdp_choice stub which kernel to use. The tpu device answers "flash"
// where its one-op lowering (ops/attention.cpp) covers the call, so the
// attention and its backward are one op each; other calls (an explicit mask,
// dropout, grouped-query heads, a value width other than the
// query's, empty inputs) take PyTorch's math path, which
// decomposes into ops the device lowers one by one.
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>

#include "aten/tpu.h"

namespace tpu::aten {
namespace {

int64_t fusedSdpChoice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                       std::optional<double> scale, bool enable_gqa) {
  auto math = static_cast<int64_t>(sdp::SDPBackend::math);
  // Symbolic shapes (torch.compile with dynamic shapes) keep the math path:
  // the checks below read concrete sizes.
  for (const at::Tensor* t : {&q, &k, &v})
    if (t->unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return math;
  if (attn_mask && attn_mask->defined()) return math;
  if (dropout_p != 0.0 || q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return math;
  if (q.is_nested() || k.is_nested() || v.is_nested()) return math;
  auto t = q.scalar_type();
  if (k.scalar_type() != t || v.scalar_type() != t || !(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf))
    return math;
  if (q.numel() == 0 || k.numel() == 0 || v.numel() == 0) return math;
  if (k.size(0) != q.size(0) || v.size(0) != q.size(0) || k.size(1) != q.size(1) || v.size(1) != q.size(1) ||
      v.size(2) != k.size(2) || k.size(3) != q.size(3) || v.size(3) != q.size(3))
    return math;
  return static_cast<int64_t>(sdp::SDPBackend::flash_attention);
}

}  // namespace
}  // namespace tpu::aten

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &tpu::aten::fusedSdpChoice)
}  // namespace at::native
