// How a tensor operand reaches a program when its layout lets a kernel read
// it in place: a matrix product's transposed operand as its stored matrix,
// attention's q, k and v as the storage of a packed projection. Both pay off
// only where the plugin runs those ops as kernels of its own that read them so
// (its kernel slots say which: ops/kernel_slots.h); elsewhere every mask is 0.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "op_steps/op_plan.h"

namespace tpu::eager {

using aten::InputSource;
using c10::IValue;

// Matrix products whose operand is a transposed view (bit i: argument i).
uint32_t transposedOperands(const std::string& base, const std::vector<IValue>& args);
bool arrivesTransposed(uint32_t transposed, const InputSource& is);
// The cache-key suffix of a program or fragment built with `transposed`.
std::string transposedKey(uint32_t transposed);

// Attention operands that are head splits of one packed projection (bit i:
// argument i); fused eager only.
uint32_t packedAttentionOperands(const std::string& base, const std::vector<IValue>& args);
bool arrivesPacked(uint32_t packed, const InputSource& is);
// The first packed operand before `i` that shares operand i's storage (i
// itself when none does).
size_t packedStorageOwner(uint32_t packed, const std::vector<IValue>& args, size_t i);
// The fragment key's part for packed operands.
std::string packedKey(uint32_t packed, const std::vector<IValue>& args);

}  // namespace tpu::eager
