"""Check the example AdamW FFI handler through JAX's own CPU runtime.

    python examples/kernels/ffi_adamw/check_adamw.py [LIB.so]

Without an argument the library is built (or reused) in a temporary-directory
cache via build.py. The handler is registered as the FFI target
"torch_tpu_example_adamw" for the "cpu" platform, run for steps 1, 2, 3 on
random float32 data, and compared with a NumPy version of the
torch.optim.AdamW formula (and with torch.optim.AdamW itself when torch is
importable). A call with mismatched shapes must fail with the handler's
message. Prints PASS or FAIL; the exit status is non-zero on failure.
"""

import ctypes
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import build  # noqa: E402  (examples/kernels/ffi_adamw/build.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_platforms", "cpu")

TARGET = "torch_tpu_example_adamw"
SHAPE = (37, 129)
LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-2, 0.9, 0.999, 1e-8, 0.1
RTOL = ATOL = 1e-6


def adamw_call(param, grad, exp_avg, exp_avg_sq, hparams):
    out = jax.ShapeDtypeStruct(param.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, (out, out, out))(
        param, grad, exp_avg, exp_avg_sq, hparams)


def numpy_adamw(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps,
                weight_decay, step):
    """torch.optim.AdamW (amsgrad=False, maximize=False), one step, in f64."""
    param, grad, m, v = (np.asarray(a, np.float64)
                         for a in (param, grad, exp_avg, exp_avg_sq))
    param = param * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad * grad
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = np.sqrt(v) / np.sqrt(bias_correction2) + eps
    param = param - step_size * m / denom
    return param, m, v


def torch_adamw(param, grads, hp):
    """The real torch.optim.AdamW on CPU, or None when torch is missing."""
    # Do not let `import torch` autoload this repository's torch_tpu backend.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        import torch
    except ImportError:
        return None
    p = torch.nn.Parameter(torch.tensor(np.asarray(param)))
    opt = torch.optim.AdamW([p], lr=hp[0], betas=(hp[1], hp[2]), eps=hp[3],
                            weight_decay=hp[4])
    for g in grads:
        p.grad = torch.tensor(np.asarray(g))
        opt.step()
    state = opt.state[p]
    return (p.detach().numpy(), state["exp_avg"].numpy(),
            state["exp_avg_sq"].numpy())


def close(name, got, want, failures):
    got = np.asarray(got)
    if got.dtype != np.float32 or got.shape != np.shape(want):
        failures.append(f"{name}: got {got.dtype}{got.shape}")
        return
    if not np.allclose(got, want, rtol=RTOL, atol=ATOL):
        err = np.max(np.abs(got - want) / (ATOL + RTOL * np.abs(want)))
        failures.append(f"{name}: max error {err:.3g}x the tolerance")


def main(argv):
    if len(argv) > 1:
        lib = argv[1]
    else:
        # JAX's own headers: this check runs the handler in JAX's runtime.
        lib = build.build(os.path.join(tempfile.gettempdir(), "torch_tpu_ffi_adamw_jax"),
                          include_dir=jax.ffi.include_dir())
    handler = ctypes.CDLL(lib).TorchTpuExampleAdamW
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler),
                                platform="cpu")

    failures = []
    rng = np.random.default_rng(0)
    param0 = rng.standard_normal(SHAPE, dtype=np.float32)
    grads = [rng.standard_normal(SHAPE, dtype=np.float32) for _ in range(3)]

    step_fn = jax.jit(adamw_call)
    p, m, v = param0, np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32)
    rp, rm, rv = p, m, v
    for step, g in enumerate(grads, start=1):
        hp = np.array([LR, BETA1, BETA2, EPS, WEIGHT_DECAY, step], np.float32)
        p, m, v = step_fn(p, g, m, v, hp)
        # The reference uses the hyperparameters as the kernel sees them
        # (rounded to float32), and feeds back its own f64 state.
        rp, rm, rv = numpy_adamw(rp, g, rm, rv, *hp.astype(np.float64))
        for name, got, want in (("param", p, rp), ("exp_avg", m, rm),
                                ("exp_avg_sq", v, rv)):
            close(f"step {step} {name}", got, want, failures)

    torch_result = torch_adamw(param0, grads, [LR, BETA1, BETA2, EPS,
                                               WEIGHT_DECAY])
    if torch_result is not None:
        for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"),
                                   (p, m, v), torch_result):
            close(f"torch.optim.AdamW {name}", got, want, failures)

    # Mismatched shapes must be refused by the handler with its own message.
    hp = np.array([LR, BETA1, BETA2, EPS, WEIGHT_DECAY, 1], np.float32)
    bad_grad = np.zeros((37, 128), np.float32)
    try:
        jax.block_until_ready(adamw_call(param0, bad_grad, param0, param0, hp))
        failures.append("shape mismatch: no error raised")
    except Exception as e:  # jax.errors.JaxRuntimeError
        if "grad has shape [37,128] but param has shape [37,129]" not in str(e):
            failures.append(f"shape mismatch: unexpected error {e!r}")

    # So must an hparams buffer of the wrong size.
    try:
        jax.block_until_ready(
            adamw_call(param0, param0, param0, param0, hp[:5]))
        failures.append("hparams[5]: no error raised")
    except Exception as e:
        if "hparams must have 6 elements" not in str(e):
            failures.append(f"hparams[5]: unexpected error {e!r}")

    for f in failures:
        print("  " + f)
    checked = "numpy" + (" and torch.optim.AdamW" if torch_result else "")
    print(("FAIL" if failures else "PASS") +
          f": {TARGET} ({lib}) vs {checked}, 3 steps on {SHAPE}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
