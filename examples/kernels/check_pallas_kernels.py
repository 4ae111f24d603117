"""Checks the Pallas example kernels in pallas_kernels.py against plain jax.numpy.

Run with:  python examples/kernels/check_pallas_kernels.py

Each forward kernel is compared with a jax.numpy reference, each hand-written
backward with jax.vjp of that reference, and each function is lowered to
StableHLO to confirm it contains no custom_call (so it is plain XLA code).
Prints PASS/FAIL per check and exits non-zero if any check fails.
"""

import functools
import math
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

RTOL = ATOL = 1e-5
failures = []


def check(name, fn):
    """Runs fn(); it returns None on success or raises / returns an error message."""
    try:
        error = fn()
    except Exception:  # noqa: BLE001 - report any failure and keep going
        error = traceback.format_exc(limit=3)
    print(f"{'FAIL' if error else 'PASS'}  {name}" + (f"\n      {error}" if error else ""))
    if error:
        failures.append(name)


def compare(actual, expected, rtol=RTOL, atol=ATOL):
    """Returns None if all array pairs match, else a description of the worst mismatch."""
    for i, (a, e) in enumerate(zip(jax.tree.leaves(actual), jax.tree.leaves(expected))):
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape:
            return f"output {i}: shape {a.shape} != {e.shape}"
        if not np.allclose(a, e, rtol=rtol, atol=atol):
            return f"output {i}: max abs err {np.max(np.abs(a - e)):.3g}"
    return None


def no_custom_call(fn, *args):
    """Returns None if jit(fn) lowers to StableHLO without any custom_call."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    asm = jax.jit(fn).lower(*specs).compiler_ir("stablehlo").operation.get_asm(
        print_generic_op_form=True)
    return "lowered StableHLO contains custom_call" if "custom_call" in asm else None


# --- jax.numpy references ---------------------------------------------------


def rms_norm_ref(x, weight, eps=1e-6):
    """Reference RMSNorm."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def softmax_cross_entropy_ref(logits, labels):
    """Reference per-row softmax cross-entropy."""
    label_logits = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return jax.nn.logsumexp(logits, axis=-1) - label_logits


