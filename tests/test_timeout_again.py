"""After ``timeout=`` fires: iterating the loader again gives a whole, correct, in-order epoch.

torch's meaning of ``timeout=``: seconds without a batch, then an error; no worker is killed for
it. With ``persistent_workers=True`` the workers are the loader's, and a timeout keeps them: the
slow worker finishes its sample, ``next()`` on the same iterator goes on with the epoch (as
torch's does), and ``iter(loader)`` starts the next epoch on the same workers, the timed-out
epoch's batches dropped as they come. Before, the timeout shut the workers down and the next
epoch started new ones: a dataset slow once per worker process (a cache each worker warms, a file
each opens) was slow again in each new worker, and every later epoch timed out too. Without
persistent workers a timeout shuts the iterator's workers down, and the next ``iter()`` starts
over. The slow sample is a gate the test opens (timeout_datasets.py); nothing sleeps to wait.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import timeout_datasets as td
from process_helpers import until, workers_left

from shmloader import DataLoader, LoaderError, WorkerTimeout
from shmloader.errors import LoaderClosed

TIMEOUT_S = 1.0
MAP_ORDER = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def _loader(dataset: Any, persistent: bool, ctx: str = "fork", **kw: Any) -> DataLoader:
    return DataLoader(dataset, batch_size=2, num_workers=2, timeout=TIMEOUT_S, persistent_workers=persistent,
                      multiprocessing_context=ctx, **kw)


def _epoch(batches: Any) -> tuple[list[list[int]], set[int]]:
    """The sample indices of each batch, and the pids of the workers that made them."""
    got, pids = [], set()
    for indices, pid in batches:
        got.append(indices.tolist())
        pids.update(pid.tolist())
    return got, pids


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _until_timeout(it: Any, before: int) -> tuple[list[list[int]], set[int]]:
    """Take ``before`` batches, then the next ``next()`` times out (the gate is shut)."""
    got = _epoch(next(it) for _ in range(before))
    with pytest.raises(WorkerTimeout, match=rf"^DataLoader timed out after {TIMEOUT_S} seconds"):
        next(it)
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("before", [0, 2], ids=["first-batch", "mid-epoch"])
def test_persistent_workers_survive_a_timeout_and_the_next_epoch_is_whole(tmp_path, before):
    gate = td.Gate(str(tmp_path), once=False)  # each worker process is slow the first time it gets there
    loader = _loader(td.SlowAt(gate, at=5 if before else 1), persistent=True)
    with loader:
        it = iter(loader)
        first, pids = _until_timeout(it, before)
        assert first == MAP_ORDER[:before]
        slow = td.release(str(tmp_path))
        assert len(slow) == 1 and workers_left() != []  # the workers are kept, the slow one too
        again, again_pids = _epoch(iter(loader))
        assert again == MAP_ORDER
        assert set(slow) <= again_pids and pids <= again_pids and len(again_pids) == 2  # the same two workers
        assert _epoch(iter(loader))[0] == MAP_ORDER
    assert workers_left() == []


@pytest.mark.timeout(60)
def test_next_on_a_persistent_iterator_after_a_timeout_goes_on_with_the_epoch(tmp_path):
    gate = td.Gate(str(tmp_path), once=False)
    with _loader(td.SlowAt(gate), persistent=True) as loader:
        it = iter(loader)
        first, _ = _until_timeout(it, 2)
        td.release(str(tmp_path))
        rest, _ = _epoch(it)  # as torch's iterator does: the timed-out batch is waited for again
        assert first + rest == MAP_ORDER
        assert _epoch(iter(loader))[0] == MAP_ORDER


@pytest.mark.timeout(60)
def test_a_persistent_iterable_dataset_after_a_timeout_starts_its_stream_afresh(tmp_path):
    gate = td.Gate(str(tmp_path), once=False)
    order = td.stream_order(12, 2, 2)
    with _loader(td.SlowStream(gate), persistent=True) as loader:
        it = iter(loader)
        first, pids = _until_timeout(it, 3)  # sample 5 is worker 1's second batch: the fourth
        assert first == order[:3]
        td.release(str(tmp_path))
        again, again_pids = _epoch(iter(loader))
        assert again == order and again_pids == pids
        assert _epoch(iter(loader))[0] == order


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_batches_held_across_a_timeout_keep_their_values(tmp_path, persistent):
    gate = td.Gate(str(tmp_path), once=True)
    with _loader(td.SlowAt(gate), persistent=persistent) as loader:
        it = iter(loader)
        held = [next(it), next(it)]
        with pytest.raises(WorkerTimeout):
            next(it)
        td.release(str(tmp_path))
        for _ in range(2):
            assert _epoch(iter(loader))[0] == MAP_ORDER  # their slots are not reused while held
        assert _epoch(held)[0] == MAP_ORDER[:2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_without_persistent_workers_a_timeout_shuts_down_and_iter_starts_over(tmp_path, iterable):
    gate = td.Gate(str(tmp_path), once=True)  # slow once: new workers are not
    dataset = td.SlowStream(gate) if iterable else td.SlowAt(gate)
    order = td.stream_order(12, 2, 2) if iterable else MAP_ORDER
    with _loader(dataset, persistent=False) as loader:
        fds = td.warm_descriptors()
        it = iter(loader)
        _until_timeout(it, 3 if iterable else 2)
        assert until(lambda: workers_left() == [], 10) and _fds() <= fds
        with pytest.raises(LoaderError, match=r"stopped at an earlier error \(WorkerTimeout") as info:
            next(it)
        assert not isinstance(info.value, LoaderClosed)
        assert _epoch(iter(loader))[0] == order
        assert _epoch(iter(loader))[0] == order


@pytest.mark.timeout(60)
def test_close_after_a_persistent_timeout_stops_the_slow_worker_and_leaves_nothing(tmp_path):
    gate = td.Gate(str(tmp_path), once=False)
    loader = _loader(td.SlowAt(gate), persistent=True)
    fds = td.warm_descriptors()
    _until_timeout(iter(loader), 2)
    loader.close()  # the gate stays shut: the worker is stopped where it blocks (after torch's 5 s grace)
    assert workers_left() == [] and _fds() == fds
    with pytest.raises(WorkerTimeout):  # and a new iter() starts new workers, which block there too
        _epoch(iter(loader))
    td.release(str(tmp_path))
    loader.close()
    assert workers_left() == [] and _fds() == fds


@pytest.mark.timeout(60)
def test_a_timeout_behind_an_abandoned_epoch_names_the_tasks_the_worker_still_runs(tmp_path):
    gate = td.Gate(str(tmp_path), once=False)
    with _loader(td.SlowAt(gate), persistent=True) as loader:
        _until_timeout(iter(loader), 2)  # worker 0 blocks in task 2 (sample 5) and holds task 4 too
        it = iter(loader)  # the next epoch's task 0 is worker 0's: it queues behind them
        with pytest.raises(WorkerTimeout, match=rf"^DataLoader timed out after {TIMEOUT_S} seconds") as info:
            next(it)
        message = str(info.value)
        # before, "Outstanding: no tasks; held by worker 0 (pid ...)": what held it was not said
        assert "abandoned epoch" in message and "task 2: indices [4..5]" in message, message
        assert info.value.tasks == {}  # this epoch's own tasks: none sent yet
        td.release(str(tmp_path))
        assert _epoch(it)[0] == MAP_ORDER
