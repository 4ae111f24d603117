// Neural-network ops: softmax, normalisation, convolution, pooling, losses,
// with their backward ops.
#include <cmath>
#include <limits>
#include <optional>
#include <utility>

#include "ops/common.h"
#include "ops/kernel_slots.h"

namespace tpu::ops {
namespace {

Value bcast(ir::Builder& b, const Value& reduced_keep, const Shape& s) { return b.broadcastTo(reduced_keep, s); }

// --------------------------------------------------------------- softmax

std::vector<Value> softmaxImpl(Ctx& c, bool log) {
  Value x = c.tensor(0);
  DType out = outType(c, x.dtype());
  DType acc = accOf(ir::isFloat(out) ? out : DType::F32);
  ir::Builder& b = c.b;
  Value xx = b.convert(x, acc);
  // A scalar: x - x is 0, or NaN for NaN and infinities, as on the CPU.
  if (x.rank() == 0) {
    Value z = sub(b, xx, xx);
    return {b.convert(log ? z : b.unary("exponential", z), out)};
  }
  int64_t dim = wrapDim(c.i64(1), x.rank());
  if (auto r = kernelSlots().softmax(b, x, dim, log, out)) return {*r};  // a plugin's row kernel
  Value m = keepDims(b, reduceMax(b, xx, {dim}), x.shape(), {dim});
  // A row whose max is infinite gives NaN throughout, as in PyTorch.
  Value sh = sub(b, xx, bcast(b, m, x.shape()));
  Value e = b.unary("exponential", sh);
  Value s = keepDims(b, reduceSum(b, e, {dim}), x.shape(), {dim});
  Value r = log ? sub(b, sh, bcast(b, b.unary("log", s), x.shape())) : div(b, e, bcast(b, s, x.shape()));
  return {b.convert(r, out)};
}
Registrar reg_softmax("_softmax", [](Ctx& c) { return softmaxImpl(c, false); });
Registrar reg_log_softmax("_log_softmax", [](Ctx& c) { return softmaxImpl(c, true); });
Registrar reg_softmax2("softmax", [](Ctx& c) { return softmaxImpl(c, false); });
Registrar reg_log_softmax2("log_softmax", [](Ctx& c) { return softmaxImpl(c, true); });

// _masked_softmax(x, mask, dim?, mask_type?): softmax over the positions the
// bool mask leaves (true: masked out); a row with every position masked is
// NaN, as PyTorch's CPU kernel gives. mask_type 1 is a [B, L] key-padding mask of a
// [B, H, L, L] input; 0 ([L, L]) and 2 broadcast. One program (it ran on the CPU).
Registrar reg_masked_softmax("_masked_softmax", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0), mask = c.tensor(1);
  if (mask.dtype() != DType::Bool || !ir::isFloat(x.dtype()) || x.rank() == 0)
    throw ir::Unsupported("_masked_softmax arguments");
  const int64_t dim = wrapDim(c.i64Or(2, -1), x.rank());
  const int64_t type = c.i64Or(3, -1);
  if (type == 1 && x.rank() == 4 && mask.rank() == 2) mask = b.reshape(mask, {mask.shape()[0], 1, 1, mask.shape()[1]});
  mask = b.broadcastTo(mask, x.shape());
  const DType out = outType(c, x.dtype());
  const DType acc = accOf(out);
  Value xx = b.convert(x, acc);
  const Value ninf = b.constant(-std::numeric_limits<double>::infinity(), acc, x.shape());
  Value xm = b.select(mask, ninf, xx);
  Value m = bcast(b, keepDims(b, reduceMax(b, xm, {dim}), x.shape(), {dim}), x.shape());
  Value e = b.unary("exponential", sub(b, xm, m));  // a row with every position masked: NaN, as on the CPU
  Value s = bcast(b, keepDims(b, reduceSum(b, e, {dim}), x.shape(), {dim}), x.shape());
  return std::vector<Value>{b.convert(div(b, e, s), out)};
});

// _softmax_backward_data / _log_softmax_backward_data(grad, output, dim, input_dtype):
// shared set-up, the formula differs.
std::vector<Value> softmaxBackward(Ctx& c, bool log) {
  Value g = c.tensor(0), y = c.tensor(1);
  DType out = outType(c, g.dtype());
  DType acc = accOf(out);
  ir::Builder& b = c.b;
  Value gg = b.convert(g, acc), yy = b.convert(y, acc);
  if (y.rank() == 0) return {b.convert(b.zeros(gg.type), out)};
  int64_t dim = wrapDim(c.i64(2), y.rank());
  if (log) {
    Value s = bcast(b, keepDims(b, reduceSum(b, gg, {dim}), y.shape(), {dim}), y.shape());
    return {b.convert(sub(b, gg, mul(b, b.unary("exponential", yy), s)), out)};
  }
  Value s = bcast(b, keepDims(b, reduceSum(b, mul(b, gg, yy), {dim}), y.shape(), {dim}), y.shape());
  return {b.convert(mul(b, yy, sub(b, gg, s)), out)};
}
Registrar reg_softmax_backward("_softmax_backward_data", [](Ctx& c) { return softmaxBackward(c, false); });
Registrar reg_log_softmax_backward("_log_softmax_backward_data", [](Ctx& c) { return softmaxBackward(c, true); });

// --------------------------------------------------------------- layer norm

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
Registrar reg_native_layer_norm("native_layer_norm", [](Ctx& c) {
  Value x = c.tensor(0);
  auto ns = c.ints(1);
  double eps = c.f64(4);
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  int64_t axis = x.rank() - static_cast<int64_t>(ns.size());
  std::vector<int64_t> dims;
  int64_t n = 1;
  for (int64_t d = axis; d < x.rank(); ++d) {
    dims.push_back(d);
    n *= x.shape()[d];
  }
  // A plugin's kernel: rows of n, the statistics shaped and typed here.
  if (auto r = kernelSlots().layerNorm(b, LayerNormArgs{x, n, c.optTensor(2), c.optTensor(3), eps})) {
    Shape stat_shape = x.shape();
    for (auto d : dims) stat_shape[d] = 1;
    DType stat = c.hasExpected() && c.expected().size() > 1 ? c.expectedAt(1).dtype : acc;
    return std::vector<Value>{b.reshape((*r)[0], x.shape()), b.convert(b.reshape((*r)[1], stat_shape), stat),
                              b.convert(b.reshape((*r)[2], stat_shape), stat)};
  }
  Value xx = b.convert(x, acc);
  Value sum = reduceSum(b, xx, dims);
  Value mean = div(b, sum, full(b, static_cast<double>(n), sum));
  Value meank = keepDims(b, mean, x.shape(), dims);
  Value d = sub(b, xx, bcast(b, meank, x.shape()));
  Value ss = reduceSum(b, mul(b, d, d), dims);
  Value var = div(b, ss, full(b, static_cast<double>(n), ss));
  Value rstd = b.unary("rsqrt", add(b, var, b.constant(eps, acc, var.shape())));
  Value rstdk = keepDims(b, rstd, x.shape(), dims);
  Value y = mul(b, d, bcast(b, rstdk, x.shape()));
  if (auto w = c.optTensor(2)) y = mul(b, y, b.broadcastTo(b.convert(*w, acc), x.shape()));
  if (auto bb = c.optTensor(3)) y = add(b, y, b.broadcastTo(b.convert(*bb, acc), x.shape()));
  DType stat = c.hasExpected() && c.expected().size() > 1 ? c.expectedAt(1).dtype : acc;
  return std::vector<Value>{b.convert(y, x.dtype()), b.convert(meank, stat), b.convert(rstdk, stat)};
});

