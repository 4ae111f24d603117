// The checks of kernel_checks.h.
#include "dispatch/kernel_checks.h"

#include <ATen/Dispatch_v2.h>
#include <ATen/WrapDimUtils.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/DistributionTemplates.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

namespace tpu::aten {

using c10::IValue;

// Ops that write or read self at the indices of an index tensor. Into (or
// from) a dimension of size 0 every index is out of range, whatever its
// value: the CPU kernels raise, and the program would either compute nothing
// (the all-empty shortcut) or be refused by the compiler (a gather from a
// zero-size dimension). index_add is not here: its CPU kernel accepts it.
// index_select and gather make the same check after their own.
const std::set<std::string>& emptyIndexedOps() {
  static const std::set<std::string> ops = {"scatter",      "scatter_add", "scatter_reduce",
                                            "index_reduce", "index_copy",  "index_fill",
                                            "put",          "index_put",   "_index_put_impl"};
  return ops;
}

// The unary ops whose CPU and CUDA kernels build their TensorIterator with
// all dtypes the same: out= of another dtype is an error, not a cast.
const std::set<std::string>& sameDtypeUnary() {
  static const std::set<std::string> ops = {"abs",        "bitwise_not", "ceil",  "conj_physical", "floor", "frac",
                                            "hardshrink", "neg",         "round", "sgn",           "sign",  "trunc"};
  return ops;
}

// fill_ with a value the tensor's dtype cannot hold raises, as on the CPU
// (PyTorch's checked conversion), in every mode.
void checkFillValue(const std::vector<IValue>& args) {
  if (!args[0].isTensor() || !args[1].isScalar()) return;
  const at::Tensor& self = args[0].toTensor();
  const at::Scalar v = args[1].toScalar();
  if (self.is_complex() || v.isComplex()) return;
  AT_DISPATCH_V2(self.scalar_type(), "fill_", AT_WRAP([&] { (void)v.to<scalar_t>(); }), AT_EXPAND(AT_ALL_TYPES),
                 at::kHalf, at::kBFloat16, at::kBool, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES));
}

