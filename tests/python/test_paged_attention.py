"""torch.ops.tpu.paged_attention (the vLLM platform's attention) against a
per-request dense attention computed by PyTorch on the CPU, in strict, fused
and compiled modes, with mixed prefill/decode batches, grouped-query heads,
sliding windows, soft-capping, padded (bucketed) shapes and bad input."""
import math

import pytest
import torch

import torch_tpu

pytestmark = pytest.mark.usefixtures("fallback_error")  # conftest.py: CPU fallback raises


def make_batch(q_lens, ctx_lens, Hq=4, Hk=2, D=64, bs=4, dtype=torch.float32, pad_reqs=0, pad_tokens=0, seed=0):
    """A paged batch: each request's context + new tokens lie in shuffled
    blocks of the cache. Returns the op's CPU inputs and each request's dense
    keys/values for the reference."""
    g = torch.Generator().manual_seed(seed)
    R = len(q_lens)
    seq = [q + c for q, c in zip(q_lens, ctx_lens)]
    nblk = [-(-s // bs) for s in seq]
    MB = max(nblk) + 1  # one unused column, as a bucket leaves
    NB = sum(nblk) + 3
    perm = torch.randperm(NB - 1, generator=g) + 1  # block 0 stays vLLM's null block
    cache = torch.randn(NB, Hk, bs, 2 * D, generator=g).to(dtype)
    table = torch.zeros(R + pad_reqs, MB, dtype=torch.int32)
    used = 0
    for r in range(R):
        table[r, : nblk[r]] = perm[used : used + nblk[r]].to(torch.int32)
        used += nblk[r]
    T = sum(q_lens)
    query = torch.randn(T + pad_tokens, Hq, D, generator=g).to(dtype)
    qsl = torch.zeros(R + pad_reqs + 1, dtype=torch.int32)
    qsl[1 : R + 1] = torch.tensor(q_lens).cumsum(0).to(torch.int32)
    qsl[R + 1 :] = T
    seq_lens = torch.zeros(R + pad_reqs, dtype=torch.int32)
    seq_lens[:R] = torch.tensor(seq, dtype=torch.int32)
    return query, cache, table, seq_lens, qsl


def reference(query, cache, table, seq_lens, qsl, scale, window=-1, soft_cap=0.0):
    """Dense attention per request, in float64 on the CPU."""
    Hq, D = query.shape[1], query.shape[2]
    Hk, bs = cache.shape[1], cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for r in range(table.shape[0]):
        s0, s1, L = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        if s1 == s0:
            continue
        blocks = cache[table[r].long()].double()  # [MB, Hk, bs, 2D]
        kv = blocks.permute(1, 0, 2, 3).reshape(Hk, -1, 2 * D)[:, :L]
        k, v = kv[..., :D], kv[..., D:]
        k = k.repeat_interleave(Hq // Hk, 0)
        v = v.repeat_interleave(Hq // Hk, 0)
        q = query[s0:s1].double().transpose(0, 1)  # [Hq, n, D]
        s = q @ k.transpose(1, 2) * scale
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        pos = torch.arange(L - (s1 - s0), L)[:, None]
        kp = torch.arange(L)[None, :]
        visible = kp <= pos
        if window > 0:
            visible &= kp > pos - window
        s = s.masked_fill(~visible, float("-inf"))
        out[s0:s1] = (s.softmax(-1) @ v).transpose(0, 1)
    return out


def run(query, cache, table, seq_lens, qsl, scale, window=-1, soft_cap=0.0):
    args = [t.to("tpu") for t in (query, cache, table, seq_lens, qsl)]
    return torch.ops.tpu.paged_attention(*args, scale, window, soft_cap).cpu()


def check(out, ref, T, dtype):
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out[:T].double(), ref[:T], atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1, 1, 1], [5, 17, 0]),  # decode only
        ([7, 1, 12], [0, 9, 3]),  # prefill, decode and a chunked prefill mixed
        ([16], [0]),  # one prefill
    ],
)
def test_matches_dense_attention(q_lens, ctx_lens):
    batch = make_batch(q_lens, ctx_lens)
    scale = 1 / math.sqrt(64)
    check(run(*batch, scale), reference(*batch, scale), sum(q_lens), torch.float32)


def test_padding_as_buckets_make_it():
    # Two padding requests (no tokens, seq_len 0) and three padding tokens:
    # the real tokens' results are unchanged and nothing is NaN.
    q_lens, ctx_lens = [3, 1], [2, 6]
    plain = make_batch(q_lens, ctx_lens)
    padded = make_batch(q_lens, ctx_lens, pad_reqs=2, pad_tokens=3)
    scale = 0.125
    out_plain = run(*plain, scale)
    out_padded = run(*padded, scale)
    torch.testing.assert_close(out_padded[:4], out_plain[:4], atol=2e-6, rtol=2e-6)
    assert not out_padded.isnan().any()
    check(out_padded, reference(*padded, scale), 4, torch.float32)


