// Fused AdamW update written as an XLA FFI handler (typed FFI, the API that
// `stablehlo.custom_call` uses with api_version = 4).
//
// This is the CPU ("Host") version: buffers live in host memory and the
// update runs inline on the calling thread. A CUDA version of the same handler
// would be registered for the platform "CUDA", add
// `.Ctx<ffi::PlatformStream<cudaStream_t>>()` to the binding below to receive
// the stream XLA runs on, and launch its kernel on that stream instead of
// looping here. Note that on a GPU `hparams` is a device buffer too, so the
// kernel must read it on the device (or the values must be passed as FFI
// attributes instead).
//
// Operands (all f32):  param, grad, exp_avg, exp_avg_sq  (one shape, any rank)
//                      hparams[6] = {lr, beta1, beta2, eps, weight_decay, step}
// Results  (all f32):  new_param, new_exp_avg, new_exp_avg_sq  (param's shape)
//
// The math follows torch.optim.AdamW (amsgrad=False, maximize=False):
//   param *= 1 - lr * weight_decay
//   m      = beta1 * m + (1 - beta1) * g
//   v      = beta2 * v + (1 - beta2) * g * g
//   param -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// As in PyTorch, the scalar factors are computed in double and the elementwise
// math is done in float.
//
// Only the XLA FFI headers are needed (no torch, no Python):
//   c++ -O2 -std=c++17 -shared -fPIC -I<jax.ffi.include_dir()>
//       adamw.cc -o libtorch_tpu_adamw.so
// The exported C symbol is `TorchTpuExampleAdamW`.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr size_t kNumHparams = 6;

// "[37,129]" for error messages.
std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? "," : "") << dims[i];
  out << ']';
  return out.str();
}

ffi::Error AdamWImpl(ffi::Buffer<ffi::F32> param, ffi::Buffer<ffi::F32> grad,
                     ffi::Buffer<ffi::F32> exp_avg,
                     ffi::Buffer<ffi::F32> exp_avg_sq,
                     ffi::Buffer<ffi::F32> hparams,
                     ffi::ResultBuffer<ffi::F32> new_param,
                     ffi::ResultBuffer<ffi::F32> new_exp_avg,
                     ffi::ResultBuffer<ffi::F32> new_exp_avg_sq) {
  // Validate shapes. The binding already guarantees the dtype (f32) and the
  // number of operands/results; XLA reports a mismatch there by itself.
  const ffi::Span<const int64_t> dims = param.dimensions();
  const struct {
    const char* name;
    ffi::Span<const int64_t> dims;
  } others[] = {
      {"grad", grad.dimensions()},
      {"exp_avg", exp_avg.dimensions()},
      {"exp_avg_sq", exp_avg_sq.dimensions()},
      {"result new_param", new_param->dimensions()},
      {"result new_exp_avg", new_exp_avg->dimensions()},
      {"result new_exp_avg_sq", new_exp_avg_sq->dimensions()},
  };
  for (const auto& other : others) {
    if (!(other.dims == dims)) {  // ffi::Span has no operator!=
      return ffi::Error::InvalidArgument(
          std::string("torch_tpu_example_adamw: ") + other.name +
          " has shape " + ShapeString(other.dims) +
          " but param has shape " + ShapeString(dims));
    }
  }
  if (hparams.element_count() != kNumHparams) {
    return ffi::Error::InvalidArgument(
        "torch_tpu_example_adamw: hparams must have 6 elements {lr, beta1, "
        "beta2, eps, weight_decay, step}, got shape " +
        ShapeString(hparams.dimensions()));
  }

  // Scalar hyperparameters, promoted to double like Python floats in torch.
  const float* hp = hparams.typed_data();
  const double lr = hp[0], beta1 = hp[1], beta2 = hp[2], eps = hp[3],
               weight_decay = hp[4], step = hp[5];
  if (!(step >= 1.0)) {
    return ffi::Error::InvalidArgument(
        "torch_tpu_example_adamw: step must be >= 1, got " +
        std::to_string(step));
  }
  const double bias_correction1 = 1.0 - std::pow(beta1, step);
  const double bias_correction2 = 1.0 - std::pow(beta2, step);

  // Elementwise factors, rounded to float once (as torch does for float
  // tensors with Python-scalar operands).
  const float decay = static_cast<float>(1.0 - lr * weight_decay);
  const float b1 = static_cast<float>(beta1);
  const float one_minus_b1 = static_cast<float>(1.0 - beta1);
  const float b2 = static_cast<float>(beta2);
  const float one_minus_b2 = static_cast<float>(1.0 - beta2);
  const float step_size = static_cast<float>(lr / bias_correction1);
  const float bias_correction2_sqrt =
      static_cast<float>(std::sqrt(bias_correction2));
  const float eps_f = static_cast<float>(eps);

  const float* p_in = param.typed_data();
  const float* g_in = grad.typed_data();
  const float* m_in = exp_avg.typed_data();
  const float* v_in = exp_avg_sq.typed_data();
  float* p_out = new_param->typed_data();
  float* m_out = new_exp_avg->typed_data();
  float* v_out = new_exp_avg_sq->typed_data();

  // Each element is read completely before it is written, so the loop is also
  // correct when results alias operands (input_output_aliases / donation).
  const size_t n = param.element_count();
  for (size_t i = 0; i < n; ++i) {
    const float g = g_in[i];
    const float m = b1 * m_in[i] + one_minus_b1 * g;
    const float v = b2 * v_in[i] + one_minus_b2 * g * g;
    const float denom = std::sqrt(v) / bias_correction2_sqrt + eps_f;
    p_out[i] = p_in[i] * decay - step_size * (m / denom);
    m_out[i] = m;
    v_out[i] = v;
  }
  return ffi::Error::Success();
}

}  // namespace

// Defines `extern "C" XLA_FFI_Error* TorchTpuExampleAdamW(XLA_FFI_CallFrame*)`.
// Operands and results are bound in order.
XLA_FFI_DEFINE_HANDLER_SYMBOL(TorchTpuExampleAdamW, AdamWImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // param
                                  .Arg<ffi::Buffer<ffi::F32>>()  // grad
                                  .Arg<ffi::Buffer<ffi::F32>>()  // exp_avg
                                  .Arg<ffi::Buffer<ffi::F32>>()  // exp_avg_sq
                                  .Arg<ffi::Buffer<ffi::F32>>()  // hparams
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new_param
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new_exp_avg
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new_exp_avg_sq
);