// native_layer_norm_backward(grad, input, normalized_shape, mean, rstd, weight?, bias?, mask[3])
Registrar reg_native_layer_norm_backward("native_layer_norm_backward", [](Ctx& c) {
  Value g = c.tensor(0), x = c.tensor(1);
  auto ns = c.ints(2);
  auto mask = c.arg(7).ints;
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  int64_t axis = x.rank() - static_cast<int64_t>(ns.size());
  std::vector<int64_t> ndims, bdims;
  int64_t n = 1;
  for (int64_t d = 0; d < x.rank(); ++d) {
    if (d >= axis) {
      ndims.push_back(d);
      n *= x.shape()[d];
    } else {
      bdims.push_back(d);
    }
  }
  auto w = c.optTensor(5);
  auto bias = c.optTensor(6);
  if (auto r = kernelSlots().layerNormBackward(b, LayerNormArgs{x, n, w, bias, 0.0}, g, c.tensor(3), c.tensor(4))) {
    std::vector<Value> res(3);
    if (mask.size() < 1 || mask[0]) res[0] = b.reshape((*r)[0], x.shape());
    if (w && mask.size() > 1 && mask[1]) res[1] = b.reshape((*r)[1], w->shape());
    if (bias && mask.size() > 2 && mask[2]) res[2] = b.reshape((*r)[2], bias->shape());
    return res;
  }
  Value gg = b.convert(g, acc), xx = b.convert(x, acc);
  Value mean = bcast(b, b.convert(c.tensor(3), acc), x.shape());
  Value rstd = bcast(b, b.convert(c.tensor(4), acc), x.shape());
  Value xhat = mul(b, sub(b, xx, mean), rstd);
  Value gw = w ? mul(b, gg, b.broadcastTo(b.convert(*w, acc), x.shape())) : gg;
  std::vector<Value> res(3);
  if (mask.size() < 1 || mask[0]) {
    Value s1 = reduceSum(b, gw, ndims), s2 = reduceSum(b, mul(b, gw, xhat), ndims);
    Value nn = full(b, static_cast<double>(n), s1);
    Value m1 = bcast(b, keepDims(b, div(b, s1, nn), x.shape(), ndims), x.shape());
    Value m2 = bcast(b, keepDims(b, div(b, s2, nn), x.shape(), ndims), x.shape());
    res[0] = b.convert(mul(b, rstd, sub(b, sub(b, gw, m1), mul(b, xhat, m2))), x.dtype());
  }
  if (w && mask.size() > 1 && mask[1]) res[1] = b.convert(reduceSum(b, mul(b, gg, xhat), bdims), w->dtype());
  if (bias && mask.size() > 2 && mask[2]) res[2] = b.convert(reduceSum(b, gg, bdims), bias->dtype());
  return res;
});

// --------------------------------------------------------------- batch norm

struct BnStats {
  Value mean, invstd, var_unbiased;
};

std::vector<int64_t> bnDims(const Value& x) {
  std::vector<int64_t> dims{0};
  for (int d = 2; d < x.rank(); ++d) dims.push_back(d);
  return dims;
}

Value perChannel(ir::Builder& b, const Value& v, const Value& x) { return b.broadcastInDim(v, x.shape(), {1}); }

// Returns (out, save_mean, save_invstd, new_running_mean?, new_running_var?)
struct BnResult {
  Value out, save_mean, save_invstd, rm, rv;
};

BnResult batchNorm(Ctx& c, const Value& x, std::optional<Value> w, std::optional<Value> bias, std::optional<Value> rm,
                   std::optional<Value> rv, bool training, double momentum, double eps) {
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  Value xx = b.convert(x, acc);
  auto dims = bnDims(x);
  int64_t n = 1;
  for (auto d : dims) n *= x.shape()[d];
  int64_t ch = x.shape()[1];
  BnResult r;
  Value mean, var;
  if (training) {
    mean = div(b, reduceSum(b, xx, dims), b.constant(static_cast<double>(n), acc, {ch}));
    Value d = sub(b, xx, perChannel(b, mean, x));
    Value ss = reduceSum(b, mul(b, d, d), dims);
    var = div(b, ss, b.constant(static_cast<double>(n), acc, {ch}));
    if (rm) {
      Value m = b.constant(momentum, acc, {ch}), om = b.constant(1 - momentum, acc, {ch});
      r.rm = b.convert(add(b, mul(b, om, b.convert(*rm, acc)), mul(b, m, mean)), rm->dtype());
    }
    if (rv) {
      Value m = b.constant(momentum, acc, {ch}), om = b.constant(1 - momentum, acc, {ch});
      Value unb = div(b, ss, b.constant(static_cast<double>(std::max<int64_t>(n - 1, 1)), acc, {ch}));
      r.rv = b.convert(add(b, mul(b, om, b.convert(*rv, acc)), mul(b, m, unb)), rv->dtype());
    }
  } else {
    mean = b.convert(*rm, acc);
    var = b.convert(*rv, acc);
  }
  Value invstd = b.unary("rsqrt", add(b, var, b.constant(eps, acc, {ch})));
  Value y = mul(b, sub(b, xx, perChannel(b, mean, x)), perChannel(b, invstd, x));
  if (w) y = mul(b, y, perChannel(b, b.convert(*w, acc), x));
  if (bias) y = add(b, y, perChannel(b, b.convert(*bias, acc), x));
  r.out = b.convert(y, x.dtype());
  r.save_mean = mean;
  r.save_invstd = invstd;
  return r;
}

Value emptyStat(ir::Builder& b, DType t) { return b.constant(0.0, t, {0}); }

// Eval mode: the CPU kernels return empty statistics (the meta kernel sizes
// them per channel; the dispatcher accepts the [0] placeholder).
std::vector<Value> evalStats(Ctx& c, const BnResult& r, DType st) {
  return {r.out, emptyStat(c.b, st), emptyStat(c.b, st)};
}

