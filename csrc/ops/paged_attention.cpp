// Paged attention for serving (vLLM's model runner, torch_tpu/vllm): the
// queries of a batch of requests, packed token after token, attend to each
// request's keys and values, which lie in fixed-size blocks of a KV cache
// named by the request's row of the block table. Prefill and decode requests
// mix in one batch (vLLM v1). One op with this one lowering, so a step's
// attention is one fused XLA computation per shape bucket in every mode.
//
// Shapes (the caller pads them to buckets; padding is masked, never read):
//   query            [T, Hq, D]           the batch's tokens
//   kv_cache         [NB, Hk, bs, 2 * D]  keys in [..., :D], values in [..., D:]
//   block_table      [R, MB] int          block ids of each request (0: unused)
//   seq_lens         [R] int              tokens of each request, context + new
//   query_start_loc  [R + 1] int          where each request's tokens start
//   max_query_len    Q, an attribute      the most new tokens of any request
// A query at position p of its request sees key k when k <= p (causal),
// k < seq_len and, with a sliding window W, k > p - W.
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "ops/common.h"

namespace tpu::ops {
namespace {

using ir::Builder;
using ir::Cmp;

Value i64(Builder& b, const Value& v) { return b.convert(v, DType::I64); }

Value scalarI64(Builder& b, int64_t v, const Shape& s) { return b.constantInt(v, DType::I64, s); }

Value clampTo(Builder& b, const Value& x, int64_t lo, int64_t hi) {
  return b.clamp(scalarI64(b, lo, x.shape()), x, scalarI64(b, hi, x.shape()));
}

// rows[i...] = operand[idx[i...]] along dim 0 (idx of shape S gives S ++ operand.shape[1:]).
Value takeRows(Builder& b, const Value& operand, const Value& idx) {
  const Shape& os = operand.shape();
  Shape is = idx.shape();
  const auto rank = static_cast<int64_t>(is.size());
  is.push_back(1);
  Builder::GatherDims dn;
  for (size_t d = 1; d < os.size(); ++d) dn.offset_dims.push_back(rank + static_cast<int64_t>(d) - 1);
  dn.collapsed_slice_dims = {0};
  dn.start_index_map = {0};
  dn.index_vector_dim = rank;
  Shape slice = os;
  slice[0] = 1;
  return b.gather(operand, b.reshape(idx, is), dn, slice);
}

// Malformed arguments are the caller's error (RuntimeError), not a reason to
// run elsewhere.
void checkArguments(const Value& query, const Value& cache, const Value& table, const Value& seq_lens, const Value& qsl,
                    int64_t max_query_len) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("paged_attention: " + what); };
  if (query.rank() != 3) fail("query must be [tokens, heads, head_size], got " + ir::shapeStr(query.shape()));
  if (cache.rank() != 4 || cache.shape()[3] != 2 * query.shape()[2])
    fail("kv_cache must be [blocks, kv_heads, block_size, 2 * head_size], got " + ir::shapeStr(cache.shape()) +
         " for head_size " + std::to_string(query.shape()[2]));
  if (cache.shape()[1] == 0 || query.shape()[1] % cache.shape()[1] != 0)
    fail(std::to_string(query.shape()[1]) + " query heads do not divide into " + std::to_string(cache.shape()[1]) +
         " kv heads");
  if (table.rank() != 2 || seq_lens.rank() != 1 || qsl.rank() != 1 || seq_lens.shape()[0] != table.shape()[0] ||
      qsl.shape()[0] != table.shape()[0] + 1)
    fail("block_table [R, blocks], seq_lens [R] and query_start_loc [R + 1] disagree: " + ir::shapeStr(table.shape()) +
         ", " + ir::shapeStr(seq_lens.shape()) + ", " + ir::shapeStr(qsl.shape()));
  for (const Value* v : {&table, &seq_lens, &qsl})
    if (ir::isFloat(v->dtype()) || v->dtype() == DType::Bool)
      fail("block_table, seq_lens and query_start_loc must be integer tensors");
  if (table.shape()[0] == 0 || query.shape()[0] == 0 || max_query_len <= 0)
    fail("needs at least one request with a token");
  if (cache.dtype() != query.dtype())
    fail("kv_cache dtype " + std::string(ir::dtypeName(cache.dtype())) + " differs from query dtype " +
         ir::dtypeName(query.dtype()));
}

