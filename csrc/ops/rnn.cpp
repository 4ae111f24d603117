// Fused recurrent cells. PyTorch's LSTM/GRU (nn.LSTM, nn.LSTMCell, nn.GRU,
// nn.GRUCell) call these on every device but the CPU, once per time step; the
// CPU has no kernel for them, so they cannot fall back and must be lowered.
// The workspace results carry the activated gates the backward reads, laid out
// as CUDA's kernels lay them out (LSTM: i, f, g, o; GRU: r, z, n, hx, hn).
#include <stdexcept>
#include <string>

#include "ops/common.h"

namespace tpu::ops {
namespace {

// Columns [k * h, (k + 1) * h) of a [batch, n * h] matrix.
Value chunk(ir::Builder& b, const Value& v, int64_t k, int64_t h) {
  return b.slice(v, {0, k * h}, {v.shape()[0], (k + 1) * h}, {1, 1});
}

Value sigmoid(ir::Builder& b, const Value& v) { return b.unary("logistic", v); }
Value tanhOf(ir::Builder& b, const Value& v) { return b.unary("tanh", v); }
Value oneMinus(ir::Builder& b, const Value& v) { return sub(b, full(b, 1.0, v), v); }

// gates + bias (a [n * h] vector broadcast over the batch), when present.
Value withBias(ir::Builder& b, const Value& gates, const std::optional<Value>& bias) {
  if (!bias) return gates;
  return add(b, gates, b.broadcastInDim(b.convert(*bias, gates.dtype()), gates.shape(), {1}));
}

// The size rules of the CUDA kernels (PyTorch's meta kernel for these ops
// cannot be used: it fails on absent biases). Bad sizes raise RuntimeError.
void checkCellSizes(const Ctx& c, const Value& ig, const Value& hg, const Value& prev, int64_t factor) {
  auto fail = [&](const std::string& why) { throw std::invalid_argument(c.op() + ": " + why); };
  if (ig.rank() != 2 || ig.shape() != hg.shape())
    fail("input and hidden gates must be 2-d and of one shape, got " + ir::shapeStr(ig.shape()) + " and " +
         ir::shapeStr(hg.shape()));
  int64_t gates = ig.shape()[1];
  for (size_t k : {3, 4}) {
    auto bias = c.optTensor(k);
    if (bias && (bias->rank() != 1 || bias->shape()[0] != gates))
      fail("a bias of shape " + ir::shapeStr(bias->shape()) + " for " + std::to_string(gates) + " gates");
  }
  if (prev.rank() != 2 || prev.shape()[0] != ig.shape()[0] || prev.shape()[1] * factor != gates)
    fail("the previous state " + ir::shapeStr(prev.shape()) + " does not match gates " + ir::shapeStr(ig.shape()));
}

// _thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias?, hidden_bias?)
//   -> (hy, cy, workspace = activated [i, f, g, o])
Registrar reg_lstm_cell("_thnn_fused_lstm_cell", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value ig = c.tensor(0), hg = c.tensor(1), cx = c.tensor(2);
  checkCellSizes(c, ig, hg, cx, 4);
  DType t = ig.dtype(), acc = accOf(t);
  Value gates = add(b, b.convert(ig, acc), b.convert(hg, acc));
  gates = withBias(b, withBias(b, gates, c.optTensor(3)), c.optTensor(4));
  int64_t h = cx.shape()[1];
  Value i = sigmoid(b, chunk(b, gates, 0, h)), f = sigmoid(b, chunk(b, gates, 1, h));
  Value g = tanhOf(b, chunk(b, gates, 2, h)), o = sigmoid(b, chunk(b, gates, 3, h));
  Value cy = add(b, mul(b, f, b.convert(cx, acc)), mul(b, i, g));
  Value hy = mul(b, o, tanhOf(b, cy));
  Value workspace = b.concatenate({i, f, g, o}, 1);
  return std::vector<Value>{b.convert(hy, t), b.convert(cy, t), b.convert(workspace, t)};
});

// _thnn_fused_lstm_cell_backward_impl(grad_hy?, grad_cy?, cx, cy, workspace, has_bias)
//   -> (grad_gates, grad_cx, grad_bias)
Registrar reg_lstm_cell_backward("_thnn_fused_lstm_cell_backward_impl", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value cx = c.tensor(2), cy = c.tensor(3), ws = c.tensor(4);
  bool has_bias = c.flag(5);
  DType t = ws.dtype(), acc = accOf(t);
  int64_t h = cx.shape()[1];
  Value cxf = b.convert(cx, acc), wsf = b.convert(ws, acc);
  Value zero = b.constant(0.0, acc, cx.shape());
  auto grad = [&](size_t k) { return c.has(k) ? b.convert(c.tensor(k), acc) : zero; };
  Value ghy = grad(0), gcy = grad(1);
  Value i = chunk(b, wsf, 0, h), f = chunk(b, wsf, 1, h), g = chunk(b, wsf, 2, h), o = chunk(b, wsf, 3, h);
  Value tcy = tanhOf(b, b.convert(cy, acc));
  // d(loss)/d(cy) through hy = o * tanh(cy), plus the gradient reaching cy directly.
  Value dcy = add(b, mul(b, mul(b, ghy, o), oneMinus(b, mul(b, tcy, tcy))), gcy);
  Value di = mul(b, mul(b, dcy, g), mul(b, i, oneMinus(b, i)));
  Value df = mul(b, mul(b, dcy, cxf), mul(b, f, oneMinus(b, f)));
  Value dg = mul(b, mul(b, dcy, i), oneMinus(b, mul(b, g, g)));
  Value d_o = mul(b, mul(b, ghy, tcy), mul(b, o, oneMinus(b, o)));
  Value dgates = b.concatenate({di, df, dg, d_o}, 1);
  Value dcx = mul(b, dcy, f);
  Value dbias = has_bias ? b.convert(reduceSum(b, dgates, {0}), t) : Value();
  return std::vector<Value>{b.convert(dgates, t), b.convert(dcx, t), dbias};
});

