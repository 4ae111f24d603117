"""Fused eager (TORCH_TPU_DEFER_AND_FUSE=1 / torch_tpu.set_mode("fused")):
same results as strict eager, one cached graph per loop iteration, and the
persistent cache shared with every mode. The whole suite also runs with
TORCH_TPU_DEFER_AND_FUSE=1 (see README)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_tpu
from torch_tpu.data import CharTokenizer, batches, load_corpus
from torch_tpu.models import GPT

pytestmark = pytest.mark.mode_dependent  # the gate runs it in strict and fused eager

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fused():
    old = torch_tpu.get_mode()
    torch_tpu.set_mode("fused")
    torch_tpu.set_fallback("error")
    yield
    torch_tpu.set_fallback("warn")
    torch_tpu.set_mode(old)


def gpt_losses(mode, steps=20, seed=0, dropout=0.0):
    text = load_corpus()[:20000]
    tok = CharTokenizer(text)
    tokens = tok.encode_tensor(text)
    with torch_tpu.mode(mode):
        torch.manual_seed(seed)
        model = GPT(tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=dropout).to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(seed)
        losses, compiles, lowerings = [], [], []
        for x, y in batches(tokens, 32, 8, gen, steps=steps):
            _, loss = model(x.to("tpu"), y.to("tpu"))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            compiles.append(torch_tpu.metrics()["compiles"])
            lowerings.append(torch_tpu.metrics()["fused_lowerings"])
    return losses, compiles, lowerings


def test_fused_matches_strict_and_stops_compiling(fused):
    strict, _, _ = gpt_losses("strict")
    torch_tpu.reset_metrics()
    fusedl, compiles, lowerings = gpt_losses("fused")
    torch.testing.assert_close(torch.tensor(fusedl), torch.tensor(strict), rtol=1e-4, atol=1e-4)
    # After the warm-up steps the loop runs cached graphs only, and records
    # each op as a call of its signature's lowering without lowering it again.
    assert compiles[-1] == compiles[3], compiles
    assert lowerings[-1] == lowerings[1], lowerings
    assert torch_tpu.metrics()["fallbacks"] == {}


def test_each_op_signature_is_lowered_once(fused):
    x = torch.randn(7, 13, 3, device="tpu")
    before = torch_tpu.metrics()["fused_lowerings"]
    a = torch.atan2(x, x + 2.5)  # a signature no other test uses: add, then atan2
    assert torch_tpu.metrics()["fused_lowerings"] == before + 2
    b = torch.atan2(a, a + 2.5)  # the same two signatures: calls, no lowering
    assert torch_tpu.metrics()["fused_lowerings"] == before + 2
    xc = x.cpu()
    ref = torch.atan2(torch.atan2(xc, xc + 2.5), torch.atan2(xc, xc + 2.5) + 2.5)
    torch.testing.assert_close(b.cpu(), ref)


def test_dropout_rng_same_in_both_modes():
    torch.manual_seed(5)
    with torch_tpu.mode("strict"):
        a = torch.nn.functional.dropout(torch.ones(1000, device="tpu"), 0.3).cpu()
        r1 = torch.randn(50, device="tpu").cpu()
    torch.manual_seed(5)
    with torch_tpu.mode("fused"):
        b = torch.nn.functional.dropout(torch.ones(1000, device="tpu"), 0.3).cpu()
        r2 = torch.randn(50, device="tpu").cpu()
    assert torch.equal(a, b) and torch.equal(r1, r2)


def test_views_and_inplace_writes_in_fused_mode(fused):
    def program(dev):
        b = torch.arange(24.0, device=dev).reshape(4, 6)
        v = b.t()[1:4]
        v.mul_(-1)
        b[1] = 7
        b[:, ::2] += 1
        c = b.clone()
        c[c > 5] = 0
        return [b, v, c, b.sum(1)]

    ref = program("cpu")
    out = program("tpu")
    for r, o in zip(ref, out):
        torch.testing.assert_close(o.cpu(), r)


def test_fallback_op_in_the_middle_of_a_graph():
    with torch_tpu.mode("fused"):
        x = torch.randn(4, 3, device="tpu")
        y = x * 2
        eye = torch.eye(3, device="tpu") * 4
        with torch_tpu.lowerings_disabled("linalg_inv_ex"):  # on the CPU: the graph materialises first
            z = torch.linalg.inv(y[:3] + eye)
        w = (z + 1).sum()
        ref = (torch.linalg.inv(x.cpu()[:3] * 2 + torch.eye(3) * 4) + 1).sum()
        torch.testing.assert_close(w.cpu(), ref)


def test_deferred_index_error_surfaces_at_materialization(fused):
    x = torch.arange(5.0, device="tpu")
    y = x[torch.tensor([2, 9], device="tpu")] + 1  # deferred
    with pytest.raises(IndexError, match=r"aten::index.*issued at .*test_fused.py:\d+"):
        y.cpu()
    assert x.sum().item() == 10


def test_loop_without_host_reads_settles_into_one_graph_per_iteration(fused):
    w = torch.randn(16, 16, device="tpu")
    x = torch.randn(8, 16, device="tpu")
    for _ in range(4):  # warm-up: the detector learns the period
        for _ in range(6):
            x = torch.tanh(x @ w) * 0.5 + x
    torch.tpu.synchronize()
    torch_tpu.reset_metrics()
    for _ in range(60):
        x = torch.tanh(x @ w) * 0.5 + x
    torch.tpu.synchronize()
    m = torch_tpu.metrics()
    assert m["compiles"] == 0, m
    assert m["executions"] <= 240 // 10, m  # one graph per detected period (>= 10 ops)
    # Nothing is overwritten in place, so nothing is donated: a new array at
    # a dead one's address must not pair their buffers (that changed the
    # program's text by chance and compiled it again).
    assert m["donated_buffers"] == 0, m


def test_a_training_step_runs_as_forward_backward_and_update_programs(fused):
    # The pending graph is launched where recording enters and leaves the
    # backward pass, so the device runs each phase while the host records the
    # next: three cached programs a step, with the loss read at its end.
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.load_state_dict(ref.state_dict())
    model.to("tpu")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def step(m, opt, dev):
        loss = torch.nn.functional.cross_entropy(m(x.to(dev)), y.to(dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    for i in range(8):
        if i == 3:  # the momentum buffers exist from step 2 on: the programs are settled
            torch_tpu.reset_metrics()
        torch.testing.assert_close(step(model, opts[1], "tpu"), step(ref, opts[0], "cpu"))
    m = torch_tpu.metrics()
    assert m["compiles"] == 0, m
    assert m["executions"] == 3 * 5, m
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), r.detach())


def test_a_host_read_starts_the_pending_graph(fused):
    x = torch.arange(6.0, device="tpu")
    loss = (x * 3).sum()
    torch_tpu.sync()  # loss is computed; what follows is pending
    y = torch.tanh(x) + 1
    before = torch_tpu.metrics()["executions"]
    assert loss.item() == 45.0
    # The read launched the pending graph (y) although it did not need it ...
    assert torch_tpu.metrics()["executions"] == before + 1
    # ... so reading y later runs nothing more.
    torch.testing.assert_close(y.cpu(), torch.tanh(torch.arange(6.0)) + 1)
    assert torch_tpu.metrics()["executions"] == before + 1


def test_buffers_whose_old_value_is_dead_are_donated(fused):
    # An optimizer step overwrites parameters and moments in place: their old
    # buffers die with the graph, which writes the new values into them.
    # Buffers of at least 1 MiB are donated (TORCH_TPU_DONATE_MIN_BYTES).
    torch.manual_seed(0)
    params = [torch.randn(512, 512), torch.randn(32)]
    grads = [torch.randn(512, 512), torch.randn(32)]
    ref = [p.clone().requires_grad_() for p in params]
    dev = [p.to("tpu").requires_grad_() for p in params]
    view = dev[0].detach().view(-1)  # shares the storage: sees every update
    opt_ref = torch.optim.Adam(ref, lr=0.1)
    opt_dev = torch.optim.Adam(dev, lr=0.1)
    donated = []
    for step in range(4):
        for r, d, g in zip(ref, dev, grads):
            r.grad = g * (step + 1)
            d.grad = r.grad.to("tpu")
        opt_ref.step()
        before = torch_tpu.metrics()["donated_buffers"]
        opt_dev.step()
        torch_tpu.sync()
        donated.append(torch_tpu.metrics()["donated_buffers"] - before)
    # Each step from the second on: the big parameter and its two moments;
    # the 32-element bias is below the size limit.
    assert all(n == 3 for n in donated[1:]), donated
    for r, d in zip(ref, dev):
        torch.testing.assert_close(d.detach().cpu(), r.detach())
        torch.testing.assert_close(opt_dev.state[d]["exp_avg_sq"].cpu(), opt_ref.state[r]["exp_avg_sq"])
    torch.testing.assert_close(view.cpu(), ref[0].detach().view(-1))


def test_second_process_loads_fused_graphs_from_disk(tmp_path):
    code = textwrap.dedent("""
        import json, torch, torch_tpu
        torch_tpu.set_mode("fused")
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2)).to("tpu")
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for i in range(5):
            loss = m(torch.randn(4, 8, device="tpu")).square().mean()
            opt.zero_grad(); loss.backward(); opt.step(); loss.item()
        print(json.dumps(torch_tpu.metrics()["compiles"]))
    """)
    env = dict(os.environ, TORCH_TPU_CACHE_DIR=str(tmp_path))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert runs[0] > 0 and runs[1] == 0, runs


def test_recompile_reasons_name_the_difference(tmp_path):
    code = textwrap.dedent("""
        import torch, torch_tpu
        a = torch.randn(3, 4, device="tpu") * 2
        b = torch.randn(5, 4, device="tpu") * 2
        torch_tpu.set_mode("fused")
        for n in (3, 3, 4):
            x = torch.randn(n, 4, device="tpu")
            (x.sin() + 1).sum().item()
    """)
    env = dict(os.environ, TORCH_TPU_CACHE_DIR=str(tmp_path), TORCH_TPU_LOG_RECOMPILES="1",
               TORCH_TPU_DEFER_AND_FUSE="0")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [l for l in r.stderr.splitlines() if l.startswith("torch_tpu: compiling")]
    assert any("aten::mul: differs" in l and "t6,3,4 -> t6,5,4" in l for l in lines), lines
    fused = [l for l in lines if "fused graph" in l]
    assert len(fused) == 2  # the repeated n=3 graph is cached
    assert "differs from the last compiled graph" in fused[1] and "t6,4,4" in fused[1]


def test_first_step_graphs_are_the_later_steps_graphs(fused):
    # What a first step makes from the host's values is uploaded, not recorded, in fused eager, so
    # its graphs read those tensors as inputs, as every later step does, and the second step runs
    # the first step's programs: AdamW's states (zeros_like: a small fill of a tensor that holds
    # nothing yet), and the model's and the batch's .to("tpu") (a copy from the host into such a
    # tensor). Recorded, the states were constants of a first update program of its own, and the
    # first forward also computed every parameter and the batch: the second step compiled both again.
    def run(mode):
        with torch_tpu.mode(mode):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(13, 11), torch.nn.Tanh(), torch.nn.Linear(11, 5)).to("tpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            x = torch.randn(7, 13).to("tpu")
            built = []
            for _ in range(3):
                loss = model(x).square().mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss.item()
                m = torch_tpu.metrics()
                built.append(m["compiles"] + m["disk_hits"])  # programs this process had not built
            return [p.detach().cpu() for p in model.parameters()], built

    want, _ = run("strict")
    got, built = run("fused")
    assert built[1] == built[0] and built[2] == built[1], f"later steps built new programs: {built}"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