// Writes the updated running statistics back into arguments 3 and 4.
void writeRunningStats(Ctx& c, const BnResult& r) {
  if (r.rm.valid()) c.mutate(3, r.rm);
  if (r.rv.valid()) c.mutate(4, r.rv);
}

// (out, save_mean, save_invstd), the saved statistics empty in evaluation.
std::vector<Value> batchNormResults(Ctx& c, const BnResult& r, bool training, const Value& x) {
  writeRunningStats(c, r);
  if (!training) return evalStats(c, r, accOf(x.dtype()));
  return {r.out, r.save_mean, r.save_invstd};
}

// native_batch_norm(input, w?, b?, rm?, rv?, training, momentum, eps) -> (out, save_mean, save_invstd)
Registrar reg_native_batch_norm("native_batch_norm", [](Ctx& c) {
  Value x = c.tensor(0);
  bool training = c.flag(5);
  auto r =
      batchNorm(c, x, c.optTensor(1), c.optTensor(2), c.optTensor(3), c.optTensor(4), training, c.f64(6), c.f64(7));
  return batchNormResults(c, r, training, x);
});
// _native_batch_norm_legit(input, w?, b?, rm!, rv!, training, momentum, eps) and .no_stats
Registrar reg_native_batch_norm_legit("_native_batch_norm_legit", [](Ctx& c) {
  Value x = c.tensor(0);
  bool no_stats = c.kind(3) == Arg::Kind::Bool;
  size_t o = no_stats ? 3 : 5;
  bool training = c.flag(o);
  std::optional<Value> rm = no_stats ? std::nullopt : c.optTensor(3), rv = no_stats ? std::nullopt : c.optTensor(4);
  auto r = batchNorm(c, x, c.optTensor(1), c.optTensor(2), rm, rv, training, c.f64(o + 1), c.f64(o + 2));
  return batchNormResults(c, r, training, x);
});
// _batch_norm_with_update(input, w?, b?, rm!, rv!, momentum, eps) -> (out, save_mean, save_invstd, reserve)
Registrar reg_batch_norm_with_update("_batch_norm_with_update", [](Ctx& c) {
  Value x = c.tensor(0);
  auto r = batchNorm(c, x, c.optTensor(1), c.optTensor(2), c.optTensor(3), c.optTensor(4), true, c.f64(5), c.f64(6));
  writeRunningStats(c, r);
  return std::vector<Value>{r.out, r.save_mean, r.save_invstd, c.b.constantInt(0, DType::U8, {0})};
});
Registrar reg_batch_norm_no_update("_batch_norm_no_update", [](Ctx& c) {
  Value x = c.tensor(0);
  auto r = batchNorm(c, x, c.optTensor(1), c.optTensor(2), c.optTensor(3), c.optTensor(4), false, c.f64(5), c.f64(6));
  DType st = accOf(x.dtype());
  return std::vector<Value>{r.out, emptyStat(c.b, st), emptyStat(c.b, st), c.b.constantInt(0, DType::U8, {0})};
});

// Shared backward: (grad_out, input, weight?, rm?, rv?, save_mean?, save_invstd?, train, eps, mask)
std::vector<Value> batchNormBackward(Ctx& c, bool save_is_var) {
  Value g = c.tensor(0), x = c.tensor(1);
  auto w = c.optTensor(2);
  bool train = c.flag(7);
  double eps = c.f64(8);
  auto mask = c.arg(9).ints;
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  auto dims = bnDims(x);
  int64_t n = 1;
  for (auto d : dims) n *= x.shape()[d];
  int64_t ch = x.shape()[1];
  Value gg = b.convert(g, acc), xx = b.convert(x, acc);
  Value mean, invstd;
  if (train) {
    mean = b.convert(c.tensor(5), acc);
    invstd = b.convert(c.tensor(6), acc);
    if (save_is_var) invstd = b.unary("rsqrt", add(b, invstd, b.constant(eps, acc, {ch})));
  } else {
    mean = b.convert(c.tensor(3), acc);
    invstd = b.unary("rsqrt", add(b, b.convert(c.tensor(4), acc), b.constant(eps, acc, {ch})));
  }
  Value xhat = mul(b, sub(b, xx, perChannel(b, mean, x)), perChannel(b, invstd, x));
  Value wv = w ? b.convert(*w, acc) : b.constant(1.0, acc, {ch});
  Value sum_g = reduceSum(b, gg, dims);
  Value sum_gx = reduceSum(b, mul(b, gg, xhat), dims);
  std::vector<Value> res(3);
  if (mask.empty() || mask[0]) {
    Value dx;
    if (train) {
      Value nn = b.constant(static_cast<double>(n), acc, {ch});
      Value t1 = perChannel(b, div(b, sum_g, nn), x);
      Value t2 = mul(b, xhat, perChannel(b, div(b, sum_gx, nn), x));
      dx = mul(b, sub(b, sub(b, gg, t1), t2), perChannel(b, mul(b, wv, invstd), x));
    } else {
      dx = mul(b, gg, perChannel(b, mul(b, wv, invstd), x));
    }
    res[0] = b.convert(dx, x.dtype());
  }
  DType wt = w ? w->dtype() : x.dtype();
  if (mask.size() > 1 && mask[1]) res[1] = b.convert(sum_gx, wt);
  if (mask.size() > 2 && mask[2]) res[2] = b.convert(sum_g, wt);
  return res;
}
Registrar reg_native_batch_norm_backward("native_batch_norm_backward",
                                         [](Ctx& c) { return batchNormBackward(c, false); });
// batch_norm_backward(grad, input, weight, rm?, rv?, save_mean?, save_var?, update, eps, mask, reserve)
Registrar reg_batch_norm_backward("batch_norm_backward", [](Ctx& c) { return batchNormBackward(c, false); });

// --------------------------------------------------------------- convolution

ir::Builder::ConvDims convDims(int nsp) {
  ir::Builder::ConvDims dn;
  dn.in_batch = 0;
  dn.in_feature = 1;
  dn.k_out = 0;
  dn.k_in = 1;
  dn.out_batch = 0;
  dn.out_feature = 1;
  for (int i = 0; i < nsp; ++i) {
    dn.in_spatial.push_back(2 + i);
    dn.k_spatial.push_back(2 + i);
    dn.out_spatial.push_back(2 + i);
  }
  return dn;
}

std::vector<int64_t> expandArg(std::vector<int64_t> v, int n) {
  if (v.size() == 1 && n > 1) v.assign(n, v[0]);
  return v;
}

