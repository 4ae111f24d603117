#!/usr/bin/env python3
"""Where a compiled GPT training step spends its time, against inductor: the step of
`compiled.py` cut into its three compiled programs (forward, backward, optimizer step), each
phase closed by a synchronize so that its device work is inside its own timer. Both
configurations are timed in turns in one process, several rounds; each phase reports its
median round and the ratio of the medians.

The phases are timed with a synchronize after each, so their sum is larger than the
pipelined step of `compiled.py`; the split, not the sum, is the point.

A second table holds the device side alone: each of the step's three programs replayed
back to back with the arguments of a real step (no Dynamo, AOTAutograd or autograd around
them), against the pipelined step. The difference is what the step's host work costs:
on the CPU plugin the host's Python and the programs share the same cores.

    python benchmarks/compiled_phases.py [--steps 20] [--rounds 5] [--markdown docs/compiled_phases.md]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time

import compiled
from common import interleaved, provenance, provenance_lines, sync, time_per_call

import torch

import torch_tpu
from torch_tpu.data import CharTokenizer, load_corpus

PHASES = ("forward", "backward", "optimizer step", "whole step")


def build(device: str, backend: str, tok, tokens, args):
    """A compiled model and optimizer step, warmed up; returns a function that runs one
    training step and returns its phase times in seconds."""
    _, opt, fwd, opt_step, data = compiled.setup(device, backend, tok, tokens, args)
    # The batches are on the device first, so that the forward's timer holds no copy.
    batches_ = itertools.cycle([(x.to(device), y.to(device)) for x, y in data])

    def step():
        x, y = next(batches_)
        t0 = time.perf_counter()
        _, loss = fwd(x, y)
        sync(device)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        opt_step()
        loss.item()
        t3 = time.perf_counter()
        return (t1 - t0, t2 - t1, t3 - t2, t3 - t0)

    for _ in range(args.warmup):
        step()
    return step


def programs_alone(step, args) -> dict:
    """Milliseconds per call of each compiled program of one training step, replayed
    alone and back to back (a synchronize after each round of calls): the programs'
    device time with no framework around them. The arguments are those of one real
    step, recorded as the backend's graphs run; replaying the optimizer program
    updates the parameters again, which is harmless here."""
    from torch_tpu import _C, _compile

    recorded = {}
    run = _compile._Graph._call

    def record(graph, graph_args):
        recorded[graph.entry["name"]] = (graph, list(graph_args))
        return run(graph, graph_args)

    _compile._Graph._call = record
    try:
        step()
    finally:
        _compile._Graph._call = run
    sync("tpu")
    out = {}
    for name, (graph, graph_args) in recorded.items():
        if not graph.captured or _C._replay(graph.captured[0], graph_args) is None:
            continue  # ran as a fused graph (not replayable): not timed alone
        replay = functools.partial(_C._replay, graph.captured[0], graph_args)
        out[name] = time_per_call(replay, "tpu", warmup=1, iters=args.steps, repeats=args.rounds) * 1e3
    return out


def pipelined_ms(device: str, backend: str, tok, tokens, args) -> float:
    """The training step as compiled.py times it (no synchronize but the loss's .item()),
    median round, in milliseconds."""
    step, _ = compiled.train(device, "strict", backend, tok, tokens, args)
    secs = interleaved({"step": (step, lambda: torch_tpu.mode("strict"), device)}, args.steps, args.rounds)
    return statistics.median(secs["step"]) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser()
    compiled.add_run_args(ap)
    ap.add_argument("--markdown", default=None, help="write the table, with provenance, to this file")
    args = ap.parse_args(argv)
    text = load_corpus()
    tok = CharTokenizer(text)
    tokens = tok.encode_tensor(text)
    torch._dynamo.reset()
    configs = {"tpu torch.compile(backend='tpu')": build("tpu", "tpu", tok, tokens, args),
               "CPU torch.compile (inductor)": build("cpu", "inductor", tok, tokens, args)}
    # per config, per phase: the per-round mean seconds
    rounds = {name: [[] for _ in PHASES] for name in configs}
    for _ in range(args.rounds):
        for name, step in configs.items():
            totals = [0.0] * len(PHASES)
            for _ in range(args.steps):
                for i, t in enumerate(step()):
                    totals[i] += t
            for i in range(len(PHASES)):
                rounds[name][i].append(totals[i] / args.steps)
    tpu, ind = rounds["tpu torch.compile(backend='tpu')"], rounds["CPU torch.compile (inductor)"]
    rows = []
    for i, phase in enumerate(PHASES):
        t, c = statistics.median(tpu[i]), statistics.median(ind[i])
        per_round = [ti / ci for ti, ci in zip(tpu[i], ind[i])]
        rows.append({"phase": phase, "tpu_ms": t * 1e3, "inductor_ms": c * 1e3, "ratio": t / c,
                     "low": min(per_round), "high": max(per_round)})
    for r in rows:
        print(f"{r['phase']:16s} tpu {r['tpu_ms']:7.2f} ms  inductor {r['inductor_ms']:7.2f} ms  "
              f"tpu / inductor {r['ratio']:.2f}x (rounds {r['low']:.2f}-{r['high']:.2f}x)")
    alone = programs_alone(configs["tpu torch.compile(backend='tpu')"], args)
    pipelined = pipelined_ms("tpu", "tpu", tok, tokens, args)
    kinds = {"forward": "forward", "backward": "backward", "inference": "optimizer step"}
    device_rows = [(kinds.get(name.rsplit("_", 1)[0], name), ms) for name, ms in alone.items()]
    for label, ms in device_rows:
        print(f"{label:16s} replayed alone {ms:7.2f} ms")
    total = sum(ms for _, ms in device_rows)
    print(f"all programs     replayed alone {total:7.2f} ms; the pipelined step {pipelined:.2f} ms")
    result = {"rows": rows, "steps": args.steps, "rounds": args.rounds, "programs_alone_ms": alone,
              "pipelined_step_ms": pipelined}
    if args.markdown:
        prov = provenance()
        lines = [
            "# Compiled GPT training step, phase by phase",
            "",
            "Generated by `python benchmarks/compiled_phases.py --markdown docs/compiled_phases.md`: the GPT",
            "training step of `compiled.py` (model and `opt.step` compiled) with a synchronize after each",
            "phase, `backend='tpu'` against inductor on the CPU, timed in turns in one process,",
            f"{args.steps} steps each per round, {args.rounds} rounds; median round, and the ratio of the",
            "medians with the lowest and highest round. Time per phase: lower is better.",
            "",
            *provenance_lines(prov),
            "",
            "| phase | tpu (ms) | inductor (ms) | tpu / inductor | rounds |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            lines.append(f"| {r['phase']} | {r['tpu_ms']:.2f} | {r['inductor_ms']:.2f} | {r['ratio']:.2f}x | "
                         f"{r['low']:.2f}-{r['high']:.2f}x |")
        lines += [
            "",
            "## The programs alone",
            "",
            "Each compiled program of the tpu step replayed back to back with the arguments of one real",
            f"step, {args.steps} calls a round, {args.rounds} rounds, median round: its device time with no",
            "Dynamo, AOTAutograd or autograd around it. Then the step as `compiled.py` times it (pipelined:",
            "no synchronize but the loss's `.item()`). On the CPU plugin the host's work and the programs",
            "share the same cores, so the difference is the step's host work.",
            "",
            "| program | ms per call |",
            "| --- | ---: |",
        ]
        lines += [f"| {label} | {ms:.2f} |" for label, ms in device_rows]
        lines += [f"| all three, back to back | {total:.2f} |",
                  f"| the training step, pipelined | {pipelined:.2f} |"]
        lines.append("")
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
