#!/usr/bin/env python3
"""Hugging Face generation (greedy, a Llama-shaped model with random weights, built offline)
on tpu in strict eager, fused eager and compiled (static KV cache, forward compiled with
backend="tpu"), next to PyTorch's own device (--ref cpu or cuda) in eager and with inductor
(the same static cache, forward compiled with inductor). New tokens per second, side by side
in one run: each configuration is warmed up first, then all are timed in turns.

    python benchmarks/hf_generate.py [--ref cuda] [--new-tokens 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

from common import interleaved, mode_configs, provenance, ratio_summary, sync, write_json

import torch

import torch_tpu


def make_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.prompt + args.new_tokens + 8,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def build(base, device, mode, backend, args):
    """One configuration, warmed up: returns (generate call, first-call seconds)."""
    model = copy.deepcopy(base).to(device)
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    if backend:
        # A static cache keeps every decode step's shapes the same, so one graph replays.
        kw["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, backend=backend)
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)

    def call():
        with torch_tpu.mode(mode), torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), **kw)

    t0 = time.perf_counter()
    first_out = call().cpu()
    first = time.perf_counter() - t0
    call()
    sync(device)
    return call, first, first_out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="cpu", help="the device PyTorch itself runs on, next to tpu: cpu or cuda")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2, help="generate calls per configuration per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    base = make_model(args)
    runs, firsts, errors, outputs = {}, {}, {}, {}
    cfgs = mode_configs(args.ref)
    for name, device, mode, backend in cfgs:
        try:
            call, firsts[name], outputs[name] = build(base, device, mode, backend, args)
            print(f"ready: {name}, first call {firsts[name]:.1f} s", flush=True)
            runs[name] = (call, contextlib.nullcontext, device)
        except Exception as e:  # noqa: BLE001 - a failing configuration is reported, not fatal
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    secs = interleaved(runs, args.steps, args.rounds)
    reference = outputs.get(cfgs[3][0])
    rows = []
    for name, *_ in cfgs:
        if name in errors:
            r = {"error": errors[name]}
        else:
            r = {"new_tokens_per_s": args.batch * args.new_tokens / statistics.median(secs[name]),
                 "first_s": firsts[name], "rounds_s": secs[name],
                 "same_tokens_as_ref_eager": reference is not None and torch.equal(outputs[name], reference)}
        r["config"] = name
        rows.append(r)
        print(f"generate {name:34s} " + (f"{r['new_tokens_per_s']:9.0f} new tokens/s  first {r['first_s']:.2f} s"
                                        f"  same tokens: {r['same_tokens_as_ref_eager']}"
                                        if "error" not in r else r["error"]), flush=True)
    ratios = {}
    comp = cfgs[2][0]
    if comp in secs:
        ratios = {other: ratio_summary(secs[comp], secs[other]) for other in (cfgs[3][0], cfgs[4][0]) if other in secs}
        for other, rs in ratios.items():
            print(f"generate: compiled tpu / {other} {rs['ratio']:.2f}x (rounds {rs['low']:.2f}-{rs['high']:.2f}x)")
    out = {"provenance": provenance(), "rows": rows, "ratios": ratios, "args": vars(args)}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