// Weight [O, I/g, k...] of a transposed conv -> forward-conv kernel
// [I... ] with flipped spatial dims: [g, I/g, O/g, k] -> [O/g * g ...].
Value transposeKernel(ir::Builder& b, const Value& w, int64_t groups) {
  // w: [Cin, Cout/g, k...] (transposed-conv weight layout) -> [Cout, Cin/g, k...]
  Shape s = w.shape();
  int64_t cin = s[0], coutg = s[1];
  int nsp = w.rank() - 2;
  Shape g5{groups, cin / groups, coutg};
  for (int i = 0; i < nsp; ++i) g5.push_back(s[2 + i]);
  Value r = b.reshape(w, g5);
  std::vector<int64_t> perm{0, 2, 1};
  for (int i = 0; i < nsp; ++i) perm.push_back(3 + i);
  r = b.transpose(r, perm);  // [g, Cout/g, Cin/g, k]
  Shape out{groups * coutg, cin / groups};
  for (int i = 0; i < nsp; ++i) out.push_back(s[2 + i]);
  r = b.reshape(r, out);
  std::vector<int64_t> sp;
  for (int i = 0; i < nsp; ++i) sp.push_back(2 + i);
  return b.reverse(r, sp);
}

Value convForward(ir::Builder& b, const Value& x, const Value& w, const std::vector<int64_t>& stride,
                  const std::vector<int64_t>& padding, const std::vector<int64_t>& dilation, bool transposed,
                  const std::vector<int64_t>& out_pad, int64_t groups, DType acc) {
  int nsp = x.rank() - 2;
  auto dn = convDims(nsp);
  if (!transposed) {
    std::vector<std::pair<int64_t, int64_t>> pad;
    for (int i = 0; i < nsp; ++i) pad.push_back({padding[i], padding[i]});
    return b.convolution(x, w, dn, stride, pad, Shape(nsp, 1), dilation, groups, 1, acc);
  }
  Value k = transposeKernel(b, w, groups);
  std::vector<std::pair<int64_t, int64_t>> pad;
  for (int i = 0; i < nsp; ++i) {
    int64_t ke = dilation[i] * (w.shape()[2 + i] - 1);
    pad.push_back({ke - padding[i], ke - padding[i] + out_pad[i]});
  }
  return b.convolution(x, k, dn, Shape(nsp, 1), pad, stride, dilation, groups, 1, acc);
}

// convolution_overrideable(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
std::vector<Value> convolution(Ctx& c) {
  Value x = c.tensor(0), w = c.tensor(1);
  int nsp = x.rank() - 2;
  if (nsp < 1) throw ir::Unsupported("convolution without spatial dims");
  auto stride = expandArg(c.ints(3), nsp), padding = expandArg(c.ints(4), nsp), dilation = expandArg(c.ints(5), nsp);
  bool transposed = c.flag(6);
  auto out_pad = expandArg(c.ints(7), nsp);
  int64_t groups = c.i64(8);
  DType out = outType(c, x.dtype());
  DType acc = accOf(out);
  ir::Builder& b = c.b;
  Value y =
      convForward(b, b.convert(x, acc), b.convert(w, acc), stride, padding, dilation, transposed, out_pad, groups, acc);
  if (auto bias = c.optTensor(2)) y = add(b, y, b.broadcastInDim(b.convert(*bias, acc), y.shape(), {1}));
  return {b.convert(y, out)};
}
Registrar reg_convolution_overrideable("convolution_overrideable", convolution);
Registrar reg_convolution("convolution", convolution);
Registrar reg_convolution2("_convolution", convolution);

// Weight gradient of conv(x, w) given the output gradient g:
// grad_w[o, i, k] = sum_{n, p} g[n, o, p] * x_pad[n, i, p*s + k*d]. The batch
// dim plays the contracted feature, the channels the batch.
Value convWeightGrad(ir::Builder& b, const Value& x, const Value& g, const Shape& w_shape,
                     const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                     const std::vector<int64_t>& dilation, int64_t groups, DType acc) {
  int nsp = x.rank() - 2;
  // The forward's dims with each pair's roles traded: x's batch and channels,
  // g's output and input channels (g is the kernel), the result's two.
  ir::Builder::ConvDims dn = convDims(nsp);
  std::swap(dn.in_batch, dn.in_feature);
  std::swap(dn.k_in, dn.k_out);
  std::swap(dn.out_batch, dn.out_feature);
  std::vector<std::pair<int64_t, int64_t>> pad;
  for (int i = 0; i < nsp; ++i) {
    int64_t k = w_shape[2 + i];
    int64_t in = x.shape()[2 + i];
    int64_t o = g.shape()[2 + i];
    int64_t hi = (k - 1) * dilation[i] + (o - 1) * stride[i] + 1 - in - padding[i];
    pad.push_back({padding[i], hi});
  }
  return b.convolution(x, g, dn, dilation, pad, Shape(nsp, 1), stride, 1, groups, acc);
}

