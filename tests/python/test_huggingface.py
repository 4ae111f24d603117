"""Hugging Face transformers on the tpu device: loading (device_map="tpu"),
generation, a plain training loop and the Trainer, on tiny random models,
compared with the CPU and with the CPU fallback forbidden."""

import copy
import importlib.util

import pytest
import torch

import torch_tpu

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

# device_map and the Trainer need Accelerate.
needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed"
)

VOCAB = 64


@pytest.fixture
def _no_fallback():
    torch_tpu.set_fallback("error")
    try:
        yield
    finally:
        torch_tpu.set_fallback("warn")


def _llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def _gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    return GPT2LMHeadModel(cfg)


MODELS = {"llama": _llama, "gpt2": _gpt2}


def _ids(batch=2, length=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


@needs_accelerate
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_from_pretrained_device_map_tpu(name, tmp_path, _no_fallback):
    cpu = MODELS[name]().eval()
    cpu.save_pretrained(tmp_path, safe_serialization=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu")
    assert {p.device.type for p in model.parameters()} == {"tpu"}
    assert {b.device.type for b in model.buffers()} <= {"tpu"}
    ids = _ids()
    with torch.no_grad():
        expected = cpu(ids).logits
        got = model(ids.to("tpu")).logits
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), expected)


@needs_accelerate
def test_from_pretrained_device_map_tpu_bfloat16(tmp_path, _no_fallback):
    _llama().save_pretrained(tmp_path, safe_serialization=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu", dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("tpu", torch.bfloat16)}
    cpu = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ids = _ids()
    with torch.no_grad():
        expected = cpu(ids).logits
        got = model(ids.to("tpu")).logits
    assert got.dtype == torch.bfloat16
    # The same bf16 weights; sums may round differently from the CPU's kernels.
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_generate_greedy_matches_cpu(name, _no_fallback):
    cpu = MODELS[name]().eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    ids = _ids()
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=True)
    expected = cpu.generate(ids, attention_mask=mask, **kw)
    got = tpu.generate(ids.to("tpu"), attention_mask=mask.to("tpu"), **kw)
    assert got.device.type == "tpu"
    assert got.shape == (2, 15)
    assert got.cpu().tolist() == expected.tolist()


@pytest.mark.parametrize("num_beams", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_generate_left_padded_matches_cpu(num_beams, _no_fallback):
    cpu = _llama().eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    ids = _ids()
    mask = torch.ones_like(ids)
    ids[0, :3] = 0  # left padding (pad_token_id=0)
    mask[0, :3] = 0
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=num_beams)
    expected = cpu.generate(ids, attention_mask=mask, **kw)
    got = tpu.generate(ids.to("tpu"), attention_mask=mask.to("tpu"), **kw)
    assert got.cpu().tolist() == expected.tolist()


@pytest.mark.slow
def test_compiled_static_cache_generate_matches_cpu_without_recompiling(_no_fallback):
    # generate() with a static KV cache and the forward compiled with backend="tpu": one
    # graph for the prompt, one for every decode step (the cache is updated in place and the
    # position changes as data, not as a new shape); later generates compile nothing (below).
    torch.tpu.synchronize()  # in fused eager, no earlier test's pending work joins the first graph
    cpu = _llama().eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    tpu.forward = torch.compile(tpu.forward, backend="tpu")
    ids = _ids(batch=1)
    kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    expected = cpu.generate(ids, **kw)
    earlier = {g["name"] for g in torch_tpu.compiled_graphs()}
    got = tpu.generate(ids.to("tpu"), **kw)
    assert got.cpu().tolist() == expected.tolist()
    graphs = [g for g in torch_tpu.compiled_graphs() if g["name"] not in earlier]
    assert len(graphs) == 2, graphs  # prompt, decode step
    assert all(g["programs_compiled"] <= 1 for g in graphs), graphs  # 0: from the disk cache
    assert max(g["calls"] for g in graphs) == 7, graphs  # every decode step replays
    # In fused eager the first generate's first decode step recorded its graph, which cuts the
    # pending eager ops around it; every later step is a call inside the pending graph with the
    # step's eager ops (cat, stopping criteria): that step's graph is new once, in the second
    # generate (with a cold cache). A third compiles nothing in either mode.
    allowed = 1 if torch_tpu._C._fused() else 0
    for _ in range(2):
        before = torch_tpu.metrics()["compiles"]
        again = tpu.generate(ids.to("tpu"), **kw)
        assert again.cpu().tolist() == expected.tolist()
        assert torch_tpu.metrics()["compiles"] - before <= allowed
        allowed = 0


def test_generate_sampling_is_reproducible(_no_fallback):
    model = _gpt2().eval().to("tpu")
    ids = _ids().to("tpu")
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=10)

    def sample(seed):
        torch.manual_seed(seed)
        return model.generate(ids, **kw).cpu().tolist()

    first = sample(5)
    assert sample(5) == first
    assert sample(6) != first


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_loop_matches_cpu(compiled, _no_fallback):
    cpu = _llama()
    tpu = copy.deepcopy(cpu).to("tpu")
    ids = _ids(batch=4, length=16)

    def losses(model, device):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = ids.to(device)
        run = torch.compile(model, backend="tpu") if compiled and device == "tpu" else model
        out = []
        for _ in range(5):
            loss = run(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    expected = losses(cpu, "cpu")
    got = losses(tpu, "tpu")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=1e-4)
    assert {p.device.type for p in tpu.parameters()} == {"tpu"}


