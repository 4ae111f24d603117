"""Crash-isolated worker processes for long test harnesses (the OpInfo sweep, the model zoo).

A harness script doubles as its own worker (``script --worker-fd N``): the worker reads units
as JSON lines on stdin and writes JSON messages to fd N: {"type": "ready"} once, then per unit
any number of {"type": "progress"} / {"type": "partial", "result": ...} and one
{"type": "result", "result": ...}. A worker that dies or stays silent past the timeout costs
that unit only (status "crash", with the reason and the log line that explains it) and is
restarted for the next.
"""

from __future__ import annotations

import json
import os
import platform
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MSG_LIMIT = 400


def snapshot_package(dest_root: str) -> str:
    """Copies the torch_tpu package (Python files and the built extension) to dest_root
    and returns the directory to put first on the workers' sys.path."""
    import importlib.util

    spec = importlib.util.find_spec("torch_tpu")
    src = (os.path.dirname(spec.origin) if spec and spec.origin
           else os.path.join(REPO_ROOT, "torch_tpu"))
    dst = os.path.join(dest_root, "torch_tpu")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dest_root


def _so_digest(pkg_root: str) -> str:
    import glob
    import hashlib

    for path in glob.glob(os.path.join(pkg_root, "torch_tpu", "_C*.so")):
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    return ""


class Worker:
    def __init__(self, index, log_dir, pythonpath, script, startup_timeout=180):
        self.index = index
        self.script = script
        self.log_path = os.path.join(log_dir, f"worker{index}.log")
        self.pythonpath = pythonpath
        self.startup_timeout = startup_timeout
        self.proc = None
        self.units_done = 0

    def start(self):
        r, w = os.pipe()
        env = dict(os.environ)
        paths = [p for p in (self.pythonpath, env.get("PYTHONPATH")) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, self.script, "--worker-fd", str(w)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
            pass_fds=(w,), env=env, cwd=REPO_ROOT)
        os.close(w)
        self.rfd = r
        self.buf = b""
        self.units_done = 0
        msg = self._next(self.startup_timeout)
        if msg is None or msg.get("type") != "ready":
            tail = self.log_tail(0)
            self.kill()
            raise RuntimeError(f"worker {self.index} did not start: {msg}; log: {tail}")

    def _next(self, timeout):
        """The next message, or None (the worker died), or {"type": "timeout"}."""
        deadline = time.time() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.time()
            if left <= 0:
                return {"type": "timeout"}
            sel = selectors.DefaultSelector()
            sel.register(self.rfd, selectors.EVENT_READ)
            ready = sel.select(min(left, 5.0))
            sel.close()
            if ready:
                chunk = os.read(self.rfd, 1 << 16)
                if not chunk:
                    return None
                self.buf += chunk
            elif self.proc.poll() is not None:
                return None
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def log_size(self):
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def log_tail(self, offset, limit=20000):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(offset, os.path.getsize(self.log_path) - limit))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def run(self, unit, timeout):
        """Runs one unit; returns its result dict (a crash is a result too)."""
        offset = self.log_size()
        t0 = time.time()
        self.proc.stdin.write((json.dumps(unit) + "\n").encode())
        self.proc.stdin.flush()
        partial = None
        while True:
            msg = self._next(timeout)
            if msg is not None and msg["type"] == "progress":
                continue
            if msg is not None and msg["type"] == "partial":
                partial = msg["result"]
                continue
            if msg is not None and msg["type"] == "result":
                self.units_done += 1
                return msg["result"]
            # died or hung
            hung = msg is not None and msg["type"] == "timeout"
            if hung:
                try:
                    self.proc.send_signal(signal.SIGUSR1)  # faulthandler: Python stack to log
                    time.sleep(1.0)
                except OSError:
                    pass
            self.kill()
            why = (f"timeout: no progress for {timeout:g} s" if hung
                   else _exit_reason(self.proc.returncode))
            detail = _crash_detail(self.log_tail(offset))
            prefix = "grad_" if unit.get("kind") == "grad" else ""
            if partial is not None:  # the primary run finished; the strict rerun crashed
                partial["strict"] = f"crash ({why})"
                return partial
            return {"status": prefix + "crash",
                    "message": f"{why}" + (f"; {detail}" if detail else ""),
                    "samples": {}, "seconds": round(time.time() - t0, 3)}

    def stop(self):
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self.kill()
        self._close()

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self):
        try:
            os.close(self.rfd)
        except OSError:
            pass
        try:
            self.log.close()
        except Exception:  # noqa: BLE001
            pass


