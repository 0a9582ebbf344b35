"""Which child processes of the test process are ours: multiprocessing's shared helpers (the
resource tracker, the fork server, which other tests start and which live for the session) are
not; the suite's leak guard (conftest.py) and the tests that count workers agree on this."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

# the modules the helpers run (``python -B -c "from multiprocessing.forkserver import main; ..."``):
# a bare "forkserver" also matched a fork child whose command line names tests/test_forkserver_faults.py
SHARED_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "multiprocessing.semaphore_tracker")


def shared_helper(p: psutil.Process, cmdline: str, parent: int | None = None) -> bool:
    """Whether ``p`` (command line ``cmdline``) is one of multiprocessing's shared helpers: a direct
    child of ``parent`` (default: this process) running one. A forkserver worker keeps the fork
    server's command line but is the fork server's child: a worker, counted."""
    return any(h in cmdline for h in SHARED_HELPERS) and p.ppid() == (os.getpid() if parent is None else parent)


def workers_left(zombies: bool = False) -> list[int]:
    """The pids of our child processes, the shared helpers aside: the live ones, and with
    ``zombies=True`` also those that exited and were never reaped (a close() that does not reap)."""
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                if zombies:
                    left.append(p.pid)
            elif not shared_helper(p, " ".join(p.cmdline())):
                left.append(p.pid)
        except psutil.ZombieProcess:
            if zombies:
                left.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return left


def until(condition: Callable[[], object], deadline_s: float) -> bool:
    """Poll ``condition`` (another process must act) until it holds or ``deadline_s`` passes."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def within(call: Callable[[], Any], seconds: float) -> Any:
    """``call()`` in a daemon thread: its result, its error raised here, or a test failure if it has
    not returned in ``seconds`` (a hung call stays blocked in its daemon thread instead of hanging
    the session)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{getattr(call, '__name__', call)} did not return within {seconds:g} s")
    error = out.pop("error", None)
    if error is not None:
        try:
            raise error
        finally:
            del error  # else this frame, in the error's traceback, holds it: a cycle only the collector frees
    return out.get("value")


def child_exit_code(pid: int, deadline_s: float) -> int | None:
    """The exit code of ``pid``, a child of this process that another fork made (not a
    ``multiprocessing`` one), once it exits within ``deadline_s``; None, and the child killed and
    reaped, if it has not (it hangs)."""
    fd = os.pidfd_open(pid)
    try:
        ended, _, _ = select.select([fd], [], [], deadline_s)
    finally:
        os.close(fd)
    if not ended:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if ended else None