@pytest.mark.parametrize(
    "cls,amsgrad,maximize,dtype",
    [
        (torch.optim.AdamW, False, False, torch.float32),
        (torch.optim.Adam, True, True, torch.float32),
        (torch.optim.AdamW, False, False, torch.bfloat16),
    ],
)
def test_fused_adam_matches_cpu(cls, amsgrad, maximize, dtype, _no_fallback):
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(5, 3, generator=g).to(dtype), torch.randn(7, generator=g).to(dtype)]
    cpu = [p.clone().requires_grad_() for p in init]
    tpu = [p.to("tpu").requires_grad_() for p in init]
    kw = dict(lr=1e-2, fused=True, amsgrad=amsgrad, maximize=maximize, weight_decay=0.1)
    opts = [cls(cpu, **kw), cls(tpu, **kw)]
    compiles = None
    for step in range(4):
        grads = [torch.randn(p.shape, generator=g).to(dtype) for p in init]
        for p, gr in zip(cpu, grads):
            p.grad = gr.clone()
        for p, gr in zip(tpu, grads):
            p.grad = gr.to("tpu")
        for opt in opts:
            opt.step()
            for group in opt.param_groups:
                group["lr"] *= 0.9  # a schedule: the learning rate is a program input
        if step == 1:
            compiles = torch_tpu.metrics()["compiles"]
    assert torch_tpu.metrics()["compiles"] == compiles
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(cpu, tpu):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), **tol)


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_fused_adamw_grad_scale_found_inf(found_inf, _no_fallback):
    def run(dev):
        g = torch.Generator().manual_seed(1)
        lists = [[torch.randn(4, 3, generator=g).to(dev)] for _ in range(3)]
        lists.append([torch.rand(4, 3, generator=g).to(dev)])
        params, grads, exp_avgs, exp_avg_sqs = lists
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], [torch.tensor(3.0).to(dev)],
            lr=0.01, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
            grad_scale=torch.tensor(4.0).to(dev), found_inf=torch.tensor(found_inf).to(dev),
        )  # fmt: skip
        return [x[0].cpu() for x in lists]

    for got, expected in zip(run("tpu"), run("cpu")):
        torch.testing.assert_close(got, expected)


@pytest.fixture
def _tpu_over_cuda(monkeypatch):
    """Where PyTorch sees a CUDA GPU, Accelerate keeps choosing it (torch_tpu only replaces
    its CPU fallback); a user who wants tpu there names it, as this does."""
    if torch.cuda.is_available():
        monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "tpu")


@needs_accelerate
def test_accelerate_picks_tpu():
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        # A built-in accelerator keeps its meaning: on a CUDA machine Accelerate picks cuda.
        assert PartialState().device.type == ("cuda" if torch.cuda.is_available() else "tpu")
        AcceleratorState._reset_state(reset_partial_state=True)
        assert PartialState(cpu=True).device.type == "cpu"
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@needs_accelerate
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_trainer_trains_on_tpu(compiled, tmp_path, _no_fallback, _tpu_over_cuda):
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    model = _llama()
    before = [p.detach().clone() for p in model.parameters()]
    ids = _ids(batch=8, length=16)
    dataset = [{"input_ids": ids[i], "labels": ids[i]} for i in range(8)]
    AcceleratorState._reset_state(reset_partial_state=True)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-2,
        # the default optimizer, adamw_torch_fused: torch._fused_adamw_
        report_to=[],
        use_cpu=False,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        torch_compile=compiled,
        torch_compile_backend="tpu" if compiled else None,
    )
    try:
        assert args.device.type == "tpu"
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        assert trainer.accelerator.device.type == "tpu"
        result = trainer.train()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert result.global_step == 3
    assert torch.isfinite(torch.tensor(result.training_loss))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert {p.device.type for p in model.parameters()} == {"tpu"}
    assert any(not torch.equal(p.detach().cpu(), q) for p, q in zip(model.parameters(), before))


def test_device_map_auto_splits_over_tpu_devices_cpu_and_disk(tmp_path):
    """device_map="auto" (issue 3/7, finding 9): with 2 tpu devices of 250 KB each, a 4-layer
    Llama is placed on tpu:0, tpu:1 and the CPU (and disk when the CPU budget is small), and
    its logits and greedy generation equal the CPU model's. In a process of its own: the device
    count and memory limit are read at start."""
    import os
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_workers", "device_map_auto.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TORCH_TPU_CPU_DEVICES="2", TORCH_TPU_MEMORY_LIMIT="250K", HF_HUB_OFFLINE="1",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, worker, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for line in ("ok tpu:0, tpu:1 and cpu", "ok disk", "ok unknown device"):
        assert line in r.stdout, r.stdout
