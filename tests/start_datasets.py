"""Datasets and init functions for the start-up failure and epoch-reset tests
(tests/test_start_failure_order.py, tests/test_reset_ack.py).

Module-level and importable, so spawned workers unpickle them by reference. A gate is a file:
the fetch that waits for it polls for it with a deadline, never sleeping as synchronisation.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from fault_datasets import FaultyDataset, in_worker, sample
from shmloader import IterableDataset, get_worker_info

GATE_DEADLINE_S = 20.0
POLL_S = 0.005


def wait_for(path: str, deadline_s: float = GATE_DEADLINE_S) -> bool:
    """Poll for ``path`` until it exists or ``deadline_s`` passes; True when it exists."""
    end = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            return False
        time.sleep(POLL_S)
    return True


class GatedFirst(FaultyDataset):
    """``n`` samples; in a worker, sample 0 is fetched only once the file ``gate`` exists."""

    def __init__(self, n: int, gate: str) -> None:
        super().__init__(n)
        self.gate = gate

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 0 and in_worker():
            wait_for(self.gate)
        return super().__getitem__(i)


class InitRaisesIn:
    """A ``worker_init_fn`` that raises ``ValueError`` in worker ``worker`` only."""

    def __init__(self, worker: int) -> None:
        self.worker = worker

    def __call__(self, worker_id: int) -> None:
        if worker_id == self.worker:
            raise ValueError(f"init of worker {worker_id} failed")


class DiesAtReset(IterableDataset):
    """``n`` samples sharded by worker. While the file ``arm`` exists, worker ``worker``'s
    ``__iter__`` (a plain method: it runs as the worker restarts its iterator for a new epoch) SIGKILLs
    its own process, once (it creates ``fired`` first): before it reads anything of that epoch."""

    def __init__(self, n: int, arm: str, fired: str, worker: int) -> None:
        self.n, self.arm, self.fired, self.worker = n, arm, fired, worker

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        if info is not None and info.id == self.worker and os.path.exists(self.arm):
            try:
                os.close(os.open(self.fired, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        return (sample(i) for i in range(first, self.n, step))


class InitCountedRaisesIn(InitRaisesIn):
    """``InitRaisesIn`` that first appends its worker id to the file ``calls``: how many times, and in
    which workers, ``worker_init_fn`` ran."""

    def __init__(self, worker: int, calls: str) -> None:
        super().__init__(worker)
        self.calls = calls

    def __call__(self, worker_id: int) -> None:
        with open(self.calls, "a") as f:
            f.write(f"{worker_id}\n")
        super().__call__(worker_id)


def init_calls(calls: str) -> list[int]:
    """The worker ids ``InitCountedRaisesIn`` wrote, sorted."""
    with open(calls) as f:
        return sorted(int(line) for line in f.read().split())


class ShardedRange(IterableDataset):
    """``range(n)``, sharded over the workers by worker id (the whole range without workers)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        return iter(range(first, self.n, step))
