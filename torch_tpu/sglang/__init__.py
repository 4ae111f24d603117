"""SGLang platform plugin: serves models on tpu with SGLang's own engine
(SGLang 0.5.21, its environment made by scripts/setup_sglang.sh).

SGLang finds it through the entry point `torch_tpu` of group
`sglang.srt.platforms` and then runs on the "tpu" device: the platform
(`platform.py`), paged attention as one native op over a KV pool in that op's
layout (`attention.py`, `torch.ops.tpu.paged_attention`) and decode steps
recorded once per batch bucket and replayed (`graph_runner.py`, SGLang's
graph-runner hook). `_torchvision.py` is the torchvision stand-in the set-up
installs (PyPI's torchvision for torch 2.13 needs CUDA).
"""


def activate() -> str | None:
    """The entry point: the SRTPlatform class path, or None to leave the
    choice to SGLang (torch_tpu not importable)."""
    try:
        import torch_tpu  # noqa: F401  (registers the device)
    except Exception:  # a broken install must not stop SGLang from choosing another platform
        return None
    return "torch_tpu.sglang.platform.TpuSRTPlatform"
