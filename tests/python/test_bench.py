"""torch-tpu bench: a sweep over 2 batch sizes x 2 modes of a tiny model on tpu and the CPU, each
target in its own process; JSON, CSV and two plots that show what they claim; cost by hand;
--compare; bad input."""

import csv
import json
import os
import subprocess
import sys

import pytest

from torch_tpu import bench

# Each bench target runs in its own process in the mode it names, whatever the caller's mode:
# the fused-eager pass of scripts/test.sh would repeat these tests unchanged.
pytestmark = pytest.mark.own_modes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG = b"\x89PNG\r\n\x1a\n"


def cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "torch_tpu", "bench", "--no-progress", *args], capture_output=True,
                          text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    cfg = out / "sweep.toml"
    cfg.write_text('model = "gpt"\ntask = "generate"\nbatch = [1, 2]\nprompt_len = [4]\nnew_tokens = [4]\n'
                   'devices = ["tpu", "cpu"]\nmodes = ["strict", "fused"]\nrounds = 2\ncalls = 2\n'
                   '[prices]\ntpu = 1.20\ncpu = 0.10\n')
    r = cli("--config", str(cfg), "--rounds", "2", "--max-latency-ms", "1000", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


def test_sweep_writes_json_csv_and_plots(sweep):
    out, stdout = sweep
    result = json.loads((out / "bench.json").read_text())
    rows = result["rows"]
    # tpu strict, tpu fused, cpu eager (fused eager is tpu's own) x 2 batch sizes
    assert sorted((r["device"], r["mode"], r["batch"]) for r in rows) == sorted(
        (d, m, b) for d, m in (("tpu", "strict"), ("tpu", "fused"), ("cpu", "eager")) for b in (1, 2))
    for r in rows:
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["round_min"] <= r["tokens_per_s"] <= r["round_max"]
        assert r["latency_p50_ms"] <= r["latency_p90_ms"] <= r["latency_p99_ms"]
        assert r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0 and r["first_call_s"] > 0
        assert 0 < r["mfu"] < 1 and r["params"] > 0
    assert result["config"]["rounds"] == 2 and result["environment"]["torch"]
    with open(out / "bench.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and {t["env_torch"] for t in table} == {result["environment"]["torch"]}
    assert "cheapest per 1M tokens within the latency limit" in stdout
    for png in ("throughput.png", "cost_latency.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000


def test_plots_show_what_they_claim(sweep, tmp_path):
    out, _ = sweep
    result = json.loads((out / "bench.json").read_text())
    shown = bench.write_outputs(result, str(tmp_path))
    tp = shown["throughput.png"]
    assert tp["x"] == "batch size" and tp["y"] == "throughput (tokens/s)"
    assert sorted(tp["legend"]) == ["cpu eager float32", "tpu fused float32", "tpu strict float32"]
    for r in result["rows"]:
        assert [r["batch"], pytest.approx(r["tokens_per_s"])] in tp["lines"][f"{r['device']} {r['mode']} float32"]
    cl = shown["cost_latency.png"]
    assert cl["x"] == "p99 latency per call (ms)" and cl["y"] == "cost per 1M tokens"
    assert "latency limit 1000.0 ms" in cl["legend"]
    r = result["rows"][0]
    assert [pytest.approx(r["latency_p99_ms"]), pytest.approx(r["cost_per_1m_tokens"])] in \
        cl["lines"][f"{r['device']} {r['mode']} float32"]


def test_cost_is_price_over_throughput(sweep):
    out, _ = sweep
    rows = json.loads((out / "bench.json").read_text())["rows"]
    for r in rows:
        price = {"tpu": 1.20, "cpu": 0.10}[r["device"]]
        # dollars per hour / tokens per hour * 1M tokens
        assert r["cost_per_1m_tokens"] == pytest.approx(price / (r["tokens_per_s"] * 3600) * 1e6)


def test_compare_merges_two_runs(sweep, tmp_path):
    out, _ = sweep
    a, b = tmp_path / "gpu_box.json", tmp_path / "tpu_box.json"
    data = json.loads((out / "bench.json").read_text())
    a.write_text(json.dumps(data))
    b.write_text(json.dumps(data))
    r = cli("--compare", str(a), str(b), "--out", str(tmp_path / "cmp"))
    assert r.returncode == 0, r.stderr
    merged = json.loads((tmp_path / "cmp" / "bench.json").read_text())
    assert len(merged["rows"]) == 2 * len(data["rows"])
    assert {row["run"] for row in merged["rows"]} == {"gpu_box", "tpu_box"}
    assert set(merged["environment"]) == {"gpu_box", "tpu_box"}
    assert (tmp_path / "cmp" / "throughput.png").read_bytes().startswith(PNG)


def test_bad_input(tmp_path, capsys):
    from torch_tpu import bench

    def refused(*args):  # in this process: argument errors end before any worker starts
        try:
            rc = bench.main(["--no-progress", *args])
        except SystemExit as e:
            rc = e.code
        return rc, capsys.readouterr().err

    rc, err = refused("--model", str(tmp_path / "no_such_model"))
    assert rc == 2 and "no such folder" in err
    rc, err = refused("--devices", "cuda")
    assert rc == 2 and "'cuda' is not present" in err
    prices = tmp_path / "prices.json"
    prices.write_text("{tpu: 1.2")
    rc, err = refused("--price", str(prices))
    assert rc == 2 and "prices file" in err
    assert refused("--price", "tpu=cheap")[0] == 2
    assert refused("--task", "train", "--optimizer", "lion")[0] == 2
    assert refused("--compare", str(prices))[0] == 2
    # A workload that fails in the worker: the row says why, the results are still written.
    r = cli("--model", "hf:no_such_architecture", "--devices", "cpu", "--modes", "strict", "--rounds", "1",
            "--out", str(tmp_path / "partial"))
    assert r.returncode == 1
    (row,) = json.loads((tmp_path / "partial" / "bench.json").read_text())["rows"]
    assert "no_such_architecture" in row["error"]


def test_training_step_with_a_chosen_optimizer(tmp_path):
    r = cli("--model", "hf:llama:tiny", "--task", "train", "--optimizer", "sgd", "--batch", "2", "--seq-len", "8",
            "--devices", "tpu", "--modes", "strict", "--rounds", "1", "--calls", "2", "--warmup", "0",
            "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert row["optimizer"] == "sgd" and row["tokens_per_s"] > 0 and row["ttft_p50_ms"] is None
