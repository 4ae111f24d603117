#!/usr/bin/env python3
"""Fused eager against strict eager, side by side in one run: GPT and MLP
training steps, a chain of elementwise and normalisation ops, and GPT greedy
decoding, each built and warmed up in both modes and then timed in turns over
several rounds (medians); plus the start-up of a second process with a cold
and a warm disk cache.

    python benchmarks/fused_vs_strict.py [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from common import interleaved, provenance, ratio_summary, sync, write_json

import torch

import torch_tpu
from torch_tpu.data import CharTokenizer, batches, load_corpus
from torch_tpu.models import GPT, MLP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpt_train(tok, tokens, batch=16, block=64):
    torch.manual_seed(0)
    model = GPT(tok.vocab_size, block_size=block, n_layer=2, n_head=4, n_embd=64, dropout=0.0).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = iter(batches(tokens, block, batch, torch.Generator().manual_seed(0)))

    def step():
        x, y = next(data)
        _, loss = model(x.to("tpu"), y.to("tpu"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    return step, batch * block


def mlp_train():
    torch.manual_seed(0)
    model = MLP(64, 256, 10).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(128, 64, device="tpu")
    y = torch.randint(0, 10, (128,), device="tpu")

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step, 128


def chain():
    x = torch.randn(256, 512, device="tpu")
    w = torch.randn(512, device="tpu")

    def step():
        y = x * 1.5 + 0.25
        y = torch.nn.functional.gelu(y)
        y = torch.nn.functional.layer_norm(y, (512,), w)
        y = torch.sigmoid(y) * y - y.mean(-1, keepdim=True)
        y = torch.nn.functional.rms_norm(y, (512,)) + x
        return y.sum().item()

    return step, 1


def decode(tok):
    torch.manual_seed(0)
    model = GPT(tok.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0).to("tpu").eval()
    prompt = torch.randint(0, tok.vocab_size, (1, 8), device="tpu")

    def step():
        with torch.no_grad():
            return model.generate(prompt, 16)

    return step, 16


def warmed(mode, make, warmup):
    with torch_tpu.mode(mode):
        fn, units = make()
        for _ in range(warmup):
            fn()
        sync("tpu")
    return fn, units


# A fresh process's first 3 GPT training steps. argv[1]: "tpu" (fused eager) or "cpu"
# (PyTorch's CPU eager, the reference); argv[2] == "preimport": PyTorch's lazy imports are done
# before the timer starts. The first optimizer a process builds imports torch._dynamo (about
# 1.2 s here, on any device: Optimizer.add_param_group is wrapped in torch._disable_dynamo), and
# tpu's first op imports torch._inductor; with them paid up front, what remains is ours.
STARTUP = """
import sys, time, torch, torch_tpu
dev = sys.argv[1]
if sys.argv[2] == "preimport":
    import torch._dynamo, torch._inductor
t0 = time.perf_counter()
if dev == "tpu":
    torch_tpu.set_mode("fused")
from torch_tpu.models import GPT
torch.manual_seed(0)
m = GPT(96, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0).to(dev)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
for _ in range(3):
    x = torch.randint(0, 96, (16, 64), device=dev)
    _, loss = m(x, x)
    opt.zero_grad(); loss.backward(); opt.step(); loss.item()
print(time.perf_counter() - t0, torch_tpu.metrics()["compiles"] if dev == "tpu" else 0)
"""


def startup():
    """Cold and warm disk cache for tpu, and the CPU reference, each with PyTorch's lazy
    imports inside the timer ("from import") and before it ("after torch's imports")."""
    out = {}
    for imports in ("from import", "after torch's imports"):
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, TORCH_TPU_CACHE_DIR=d, PYTHONPATH=ROOT)
            arg = "preimport" if imports != "from import" else "timed"
            row = {}
            for name, dev in (("cold", "tpu"), ("warm", "tpu"), ("cpu eager", "cpu")):
                r = subprocess.run([sys.executable, "-c", STARTUP, dev, arg], capture_output=True, text=True, env=env,
                                   check=True)
                secs, compiles = r.stdout.strip().splitlines()[-1].split()
                row[name] = {"seconds": float(secs), "compiles": int(compiles)}
            out[imports] = row
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    text = load_corpus()
    tok = CharTokenizer(text)
    tokens = tok.encode_tensor(text)
    # (name, make, calls per round, warm-up calls, unit). A round lasts 0.2-0.6 s: with 0.1 s rounds
    # (50 MLP steps) one slow spell of the shared machine moved a round's ratio by 30%.
    cases = [
        ("GPT training step", lambda: gpt_train(tok, tokens), 40, 10, "tokens/s"),
        ("MLP training step", mlp_train, 200, 5, "samples/s"),
        ("elementwise + norm chain", chain, 200, 5, "calls/s"),
        ("GPT greedy decode (16 tokens)", lambda: decode(tok), 20, 3, "tokens/s"),
    ]
    rows = []
    for name, make, steps, warmup, unit in cases:
        runs = {}
        for mode in ("strict", "fused"):
            fn, units = warmed(mode, make, warmup)
            runs[mode] = (fn, lambda m=mode: torch_tpu.mode(m), "tpu")
        secs = interleaved(runs, steps, args.rounds)
        s, f = statistics.median(secs["strict"]), statistics.median(secs["fused"])
        rs = ratio_summary(secs["fused"], secs["strict"])
        rows.append({"case": name, "unit": unit, "strict": units / s, "fused": units / f, "speedup": rs["ratio"],
                     "low": rs["low"], "high": rs["high"], "rounds_s": secs})
        print(f"{name:32s} strict {units / s:10.1f} {unit:10s} fused {units / f:10.1f} {unit:10s} "
              f"fused/strict {rs['ratio']:5.2f}x (rounds {rs['low']:.2f}-{rs['high']:.2f}x)", flush=True)
    st = startup()
    for imports, row in st.items():
        print(f"second-process start, 3 GPT steps ({imports}): cold cache {row['cold']['seconds']:.2f} s "
              f"({row['cold']['compiles']} compiles), warm cache {row['warm']['seconds']:.2f} s "
              f"({row['warm']['compiles']} compiles, {row['warm']['seconds'] / row['cold']['seconds']:.0%} of cold), "
              f"CPU eager {row['cpu eager']['seconds']:.2f} s")
    out = {"provenance": provenance(), "rows": rows, "rounds": args.rounds, "startup": st}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
