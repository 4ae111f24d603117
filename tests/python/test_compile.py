"""torch.compile(backend="tpu"): whole graphs through Dynamo and AOTAutograd, run as one
program each through the eager lowering table; results against eager."""

import gc

import pytest
import torch
import torch.nn.functional as F

import torch_tpu
from torch_tpu.models import CNN, GPT, MLP, train_steps

pytestmark = pytest.mark.mode_dependent  # the gate runs it in strict and fused eager


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch_tpu.set_fallback("error")
    yield
    torch_tpu.set_fallback("warn")
    torch._dynamo.reset()


def _graphs_since(n):
    return torch_tpu.compiled_graphs()[n:]


def test_backend_is_registered_and_inference_matches_eager():
    from torch._dynamo.backends.registry import lookup_backend

    from torch_tpu._compile import tpu_backend

    assert lookup_backend("tpu") is tpu_backend  # found through the entry point
    torch.manual_seed(0)
    model = MLP(16, 32, 4).to("tpu")
    x = torch.randn(8, 16, device="tpu")
    n = len(torch_tpu.compiled_graphs())
    compiled = torch.compile(model, backend="tpu")
    with torch.no_grad():
        ref = model(x)
        out = compiled(x)
        out2 = compiled(x * 2)
    torch.testing.assert_close(out.cpu(), ref.cpu())
    torch.testing.assert_close(out2.cpu(), model(x * 2).detach().cpu())
    graphs = _graphs_since(n)
    assert len(graphs) == 1 and graphs[0]["calls"] == 2 and graphs[0]["ops"] > 0
    # One program for the whole graph (none when the disk cache already holds it).
    assert graphs[0]["programs_compiled"] <= 1


def _model_and_data(name):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if name == "mlp":
        model = MLP(16, 32, 4)
        data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(20)]
    elif name == "gpt":
        model = GPT(40, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
        data = [(torch.randint(0, 40, (4, 16), generator=g), torch.randint(0, 40, (4, 16), generator=g))
                for _ in range(20)]
    else:
        model = CNN(num_classes=10, in_channels=3, width=8)
        data = [(torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(20)]
    return model.to("tpu"), data


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_training_matches_eager(name):
    model, data = _model_and_data(name)
    eager = train_steps(model, data, torch.optim.AdamW(model.parameters(), lr=1e-2), steps=20)
    model, data = _model_and_data(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = len(torch_tpu.compiled_graphs())
    compiled = train_steps(torch.compile(model, backend="tpu"), data, opt, steps=20)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-4)
    kinds = {g["name"].split("_")[0] for g in _graphs_since(n)}
    assert {"forward", "backward"} <= kinds, kinds


def test_outputs_are_not_views_and_can_be_updated_in_place():
    # Replayed outputs used to be views of the program's result buffers; autograd refuses
    # in-place updates of a compiled Function's view outputs (the Trainer does `loss *= n`).
    def f(x, w):
        y = (x @ w).relu()
        return y.sum(), y

    w_cpu = torch.randn(4, 4).requires_grad_()
    w = w_cpu.detach().to("tpu").requires_grad_()
    x = torch.randn(4, 4)
    cf = torch.compile(f, backend="tpu")
    for _ in range(3):  # the first call records, the later ones replay
        loss, y = cf(x.to("tpu"), w)
        assert not loss._is_view() and not y._is_view()
        loss *= 2
        loss.backward()
        ref, _ = f(x, w_cpu)
        (ref * 2).backward()
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad)


def test_graph_break_runs_the_pieces_eagerly():
    def f(x):
        y = torch.sin(x) * 2
        if y.sum().item() > 0:  # data-dependent: a graph break
            y = y + 1
        return torch.cos(y)

    x = torch.randn(5, device="tpu")
    out = torch.compile(f, backend="tpu")(x)
    torch.testing.assert_close(out.cpu(), f(x.cpu()))


def test_input_mutation_and_aliasing():
    def f(buf, x):
        buf.add_(x)  # mutates a graph input
        return buf * 2, buf.view(-1)[:2]

    b_cpu, x_cpu = torch.zeros(2, 3), torch.arange(6.0).reshape(2, 3)
    b_tpu, x_tpu = b_cpu.to("tpu"), x_cpu.to("tpu")
    cf = torch.compile(f, backend="tpu")
    for _ in range(2):
        ref = f(b_cpu, x_cpu)
        out = cf(b_tpu, x_tpu)
        torch.testing.assert_close(b_tpu.cpu(), b_cpu)
        for o, r in zip(out, ref):
            torch.testing.assert_close(o.cpu(), r)
    # The returned alias is a view of the input: writes through it land in the input.
    assert out[1]._is_view()
    out[1].add_(100)
    ref[1].add_(100)
    torch.testing.assert_close(b_tpu.cpu(), b_cpu)


def test_in_place_update_of_a_saved_weight_before_backward_raises_as_in_eager():
    def run(dev, backend):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 4).to(dev)
        m = torch.compile(lin, backend=backend) if backend else lin
        x = torch.randn(3, 8, device=dev, requires_grad=True)
        for _ in range(2):  # the first call records, the second replays
            out = m(x).sum()
            with torch.no_grad():
                lin.weight.mul_(2)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.backward()

    run("cpu", None)
    run("tpu", "tpu")


