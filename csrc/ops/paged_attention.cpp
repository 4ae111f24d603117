// Paged attention for serving (vLLM's model runner, torch_tpu/vllm): the
// queries of a batch of requests, packed token after token, attend to each
// request's keys and values, which lie in fixed-size blocks of a KV cache
// named by the request's row of the block table. Prefill and decode requests
// mix in one batch (vLLM v1). One op with this one lowering, so a step's
// attention is one fused XLA computation in every mode.
//
// Shapes (padding is masked, never read):
//   query            [T, Hq, D]           the batch's tokens
//   kv_cache         [NB, Hk, bs, 2 * D]  keys in [..., :D], values in [..., D:]
//   block_table      [R, MB] int          block ids of each request (0: unused)
//   seq_lens         [R] int              tokens of each request, context + new
//   query_start_loc  [R + 1] int          where each request's tokens start
// A query at position p of its request sees key k when k <= p (causal),
// k < seq_len and, with a sliding window W, k > p - W.
//
// Ragged: the program's shape depends on T, R and MB only, never on the
// step's query lengths or sequence lengths, so a serving run has one program
// per (token bucket, request bucket) and any mix of prefill and decode reuses
// it. Loops with data-dependent trip counts walk the real work, in key tiles
// with an online softmax (flash attention):
//   - decode requests (one new token) as (request, key tile) items, R per
//     step, each request's tiles up to its own length (split-K);
//   - every other request in query tiles of up to kQueryTile tokens, each tile
//     over the key tiles up to its last token's position (causal: later tiles
//     read more keys, none reads keys past its own tokens).
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "ops/common.h"

