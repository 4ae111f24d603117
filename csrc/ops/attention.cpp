// Scaled dot-product attention as one op (forward and backward), so that
// F.scaled_dot_product_attention is a single dispatch in eager modes and a
// single node in compiled graphs instead of PyTorch's math decomposition
// (matmuls, a materialised causal mask, softmax and their backward ops).
// The tpu device reports the "flash" choice to PyTorch (aten/attention.cpp);
// these are the ops that choice calls. The causal mask is computed in the
// program and the backward reuses the forward's logsumexp, as flash
// attention does; the math stays the plain O(L*S) formulation. On the CPU
// plugin float32 calls the runtime's kernels instead (plugins/cpu/host_kernels.h).
#include <array>
#include <cmath>

#include "ops/common.h"
#include "plugins/cpu/custom_calls.h"

namespace tpu::ops {

// The forward kernel measured 1.2-2.5x faster than XLA:CPU's form at head
// widths 16, 32 and 64. The backward one, since its products are register
// tiles, wins up to width 64 too (forward + backward of [4, 8, 128, 128 x 64]:
// 5.5 ms against 6.9 ms with XLA's backward) and ties at 128, so wider heads
// keep the StableHLO backward (it reads the kernel's output and logsumexp alike).
bool attentionOnHostKernels(int64_t E, int64_t Ev, bool backward) {
  return pluginKernel(plugins::cpu::kAttentionForward) && Ev == E && (!backward || E <= 64);
}

std::optional<int64_t> attentionRowStride(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  if (sizes.size() != 4 || strides.size() != 4 || sizes[1] < 2) return std::nullopt;
  const int64_t H = sizes[2], E = sizes[3], row = strides[1];
  const bool whole =
      strides[3] == 1 && (H == 1 || strides[2] == E) && row >= H * E && (sizes[0] == 1 || strides[0] == sizes[1] * row);
  return whole ? std::optional<int64_t>(row) : std::nullopt;
}

namespace {

struct Attention {
  Value q, k, v;  // [B, H, L, E], [B, H, S, E], [B, H, S, Ev] in the compute type
  DType in = DType::F32, acc = DType::F32;
  double scale = 1.0;
  bool causal = false;
};

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

// float32 attention on the CPU plugin runs as the runtime's host kernels
// (attentionOnHostKernels).
bool useHostKernel(const Attention& a, bool backward) {
  return a.in == DType::F32 && attentionOnHostKernels(a.q.shape()[3], a.v.shape()[3], backward);
}

// [B, H, L, E] <-> the kernels' sequence-major [B, L, H, E] (the permutation
// is its own inverse).
Value seqMajor(ir::Builder& b, const Value& x) { return b.transpose(x, {0, 2, 1, 3}); }

// A q, k or v operand of the kernels: the buffer read, and where the
// [B, L, H, E] tensor lies in it (plugins/cpu/host_kernels.h, the layout operand).
struct KernelInput {
  Value buffer;
  int64_t offset = 0, row = 0;
};

// x, sequence-major [B, L, H, E]: the storage it is a view of where the
// kernel can read it in place (attentionRowStride), instead of XLA copying it
// out; else x itself.
KernelInput kernelInput(ir::Builder& b, const Value& x) {
  if (auto v = b.viewOf(x); v && v->base.dtype() == DType::F32)
    if (auto row = attentionRowStride(x.shape(), v->strides)) return {v->base, v->offset, *row};
  return {x, 0, x.shape()[2] * x.shape()[3]};
}

using QkvInputs = std::array<KernelInput, 3>;
QkvInputs kernelInputs(ir::Builder& b, const Value& q, const Value& k, const Value& v) {
  return {kernelInput(b, q), kernelInput(b, k), kernelInput(b, v)};
}

// The kernels' q, k, v and layout operands; S is the keys' length.
std::vector<Value> kernelOperands(ir::Builder& b, const QkvInputs& in, int64_t S) {
  Value layout =
      b.constantInts({S, in[0].offset, in[0].row, in[1].offset, in[1].row, in[2].offset, in[2].row}, DType::I64);
  return {in[0].buffer, in[1].buffer, in[2].buffer, layout};
}

// Where sequence-major q, k and v (self-attention) are the three thirds of
// each row of one buffer, as a fused qkv projection leaves them: the row
// width (3 H E) and each one's offset in it; nullopt otherwise.
struct PackedQkv {
  int64_t row = 0, offset[3] = {0, 0, 0};
};
std::optional<PackedQkv> packedQkv(const QkvInputs& in, const Value& q, const Value& k, const Value& v) {
  const int64_t n = q.shape()[2] * q.shape()[3], row = 3 * n;
  if (q.shape() != k.shape() || q.shape() != v.shape()) return std::nullopt;
  PackedQkv p;
  p.row = row;
  int64_t seen = 0;
  for (int i = 0; i < 3; ++i) {
    if (in[i].buffer.id != in[0].buffer.id || in[i].row != row || in[i].offset % n || in[i].offset / n > 2)
      return std::nullopt;
    p.offset[i] = in[i].offset;
    seen |= int64_t{1} << (in[i].offset / n);
  }
  if (seen != 7 || in[0].buffer.type.numel() != q.shape()[0] * q.shape()[1] * row) return std::nullopt;
  return p;
}

// The kernel's trailing operands: the scale and the causal flag.
std::vector<Value> withFlags(ir::Builder& b, const Attention& a, std::vector<Value> operands) {
  operands.push_back(b.constant(a.scale, DType::F32));
  operands.push_back(b.constantInt(a.causal ? 1 : 0, DType::I32));
  return operands;
}

// _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
// *, attn_mask?, scale?) -> (output, logsumexp [B, H, L] float)
Registrar reg_attention("_scaled_dot_product_flash_attention_for_cpu", [](Ctx& c) {
  ir::Builder& b = c.b;
  Attention a = readAttention(c, 0, 3, 4, 5, 6);
  if (useHostKernel(a, false)) {
    Shape lse_shape(a.q.shape().begin(), a.q.shape().end() - 1);
    Value q = seqMajor(b, a.q);
    auto r = b.customCall(
        plugins::cpu::kAttentionForward,
        withFlags(b, a, kernelOperands(b, kernelInputs(b, q, seqMajor(b, a.k), seqMajor(b, a.v)), a.k.shape()[2])),
        {q.type, Type{DType::F32, lse_shape}});
    return std::vector<Value>{seqMajor(b, r[0]), r[1]};
  }
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
  if (useHostKernel(a, true)) {
    Value q = seqMajor(b, a.q), k = seqMajor(b, a.k), v = seqMajor(b, a.v);
    const QkvInputs ins = kernelInputs(b, q, k, v);
    const std::vector<Value> in = kernelOperands(b, ins, k.shape()[1]);
    const std::vector<Value> operands =
        withFlags(b, a, {seqMajor(b, dout), in[0], in[1], in[2], seqMajor(b, out), lse, in[3]});
    // In a program of several ops, gradients of a packed q, k and v come out
    // packed the same way: the projection's backward concatenates them, and
    // XLA folds that concatenation of the result's slices into the result
    // itself (a 786 KB copy per layer of the benchmark GPT). A one-op program
    // keeps three results, as the slices would each be copied out.
    if (auto packed = inMultiOpProgram() ? packedQkv(ins, q, k, v) : std::nullopt) {
      const int64_t B = q.shape()[0], L = q.shape()[1], n = q.shape()[2] * q.shape()[3];
      Value g = b.reshape(b.customCall(plugins::cpu::kAttentionBackward, operands, {ins[0].buffer.type})[0],
                          {B, L, packed->row});
      std::vector<Value> grads;
      for (int i = 0; i < 3; ++i) {
        Value s = b.slice(g, {0, 0, packed->offset[i]}, {B, L, packed->offset[i] + n}, {1, 1, 1});
        grads.push_back(seqMajor(b, b.reshape(s, q.shape())));
      }
      return grads;
    }
    auto r = b.customCall(plugins::cpu::kAttentionBackward, operands, {q.type, k.type, v.type});
    return std::vector<Value>{seqMajor(b, r[0]), seqMajor(b, r[1]), seqMajor(b, r[2])};
  }
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
