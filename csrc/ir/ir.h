// A small typed SSA graph IR that prints as StableHLO (MLIR generic syntax).
// Values are typed tensors; each builder method appends one StableHLO op and
// infers its result type, so lowerings compose ops without shape bookkeeping.
// No torch headers here.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tpu::ir {

enum class DType : uint8_t { Bool, U8, I8, I16, I32, I64, F16, BF16, F32, F64, C64, U32, U64, U16, C128 };

const char* mlirName(DType t);   // i1, ui8, i8, ..., f32, complex<f32>
const char* dtypeName(DType t);  // bool, uint8, ..., float32
size_t itemSize(DType t);
inline bool isFloat(DType t) { return t == DType::F16 || t == DType::BF16 || t == DType::F32 || t == DType::F64; }
inline bool isComplex(DType t) { return t == DType::C64 || t == DType::C128; }
inline bool isInt(DType t) {
  return t == DType::U8 || t == DType::I8 || t == DType::I16 || t == DType::I32 || t == DType::I64 || t == DType::U16 ||
         t == DType::U32 || t == DType::U64;
}
inline bool isUnsigned(DType t) {
  return t == DType::U8 || t == DType::U16 || t == DType::U32 || t == DType::U64 || t == DType::Bool;
}
// A complex type's real and imaginary parts (float32 or float64), and the
// complex type whose parts are a float type (float64: complex128, else complex64).
inline DType complexPart(DType t) { return t == DType::C128 ? DType::F64 : DType::F32; }
inline DType complexOf(DType part) { return part == DType::F64 ? DType::C128 : DType::C64; }
// PyTorch's promotion of two dtypes (torch.promote_types).
DType promote(DType a, DType b);

using Shape = std::vector<int64_t>;

struct Type {
  DType dtype = DType::F32;
  Shape shape;
  int64_t numel() const;
  int rank() const { return static_cast<int>(shape.size()); }
  std::string str() const;  // tensor<2x3xf32>
  bool operator==(const Type& o) const { return dtype == o.dtype && shape == o.shape; }
  bool operator!=(const Type& o) const { return !(*this == o); }
};

struct Value {
  int id = -1;
  Type type;
  bool valid() const { return id >= 0; }
  DType dtype() const { return type.dtype; }
  const Shape& shape() const { return type.shape; }
  int rank() const { return type.rank(); }
};

// Where a value's elements lie in another value's row-major buffer: element
// (i0, i1, ...) is base[offset + sum(i_k * strides[k])]. A kernel that takes
// strided operands can read `base` in place instead of a copy.
struct StridedView {
  Value base;
  int64_t offset = 0;
  std::vector<int64_t> strides;  // one per dim of the value, in elements of base
};