// _thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias?, hidden_bias?)
//   -> (hy, workspace = [r, z, n, hx, hn]); hn is the hidden n-gate with its bias.
Registrar reg_gru_cell("_thnn_fused_gru_cell", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value ig = c.tensor(0), hg = c.tensor(1), hx = c.tensor(2);
  checkCellSizes(c, ig, hg, hx, 3);
  DType t = ig.dtype(), acc = accOf(t);
  Value igb = withBias(b, b.convert(ig, acc), c.optTensor(3));
  Value hgb = withBias(b, b.convert(hg, acc), c.optTensor(4));
  int64_t h = hx.shape()[1];
  Value r = sigmoid(b, add(b, chunk(b, igb, 0, h), chunk(b, hgb, 0, h)));
  Value z = sigmoid(b, add(b, chunk(b, igb, 1, h), chunk(b, hgb, 1, h)));
  Value hn = chunk(b, hgb, 2, h);
  Value n = tanhOf(b, add(b, chunk(b, igb, 2, h), mul(b, r, hn)));
  Value hxf = b.convert(hx, acc);
  Value hy = add(b, mul(b, oneMinus(b, z), n), mul(b, z, hxf));
  Value workspace = b.concatenate({r, z, n, hxf, hn}, 1);
  return std::vector<Value>{b.convert(hy, t), b.convert(workspace, t)};
});

// _thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias)
//   -> (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)
Registrar reg_gru_cell_backward("_thnn_fused_gru_cell_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Value ghy = c.tensor(0), ws = c.tensor(1);
  bool has_bias = c.flag(2);
  DType t = ws.dtype(), acc = accOf(t);
  int64_t h = ghy.shape()[1];
  Value g = b.convert(ghy, acc), wsf = b.convert(ws, acc);
  Value r = chunk(b, wsf, 0, h), z = chunk(b, wsf, 1, h), n = chunk(b, wsf, 2, h);
  Value hx = chunk(b, wsf, 3, h), hn = chunk(b, wsf, 4, h);
  Value dhx_direct = mul(b, g, z);
  Value dn = mul(b, mul(b, g, oneMinus(b, z)), oneMinus(b, mul(b, n, n)));  // before tanh
  Value dz = mul(b, mul(b, g, sub(b, hx, n)), mul(b, z, oneMinus(b, z)));
  Value dr = mul(b, mul(b, dn, hn), mul(b, r, oneMinus(b, r)));
  Value d_input = b.concatenate({dr, dz, dn}, 1);
  Value d_hidden = b.concatenate({dr, dz, mul(b, dn, r)}, 1);
  std::vector<Value> res{b.convert(d_input, t), b.convert(d_hidden, t), b.convert(dhx_direct, t), Value(), Value()};
  if (has_bias) {
    res[3] = b.convert(reduceSum(b, d_input, {0}), t);
    res[4] = b.convert(reduceSum(b, d_hidden, {0}), t);
  }
  return res;
});

}  // namespace
}  // namespace tpu::ops