@pytest.mark.parametrize("window,soft_cap", [(4, 0.0), (-1, 5.0)])
def test_sliding_window_and_soft_cap(window, soft_cap):
    batch = make_batch([6, 1], [5, 13])
    check(run(*batch, 0.1, window, soft_cap), reference(*batch, 0.1, window, soft_cap), 7, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    batch = make_batch([5, 1], [3, 8], dtype=dtype)
    out = run(*batch, 0.125)
    assert out.dtype == dtype
    check(out, reference(*batch, 0.125), 6, dtype)


def test_multi_query_heads():
    batch = make_batch([4, 1], [0, 6], Hq=8, Hk=1)
    check(run(*batch, 0.125), reference(*batch, 0.125), 5, torch.float32)


def test_one_program_per_bucket_and_modes():
    batch = make_batch([3, 1], [4, 9])
    ref = reference(*batch, 0.125)
    run(*batch, 0.125)
    before = torch_tpu.metrics()["compiles"]
    for _ in range(3):
        check(run(*batch, 0.125), ref, 4, torch.float32)
    assert torch_tpu.metrics()["compiles"] == before

    with torch_tpu.mode("fused"):
        args = [t.to("tpu") for t in batch]
        out = (torch.ops.tpu.paged_attention(*args, 0.125) * 2).cpu()
    check(out / 2, ref, 4, torch.float32)

    fn = torch.compile(lambda *a: torch.ops.tpu.paged_attention(*a, 0.125) + 1, backend="tpu", fullgraph=True)
    out = fn(*[t.to("tpu") for t in batch]).cpu()
    check(out - 1, ref, 4, torch.float32)


def test_bad_input():
    query, cache, table, seq_lens, qsl = (t.to("tpu") for t in make_batch([2], [1]))
    with pytest.raises(RuntimeError, match="2 \\* head_size"):
        torch.ops.tpu.paged_attention(query, cache[..., :64], table, seq_lens, qsl, 1.0)
    with pytest.raises(RuntimeError, match="do not divide"):
        torch.ops.tpu.paged_attention(query[:, :3], cache, table, seq_lens, qsl, 1.0)
    with pytest.raises(RuntimeError, match="disagree"):
        torch.ops.tpu.paged_attention(query, cache, table, seq_lens, qsl[:1], 1.0)
    with pytest.raises(RuntimeError, match="integer"):
        torch.ops.tpu.paged_attention(query, cache, table.float(), seq_lens, qsl, 1.0)
    with pytest.raises(RuntimeError, match="dtype float16 differs"):
        torch.ops.tpu.paged_attention(query, cache.half(), table, seq_lens, qsl, 1.0)
    # The device still computes.
    assert (torch.ones(2, device="tpu") + 1).cpu().tolist() == [2.0, 2.0]


@pytest.mark.parametrize(
    "q_lens,ctx_lens,Hq,Hk,bs,window",
    [
        # Prefills over several query tiles (64 tokens) and key tiles (256
        # keys), a long decode and a chunk whose last tile is read from T - 64.
        ([150, 1, 37, 1], [0, 700, 300, 5], 4, 2, 16, -1),
        ([130, 1, 70], [400, 520, 0], 4, 4, 8, 100),  # windows across tiles
        ([300], [0], 8, 2, 32, -1),  # grouped heads, one long prompt
        ([2, 3], [0, 1], 2, 1, 4, -1),  # fewer tokens than a query tile
    ],
)
def test_long_sequences_span_tiles(q_lens, ctx_lens, Hq, Hk, bs, window):
    batch = make_batch(q_lens, ctx_lens, Hq=Hq, Hk=Hk, bs=bs, pad_reqs=1, pad_tokens=5, seed=3)
    out = run(*batch, 0.125, window)
    assert not out.isnan().any()
    check(out, reference(*batch, 0.125, window), sum(q_lens), torch.float32)


def test_any_mix_of_lengths_reuses_one_program():
    # The program depends on the tokens, requests and block columns only: a
    # serving run's changing prefill/decode mixes and lengths find it.
    def batch(q_lens, ctx_lens, seed):
        query, cache, table, seq_lens, qsl = make_batch(q_lens, ctx_lens, seed=seed)
        T, R = 24, 4
        pad = lambda t, n, v=0: torch.cat([t, torch.full((n - t.shape[0], *t.shape[1:]), v, dtype=t.dtype)])
        table = torch.cat([table, torch.zeros(table.shape[0], 40 - table.shape[1], dtype=table.dtype)], 1)
        return (pad(query, T), pad(cache, 120), pad(table, R), pad(seq_lens, R),
                pad(qsl, R + 1, int(qsl[-1])))

    mixes = [([1, 1, 1, 1], [5, 50, 90, 2]), ([20, 1], [0, 130]), ([7, 1, 12], [30, 9, 3]), ([24], [100])]
    batches = [batch(q, c, seed) for seed, (q, c) in enumerate(mixes)]
    run(*batches[0], 0.125)
    before = torch_tpu.metrics()["compiles"]
    for (q_lens, _), b in zip(mixes, batches):
        check(run(*b, 0.125), reference(*b, 0.125), sum(q_lens), torch.float32)
    assert torch_tpu.metrics()["compiles"] == before
