// Lowering one op onto a builder, for every mode: the op's arguments become
// lowering arguments (tensors and scalars through the mode's Sources), its
// lowering runs (once per element for _foreach_ ops), and each result is
// bound to a return or a written argument, checked against the meta run,
// converted to PyTorch's dtype and flattened in memory order.
#include <sstream>

#include "op_steps/op_plan.h"

namespace tpu::aten {
namespace {

ir::DType scalarIrType(const IValue& v) {
  if (v.isDouble()) return ir::DType::F64;
  if (v.isBool()) return ir::DType::Bool;
  if (v.isComplexDouble()) return ir::DType::C64;
  return ir::DType::I64;
}

// The op's arguments as lowering arguments. out= tensors are written, not
// read: they keep an empty slot.
std::vector<ops::Arg> bindArguments(const PlannedOp& p, ir::Builder& b, Sources& src) {
  const auto& sargs = p.op.schema().arguments();
  const auto& args = p.args;
  const ops::Lowering* low = p.low;
  std::vector<ops::Arg> largs;
  auto tensorParam = [&](const at::Tensor& t, InputSource is) { return src.tensor(t, is); };

  for (size_t i = 0; i < args.size(); ++i) {
    const IValue& v = args[i];
    const auto& sa = sargs[i];
    ops::Arg a;
    if (isOutArg(sa)) {
      largs.push_back(a);
      continue;
    }
    if (v.isNone()) {
      a.kind = ops::Arg::Kind::None;
    } else if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        a.kind = ops::Arg::Kind::None;
      } else if (t.device().is_cpu() && t.unsafeGetTensorImpl()->is_wrapped_number()) {
        a.kind = ops::Arg::Kind::Scalar;
        a.scalar_is_float = at::isFloatingType(t.scalar_type());
        a.value = tensorParam(t, {InputSource::Kind::CpuScalar, static_cast<int>(i)});
      } else {
        a.kind = ops::Arg::Kind::Tensor;
        a.value = tensorParam(t, {InputSource::Kind::Tensor, static_cast<int>(i)});
        a.contiguous = t.is_contiguous();
      }
    } else if (v.isTensorList() || (v.isList() && v.toList().elementType()->kind() == c10::TypeKind::OptionalType)) {
      a.kind = ops::Arg::Kind::TensorList;
      auto lst = v.toList();
      for (size_t j = 0; j < lst.size(); ++j) {
        IValue e = lst.get(j);
        if (e.isNone() || !e.toTensor().defined()) {
          a.values.push_back(ir::Value{});
        } else {
          a.values.push_back(
              tensorParam(e.toTensor(), {InputSource::Kind::ListElem, static_cast<int>(i), static_cast<int>(j)}));
        }
      }
    } else if (isScalarType(sa.type()) && (v.isDouble() || v.isInt() || v.isBool() || v.isComplexDouble())) {
      a.kind = ops::Arg::Kind::Scalar;
      a.scalar_is_float = v.isDouble();
      bool is_const = std::find(low->const_scalars.begin(), low->const_scalars.end(), static_cast<int>(i)) !=
                      low->const_scalars.end();
      ir::DType st = scalarIrType(v);
      if (v.isComplexDouble()) {
        // A constant of the program (the signature holds its value): scalar
        // inputs travel as f64/i64/i1 only. complex128 where the plugin
        // computes it (a complex128 op keeps the scalar's precision; others
        // convert it down), complex64 on a TPU.
        auto z = v.toComplexDouble();
        a.scalar_is_float = true;
        const ir::DType part = ir::complexPart(complexNumberIr());
        a.value = b.complex(b.constant(z.real(), part), b.constant(z.imag(), part));
      } else if (is_const) {
        a.const_value = v.isDouble() ? v.toDouble() : (v.isBool() ? double(v.toBool()) : double(v.toInt()));
        a.value = v.isInt() ? b.constantInt(v.toInt(), st) : b.constant(*a.const_value, st);
      } else {
        a.value = src.scalar(v, st, {InputSource::Kind::Scalar, static_cast<int>(i), -1, st});
      }
    } else if (v.isList() && baseType(sa.type())->castRaw<c10::ListType>() &&
               baseType(sa.type())->castRaw<c10::ListType>()->getElementType()->kind() == c10::TypeKind::NumberType) {
      a.kind = ops::Arg::Kind::ScalarList;
      auto lst = v.toList();
      for (size_t j = 0; j < lst.size(); ++j) {
        if (lst.get(j).isComplexDouble()) throw ir::Unsupported("complex scalar lists");
        ir::DType st = scalarIrType(lst.get(j));
        a.values.push_back(src.scalar(
            lst.get(j), st, {InputSource::Kind::ScalarListElem, static_cast<int>(i), static_cast<int>(j), st}));
      }
      a.scalar_is_float = !lst.empty() && lst.get(0).isDouble();
    } else if (v.isInt() && baseType(sa.real_type())->kind() == c10::TypeKind::ScalarTypeType) {
      a.kind = ops::Arg::Kind::DType;
      a.dtype = toIr(static_cast<at::ScalarType>(v.toInt()));
    } else if (v.isInt() || v.isSymInt()) {
      a.kind = ops::Arg::Kind::Int;
      a.i = v.isInt() ? v.toInt() : v.toSymInt().expect_int();
    } else if (v.isDouble()) {
      a.kind = ops::Arg::Kind::Double;
      a.d = v.toDouble();
    } else if (v.isBool()) {
      a.kind = ops::Arg::Kind::Bool;
      a.b = v.toBool();
    } else if (v.isIntList() ||
               (v.isList() && baseType(sa.type())->castRaw<c10::ListType>() &&
                (baseType(sa.type())->castRaw<c10::ListType>()->getElementType()->kind() == c10::TypeKind::IntType ||
                 baseType(sa.type())->castRaw<c10::ListType>()->getElementType()->kind() ==
                     c10::TypeKind::SymIntType))) {
      a.kind = ops::Arg::Kind::IntList;
      if (v.isIntList()) {
        a.ints = v.toIntVector();
      } else {
        for (const IValue& e : v.toList()) a.ints.push_back(e.isInt() ? e.toInt() : e.toSymInt().expect_int());
      }
    } else if (v.isDoubleList()) {
      a.kind = ops::Arg::Kind::DoubleList;
      a.doubles = v.toDoubleVector();
    } else if (v.isBoolList()) {
      a.kind = ops::Arg::Kind::BoolList;
      for (bool x : v.toBoolList()) a.ints.push_back(x);
    } else if (v.isString()) {
      a.kind = ops::Arg::Kind::String;
      a.s = v.toStringRef();
    } else {
      a.kind = ops::Arg::Kind::Other;  // layout, device, memory format, generator
    }
    largs.push_back(std::move(a));
  }

