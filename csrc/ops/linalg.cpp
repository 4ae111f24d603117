// Matrix products. Low-precision inputs accumulate in float32 and round
// once, as PyTorch's CPU kernels do.
#include "ops/common.h"
#include "ops/kernel_slots.h"

namespace tpu::ops {
namespace {

// Dot in the accumulation type, converted to `out`.
Value product(ir::Builder& b, const Value& x, const Value& y, DType out) {
  DType acc = accOf(out);
  return b.convert(matmul(b, b.convert(x, acc), b.convert(y, acc)), out);
}

std::vector<Value> plainProduct(Ctx& c) {
  Value x = c.tensor(0), y = c.tensor(1);
  DType out = outType(c, ir::promote(x.dtype(), y.dtype()));
  return {product(c.b, x, y, out)};
}
Registrar reg_mm("mm", plainProduct);
Registrar reg_bmm("bmm", plainProduct);
Registrar reg_matmul("matmul", plainProduct);
Registrar reg_dot("dot", plainProduct);
Registrar reg_vdot("vdot", [](Ctx& c) {  // conjugates its first argument
  Value x = c.tensor(0), y = c.tensor(1);
  if (ir::isComplex(x.dtype())) x = c.b.complex(c.b.real(x), c.b.unary("negate", c.b.imag(x)));
  DType out = outType(c, ir::promote(x.dtype(), y.dtype()));
  return std::vector<Value>{product(c.b, x, y, out)};
});
Registrar reg_mv("mv", plainProduct);
Registrar reg_inner("inner", [](Ctx& c) {
  Value x = c.tensor(0), y = c.tensor(1);
  if (x.rank() == 0 || y.rank() == 0) throw ir::Unsupported("inner with scalars");
  DType out = outType(c, ir::promote(x.dtype(), y.dtype()));
  DType acc = accOf(out);
  Value r = c.b.dotGeneral(c.b.convert(x, acc), c.b.convert(y, acc), {}, {}, {x.rank() - 1}, {y.rank() - 1}, acc);
  return std::vector<Value>{c.b.convert(r, out)};
});
Registrar reg_outer("outer", [](Ctx& c) {
  Value x = c.tensor(0), y = c.tensor(1);
  DType out = outType(c, ir::promote(x.dtype(), y.dtype()));
  int64_t n = x.shape()[0], m = y.shape()[0];
  Value xx = c.b.broadcastInDim(c.b.convert(x, out), {n, m}, {0});
  Value yy = c.b.broadcastInDim(c.b.convert(y, out), {n, m}, {1});
  return std::vector<Value>{mul(c.b, xx, yy)};
});

// addr(self, vec1, vec2, *, beta, alpha) = beta*self + alpha*outer(vec1, vec2),
// beta 0 ignoring self (NaN too), as PyTorch's kernel. Lowered so addr_ and
// addr(out=) reach the dispatcher, and its overlap check, instead of
// decomposing above it.
Registrar reg_addr("addr", [](Ctx& c) {
  Value s = c.tensor(0), x = c.tensor(1), y = c.tensor(2);
  if (x.rank() != 1 || y.rank() != 1) throw ir::Unsupported("addr of non-vectors");
  const DType out = outType(c, resultType(c, {0, 1, 2}));
  ir::Builder& b = c.b;
  const Shape sh{x.shape()[0], y.shape()[0]};
  if (out == DType::Bool) {  // (beta and self) or (alpha and vec1 and vec2), as PyTorch's bool kernel
    auto flag = [&](size_t i) { return b.broadcastTo(b.convert(c.scalar(i, DType::Bool), DType::Bool), sh); };
    Value p =
        b.binary("and", b.broadcastInDim(b.convert(x, out), sh, {0}), b.broadcastInDim(b.convert(y, out), sh, {1}));
    if (c.has(4)) p = b.binary("and", p, flag(4));
    Value ss = b.broadcastTo(b.convert(s, out), sh);
    if (c.has(3)) ss = b.binary("and", ss, flag(3));
    return std::vector<Value>{b.binary("or", ss, p)};
  }
  const DType acc = accOf(out);
  Value p = mul(b, b.broadcastInDim(b.convert(x, acc), sh, {0}), b.broadcastInDim(b.convert(y, acc), sh, {1}));
  if (c.has(4)) p = mul(b, p, b.broadcastTo(c.scalar(4, acc), sh));
  Value ss = b.broadcastTo(b.convert(s, acc), sh);
  if (c.has(3)) {
    Value beta = b.broadcastTo(c.scalar(3, acc), sh), zero = b.zeros({acc, sh});
    ss = b.select(b.compare(beta, zero, ir::Cmp::EQ), zero, mul(b, ss, beta));
  }
  return std::vector<Value>{b.convert(add(b, ss, p), out)};
});

// addmm/baddbmm/addmv(self, a, b, *, beta, alpha) = beta*self + alpha*(a@b)
std::vector<Value> addProduct(Ctx& c) {
  Value s = c.tensor(0), x = c.tensor(1), y = c.tensor(2);
  DType out = outType(c, ir::promote(x.dtype(), y.dtype()));
  DType acc = accOf(out);
  ir::Builder& b = c.b;
  if (out == DType::F32 && c.op() == "addmm") {  // a linear layer: a plugin's kernel may add the bias
    Value alpha = c.has(4) ? c.scalar(4, acc) : b.constant(1.0, acc);
    Value beta = c.has(3) ? c.scalar(3, acc) : b.constant(1.0, acc);
    if (auto r = kernelSlots().addmm(b, s, b.convert(x, acc), b.convert(y, acc), alpha, beta)) return {*r};
  }
  Value p = matmul(b, b.convert(x, acc), b.convert(y, acc));
  if (c.has(4)) p = mul(b, p, b.broadcastTo(c.scalar(4, acc), p.shape()));
  Value ss = b.broadcastTo(b.convert(s, acc), p.shape());
  if (c.has(3)) {
    // beta == 0 ignores self entirely (even nan/inf), as in PyTorch.
    Value beta = b.broadcastTo(c.scalar(3, acc), p.shape());
    Value scaled = mul(b, ss, beta);
    Value zero = b.constant(0.0, acc, p.shape());
    ss = b.select(b.compare(beta, zero, ir::Cmp::EQ), zero, scaled);
  }
  return {b.convert(add(b, ss, p), out)};
}
Registrar reg_addmm("addmm", addProduct);
Registrar reg_baddbmm("baddbmm", addProduct);
Registrar reg_addmv("addmv", addProduct);
Registrar reg_addbmm("addbmm", [](Ctx& c) {
  Value s = c.tensor(0), x = c.tensor(1), y = c.tensor(2);
  DType out = outType(c, ir::promote(x.dtype(), y.dtype()));
  DType acc = accOf(out);
  ir::Builder& b = c.b;
  Value p = b.dotGeneral(b.convert(x, acc), b.convert(y, acc), {}, {}, {0, 2}, {0, 1}, acc);
  if (c.has(4)) p = mul(b, p, b.broadcastTo(c.scalar(4, acc), p.shape()));
  Value ss = b.broadcastTo(b.convert(s, acc), p.shape());
  if (c.has(3)) ss = mul(b, ss, b.broadcastTo(c.scalar(3, acc), p.shape()));
  return std::vector<Value>{b.convert(add(b, ss, p), out)};
});

}  // namespace
}  // namespace tpu::ops
