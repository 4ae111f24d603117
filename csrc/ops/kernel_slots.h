// Kernel slots: the parts of a few lowerings that a plugin may lower its own
// way (a custom call to a kernel it registered with the plugin) instead of
// the portable StableHLO form. The portable lowering asks the installed slots
// first (attention.cpp, nn.cpp, common.cpp); a slot returns nullopt for
// arguments its kernel does not take, and the lowering goes on with its
// StableHLO form. A plugin's support (runtime/plugin.h, csrc/plugins/<name>/)
// installs its slots for its lifetime; with none installed every slot is
// empty. Nothing here knows which kernels or custom calls stand behind them.
// No torch headers here.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "ir/ir.h"

namespace tpu::ops {

using ir::DType;
using ir::Value;

// Scaled dot-product attention's operands as its lowering reads them.
struct AttentionArgs {
  Value q, k, v;                            // [B, H, L, E], [B, H, S, E], [B, H, S, Ev] in the compute type `acc`
  DType in = DType::F32, acc = DType::F32;  // the inputs' dtype, the compute type
  double scale = 1.0;
  bool causal = false;  // key j visible from query i when j <= i
};

// Layer norm over the last `n` elements of x, w and bias absent or [n]-sized.
struct LayerNormArgs {
  Value x;
  int64_t n = 1;
  std::optional<Value> w, bias;
  double eps = 0.0;
};

// The slots a lowering reports on (torch_tpu._C._host_kernels, _host_gemm).
enum class KernelSlot { Attention, LayerNorm, Softmax, Matmul };

class KernelSlots {
 public:
  virtual ~KernelSlots() = default;
  virtual bool fills(KernelSlot slot) const { return false; }

  // Attention: the op's results, {out [B, H, L, Ev] in the inputs' dtype,
  // logsumexp [B, H, L] float32}.
  virtual std::optional<std::vector<Value>> attention(ir::Builder& b, const AttentionArgs& a) const {
    return std::nullopt;
  }
  // Its backward from the output's gradient, the output and its logsumexp (in
  // the compute type): the op's results, {dq, dk, dv} in the inputs' dtype.
  virtual std::optional<std::vector<Value>> attentionBackward(ir::Builder& b, const AttentionArgs& a, const Value& dout,
                                                              const Value& out, const Value& lse) const {
    return std::nullopt;
  }
  // Whether the attention kernel, for q width E and v width Ev (forward, or
  // backward), reads q, k and v in place from the storage they are views of
  // when their rows lie whole in it (attentionRowStride): the eager modes then
  // pass such operands as their storage (eager/operand_layout).
  virtual bool attentionReadsViews(int64_t E, int64_t Ev, bool backward) const { return false; }

  // Layer norm: {y [m, n], mean [m], rstd [m]} in float32, m rows of n.
  virtual std::optional<std::vector<Value>> layerNorm(ir::Builder& b, const LayerNormArgs& a) const {
    return std::nullopt;
  }
  // Its backward from dy, the saved mean and rstd: {dx [m, n], dw [n], db [n]} in float32.
  virtual std::optional<std::vector<Value>> layerNormBackward(ir::Builder& b, const LayerNormArgs& a, const Value& dy,
                                                              const Value& mean, const Value& rstd) const {
    return std::nullopt;
  }

  // Softmax (or log-softmax) of x over `dim`, result dtype `out`.
  virtual std::optional<Value> softmax(ir::Builder& b, const Value& x, int64_t dim, bool log, DType out) const {
    return std::nullopt;
  }

  // x [M, K] @ y [K, N].
  virtual std::optional<Value> matmul(ir::Builder& b, const Value& x, const Value& y) const { return std::nullopt; }
  // alpha * (x @ y) + beta * bias for 2-d x, y and a bias row ([N] or [1, N])
  // in one call (beta 0 ignores the bias, NaN included, as PyTorch does).
  virtual std::optional<Value> addmm(ir::Builder& b, const Value& bias, const Value& x, const Value& y,
                                     const Value& alpha, const Value& beta) const {
    return std::nullopt;
  }
  // Whether the matrix-product kernel reads a transposed operand as its
  // stored matrix (eager/operand_layout then passes it that way).
  virtual bool matmulTakesTransposes() const { return false; }
};

// The installed slots, or the empty default.
const KernelSlots& kernelSlots();
// Installs `slots` (not owned; null: none). A plugin's support calls it when
// the runtime starts, before anything is lowered, and with null when it goes.
void setKernelSlots(const KernelSlots* slots);

// The row stride at which a sequence-major [B, L, H, E] view (`sizes`,
// `strides` in elements of its storage) lies in its storage when its rows lie
// whole there, one after another (a model's head split of a packed q/k/v
// projection); nullopt otherwise.
std::optional<int64_t> attentionRowStride(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides);

}  // namespace tpu::ops
