// Scaled dot-product attention as one op (forward and backward), so that
// F.scaled_dot_product_attention is a single dispatch in eager modes and a
// single node in compiled graphs instead of PyTorch's math decomposition
// (matmuls, a materialised causal mask, softmax and their backward ops).
// The tpu device reports the "flash" choice to PyTorch (aten/attention.cpp);
// these are the ops that choice calls. The causal mask is computed in the
// program and the backward reuses the forward's logsumexp, as flash
// attention does; the math stays the plain O(L*S) formulation. A plugin with
// its own attention kernel fills the attention slots (ops/kernel_slots.h).
#include <cmath>

#include "ops/common.h"
#include "ops/kernel_slots.h"

namespace tpu::ops {

std::optional<int64_t> attentionRowStride(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  if (sizes.size() != 4 || strides.size() != 4 || sizes[1] < 2) return std::nullopt;
  const int64_t H = sizes[2], E = sizes[3], row = strides[1];
  const bool whole =
      strides[3] == 1 && (H == 1 || strides[2] == E) && row >= H * E && (sizes[0] == 1 || strides[0] == sizes[1] * row);
  return whole ? std::optional<int64_t>(row) : std::nullopt;
}

namespace {

using Attention = AttentionArgs;

Attention readAttention(Ctx& c, size_t q, size_t dropout, size_t causal, size_t mask, size_t scale) {
  Attention a;
  Value qq = c.tensor(q), kk = c.tensor(q + 1), vv = c.tensor(q + 2);
  if (qq.rank() != 4 || kk.rank() != 4 || vv.rank() != 4) throw ir::Unsupported("attention on non-4-d inputs");
  if (c.f64Or(dropout, 0.0) != 0.0) throw ir::Unsupported("attention with dropout");
  if (c.has(mask)) throw ir::Unsupported("attention with an explicit mask");
  if (qq.shape()[0] != kk.shape()[0] || qq.shape()[1] != kk.shape()[1] || kk.shape()[2] != vv.shape()[2] ||
      kk.shape()[0] != vv.shape()[0] || kk.shape()[1] != vv.shape()[1] || qq.shape()[3] != kk.shape()[3])
    throw ir::Unsupported("attention with mismatched shapes");
  a.in = qq.dtype();
  a.acc = accOf(floatOf(a.in));
  a.q = c.b.convert(qq, a.acc);
  a.k = c.b.convert(kk, a.acc);
  a.v = c.b.convert(vv, a.acc);
  a.scale = c.has(scale) ? c.f64(scale) : 1.0 / std::sqrt(static_cast<double>(qq.shape()[3]));
  a.causal = c.flagOr(causal, false);
  return a;
}

// scale * q k^T with the causal mask (key j visible from query i when
// j <= i, PyTorch's top-left alignment) as -inf: [B, H, L, S].
Value scores(ir::Builder& b, const Attention& a) {
  Value s = b.dotGeneral(a.q, a.k, {0, 1}, {0, 1}, {3}, {3}, a.acc);
  s = mul(b, s, full(b, a.scale, s));
  if (!a.causal) return s;
  int64_t L = s.shape()[2], S = s.shape()[3];
  Type grid{DType::I64, {L, S}};
  Value visible = b.compare(b.iota(grid, 1), b.iota(grid, 0), ir::Cmp::LE);
  visible = b.broadcastInDim(visible, s.shape(), {2, 3});
  return b.select(visible, s, extremeConst(b, a.acc, true, s.shape()));
}

Value rowsLike(ir::Builder& b, const Value& rows, const Shape& s) { return b.broadcastInDim(rows, s, {0, 1, 2}); }

// The probabilities (and their gradients) enter the second product rounded to
// the input type, as PyTorch's CPU flash kernel feeds its bf16/fp16 GEMMs;
// sums and the softmax statistics stay in float32.
Value asGemmInput(ir::Builder& b, const Attention& a, const Value& x) {
  return a.in == a.acc ? x : b.convert(b.convert(x, a.in), a.acc);
}

// _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
// *, attn_mask?, scale?) -> (output, logsumexp [B, H, L] float)
Registrar reg_attention("_scaled_dot_product_flash_attention_for_cpu", [](Ctx& c) {
  ir::Builder& b = c.b;
  Attention a = readAttention(c, 0, 3, 4, 5, 6);
  if (auto r = kernelSlots().attention(b, a)) return *r;
  Value s = scores(b, a);
  Value m = reduceMax(b, s, {3});
  m = b.select(b.unary("is_finite", m), m, b.zeros(m.type));  // a row with every key masked
  Value p = b.unary("exponential", sub(b, s, rowsLike(b, m, s.shape())));
  Value l = reduceSum(b, p, {3});
  Value o = b.dotGeneral(asGemmInput(b, a, p), a.v, {0, 1}, {0, 1}, {3}, {2}, a.acc);
  o = div(b, o, rowsLike(b, l, o.shape()));
  Value lse = add(b, m, b.unary("log", l));
  DType lse_t = c.hasExpected() && c.expected().size() > 1 ? c.expectedAt(1).dtype : DType::F32;
  return std::vector<Value>{b.convert(o, a.in), b.convert(lse, lse_t)};
});

// _scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out,
// logsumexp, dropout_p, is_causal, *, attn_mask?, scale?) -> (dq, dk, dv)
Registrar reg_attention_backward("_scaled_dot_product_flash_attention_for_cpu_backward", [](Ctx& c) {
  ir::Builder& b = c.b;
  Attention a = readAttention(c, 1, 6, 7, 8, 9);
  Value dout = b.convert(c.tensor(0), a.acc);
  Value out = b.convert(c.tensor(4), a.acc);
  Value lse = b.convert(c.tensor(5), a.acc);
  if (auto r = kernelSlots().attentionBackward(b, a, dout, out, lse)) return *r;
  Value s = scores(b, a);
  Value p = b.unary("exponential", sub(b, s, rowsLike(b, lse, s.shape())));  // masked keys: exp(-inf) = 0
  Value dv = b.dotGeneral(asGemmInput(b, a, p), dout, {0, 1}, {0, 1}, {2}, {2}, a.acc);
  Value dp = b.dotGeneral(dout, a.v, {0, 1}, {0, 1}, {3}, {3}, a.acc);
  Value delta = reduceSum(b, mul(b, dout, out), {3});  // sum_j p_ij dp_ij
  Value ds = asGemmInput(b, a, mul(b, p, sub(b, dp, rowsLike(b, delta, dp.shape()))));
  Value dq = b.dotGeneral(ds, a.k, {0, 1}, {0, 1}, {3}, {2}, a.acc);
  Value dk = b.dotGeneral(ds, a.q, {0, 1}, {0, 1}, {2}, {2}, a.acc);
  dq = mul(b, dq, full(b, a.scale, dq));
  dk = mul(b, dk, full(b, a.scale, dk));
  return std::vector<Value>{b.convert(dq, a.in), b.convert(dk, a.in), b.convert(dv, a.in)};
});

}  // namespace
}  // namespace tpu::ops
