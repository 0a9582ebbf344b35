"""Run as a script: ``iter(loader)`` with 0 to N descriptors left below a lowered RLIMIT_NOFILE.

For each count of free descriptors, a fresh loader (``num_workers=2``, the start method of argv[1])
reads one epoch while the rest of the process's descriptors are taken; prints one JSON list of
``[free, outcome]``: ``["ok", batches_right]`` or ``[type name, errno, message]``, then whether
child processes or segments of this process are left. Used by tests/test_iter_fd_limit.py.
"""

from __future__ import annotations

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


def _semaphores() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")]


def main() -> None:
    method, most = sys.argv[1], int(sys.argv[2])
    semaphores = set(_semaphores())
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    outcomes = [[free, one(free, method)] for free in range(most + 1)]
    prefix = f"shml_{os.getpid()}_"
    left = {"children": len(workers_left(zombies=True)),  # multiprocessing's shared helpers aside
            "segments": [n for n in os.listdir("/dev/shm") if n.startswith(prefix)],
            # multiprocessing's named semaphores (the workers' stop flags under spawn) this run left
            "semaphores": sorted(set(_semaphores()) - semaphores)}
    print(json.dumps({"outcomes": outcomes, "left": left}))


if __name__ == "__main__":
    main()
