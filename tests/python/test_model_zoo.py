"""The Hugging Face model zoo (tools/model_zoo.py): its CI sample (tools/model_zoo_sample.txt)
must agree with the CPU in strict and fused eager with no CPU fallback, and the harness's own
statuses (skip, error, crash) must be what they claim. The full zoo is a long run of its own:

    python tools/model_zoo.py --workers 2 --out zoo.json
    python tools/model_zoo.py --report zoo.json --md docs/model_zoo.md
"""

from __future__ import annotations

import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO_ROOT, "tools")
SAMPLE = os.path.join(TOOLS, "model_zoo_sample.txt")

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def zoo():
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import model_zoo

    return model_zoo


@pytest.mark.slow
def test_zoo_sample_agrees_with_cpu_natively(zoo, monkeypatch):
    monkeypatch.setenv("TORCH_TPU_FALLBACK", "error")
    pairs = zoo.select_pairs(zoo.read_list(SAMPLE))
    assert len(pairs) >= 30
    results, _ = zoo.run_zoo(pairs, workers=2, timeout=300, snapshot=False)
    bad = []
    for key, rec in sorted(results.items()):
        if rec["status"] == "skip":
            bad.append(f"{key}: the CPU no longer runs it: {rec.get('message')}")
            continue
        for mode in zoo.MODES:
            m = rec["modes"][mode]
            if m["status"] != "pass":
                bad.append(f"{key} {mode}: {m['status']}: {m.get('message', '')}")
    assert not bad, "\n".join(bad)


def test_zoo_statuses_skip_error_crash(zoo, monkeypatch):
    # A CPU failure is a skip with its reason; an op that cannot run on tpu (a lowering
    # disabled, fallback forbidden) is an error; a dying worker is a crash of that pair only.
    monkeypatch.setenv("TORCH_TPU_FALLBACK", "error")
    monkeypatch.setenv("TORCH_TPU_DISABLE_LOWERINGS", "native_layer_norm")
    monkeypatch.setenv("TORCH_TPU_ZOO_TEST_CRASH", "gpt2")
    pairs = [p for p in zoo.enumerate_pairs({"bark", "bert", "gpt2", "llama"})
             if p[1] in ("BarkModel", "BertModel", "GPT2Model", "LlamaModel")]
    results, _ = zoo.run_zoo(pairs, modes=["strict"], workers=1, timeout=120, snapshot=False)
    assert results["bark|BarkModel"]["status"] == "skip"
    assert results["bark|BarkModel"]["message"].startswith("CPU: ")
    bert = results["bert|BertModel"]["modes"]["strict"]
    assert bert["status"] == "error" and "native_layer_norm" in bert["message"], bert
    gpt2 = results["gpt2|GPT2Model"]["modes"]["strict"]
    assert gpt2["status"] == "crash" and "SIGABRT" in gpt2["message"], gpt2
    # The worker restarted: the pair after the crash ran (RMSNorm, no layer_norm).
    assert results["llama|LlamaModel"]["modes"]["strict"]["status"] == "pass"
    s = zoo.summarize(results, ["strict"])
    assert s["cpu_runnable"] == 3 and s["skipped"] == 1
    assert s["modes"]["strict"]["counts"] == {"error": 1, "crash": 1, "pass": 1}
    assert s["modes"]["strict"]["runs_pct"] == pytest.approx(33.3)


def test_zoo_compare_tolerance(zoo):
    import torch

    ref = {"logits": torch.ones(3), "ids": torch.tensor([1, 2])}
    assert zoo.compare(ref, {"logits": torch.ones(3) + 5e-5, "ids": torch.tensor([1, 2])})[0] is None
    msg, worst = zoo.compare(ref, {"logits": torch.ones(3) + 1e-2, "ids": torch.tensor([1, 2])})
    assert "logits" in msg and worst == pytest.approx(1e-2)
    assert "ids" in zoo.compare(ref, {"logits": torch.ones(3), "ids": torch.tensor([1, 3])})[0]
    msg, _ = zoo.compare(ref, {"logits": torch.ones(4), "ids": torch.tensor([1, 2])})
    assert "(4,)" in msg and "(3,)" in msg
    # Beyond the elementwise tolerance, but no further from the float64 result than twice
    # the CPU's own float32 error: agrees. Three times further: a mismatch that says so.
    ref64 = {"logits": torch.ones(3, dtype=torch.float64) + 0.02}
    near = {"logits": torch.ones(3) + 0.03, "ids": torch.tensor([1, 2])}
    assert zoo.compare(ref, near, ref64=ref64)[0] is None
    far = {"logits": torch.ones(3) - 0.05, "ids": torch.tensor([1, 2])}
    msg, _ = zoo.compare(ref, far, ref64=ref64)
    assert "from float64: tpu 0.07" in msg


def test_tiny_config_is_small_and_consistent(zoo):
    for model_type in ("llama", "deepseek_v3", "whisper", "llava"):
        config = zoo.tiny_config(model_type)
        text = getattr(config, "text_config", None) or config
        hidden = getattr(text, "hidden_size", None) or getattr(text, "d_model")
        assert hidden <= 32, (model_type, hidden)
        layers = getattr(text, "num_hidden_layers", None) or getattr(text, "encoder_layers")
        assert layers <= 2, (model_type, layers)
