"""Which child processes of the test process are ours: multiprocessing's shared helpers (the
resource tracker, the fork server, which other tests start and which live for the session) are
not; the suite's leak guard (conftest.py) and the tests that count workers agree on this."""

from __future__ import annotations

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
