"""An iterable dataset's epoch is resumed mid-way only where its fast-forward is exact.

An iterable dataset is resumed by making its first ``yielded`` batches again and dropping them
(docs/resume.md). That replays the same batches only with the worker count that saved the state
(each worker iterates its own shard) and with ``in_order=True`` (an ``in_order=False`` epoch of two
workers or more handed batches out in an arrival order no rerun repeats). Loaded otherwise, batches
were lost and others repeated without a word; now ``load_state_dict`` refuses, naming both sides.
With one worker or none an ``in_order=False`` epoch hands batches out in task order, and its state
loads, unless a later batch came first while an earlier one's slot grew. Between epochs (no batch
handed out yet) nothing is replayed, so any worker count and order loads. A state of an
``in_order=True`` epoch loads into an ``in_order=False`` loader: the replay is dealt and dropped in
order, then the epoch goes on in arrival order.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.errors import StateError


class Shards(shmloader.IterableDataset):
    """Rows 0..11, each worker taking every num_workers-th one."""

    def __iter__(self) -> Iterator[np.ndarray]:
        info = shmloader.get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        return iter([np.array([i]) for i in range(first, 12, step)])


def _loader(num_workers: int, in_order: bool = True) -> shmloader.DataLoader:
    return shmloader.DataLoader(Shards(), batch_size=2, num_workers=num_workers, in_order=in_order)


def _mid_epoch_state(num_workers: int, in_order: bool = True) -> dict:
    loader = _loader(num_workers, in_order)
    it = iter(loader)
    next(it), next(it)
    state = it.state_dict()
    loader.close()
    return state


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("saved", "loaded"), [(2, 1), (1, 2), (2, 0), (0, 2)])
def test_a_mid_epoch_state_loads_only_with_the_worker_count_that_saved_it(saved: int, loaded: int) -> None:
    state = _mid_epoch_state(saved)
    loader = _loader(loaded)
    with pytest.raises(StateError, match=rf"num_workers: saved {saved}, this loader {loaded}"):
        loader.load_state_dict(state)
    loader.close()


@pytest.mark.timeout(60)
def test_a_mid_epoch_state_of_an_unordered_epoch_is_refused() -> None:
    state = _mid_epoch_state(2, in_order=False)
    for in_order in (False, True):
        loader = _loader(2, in_order)
        with pytest.raises(StateError, match="in_order=False"):
            loader.load_state_dict(state)
        loader.close()


@pytest.mark.timeout(60)
def test_the_same_worker_count_resumes_exactly() -> None:
    whole = [int(b[0, 0]) for b in _loader(2)]
    state = _mid_epoch_state(2)
    loader = _loader(2)
    loader.load_state_dict(state)
    rest = [int(b[0, 0]) for b in loader]
    assert whole[:2] + rest == whole


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, False])
def test_a_state_between_epochs_loads_with_any_worker_count(in_order: bool) -> None:
    saver = _loader(2, in_order)
    assert len(list(saver)) == 6
    state = saver.state_dict()
    loader = _loader(1)
    loader.load_state_dict(state)
    assert sorted(int(b[0, 0]) for b in loader) == [0, 2, 4, 6, 8, 10]


FORK = multiprocessing.get_context("fork")
GATE_WAIT_S = 60.0


class LateFirstWorker(shmloader.IterableDataset):
    """``Shards`` over two workers, where worker 0 begins only once worker 1 is inside its second
    batch (a semaphore: releasing it never blocks), so worker 1's first batch arrives first."""

    def __init__(self) -> None:
        self.gate = FORK.Semaphore(0)

    def __iter__(self) -> Iterator[np.ndarray]:
        info = shmloader.get_worker_info()
        assert info is not None and info.num_workers == 2
        if info.id == 0 and not self.gate.acquire(timeout=GATE_WAIT_S):
            raise TimeoutError("worker 1 never let worker 0 begin")
        for i in range(info.id, 12, 2):
            if i == 5:
                self.gate.release()
            yield np.array([i])


def _late_first_loader(in_order: bool) -> shmloader.DataLoader[Any]:
    return shmloader.DataLoader(LateFirstWorker(), batch_size=2, num_workers=2, in_order=in_order,
                                multiprocessing_context="fork")


@pytest.mark.timeout(120)
def test_a_mid_epoch_state_resumes_exactly_in_an_unordered_loader() -> None:
    """A state saved one batch into an ``in_order=True`` epoch (batch [0, 2], worker 0's first),
    loaded into an ``in_order=False`` loader. The fast-forward made the first batches again and
    dropped the first ``yielded`` to arrive: worker 1's [1, 3] here, so [1, 3] was lost and
    [0, 2] handed out twice. Now the fast-forward deals and drops them in order (the saved epoch's
    first batches), and the rest of the epoch comes in arrival order."""
    saver = _late_first_loader(in_order=True)
    it = iter(saver)
    first = next(it).ravel().tolist()
    state = it.state_dict()
    saver.close()
    assert first == [0, 2]
    loader = _late_first_loader(in_order=False)
    loader.load_state_dict(state)
    rest = sorted(b.ravel().tolist() for b in loader)
    loader.close()
    assert rest == [[1, 3], [4, 6], [5, 7], [8, 10], [9, 11]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("loaded_in_order", [False, True])
def test_an_unordered_epoch_of_one_worker_or_none_resumes_exactly(num_workers: int, loaded_in_order: bool) -> None:
    """With one worker (or none) batches arrive in task order, in_order=False or not: the replay is
    the batches handed out before the save. Such a state used to be refused as any unordered one."""
    whole = [int(b[0, 0]) for b in _loader(num_workers, in_order=False)]
    assert whole == [0, 2, 4, 6, 8, 10]
    state = _mid_epoch_state(num_workers, in_order=False)
    assert state["delivered"] == [[0, 2]] and state["yielded"] == 2
    loader = _loader(num_workers, loaded_in_order)
    loader.load_state_dict(state)
    assert [int(b[0, 0]) for b in loader] == whole[2:]  # the uninterrupted run's rest, exactly
    assert [int(b[0, 0]) for b in loader] == whole  # and the next epoch whole


class BigFirst(shmloader.IterableDataset):
    """Rows 0..5 one by one (``batch_size=None``); row 0 is 64 KiB, too large for a 4 KiB slot."""

    def __iter__(self) -> Iterator[np.ndarray]:
        yield np.zeros(1 << 13, dtype=np.int64)
        yield from (np.array([i]) for i in range(1, 6))


def _big_first_loader() -> shmloader.DataLoader[Any]:
    return shmloader.DataLoader(BigFirst(), batch_size=None, num_workers=1, in_order=False, slot_bytes=4096)


@pytest.mark.timeout(60)
def test_an_unordered_state_whose_later_batch_came_first_is_refused_naming_the_tasks() -> None:
    """One worker, in_order=False: task 0's slot grows while the worker answers task 1, which is
    handed out first. A state saved then delivered task 1 and not task 0; the replay, one batch in
    task order, would drop task 0 and hand task 1 out again."""
    saver = _big_first_loader()
    it = iter(saver)
    assert int(next(it)[0]) == 1  # task 1 first: task 0 waits for its slot to grow
    state = it.state_dict()
    assert state["delivered"] == [[1, 2]]
    saver.close()
    loader = _big_first_loader()
    with pytest.raises(StateError, match=r"not in task order.*delivered: \[\[1, 2\]\].*task 0"):
        loader.load_state_dict(state)
    loader.close()