  return largs;
}

// The lowering's results (one per element for _foreach_ ops) and what it
// noted on its context: mutations, a dynamic length, a bounds check.
struct LoweringResults {
  std::vector<ir::Value> values;
  std::vector<ops::Ctx::Mutation> mutations;
  ir::Value dynamic_len, bounds_ok;
  std::vector<int> dynamic_results;
};

LoweringResults runLowering(const PlannedOp& p, const Plan& plan, std::vector<ops::Arg> largs, ir::Builder& b,
                            Sources& src) {
  const auto& schema = p.op.schema();
  const ops::Lowering* low = p.low;
  const bool have_expected = plan.have_expected;
  const auto& expected = plan.expected;
  auto make_rng = [&src](ir::Builder& bb) { return src.rng(bb); };
  LoweringResults out;
  bool all_empty = have_expected && !expected.empty() && !low->data_dependent;
  for (const auto& t : expected) all_empty &= t.shape != ir::Shape{-1} && t.numel() == 0;
  if (all_empty && !p.foreach_expand) {
    // Every result is empty: nothing to compute (and XLA rejects some
    // zero-size windows and gathers).
    for (const auto& t : expected) out.values.push_back(b.constant(0.0, t.dtype, t.shape));
  } else if (!p.foreach_expand) {
    ops::Ctx ctx(b, p.base, std::move(largs), have_expected ? expected : std::vector<ir::Type>{});
    ctx.make_rng_state = make_rng;
    out.values = low->fn(ctx);
    out.mutations = ctx.mutations();
    out.dynamic_len = ctx.dynamicLength();
    out.dynamic_results = ctx.dynamicResults();
    out.bounds_ok = ctx.boundsOk();
    bool aliased_return = false;
    for (const auto& r : schema.returns()) aliased_return |= r.alias_info() != nullptr;
    if (low->data_dependent && (!out.dynamic_len.valid() || aliased_return))
      throw ir::Unsupported("data-dependent result here");
  } else {
    // _foreach_X(list, list|scalar|scalars, ...) = X on each element.
    size_t len = 0;
    for (const auto& a : largs)
      if (a.kind == ops::Arg::Kind::TensorList) len = std::max(len, a.values.size());
    for (size_t j = 0; j < len; ++j) {
      std::vector<ops::Arg> el;
      for (const auto& a : largs) {
        ops::Arg e = a;
        if (a.kind == ops::Arg::Kind::TensorList) {
          e.kind = ops::Arg::Kind::Tensor;
          e.value = a.values.at(j);
          e.values.clear();
        } else if (a.kind == ops::Arg::Kind::ScalarList) {
          e.kind = ops::Arg::Kind::Scalar;
          e.value = a.values.at(j);
          e.values.clear();
        }
        el.push_back(std::move(e));
      }
      std::vector<ir::Type> ex;
      if (have_expected && expected.size() == len) ex.push_back(expected[j]);
      ops::Ctx ctx(b, p.base, std::move(el), ex);
      ctx.make_rng_state = make_rng;
      auto r = low->fn(ctx);
      if (r.size() != 1) throw ir::Unsupported("foreach over a multi-result op");
      out.values.push_back(r[0]);
    }
  }
  return out;
}