def test_rng_is_reproducible_under_manual_seed():
    def f(x):
        return F.dropout(x, p=0.5, training=True) + torch.rand_like(x)

    cf = torch.compile(f, backend="tpu")
    x = torch.ones(64, device="tpu")
    torch.manual_seed(3)
    a = cf(x).cpu()
    torch.manual_seed(3)
    b = cf(x).cpu()
    c = cf(x).cpu()
    torch.testing.assert_close(a, b)
    assert not torch.equal(b, c)


def test_changing_python_scalars_do_not_compile_new_programs():
    def f(x, scale):
        return x * scale + 1

    cf = torch.compile(f, backend="tpu")
    x = torch.randn(4, device="tpu")
    cf(x, 0.5)
    cf(x, 0.25)  # Dynamo may retrace once to make the float dynamic
    torch_tpu.reset_metrics()
    for s in (0.1, 0.2, 0.3):
        torch.testing.assert_close(cf(x, s).cpu(), x.cpu() * s + 1)
    assert torch_tpu.metrics()["compiles"] == 0


def test_new_shape_compiles_a_new_program_and_says_why():
    cf = torch.compile(lambda x: torch.tanh(x) * 3, backend="tpu")
    cf(torch.randn(3, device="tpu"))
    x7 = torch.randn(7, device="tpu")  # before the reset: its eager program may compile too
    torch_tpu.reset_metrics()
    cf(x7)
    m = torch_tpu.metrics()
    assert m["executions"] >= 1
    reasons = m["recompile_reasons"]
    assert m["compiles"] == 0 or any("graph" in r for r in reasons), reasons


def test_dynamic_shapes_compile_one_program_per_shape():
    cf = torch.compile(lambda x: (x * 2).sum(0), backend="tpu", dynamic=True)
    for n in (3, 5):
        x = torch.randn(n, 4, device="tpu")
        torch.testing.assert_close(cf(x).cpu(), (x.cpu() * 2).sum(0))


def test_autocast_bfloat16_in_a_compiled_graph():
    lin = torch.nn.Linear(8, 8).to("tpu")
    x = torch.randn(4, 8, device="tpu")

    def f(x):
        with torch.autocast("tpu", dtype=torch.bfloat16):
            return lin(x)

    out = torch.compile(f, backend="tpu")(x)
    ref = f(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), ref.cpu())


def test_errors_in_a_compiled_graph_surface_with_the_op_name():
    def f(x, i):
        return x[i] + 1

    cf = torch.compile(f, backend="tpu")
    x = torch.arange(4.0, device="tpu")
    mode = torch_tpu.get_mode()
    torch.testing.assert_close(cf(x, torch.tensor([1], device="tpu")).cpu(), torch.tensor([2.0]))
    for _ in range(2):  # the recording, then a replay
        with pytest.raises(IndexError):
            cf(x, torch.tensor([7], device="tpu")).cpu()
    assert torch_tpu.get_mode() == mode  # the caller's mode is restored after a failure


def test_later_calls_replay_the_recorded_program():
    cf = torch.compile(lambda x, y: (x @ y).relu().sum(0), backend="tpu")
    n = len(torch_tpu.compiled_graphs())
    x, y = torch.randn(6, 5, device="tpu"), torch.randn(5, 3, device="tpu")
    for i in range(4):
        xi = x + i
        torch.testing.assert_close(cf(xi, y).cpu(), (xi.cpu() @ y.cpu()).relu().sum(0))
    g = _graphs_since(n)[0]
    assert g["calls"] == 4 and g["replays"] == 3, g
    # A view argument (another layout) records again, then replays too.
    xt = torch.randn(5, 6, device="tpu").t()
    for _ in range(2):
        torch.testing.assert_close(cf(xt, y).cpu(), (xt.cpu() @ y.cpu()).relu().sum(0))