namespace tpu::ops {
namespace {

using ir::Builder;
using ir::Cmp;

// Query rows of a prefill tile: up to 64, and at most a quarter of the
// step's tokens, since a step that mixes prompt chunks into decodes (the vLLM
// platform caps such a step at twice its decodes) has chunks of at most half
// its tokens and of any length: a chunk's last tile is padded.
constexpr int64_t kQueryTile = 64;
// Keys read per step (whole blocks): a sixteenth of the longest context (the
// block table's width), between these two. Each request's last tile is read
// whole, past its end: a tile long against the context's sequences reads
// mostly padding (256-key tiles over a 512-token context); a long context
// keeps the largest tile. torch_tpu/vllm/attention.py (key_tile, for the
// padding accounting) mirrors this choice.
constexpr int64_t kMinKeyTile = 32;
constexpr int64_t kMaxKeyTile = 256;

Value i64(Builder& b, const Value& v) { return b.convert(v, DType::I64); }
Value cI64(Builder& b, int64_t v, const Shape& s = {}) { return b.constantInt(v, DType::I64, s); }
Value bcast(Builder& b, const Value& v, const Shape& s, const std::vector<int64_t>& dims) {
  return b.broadcastInDim(v, s, dims);
}
Value band(Builder& b, const Value& x, const Value& y) { return b.binary("and", x, y); }
Value minI(Builder& b, const Value& x, const Value& y) { return b.binary("minimum", x, y); }
Value maxI(Builder& b, const Value& x, const Value& y) { return b.binary("maximum", x, y); }
Value clampTo(Builder& b, const Value& x, int64_t lo, int64_t hi) {
  return b.clamp(cI64(b, lo, x.shape()), x, cI64(b, hi, x.shape()));
}
// Element i of a 1-d value, i a scalar.
Value at(Builder& b, const Value& v, const Value& i) { return b.reshape(b.dynamicSlice(v, {i}, {1}), {}); }

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
void checkArguments(const Value& query, const Value& cache, const Value& table, const Value& seq_lens,
                    const Value& qsl) {
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
  if (table.shape()[0] == 0 || table.shape()[1] == 0 || query.shape()[0] == 0)
    fail("needs at least one request, one block column and one token");
  if (cache.dtype() != query.dtype())
    fail("kv_cache dtype " + std::string(ir::dtypeName(cache.dtype())) + " differs from query dtype " +
         ir::dtypeName(query.dtype()));
}

struct Dims {
  int64_t T, Hq, Hk, G, D, bs, R, MB, Kb, L;  // L = Kb * bs keys per step
  double scale, soft_cap;
  int64_t window;
  DType acc;
};

// One key tile of online softmax for queries q [N, Hk, M, D] against the
// keys of `blocks` [N, Kb] (N requests' rows). `visible` [N, M, L] says which
// keys each query row sees. State m, l [N, Hk, M], o [N, Hk, M, D].
struct Online {
  Value m, l, o;
};
Online keyTile(Builder& b, const Dims& d, const Value& q, const Value& cache, const Value& blocks, const Value& visible,
               const Online& st) {
  const int64_t N = q.shape()[0];
  // [N, Kb, Hk, bs, 2D] -> [N, Hk, L, 2D]
  Value kv = b.transpose(takeRows(b, cache, blocks), {0, 2, 1, 3, 4});
  kv = b.convert(b.reshape(kv, {N, d.Hk, d.L, 2 * d.D}), d.acc);
  const Value k = b.slice(kv, {0, 0, 0, 0}, {N, d.Hk, d.L, d.D}, {1, 1, 1, 1});
  const Value v = b.slice(kv, {0, 0, 0, d.D}, {N, d.Hk, d.L, 2 * d.D}, {1, 1, 1, 1});
  Value s = b.dotGeneral(q, k, {0, 1}, {0, 1}, {3}, {3}, d.acc);  // [N, Hk, M, L]
  s = mul(b, s, full(b, d.scale, s));
  if (d.soft_cap > 0) s = mul(b, b.unary("tanh", div(b, s, full(b, d.soft_cap, s))), full(b, d.soft_cap, s));
  const Value vis = bcast(b, visible, s.shape(), {0, 2, 3});
  const Value lowest = b.constant(std::numeric_limits<float>::lowest(), d.acc, s.shape());
  s = b.select(vis, s, lowest);
  const Value m = b.binary("maximum", st.m, reduceMax(b, s, {3}));
  // Masked keys weigh 0 even in a row that has seen none yet (m still lowest).
  const Value p = b.select(vis, b.unary("exponential", sub(b, s, bcast(b, m, s.shape(), {0, 1, 2}))), b.zeros(s.type));
  const Value corr = b.unary("exponential", sub(b, st.m, m));
  const Value l = add(b, mul(b, st.l, corr), reduceSum(b, p, {3}));
  const Value pv = b.dotGeneral(p, v, {0, 1}, {0, 1}, {3}, {2}, d.acc);  // [N, Hk, M, D]
  const Value o = add(b, mul(b, st.o, bcast(b, corr, pv.shape(), {0, 1, 2})), pv);
  return {m, l, o};
}

Online initial(Builder& b, const Dims& d, int64_t N, int64_t M) {
  return {b.constant(std::numeric_limits<float>::lowest(), d.acc, {N, d.Hk, M}), b.constant(0, d.acc, {N, d.Hk, M}),
          b.constant(0, d.acc, {N, d.Hk, M, d.D})};
}

// o / l; rows that saw no key (padding) give 0, not NaN.
Value normalized(Builder& b, const Online& st) {
  const Value l = st.l;
  const Value safe = b.select(b.compare(l, full(b, 0, l), Cmp::GT), l, full(b, 1, l));
  return div(b, st.o, bcast(b, safe, st.o.shape(), {0, 1, 2}));
}

// Keys at positions kp [..] a query at position pos sees, given the request's
// sequence length and the first key this tile may add (earlier ones were read).
Value sees(Builder& b, const Dims& d, const Value& kp, const Value& pos, const Value& seq_len, const Value& first) {
  Value v = band(b, b.compare(kp, seq_len, Cmp::LT), b.compare(kp, pos, Cmp::LE));
  v = band(b, v, b.compare(kp, first, Cmp::GE));
  if (d.window > 0) v = band(b, v, b.compare(kp, sub(b, pos, cI64(b, d.window, kp.shape())), Cmp::GT));
  return v;
}

// The first block a step reads: `kb`, moved back so Kb blocks fit in the row
// (dynamic_slice would clamp it the same way; the keys before kb are masked).
Value tileStart(Builder& b, const Dims& d, const Value& kb) { return minI(b, kb, cI64(b, d.MB - d.Kb)); }

// Decode requests (one new token each): [R, Hq, D]. The work is a list of
// (request, key tile) items, each request's tiles up to its own length (from
// its window's start), taken R at a time: rows of unequal lengths read no
// tiles past their ends, as a loop over all rows up to the longest would
// (split-K, as flash-decoding does). Each item's online softmax starts
// afresh; items merge into their request's running max, sum and output
// through a one-hot [items, R] matrix (a matmul; no scatter).
Value decodeAttention(Builder& b, const Dims& d, const Value& query, const Value& cache, const Value& table,
                      const Value& starts, const Value& qlen, const Value& seq_lens) {
  const int64_t R = d.R;
  const Value is_dec = b.compare(qlen, cI64(b, 1, qlen.shape()), Cmp::EQ);
  const Value len = b.select(is_dec, seq_lens, cI64(b, 0, seq_lens.shape()));      // 0: not a decode
  Value q = b.convert(takeRows(b, query, clampTo(b, starts, 0, d.T - 1)), d.acc);  // [R, Hq, D]
  q = b.reshape(q, {R, d.Hk, d.G, d.D});
  // Tiles of request r: [first_r, ceil(len_r / L)).
  const Value tileL = cI64(b, d.L, len.shape());
  Value first = cI64(b, 0, len.shape());
  if (d.window > 0)
    first = b.binary("divide", maxI(b, sub(b, len, cI64(b, d.window, len.shape())), cI64(b, 0, len.shape())), tileL);
  const Value end = b.binary("divide", add(b, len, cI64(b, d.L - 1, len.shape())), tileL);
  const Value n = b.select(is_dec, maxI(b, sub(b, end, first), cI64(b, 0, len.shape())), cI64(b, 0, len.shape()));
  const Value item_end = scan(b, n, 0, "add", 0);  // [R] inclusive cumsum
  const Value total = reduceSum(b, n, {0});
  const Value lowest = b.constant(std::numeric_limits<float>::lowest(), d.acc, {R, d.Hk, d.G});
  // State: k, total, q, cache, table, len, first, item_end, n, m, l, o.
  auto out = b.whileLoop(
      {cI64(b, 0), total, q, cache, table, len, first, item_end, n, lowest, b.constant(0, d.acc, {R, d.Hk, d.G}),
       b.constant(0, d.acc, {R, d.Hk, d.G, d.D})},
      [&](Builder& bb, const std::vector<Value>& s) {
        return std::vector<Value>{bb.compare(mul(bb, s[0], cI64(bb, R)), s[1], Cmp::LT)};
      },
      [&](Builder& bb, const std::vector<Value>& s) {
        const Value &k = s[0], &qs = s[2], &tab = s[4], &ln = s[5], &fst = s[6], &ie = s[7], &cnt = s[8];
        // Items k R + j: their request and tile.
        const Value item = add(bb, bb.iota({DType::I64, {R}}, 0), bcast(bb, mul(bb, k, cI64(bb, R)), {R}, {}));
        const Value valid = bb.compare(item, bcast(bb, s[1], {R}, {}), Cmp::LT);
        const Value row = clampTo(
            bb,
            reduceSum(
                bb,
                bb.convert(bb.compare(bcast(bb, ie, {R, R}, {1}), bcast(bb, item, {R, R}, {0}), Cmp::LE), DType::I64),
                {1}),
            0, R - 1);
        const Value tile =
            add(bb, takeRows(bb, fst, row), sub(bb, item, sub(bb, takeRows(bb, ie, row), takeRows(bb, cnt, row))));
        const Value kb = mul(bb, tile, cI64(bb, d.Kb, {R}));
        const Value b0 = minI(bb, kb, cI64(bb, d.MB - d.Kb, {R}));
        const Value cols = add(bb, bb.iota({DType::I64, {R, d.Kb}}, 1), bcast(bb, b0, {R, d.Kb}, {0}));
        const Value flat = add(bb, cols, bcast(bb, mul(bb, row, cI64(bb, d.MB, {R})), {R, d.Kb}, {0}));
        const Value blocks = bb.convert(takeRows(bb, bb.reshape(tab, {R * d.MB}), flat), DType::I64);
        const Shape rl{R, 1, d.L};
        const Value kp = add(bb, bb.iota({DType::I64, rl}, 2), bcast(bb, mul(bb, b0, cI64(bb, d.bs, {R})), rl, {0}));
        const Value lens = bcast(bb, takeRows(bb, ln, row), rl, {0});
        const Value from = bcast(bb, mul(bb, kb, cI64(bb, d.bs, {R})), rl, {0});
        Value vis = sees(bb, d, kp, sub(bb, lens, cI64(bb, 1, rl)), lens, from);
        vis = band(bb, vis, bcast(bb, valid, rl, {0}));
        const Value visible = bcast(bb, vis, {R, d.G, d.L}, {0, 1, 2});
        const Online item_st = keyTile(bb, d, takeRows(bb, qs, row), s[3], blocks, visible, initial(bb, d, R, d.G));
        // Merge the items into their requests' states.
        const Shape rr{R, R};
        const Value hot = band(bb, bb.compare(bb.iota({DType::I64, rr}, 1), bcast(bb, row, rr, {0}), Cmp::EQ),
                               bcast(bb, valid, rr, {0}));  // [item, request]
        const Shape rrhg{R, R, d.Hk, d.G};
        const Value low = bb.constant(std::numeric_limits<float>::lowest(), d.acc, rrhg);
        const Value item_max =
            reduceMax(bb, bb.select(bcast(bb, hot, rrhg, {0, 1}), bcast(bb, item_st.m, rrhg, {0, 2, 3}), low), {0});
        const Value m = bb.binary("maximum", s[9], item_max);  // [R, Hk, G]
        const Value alpha = bb.unary("exponential", sub(bb, s[9], m));
        const Value scale =
            bb.select(bcast(bb, valid, item_st.m.shape(), {0}),
                      bb.unary("exponential", sub(bb, item_st.m, takeRows(bb, m, row))), bb.zeros(item_st.m.type));
        const Value h = bb.convert(hot, d.acc);
        const Value l =
            add(bb, mul(bb, s[10], alpha), bb.dotGeneral(h, mul(bb, item_st.l, scale), {}, {}, {0}, {0}, d.acc));
        const Value o = add(bb, mul(bb, s[11], bcast(bb, alpha, s[11].shape(), {0, 1, 2})),
                            bb.dotGeneral(h, mul(bb, item_st.o, bcast(bb, scale, item_st.o.shape(), {0, 1, 2})), {}, {},
                                          {0}, {0}, d.acc));
        return std::vector<Value>{add(bb, k, cI64(bb, 1)), s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], m, l, o};
      });
  return b.reshape(normalized(b, {out[9], out[10], out[11]}), {R, d.Hq, d.D});
}
// The other requests (more than one new token) in query tiles of C tokens,
// written into `out` [T, Hq, D] (rows of decode tokens are left as they are).
Value prefillAttention(Builder& b, const Dims& d, const Value& query, const Value& cache, const Value& table,
                       const Value& starts, const Value& qlen, const Value& seq_lens, Value out) {
  const int64_t C = std::min(kQueryTile, std::max<int64_t>(1, d.T / 4));
  const Value is_pre = b.compare(qlen, cI64(b, 1, qlen.shape()), Cmp::GT);
  const Value tiles =
      b.select(is_pre, b.binary("divide", add(b, qlen, cI64(b, C - 1, qlen.shape())), cI64(b, C, qlen.shape())),
               cI64(b, 0, qlen.shape()));
  const Value tile_end = scan(b, tiles, 0, "add", 0);  // [R] inclusive cumsum
  const Value total = reduceSum(b, tiles, {0});
  const Value ctx = sub(b, seq_lens, qlen);

  // State: work item w, total, query, cache, table, starts, qlen, ctx, seq_lens, tile_end, out.
  auto res = b.whileLoop(
      {cI64(b, 0), total, query, cache, table, starts, qlen, ctx, seq_lens, tile_end, out},
      [&](Builder& bb, const std::vector<Value>& s) { return std::vector<Value>{bb.compare(s[0], s[1], Cmp::LT)}; },
      [&](Builder& bb, const std::vector<Value>& s) {
        const Value &w = s[0], &qry = s[2], &cch = s[3], &tab = s[4], &te = s[9];
        // The request that holds work item w, and the tile's index in it.
        const Value r =
            reduceSum(bb, bb.convert(bb.compare(te, bcast(bb, w, te.shape(), {}), Cmp::LE), DType::I64), {0});
        const Value rt = clampTo(bb, r, 0, d.R - 1);
        const Value start = at(bb, s[5], rt), n = at(bb, s[6], rt), c0 = at(bb, s[7], rt), len = at(bb, s[8], rt);
        const Value first_tile = sub(bb, at(bb, te, rt), bb.binary("divide", add(bb, n, cI64(bb, C - 1)), cI64(bb, C)));
        const Value i = sub(bb, w, first_tile);
        const Value tok0 = add(bb, start, mul(bb, i, cI64(bb, C)));  // the tile's first token
        const Value s0 = minI(bb, tok0, cI64(bb, d.T - C));          // where the C rows are read
        // Row j holds token s0 + j: this tile's when in [tok0, start + n).
        const Value tok = add(bb, bb.iota({DType::I64, {C}}, 0), bcast(bb, s0, {C}, {}));
        const Value mine = band(bb, bb.compare(tok, bcast(bb, tok0, {C}, {}), Cmp::GE),
                                bb.compare(tok, bcast(bb, add(bb, start, n), {C}, {}), Cmp::LT));
        const Value pos = add(bb, sub(bb, tok, bcast(bb, start, {C}, {})), bcast(bb, c0, {C}, {}));
        Value q = bb.convert(bb.dynamicSlice(qry, {s0, cI64(bb, 0), cI64(bb, 0)}, {C, d.Hq, d.D}), d.acc);
        q = bb.reshape(bb.transpose(bb.reshape(q, {C, d.Hk, d.G, d.D}), {1, 2, 0, 3}), {1, d.Hk, d.G * C, d.D});
        // Keys up to the tile's last position; with a window, from its first.
        const Value last_pos = add(bb, c0, minI(bb, n, add(bb, sub(bb, tok0, start), cI64(bb, C))));
        const Value kend = minI(bb, last_pos, len);  // exclusive
        Value kfirst = cI64(bb, 0);
        if (d.window > 0)
          kfirst = maxI(bb, sub(bb, add(bb, c0, sub(bb, tok0, start)), cI64(bb, d.window - 1)), cI64(bb, 0));
        const Value row = bb.reshape(bb.dynamicSlice(tab, {rt, cI64(bb, 0)}, {1, d.MB}), {d.MB});
        const Online init = initial(bb, d, 1, d.G * C);
        // Inner state: kb, kend, q, cache, row, pos, mine, len, m, l, o.
        auto kin = bb.whileLoop(
            {bb.binary("divide", kfirst, cI64(bb, d.bs)), kend, q, cch, row, pos, mine, len, init.m, init.l, init.o},
            [&](Builder& k, const std::vector<Value>& t) {
              return std::vector<Value>{k.compare(mul(k, t[0], cI64(k, d.bs)), t[1], Cmp::LT)};
            },
            [&](Builder& k, const std::vector<Value>& t) {
              const Value& kb = t[0];
              const Value b0 = tileStart(k, d, kb);
              const Value blocks = k.reshape(k.dynamicSlice(t[4], {b0}, {d.Kb}), {1, d.Kb});
              const Shape cl{C, d.L};
              const Value kp = add(k, k.iota({DType::I64, cl}, 1), bcast(k, mul(k, b0, cI64(k, d.bs)), cl, {}));
              Value vis = sees(k, d, kp, bcast(k, t[5], cl, {0}), bcast(k, t[7], cl, {}),
                               bcast(k, mul(k, kb, cI64(k, d.bs)), cl, {}));
              vis = band(k, vis, bcast(k, t[6], cl, {0}));
              // Rows of q are (g, c): [1, G*C, L].
              const Value visible = k.reshape(bcast(k, vis, {d.G, C, d.L}, {1, 2}), {1, d.G * C, d.L});
              const Online st = keyTile(k, d, t[2], t[3], k.convert(blocks, DType::I64), visible, {t[8], t[9], t[10]});
              return std::vector<Value>{
                  add(k, kb, cI64(k, d.Kb)), t[1], t[2], t[3], t[4], t[5], t[6], t[7], st.m, st.l, st.o};
            });
        Value o = normalized(bb, {kin[8], kin[9], kin[10]});  // [1, Hk, G*C, D]
        o = bb.reshape(bb.transpose(bb.reshape(o, {d.Hk, d.G, C, d.D}), {2, 0, 1, 3}), {C, d.Hq, d.D});
        o = bb.convert(o, s[10].dtype());
        const Value at0 = cI64(bb, 0);
        const Value old = bb.dynamicSlice(s[10], {s0, at0, at0}, {C, d.Hq, d.D});
        const Value keep = bcast(bb, mine, {C, d.Hq, d.D}, {0});
        const Value next = bb.dynamicUpdateSlice(s[10], bb.select(keep, o, old), {s0, at0, at0});
        return std::vector<Value>{add(bb, w, cI64(bb, 1)), s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], next};
      });
  return res[10];
}