namespace {

// add/sub(bool, bool, alpha=1.5): PyTorch's CPU and CUDA alpha check counts
// bool as integral.
void checkBoolAlpha(const std::string&, const std::string&, const std::vector<IValue>& args) {
  if (args.size() < 3 || !args[0].isTensor() || args[0].toTensor().scalar_type() != at::kBool || !args[2].isScalar() ||
      !args[2].toScalar().isFloatingPoint())
    return;
  const bool other_bool = args[1].isTensor() ? args[1].toTensor().scalar_type() == at::kBool
                                             : args[1].isScalar() && args[1].toScalar().isBoolean();
  TORCH_CHECK(!other_bool, "For integral input tensors, argument alpha must not be a floating point number.");
}

// index_add / index_reduce(self, dim, index, source): the source's slices have self's
// shape and one per index, as their CPU kernels check (index_reduce's meta kernel checks
// neither; index_add's only the count). A mismatch otherwise gave a value or a compiler error.
void checkIndexSource(const std::string& base, const std::vector<IValue>& args) {
  if (args.size() < 4 || !args[1].isInt() || !args[2].isTensor() || !args[3].isTensor()) return;
  const at::Tensor &self = args[0].toTensor(), &index = args[2].toTensor(), &source = args[3].toTensor();
  if (self.dim() == 0 || source.dim() == 0) return;  // scalars: the op's own checks
  const int64_t dim = at::maybe_wrap_dim(args[1].toInt(), self.dim());
  TORCH_CHECK(dim < source.dim(), base, "_(): Indexing dim ", dim, " is out of bounds of the source tensor with dim ",
              source.dim());
  TORCH_CHECK(index.numel() == source.size(dim), base, "_(): Number of indices (", index.numel(),
              ") should be equal to source.size(dim): (", source.size(dim), "), for dim: ", dim);
  bool same = self.dim() == source.dim();
  for (int64_t d = 0; same && d < self.dim(); ++d) same = d == dim || self.size(d) == source.size(d);
  TORCH_CHECK(same,
              "source tensor shape must match self tensor shape, excluding the specified dimension. Got "
              "self.shape = ",
              self.sizes(), " source.shape = ", source.sizes());
}

// A non-empty index into a dimension of size 0: the CPU kernel's exception
// type for each op (its words where they do not name an index value).
void checkEmptyIndexed(const std::string& base, const std::string&, const std::vector<IValue>& args) {
  if (args.size() < 3 || !args[0].isTensor()) return;
  if (base == "index_add" || base == "index_reduce") {
    checkIndexSource(base, args);
    if (base == "index_add") return;  // its CPU kernel accepts an empty self
  }
  const at::Tensor& self = args[0].toTensor();
  if (!self.defined() || self.numel() != 0) return;
  if (base == "put") {
    if (args[1].isTensor() && args[1].toTensor().numel() > 0)
      TORCH_CHECK_INDEX(false, "put_(): Tried to put elements into an empty tensor");
    return;
  }
  if (base == "index_put" || base == "_index_put_impl") {
    if (!args[1].isList()) return;
    int64_t d = 0;
    for (const IValue& v : args[1].toListRef()) {
      if (!v.isTensor()) {  // None: a whole dimension
        ++d;
        continue;
      }
      const at::Tensor& idx = v.toTensor();
      const bool mask = idx.scalar_type() == at::kBool || idx.scalar_type() == at::kByte;
      if (!mask && idx.numel() > 0 && d < self.dim() && self.size(d) == 0)
        TORCH_CHECK_INDEX(false, "index is out of bounds for dimension with size 0");
      d += mask ? idx.dim() : 1;
    }
    return;
  }
  if (!args[1].isInt() || !args[2].isTensor() || args[2].toTensor().numel() == 0 || self.dim() == 0) return;
  const int64_t dim = at::maybe_wrap_dim(args[1].toInt(), self.dim());
  if (self.size(dim) != 0) return;
  if (base == "index_select") TORCH_CHECK(false, "index_select(): self indexing axis dim should be positive");
  if (base == "index_reduce")
    TORCH_CHECK_INDEX(false, "index_reduce(): index out of range for dimension ", dim, " of size 0");
  TORCH_CHECK(false, base, "(): index out of bounds for dimension ", dim, " with size 0");
}

// Reductions over a dim: PyTorch's CPU and CUDA kernels keep the reduced dims in a 64-bit
// mask, and max/min with a dim refuse an empty one (their meta kernels check neither).
void checkReductionDims(const std::string& base, const std::string&, const std::vector<IValue>& args) {
  if (args.size() < 2 || !args[0].isTensor()) return;
  const at::Tensor& self = args[0].toTensor();
  const bool dim_given = args[1].isInt() || (args[1].isIntList() && !args[1].toIntList().empty());
  if (!dim_given) return;
  TORCH_CHECK(self.dim() <= 64, "only tensors with up to 64 dims are supported");
  if ((base == "max" || base == "min") && args[1].isInt() && self.dim() > 0) {
    const int64_t dim = at::maybe_wrap_dim(args[1].toInt(), self.dim());
    TORCH_CHECK_INDEX(self.size(dim) != 0, base, "(): Expected reduction dim ", dim, " to have non-zero size.");
  }
}

// var/std(x, dim, correction): the CPU and CUDA kernels warn where the correction leaves no
// degrees of freedom (the result is inf or NaN).
void warnDegreesOfFreedom(const std::string& base, const std::string& overload, const std::vector<IValue>& args) {
  if (args.size() < 2 || !args[0].isTensor() || args[0].toTensor().dim() > 64) return;  // that raises first
  const at::Tensor& self = args[0].toTensor();
  double correction = 1;
  if (overload.rfind("correction", 0) == 0) {  // (self, dim, *, correction, keepdim)
    if (args.size() > 2 && args[2].isScalar()) correction = args[2].toScalar().toDouble();
  } else if (overload.rfind("dim", 0) == 0) {  // (self, dim, unbiased, keepdim)
    if (args.size() > 2 && args[2].isBool()) correction = args[2].toBool() ? 1 : 0;
  } else if (overload.empty()) {  // (self, unbiased): every element
    if (args[1].isBool()) correction = args[1].toBool() ? 1 : 0;
  } else {
    return;  // names: not on tpu
  }
  int64_t n = self.numel();  // the reduction factor: the reduced dims' sizes
  if (!overload.empty() && args[1].isIntList() && !args[1].toIntVector().empty()) {
    n = 1;
    for (int64_t d : args[1].toIntVector()) n *= self.dim() ? self.size(at::maybe_wrap_dim(d, self.dim())) : 1;
  }
  if (static_cast<double>(n) - correction <= 0)
    TORCH_WARN(base,
               "(): degrees of freedom is <= 0. Correction should be strictly less than the reduction factor "
               "(input numel divided by output numel).");
}

// (values, indices) outputs of the sorting reductions: the CPU kernels' dtype checks, in
// their words, where the meta kernels resize without checking.
void checkValuesIndicesOut(const std::string& base, const std::string&, const std::vector<IValue>& args) {
  if (args.size() < 3 || !args[0].isTensor() || !args[args.size() - 2].isTensor() || !args.back().isTensor()) return;
  const at::ScalarType self = args[0].toTensor().scalar_type();
  const at::ScalarType values = args[args.size() - 2].toTensor().scalar_type();
  const at::ScalarType indices = args.back().toTensor().scalar_type();
  auto meta = [](at::ScalarType t) { return std::string(c10::scalarTypeToTypeMeta(t).name()); };
  if (base == "mode") {
    TORCH_CHECK(values == self, "expected scalar type '", self, "' but got '", values, "' for values output");
    TORCH_CHECK(indices == at::kLong, "expected scalar type 'Long' but got '", indices, "' for indices output");
  } else if (base == "sort") {
    TORCH_CHECK(values == self, "Expected out tensor to have dtype ", meta(self), ", but got ", meta(values),
                " instead");
    TORCH_CHECK(indices == at::kLong, "Expected out tensor to have dtype long int, but got ", meta(indices),
                " instead");
  } else if (base == "kthvalue") {
    TORCH_CHECK(values == self, "output values must be of same type as input");
    TORCH_CHECK(indices == at::kLong, "output indices must be of scalar type Long");
  } else if (base == "cummax" || base == "cummin") {
    TORCH_CHECK(values == self, "expected scalar_type ", self, " but found ", values);
    TORCH_CHECK(indices == at::kLong, "expected scalar_type Long but found ", indices);
  } else {  // median, nanmedian
    TORCH_CHECK(values == self,
                "Expected tensor for 'values' to have the same type as tensor for argument #2 "
                "'self'; but got ",
                values, " instead of ", self, " (while checking arguments for median_out)");
    TORCH_CHECK(indices == at::kLong, "Expected tensor for argument #1 'indices' to have scalar type Long; but got ",
                indices, " instead (while checking arguments for median_out)");
  }
}

// Ranges of scalar arguments. A scalar reaches a program as one of its inputs (a new
// value compiles nothing), so the meta kernel that checks it runs only when the program is
// built: a later call with a bad value would skip it.
void checkScalarRanges(const std::string& base, const std::string& overload, const std::vector<IValue>& args) {
  auto number = [&](size_t i) -> std::optional<double> {
    if (i < args.size() && args[i].isScalar()) return args[i].toScalar().toDouble();
    return std::nullopt;
  };
  if (base == "histc") {  // histc(self, bins, min, max)
    const auto lo = number(2), hi = number(3);
    if (!lo || !hi || *lo == *hi) return;  // equal: the range comes from the data
    TORCH_CHECK(std::isfinite(*lo) && std::isfinite(*hi), "torch.histc: range of [", *lo, ", ", *hi, "] is not finite");
    TORCH_CHECK(*lo <= *hi, "torch.histc: max must be larger than min");
  } else if (base == "uniform") {  // uniform_(self, from, to)
    const auto lo = number(1), hi = number(2);
    if (!lo || !hi || args.empty() || !args[0].isTensor()) return;
    TORCH_CHECK(*lo <= *hi, "uniform_ expects to return a [from, to) range, but found from=", *lo, " > to=", *hi);
    const at::ScalarType t = args[0].toTensor().scalar_type();
    double limit = std::numeric_limits<double>::max();
    if (t == at::kFloat) limit = std::numeric_limits<float>::max();
    if (t == at::kHalf) limit = 65504.0;
    if (t == at::kBFloat16) limit = static_cast<double>(std::numeric_limits<c10::BFloat16>::max());
    TORCH_CHECK(*hi - *lo <= limit, "uniform_ expects to-from <= std::numeric_limits<", t,
                ">::max(), but found to=", *hi, " and from=", *lo, " which result in to-from to exceed the limit");
  } else if (base == "bernoulli" && (overload == "float" || overload == "p")) {  // bernoulli(self, p: float)
    if (const auto p = number(1))
      TORCH_CHECK(*p >= 0 && *p <= 1, "bernoulli_ expects p to be in [0, 1], but got p=", *p);
  }
}

// convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
// groups): PyTorch's shape check (Convolution.cpp, every device) refuses a weight with fewer
// than `groups` channels in dim 0 (and, transposed, an input whose channels are not the
// weight's dim 0); its meta kernel does not, and tpu returned an empty result.
void checkConvWeight(const std::string&, const std::string&, const std::vector<IValue>& args) {
  if (args.size() < 9 || !args[1].isTensor() || !args[8].isInt()) return;
  const at::Tensor& weight = args[1].toTensor();
  const int64_t groups = args[8].toInt();
  if (weight.dim() == 0) return;
  TORCH_CHECK(weight.size(0) >= groups, "Given groups=", groups, ", expected weight to be at least ", groups,
              " at dimension 0, but got weight of size ", weight.sizes(), " instead");
  // Transposed: the input's channels are the weight's dim 0 (the compiler refused a mismatch,
  // and an input of 0 channels gave an empty result).
  if (!args[0].isTensor() || !args[6].isBool() || !args[6].toBool()) return;
  const at::Tensor& input = args[0].toTensor();
  if (input.dim() != weight.dim()) return;  // unbatched: PyTorch adds the batch dim itself
  TORCH_CHECK(input.size(1) == weight.size(0), "Given transposed=1, weight of size ", weight.sizes(),
              ", expected input", input.sizes(), " to have ", weight.size(0), " channels, but got ", input.size(1),
              " channels instead");
}

// The checks with a function of their own, by kind (the rest are written in checkLikeKernels).
using Check = void (*)(const std::string& base, const std::string& overload, const std::vector<IValue>& args);
const std::pair<KernelCheck, Check> kChecks[] = {{KernelCheck::BoolAlpha, checkBoolAlpha},
                                                 {KernelCheck::EmptyIndexed, checkEmptyIndexed},
                                                 {KernelCheck::ReductionDims, checkReductionDims},
                                                 {KernelCheck::DegreesOfFreedom, warnDegreesOfFreedom},
                                                 {KernelCheck::ValuesIndicesOut, checkValuesIndicesOut},
                                                 {KernelCheck::ScalarRanges, checkScalarRanges},
                                                 {KernelCheck::ConvWeight, checkConvWeight}};

}  // namespace

