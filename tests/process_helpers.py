"""Which child processes of the test process are ours: multiprocessing's shared helpers (the
resource tracker, the fork server, which other tests start and which live for the session) are
not; the suite's leak guard (conftest.py) and the tests that count workers agree on this."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil

SHARED_HELPERS = ("resource_tracker", "forkserver", "semaphore_tracker")


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