std::vector<Value> pagedAttention(Ctx& c) {
  Builder& b = c.b;
  const Value query = c.tensor(0), cache = c.tensor(1);
  checkArguments(query, cache, c.tensor(2), c.tensor(3), c.tensor(4));
  Dims d{};
  d.T = query.shape()[0];
  d.Hq = query.shape()[1];
  d.D = query.shape()[2];
  d.Hk = cache.shape()[1];
  d.bs = cache.shape()[2];
  d.G = d.Hq / d.Hk;
  const Value table = i64(b, c.tensor(2)), seq_lens = i64(b, c.tensor(3)), qsl = i64(b, c.tensor(4));
  d.R = table.shape()[0];
  d.MB = table.shape()[1];
  const int64_t min_blocks = std::max<int64_t>(1, (kMinKeyTile + d.bs - 1) / d.bs);
  d.Kb = std::min(std::clamp<int64_t>((d.MB + 15) / 16, min_blocks, std::max<int64_t>(1, kMaxKeyTile / d.bs)), d.MB);
  d.L = d.Kb * d.bs;
  d.scale = c.f64(5);
  d.window = c.i64Or(6, -1);
  d.soft_cap = c.f64Or(7, 0.0);
  d.acc = accOf(floatOf(query.dtype()));

  const Value starts = b.slice(qsl, {0}, {d.R}, {1}), ends = b.slice(qsl, {1}, {d.R + 1}, {1});
  const Value qlen = sub(b, ends, starts);

  // Decode results, placed at their tokens: token t belongs to the request
  // whose range holds it.
  const Value dec = decodeAttention(b, d, query, cache, table, starts, qlen, seq_lens);  // [R, Hq, D]
  const Value t = b.iota({DType::I64, {d.T, d.R}}, 0);
  Value r = reduceSum(b, b.convert(b.compare(t, bcast(b, ends, {d.T, d.R}, {1}), Cmp::GE), DType::I64), {1});
  r = clampTo(b, r, 0, d.R - 1);
  const Value tok_is_dec = b.compare(takeRows(b, qlen, r), cI64(b, 1, {d.T}), Cmp::EQ);
  Value out = b.convert(takeRows(b, dec, r), query.dtype());  // [T, Hq, D]
  out = b.select(bcast(b, tok_is_dec, out.shape(), {0}), out, b.zeros(out.type));
  out = prefillAttention(b, d, query, cache, table, starts, qlen, seq_lens, out);
  return {out};
}

const Registrar kPagedAttention("paged_attention", pagedAttention);

}  // namespace
}  // namespace tpu::ops
