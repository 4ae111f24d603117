// Kernels the CPU plugin runs as XLA FFI custom calls, for ops XLA:CPU
// compiles into slow code. Attention is the one: XLA:CPU runs a batched dot
// as one small GEMM per batch element (64 for a 4-head, 16-sequence batch),
// which made attention the largest cost of a small GPT step. Other plugins
// (TPU, GPU) keep the portable StableHLO lowering. No torch headers here.
#pragma once

#include <cstdint>

#include "pjrt/pjrt.h"

namespace tpu::runtime {

// Custom-call targets, operands and results (all float32, row-major):
//   attention forward:  q [B,H,L,E], k [B,H,S,E], v [B,H,S,E], scale [], causal (i32) []
//                       -> out [B,H,L,E], logsumexp [B,H,L]
//   attention backward: dout, q, k, v, out, logsumexp, scale, causal -> dq, dk, dv
inline constexpr const char* kAttentionForward = "torch_tpu_attention_fwd";
inline constexpr const char* kAttentionBackward = "torch_tpu_attention_bwd";

// Registers the kernels with a plugin whose platform is the host CPU. False
// when the plugin has no FFI extension, refuses the registration, or this
// CPU lacks AVX2/FMA: the lowerings then use their StableHLO form.
bool registerHostKernels(const pjrt::Api& api);

// The kernels themselves, on plain arrays (for the unit tests).
void attentionForward(const float* q, const float* k, const float* v, float* out, float* lse, int64_t heads, int64_t L,
                      int64_t S, int64_t E, float scale, bool causal);
void attentionBackward(const float* dout, const float* q, const float* k, const float* v, const float* out,
                       const float* lse, float* dq, float* dk, float* dv, int64_t heads, int64_t L, int64_t S,
                       int64_t E, float scale, bool causal);

}  // namespace tpu::runtime