// Checks PyTorch's CPU and CUDA kernels make that its meta kernels skip, so
// the meta run (op_steps/op_plan.cpp) does not raise them: the same exception
// type and words, in every mode.
void checkLikeKernels(KernelCheck check, const std::string& base, const std::string& overload,
                      const std::vector<IValue>& args) {
  using K = KernelCheck;
  auto tensor = [&](size_t i) -> const at::Tensor* {
    return i < args.size() && args[i].isTensor() && args[i].toTensor().defined() ? &args[i].toTensor() : nullptr;
  };
  switch (check) {
    case K::None:
      return;
    case K::InPlaceBroadcast: {  // x.atan2_(y) where y would grow x
      const at::Tensor* self = tensor(0);
      if (!self) return;
      c10::DimVector shape(self->sizes().begin(), self->sizes().end());
      try {
        for (size_t i = 1; i < args.size(); ++i)
          if (const at::Tensor* t = tensor(i)) shape = at::infer_size_dimvector(shape, t->sizes());
      } catch (const c10::Error&) {
        return;  // not broadcastable at all: the op's own path says so
      }
      TORCH_CHECK(c10::IntArrayRef(shape) == self->sizes(), "output with shape ", self->sizes(),
                  " doesn't match the broadcast shape ", c10::IntArrayRef(shape));
      if (base == "add" || base == "sub") checkBoolAlpha(base, overload, args);
      return;
    }
    case K::BoolResult: {  // all/any(out=): a bool result (uint8 for a uint8 input)
      const at::Tensor* self = tensor(0);
      const at::Tensor* out = nullptr;
      for (size_t i = args.size(); i-- > 1 && !out;) out = tensor(i);
      if (!self || !out) return;
      const bool ok =
          out->scalar_type() == at::kBool || (self->scalar_type() == at::kByte && out->scalar_type() == at::kByte);
      TORCH_CHECK(ok, base, " only supports bool tensor for result, got: ", out->scalar_type());
      return;
    }
    case K::EluBackward:  // elu_backward(grad, alpha, scale, input_scale, is_result, self_or_result)
      if (args.size() > 4 && args[4].isBool() && args[4].toBool() && args[1].isScalar())
        TORCH_CHECK(args[1].toScalar().toDouble() >= 0,
                    "In-place elu backward calculation is triggered with a negative slope which is not supported. "
                    "This is caused by calling in-place forward function with a negative slope, please call "
                    "out-of-place version instead.");
      return;
    case K::IndexSelect:  // index_select(self, dim, index)
      if (const at::Tensor* index = tensor(2))
        TORCH_CHECK_INDEX(index->dim() <= 1, "index_select(): Index is supposed to be a vector");
      checkEmptyIndexed(base, overload, args);
      return;
    case K::SameDtypeOut: {  // neg(x, out=y): y has x's dtype (abs of a complex x: its real type)
      const at::Tensor *self = tensor(0), *out = nullptr;
      for (size_t i = args.size(); i-- > 1 && !out;) out = tensor(i);
      if (!self || !out) return;
      const at::ScalarType want =
          base == "abs" && self->is_complex() ? c10::toRealValueType(self->scalar_type()) : self->scalar_type();
      TORCH_CHECK(out->scalar_type() == want, "Found dtype ", out->scalar_type(), " but expected ", want);
      return;
    }
    default:  // a check with a function of its own
      for (const auto& [k, fn] : kChecks)
        if (k == check) return fn(base, overload, args);
      return;
    case K::Gather:  // gather(self, dim, index)
      if (const at::Tensor *self = tensor(0), *index = tensor(2); self && index && index->numel() > 0)  // as PyTorch
        TORCH_CHECK(std::max<int64_t>(self->dim(), 1) == std::max<int64_t>(index->dim(), 1),
                    "Index tensor must have the same number of dimensions as input tensor");
      checkEmptyIndexed(base, overload, args);
      return;
  }
}

// random_(from, to) and random_(to): the bounds PyTorch checks on every call,
// with its errors and its warnings (a float tensor's range beyond exactly
// representable integers), before the program's own check.
void checkRandomBounds(const c10::OperatorHandle& op, const std::vector<IValue>& args) {
  if (!args[0].isTensor() || !args[1].isInt()) return;
  const at::Tensor& self = args[0].toTensor();
  const bool from_to = op.schema().overload_name() == "from";
  const int64_t from = from_to ? args[1].toInt() : 0;
  std::optional<int64_t> to;
  if (!from_to)
    to = args[1].toInt();
  else if (args.size() > 2 && args[2].isInt())
    to = args[2].toInt();
  if (!to) return;  // up to the dtype's range: nothing to check
  TORCH_CHECK(from < *to, "random_ expects 'from' to be less than 'to', but got from=", from, " >= to=", *to);
  at::native::templates::check_from_to_in_range(from, *to - 1, self.dtype());
}

}  // namespace tpu::aten