def _exit_reason(rc):
    if rc is None:
        return "worker died"
    if rc < 0:
        try:
            return f"worker killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"worker killed by signal {-rc}"
    return f"worker exited with status {rc}"


def _crash_detail(log: str) -> str:
    keys = ("Check failed", "terminate called", "what():", "Fatal Python error", "F0000",
            "Aborted", "RuntimeError", "error:", "Error")
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for key in keys:
        for ln in lines:
            if key in ln:
                return ln[:MSG_LIMIT]
    return ""


def _load_partial(path):
    done = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                done[rec["key"]] = rec
    return done


def run_units(units, script, key_of, record_of, extra_files=(), workers=1, timeout=60.0,
              recycle=150, log_dir=None, partial_path=None, snapshot=True, progress=None):
    """Runs units (JSON-able dicts) in worker subprocesses of ``script`` (started as
    ``script --worker-fd N``) and returns ({key_of(unit): record}, digest of the extension).
    ``record_of(unit, result)`` makes the record kept for a unit; a record needs "key" and
    "status". With ``snapshot``, the workers import a copy of torch_tpu and of ``script`` (and
    ``extra_files``) taken now, so that a rebuild during a long run does not mix two builds.
    ``partial_path`` (JSON lines) lets an interrupted run resume."""
    import threading

    own_tmp = tempfile.mkdtemp(prefix="torch_tpu_workers_")
    own_logs = log_dir is None
    log_dir = log_dir or own_tmp
    os.makedirs(log_dir, exist_ok=True)
    pythonpath = snapshot_package(own_tmp) if snapshot else REPO_ROOT
    if snapshot:  # workers restarted later run this version of the harness too
        for path in (*extra_files, __file__):
            shutil.copy(os.path.abspath(path), own_tmp)
        original = script
        script = os.path.join(own_tmp, os.path.basename(script))
        shutil.copy(os.path.abspath(original), script)
    results = _load_partial(partial_path) if partial_path else {}
    todo = [u for u in units if key_of(u) not in results]
    total = len(results) + len(todo)
    lock = threading.Lock()
    partial_file = open(partial_path, "a") if partial_path else None
    errors = []

    def loop(index):
        w = Worker(index, log_dir, pythonpath, script)
        try:
            while True:
                with lock:
                    if not todo:
                        break
                    unit = todo.pop(0)
                if w.proc is None or w.proc.poll() is not None or w.units_done >= recycle:
                    if w.proc is not None:
                        w.stop()
                    w.start()
                res = w.run(unit, timeout)
                rec = record_of(unit, res)
                with lock:
                    results[rec["key"]] = rec
                    if partial_file:
                        partial_file.write(json.dumps(rec) + "\n")
                        partial_file.flush()
                    if progress:
                        progress(rec, len(results), total)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            w.stop() if w.proc is not None else None

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if partial_file:
        partial_file.close()
    digest = _so_digest(pythonpath)
    if snapshot:
        shutil.rmtree(os.path.join(own_tmp, "torch_tpu"), ignore_errors=True)
        for name in os.listdir(own_tmp):
            if name.endswith(".py"):
                os.remove(os.path.join(own_tmp, name))
    if own_logs and not any(r["status"].endswith("crash") for r in results.values()):
        shutil.rmtree(own_tmp, ignore_errors=True)  # worker logs matter after a crash only
    if errors:
        raise errors[0]
    return results, digest


def _git(*args):
    try:
        return subprocess.check_output(["git", *args], cwd=REPO_ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return ""


def read_list(path):
    """The non-empty lines of a list file, without "#" comments."""
    names = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                names.append(line)
    return names


def machine_info():
    import torch

    from torch_tpu import _env
    from torch_tpu._sysinfo import cpu_model

    cpu = cpu_model()

    return {"host": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "plugin": _env.get("TORCH_TPU_PLUGIN", "default")}
