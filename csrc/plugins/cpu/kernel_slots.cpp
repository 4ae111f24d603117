// The CPU plugin's kernel slots (ops/kernel_slots.h): attention, layer norm,
// softmax and float32 matrix products as custom calls of its host kernels
// (custom_calls.h gives each call's operands, host_kernels.h the kernels).
// Each slot takes only the arguments its kernel handles and leaves the rest
// to the portable StableHLO lowering. No torch headers here.
#include "ops/kernel_slots.h"

#include <array>
#include <limits>

#include "ops/lowering.h"
#include "plugins/cpu/cpu_plugin.h"
#include "plugins/cpu/custom_calls.h"

namespace tpu::plugins::cpu {
namespace {

using ir::DType;
using ir::Shape;
using ir::Type;
using ir::Value;
using ops::AttentionArgs;

// ------------------------------------------------------------------ attention

// [B, H, L, E] <-> the kernels' sequence-major [B, L, H, E] (the permutation
// is its own inverse).
Value seqMajor(ir::Builder& b, const Value& x) { return b.transpose(x, {0, 2, 1, 3}); }

// A q, k or v operand of the kernels: the buffer read, and where the
// [B, L, H, E] tensor lies in it (custom_calls.h, the layout operand).
struct KernelInput {
  Value buffer;
  int64_t offset = 0, row = 0;
};

// x, sequence-major [B, L, H, E]: the storage it is a view of where the
// kernel can read it in place (attentionRowStride), instead of XLA copying it
// out; else x itself.
KernelInput kernelInput(ir::Builder& b, const Value& x) {
  if (auto v = b.viewOf(x); v && v->base.dtype() == DType::F32)
    if (auto row = ops::attentionRowStride(x.shape(), v->strides)) return {v->base, v->offset, *row};
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
std::vector<Value> withFlags(ir::Builder& b, const AttentionArgs& a, std::vector<Value> operands) {
  operands.push_back(b.constant(a.scale, DType::F32));
  operands.push_back(b.constantInt(a.causal ? 1 : 0, DType::I32));
  return operands;
}

// The forward kernel measured 1.2-2.5x faster than XLA:CPU's form at head
// widths 16, 32 and 64. The backward one, since its products are register
// tiles, wins up to width 64 too (forward + backward of [4, 8, 128, 128 x 64]:
// 5.5 ms against 6.9 ms with XLA's backward) and ties at 128, so wider heads
// keep the StableHLO backward (it reads the kernel's output and logsumexp alike).
bool attentionWidths(int64_t E, int64_t Ev, bool backward) { return Ev == E && (!backward || E <= 64); }

bool takesAttention(const AttentionArgs& a, bool backward) {
  return a.in == DType::F32 && attentionWidths(a.q.shape()[3], a.v.shape()[3], backward);
}

std::vector<Value> emitAttention(ir::Builder& b, const AttentionArgs& a) {
  Shape lse_shape(a.q.shape().begin(), a.q.shape().end() - 1);
  Value q = seqMajor(b, a.q);
  auto r = b.customCall(
      kAttentionForward,
      withFlags(b, a, kernelOperands(b, kernelInputs(b, q, seqMajor(b, a.k), seqMajor(b, a.v)), a.k.shape()[2])),
      {q.type, Type{DType::F32, lse_shape}});
  return {seqMajor(b, r[0]), r[1]};
}

std::vector<Value> emitAttentionBackward(ir::Builder& b, const AttentionArgs& a, const Value& dout, const Value& out,
                                         const Value& lse) {
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
  if (auto packed = ops::inMultiOpProgram() ? packedQkv(ins, q, k, v) : std::nullopt) {
    const int64_t B = q.shape()[0], L = q.shape()[1], n = q.shape()[2] * q.shape()[3];
    Value g = b.reshape(b.customCall(kAttentionBackward, operands, {ins[0].buffer.type})[0], {B, L, packed->row});
    std::vector<Value> grads;
    for (int i = 0; i < 3; ++i) {
      Value s = b.slice(g, {0, 0, packed->offset[i]}, {B, L, packed->offset[i] + n}, {1, 1, 1});
      grads.push_back(seqMajor(b, b.reshape(s, q.shape())));
    }
    return grads;
  }
  auto r = b.customCall(kAttentionBackward, operands, {q.type, k.type, v.type});
  return {seqMajor(b, r[0]), seqMajor(b, r[1]), seqMajor(b, r[2])};
}

// ------------------------------------------------------------------ matrix products

// Products of at least this many multiply-adds go to the GEMM kernel;
// smaller ones stay XLA dots, which XLA can fuse and which cost no call.
constexpr int64_t kHostGemmMinWork = 32768;

// x [M, K] @ y [K, N] as the GEMM kernel: an operand that is a transpose is
// passed untransposed with its flag, so the transpose is left dead instead of
// copied. `terms`: none, or bias [N], alpha and beta (see kGemm).
std::optional<Value> gemm(ir::Builder& b, const Value& x, const Value& y, const std::vector<Value>& terms = {}) {
  if (x.dtype() != DType::F32 || y.dtype() != DType::F32) return std::nullopt;
  const int64_t M = x.shape()[0], K = x.shape()[1], N = y.shape()[1];
  constexpr int64_t kInt = std::numeric_limits<int>::max();  // the BLAS takes 32-bit sizes
  if (M * N * K < kHostGemmMinWork || M * K > kInt || K * N > kInt || M * N > kInt) return std::nullopt;
  Value a = x, bb = y;
  int32_t flags = 0;
  if (auto src = b.transposeSource(x)) {
    a = *src;
    flags |= 1;
  }
  if (auto src = b.transposeSource(y)) {
    bb = *src;
    flags |= 2;
  }
  std::vector<Value> operands{a, bb, b.constantInt(flags, DType::I32)};
  operands.insert(operands.end(), terms.begin(), terms.end());
  return b.customCall(kGemm, operands, {Type{DType::F32, {M, N}}})[0];
}

// ------------------------------------------------------------------ the slots

class CpuKernelSlots final : public ops::KernelSlots {
 public:
  explicit CpuKernelSlots(bool gemm) : gemm_(gemm) {}

  bool fills(ops::KernelSlot slot) const override { return slot != ops::KernelSlot::Matmul || gemm_; }

  std::optional<std::vector<Value>> attention(ir::Builder& b, const AttentionArgs& a) const override {
    if (!takesAttention(a, false)) return std::nullopt;
    return emitAttention(b, a);
  }
  std::optional<std::vector<Value>> attentionBackward(ir::Builder& b, const AttentionArgs& a, const Value& dout,
                                                      const Value& out, const Value& lse) const override {
    if (!takesAttention(a, true)) return std::nullopt;
    return emitAttentionBackward(b, a, dout, out, lse);
  }
  bool attentionReadsViews(int64_t E, int64_t Ev, bool backward) const override {
    return attentionWidths(E, Ev, backward);
  }

  // XLA:CPU splits each row reduction into two unvectorized kernels, and its
  // layer norm forward and backward took 6-8 kernels each.
  std::optional<std::vector<Value>> layerNorm(ir::Builder& b, const ops::LayerNormArgs& a) const override {
    if (!takesLayerNorm(a)) return std::nullopt;
    const int64_t n = a.n, m = a.x.type.numel() / n;
    Value w = a.w ? b.reshape(*a.w, {n}) : b.constant(1.0, DType::F32, {n});
    Value bias = a.bias ? b.reshape(*a.bias, {n}) : b.constant(0.0, DType::F32, {n});
    return b.customCall(kLayerNormForward, {b.reshape(a.x, {m, n}), w, bias, b.constant(a.eps, DType::F32)},
                        {Type{DType::F32, {m, n}}, Type{DType::F32, {m}}, Type{DType::F32, {m}}});
  }
  std::optional<std::vector<Value>> layerNormBackward(ir::Builder& b, const ops::LayerNormArgs& a, const Value& dy,
                                                      const Value& mean, const Value& rstd) const override {
    if (!takesLayerNorm(a) || dy.dtype() != DType::F32 || mean.dtype() != DType::F32 || rstd.dtype() != DType::F32)
      return std::nullopt;
    const int64_t n = a.n, m = a.x.type.numel() / n;
    Value w = a.w ? b.reshape(*a.w, {n}) : b.constant(1.0, DType::F32, {n});
    return b.customCall(kLayerNormBackward,
                        {b.reshape(dy, {m, n}), b.reshape(a.x, {m, n}), b.reshape(mean, {m}), b.reshape(rstd, {m}), w},
                        {Type{DType::F32, {m, n}}, Type{DType::F32, {n}}, Type{DType::F32, {n}}});
  }

  // XLA:CPU runs the max and sum-of-exp reductions as separate
  // single-threaded kernels: a language model's loss, the cross-entropy
  // forward over [4096, 8192] logits, took 63 ms, 41 with the row kernel. The
  // kernel computes the portable lowering's formula, in float32.
  std::optional<Value> softmax(ir::Builder& b, const Value& x, int64_t dim, bool log, DType out) const override {
    if (x.dtype() != DType::F32 || out != DType::F32 || dim != x.rank() - 1 || x.shape()[dim] < 8 ||
        x.type.numel() == 0)
      return std::nullopt;
    const Shape& s = x.shape();
    const int64_t n = s.back(), m = x.type.numel() / n;
    auto r = b.customCall(kSoftmaxForward, {b.reshape(x, {m, n}), b.constantInt(log ? 1 : 0, DType::I32)},
                          {Type{DType::F32, {m, n}}});
    return b.reshape(r[0], s);
  }

  std::optional<Value> matmul(ir::Builder& b, const Value& x, const Value& y) const override {
    return gemm_ ? gemm(b, x, y) : std::nullopt;
  }
  std::optional<Value> addmm(ir::Builder& b, const Value& bias, const Value& x, const Value& y, const Value& alpha,
                             const Value& beta) const override {
    if (!gemm_ || x.rank() != 2 || y.rank() != 2 || bias.dtype() != DType::F32) return std::nullopt;
    const int64_t N = y.shape()[1];
    const bool row = (bias.rank() == 1 && bias.shape()[0] == N) || (bias.rank() == 2 && bias.shape() == Shape{1, N});
    if (!row) return std::nullopt;
    return gemm(b, x, y, {b.reshape(bias, {N}), b.convert(alpha, DType::F32), b.convert(beta, DType::F32)});
  }
  bool matmulTakesTransposes() const override { return gemm_; }

 private:
  static bool takesLayerNorm(const ops::LayerNormArgs& a) {
    return a.x.dtype() == DType::F32 && (!a.w || a.w->dtype() == DType::F32) &&
           (!a.bias || a.bias->dtype() == DType::F32) && a.n >= 8 && a.x.type.numel() > 0;
  }

  bool gemm_;
};

}  // namespace

std::unique_ptr<ops::KernelSlots> makeKernelSlots(bool gemm) { return std::make_unique<CpuKernelSlots>(gemm); }

}  // namespace tpu::plugins::cpu
