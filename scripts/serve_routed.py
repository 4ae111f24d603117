"""Several vLLM servers on tpu behind one router: N workers (`python -m torch_tpu.vllm serve`,
vLLM's OpenAI server, prefix caching on as vLLM's default), each on its own port, and
sglang-router (`python -m sglang_router.launch_router`, scripts/setup_routing.sh installs it) in
front of them with a chosen policy. Prints the router's URL once every worker is registered,
then watches its children: a worker that exits is reported and taken out of the router (the
router and the other workers go on serving); SIGINT or SIGTERM (or the router exiting, or every
worker gone) stops everything it started, each child in its own process group, so that nothing
outlives it.

    .venv-vllm/bin/python scripts/serve_routed.py --model PATH --workers 2 --policy cache_aware \\
        --port 30000 [-- extra vLLM serve args, e.g. --dtype float32 --max-model-len 2048]

Unknown arguments go to every vLLM server as well (after `--` or not).
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

POLICIES = ["cache_aware", "round_robin", "random", "power_of_two"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http(method: str, url: str, timeout: float = 5.0, body: dict | None = None):
    """(status, parsed JSON or text); status 0 when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except OSError:
        return 0, None
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def _die_with_parent():
    """In the child, before exec: its own session (so that a terminal's Ctrl-C reaches only this
    script, which stops the children in order), and SIGTERM when this script dies, even by
    SIGKILL (Linux; elsewhere only the session)."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


class Child:
    def __init__(self, name: str, cmd: list[str], env: dict, log_path: str, url: str):
        self.name, self.cmd, self.log_path, self.url = name, cmd, log_path, url
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)
        self.reported = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGINT, timeout: float = 60) -> None:
        """`sig` to its process group (the vLLM server and its engine process), SIGKILL to the
        group if it has not exited after `timeout` s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (an engine process whose parent is gone)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait()


