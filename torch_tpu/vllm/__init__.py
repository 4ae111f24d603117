"""vLLM platform plugin: serves models on tpu with vLLM's own engine.

Installed with the `vllm` extra; vLLM finds it through the entry point
`torch_tpu` of group `vllm.platform_plugins` (not `tpu`: that is vLLM's own TPU
platform's name) and then runs on the "tpu" device:
the platform (`platform.py`), a worker and model runner (`worker.py`), paged
attention as one native op (`attention.py`, `torch.ops.tpu.paged_attention`)
and torch versions of vLLM's Triton helpers (`kernels.py`).
"""


def register() -> str | None:
    """The entry point: the Platform class path, or None to leave the choice
    to vLLM (torch_tpu not importable, or VLLM_TORCH_TPU=0). An out-of-tree
    platform wins over vLLM's built-in CPU one unless VLLM_TARGET_DEVICE=cpu."""
    try:
        from torch_tpu import _env  # imports torch_tpu; the registry is its extension's
    except Exception:  # a broken install must not stop vLLM from choosing another platform
        return None
    if _env.get("VLLM_TORCH_TPU", "1") == "0":
        return None
    return "torch_tpu.vllm.platform.TpuPlatform"
