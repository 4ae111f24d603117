// Fused optimizer steps: _fused_adam_ / _fused_adamw_ (torch.optim.Adam(W)
// with fused=True, the transformers Trainer's default "adamw_torch_fused").
// One program updates every parameter and its moments; results are returned
// in the order the op's mutable lists appear (params, grads, exp_avgs,
// exp_avg_sqs, max_exp_avg_sqs), which is how the dispatcher writes them back.
#include "ops/common.h"

namespace tpu::ops {
namespace {

enum Idx : size_t {
  kParams,
  kGrads,
  kExpAvgs,
  kExpAvgSqs,
  kMaxExpAvgSqs,
  kSteps,
  kLr,
  kBeta1,
  kBeta2,
  kWeightDecay,
  kEps,
  kAmsgrad,
  kMaximize,
  kGradScale,
  kFoundInf
};

std::vector<Value> fusedAdam(Ctx& c, bool decoupled) {
  auto& b = c.b;
  const DType f = DType::F32;  // opmath of float, half and bfloat16 parameters
  auto params = c.tensors(kParams), grads = c.tensors(kGrads), m = c.tensors(kExpAvgs), v = c.tensors(kExpAvgSqs),
       vmax = c.tensors(kMaxExpAvgSqs), steps = c.tensors(kSteps);
  const bool amsgrad = c.flag(kAmsgrad), maximize = c.flag(kMaximize);
  const size_t n = params.size();
  if (grads.size() != n || m.size() != n || v.size() != n || steps.size() != n || (amsgrad && vmax.size() != n))
    throw std::invalid_argument("_fused_adam: the tensor lists must have the same length");
  for (size_t i = 0; i < n; ++i)
    if (!ir::isFloat(params[i].dtype()) || params[i].dtype() == DType::F64)
      throw ir::Unsupported("_fused_adam on " + std::string(ir::dtypeName(params[i].dtype())));

  // lr is a float attribute or a tensor (the tensor_lr overload, and the
  // float overload's composite, which passes it as a program input).
  Value lr = c.kind(kLr) == Arg::Kind::Double ? b.constant(c.f64(kLr), f) : cast(b, c.tensor(kLr), f);
  if (!lr.shape().empty()) lr = b.reshape(lr, {});
  const double beta1 = c.f64(kBeta1), beta2 = c.f64(kBeta2), wd = c.f64(kWeightDecay), eps = c.f64(kEps);
  auto gs = c.optTensor(kGradScale), inf = c.optTensor(kFoundInf);
  Value skip;  // found_inf set: the step leaves everything unchanged
  if (inf) skip = b.compare(b.reshape(cast(b, *inf, f), {}), b.constant(0.0, f), ir::Cmp::NE);
  Value scale = gs ? b.reshape(cast(b, *gs, f), {}) : Value{};

  std::vector<Value> p_out, g_out, m_out, v_out, vmax_out;
  auto k = [&](double x, const Value& like) { return b.constant(x, like.dtype(), like.shape()); };
  auto bc = [&](const Value& s, const Value& like) { return b.broadcastTo(s, like.shape()); };
  for (size_t i = 0; i < n; ++i) {
    Value p = cast(b, params[i], f), g = cast(b, grads[i], f);
    Value mi = cast(b, m[i], f), vi = cast(b, v[i], f);
    if (scale.valid()) g = div(b, g, bc(scale, g));
    Value g_store = g;  // the unscaled gradient is written back (as PyTorch's kernels do)
    if (maximize) g = b.unary("negate", g);
    if (wd != 0) {
      if (decoupled)
        p = mul(b, p, sub(b, k(1, p), mul(b, bc(lr, p), k(wd, p))));
      else
        g = add(b, g, mul(b, p, k(wd, p)));
    }
    mi = add(b, mi, mul(b, k(1 - beta1, g), sub(b, g, mi)));
    vi = add(b, mul(b, vi, k(beta2, vi)), mul(b, k(1 - beta2, g), mul(b, g, g)));
    Value step = b.reshape(cast(b, steps[i], f), {});
    Value bc1 = sub(b, b.constant(1, f), b.binary("power", b.constant(beta1, f), step));
    Value bc2 = sub(b, b.constant(1, f), b.binary("power", b.constant(beta2, f), step));
    Value step_size = div(b, lr, bc1), bc2_sqrt = b.unary("sqrt", bc2);
    Value second = vi;
    Value vmi;
    if (amsgrad) {
      vmi = b.binary("maximum", cast(b, vmax[i], f), vi);
      second = vmi;
    }
    Value denom = add(b, div(b, b.unary("sqrt", second), bc(bc2_sqrt, second)), k(eps, second));
    p = sub(b, p, mul(b, bc(step_size, p), div(b, mi, denom)));

    auto keep = [&](const Value& updated, const Value& old) {
      Value r = cast(b, updated, old.dtype());
      return skip.valid() ? b.select(bc(skip, r), old, r) : r;
    };
    p_out.push_back(keep(p, params[i]));
    g_out.push_back(scale.valid() ? keep(g_store, grads[i]) : grads[i]);
    m_out.push_back(keep(mi, m[i]));
    v_out.push_back(keep(vi, v[i]));
    if (amsgrad) vmax_out.push_back(keep(vmi, vmax[i]));
  }
  if (!amsgrad) {  // a list passed without amsgrad is left as it is
    for (const auto& x : vmax)
      if (x.valid()) vmax_out.push_back(x);
  }
  std::vector<Value> out;
  for (auto* l : {&p_out, &g_out, &m_out, &v_out, &vmax_out}) out.insert(out.end(), l->begin(), l->end());
  return out;
}

Registrar reg_fused_adam("_fused_adam", [](Ctx& c) { return fusedAdam(c, false); });
Registrar reg_fused_adamw("_fused_adamw", [](Ctx& c) { return fusedAdam(c, true); });

}  // namespace
}  // namespace tpu::ops
