// The CPU plugin's custom calls: the targets its host kernels register under
// (host_kernels.cpp) and the operands its kernel slots pass when they emit
// them (kernel_slots.cpp), which happens only once the kernels are registered.
// No torch headers here.
#pragma once

namespace tpu::plugins::cpu {

// Custom-call targets, operands and results (all float32, row-major). The
// kernels take the sequence-major layout a model's projections produce
// ([batch, sequence, heads, width]): the lowering transposes to it, and XLA
// cancels that transpose against the model's own head split and merge, so
// neither a gather nor a copy is left around the call.
//   attention forward:  q, k, v, layout (i64 [7]), scale [], causal (i32) []
//                       -> out [B,L,H,E], logsumexp [B,H,L]
//   attention backward: dout [B,L,H,E], q, k, v, out, logsumexp, layout, scale, causal
//                       -> dq [B,L,H,E], dk [B,S,H,E], dv [B,S,H,E]
//                       or -> one result shaped as q's buffer, when q, k and v
//                       are the three thirds of each row of that one buffer
//                       (self-attention on a fused projection): the gradients
//                       are written where q, k and v lie (a projection's
//                       backward then reads them with no concatenation)
//   q, k and v are the buffers that hold them (any shape): layout is
//   {S, q offset, q row stride, k offset, k row stride, v offset, v row stride}
//   in elements; a row (one position's H*E values) is contiguous and a batch
//   is L (for k and v, S) rows. So the three can be read in place from one
//   projection's [B, L, 3*H*E] output; separate [B,L,H,E] arrays are offset
//   0, row stride H*E.
inline constexpr const char* kAttentionForward = "torch_tpu_attention_fwd";
inline constexpr const char* kAttentionBackward = "torch_tpu_attention_bwd";
//   layer norm over the rows of x (the lowering passes ones and zeros for an
//   absent weight or bias):
//   forward:  x [M, N], w [N], b [N], eps [] -> y [M, N], mean [M], rstd [M]
//   backward: dy [M, N], x [M, N], mean [M], rstd [M], w [N] -> dx [M, N], dw [N], db [N]
inline constexpr const char* kLayerNormForward = "torch_tpu_layer_norm_fwd";
inline constexpr const char* kLayerNormBackward = "torch_tpu_layer_norm_bwd";
//   softmax (log 0) or log-softmax (log 1) over the rows of x (the backward
//   stays XLA's: it fuses with the gradient's producer, a loss's one-hot):
//   x [M, N], log (i32 []) -> y [M, N]
inline constexpr const char* kSoftmaxForward = "torch_tpu_softmax_fwd";
//   matrix product on a host BLAS (see HostBlas):
//   a [M, K] ([K, M] when transposed), b [K, N] ([N, K] when transposed),
//   transposes (i32 []: bit 0 a, bit 1 b) [, bias [N], alpha [], beta []]
//   -> c [M, N] = alpha op(a) op(b) + beta bias, the bias added to every row
//   (a linear layer's addmm; beta 0 ignores the bias, NaN included, as the
//   BLAS and PyTorch do)
inline constexpr const char* kGemm = "torch_tpu_gemm";

}  // namespace tpu::plugins::cpu
