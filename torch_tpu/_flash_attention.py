"""``aten::_flash_attention_forward`` / ``_flash_attention_backward`` on tpu.

PyTorch's variable-length attention (``torch.nn.attention.varlen.varlen_attn``, which
TorchTitan's language models use) calls these two CUDA kernels directly, packed sequences
described by cumulative lengths (``cu_seq_q``, ``cu_seq_k``). Here they are the same math as
dense masked attention over the packed tokens: a token attends to keys of its own sequence
(causally, aligned bottom-right as flash does; within ``window_size`` when given), scores in
float32, the log-sum-exp returned as flash returns it. The backward recomputes the
probabilities from that log-sum-exp. Every step is a tpu op with a native lowering.

Memory is O(tokens^2 x heads) per call, fine for the packed batches of a few thousand
tokens these tests and debug models use; a fused kernel would be the way for long contexts.
"""

from __future__ import annotations

import torch

_lib = None


def _positions(cu: torch.Tensor, total: int, device) -> tuple:
    """Each packed token's sequence index and position in it (index len(cu)-1: padding)."""
    idx = torch.arange(total, device=device)
    cu = cu.to(device=device, dtype=torch.long)
    seq = (idx[:, None] >= cu[1:][None, :]).sum(1)
    start = torch.cat([cu[:-1], cu[-1:]])[seq]
    return seq, idx - start, cu[1:] - cu[:-1]


def _mask(cu_q, cu_k, tq, tk, causal, left, right, device):
    seq_q, pos_q, len_q = _positions(cu_q, tq, device)
    seq_k, pos_k, len_k = _positions(cu_k, tk, device)
    n = len_q.numel()
    allowed = (seq_q[:, None] == seq_k[None, :]) & (seq_q[:, None] < n)
    if causal or left >= 0 or right >= 0:
        # Flash aligns a causal mask to the bottom right when a sequence has more keys than queries.
        shift = torch.cat([len_k - len_q, len_k.new_zeros(1)])[seq_q]
        diag = pos_q[:, None] + shift[:, None] - pos_k[None, :]  # >= 0: key at or before the query
        if causal:
            allowed &= diag >= 0
        if left >= 0:
            allowed &= diag <= left
        if right >= 0 and not causal:
            allowed &= diag >= -right
    return allowed


def _packed(query, key, value, cu_q, cu_k):
    """(q, k, v as [tokens, heads, dim], cu_q, cu_k, batch or None)."""
    if cu_q is not None:
        return query, key, value, cu_q, cu_k, None
    b, sq, h, d = query.shape
    sk = key.shape[1]
    dev = query.device
    cu_q = torch.arange(b + 1, device=dev) * sq
    cu_k = torch.arange(b + 1, device=dev) * sk
    return (query.reshape(b * sq, h, d), key.reshape(b * sk, key.shape[2], d), value.reshape(b * sk, value.shape[2], -1),
            cu_q, cu_k, b)


def _scores(q, k, allowed, scale):
    """q [T, H, D], k [Tk, Hk, D] -> masked scores [H, T, Tk] in float32, keys repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).float()
    kh = k.transpose(0, 1).float()
    if group > 1:
        kh = kh.repeat_interleave(group, dim=0)
    s = torch.matmul(qh, kh.transpose(1, 2)) * scale
    return s.masked_fill(~allowed, float("-inf")), group


# CUDA's kernel takes float16 and bfloat16; tpu float32 (and float64) as well, as the
# attention it stands for computes in them. Other dtypes are refused, as on CUDA.
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
             scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
             block_table=None, num_splits=None):
    for t in (query, key, value):
        if t.dtype not in _FLOATS:
            raise RuntimeError(f"_flash_attention_forward on tpu supports floating point inputs only, got {t.dtype}")
    if dropout_p != 0.0:
        raise NotImplementedError("_flash_attention_forward on tpu: dropout is not supported")
    if seqused_k is not None or alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("_flash_attention_forward on tpu: seqused_k, alibi_slopes and block_table "
                                  "are not supported")
    q, k, v, cu_q, cu_k, batch = _packed(query, key, value, cum_seq_q, cum_seq_k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    allowed = _mask(cu_q, cu_k, q.shape[0], k.shape[0], is_causal, -1 if window_size_left is None else window_size_left,
                    -1 if window_size_right is None else window_size_right, q.device)
    s, group = _scores(q, k, allowed, scale)
    lse = torch.logsumexp(s, dim=-1)  # [H, T]; -inf for a token with no key
    p = torch.where(allowed, torch.exp(s - lse[..., None]), 0.0)
    vh = v.transpose(0, 1).float()
    if group > 1:
        vh = vh.repeat_interleave(group, dim=0)
    out = torch.matmul(p, vh).transpose(0, 1).to(query.dtype)  # [T, H, Dv]
    if batch is not None:
        out = out.reshape(batch, -1, *out.shape[1:])
        lse = lse.reshape(lse.shape[0], batch, -1).transpose(0, 1)  # [B, H, S]
    rng = torch.zeros(2, dtype=torch.uint64, device=query.device)
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    return out.contiguous(), lse.contiguous(), rng, empty, empty


def _backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
              rng_state, unused, scale=None, window_size_left=None, window_size_right=None):
    if dropout_p != 0.0:
        raise NotImplementedError("_flash_attention_backward on tpu: dropout is not supported")
    varlen = cum_seq_q is not None and cum_seq_q.numel() > 0
    q, k, v, cu_q, cu_k, batch = _packed(query, key, value, cum_seq_q if varlen else None,
                                         cum_seq_k if varlen else None)
    go = grad_out.reshape(q.shape[0], q.shape[1], -1)
    o = out.reshape(q.shape[0], q.shape[1], -1)
    lse = logsumexp if batch is None else logsumexp.transpose(0, 1).reshape(logsumexp.shape[1], -1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    allowed = _mask(cu_q, cu_k, q.shape[0], k.shape[0], is_causal, -1 if window_size_left is None else window_size_left,
                    -1 if window_size_right is None else window_size_right, q.device)
    s, group = _scores(q, k, allowed, scale)
    p = torch.where(allowed, torch.exp(s - lse.float()[..., None]), 0.0)  # [H, T, Tk]
    goh = go.transpose(0, 1).float()
    vh = v.transpose(0, 1).float()
    kh = k.transpose(0, 1).float()
    if group > 1:
        vh = vh.repeat_interleave(group, dim=0)
        kh = kh.repeat_interleave(group, dim=0)
    dv = torch.matmul(p.transpose(1, 2), goh)  # [H, Tk, Dv]
    dp = torch.matmul(goh, vh.transpose(1, 2))
    delta = (goh * o.transpose(0, 1).float()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kh) * scale
    dk = torch.matmul(ds.transpose(1, 2), q.transpose(0, 1).float()) * scale
    if group > 1:
        dk = dk.reshape(-1, group, *dk.shape[1:]).sum(1)
        dv = dv.reshape(-1, group, *dv.shape[1:]).sum(1)
    dq = dq.transpose(0, 1).to(query.dtype).reshape(query.shape)
    dk = dk.transpose(0, 1).to(key.dtype).reshape(key.shape)
    dv = dv.transpose(0, 1).to(value.dtype).reshape(value.shape)
    return dq, dk, dv


def register() -> None:
    """Registers both kernels for the tpu device (once)."""
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("_flash_attention_forward", _forward, "PrivateUse1")
    _lib.impl("_flash_attention_backward", _backward, "PrivateUse1")
