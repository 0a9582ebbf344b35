"""Which child processes of the test process are ours: multiprocessing's shared helpers (the
resource tracker, the fork server, which other tests start and which live for the session) are
not; the suite's leak guard (conftest.py) and the tests that count workers agree on this."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil

SHARED_HELPERS = ("resource_tracker", "forkserver", "semaphore_tracker")


def workers_left(zombies: bool = False) -> list[int]:
    """The pids of our child processes, the shared helpers aside: the live ones, and with
    ``zombies=True`` also those that exited and were never reaped (a close() that does not reap)."""
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                if zombies:
                    left.append(p.pid)
            elif not any(h in " ".join(p.cmdline()) for h in SHARED_HELPERS):
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
