#include "op_steps/operand_layout.h"

#include "ops/kernel_slots.h"

namespace tpu::eager {

using aten::arrayOf;
using aten::kTpu;

// Matrix products whose operand is a transposed view (the weight of a
// linear layer, the activations of its weight gradient) take that operand in
// memory order: the caller passes the stored matrix and the fragment (fused
// eager) or one-op program (strict eager) transposes it back, so the lowering
// sees the transpose and the GEMM kernel reads the stored matrix with its
// transpose flag (the transpose in the caller cancels against the view's).
// Without this XLA had to materialise each transpose for the kernel, fused
// into the producer of the operand: transposed writes that made the GPT step
// 1.7x slower; strict eager ran a transposing read, a program of its own
// (55 us more per 1024x64x256 linear). Bit i: argument i.
uint32_t transposedOperands(const std::string& base, const std::vector<IValue>& args) {
  if ((base != "mm" && base != "addmm") || !ops::kernelSlots().matmulTakesTransposes()) return 0;
  uint32_t mask = 0;
  for (size_t i = 0; i < args.size() && i < 32; ++i) {
    if (!args[i].isTensor()) continue;
    const at::Tensor& t = args[i].toTensor();
    if (t.defined() && !t.device().is_cpu() && t.dim() == 2 && t.size(0) > 1 && t.size(1) > 1 && t.stride(0) == 1 &&
        t.stride(1) == t.size(0))
      mask |= 1u << i;
  }
  return mask;
}

bool arrivesTransposed(uint32_t transposed, const InputSource& is) {
  return is.kind == InputSource::Kind::Tensor && (transposed >> is.arg & 1u);
}

// Attention's q, k and v [B, H, L, E] that are head splits of a wider
// projection (a model's packed q/k/v linear: rows of 3*H*E, one row per
// position) arrive as their whole storage, and the fragment notes where each
// lies in it, so the attention kernel reads them in place (ops/attention.cpp).
// Without this XLA copied each out of the projection, forward and backward:
// 12 copies of [16, 64, 64] per step of the benchmark GPT. Bit i: argument i.
uint32_t packedAttentionOperands(const std::string& base, const std::vector<IValue>& args) {
  int first = -1;
  if (base == "_scaled_dot_product_flash_attention_for_cpu") first = 0;
  if (base == "_scaled_dot_product_flash_attention_for_cpu_backward") first = 1;
  if (first < 0 || args.size() < static_cast<size_t>(first + 3)) return 0;
  uint32_t mask = 0;
  for (int i = first; i < first + 3; ++i) {
    if (!args[i].isTensor()) return 0;
    const at::Tensor& t = args[i].toTensor();
    if (!t.defined() || t.device().type() != kTpu || t.scalar_type() != at::kFloat || t.dim() != 4) return 0;
    // [B, H, L, E] as the kernels' sequence-major [B, L, H, E].
    const auto sz = t.sizes(), st = t.strides();
    if (ops::attentionRowStride({sz[0], sz[2], sz[1], sz[3]}, {st[0], st[2], st[1], st[3]}) &&
        arrayOf(t).dtype() == ir::DType::F32)
      mask |= 1u << i;
  }
  const bool in_place = ops::kernelSlots().attentionReadsViews(args[first].toTensor().size(3),
                                                               args[first + 2].toTensor().size(3), first == 1);
  return in_place ? mask : 0;
}

// The first packed operand before `i` that shares operand i's storage (i
// itself when none does): operands of one storage (q, k and v split from one
// projection) share the fragment's param, so the lowering sees one buffer.
size_t packedStorageOwner(uint32_t packed, const std::vector<IValue>& args, size_t i) {
  const void* storage = args[i].toTensor().storage().unsafeGetStorageImpl();
  for (size_t j = 0; j < i; ++j)
    if ((packed >> j & 1u) && args[j].toTensor().storage().unsafeGetStorageImpl() == storage) return j;
  return i;
}

// The fragment key's part for packed operands: each one's storage size,
// where it lies there (the fragment's param is the storage) and which
// operand's storage it shares.
std::string packedKey(uint32_t packed, const std::vector<IValue>& args) {
  std::string k;
  for (size_t i = 0; i < args.size() && i < 32; ++i) {
    if (!(packed >> i & 1u)) continue;
    const at::Tensor& t = args[i].toTensor();
    k += "|P";
    ir::appendInt(k, static_cast<int64_t>(i));
    k += ',';
    ir::appendInt(k, arrayOf(t).numel());
    k += ',';
    ir::appendInt(k, t.storage_offset());
    k += ',';
    ir::appendInt(k, t.stride(2));
    k += ',';
    ir::appendInt(k, static_cast<int64_t>(packedStorageOwner(packed, args, i)));
  }
  return k;
}

bool arrivesPacked(uint32_t packed, const InputSource& is) {
  return is.kind == InputSource::Kind::Tensor && (packed >> is.arg & 1u);
}

std::string transposedKey(uint32_t transposed) { return transposed ? "|T" + std::to_string(transposed) : ""; }

}  // namespace tpu::eager