def test_a_masked_fill_by_index_put_keeps_the_graph_one_replayable_program():
    # `x[mask] = 0` (DTensor masks a sharded embedding so): a select, not a size read back.
    def f(ids, emb):
        mask = (ids < 3) | (ids >= 9)
        local = ids.clone() - 3
        local[mask] = 0
        out = emb[local]
        out[mask] = 0.0  # a mask of the leading dims
        return out * 2

    cf = torch.compile(f, backend="tpu")
    n = len(torch_tpu.compiled_graphs())
    emb = torch.randn(6, 4)
    for i in range(3):
        ids = torch.randint(0, 12, (3, 5), generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(cf(ids.to("tpu"), emb.to("tpu")).cpu(), f(ids, emb))
    g = _graphs_since(n)[0]
    assert g["replays"] == 2, g


def test_replays_keep_constants_and_view_offsets_of_the_recording():
    # The recording bakes the graph's Python constants (alpha, the 0.5) and its
    # views' storage offsets (the slices, the per-head split) into the program:
    # replays on new values and on views at other offsets must stay exact.
    def f(qkv, w):
        q, k, v = qkv.split(8, dim=-1)
        heads = [t.view(2, 5, 2, 4).transpose(1, 2) for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*heads, is_causal=True)
        return torch.add(o.transpose(1, 2).reshape(2, 5, 8), w[1:], alpha=0.5) - 2

    cf = torch.compile(f, backend="tpu")
    n = len(torch_tpu.compiled_graphs())
    base = torch.randn(3, 2, 5, 24)
    w = torch.randn(6, 8)
    for i in range(3):
        qkv = base[i]
        torch.testing.assert_close(cf(qkv.to("tpu"), w.to("tpu")).cpu(), f(qkv, w))
    storage = base.to("tpu")
    for i in range(3):  # views of one storage: other offsets record again, then replay
        torch.testing.assert_close(cf(storage[i], w.to("tpu")).cpu(), f(base[i], w))
    assert sum(g["replays"] for g in _graphs_since(n)) >= 2


def test_a_recording_that_must_name_all_inputs_refuses_other_tensors():
    # The vLLM runner's step capture names every tensor that can change
    # between steps (all_inputs): a recording that reads another device tensor
    # is not replayable, since a replay would read that tensor's buffer of the
    # recording's time. Without all_inputs such a tensor is a constant.
    from torch_tpu import _C

    x, other = torch.randn(4, device="tpu"), torch.randn(4, device="tpu")
    for all_inputs, replayable in ((True, False), (False, True)):
        assert _C._capture_begin([x], all_inputs)
        out = x * 2 + other
        graph = _C._capture_end([out])
        assert (graph is not None) == replayable
        torch.testing.assert_close(out.cpu(), x.cpu() * 2 + other.cpu())
    # A tensor made before the recording and never written reads as zeros now,
    # not necessarily at a replay; one made while recording is the graph's own.
    unwritten = torch.empty(4, device="tpu")
    assert _C._capture_begin([x], True)
    out = x + unwritten * 0
    assert _C._capture_end([out]) is None
    assert _C._capture_begin([x], True)
    buf = torch.empty(6, device="tpu")  # as vLLM's attention output, written in part
    buf[:4] = x
    out = buf[:4] * 2
    assert _C._capture_end([out]) is not None
    assert _C._capture_begin([x, other], True)
    out = x * 2 + other
    graph = _C._capture_end([out])
    assert graph is not None
    y = torch.randn(4, device="tpu")
    (got,) = _C._replay(graph, [y, other])
    torch.testing.assert_close(got.cpu(), y.cpu() * 2 + other.cpu())


def test_timm_model_matches_eager():
    timm = pytest.importorskip("timm")  # needs a torchvision built for this torch
    torch.manual_seed(0)
    net = timm.create_model("resnet18", pretrained=False, num_classes=5).to("tpu").eval()
    x = torch.randn(2, 3, 32, 32, device="tpu")
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(net, backend="tpu")(x).cpu(), net(x).cpu(), rtol=1e-4, atol=1e-4)


def test_transformers_model_matches_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    lm = transformers.GPT2LMHeadModel(cfg).to("tpu").eval()
    ids = torch.randint(0, 64, (2, 12), device="tpu")
    with torch.no_grad():
        ref = lm(ids).logits
        out = torch.compile(lm, backend="tpu")(ids).logits
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-4, atol=1e-4)


