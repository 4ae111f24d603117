"""Example Pallas kernels (pure JAX) meant to be wrapped as PyTorch ops.

Each forward pass is a Pallas kernel launched with ``pl.pallas_call(...,
interpret=INTERPRET)``. With ``INTERPRET = True`` (the default) Pallas lowers
the kernel to ordinary XLA ops (a loop over the grid), so the code runs on any
backend, CPU included. On a TPU or GPU, set ``INTERPRET = False`` to compile
the same kernel source with Mosaic / Triton instead. The flag is read when a
function is traced, so change it before the first call of a jitted wrapper.

Each backward pass is written in plain ``jax.numpy`` and gives the exact
gradient of the matching forward pass.

All kernels work in float32. Block sizes are keyword arguments. A block that is
larger than its dimension is shrunk to fit. A dimension that is not a multiple
of its block raises ``ValueError``.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

INTERPRET = True


def _block_size(dim, block, name):
    """Clamps `block` to `dim` and checks that it tiles `dim` exactly."""
    block = min(block, dim)
    if block <= 0 or dim % block:
        raise ValueError(f"{name}={dim} must be a positive multiple of the block size {block}")
    return block


# ---------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------


def _rms_norm_kernel(x_ref, w_ref, o_ref, *, eps):
    x = x_ref[...]  # [block_rows, hidden]
    inv_rms = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    o_ref[...] = x * inv_rms * w_ref[...]


def rms_norm(x, weight, eps=1e-6, *, block_rows=128):
    """RMSNorm over the last axis: x * rsqrt(mean(x**2, -1) + eps) * weight."""
    rows, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {weight.shape} does not match hidden size {hidden}")
    block_rows = _block_size(rows, block_rows, "rows")
    return pl.pallas_call(
        functools.partial(_rms_norm_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows // block_rows,),
        in_specs=[
            pl.BlockSpec((block_rows, hidden), lambda i: (i, 0)),
            pl.BlockSpec((1, hidden), lambda i: (0, 0)),
        ],
        out_specs=pl.BlockSpec((block_rows, hidden), lambda i: (i, 0)),
        interpret=INTERPRET,
    )(x, weight.reshape(1, hidden))


def rms_norm_bwd(x, weight, dy, eps=1e-6):
    """Gradients (dx, dweight) of rms_norm given the output cotangent dy."""
    inv_rms = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    x_hat = x * inv_rms
    dweight = jnp.sum(dy * x_hat, axis=0)
    dx_hat = dy * weight
    dx = inv_rms * (dx_hat - x_hat * jnp.mean(dx_hat * x_hat, axis=-1, keepdims=True))
    return dx, dweight


# ---------------------------------------------------------------------------
# Softmax cross-entropy
# ---------------------------------------------------------------------------


def _softmax_cross_entropy_kernel(logits_ref, labels_ref, loss_ref):
    logits = logits_ref[...]  # [block_rows, classes]
    labels = labels_ref[...]  # [block_rows]
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    shifted = logits - row_max
    log_sum_exp = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    classes = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    label_logit = jnp.sum(jnp.where(classes == labels[:, None], shifted, 0.0), axis=-1)
    loss_ref[...] = log_sum_exp - label_logit


def softmax_cross_entropy(logits, labels, *, block_rows=128):
    """Per-row loss logsumexp(logits) - logits[label] for int32 labels."""
    rows, classes = logits.shape
    if labels.shape != (rows,):
        raise ValueError(f"labels shape {labels.shape} does not match rows {rows}")
    block_rows = _block_size(rows, block_rows, "rows")
    return pl.pallas_call(
        _softmax_cross_entropy_kernel,
        out_shape=jax.ShapeDtypeStruct((rows,), logits.dtype),
        grid=(rows // block_rows,),
        in_specs=[
            pl.BlockSpec((block_rows, classes), lambda i: (i, 0)),
            pl.BlockSpec((block_rows,), lambda i: (i,)),
        ],
        out_specs=pl.BlockSpec((block_rows,), lambda i: (i,)),
        interpret=INTERPRET,
    )(logits, labels.astype(jnp.int32))


def softmax_cross_entropy_bwd(logits, labels, dloss):
    """Gradient of softmax_cross_entropy w.r.t. logits: (softmax - onehot) * dloss."""
    probs = jax.nn.softmax(logits, axis=-1)
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    return (probs - onehot) * dloss[:, None]


# ---------------------------------------------------------------------------
# Flash attention
# ---------------------------------------------------------------------------


def _flash_attention_kernel(q_ref, k_ref, v_ref, o_ref, *, sm_scale, causal, block_k):
    # q_ref/o_ref: one [block_q, d] query block. k_ref/v_ref: the whole
    # [kv_len, d] key and value sequence for this (batch, head).
    block_q, d = q_ref.shape
    kv_len = k_ref.shape[0]
    q_start = pl.program_id(2) * block_q
    q = q_ref[...] * sm_scale

    def body(j, carry):
        m, l, acc = carry  # running max, running sum, unnormalized output
        k_start = j * block_k
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        s = lax.dot_general(  # q @ k.T
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if causal:
            q_idx = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)
            k_idx = k_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(k_idx <= q_idx, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)  # rescales what was accumulated so far
        p = jnp.exp(s - m_new[:, None])
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[:, None] * acc + jnp.dot(p, v, preferred_element_type=jnp.float32)
        return m_new, l, acc

    if causal:
        # Key blocks that lie entirely above the diagonal are skipped. Key 0 is
        # never masked, so every row has a finite max after the first block.
        num_k_blocks = lax.div(q_start + block_q + block_k - 1, block_k)
    else:
        num_k_blocks = kv_len // block_k
    init = (
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, d), jnp.float32),
    )
    _, l, acc = lax.fori_loop(0, num_k_blocks, body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def flash_attention(q, k, v, causal=False, sm_scale=None, *, block_q=64, block_k=64):
    """Blocked attention softmax(q k^T * sm_scale [+ causal mask]) v with online softmax."""
    batch, heads, q_len, d = q.shape
    kv_len = k.shape[2]
    if k.shape != (batch, heads, kv_len, d) or v.shape != k.shape:
        raise ValueError(f"incompatible shapes q={q.shape} k={k.shape} v={v.shape}")
    if causal and q_len != kv_len:
        raise ValueError("causal attention requires q_len == kv_len")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    block_q = _block_size(q_len, block_q, "q_len")
    block_k = _block_size(kv_len, block_k, "kv_len")

    kernel = functools.partial(
        _flash_attention_kernel, sm_scale=sm_scale, causal=causal, block_k=block_k)
    q_spec = pl.BlockSpec((None, None, block_q, d), lambda b, h, i: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, kv_len, d), lambda b, h, i: (b, h, 0, 0))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(batch, heads, q_len // block_q),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        interpret=INTERPRET,
    )(q, k, v)


def flash_attention_bwd(q, k, v, do, causal=False, sm_scale=None):
    """Gradients (dq, dk, dv) of flash_attention, recomputing the probabilities."""
    q_len, kv_len, d = q.shape[2], k.shape[2], q.shape[3]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * sm_scale
    if causal:
        mask = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None]
        s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    dv = jnp.einsum("bhqk,bhqd->bhkd", p, do)
    dp = jnp.einsum("bhqd,bhkd->bhqk", do, v)
    ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))  # softmax vjp
    dq = jnp.einsum("bhqk,bhkd->bhqd", ds, k) * sm_scale
    dk = jnp.einsum("bhqk,bhqd->bhkd", ds, q) * sm_scale
    return dq, dk, dv
