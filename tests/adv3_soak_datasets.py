"""Datasets of tests/test_adv3_soak_*.py: iterable workers that hang, once, before they read their
stream. Importable by reference from spawned workers (tests/ is on their ``sys.path``).

Each hang is a wait on nothing (only the loader's kill ends it) that fires once across every
process: the first caller makes the marker file ``fired`` (``O_CREAT | O_EXCL``), so the successor
of a killed worker goes on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import fault_datasets
import numpy as np

from shmloader import IterableDataset, get_worker_info


def first_time(fired: str) -> bool:
    """True the first time any process asks about the file ``fired`` (fault_datasets.first_time)."""
    return fault_datasets.first_time(os.path.dirname(fired), os.path.basename(fired))


def hang() -> None:
    threading.Event().wait()


class Stream(IterableDataset):
    """``n`` samples ``[i]`` sharded by worker (``i = id, id + k, ...``); while the file ``arm`` exists,
    worker ``worker``'s ``__iter__`` (a plain method, run as the worker restarts its iterator for an
    epoch, before it acknowledges the epoch's reset) hangs, once."""

    def __init__(self, n: int, arm: str = "", fired: str = "", worker: int = -1) -> None:
        self.n, self.arm, self.fired, self.worker = n, arm, fired, worker

    def __iter__(self) -> Iterator[np.ndarray]:
        info = get_worker_info()
        if info is not None and info.id == self.worker and os.path.exists(self.arm) and first_time(self.fired):
            hang()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        return (np.array([i]) for i in range(first, self.n, step))


class HangsInInit:
    """A ``worker_init_fn``: worker ``worker`` hangs, once, while it starts."""

    def __init__(self, fired: str, worker: int) -> None:
        self.fired, self.worker = fired, worker

    def __call__(self, worker_id: int) -> None:
        if worker_id == self.worker and first_time(self.fired):
            hang()