class Stop(Exception):
    pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)  # vLLM options must not be read as abbreviations of ours
    ap.add_argument("--model", required=True, help="model path or name, as for `vllm serve`")
    ap.add_argument("--workers", type=int, default=2, help="vLLM servers (default 2)")
    ap.add_argument("--policy", default="cache_aware", choices=POLICIES, help="the router's policy")
    ap.add_argument("--host", default="127.0.0.1", help="the router's address (workers listen on 127.0.0.1)")
    ap.add_argument("--port", type=int, default=30000, help="the router's port (0: a free one)")
    ap.add_argument("--worker-ports", type=int, nargs="*", help="one per worker (default: free ports)")
    ap.add_argument("--router-metrics-port", type=int, default=0, help="router's Prometheus port (0: a free one)")
    ap.add_argument("--log-dir", help="logs of the workers and the router (default: a new temporary folder)")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds for each worker to answer /health")
    ap.add_argument("--staggered-start", action="store_true",
                    help="start the first worker alone, then the others (they read the programs it compiled "
                         "from torch_tpu's disk cache); default: all at once")
    ap.add_argument("--dev-mode", action="store_true",
                    help="VLLM_SERVER_DEV_MODE=1 on the workers: vLLM's /reset_prefix_cache and other dev routes")
    ap.add_argument("--pin-devices", action="store_true",
                    help="worker i sees only chip i (TPU_VISIBLE_CHIPS=i), for hosts with several chips")
    ap.add_argument("--router-arg", action="append", default=[],
                    help="extra argument for sglang_router.launch_router (repeat; e.g. --router-arg=--cache-threshold=0.5)")
    ap.add_argument("--info-file", help="write the URLs and process ids as JSON here once serving")
    args, vllm_args = ap.parse_known_args(argv)
    vllm_args = [a for a in vllm_args if a != "--"]
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    if args.worker_ports and len(args.worker_ports) != args.workers:
        ap.error("--worker-ports needs one port per worker")
    if "--no-enable-prefix-caching" in vllm_args:
        print("serve_routed: warning: prefix caching is off; cache-aware routing gains nothing", flush=True)
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        print("serve_routed: sglang_router is not installed here; run `bash scripts/setup_routing.sh`", file=sys.stderr)
        return 2

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="serve_routed_")
    os.makedirs(log_dir, exist_ok=True)
    workers: list[Child] = []
    router: Child | None = None
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum
        raise Stop()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def start_worker(i: int) -> Child:
        port = args.worker_ports[i] if args.worker_ports else free_port()
        env = dict(os.environ)
        if args.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if args.pin_devices:
            env["TPU_VISIBLE_CHIPS"] = str(i)
        cmd = [sys.executable, "-m", "torch_tpu.vllm", "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
               *vllm_args]
        w = Child(f"worker {i}", cmd, env, os.path.join(log_dir, f"worker{i}.log"), f"http://127.0.0.1:{port}")
        print(f"serve_routed: starting worker {i} on {w.url} (pid {w.pid}, log {w.log_path})", flush=True)
        return w

    def wait_healthy(group: list[Child]) -> None:
        deadline = time.time() + args.start_timeout
        pending = list(group)
        while pending:
            for w in list(pending):
                if not w.alive():
                    raise RuntimeError(f"{w.name} exited with {w.proc.returncode} while starting; "
                                       f"end of {w.log_path}:\n{_tail(w.log_path)}")
                if http("GET", w.url + "/health", timeout=5)[0] == 200:
                    print(f"serve_routed: {w.name} is ready ({w.url})", flush=True)
                    pending.remove(w)
            if pending and time.time() > deadline:
                raise RuntimeError(f"{pending[0].name} did not answer /health in {args.start_timeout:.0f} s; "
                                   f"end of {pending[0].log_path}:\n{_tail(pending[0].log_path)}")
            if pending:
                time.sleep(1)

    rc = 0
    try:
        t0 = time.time()
        if args.staggered_start:
            workers = [start_worker(0)]
            wait_healthy(workers)
            rest = [start_worker(i) for i in range(1, args.workers)]
            workers += rest
            wait_healthy(rest)
        else:
            workers = [start_worker(i) for i in range(args.workers)]
            wait_healthy(workers)

        port = args.port or free_port()
        metrics_port = args.router_metrics_port or free_port()
        # Health checks every 5 s (sglang-router's default is 60 s) so that a dead worker is marked
        # unhealthy soon even where this script does not see it exit (another host); a short grace
        # period at shutdown: this script stops the workers right after.
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(port),
               "--worker-urls", *[w.url for w in workers], "--policy", args.policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
               "--health-check-interval-secs", "5", "--health-failure-threshold", "2",
               "--shutdown-grace-period-secs", "5", "--log-level", "warn", *args.router_arg]
        router_url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{port}"
        router = Child("router", cmd, dict(os.environ), os.path.join(log_dir, "router.log"), router_url)
        deadline = time.time() + 120
        while True:  # the router registers its workers in the background (a few seconds)
            if not router.alive():
                raise RuntimeError(f"the router exited with {router.proc.returncode}:\n{_tail(router.log_path)}")
            status, out = http("GET", router_url + "/workers")
            if status == 200 and isinstance(out, dict):
                healthy = {w["url"] for w in out.get("workers", []) if w.get("is_healthy")}
                if healthy >= {w.url for w in workers}:
                    break
            if time.time() > deadline:
                raise RuntimeError(f"the router did not register its workers in 120 s:\n{_tail(router.log_path)}")
            time.sleep(0.5)

        info = {"router": router_url, "router_metrics": f"http://127.0.0.1:{metrics_port}/metrics",
                "policy": args.policy, "log_dir": log_dir, "pid": os.getpid(), "router_pid": router.pid,
                "workers": [{"url": w.url, "pid": w.pid, "log": w.log_path} for w in workers]}
        if args.info_file:
            tmp = args.info_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(info, f)
            os.replace(tmp, args.info_file)
        print(f"serve_routed: {args.workers} workers ready in {time.time() - t0:.0f} s; policy {args.policy}", flush=True)
        print(f"serve_routed: router at {router_url} (OpenAI API: {router_url}/v1; metrics {info['router_metrics']})",
              flush=True)

        while True:
            time.sleep(1)
            if not router.alive():
                print(f"serve_routed: the router exited with {router.proc.returncode}; stopping "
                      f"(end of {router.log_path}:\n{_tail(router.log_path, 1500)})", flush=True)
                rc = 1
                break
            for i, w in enumerate(workers):
                if not w.alive() and not w.reported:
                    w.reported = True
                    print(f"serve_routed: worker {i} ({w.url}, pid {w.pid}) exited with {w.proc.returncode}; "
                          f"removing it from the router (log {w.log_path})", flush=True)
                    removed = remove_from_router(router_url, w.url)
                    print(f"serve_routed: worker {i} {'removed from' if removed else 'could not be removed from'} "
                          f"the router; {sum(x.alive() for x in workers)} of {len(workers)} workers serving",
                          flush=True)
            if not any(w.alive() for w in workers):
                print("serve_routed: no worker left; stopping", flush=True)
                rc = 1
                break
    except Stop:
        print(f"serve_routed: {signal.Signals(stopping['signal']).name}: stopping", flush=True)
    except RuntimeError as e:
        print(f"serve_routed: {e}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        # No more interruptions while stopping: each child is stopped (and waited for) once.
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        if router is not None:
            router.stop(signal.SIGTERM, timeout=15)
        for w in workers:  # SIGINT to each group first, then wait: they shut down side by side
            if w.alive():
                try:
                    os.killpg(w.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        for w in workers:
            w.stop(signal.SIGINT, timeout=60)
        print(f"serve_routed: stopped (logs in {log_dir})", flush=True)
    return rc


def remove_from_router(router_url: str, worker_url: str) -> bool:
    """Takes a worker out of sglang-router (DELETE /workers/{id}; the id from GET /workers)."""
    status, out = http("GET", router_url + "/workers")
    if status != 200 or not isinstance(out, dict):
        return False
    ids = [w["id"] for w in out.get("workers", []) if w.get("url") == worker_url]
    ok = bool(ids)
    for wid in ids:
        ok &= http("DELETE", f"{router_url}/workers/{wid}")[0] in (200, 202, 204)
    return ok


if __name__ == "__main__":
    sys.exit(main())
