// The steps every execution mode shares, one place each: a planned op (what
// the dispatcher hands a mode), its meta run (PyTorch's expected results),
// its signature (the cache key), and lowering it onto a builder (arguments
// bound to values, results bound to returns or written arguments). This layer
// (op_steps/) sits below the modes, which run these steps in order: strict/,
// fused/ and compile/ (capture); the dispatcher (dispatch/) sits above them.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <array>
#include <functional>
#include <string>
#include <vector>

#include "aten/tpu.h"
#include "ops/lowering.h"

namespace tpu::aten {

using c10::IValue;

// An op the dispatcher has routed to a mode: its arguments (math bits
// resolved, indices on the device), its lowering and its signature.
struct PlannedOp {
  const c10::OperatorHandle& op;
  torch::jit::Stack* stack;
  std::vector<IValue> args;
  const ops::Lowering* low = nullptr;
  bool foreach_expand = false;  // _foreach_X: the lowering of X on each element
  std::string base;             // ATen base name ("add" for aten::add_.Tensor)
  std::string key;              // signature(): the cache key of its program
  c10::DeviceIndex device = 0;
  // "aten::add.Tensor"
  std::string name() const;
};

// Where a program (or fused-eager fragment) parameter comes from.
struct InputSource {
  enum class Kind { Tensor, ListElem, Scalar, ScalarListElem, CpuScalar, Rng } kind;
  int arg = -1;
  int elem = -1;
  ir::DType dtype = ir::DType::F32;  // Scalar / CpuScalar element type in the program
};

// Where a program result goes: a return, a list return, or a written argument.
struct OutputBinding {
  enum class Kind { Return, ReturnList, WriteArg, ReturnNone } kind;
  int index = -1;  // return index, or argument index for WriteArg
  int elem = -1;   // list element for WriteArg on a list
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes;
  // Memory order of a new result when PyTorch's kernel would not make it
  // contiguous (elementwise ops keep a permuted input's layout): the dims
  // outermost first. Empty: contiguous.
  std::vector<int64_t> perm;
};

// PyTorch's view of the op for this signature (meta kernel results).
struct Plan {
  bool have_expected = false;
  std::vector<ir::Type> expected;
  std::vector<std::vector<int64_t>> perms;
};

// How tensor and scalar arguments (and random states) become values: each
// mode supplies its own (program parameters, graph reads, constants).
struct Sources {
  std::function<ir::Value(const at::Tensor&, InputSource)> tensor;
  std::function<ir::Value(const IValue&, ir::DType, InputSource)> scalar;
  std::function<ir::Value(ir::Builder&)> rng;
};

// An op lowered onto a builder: each bound result's value is flat, in the
// result's dtype and memory order.
struct Lowered {
  std::vector<std::pair<OutputBinding, ir::Value>> bound;
  std::vector<int> none_returns;
  ir::Value bounds_ok, dynamic_len;
  std::vector<int> dynamic_results;
  size_t num_returns = 0;
};

// ---- planning (op_plan.cpp)

// Runs the op on meta tensors: PyTorch's own shape and dtype checks raise the
// CPU's errors, and the results give the expected types.
Plan planFor(const PlannedOp& p);
// The cache key of the op's program: op, dtypes, shapes, layouts, scalars.
std::string signature(const c10::OperatorHandle& op, const std::vector<IValue>& args, const ops::Lowering* low);
// Why `key` compiled: its difference from the closest signature seen before.
std::string explainSignature(const std::string& op, const std::string& key);
// "aten::add.Tensor(float32[2, 3], float32[3])" for error messages.
std::string describe(const c10::OperatorHandle& op, const std::vector<IValue>& args);

// ---- lowering (lower_op.cpp)

// Lowers one op onto `b`: converts the arguments (tensors and scalars become
// values through `src`), runs the lowering, and binds each result to a return
// or a written argument, converted to PyTorch's dtype, laid out in memory
// order and flattened. Every mode lowers through it.
Lowered lowerOp(const PlannedOp& p, const Plan& plan, ir::Builder& b, Sources& src);
// Scalar arguments and random states as parameters of `b`, each recorded in
// `inputs` (strict programs and fused-eager fragments take them alike).
void paramScalarSources(Sources& src, ir::Builder& b, std::vector<InputSource>& inputs);

// ---- arguments and results (op_plan.cpp)

bool isOutArg(const c10::Argument& a);
c10::TypePtr baseType(const c10::TypePtr& t);
bool isScalarType(const c10::TypePtr& t);
// A Python complex number: a 0-d complex128 CPU tensor. Programs take it as
// complex64, the precision the device computes in.
bool isComplexNumber(const at::Tensor& t);
// The element type a CPU scalar tensor has in a program.
ir::DType cpuScalarIr(const at::Tensor& t);
// complex128 where the plugin computes it, else complex64: Python complex numbers in a program.
ir::DType complexNumberIr();
runtime::BufferPtr cpuScalarBuffer(const at::Tensor& t, ir::DType dt, int device);
// The tensor argument `idx`, or element `elem` of the list argument `idx`.
at::Tensor listElem(const std::vector<IValue>& args, int idx, int elem);
// The generator an op's arguments name, else the device's default one.
at::Generator generatorFor(const std::vector<IValue>& args, c10::DeviceIndex d);
// The state words of the next random op drawn from `gen`.
std::array<uint64_t, 2> nextRngState(at::Generator& gen);
// The sizes of a result in memory order (its layout's permutation applied).
std::vector<int64_t> memorySizes(const OutputBinding& ob);
// Strides of a result laid out in memory order `ob.perm` (outermost first).
std::vector<int64_t> permutedStrides(const OutputBinding& ob);
// Replaces the op's arguments on the stack by its returns: new tensors
// (`returns`, `lists`), or the written arguments they alias.
void pushReturns(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::vector<IValue>& args,
                 std::vector<IValue>& returns, std::vector<c10::List<at::Tensor>>& lists);

}  // namespace tpu::aten