// convolution_backward_overrideable(grad, input, weight, stride, padding, dilation, transposed, output_padding,
//                                   groups, mask) -> (grad_input, grad_weight, grad_bias)
// A transposed convolution is the adjoint of conv(., w): its input gradient
// is that convolution of the output gradient, and its weight gradient is
// conv's weight gradient with the roles of input and output swapped.
std::vector<Value> convolutionBackward(Ctx& c, size_t mask_idx, size_t first) {
  Value g = c.tensor(0), x = c.tensor(1), w = c.tensor(2);
  int nsp = x.rank() - 2;
  auto stride = expandArg(c.ints(first), nsp), padding = expandArg(c.ints(first + 1), nsp);
  auto dilation = expandArg(c.ints(first + 2), nsp);
  bool transposed = c.flag(first + 3);
  int64_t groups = c.i64(first + 5);
  auto mask = c.arg(mask_idx).ints;
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  Value gg = b.convert(g, acc), xx = b.convert(x, acc), ww = b.convert(w, acc);
  std::vector<Value> res(3);
  if (mask.empty() || mask[0]) {
    Value gi;
    if (transposed) {
      gi = convForward(b, gg, ww, stride, padding, dilation, false, {}, groups, acc);
      // output_padding may reach past a stride (when dilation is larger):
      // those output positions came from no input.
      if (gi.shape() != x.shape()) gi = b.slice(gi, Shape(gi.rank(), 0), x.shape(), Shape(gi.rank(), 1));
    } else {
      std::vector<int64_t> out_pad(nsp);
      for (int i = 0; i < nsp; ++i) {
        int64_t k = w.shape()[2 + i];
        int64_t full = (g.shape()[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (k - 1) + 1;
        out_pad[i] = x.shape()[2 + i] - full;
      }
      // conv_transpose takes its weight as [in = Cout, out/g = Cin/g, k]: the
      // forward weight's own layout.
      gi = convForward(b, gg, ww, stride, padding, dilation, true, out_pad, groups, acc);
    }
    res[0] = b.convert(gi, x.dtype());
  }
  if (mask.size() > 1 && mask[1]) {
    Value gw = transposed ? convWeightGrad(b, gg, xx, w.shape(), stride, padding, dilation, groups, acc)
                          : convWeightGrad(b, xx, gg, w.shape(), stride, padding, dilation, groups, acc);
    res[1] = b.convert(gw, w.dtype());
  }
  if (mask.size() > 2 && mask[2]) {
    std::vector<int64_t> dims{0};
    for (int i = 0; i < nsp; ++i) dims.push_back(2 + i);
    res[2] = b.convert(reduceSum(b, gg, dims), g.dtype());
  }
  return res;
}
Registrar reg_convolution_backward_overrideable("convolution_backward_overrideable",
                                                [](Ctx& c) { return convolutionBackward(c, 9, 3); });
// convolution_backward(grad, input, weight, bias_sizes?, stride, padding, dilation, transposed, output_padding,
//                      groups, mask)
Registrar reg_convolution_backward("convolution_backward", [](Ctx& c) { return convolutionBackward(c, 10, 4); });

// --------------------------------------------------------------- pooling

struct Pool {
  std::vector<int64_t> k, s, p, d;
  std::vector<int64_t> out;
  std::vector<std::pair<int64_t, int64_t>> pad;  // per spatial dim (lo, hi)
};

Pool poolGeometry(const Value& x, std::vector<int64_t> k, std::vector<int64_t> s, std::vector<int64_t> p,
                  std::vector<int64_t> d, bool ceil_mode) {
  int nsp = 2;
  Pool g;
  g.k = expandArg(k, nsp);
  g.s = s.empty() ? g.k : expandArg(s, nsp);
  g.p = expandArg(p, nsp);
  g.d = expandArg(d.empty() ? std::vector<int64_t>{1} : d, nsp);
  for (int i = 0; i < nsp; ++i) {
    int64_t in = x.shape()[x.rank() - 2 + i];
    int64_t num = in + 2 * g.p[i] - g.d[i] * (g.k[i] - 1) - 1 + (ceil_mode ? g.s[i] - 1 : 0);
    int64_t o = num / g.s[i] + 1;
    if (ceil_mode && (o - 1) * g.s[i] >= in + g.p[i]) --o;
    g.out.push_back(o);
    int64_t hi = (o - 1) * g.s[i] + g.d[i] * (g.k[i] - 1) + 1 - in - g.p[i];
    g.pad.push_back({g.p[i], std::max<int64_t>(hi, 0)});
  }
  return g;
}

// Window params over the full tensor (N, C spatial...) for reduce_window.
void windowParams(const Value& x, const Pool& g, Shape& win, Shape& str, Shape& dil,
                  std::vector<std::pair<int64_t, int64_t>>& pad) {
  int lead = x.rank() - 2;
  win.assign(x.rank(), 1);
  str.assign(x.rank(), 1);
  dil.assign(x.rank(), 1);
  pad.assign(x.rank(), {0, 0});
  for (int i = 0; i < 2; ++i) {
    win[lead + i] = g.k[i];
    str[lead + i] = g.s[i];
    dil[lead + i] = g.d[i];
    pad[lead + i] = g.pad[i];
  }
}

// max_pool2d_with_indices(self, kernel, stride, padding, dilation, ceil_mode) -> (out, indices)
Registrar reg_max_pool2d_with_indices("max_pool2d_with_indices", [](Ctx& c) {
  Value x = c.tensor(0);
  Pool g = poolGeometry(x, c.ints(1), c.ints(2), c.ints(3), c.ints(4), c.flagOr(5, false));
  ir::Builder& b = c.b;
  int64_t h = x.shape()[x.rank() - 2], w = x.shape()[x.rank() - 1];
  Type it{DType::I64, x.shape()};
  Value flat =
      add(b, mul(b, b.iota(it, x.rank() - 2), b.constantInt(w, DType::I64, x.shape())), b.iota(it, x.rank() - 1));
  (void)h;
  Shape win, str, dil;
  std::vector<std::pair<int64_t, int64_t>> pad;
  windowParams(x, g, win, str, dil, pad);
  DType t = x.dtype();
  bool is_float = ir::isFloat(t);
  Value init = b.constant(lowestValue(t), t);
  auto r = b.reduceWindow({x, flat}, {init, b.constantInt(-1, DType::I64)}, win, str, Shape(x.rank(), 1), dil, pad,
                          maxWithIndex(is_float));
  return std::vector<Value>{r[0], r[1]};
});

// max_pool2d_with_indices_backward(grad, self, kernel, stride, padding, dilation, ceil_mode, indices)
Registrar reg_max_pool2d_backward("max_pool2d_with_indices_backward", [](Ctx& c) {
  Value g = c.tensor(0), x = c.tensor(1), idx = c.tensor(7);
  ir::Builder& b = c.b;
  int64_t hw = x.shape()[x.rank() - 2] * x.shape()[x.rank() - 1];
  int64_t lead = x.type.numel() / std::max<int64_t>(hw, 1);
  int64_t l = g.shape()[g.rank() - 2] * g.shape()[g.rank() - 1];
  DType acc = accOf(x.dtype());
  Value gg = b.reshape(b.convert(g, acc), {lead, l});
  Value ii = b.reshape(idx, {lead, l});
  Type it{DType::I64, {lead, l}};
  Value rows = b.reshape(b.iota(it, 0), {lead, l, 1});
  Value coords = b.concatenate({rows, b.reshape(ii, {lead, l, 1})}, 2);
  ir::Builder::ScatterDims dn;
  dn.inserted_window_dims = {0, 1};
  dn.scatter_dims_to_operand_dims = {0, 1};
  dn.index_vector_dim = 2;
  Value r =
      b.scatter(b.constant(0.0, acc, {lead, hw}), coords, gg, dn,
                [](ir::Builder& bb, const std::vector<Value>& a) { return std::vector<Value>{add(bb, a[0], a[1])}; });
  return std::vector<Value>{b.convert(b.reshape(r, x.shape()), x.dtype())};
});

// Divisor per output position of avg_pool2d.
Value avgDivisor(ir::Builder& b, const Value& x, const Pool& g, bool count_include_pad, DType acc) {
  Shape win, str, dil;
  std::vector<std::pair<int64_t, int64_t>> pad;
  windowParams(x, g, win, str, dil, pad);
  int lead = x.rank() - 2;
  Shape hw{x.shape()[lead], x.shape()[lead + 1]};
  Value ones = b.constant(1.0, acc, hw);
  Shape w2{g.k[0], g.k[1]}, s2{g.s[0], g.s[1]}, d2{1, 1};
  std::vector<std::pair<int64_t, int64_t>> p2{g.pad[0], g.pad[1]};
  if (count_include_pad) {
    // Padding counts, but not the extra ceil-mode area past it.
    ones = b.pad(ones, b.constant(1.0, acc), {g.p[0], g.p[1]}, {g.p[0], g.p[1]}, {0, 0});
    p2 = {{0, g.pad[0].second - g.p[0]}, {0, g.pad[1].second - g.p[1]}};
  }
  Value cnt = b.reduceWindow(
      {ones}, {b.constant(0.0, acc)}, w2, s2, d2, d2, p2,
      [](ir::Builder& bb, const std::vector<Value>& a) { return std::vector<Value>{add(bb, a[0], a[1])}; })[0];
  return cnt;
}

// avg_pool2d(self, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override?)
Registrar reg_avg_pool2d("avg_pool2d", [](Ctx& c) {
  Value x = c.tensor(0);
  Pool g = poolGeometry(x, c.ints(1), c.ints(2), c.ints(3), {1}, c.flagOr(4, false));
  bool include_pad = c.flagOr(5, true);
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  Shape win, str, dil;
  std::vector<std::pair<int64_t, int64_t>> pad;
  windowParams(x, g, win, str, dil, pad);
  Value s = b.reduceWindow(
      {b.convert(x, acc)}, {b.constant(0.0, acc)}, win, str, Shape(x.rank(), 1), dil, pad,
      [](ir::Builder& bb, const std::vector<Value>& a) { return std::vector<Value>{add(bb, a[0], a[1])}; })[0];
  Value divv;
  if (c.has(6)) {
    divv = b.constant(static_cast<double>(c.i64(6)), acc, s.shape());
  } else {
    Value cnt = avgDivisor(b, x, g, include_pad, acc);
    std::vector<int64_t> dims{s.rank() - 2, s.rank() - 1};
    divv = b.broadcastInDim(cnt, s.shape(), dims);
  }
  return std::vector<Value>{b.convert(div(b, s, divv), x.dtype())};
});

// avg_pool2d_backward(grad, self, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override?)
Registrar reg_avg_pool2d_backward("avg_pool2d_backward", [](Ctx& c) {
  Value g = c.tensor(0), x = c.tensor(1);
  Pool geo = poolGeometry(x, c.ints(2), c.ints(3), c.ints(4), {1}, c.flagOr(5, false));
  bool include_pad = c.flagOr(6, true);
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  Value gg = b.convert(g, acc);
  Value divv;
  if (c.has(7)) {
    divv = b.constant(static_cast<double>(c.i64(7)), acc, g.shape());
  } else {
    Value cnt = avgDivisor(b, x, geo, include_pad, acc);
    divv = b.broadcastInDim(cnt, g.shape(), {g.rank() - 2, g.rank() - 1});
  }
  Value q = div(b, gg, divv);
  // Spread each output gradient over its window: dilate by the stride, pad by
  // k-1, sum windows of k, then drop the padding.
  int lead = x.rank() - 2;
  Shape lo(x.rank(), 0), hi(x.rank(), 0), in(x.rank(), 0);
  for (int i = 0; i < 2; ++i) {
    in[lead + i] = geo.s[i] - 1;
    lo[lead + i] = geo.k[i] - 1;
    hi[lead + i] = geo.k[i] - 1;
  }
  Value up = b.pad(q, b.constant(0.0, acc), lo, hi, in);
  Shape win(x.rank(), 1), one(x.rank(), 1);
  std::vector<std::pair<int64_t, int64_t>> nopad(x.rank(), {0, 0});
  for (int i = 0; i < 2; ++i) win[lead + i] = geo.k[i];
  Value summed = b.reduceWindow(
      {up}, {b.constant(0.0, acc)}, win, one, one, one, nopad,
      [](ir::Builder& bb, const std::vector<Value>& a) { return std::vector<Value>{add(bb, a[0], a[1])}; })[0];
  // summed covers padded input positions [-p, ...): take [p, p + in).
  Shape st(x.rank(), 0), lim = summed.shape(), strd(x.rank(), 1);
  for (int i = 0; i < 2; ++i) {
    int64_t inn = x.shape()[lead + i];
    st[lead + i] = geo.p[i];
    lim[lead + i] = geo.p[i] + inn;
    if (lim[lead + i] > summed.shape()[lead + i]) {
      // Pad the tail when the windows did not reach the end of the input.
      Shape plo(x.rank(), 0), phi(x.rank(), 0), pin(x.rank(), 0);
      phi[lead + i] = lim[lead + i] - summed.shape()[lead + i];
      summed = b.pad(summed, b.constant(0.0, acc), plo, phi, pin);
    }
  }
  lim = summed.shape();
  for (int i = 0; i < 2; ++i) lim[lead + i] = st[lead + i] + x.shape()[lead + i];
  return std::vector<Value>{b.convert(b.slice(summed, st, lim, strd), x.dtype())};
});

// Averaging matrix [out, in] of adaptive pooling.
Value adaptiveMatrix(ir::Builder& b, int64_t out, int64_t in, DType t) {
  Type it{DType::I64, {out, in}};
  Value i = b.iota(it, 0), j = b.iota(it, 1);
  Value inn = b.constantInt(in, DType::I64, {out, in}), outn = b.constantInt(out, DType::I64, {out, in});
  Value start = b.binary("divide", mul(b, i, inn), outn);
  Value one = b.constantInt(1, DType::I64, {out, in});
  Value end = b.binary("divide", sub(b, add(b, mul(b, add(b, i, one), inn), outn), one), outn);
  Value m = b.binary("and", b.compare(j, start, ir::Cmp::GE), b.compare(j, end, ir::Cmp::LT));
  Value cnt = b.convert(sub(b, end, start), t);
  return div(b, b.convert(m, t), cnt);
}

// Applies the matrix m along dim d of v: contract = 1 maps v's dim of size
// m[1] to m[0] (forward), contract = 0 uses the transpose (backward).
Value applyAlong(ir::Builder& b, const Value& v, const Value& m, int64_t d, int64_t contract) {
  int rank = v.rank();
  Value t = b.dotGeneral(v, m, {}, {}, {d}, {contract}, v.dtype());  // d moved to the end
  std::vector<int64_t> perm;
  for (int i = 0; i < rank - 1; ++i) {
    if (i == d) perm.push_back(rank - 1);
    perm.push_back(i);
  }
  if (d == rank - 1) perm.push_back(rank - 1);
  return b.transpose(t, perm);
}

// Adaptive average pooling's backward over the trailing n dims, one averaging matrix a dim.
std::vector<Value> adaptiveAvgBackward(Ctx& c, int n) {
  Value x = c.tensor(1), g = c.tensor(0);
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  int r = x.rank();
  Value y = b.convert(g, acc);
  for (int i = 0; i < n; ++i) {
    int64_t d = r - n + i;
    y = applyAlong(b, y, adaptiveMatrix(b, g.shape()[d], x.shape()[d], acc), d, 0);
  }
  return {b.convert(y, x.dtype())};
}
Registrar reg_adaptive_avg_pool2d_backward("_adaptive_avg_pool2d_backward",
                                           [](Ctx& c) { return adaptiveAvgBackward(c, 2); });
Registrar reg_adaptive_avg_pool3d_backward("_adaptive_avg_pool3d_backward",
                                           [](Ctx& c) { return adaptiveAvgBackward(c, 3); });

// --------------------------------------------------------------- group norm

// native_group_norm(input, weight?, bias?, N, C, HxW, group, eps) -> (out, mean, rstd)
Registrar reg_native_group_norm("native_group_norm", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value x = c.tensor(0);
  int64_t n = c.i64(3), ch = c.i64(4), hw = c.i64(5), g = c.i64(6);
  double eps = c.f64(7);
  if (g <= 0 || ch % g != 0 || n * ch * hw != x.type.numel() || x.type.numel() == 0)
    throw ir::Unsupported("group_norm shapes");
  DType acc = accOf(x.dtype());
  int64_t d = ch / g * hw;
  Value xx = b.reshape(b.convert(x, acc), {n, g, d});
  Value mean = div(b, reduceSum(b, xx, {2}), b.constant(double(d), acc, {n, g}));
  Value xc = sub(b, xx, b.broadcastInDim(mean, {n, g, d}, {0, 1}));
  Value var = div(b, reduceSum(b, mul(b, xc, xc), {2}), b.constant(double(d), acc, {n, g}));
  Value rstd = b.unary("rsqrt", add(b, var, b.constant(eps, acc, {n, g})));
  Value y = b.reshape(mul(b, xc, b.broadcastInDim(rstd, {n, g, d}, {0, 1})), {n, ch, hw});
  if (auto w = c.optTensor(1)) y = mul(b, y, b.broadcastInDim(b.convert(*w, acc), {n, ch, hw}, {1}));
  if (auto bias = c.optTensor(2)) y = add(b, y, b.broadcastInDim(b.convert(*bias, acc), {n, ch, hw}, {1}));
  DType st = c.hasExpected() && c.expected().size() > 1 ? c.expectedAt(1).dtype : x.dtype();
  return std::vector<Value>{b.convert(b.reshape(y, x.shape()), x.dtype()), b.convert(mean, st), b.convert(rstd, st)};
});

// native_group_norm_backward(grad_out, input, mean, rstd, weight?, N, C, HxW, group, output_mask)
//   -> (grad_input, grad_weight, grad_bias)
Registrar reg_native_group_norm_backward("native_group_norm_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value dy = c.tensor(0), x = c.tensor(1), mean = c.tensor(2), rstd = c.tensor(3);
  auto w = c.optTensor(4);
  int64_t n = c.i64(5), ch = c.i64(6), hw = c.i64(7), g = c.i64(8);
  auto mask = c.arg(9).ints;
  if (g <= 0 || ch % g != 0 || n * ch * hw != x.type.numel() || x.type.numel() == 0)
    throw ir::Unsupported("group_norm backward shapes");
  DType acc = accOf(x.dtype());
  int64_t cg = ch / g, d = cg * hw;
  Shape s4{n, g, cg, hw};
  Value xx = b.reshape(b.convert(x, acc), s4), gy = b.reshape(b.convert(dy, acc), s4);
  Value m = b.broadcastInDim(b.convert(mean, acc), s4, {0, 1}), r = b.broadcastInDim(b.convert(rstd, acc), s4, {0, 1});
  Value xhat = mul(b, sub(b, xx, m), r);
  std::vector<Value> res(3);
  if (mask.empty() || mask[0]) {
    // dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)) over each group, gw = dy * weight.
    Value gw = w ? mul(b, gy, b.broadcastInDim(b.reshape(b.convert(*w, acc), {g, cg}), s4, {1, 2})) : gy;
    Value inv_d = b.constant(1.0 / double(d), acc, {n, g});
    Value m1 = b.broadcastInDim(mul(b, reduceSum(b, gw, {2, 3}), inv_d), s4, {0, 1});
    Value m2 = b.broadcastInDim(mul(b, reduceSum(b, mul(b, gw, xhat), {2, 3}), inv_d), s4, {0, 1});
    Value dx = mul(b, r, sub(b, sub(b, gw, m1), mul(b, xhat, m2)));
    res[0] = b.convert(b.reshape(dx, x.shape()), x.dtype());
  }
  DType wt = w ? w->dtype() : x.dtype();
  if (mask.size() > 1 && mask[1]) res[1] = b.convert(b.reshape(reduceSum(b, mul(b, gy, xhat), {0, 3}), {ch}), wt);
  if (mask.size() > 2 && mask[2]) res[2] = b.convert(b.reshape(reduceSum(b, gy, {0, 3}), {ch}), wt);
  return res;
});