// Thrown when a lowering cannot express an op for these arguments; the
// dispatcher then uses the CPU fallback (counted, warned) or raises.
class Unsupported : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thrown when an op has no code for a dtype on CUDA and the CPU (or on CUDA, where tpu
// follows it): raised as NotImplementedError, like PyTorch's "... not implemented for 'Bool'".
class NotImplementedForDtype : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

enum class Cmp { EQ, NE, LT, LE, GT, GE };

// A finished builder's body as a private function of a module, so that a
// graph can call one op's lowering instead of lowering the op again: fused
// eager builds each op signature's function once and calls it per op. The
// name is a hash of the text, so a caller's fingerprint pins the body.
struct Function {
  std::string name;  // without the '@'
  std::string text;  // the func.func definition
  std::vector<Type> params, results;
  std::string call_types;  // " : (params) -> (results)", printed at every call
  int op_count = 0;
  // The functions this one calls (they join every module that calls it).
  std::vector<std::shared_ptr<const Function>> callees;
  // Replicas of a body with collectives (see Builder::setParticipants).
  std::vector<int> participants;
  int collectives = 0;
  int64_t max_channel = 0;  // the highest channel of its collectives, its callees' included
};

// `f` with every collective's channel raised by `offset` (itself when it has
// none): a new function, and new callees where theirs change, named apart.
// Two programs whose channels both count from 1 (each recording numbers its
// collectives so) can then be called in one: the second after the first's
// highest channel. Memoized.
std::shared_ptr<const Function> withChannelsAfter(const std::shared_ptr<const Function>& f, int64_t offset);

// Formulations chosen for XLA:CPU where its code for the portable form is
// slow (set by the runtime when the plugin is the CPU one). Programs differ by
// plugin anyway: the compilation cache keys the plugin's identity.
void setXlaCpuTuning(bool on);
bool xlaCpuTuning();

class Builder {
 public:
  Builder();

  Value param(const Type& t);
  void output(const Value& v);
  const std::vector<Type>& paramTypes() const { return params_; }
  const std::vector<Value>& outputs() const { return outputs_; }
  // Input-output aliasing: output `output` may be written into param
  // `param`'s buffer, which the caller donates at execution. Same dtype and
  // element count (the shapes may differ: both are dense row-major bytes).
  void alias(int param, int output);
  const std::vector<std::pair<int, int>>& aliases() const { return aliases_; }
  // For each (param, value) pair: whether every op of @main that reads the
  // param (directly or through reshapes) computes the value or one of its
  // operands, transitively. XLA orders such readers before the write; a reader
  // it cannot order (say the weight read by a backward matmul, aliased to the
  // weight's optimizer update) makes it copy the whole param first.
  // `results`: all the values @main will return.
  std::vector<bool> inPlaceSafe(const std::vector<std::pair<int, Value>>& pairs,
                                const std::vector<Value>& results) const;
  // For each param: whether a value @main returns (so far) depends on it. A
  // param no result reads needs no buffer: strict eager drops it (fill_ and
  // zero_ read only their argument's shape).
  std::vector<bool> paramsRead() const;
  // The whole module as MLIR text, entry function @main.
  std::string emit() const;
  // Number of ops emitted so far (for metrics and the recompile log).
  int opCount() const { return op_count_; }
  // A 128-bit hash of the program (kept up to date as ops are added), so a
  // cache lookup does not need the text.
  std::string fingerprint() const;
  // This builder's params, body and outputs as a private function (see
  // Function); needs at least one output.
  std::shared_ptr<const Function> asFunction() const;
  // Calls `f` (its definition joins this module); the argument types must
  // match its params. Only at the top level of @main.
  std::vector<Value> call(const std::shared_ptr<const Function>& f, const std::vector<Value>& args);

  // --- constants and conversions
  Value constant(double v, DType t, const Shape& shape = {});
  Value constantInt(int64_t v, DType t, const Shape& shape = {});
  // A 1-d integer constant holding `vs`.
  Value constantInts(const std::vector<int64_t>& vs, DType t);
  Value zeros(const Type& t) { return constant(0.0, t.dtype, t.shape); }
  Value convert(const Value& v, DType t);
  Value bitcast(const Value& v, const Type& t);
  Value iota(const Type& t, int dim);

  // --- shape ops
  // stablehlo.optimization_barrier: XLA keeps `v` as computed (no folding
  // across it).
  Value barrier(const Value& v);
  Value reshape(const Value& v, const Shape& shape);
  Value broadcastInDim(const Value& v, const Shape& shape, const std::vector<int64_t>& dims);
  // NumPy-style broadcast of v to `shape` (trailing alignment).
  Value broadcastTo(const Value& v, const Shape& shape);
  Value transpose(const Value& v, const std::vector<int64_t>& perm);
  // The operand of a 2-d transpose ({1, 0}) this builder emitted, so that a
  // kernel that takes operands transposed (a GEMM) can read the original and
  // leave the transpose dead; nullopt for any other value.
  std::optional<Value> transposeSource(const Value& v) const;
  // Views: `v` holds the elements of `view.base` that `view` addresses (a
  // tensor view read from its storage). Reshapes, transposes and slices of a
  // noted value are views of the same base where the strides allow, so
  // viewOf answers for them too; nullopt for any other value.
  void noteView(const Value& v, StridedView view);
  std::optional<StridedView> viewOf(const Value& v) const;
  Value slice(const Value& v, const Shape& start, const Shape& limit, const Shape& strides);
  Value dynamicSlice(const Value& v, const std::vector<Value>& starts, const Shape& sizes);
  Value dynamicUpdateSlice(const Value& v, const Value& update, const std::vector<Value>& starts);
  Value concatenate(const std::vector<Value>& vs, int64_t dim);
  Value pad(const Value& v, const Value& pad_value, const Shape& lo, const Shape& hi, const Shape& interior);
  Value reverse(const Value& v, const std::vector<int64_t>& dims);

  // --- elementwise
  Value unary(const char* op, const Value& v);                   // "exponential", "log", ...
  Value binary(const char* op, const Value& a, const Value& b);  // same types required
  Value compare(const Value& a, const Value& b, Cmp dir);
  Value select(const Value& pred, const Value& a, const Value& b);
  Value clamp(const Value& lo, const Value& x, const Value& hi);

  // --- reductions and structured ops
  using BodyFn = std::function<std::vector<Value>(Builder&, const std::vector<Value>& args)>;
  // Reduces `inputs` over `dims` with the body (args: accumulators then
  // elements, all scalars). `lane_body`: the body is a single add, which
  // XLA:CPU vectorizes across lanes when a minor-dim reduction is split.
  std::vector<Value> reduce(const std::vector<Value>& inputs, const std::vector<Value>& inits,
                            const std::vector<int64_t>& dims, const BodyFn& body, bool lane_body = false);
  std::vector<Value> reduceWindow(const std::vector<Value>& inputs, const std::vector<Value>& inits,
                                  const Shape& window, const Shape& strides, const Shape& base_dilations,
                                  const Shape& window_dilations,
                                  const std::vector<std::pair<int64_t, int64_t>>& padding, const BodyFn& body);
  Value dotGeneral(const Value& lhs, const Value& rhs, const std::vector<int64_t>& lhs_batch,
                   const std::vector<int64_t>& rhs_batch, const std::vector<int64_t>& lhs_contract,
                   const std::vector<int64_t>& rhs_contract, DType out, const char* precision = nullptr);
  struct ConvDims {
    // Dimension numbers for N-d convolution; spatial dims listed in order.
    int64_t in_batch = 0, in_feature = 1;
    std::vector<int64_t> in_spatial;
    int64_t k_out = 0, k_in = 1;
    std::vector<int64_t> k_spatial;
    int64_t out_batch = 0, out_feature = 1;
    std::vector<int64_t> out_spatial;
  };
  Value convolution(const Value& lhs, const Value& rhs, const ConvDims& dn, const Shape& strides,
                    const std::vector<std::pair<int64_t, int64_t>>& padding, const Shape& lhs_dilation,
                    const Shape& rhs_dilation, int64_t feature_groups, int64_t batch_groups, DType out);
  struct GatherDims {
    std::vector<int64_t> offset_dims, collapsed_slice_dims, start_index_map, operand_batching_dims,
        start_indices_batching_dims;
    int64_t index_vector_dim = 0;
  };
  Value gather(const Value& operand, const Value& indices, const GatherDims& dn, const Shape& slice_sizes);
  struct ScatterDims {
    std::vector<int64_t> update_window_dims, inserted_window_dims, scatter_dims_to_operand_dims, input_batching_dims,
        scatter_indices_batching_dims;
    int64_t index_vector_dim = 0;
  };
  // body(args = {old, update}) -> {new}
  Value scatter(const Value& operand, const Value& indices, const Value& updates, const ScatterDims& dn,
                const BodyFn& body);
  // Sorts along `dim`; the comparator sees (a_0, b_0, a_1, b_1, ...).
  std::vector<Value> sort(const std::vector<Value>& inputs, int64_t dim, bool stable, const BodyFn& cmp);
  // THREE_FRY bit generator: returns {new_state, bits}.
  std::vector<Value> rngBitGenerator(const Value& state, const Type& out);
  // stablehlo.while: `cond(state) -> {i1 scalar}`, `body(state) -> state`.
  // Pass every value the regions read through the state: regions here do
  // not capture outer values, which keeps them valid for every plugin.
  std::vector<Value> whileLoop(const std::vector<Value>& init, const BodyFn& cond, const BodyFn& body);
  // Batched Cholesky over the last two dims (only the `lower` triangle is read).
  Value cholesky(const Value& a, bool lower);
  // Solves op(a) x = b (left_side) or x op(a) = b; a triangular, batched.
  Value triangularSolve(const Value& a, const Value& rhs, bool left_side, bool lower, bool unit_diagonal,
                        bool transpose_a);
  // stablehlo.fft over the trailing `lengths.size()` dims; kind is FFT, IFFT,
  // RFFT (real -> complex, last dim n/2+1) or IRFFT (complex -> real, last dim n).
  Value fft(const Value& v, const char* kind, const Shape& lengths);
  Value real(const Value& v);  // complex -> its real part; real -> itself
  Value imag(const Value& v);
  Value complex(const Value& re, const Value& im);  // f32 pair -> c64

  // --- collectives across replicas
  // A program with collectives runs as one replica per device of
  // `participants` (global device ids; replica r on participants[r]): the
  // devices of every group its collectives run over (a rank's world, with
  // ranks as threads). Set by the first collective's lowering; another list in
  // the same program is an error (Unsupported).
  void setParticipants(const std::vector<int>& ids);
  const std::vector<int>& participants() const { return participants_; }
  // Each collective runs among `group` (global device ids, some of the
  // participants, whose count divides theirs): a rank's data-parallel and
  // tensor-parallel collectives sit in one program, each over its own group.
  // `combine` is the reduction body (args: two scalars). Gather and scatter
  // work along `dim`; all_to_all splits `split_dim` into one block per
  // member and concatenates the received blocks along `concat_dim`.
  // `channel` (from 1) pairs the collective with the same one of the other
  // replicas' programs, which may differ elsewhere (a rank's own constants):
  // the n-th collective of a step has channel n on every rank.
  Value allReduce(const Value& v, const std::vector<int>& group, const BodyFn& combine, int64_t channel);
  Value allGather(const Value& v, const std::vector<int>& group, int64_t dim, int64_t channel);
  Value reduceScatter(const Value& v, const std::vector<int>& group, int64_t dim, const BodyFn& combine,
                      int64_t channel);
  Value allToAll(const Value& v, const std::vector<int>& group, int64_t split_dim, int64_t concat_dim, int64_t channel);
  // How many collectives this program holds.
  int collectiveCount() const { return collectives_; }

  // stablehlo.custom_call of a typed-FFI target (api_version 4): a kernel the
  // runtime registered with the plugin.
  std::vector<Value> customCall(const std::string& target, const std::vector<Value>& args,
                                const std::vector<Type>& results);

  // Scalar-typed helper (tensor<dtype>).
  static Type scalarType(DType t) { return Type{t, {}}; }

 private:
  struct Block {
    std::vector<std::string> lines;
  };
  Value fresh(const Type& t);
  std::string ref(const Value& v) const;
  void emitLine(const std::string& s);
  std::string region(const std::vector<Type>& arg_types, const BodyFn& body);
  std::string types(const std::vector<Value>& vs) const;
  void emitMulti(const std::vector<Value>& results, const std::string& rhs);
  // The stablehlo.reduce itself, operands as given.
  std::vector<Value> reduceOp(const std::vector<Value>& inputs, const std::vector<Value>& inits,
                              const std::vector<int64_t>& dims, const BodyFn& body);

  int next_id_ = 0;
  int op_count_ = 0;
  uint64_t h1_ = 1469598103934665603ull, h2_ = 7809847782465536322ull;
  void mix(const std::string& s);
  std::vector<Type> params_;
  std::vector<int> param_ids_;
  std::unordered_map<int, std::string> names_;
  std::vector<Value> outputs_;
  std::unordered_map<int, Value> transposed_from_;  // 2-d transposes: result id -> operand
  std::unordered_map<int, StridedView> views_;      // see noteView
  std::vector<std::pair<int, int>> aliases_;        // (param, output)
  std::vector<Block> blocks_;                       // blocks_[0] is @main's body; nested regions push.
  std::map<std::string, std::shared_ptr<const Function>> functions_;  // called ones, by name
  std::vector<int> participants_;                                     // see setParticipants
  int collectives_ = 0;
  int64_t max_channel_ = 0;
  // The channel and replica groups of a collective among `group`: `group` as
  // replica indices, the other replicas in groups of its size (XLA asks for a
  // partition of all replicas; each replica's program uses only its own group).
  std::string replicaGroups(const std::vector<int>& group, int64_t channel);
  // v's shape with `dim` split into one block per member of a group of `n`
  // (Unsupported if it does not split).
  static Shape splitAmongGroup(const char* what, const Value& v, int64_t dim, int64_t n);
  std::string signatureText(const std::string& name, bool is_public) const;
};

std::string shapeStr(const Shape& s);
// Appends v's decimal digits to s (program text and op keys are built for
// every recorded op: no temporary string).
void appendInt(std::string& s, int64_t v);
// FNV-1a: stable across builds (the disk cache's keys and checksums).
uint64_t fnv1a(const std::string& s, uint64_t seed = 1469598103934665603ull);
// A faster hash for in-memory keys (program fingerprints, op signatures).
uint64_t hash64(std::string_view s, uint64_t seed);

}  // namespace tpu::ir
