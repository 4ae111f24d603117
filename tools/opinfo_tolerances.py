"""Tolerance overrides for the OpInfo sweep: the one place where the tpu may differ from
the CPU by more than PyTorch's default tolerance for the dtype.

Each entry is keyed by (variant, unit), unit being a dtype name or "grad", and gives the
atol/rtol used instead of torch.testing.assert_close's defaults, with the reason. Entries
are as narrow as the measured difference allows (about 1.5x the largest difference seen);
a unit that passes under an override is still a native pass, and the report names the
override. Add an entry only for a measured precision difference, never for a wrong result.
"""

OVERRIDES = {
    ("addbmm", "float32"): dict(
        atol=2e-5, rtol=1.3e-6,
        reason="the batch and inner dims are contracted in one dot (XLA's order); the CPU adds "
               "the batch products one at a time: 1.4e-5 apart at 1 of 50 elements"),
    ("nn.functional.conv_transpose3d", "grad"): dict(
        atol=1.2e-4, rtol=1.3e-6,
        reason="the input gradient sums 4x4x4 kernel taps x channels in XLA's convolution order, "
               "the CPU in oneDNN's: 7.8e-5 apart on values up to ~10"),
    ("nn.functional.layer_norm", "grad"): dict(
        atol=4e-5, rtol=1.3e-6,
        reason="a 1-element weight gradient sums the whole batch: 2.4e-5 apart (summation order)"),
    ("nn.functional.scaled_dot_product_attention", "grad"): dict(
        atol=2e-5, rtol=1.3e-6,
        reason="softmax backward through two batched matmuls, different summation order: "
               "1.2e-5 apart at 2 of 96 elements"),
    ("special.log_ndtr", "grad"): dict(
        atol=5e-5, rtol=1.3e-6,
        reason="exp(-x^2/2) / ndtr(x) for large |x|: XLA's exp and erfc differ from the CPU's "
               "libm in the last bits, 3.2e-5 apart on gradients of magnitude ~10"),
}


def lookup(variant, unit):
    """The override for this unit, or None."""
    return OVERRIDES.get((variant, unit))
