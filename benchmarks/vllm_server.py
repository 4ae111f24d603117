"""vLLM's OpenAI server on a free local port, for the serving tests and
benchmark: `python -m torch_tpu.vllm serve MODEL ...` (vLLM's `vllm serve`)
in its own process group, ready once /health answers, stopped with SIGINT
(SIGKILL if it does not exit)."""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager


def request(port: int, method: str, path: str, body=None, timeout: float = 120):
    """(status, body) of one HTTP request to 127.0.0.1:port: the body as
    JSON, as text where it is not JSON, None where it is empty."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        try:
            return r.status, json.loads(data) if data else None
        except ValueError:
            return r.status, data.decode(errors="replace")
    finally:
        conn.close()


def stream(port: int, path: str, body: dict, timeout: float = 300) -> list:
    """The events (JSON objects) of a streamed OpenAI-style request, up to [DONE]."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(dict(body, stream=True)), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        events = []
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line[len("data: "):]))
        raise AssertionError("the stream ended without [DONE]")
    finally:
        conn.close()


def write_report(text: str, out: str | None, work: str, raw) -> None:
    """A serving benchmark's end: its Markdown report written to `out` (if
    any) and printed, its raw results in work/results.json."""
    if out:
        with open(out, "w") as f:
            f.write(text)
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(raw, f)
    print(text)
    print(f"raw results and logs: {work}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, chars: int = 4000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=timeout)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def serving(model: str, args: list[str], env: dict, log_path: str, start_timeout: float = 600):
    """Yields (port, process) of a server that answers /health; RuntimeError
    with the end of its log if it exits or does not start in time."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch_tpu.vllm", "serve", model, "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{_tail(log_path)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"the server did not start in {start_timeout:.0f} s:\n{_tail(log_path)}")
            time.sleep(1)
        yield port, proc
    finally:
        stop(proc)
