"""Reference models train natively on tpu and match the CPU.

Each test builds the same model (same seed) on the CPU and on tpu, trains it for
the same steps on the same batches with gradient clipping, and compares the loss
sequences. CPU fallback is an error here (a model claimed native must be native),
and the fallback counters must stay empty.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torch_tpu
from torch_tpu.data import CharTokenizer, batches, load_corpus
from torch_tpu.models import CNN, GPT, MLP, train_steps

pytestmark = pytest.mark.mode_dependent  # the gate runs it in strict and fused eager

STEPS = 20


@pytest.fixture(autouse=True)
def _native_only(fallback_error):
    yield


@pytest.fixture(scope="module")
def corpus_tokens():
    text = load_corpus()
    tok = CharTokenizer(text)
    return tok, torch.tensor(tok.encode(text), dtype=torch.long)


def _build(make_model, device, seed=0):
    torch.manual_seed(seed)
    return make_model().to(device)


def _assert_same_structure(cpu_model, tpu_model):
    cpu_names = [n for n, _ in cpu_model.named_parameters()]
    tpu_names = [n for n, _ in tpu_model.named_parameters()]
    assert tpu_names == cpu_names, (
        "the tpu model has different (shared) parameters than the CPU model; "
        "tied weights were probably untied by .to('tpu')")


def _assert_no_fallbacks():
    fallbacks = torch_tpu.metrics()["fallbacks"]
    assert not fallbacks, f"ops ran on the CPU fallback: {fallbacks}"


def _compare_training(make_model, make_opt, data, steps=STEPS, autocast_dtype=None,
                      rtol=1e-3, atol=1e-3, param_atol=1e-2):
    cpu_model = _build(make_model, "cpu")
    tpu_model = _build(make_model, "tpu")
    for (n, p), (_, q) in zip(cpu_model.state_dict().items(), tpu_model.state_dict().items()):
        torch.testing.assert_close(q.cpu(), p, rtol=0, atol=0, msg=f"initial {n} differs")

    cpu_losses = train_steps(cpu_model, data, make_opt(cpu_model), steps, clip=1.0,
                             autocast_dtype=autocast_dtype, device="cpu")
    tpu_losses = train_steps(tpu_model, data, make_opt(tpu_model), steps, clip=1.0,
                             autocast_dtype=autocast_dtype, device="tpu")
    _assert_no_fallbacks()
    _assert_same_structure(cpu_model, tpu_model)
    assert len(tpu_losses) == steps
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"loss curves differ:\ncpu {cpu_losses}\ntpu {tpu_losses}\n{m}")
    for (n, p), (_, q) in zip(cpu_model.state_dict().items(), tpu_model.state_dict().items()):
        if p.is_floating_point():
            torch.testing.assert_close(q.cpu().float(), p.float(), rtol=1e-2, atol=param_atol,
                                       msg=lambda m, n=n: f"after training, {n} differs: {m}")
        else:
            assert torch.equal(q.cpu(), p), n
    return cpu_losses, tpu_losses


def _decreases(losses):
    k = max(1, len(losses) // 4)
    return sum(losses[-k:]) / k < sum(losses[:k]) / k


# ------------------------------------------------------------------ MLP


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_mlp_matches_cpu(act):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 10, generator=g)
    data = []
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=g)
        data.append((x, (x @ w).argmax(1)))
    _, losses = _compare_training(
        lambda: MLP(32, 64, 10, act=act),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        data)
    assert _decreases(losses)


# ------------------------------------------------------------------ GPT


def _gpt_batches(tokens, steps=STEPS, block_size=32, batch_size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return list(batches(tokens, block_size, batch_size, g, steps=steps))


@pytest.mark.parametrize("norm,act", [("layernorm", "gelu"), ("rmsnorm", "silu")])
def test_gpt_matches_cpu(corpus_tokens, norm, act):
    tok, tokens = corpus_tokens
    _, losses = _compare_training(
        lambda: GPT(tok.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=64,
                    dropout=0.0, norm=norm, act=act),
        lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1),
        _gpt_batches(tokens))
    assert _decreases(losses)


def test_gpt_untied_head_matches_cpu(corpus_tokens):
    tok, tokens = corpus_tokens
    _compare_training(
        lambda: GPT(tok.vocab_size, block_size=32, dropout=0.0, tie_weights=False),
        lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
        _gpt_batches(tokens, steps=10), steps=10)


def test_gpt_generate_matches_cpu(corpus_tokens):
    tok, _ = corpus_tokens
    make = lambda: GPT(tok.vocab_size, block_size=32, dropout=0.0)  # noqa: E731
    cpu_model, tpu_model = _build(make, "cpu"), _build(make, "tpu")
    prompt = torch.tensor([tok.encode("def ")], dtype=torch.long)
    out_cpu = cpu_model.generate(prompt, 12)
    out_tpu = tpu_model.generate(prompt.to("tpu"), 12)
    _assert_no_fallbacks()
    assert out_tpu.device.type == "tpu"
    assert out_tpu.cpu().tolist() == out_cpu.tolist()


def test_gpt_autocast_bf16_close_to_cpu(corpus_tokens):
    tok, tokens = corpus_tokens
    cpu_losses, tpu_losses = _compare_training(
        lambda: GPT(tok.vocab_size, block_size=32, dropout=0.0),
        lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
        _gpt_batches(tokens), autocast_dtype=torch.bfloat16,
        # bf16 matmuls round differently from the CPU's bf16 kernels, and a
        # one-ulp difference moves a 20-step bf16 trajectory: the loss spike at
        # step 9 (3.71-3.72 on the CPU) lands 0.10-0.14 away with the device's
        # fused attention (0.154 in fused eager with the layer-norm kernel),
        # 0.003 away with the CPU's attention kernel (measured), while the other
        # 19 steps stay within 0.021. AdamW moves a weight by up to lr (3e-3) a
        # step whatever the gradient's size, so a bias element whose bf16
        # gradient is near zero can drift either way: the largest parameter
        # difference was 0.041 (strict) and 0.036 (fused), and 0.057 and 0.044
        # once the minor-dim sums were split into lanes (same loss curves: mean
        # difference 0.0123 -> 0.0124; float32 parameters stay within 1e-4).
        rtol=0, atol=2e-1, param_atol=8e-2)
    diffs = [abs(a - b) for a, b in zip(cpu_losses, tpu_losses)]
    assert sum(diffs) / len(diffs) < 2e-2, diffs
    assert sorted(diffs)[-2] < 5e-2, diffs  # one spike at most
    assert _decreases(tpu_losses), tpu_losses


def test_autocast_bf16_matmul_dtype():
    a = torch.randn(8, 8, device="tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        y = a @ a
        z = torch.nn.functional.linear(a, a)
    assert y.dtype == torch.bfloat16 and z.dtype == torch.bfloat16
    _assert_no_fallbacks()


# ------------------------------------------------------------------ CNN


def test_cnn_matches_cpu():
    g = torch.Generator().manual_seed(2)
    # Four fixed batches seen five times each: the loss must go down.
    distinct = [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g))
                for _ in range(4)]
    data = [distinct[i % 4] for i in range(STEPS)]
    _, losses = _compare_training(
        lambda: CNN(num_classes=10),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        data)
    assert _decreases(losses)


def test_cnn_eval_matches_cpu():
    make = lambda: CNN(num_classes=10)  # noqa: E731
    cpu_model, tpu_model = _build(make, "cpu").eval(), _build(make, "tpu").eval()
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        ref = cpu_model(x)
        out = tpu_model(x.to("tpu"))
    _assert_no_fallbacks()
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ main job


@pytest.mark.slow
def test_train_gpt_script_runs(repo_root):
    """The main job runs end to end (fallback left at its default policy)."""
    env = dict(os.environ, PYTHONPATH=repo_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(repo_root, "scripts", "train_gpt.py"),
                        "--steps", "20", "--log-every", "10"],
                       cwd=repo_root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "== tpu" in out and "== cpu" in out and "== summary" in out, out[-3000:]
    assert "tokens/s" in out and "torch_tpu metrics" in out