// Binds the lowering's results to the op's returns and written arguments,
// in schema order; records undefined returns.
void bindResults(const PlannedOp& p, const LoweringResults& lr, Lowered& out, std::vector<size_t>& expected_skip) {
  const auto& schema = p.op.schema();
  const auto& sargs = schema.arguments();
  const auto& args = p.args;
  const auto& results = lr.values;
  // Bind results to returns / written arguments.
  const auto& rets = schema.returns();
  out.num_returns = rets.size();
  size_t ri = 0;
  auto take = [&]() -> ir::Value {
    if (ri >= results.size())
      throw std::logic_error("torch_tpu internal: the lowering of " + schema.name() + " returned too few results");
    return results[ri++];
  };
  auto& bound = out.bound;
  auto& none_returns = out.none_returns;
  auto bindWrite = [&](int idx, int elem, const ir::Value& val) {
    at::Tensor t = listElem(args, idx, elem);
    OutputBinding ob{OutputBinding::Kind::WriteArg, idx, elem, t.scalar_type(), {}};
    bound.push_back({ob, val});
  };
  if (rets.empty()) {
    for (size_t i = 0; i < sargs.size() && ri < results.size(); ++i) {
      if (!(sargs[i].alias_info() && sargs[i].alias_info()->isWrite())) continue;
      const IValue& v = args[i];
      if (v.isTensor()) {
        bindWrite(static_cast<int>(i), -1, take());
      } else if (v.isTensorList() || v.isList()) {
        auto lst = v.toList();
        for (size_t j = 0; j < lst.size(); ++j)
          if (!lst.get(j).isNone()) bindWrite(static_cast<int>(i), static_cast<int>(j), take());
      }
    }
  } else {
    for (size_t r = 0; r < rets.size(); ++r) {
      const auto& ret = rets[r];
      if (ret.alias_info() && ret.alias_info()->isWrite()) {
        int target = -1;
        for (size_t i = 0; i < sargs.size(); ++i)
          if (sargs[i].alias_info() && sargs[i].alias_info()->beforeSets() == ret.alias_info()->beforeSets())
            target = static_cast<int>(i);
        if (target < 0) throw ir::Unsupported("unmatched alias in " + schema.name());
        const IValue& v = args[target];
        if (v.isTensor()) {
          bindWrite(target, -1, take());
        } else {
          auto lst = v.toList();
          for (size_t j = 0; j < lst.size(); ++j) bindWrite(target, static_cast<int>(j), take());
        }
      } else if (ret.type()->kind() == c10::TypeKind::ListType) {
        while (ri < results.size()) {
          ir::Value val = take();
          OutputBinding ob{OutputBinding::Kind::ReturnList, static_cast<int>(r), -1, toAten(val.dtype()), val.shape()};
          bound.push_back({ob, val});
        }
      } else {
        ir::Value val = take();
        if (!val.valid()) {  // the lowering leaves this result undefined
          none_returns.push_back(static_cast<int>(r));
          expected_skip.push_back(r);
          continue;
        }
        OutputBinding ob{OutputBinding::Kind::Return, static_cast<int>(r), -1, toAten(val.dtype()), val.shape()};
        bound.push_back({ob, val});
      }
    }
  }
  if (ri != results.size())
    throw std::logic_error("torch_tpu internal: the lowering of " + schema.name() + " returned " +
                           std::to_string(results.size()) + " results, the schema binds " + std::to_string(ri));
  for (const auto& m : lr.mutations) bindWrite(static_cast<int>(m.arg), m.elem, m.value);
}