std::vector<Value> pagedAttention(Ctx& c) {
  Builder& b = c.b;
  const Value query = c.tensor(0), cache = c.tensor(1);
  checkArguments(query, cache, c.tensor(2), c.tensor(3), c.tensor(4), c.i64(5));
  const int64_t T = query.shape()[0], Hq = query.shape()[1], D = query.shape()[2];
  const int64_t Hk = cache.shape()[1], bs = cache.shape()[2];
  const Value table = i64(b, c.tensor(2)), seq_lens = i64(b, c.tensor(3)), qsl = i64(b, c.tensor(4));
  const int64_t R = table.shape()[0], MB = table.shape()[1], L = MB * bs, G = Hq / Hk;
  const int64_t Q = std::min(c.i64(5), T);
  const double scale = c.f64(6);
  const int64_t window = c.i64Or(7, -1);
  const double soft_cap = c.f64Or(8, 0.0);
  const DType acc = accOf(floatOf(query.dtype()));

  // Per request r and query slot j: its token, and that token's position.
  const Value starts = b.slice(qsl, {0}, {R}, {1}), ends = b.slice(qsl, {1}, {R + 1}, {1});
  const Value ctx = sub(b, seq_lens, sub(b, ends, starts));  // [R] tokens before this step's
  const Shape rq{R, Q};
  const Value j = b.iota({DType::I64, rq}, 1);
  const Value tok = clampTo(b, add(b, b.broadcastInDim(starts, rq, {0}), j), 0, T - 1);
  const Value q_pos = add(b, b.broadcastInDim(ctx, rq, {0}), j);

  // q: [R, Q, Hq, D] -> [R, Hk, G * Q, D]
  Value q = b.convert(takeRows(b, query, tok), acc);
  q = b.reshape(b.transpose(b.reshape(q, {R, Q, Hk, G, D}), {0, 2, 3, 1, 4}), {R, Hk, G * Q, D});

  // The requests' blocks: [R, MB, Hk, bs, 2D] -> [R, Hk, L, 2D], then k and v.
  Value kv = b.transpose(takeRows(b, cache, table), {0, 2, 1, 3, 4});
  kv = b.convert(b.reshape(kv, {R, Hk, L, 2 * D}), acc);
  const Value k = b.slice(kv, {0, 0, 0, 0}, {R, Hk, L, D}, {1, 1, 1, 1});
  const Value v = b.slice(kv, {0, 0, 0, D}, {R, Hk, L, 2 * D}, {1, 1, 1, 1});

  Value s = b.dotGeneral(q, k, {0, 1}, {0, 1}, {3}, {3}, acc);  // [R, Hk, G*Q, L]
  s = mul(b, s, full(b, scale, s));
  if (soft_cap > 0) s = mul(b, b.unary("tanh", div(b, s, full(b, soft_cap, s))), full(b, soft_cap, s));

  // Which keys each query sees: [R, Q, L].
  const Shape rql{R, Q, L};
  const Value kp = b.iota({DType::I64, rql}, 2);
  const Value pos = b.broadcastInDim(q_pos, rql, {0, 1});
  Value visible =
      b.binary("and", b.compare(kp, b.broadcastInDim(seq_lens, rql, {0}), Cmp::LT), b.compare(kp, pos, Cmp::LE));
  if (window > 0) visible = b.binary("and", visible, b.compare(kp, sub(b, pos, scalarI64(b, window, rql)), Cmp::GT));
  const Shape s5{R, Hk, G, Q, L};
  visible = b.reshape(b.broadcastInDim(visible, s5, {0, 3, 4}), s.shape());
  // The lowest finite value, not -inf: a padding request sees no key, and its
  // (discarded) row must not become NaN.
  s = b.select(visible, s, b.constant(std::numeric_limits<float>::lowest(), acc, s.shape()));

  const Value m = b.broadcastInDim(reduceMax(b, s, {3}), s.shape(), {0, 1, 2});
  const Value e = b.unary("exponential", sub(b, s, m));
  const Value p = div(b, e, b.broadcastInDim(reduceSum(b, e, {3}), s.shape(), {0, 1, 2}));
  Value o = b.dotGeneral(p, v, {0, 1}, {0, 1}, {3}, {2}, acc);  // [R, Hk, G*Q, D]
  o = b.reshape(b.transpose(b.reshape(o, {R, Hk, G, Q, D}), {0, 3, 1, 2, 4}), {R, Q, Hq, D});

  // Back to the packed tokens: token t belongs to the request whose range
  // holds it (padding tokens past the last range read some slot; discarded).
  const Value t = b.iota({DType::I64, {T, R}}, 0);
  Value r = reduceSum(b, b.convert(b.compare(t, b.broadcastInDim(ends, {T, R}, {1}), Cmp::GE), DType::I64), {1});
  r = clampTo(b, r, 0, R - 1);
  const Value start_r = takeRows(b, starts, r);
  const Value jj = clampTo(b, sub(b, b.iota({DType::I64, {T}}, 0), start_r), 0, Q - 1);
  const Value idx = b.concatenate({b.reshape(r, {T, 1}), b.reshape(jj, {T, 1})}, 1);
  Builder::GatherDims dn;
  dn.offset_dims = {1, 2};
  dn.collapsed_slice_dims = {0, 1};
  dn.start_index_map = {0, 1};
  dn.index_vector_dim = 1;
  const Value out = b.gather(o, idx, dn, {1, 1, Hq, D});
  return {b.convert(out, query.dtype())};
}

const Registrar kPagedAttention("paged_attention", pagedAttention);

}  // namespace
}  // namespace tpu::ops
