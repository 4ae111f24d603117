"""One target of ``torch-tpu bench`` (a device, a mode, a dtype) in its own process.

The parent writes one JSON command per line on standard input and reads one JSON answer per line
(prefixed with ``@@bench ``, so that what a model prints cannot be mistaken for an answer):

- ``{"op": "setup", "point": {...}, "warmup": N}``: build the workload of a sweep point, run it once
  (the first call: compiles, or loads from the disk cache) and N more times; answers the first
  call's time, the compiles of all of them, the parameters;
- ``{"op": "measure", "calls": N}``: N timed calls; answers each call's latency, the tokens per
  call, time to first token and inter-token latencies (generation), compiles during the calls
  (steady-state recompiles), peak device memory;
- ``{"op": "peak"}``: this device's measured matmul peak (FLOP/s), for the host CPU;
- ``{"op": "exit"}``.
An error answers ``{"error": "Type: message"}`` and the worker stays usable.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

GPT_SIZES = {"tiny": dict(n_layer=2, n_head=4, n_embd=64), "small": dict(n_layer=4, n_head=8, n_embd=256),
             "base": dict(n_layer=12, n_head=12, n_embd=768)}
HF_SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=1024),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, intermediate_size=1024,
                  vocab_size=32000),
}


def answer(obj):
    sys.stdout.write("@@bench " + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Target:
    def __init__(self, device: str, mode: str, dtype: str):
        self.device, self.mode, self.dtype = device, mode, getattr(torch, dtype)
        if device.startswith("tpu"):
            import torch_tpu

            self.tpu = torch_tpu
            torch_tpu.set_mode("strict" if mode == "compile" else mode)
        else:
            self.tpu = None
        self.step = None

    # -- device helpers
    def sync(self):
        if self.tpu is not None:
            torch.tpu.synchronize()
        elif self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def compiles(self) -> int:
        if self.tpu is not None:
            m = self.tpu.metrics()
            return m["compiles"]
        if "torch._dynamo" in sys.modules:
            from torch._dynamo.utils import counters

            return counters["stats"]["unique_graphs"]  # graphs Dynamo compiled
        return 0

    def peak_memory(self) -> int | None:
        if self.tpu is not None:
            return int(torch.tpu.max_memory_allocated())
        if self.device.startswith("cuda"):
            return int(torch.cuda.max_memory_allocated())
        return None

    def reset_peak(self):
        if self.tpu is not None:
            torch.tpu.reset_peak_memory_stats()
        elif self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()

    # -- the workload
    def build(self, point: dict):
        model_spec = point["model"]
        task = point["task"]
        kind, model, vocab = load_model(model_spec, max_len=point.get("seq_len", 0) + point.get("prompt_len", 0) +
                                        point.get("new_tokens", 0))
        model = model.to(self.device, self.dtype)
        self.params = sum(p.numel() for p in model.parameters())
        forward = model
        if self.mode == "compile":
            forward = torch.compile(model, backend="tpu" if self.tpu is not None else "inductor")
        gen = torch.Generator().manual_seed(0)
        b = point["batch"]
        if task == "train":
            model.train()
            opt = make_optimizer(point.get("optimizer", "adamw"), model.parameters())
            s = point["seq_len"]
            x = torch.randint(0, vocab, (b, s + 1), generator=gen).to(self.device)

            def step():
                out = forward(x[:, :-1], labels=x[:, :-1]) if kind == "hf" else forward(x[:, :-1], x[:, 1:])
                loss = out.loss if kind == "hf" else out[1]
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss.item()
                return {"tokens": b * s}

            self.flops_per_token = 6 * self.params
        elif task == "forward":
            model.eval()
            s = point["seq_len"]
            x = torch.randint(0, vocab, (b, s), generator=gen).to(self.device)

            def step():
                with torch.no_grad():
                    out = forward(x)
                    logits = out.logits if kind == "hf" else out[0]
                    logits[0, -1, 0].item()
                return {"tokens": b * s}

            self.flops_per_token = 2 * self.params
        elif task == "generate":
            model.eval()
            p, n = point["prompt_len"], point["new_tokens"]
            prompt = torch.randint(0, vocab, (b, p), generator=gen).to(self.device)
            if kind == "hf":
                step = hf_generate(model, prompt, n)
            else:
                step = gpt_generate(forward, prompt, n)
            self.flops_per_token = 2 * self.params
        else:
            raise ValueError(f"unknown task {task!r}: generate, forward or train")
        self.step = step

    def timed_call(self) -> dict:
        t0 = time.perf_counter()
        r = self.step()
        self.sync()
        r["latency"] = time.perf_counter() - t0
        return r


OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4), "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
              "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-3)}


def make_optimizer(name: str, params):
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r}: one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](params)


def load_model(spec: str, max_len: int):
    """('gpt' | 'hf', model, vocab size) for 'gpt[:size]', 'hf:ARCH[:size]' or a local folder."""
    if spec == "gpt" or spec.startswith("gpt:"):
        from torch_tpu.models import GPT

        size = spec.split(":", 1)[1] if ":" in spec else "tiny"
        if size not in GPT_SIZES:
            raise ValueError(f"gpt size {size!r}: one of {', '.join(GPT_SIZES)}")
        torch.manual_seed(0)
        return "gpt", GPT(256, block_size=max(max_len, 8), dropout=0.0, **GPT_SIZES[size]), 256
    from transformers import AutoModelForCausalLM

    if spec.startswith("hf:"):
        cfg = hf_config(spec)
        for k in ("max_position_embeddings", "n_positions"):
            if hasattr(cfg, k):
                setattr(cfg, k, max(getattr(cfg, k) or 0, max_len))
        torch.manual_seed(0)
        return "hf", AutoModelForCausalLM.from_config(cfg), cfg.vocab_size
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"model {spec!r}: not 'gpt[:size]', not 'hf:ARCH[:size]', and no such folder")
    model = AutoModelForCausalLM.from_pretrained(spec)
    return "hf", model, model.config.vocab_size


def hf_config(spec: str):
    """The transformers config of ``hf:ARCH[:size]``: ARCH's own, resized to HF_SIZES[size]
    (random weights, nothing downloaded)."""
    from transformers import AutoConfig

    arch, _, size = spec[3:].partition(":")
    size = size or "tiny"
    if size not in HF_SIZES:
        raise ValueError(f"hf size {size!r}: one of {', '.join(HF_SIZES)}")
    cfg = AutoConfig.for_model(arch)
    for k, v in HF_SIZES[size].items():
        setattr(cfg, k, v)
    if hasattr(cfg, "num_key_value_heads"):
        cfg.num_key_value_heads = cfg.num_attention_heads
    return cfg


def gpt_generate(forward, prompt, n):
    """Greedy decoding that reads each token on the host as it comes (as a server streams it)."""

    def step():
        ids = prompt
        stamps = []
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(n):
                logits, _ = forward(ids)
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                nxt.cpu()
                stamps.append(time.perf_counter())
                ids = torch.cat([ids, nxt], 1)
        return {"tokens": prompt.shape[0] * n, "ttft": stamps[0] - t0,
                "itl": [b - a for a, b in zip(stamps, stamps[1:])]}

    return step


def hf_generate(model, prompt, n):
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def step():
        st = Stamps()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=st,
                           pad_token_id=0)
        tokens = st.times[1:]  # the first put is the prompt
        return {"tokens": prompt.shape[0] * n, "ttft": tokens[0] - t0 if tokens else None,
                "itl": [b - a for a, b in zip(tokens, tokens[1:])]}

    if prompt.shape[0] > 1:  # the streamer takes one sequence; time the batch without it
        def batched():
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            return {"tokens": prompt.shape[0] * n}

        return batched
    return step


def measured_peak(device: str) -> float:
    """FLOP/s of a float32 1024^3 matmul on this device (the host CPU's peak for the CPU plugin)."""
    a = torch.randn(1024, 1024, device=device)
    for _ in range(3):
        (a @ a).sum().item()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        (a @ a).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024**3 / best


def main(argv) -> int:
    device, mode, dtype = argv
    target = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if target is None:
                target = Target(device, mode, dtype)
            if cmd["op"] == "exit":
                return 0
            if cmd["op"] == "setup":
                c0 = target.compiles()
                t0 = time.perf_counter()
                target.build(cmd["point"])
                target.timed_call()
                first = time.perf_counter() - t0
                for _ in range(cmd.get("warmup", 0)):
                    target.timed_call()
                answer({"first_s": first, "compiles": target.compiles() - c0,
                        "params": target.params, "flops_per_token": target.flops_per_token})
            elif cmd["op"] == "measure":
                target.reset_peak()
                c0 = target.compiles()
                calls = [target.timed_call() for _ in range(cmd["calls"])]
                answer({"calls": calls, "recompiles": target.compiles() - c0, "peak_memory": target.peak_memory()})
            elif cmd["op"] == "peak":
                answer({"flops": measured_peak(device)})
            else:
                answer({"error": f"ValueError: unknown command {cmd['op']!r}"})
        except Exception as e:  # noqa: BLE001 - the parent reports it and goes on
            traceback.print_exc(file=sys.stderr)
            answer({"error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