// Checks each bound result against the meta run, takes PyTorch's dtype,
// sizes and layout from it, and flattens the value in memory order.
void finishResults(const PlannedOp& p, const Plan& plan, size_t mutations, const std::vector<size_t>& expected_skip,
                   ir::Builder& b, Lowered& out) {
  const auto& schema = p.op.schema();
  const auto& expected = plan.expected;
  const auto& perms = plan.perms;
  auto& bound = out.bound;
  // Expected types of the bound results (undefined results removed).
  std::vector<ir::Type> ex_bound;
  std::vector<std::vector<int64_t>> perm_bound;
  for (size_t i = 0; i < expected.size(); ++i)
    if (std::find(expected_skip.begin(), expected_skip.end(), i) == expected_skip.end()) {
      ex_bound.push_back(expected[i]);
      perm_bound.push_back(i < perms.size() ? perms[i] : std::vector<int64_t>{});
    }
  for (size_t i = 0; i < bound.size(); ++i) {
    auto& [ob, val] = bound[i];
    bool from_mutation = i >= bound.size() - mutations;
    if (plan.have_expected && !from_mutation && i < ex_bound.size() && ex_bound[i].shape != ir::Shape{-1}) {
      const ir::Type& ex = ex_bound[i];
      // A lowering may return [0] for a result the CPU kernel leaves empty
      // where the meta kernel sizes it (batch-norm eval statistics).
      bool empty_placeholder = ob.kind == OutputBinding::Kind::Return && val.shape() == ir::Shape{0};
      if (empty_placeholder) {
        ob.dtype = toAten(ex.dtype);
        ob.sizes = val.shape();
      } else if (ex.shape != val.shape())
        throw std::logic_error("torch_tpu internal: the lowering of " + schema.name() + " produced shape " +
                               ir::shapeStr(val.shape()) + ", PyTorch expects " + ir::shapeStr(ex.shape));
      if (!empty_placeholder) {
        if (ob.kind != OutputBinding::Kind::WriteArg) ob.dtype = toAten(ex.dtype);
        ob.sizes = ex.shape;
        if (ob.kind == OutputBinding::Kind::Return && i < perm_bound.size()) ob.perm = perm_bound[i];
      }
    } else if (ob.kind == OutputBinding::Kind::WriteArg) {
      ob.sizes = val.shape();
    }
    ir::Value v = b.convert(val, toIr(ob.dtype));
    if (!ob.perm.empty()) v = b.transpose(v, ob.perm);  // into memory order
    val = b.reshape(v, {v.type.numel()});
  }
}

}  // namespace

Lowered lowerOp(const PlannedOp& p, const Plan& plan, ir::Builder& b, Sources& src) {
  LoweringResults lr = runLowering(p, plan, bindArguments(p, b, src), b, src);
  Lowered out;
  std::vector<size_t> expected_skip;  // positions (in return order) of undefined results
  bindResults(p, lr, out, expected_skip);
  finishResults(p, plan, lr.mutations.size(), expected_skip, b, out);
  out.bounds_ok = lr.bounds_ok;
  out.dynamic_len = lr.dynamic_len;
  out.dynamic_results = lr.dynamic_results;
  return out;
}

void paramScalarSources(Sources& src, ir::Builder& b, std::vector<InputSource>& inputs) {
  src.scalar = [&b, &inputs](const IValue&, ir::DType st, InputSource is) {
    inputs.push_back(is);
    return b.param({st, {}});
  };
  src.rng = [&inputs](ir::Builder& bb) {
    inputs.push_back({InputSource::Kind::Rng, -1, -1, ir::DType::U64});
    return bb.param({ir::DType::U64, {2}});
  };
}

}  // namespace tpu::aten