// --------------------------------------------------------------- losses

// Per-sample pieces of nll_loss: the one-hot of the (valid) targets and each
// sample's weight (0 for ignore_index).
struct NllTargets {
  int64_t n, ncls;
  Value onehot, weight;
};
NllTargets nllTargets(Ctx& c, const Value& x, const Value& t, std::optional<Value> w, int64_t ignore, DType acc) {
  ir::Builder& b = c.b;
  NllTargets r;
  r.n = x.rank() == 2 ? x.shape()[0] : 1;
  r.ncls = x.shape()[x.rank() - 1];
  Value tt = b.reshape(b.convert(t, DType::I64), {r.n});
  Value valid = b.compare(tt, b.constantInt(ignore, DType::I64, {r.n}), ir::Cmp::NE);
  Value safe = b.select(valid, tt, b.constantInt(0, DType::I64, {r.n}));
  c.requireInRange(indicesInRange(b, safe, r.ncls, false));
  Shape nc{r.n, r.ncls};
  r.onehot = b.compare(b.iota({DType::I64, nc}, 1), b.broadcastInDim(safe, nc, {0}), ir::Cmp::EQ);
  r.weight = b.convert(valid, acc);
  if (w) {
    Value ww = b.broadcastInDim(b.convert(*w, acc), nc, {1});
    r.weight = mul(b, r.weight, reduceSum(b, b.select(r.onehot, ww, b.constant(0.0, acc, nc)), {1}));
  }
  return r;
}

