"""Iterable datasets whose worker 0 has a short share, for the tests of a worker that dies after
its share ended (tests/test_ended_worker_death.py).

Module-level, so spawned workers could unpickle them; the tests use fork, where the events they
hold are inherited.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from fault_datasets import sample
from shmloader import IterableDataset, get_worker_info


class GatedEnd(IterableDataset):
    """Worker 0 yields samples 0, 2, ... (``short`` of them), then, before its share ends, sets
    ``at_end`` and waits for ``gate``; every other worker's share runs to ``n``. The events are
    ``multiprocessing`` events of the fork context."""

    def __init__(self, n: int, short: int, at_end: Any, gate: Any) -> None:
        self.n, self.short, self.at_end, self.gate = n, short, at_end, gate

    def __iter__(self) -> Iterator[np.ndarray]:
        info = get_worker_info()
        assert info is not None, "GatedEnd runs in workers only"
        if info.id != 0:
            yield from (sample(i) for i in range(info.id, self.n, info.num_workers))
            return
        yield from (sample(i) for i in range(0, info.num_workers * self.short, info.num_workers))
        self.at_end.set()
        assert self.gate.wait(30), "the test never opened the gate"
