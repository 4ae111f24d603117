"""Two vLLM servers on tpu behind sglang-router (scripts/serve_routed.py): through the router,
greedy outputs equal a direct request to either worker; with the cache_aware policy requests
that share a prefix land on one worker (read from the workers' own counters) and hit its prefix
cache, and a new prefix goes to the idle worker; a worker killed in the middle of a run is
reported by the script and taken out of the router, requests in flight end (an answer or an
error, within their timeouts) and later ones succeed on the live worker; SIGTERM stops the
script and every process it started. sglang-router comes from scripts/setup_routing.sh."""
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlparse

import pytest

pytest.importorskip("sglang_router")

from vllm_server import request  # noqa: E402  (tests/vllm/conftest.py puts benchmarks/ on the path)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "serve_routed.py")
# test_server.py's server arguments: the same programs, so torch_tpu's compilation cache serves both.
VLLM_ARGS = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8"]
A = "the quick brown fox jumps over the lazy dog " * 2  # 88 tokens: 5 full blocks of 16
B = "paged attention stores keys and values in blocks " * 2
C = "vllm serves models on many devices including tpu " * 2
D = "hello world this is a tiny model for testing " * 2


def _port(url):
    return urlparse(url).port


def body(prompt, n=8, **extra):
    return {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def tokens(port, prompt, n=8):
    status, out = request(port, "POST", "/v1/completions", body(prompt, n))
    assert status == 200, out
    return out["choices"][0]["token_ids"]


def successes(port):
    """vllm:request_success_total summed over finish reasons, and prefix-cache hit tokens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    done = sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("vllm:request_success_total{"))
    hits = sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("vllm:prefix_cache_hits_total{"))
    return done, hits


def counts(ports, before):
    return [successes(p)[0] - before[i][0] for i, p in enumerate(ports)]


@contextmanager
def routed(model, policy, tmp_path, start_timeout=600):
    """scripts/serve_routed.py with 2 workers: yields (info, process, stdout path); afterwards
    SIGTERM, and every process it started is gone."""
    info_path, out_path = tmp_path / "info.json", tmp_path / "serve_routed.out"
    cmd = [sys.executable, SCRIPT, "--model", model, "--workers", "2", "--policy", policy, "--port", "0",
           "--info-file", str(info_path), "--log-dir", str(tmp_path / "logs"), "--", *VLLM_ARGS]
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    info = None
    try:
        deadline = time.time() + start_timeout
        while not info_path.exists():
            if proc.poll() is not None:
                pytest.fail(f"serve_routed.py exited with {proc.returncode}:\n{out_path.read_text()[-4000:]}")
            if time.time() > deadline:
                pytest.fail(f"serve_routed.py not serving in {start_timeout} s:\n{out_path.read_text()[-4000:]}")
            time.sleep(0.5)
        info = json.loads(info_path.read_text())
        yield info, proc, out_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail("serve_routed.py did not stop in 120 s after SIGTERM")
        if info is not None:  # no orphans: the router, the workers and their engine processes
            groups = [info["router_pid"]] + [w["pid"] for w in info["workers"]]  # each leads its group
            deadline, left = time.time() + 15, groups
            while left and time.time() < deadline:
                time.sleep(0.5)
                left = [g for g in groups if _group_alive(g)]
            if left:
                ps = subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat,etime,cmd"], capture_output=True, text=True).stdout
                for g in left:
                    os.killpg(g, signal.SIGKILL)
                pytest.fail(f"process groups left after SIGTERM: {left}\n{ps}")


def _group_alive(pgid):
    """Whether a process of group `pgid` is alive (zombies, dead but not reaped, do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def test_cache_aware_routing_keeps_a_prefix_on_one_worker_with_equal_greedy_outputs(models, tmp_path):
    with routed(models["llama"], "cache_aware", tmp_path) as (info, proc, out_path):
        router = _port(info["router"])
        workers = [_port(w["url"]) for w in info["workers"]]
        assert "router at " + info["router"] in out_path.read_text()
        before = [successes(p) for p in workers]

        # One prefix, one request after another: all on one worker, which reads its prefix cache.
        got = {p: tokens(router, p) for p in (A + "one", A + "two", A + "three")}
        n = counts(workers, before)
        assert sorted(n) == [0, 3], n
        wa = n.index(3)
        assert successes(workers[wa])[1] - before[wa][1] >= 2 * 80  # 5 blocks of A, twice

        # While that worker computes long answers, a new prefix goes to the other worker (the one
        # with fewer requests in flight: sglang-router's choice below its cache threshold), and
        # its later requests follow it there (idle as both then are, where a tie would pick the
        # first worker). Not streamed: with one streamed long request in flight, a new prefix
        # once went to the busy worker here (as if the router no longer counted it in flight).
        ends = []

        def hold(i):
            status, out = request(router, "POST", "/v1/completions", body(A + f"hold {i}", 160), timeout=180)
            ends.append((time.time(), status))

        holds = [threading.Thread(target=hold, args=(i,)) for i in range(3)]
        for t in holds:
            t.start()
        time.sleep(0.15)
        sent = time.time()
        got[B + "one"] = tokens(router, B + "one")
        for t in holds:
            t.join(180)
        assert len(ends) == 3 and all(s == 200 for _, s in ends), ends
        assert min(e for e, _ in ends) > sent, "the long requests ended before the new prefix was sent"
        for p in (B + "two", B + "three"):
            got[p] = tokens(router, p)
        n = counts(workers, before)
        assert n[wa] == 6 and n[1 - wa] == 3, n  # A x3 + the long ones; B x3

        # Through the router or straight to either worker: the same greedy tokens.
        for p, toks in got.items():
            assert toks == tokens(workers[0], p) == tokens(workers[1], p), p
        status, out = request(router, "GET", "/v1/models")
        assert status == 200, out


@pytest.mark.slow  # a second pair of servers
def test_a_killed_worker_is_reported_and_the_router_keeps_serving(models, tmp_path):
    with routed(models["llama"], "cache_aware", tmp_path) as (info, proc, out_path):
        router = _port(info["router"])
        workers = [_port(w["url"]) for w in info["workers"]]
        prompts = [x + s for x in (A, B, C, D) for s in ("one", "two")]
        ref = {p: tokens(workers[0], p, 8) for p in prompts}

        # 8 streams over 4 prefixes through the router; worker 1 is killed while they run.
        results, started = [None] * len(prompts), threading.Semaphore(0)

        def run(i):
            t0 = time.time()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", router, timeout=60)
                conn.request("POST", "/v1/completions", body=json.dumps(body(prompts[i], 100, stream=True)),
                             headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                started.release()
                data = r.read().decode(errors="replace")
                ok = r.status == 200 and "data: [DONE]" in data
                results[i] = ("done" if ok else f"http {r.status}", data[-300:], time.time() - t0)
            except Exception as e:  # noqa: BLE001  (a cut connection: an error, not a hang)
                started.release()
                results[i] = ("error", repr(e), time.time() - t0)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=120)
        os.killpg(info["workers"][1]["pid"], signal.SIGKILL)
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a request through the router hung"
        assert all(r is not None for r in results), results
        print("outcomes after the kill:", [(r[0], round(r[2], 1), r[1][-80:] if r[0] != "done" else "") for r in results])
        for r in results:  # each ended: complete, or an HTTP error, or a cut stream
            assert r[0] in ("done", "error") or r[0].startswith("http 5"), results

        # The script reports the dead worker and takes it out of the router.
        deadline = time.time() + 30
        while "worker 1 removed from the router" not in out_path.read_text():
            assert time.time() < deadline, out_path.read_text()[-3000:]
            time.sleep(0.5)
        text = out_path.read_text()
        assert f"worker 1 ({info['workers'][1]['url']}, pid {info['workers'][1]['pid']}) exited" in text
        status, out = request(router, "GET", "/workers")
        assert status == 200 and [w["url"] for w in out["workers"]] == [info["workers"][0]["url"]], out

        # Every prefix, including those worker 1 had, now succeeds on worker 0 with its tokens.
        for p in prompts:
            status, out = request(router, "POST", "/v1/completions", body(p, 8), timeout=60)
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == ref[p]
        assert proc.poll() is None  # still serving
