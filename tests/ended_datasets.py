"""Iterable datasets whose worker 0 has a short share, for the tests of a worker that dies after
its share ended, and of one that exits then (tests/test_ended_worker_death.py, test_ended_worker_exit.py).

Module-level, so spawned workers could unpickle them; the tests use fork, where the events they
hold are inherited.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from fault_datasets import sample
from shmloader import IterableDataset, get_worker_info


class _ShortShare(IterableDataset):
    """Worker 0 yields samples 0, 2, ... (``short`` of them), then runs ``_at_end`` before its share
    ends; every other worker's share runs to ``n``."""

    def __init__(self, n: int, short: int) -> None:
        self.n, self.short = n, short

    def __iter__(self) -> Iterator[np.ndarray]:
        info = get_worker_info()
        assert info is not None, f"{type(self).__name__} runs in workers only"
        if info.id != 0:
            yield from (sample(i) for i in range(info.id, self.n, info.num_workers))
            return
        yield from (sample(i) for i in range(0, info.num_workers * self.short, info.num_workers))
        self._at_end()

    def _at_end(self) -> None:
        raise NotImplementedError


class GatedEnd(_ShortShare):
    """Worker 0, before its share ends, sets ``at_end`` and waits for ``gate``. The events are
    ``multiprocessing`` events of the fork context."""

    def __init__(self, n: int, short: int, at_end: Any, gate: Any) -> None:
        super().__init__(n, short)
        self.at_end, self.gate = at_end, gate

    def _at_end(self) -> None:
        gated_end(self.at_end, self.gate)


class HeldExit(_ShortShare):
    """Worker 0, as its share ends, starts a non-daemon thread that waits for ``gate`` (a
    semaphore: an ``Event``'s ``set()`` waits for each sleeper to wake, and a killed one never
    does): the worker's exit (multiprocessing joins such threads first) is held until the test
    opens the gate, so a signal sent meanwhile is a death after the worker's end was read, never
    one that comes too late."""

    def __init__(self, n: int, short: int, gate: Any) -> None:
        super().__init__(n, short)
        self.gate = gate

    def _at_end(self) -> None:
        threading.Thread(target=self.gate.acquire, kwargs={"timeout": 30}, daemon=False).start()


def torch_uneven(n: int, short: int, at_end: Callable[[], object] | None = None) -> Any:
    """``fault_datasets.UnevenStream`` for torch's loader (its IterableDataset, its worker info);
    ``at_end``: run by worker 0 before its share ends, as ``_ShortShare._at_end``. The test is
    skipped without torch. Defined here, so only fork can start its workers."""
    import pytest

    torch_data: Any = pytest.importorskip("torch.utils.data")

    class Uneven(torch_data.IterableDataset):
        def __iter__(self) -> Any:
            info = torch_data.get_worker_info()
            if info.id != 0:
                yield from (sample(i) for i in range(info.id, n, info.num_workers))
                return
            yield from (sample(i) for i in range(0, info.num_workers * short, info.num_workers))
            if at_end is not None:
                at_end()

    return Uneven()


def gated_end(at_end: Any, gate: Any) -> None:
    """``GatedEnd``'s end of worker 0's share, for ``torch_uneven``."""
    at_end.set()
    assert gate.wait(30), "the test never opened the gate"


def firsts(batch: Any) -> list[int]:
    """The sample numbers of a batch of ``sample(i)`` rows."""
    return [int(x) // 10 for x in np.asarray(batch)[:, 0]]


def epoch_at_end(it: Any, at_end: Callable[[Any], object]) -> tuple[list[int], int, int]:
    """Iterate one epoch of ``it`` (the workers' iterator); ``at_end(w0)`` is called once, with worker
    0's handle, after the first batch by which the main process has read the end of worker 0's share.
    The samples, worker 0's pid, and how many batches came after that call."""
    got: list[int] = []
    pid, after = 0, 0
    for batch in it:
        got += firsts(batch)
        w0 = it._pool.workers[0]
        if pid:
            after += 1
        elif w0.exhausted:
            pid = int(w0.pid)
            at_end(w0)
    assert pid, "worker 0's end was never read"
    return got, pid, after
