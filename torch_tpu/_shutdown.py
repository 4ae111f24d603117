"""Keeps a backward that ran on tpu from aborting the process at exit.

PyTorch's autograd engine runs a tpu backward on its device thread
(``pt_autograd_<i>``). That thread may drop the last reference to the
finished backward's GraphTask after ``backward()`` has returned on the main
thread. The GraphTask holds the Python context that ``backward()`` stashed in
thread-local state, so its destructor takes the GIL; if the interpreter is
finalizing by then, CPython ends the thread with ``pthread_exit``, whose
unwinding crosses a noexcept destructor and calls ``std::terminate``
("terminate called without an active exception", exit status 134). A
machine under load widens the window (measured: 6 aborts in 40 runs of a
one-backward script beside two busy processes).

The hook below runs before finalization. It sends one backward through each
device thread: the thread releases the previous GraphTask before it takes the
new one. The new one must be safe to release at any time, so it is built in
C++ (``_C._drain_autograd_device``): it stashes no Python context, and its
tensors have no Python objects (a tensor whose Python object died while the
GraphTask still held it keeps that object alive, and its last release would
take the GIL). The backward is a view of an empty tensor, so it launches no
program.
"""

from __future__ import annotations

import atexit
import os

from . import _C

_installed = False


def _autograd_device_threads_started() -> bool:
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # no procfs: assume they may have started
        return True
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("pt_autograd_"):
                    return True
        except OSError:  # the thread ended while we looked
            continue
    return False


def drain_autograd_device_threads() -> None:
    """Waits until every tpu autograd thread has released its last GraphTask."""
    if not _autograd_device_threads_started():
        return
    for i in range(_C._device_count()):
        _C._drain_autograd_device(i)


def _at_exit() -> None:
    try:
        drain_autograd_device_threads()
    except Exception:  # a failing device must not turn a clean exit into a traceback
        pass


def install() -> None:
    global _installed
    if not _installed:
        atexit.register(_at_exit)
        _installed = True
