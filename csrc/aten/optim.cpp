// Fused Adam/AdamW with a float learning rate: the learning rate goes to the
// tensor_lr overload as a CPU scalar, which the lowering receives as a program
// input. As a float attribute it would be part of the program's signature,
// and a learning-rate schedule would compile a new program every step.
#include <torch/library.h>

#include "aten/tpu.h"

namespace tpu::aten {
namespace {

at::Tensor lrScalar(double lr) {
  at::Tensor t = at::scalar_tensor(lr, at::TensorOptions().dtype(at::kDouble));
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

void fused_adamw(at::TensorList self, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr, double beta1, double beta2,
                 double weight_decay, double eps, bool amsgrad, bool maximize,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  at::_fused_adamw_(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lrScalar(lr), beta1, beta2,
                    weight_decay, eps, amsgrad, maximize, grad_scale, found_inf);
}

void fused_adam(at::TensorList self, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr, double beta1, double beta2,
                double weight_decay, double eps, bool amsgrad, bool maximize,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  at::_fused_adam_(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lrScalar(lr), beta1, beta2,
                   weight_decay, eps, amsgrad, maximize, grad_scale, found_inf);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_fused_adamw_", fused_adamw);
  m.impl("_fused_adam_", fused_adam);
}

}  // namespace tpu::aten