// nll_loss_forward(self, target, weight?, reduction, ignore_index) -> (output, total_weight)
Registrar reg_nll_loss_forward("nll_loss_forward", [](Ctx& c) {
  Value x = c.tensor(0);
  int64_t reduction = c.i64(3);
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  NllTargets nt = nllTargets(c, x, c.tensor(1), c.optTensor(2), c.i64(4), acc);
  Value xx = b.reshape(b.convert(x, acc), {nt.n, nt.ncls});
  Value picked = reduceSum(b, b.select(nt.onehot, xx, b.constant(0.0, acc, {nt.n, nt.ncls})), {1});
  Value loss = b.unary("negate", mul(b, picked, nt.weight));
  Value total = reduceSum(b, nt.weight, {0});
  Value out;
  if (reduction == 0)
    out = x.rank() == 2 ? loss : b.reshape(loss, {});
  else if (reduction == 2)
    out = reduceSum(b, loss, {0});
  else
    out = div(b, reduceSum(b, loss, {0}), total);
  return std::vector<Value>{b.convert(out, x.dtype()), b.convert(total, x.dtype())};
});

// nll_loss_backward(grad, self, target, weight?, reduction, ignore_index, total_weight)
Registrar reg_nll_loss_backward("nll_loss_backward", [](Ctx& c) {
  Value g = c.tensor(0), x = c.tensor(1);
  int64_t reduction = c.i64(4);
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  NllTargets nt = nllTargets(c, x, c.tensor(2), c.optTensor(3), c.i64(5), acc);
  Value gg = b.convert(g, acc);
  Value gs;
  if (reduction == 0)
    gs = b.reshape(gg, {nt.n});
  else if (reduction == 2)
    gs = b.broadcastTo(b.reshape(gg, {}), {nt.n});
  else
    gs = b.broadcastTo(div(b, b.reshape(gg, {}), b.reshape(b.convert(c.tensor(6), acc), {})), {nt.n});
  Value per = b.unary("negate", mul(b, gs, nt.weight));
  Value r = b.select(nt.onehot, b.broadcastInDim(per, {nt.n, nt.ncls}, {0}), b.constant(0.0, acc, {nt.n, nt.ncls}));
  return std::vector<Value>{b.convert(b.reshape(r, x.shape()), x.dtype())};
});

