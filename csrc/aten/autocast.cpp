// Autocast for tpu: PyTorch's standard op lists (matmuls and convolutions in
// the low-precision dtype, reductions and losses in float32, promotion for
// mixed inputs), registered for AutocastPrivateUse1; everything else falls
// through.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {

using namespace at;
using namespace at::autocast;

#define TPU_LOW_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TPU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TPU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(TPU_LOW_PRECISION)
  AT_FORALL_FP32(TPU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TPU_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(TPU_PROMOTE)
}

}  // namespace