def test_compiled_optimizer_step_replays_and_matches_eager():
    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MLP(16, 32, 4).to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
        step = torch.compile(opt.step, backend="tpu") if compiled else opt.step
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(5):
            x, y = torch.randn(8, 16, generator=g).to("tpu"), torch.randint(0, 4, (8,), generator=g).to("tpu")
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    n = len(torch_tpu.compiled_graphs())
    eager_losses, eager_params = run(False)
    losses, params = run(True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-5)
    for p, q in zip(params, eager_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    assert any(g["replays"] > 0 for g in _graphs_since(n))


def test_a_recorded_graph_keeps_no_argument_alive():
    # The recording's arguments (weights, activations, a whole first step's
    # state) must die with their tensors, not live as long as the graph.
    cf = torch.compile(lambda x: x.sin() * x, backend="tpu")
    gc.collect()  # earlier tests' tensors in reference cycles die now, not during the count
    torch.tpu.synchronize()
    before = torch_tpu.metrics()["live_buffers"]
    x = torch.randn(64, 64, device="tpu")
    y = cf(x)
    torch.testing.assert_close(y.cpu(), x.cpu().sin() * x.cpu())
    del x, y
    torch.tpu.synchronize()
    assert torch_tpu.metrics()["live_buffers"] == before
    x = torch.randn(64, 64, device="tpu")  # a replay of the same graph
    z = cf(x)
    torch.testing.assert_close(z.cpu(), x.cpu().sin() * x.cpu())
    del x, z
    torch.tpu.synchronize()
    assert torch_tpu.metrics()["live_buffers"] == before


def test_a_compiled_optimizer_step_donates_its_state_and_matches_eager():
    # The compiled step writes each parameter, both moments and the step
    # count into their old buffers, replay after replay, and a view of a
    # weight taken before a step still sees the update.
    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Linear(512, 512).to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
        step = torch.compile(opt.step, backend="tpu") if compiled else opt.step
        g = torch.Generator().manual_seed(1)
        row = model.weight[3]
        donated = []
        for _ in range(4):
            x = torch.randn(8, 512, generator=g).to("tpu")
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            d0 = torch_tpu.metrics()["donated_buffers"]
            step()
            torch.tpu.synchronize()
            donated.append(torch_tpu.metrics()["donated_buffers"] - d0)
        return [p.detach().cpu() for p in model.parameters()], row.detach().cpu(), donated

    params, row, donated = run(True)
    eager_params, eager_row, _ = run(False)
    for p, q in zip(params, eager_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row, params[0][3])
    torch.testing.assert_close(row, eager_row, rtol=1e-5, atol=1e-5)
    # Weight and bias, each with two moments and a step count, in every
    # replay. In strict eager the recording's run copies the three state
    # tensors that hold a kept fill (one zeros per state shape: [512, 512],
    # [512] and the count; see test_fills_reuse_kept_results_and_in_place_updates_do_not_leak);
    # fused eager uploads and keeps the fills of fresh tensors of at most 256 KiB
    # (dispatch/dispatcher.cpp, fillWholeDeferred): the [512] moment and the count;
    # the [512, 512] ones stay constants of its graph.
    first = 6 if torch_tpu._C._fused() else 5
    assert donated == [first, 8, 8, 8], donated


def test_a_compiled_in_place_update_that_returns_its_argument_keeps_the_update_replay_after_replay():
    # `t.add_(1).mul_(2)` writes its argument and returns it: the program's result is both.
    # In fused eager a replay is a call in the pending graph, whose result must land in the
    # argument as well as in the returned tensor (it once went to the returned one alone:
    # the argument read back unchanged). Large enough to be donated, and small.
    bump = torch.compile(lambda t: t.add_(1).mul_(2), backend="tpu")
    for shape in [(300, 1024), (3, 4)]:
        torch._dynamo.reset()
        w = torch.ones(shape, device="tpu")
        ref = torch.ones(shape)
        for _ in range(4):  # record, then replays; read between them
            out = bump(w)
            ref.add_(1).mul_(2)
            torch.testing.assert_close(w.cpu(), ref)
            torch.testing.assert_close(out.cpu(), ref)
        e = torch.zeros(shape, device="tpu")  # another argument, two replays unread in between
        bump(e)
        out = bump(e)
        torch.testing.assert_close(e.cpu(), torch.full(shape, 6.0))
        torch.testing.assert_close(out.cpu(), torch.full(shape, 6.0))
        out.add_(1)  # the result is the argument, as in eager
        torch.testing.assert_close(e.cpu(), torch.full(shape, 7.0))


def test_a_launch_that_donates_returns_before_its_program_finishes():
    # The plugin blocks the destruction of a donated buffer's handle until the
    # program that took it finishes; the launch must not wait for that.
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096).to("tpu")  # 64 MiB: an AdamW step of tens of milliseconds
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    step = torch.compile(opt.step, backend="tpu")
    x = torch.randn(4, 4096, device="tpu")
    for _ in range(2):  # record, then replay
        model(x).sum().backward()
        step()
    still_running = []
    for _ in range(5):
        torch.tpu.synchronize()
        d0 = torch_tpu.metrics()["donated_buffers"]
        step()
        if torch_tpu._C._fused():  # the replay is a call in the pending graph: launch it
            torch_tpu._C._flush(-1)
        still_running.append(not torch.tpu.current_stream().query())
        torch.tpu.synchronize()
        assert torch_tpu.metrics()["donated_buffers"] - d0 == 8
    # A launch that waited finds its program done; a busy host may rarely
    # also see one finish first, so most, not all, must still be running.
    assert sum(still_running) >= 4, still_running
