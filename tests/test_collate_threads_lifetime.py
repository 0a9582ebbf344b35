"""The collate helpers' lifetime: they belong to a ``num_workers=0`` iterator, not to the process.

They used to be made on the first large stack and live as long as the process: a later loader
forked its workers with them alive (Python 3.12+ warns "This process is multi-threaded, use of
fork() may lead to deadlocks in the child"), where a helper in the middle of a copy may hold a lock
the child then never sees released. Now an epoch's end, ``close()`` or the iterator's collection
ends them, and no worker of ours is forked while one of them lives."""

from __future__ import annotations

import os

import threading
import warnings
from typing import Any

import numpy as np
import pytest
from process_helpers import until

import shmloader
from shmloader.collate import helpers, threads
from shmloader.collate.threads import ThreadedStack

SHAPE = (32, 32)  # float32: 4 KiB a sample; the split threshold is lowered to one sample's bytes
BATCH = 4


class Squares:
    """``length`` float32 samples of ``SHAPE``, each filled with its index."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return np.full(SHAPE, index, np.float32)


@pytest.fixture
def split_small(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Split every stack of more than one sample; records the thread of each chunk stacked."""
    monkeypatch.setattr(threads, "SPLIT_MIN_BYTES", 4 * SHAPE[0] * SHAPE[1])
    seen: list[str] = []
    stack_into = threads.stack_into

    def recording(batch: Any, out: np.ndarray) -> np.ndarray:
        seen.append(threading.current_thread().name)
        return stack_into(batch, out)

    monkeypatch.setattr(threads, "stack_into", recording)
    return seen


def helpers_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shmloader-")]


def _loader(length: int = 3 * BATCH, **kwargs: Any) -> shmloader.DataLoader[Any]:
    return shmloader.DataLoader(Squares(length), batch_size=BATCH, collate_threads=2, **kwargs)


def _first_column(batches: list[Any]) -> list[float]:
    return [float(v) for batch in batches for v in np.asarray(batch)[:, 0, 0]]


@pytest.mark.timeout(60)
def test_no_helper_outlives_a_num_workers_0_epoch(split_small: list[str]) -> None:
    it = iter(_loader())
    first = next(it)
    assert "shmloader-collate-1" in helpers_alive()  # a helper serves the epoch
    batches = [first, *it]
    assert _first_column(batches) == [float(i) for i in range(3 * BATCH)]
    assert helpers_alive() == []  # joined as the epoch ended
    assert split_small.count("MainThread") + split_small.count("shmloader-collate-1") == 2 * 3


@pytest.mark.timeout(60)
def test_close_joins_the_helpers_and_a_dropped_iterator_ends_them(split_small: list[str]) -> None:
    it = iter(_loader())
    next(it)
    it.close()  # type: ignore[attr-defined]
    assert helpers_alive() == []
    it = iter(_loader())
    next(it)
    assert helpers_alive()
    del it  # abandoned mid-epoch: its helpers are told to exit
    assert until(lambda: helpers_alive() == [], 10), helpers_alive()


@pytest.mark.timeout(60)
def test_helpers_of_dropped_stacks_are_not_remembered_once_they_have_exited() -> None:
    batch = [np.full(SHAPE, i, np.float32) for i in range(4)]
    for _ in range(20):  # a process that never forks a worker: nothing joins these
        ThreadedStack(2, 0)(batch, np.empty((4, *SHAPE), np.float32))  # dropped unclosed
    assert until(lambda: helpers_alive() == [], 10), helpers_alive()
    stack = ThreadedStack(2, 0)
    stack(batch, np.empty((4, *SHAPE), np.float32))
    del stack
    assert len(helpers._exiting) <= 1  # only the one just told to exit


@pytest.mark.timeout(60)
def test_helpers_start_again_each_epoch_and_after_a_close_of_their_pool(split_small: list[str]) -> None:
    loader = _loader()
    for _ in range(2):  # each epoch starts a helper and ends it
        it = iter(loader)
        batches = [next(it)]
        assert helpers_alive() == ["shmloader-collate-1"]
        batches += it
        assert _first_column(batches) == [float(i) for i in range(3 * BATCH)] and helpers_alive() == []
    stack = ThreadedStack(3)
    batch = [np.full(SHAPE, i, np.float32) for i in range(6)]
    for _ in range(2):  # closed between the two: the second stack starts its helpers again
        out = stack(batch, np.empty((6, *SHAPE), np.float32))
        assert _first_column([out]) == [float(i) for i in range(6)]
        assert sorted(helpers_alive()) == ["shmloader-collate-1", "shmloader-collate-2"]
        stack.close()
        assert helpers_alive() == []


@pytest.mark.timeout(90)
def test_workers_are_forked_with_no_helper_alive(split_small: list[str]) -> None:
    # threads not ours (torch's intra-op pool, once an earlier test ran torch) make Python 3.12+ warn
    # at any fork: the warning tells about our helpers only in a process that had no other thread
    alone = len(os.listdir("/proc/self/task")) == 1
    for _ in _loader():  # one whole epoch
        pass
    held = iter(_loader())  # and one held mid-epoch, its helpers idle
    try:
        next(held)
        assert helpers_alive()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            it = iter(_loader(num_workers=2, multiprocessing_context="fork"))
            try:
                alive_after_the_forks = helpers_alive()
                batches = list(it)
            finally:
                it.close()  # type: ignore[attr-defined]
        assert alive_after_the_forks == []  # joined before the first worker was forked
        assert _first_column(batches) == [float(i) for i in range(3 * BATCH)]
        forked_threaded = [str(w.message) for w in caught if "multi-threaded" in str(w.message)]
        assert forked_threaded == [] or not alone  # Python 3.12+: no "use of fork() may lead to deadlocks"
        assert _first_column([next(held)]) == [float(i) for i in range(BATCH, 2 * BATCH)]  # starts them again
    finally:
        held.close()  # type: ignore[attr-defined]
    assert helpers_alive() == []
