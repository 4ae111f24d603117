// The lowering table: one lowering per ATen op (by base name, e.g. "add"),
// used by every execution mode. A lowering reads the op's arguments in schema
// order and appends StableHLO ops to a Builder. In-place and out= variants
// reuse the functional lowering: the dispatcher writes the results back.
// No torch headers here.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ir/ir.h"

namespace tpu::ops {

using ir::DType;
using ir::Shape;
using ir::Type;
using ir::Value;

// One argument of an ATen op, as a lowering sees it. Tensors and Scalars are
// program inputs (Values); ints, bools, lists, dtypes and strings are
// compile-time attributes.
struct Arg {
  enum class Kind {
    None,
    Tensor,
    TensorList,
    Int,
    Double,
    Bool,
    IntList,
    DoubleList,
    BoolList,
    Scalar,
    ScalarList,
    DType,
    String,
    Other
  };
  Kind kind = Kind::None;
  Value value;                // Tensor, or Scalar (0-d f64 / i64 / i1 input)
  std::vector<Value> values;  // TensorList (invalid Value = None element), ScalarList
  int64_t i = 0;
  double d = 0;
  bool b = false;
  std::vector<int64_t> ints;
  std::vector<double> doubles;
  std::string s;
  DType dtype = DType::F32;
  // A Scalar whose value is part of the program (see Lowering::const_scalars).
  std::optional<double> const_value;
  bool scalar_is_float = false;  // Scalar kinds: float vs int/bool (type promotion)
  // Tensor: whether the input is contiguous (a few linalg kernels choose by it,
  // and their backward formulas rely on the same choice).
  bool contiguous = true;
};

class Ctx;
using LowerFn = std::function<std::vector<Value>(Ctx&)>;

struct Lowering {
  LowerFn fn;
  // Scalar arguments (by index) whose value must be known when compiling.
  std::vector<int> const_scalars;
  // The first result's leading dim depends on the data (nonzero,
  // masked_select): the lowering returns it padded and reports the length
  // with Ctx::setDynamicLength; the host reads the length back.
  bool data_dependent = false;
};

class Ctx {
 public:
  Ctx(ir::Builder& b, std::string op, std::vector<Arg> args, std::vector<Type> expected)
      : b(b), op_(std::move(op)), args_(std::move(args)), expected_(std::move(expected)) {}

  ir::Builder& b;
  const std::string& op() const { return op_; }
  size_t size() const { return args_.size(); }
  const Arg& arg(size_t i) const;
  bool has(size_t i) const { return i < args_.size() && args_[i].kind != Arg::Kind::None; }
  Arg::Kind kind(size_t i) const { return i < args_.size() ? args_[i].kind : Arg::Kind::None; }

  Value tensor(size_t i) const;  // a Tensor (or a Scalar as 0-d)
  std::optional<Value> optTensor(size_t i) const;
  std::vector<Value> tensors(size_t i) const;
  int64_t i64(size_t i) const;
  int64_t i64Or(size_t i, int64_t dflt) const { return has(i) ? i64(i) : dflt; }
  double f64(size_t i) const;  // Double (or Int) attribute
  double f64Or(size_t i, double dflt) const { return has(i) ? f64(i) : dflt; }
  bool flag(size_t i) const;
  bool flagOr(size_t i, bool dflt) const { return has(i) ? flag(i) : dflt; }
  std::vector<int64_t> ints(size_t i) const;  // also accepts a single Int
  std::optional<std::vector<int64_t>> optInts(size_t i) const;
  std::string str(size_t i) const;
  std::optional<DType> optDType(size_t i) const;
  // A Scalar argument converted to `t` (0-d), or `dflt` when absent.
  Value scalar(size_t i, DType t) const;
  Value scalarOr(size_t i, DType t, double dflt) const;
  bool isScalarArg(size_t i) const { return kind(i) == Arg::Kind::Scalar; }
  // The compile-time value of a Scalar listed in const_scalars.
  double constScalar(size_t i) const;

  // Expected result types (from PyTorch's meta kernels); empty when unknown.
  const std::vector<Type>& expected() const { return expected_; }
  bool hasExpected() const { return !expected_.empty(); }
  const Type& expectedAt(size_t i) const;

  // A fresh random-number state (u64[2]) fed from the device generator.
  Value rngState();
  int rngStatesUsed() const { return rng_states_; }
  std::function<Value(ir::Builder&)> make_rng_state;  // set by the dispatcher

  // Updates of arguments the op mutates besides its returns (batch-norm
  // running stats): (argument index, element index or -1, new value).
  struct Mutation {
    size_t arg;
    int elem;
    Value value;
  };
  void mutate(size_t arg, Value v, int elem = -1) { mutations_.push_back({arg, elem, v}); }
  const std::vector<Mutation>& mutations() const { return mutations_; }

  // Index checks: `ok` (a bool scalar) must hold, else the op raises
  // IndexError at the next host read (at once in debug mode).
  void requireInRange(Value ok) { bounds_ok_ = bounds_ok_.valid() ? b.binary("and", bounds_ok_, ok) : ok; }
  const Value& boundsOk() const { return bounds_ok_; }

  // `results` (return indices) are padded along dim 0 and cut to `len`.
  void setDynamicLength(Value len, std::vector<int> results = {0}) {
    dynamic_len_ = len;
    dynamic_results_ = std::move(results);
  }
  const Value& dynamicLength() const { return dynamic_len_; }
  const std::vector<int>& dynamicResults() const { return dynamic_results_; }

 private:
  std::string op_;
  std::vector<Arg> args_;
  std::vector<Type> expected_;
  std::vector<Mutation> mutations_;
  Value dynamic_len_;
  std::vector<int> dynamic_results_;
  Value bounds_ok_;
  int rng_states_ = 0;
};

// Whether the op being lowered joins a program of several ops (a fused-eager
// fragment, a compiled graph) rather than a strict-eager program of its own:
// a lowering may then return views of one result that later ops of the same
// program read whole. Set for its lifetime by a MultiOpProgram on the
// lowering's thread.
bool inMultiOpProgram();
class MultiOpProgram {
 public:
  MultiOpProgram();
  ~MultiOpProgram();
  MultiOpProgram(const MultiOpProgram&) = delete;
  MultiOpProgram& operator=(const MultiOpProgram&) = delete;

 private:
  bool was_;
};

// Registry. Lowerings register by base name ("add") or by "name.overload"
// ("sum.dim_IntList"); lookup tries the exact overload first.
void registerLowering(const std::string& name, LowerFn fn, std::vector<int> const_scalars = {},
                      bool data_dependent = false);
const Lowering* findLowering(const std::string& name, const std::string& overload);
std::vector<std::string> loweredOps();

// Registers at static-initialization time from each ops/*.cpp file.
struct Registrar {
  Registrar(const char* name, LowerFn fn, std::vector<int> const_scalars = {}, bool data_dependent = false) {
    registerLowering(name, std::move(fn), std::move(const_scalars), data_dependent);
  }
};

}  // namespace tpu::ops
