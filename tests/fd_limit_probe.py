"""Run as a script: ``iter(loader)`` with 0 to N descriptors left below a lowered RLIMIT_NOFILE.

For each count of free descriptors, a fresh loader (``num_workers=2``, the start method of argv[1])
reads one epoch while the rest of the process's descriptors are taken; prints one JSON list of
``[free, outcome]``: ``["ok", batches_right]`` or ``[type name, errno, message]``, then whether
child processes or segments of this process are left. Used by tests/test_iter_fd_limit.py.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
from typing import Any

import numpy as np
from process_helpers import workers_left

from shmloader import DataLoader

LIMIT = 128


def take_all_but(free: int) -> list[int]:
    """Open /dev/null until the limit refuses, then close ``free`` of them again."""
    held: list[int] = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for _ in range(min(free, len(held))):
        os.close(held.pop())
    return held


def one(free: int, method: str) -> list[Any]:
    loader: DataLoader[Any] = DataLoader([np.full(4, i) for i in range(8)], batch_size=2, num_workers=2,
                                         multiprocessing_context=method)
    held = take_all_but(free)
    try:
        got = [b[:, 0].tolist() for b in loader]
        return ["ok", got == [[0, 1], [2, 3], [4, 5], [6, 7]]]
    except Exception as exc:
        return [type(exc).__name__, getattr(exc, "errno", None), str(exc)]
    finally:
        for fd in held:
            os.close(fd)
        loader.close()


_MADE: list[str] = []  # the named semaphores this process made (multiprocessing's SemLock)


def _record_semaphores() -> None:
    """Note every named semaphore multiprocessing makes here (a stop flag under spawn, say), so
    that only this run's are looked for at the end: another job's on the machine are not ours."""
    from multiprocessing import synchronize

    made = synchronize.SemLock.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            made(self, *args, **kwargs)
        finally:  # made, then refused by a resource tracker that cannot start: the leak to find
            name = getattr(getattr(self, "_semlock", None), "name", None)
            if name is not None:  # None: unlinked at once (fork), or never made
                _MADE.append(name)

    synchronize.SemLock.__init__ = init  # type: ignore[method-assign]


def _semaphores() -> list[str]:
    """This run's semaphores whose names are still in /dev/shm."""
    return [n for n in _MADE if os.path.exists("/dev/shm/sem." + n.lstrip("/"))]


def main() -> None:
    method, most = sys.argv[1], int(sys.argv[2])
    _record_semaphores()
    gc.disable()  # what only the collector would free counts as left: a cycle that holds a failed start
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    outcomes = [[free, one(free, method)] for free in range(most + 1)]
    prefix = f"shml_{os.getpid()}_"
    left = {"children": len(workers_left(zombies=True)),  # multiprocessing's shared helpers aside
            "segments": [n for n in os.listdir("/dev/shm") if n.startswith(prefix)],
            # multiprocessing's named semaphores (the workers' stop flags under spawn) this run left
            "semaphores": _semaphores()}
    print(json.dumps({"outcomes": outcomes, "left": left}))


if __name__ == "__main__":
    main()