def attention_ref(q, k, v, causal=False, sm_scale=None):
    """Reference (unblocked) scaled dot-product attention."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * sm_scale
    if causal:
        q_len, kv_len = s.shape[-2:]
        s = jnp.where(jnp.tril(jnp.ones((q_len, kv_len), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


# --- checks -------------------------------------------------------------------


def raises_value_error(fn, *args):
    """Returns None if fn(*args) raises ValueError, else an error message."""
    try:
        fn(*args)
    except ValueError:
        return None
    return "expected ValueError"


def check_rms_norm(key, rows, hidden, block_rows):
    """Checks rms_norm and rms_norm_bwd on one shape."""
    kx, kw, kd = jax.random.split(key, 3)
    x = jax.random.normal(kx, (rows, hidden), jnp.float32)
    w = 1.0 + 0.1 * jax.random.normal(kw, (hidden,), jnp.float32)
    dy = jax.random.normal(kd, (rows, hidden), jnp.float32)
    fwd = functools.partial(pk.rms_norm, block_rows=block_rows)
    tag = f"rms_norm ({rows}, {hidden}) block_rows={block_rows}"

    check(f"{tag} forward", lambda: compare(jax.jit(fwd)(x, w), rms_norm_ref(x, w)))
    _, vjp = jax.vjp(rms_norm_ref, x, w)
    check(f"{tag} backward", lambda: compare(jax.jit(pk.rms_norm_bwd)(x, w, dy), vjp(dy)))
    check(f"{tag} no custom_call", lambda: no_custom_call(fwd, x, w)
          or no_custom_call(pk.rms_norm_bwd, x, w, dy))


def check_softmax_cross_entropy(key, rows, classes, block_rows):
    """Checks softmax_cross_entropy and its backward on one shape."""
    kl, kt, kd = jax.random.split(key, 3)
    logits = 3.0 * jax.random.normal(kl, (rows, classes), jnp.float32)
    labels = jax.random.randint(kt, (rows,), 0, classes, jnp.int32)
    dloss = jax.random.normal(kd, (rows,), jnp.float32)
    fwd = functools.partial(pk.softmax_cross_entropy, block_rows=block_rows)
    tag = f"softmax_cross_entropy ({rows}, {classes}) block_rows={block_rows}"

    check(f"{tag} forward", lambda: compare(
        jax.jit(fwd)(logits, labels), softmax_cross_entropy_ref(logits, labels)))
    _, vjp = jax.vjp(lambda l: softmax_cross_entropy_ref(l, labels), logits)
    check(f"{tag} backward", lambda: compare(
        jax.jit(pk.softmax_cross_entropy_bwd)(logits, labels, dloss), vjp(dloss)))
    check(f"{tag} no custom_call", lambda: no_custom_call(fwd, logits, labels)
          or no_custom_call(pk.softmax_cross_entropy_bwd, logits, labels, dloss))


def check_flash_attention(key, shape, causal, block_q, block_k, kv_len=None):
    """Checks flash_attention and flash_attention_bwd on one configuration."""
    batch, heads, q_len, d = shape
    kv_shape = (batch, heads, kv_len or q_len, d)
    kq, kk, kv, kd = jax.random.split(key, 4)
    q, do = (jax.random.normal(key_, shape, jnp.float32) for key_ in (kq, kd))
    k, v = (jax.random.normal(key_, kv_shape, jnp.float32) for key_ in (kk, kv))
    fwd = functools.partial(
        pk.flash_attention, causal=causal, block_q=block_q, block_k=block_k)
    bwd = functools.partial(pk.flash_attention_bwd, causal=causal)
    tag = (f"flash_attention {shape} kv_len={kv_shape[2]} causal={causal} "
           f"block_q={block_q} block_k={block_k}")

    check(f"{tag} forward",
          lambda: compare(jax.jit(fwd)(q, k, v), attention_ref(q, k, v, causal)))
    _, vjp = jax.vjp(functools.partial(attention_ref, causal=causal), q, k, v)
    check(f"{tag} backward", lambda: compare(jax.jit(bwd)(q, k, v, do), vjp(do)))
    check(f"{tag} no custom_call", lambda: no_custom_call(fwd, q, k, v)
          or no_custom_call(bwd, q, k, v, do))


def main():
    """Runs all checks; returns the process exit code."""
    keys = iter(jax.random.split(jax.random.key(0), 16))

    check_rms_norm(next(keys), 32, 256, block_rows=8)
    check_rms_norm(next(keys), 64, 128, block_rows=128)  # block clamped to rows
    check_softmax_cross_entropy(next(keys), 16, 512, block_rows=8)
    check_softmax_cross_entropy(next(keys), 48, 1000, block_rows=16)
    for causal in (False, True):
        check_flash_attention(next(keys), (2, 2, 128, 64), causal, block_q=32, block_k=64)
        check_flash_attention(next(keys), (2, 2, 128, 64), causal, block_q=64, block_k=32)
    # Cross attention: kv_len != q_len (non-causal only).
    check_flash_attention(next(keys), (1, 2, 32, 16), False, block_q=16, block_k=16, kv_len=80)

    x = jnp.zeros((30, 8), jnp.float32)
    bad_rms_norm = functools.partial(pk.rms_norm, block_rows=8)
    check("rms_norm rejects rows not a multiple of block_rows",
          lambda: raises_value_error(bad_rms_norm, x, jnp.ones(8)))
    q = jnp.zeros((1, 1, 96, 16), jnp.float32)
    bad_flash_attention = functools.partial(pk.flash_attention, block_q=64)
    check("flash_attention rejects q_len not a multiple of block_q",
          lambda: raises_value_error(bad_flash_attention, q, q, q))

    print(f"\n{'FAILED: ' + ', '.join(failures) if failures else 'All checks passed.'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