Registrar reg_mse_loss("mse_loss", [](Ctx& c) {
  Value x = c.tensor(0), t = c.tensor(1);
  int64_t reduction = c.i64Or(2, 1);
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  auto vs = broadcastAll(b, {b.convert(x, acc), b.convert(t, acc)});
  Value d = sub(b, vs[0], vs[1]);
  Value sq = mul(b, d, d);
  std::vector<int64_t> all;
  for (int i = 0; i < sq.rank(); ++i) all.push_back(i);
  Value out = sq;
  if (reduction == 1) out = div(b, reduceSum(b, sq, all), b.constant(static_cast<double>(sq.type.numel()), acc));
  if (reduction == 2) out = reduceSum(b, sq, all);
  return std::vector<Value>{b.convert(out, x.dtype())};
});
Registrar reg_mse_loss_backward("mse_loss_backward", [](Ctx& c) {
  Value g = c.tensor(0), x = c.tensor(1), t = c.tensor(2);
  int64_t reduction = c.i64(3);
  ir::Builder& b = c.b;
  DType acc = accOf(x.dtype());
  auto vs = broadcastAll(b, {b.convert(x, acc), b.convert(t, acc)});
  Value d = mul(b, b.constant(2.0, acc, vs[0].shape()), sub(b, vs[0], vs[1]));
  Value gg = b.broadcastTo(b.convert(g, acc), d.shape());
  Value r = mul(b, d, gg);
  if (reduction == 1) r = div(b, r, b.constant(static_cast<double>(d.type.numel()), acc, d.shape()));
  return std::vector<Value>{b.convert(r, x.dtype())};
});

// Weight normalisation (nn.utils.weight_norm, parametrizations.weight_norm):
// w = v * g / ||v||, the 2-norm over every dim but `dim` (0 or the last; the
// composite _weight_norm decomposes the others). Returns (w, norms), norms
// shaped like g (keepdim), in float32 for half inputs like the CPU kernel.
std::vector<int64_t> allDimsBut(int rank, int64_t dim) {
  std::vector<int64_t> dims;
  for (int i = 0; i < rank; ++i)
    if (i != dim) dims.push_back(i);
  return dims;
}
Registrar reg_weight_norm_interface("_weight_norm_interface", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value v = c.tensor(0), g = c.tensor(1);
  int64_t dim = wrapDim(c.i64Or(2, 0), v.rank());
  DType acc = accOf(v.dtype());
  std::vector<int64_t> red = allDimsBut(v.rank(), dim);
  Value vf = b.convert(v, acc);
  Value norm = keepDims(b, b.unary("sqrt", reduceSum(b, mul(b, vf, vf), red)), v.shape(), red);
  Value scale = div(b, b.convert(b.reshape(g, norm.shape()), acc), norm);
  Value w = mul(b, vf, b.broadcastTo(scale, v.shape()));
  DType norm_t = c.hasExpected() ? c.expectedAt(1).dtype : acc;
  return std::vector<Value>{b.convert(w, v.dtype()), b.convert(norm, norm_t)};
});
// grad_g = sum(grad_w * v) / norm over the reduced dims;
// grad_v = g / norm * (grad_w - v * grad_g / norm).
Registrar reg_weight_norm_interface_backward("_weight_norm_interface_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value gw = c.tensor(0), v = c.tensor(1), g = c.tensor(2), norm = c.tensor(3);
  int64_t dim = wrapDim(c.i64(4), v.rank());
  DType acc = accOf(v.dtype());
  std::vector<int64_t> red = allDimsBut(v.rank(), dim);
  Value vf = b.convert(v, acc), gwf = b.convert(gw, acc);
  Value dot = keepDims(b, reduceSum(b, mul(b, gwf, vf), red), v.shape(), red);
  Value n = b.convert(b.reshape(norm, dot.shape()), acc);  // keepdim shapes from here
  Value grad_g = div(b, dot, n);
  Value nb = b.broadcastTo(n, v.shape());
  Value gb = b.broadcastTo(b.convert(b.reshape(g, dot.shape()), acc), v.shape());
  Value inner = sub(b, gwf, div(b, mul(b, vf, b.broadcastTo(grad_g, v.shape())), nb));
  Value grad_v = mul(b, div(b, gb, nb), inner);
  grad_g = b.reshape(grad_g, g.shape());
  return std::vector<Value>{b.convert(grad_v, v.dtype()), b.convert(grad_g, g.dtype())};
});

}  // namespace
}  // namespace tpu::ops
