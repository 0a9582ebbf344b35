"""After ``task_timeout_s`` kills a slow worker: the rest of the epoch, and the next one.

Without the restart policy the kill ends the epoch with ``WorkerHung`` and shuts the iterator
down (persistent or not); ``iter(loader)`` starts over with new workers and gets a whole epoch.
Under ``on_worker_death="restart"`` the task is retried in a new worker and the epoch goes on,
each batch once and in order (an iterable dataset's worker cannot be restarted: ``WorkerHung``).
With ``timeout=`` shorter than the deadline and persistent workers, the timeout keeps the slow
worker, and a deadline still applies to the task it holds from the abandoned epoch. The slow
sample is a gate the test owns (timeout_datasets.py), left shut: only the kill ends it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import timeout_datasets as td
from process_helpers import workers_left

from shmloader import DataLoader, WorkerHung, WorkerTimeout

DEADLINE_S = 0.5
MAP_ORDER = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
STREAM_ORDER = td.stream_order(12, 2, 2)


def _loader(dataset: Any, persistent: bool, **kw: Any) -> DataLoader:
    return DataLoader(dataset, batch_size=2, num_workers=2, task_timeout_s=DEADLINE_S, persistent_workers=persistent,
                      multiprocessing_context="fork", **kw)


def _indices(batches: Any) -> list[list[int]]:
    return [indices.tolist() for indices, _pid in batches]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_after_worker_hung_the_next_epoch_is_whole(tmp_path, persistent, iterable):
    gate = td.Gate(str(tmp_path), once=True)  # slow once: never opened, the worker is killed there
    dataset, order = (td.SlowStream(gate), STREAM_ORDER) if iterable else (td.SlowAt(gate), MAP_ORDER)
    fds = td.warm_descriptors()
    with _loader(dataset, persistent) as loader:
        it = iter(loader)
        before = 3 if iterable else 2
        assert _indices(next(it) for _ in range(before)) == order[:before]
        with pytest.raises(WorkerHung, match=rf"spent more than task_timeout_s={DEADLINE_S} seconds on task"):
            next(it)
        assert workers_left() == []
        for _ in range(2):
            assert _indices(loader) == order
    assert workers_left() == [] and _fds() == fds


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_under_the_restart_policy_the_epoch_goes_on_and_the_next_is_whole(tmp_path, persistent):
    gate = td.Gate(str(tmp_path), once=True)
    with _loader(td.SlowAt(gate), persistent, on_worker_death="restart") as loader:
        assert _indices(loader) == MAP_ORDER  # task 2 retried in a new worker
        assert loader.stats()["worker_restarts"] == 1
        assert _indices(loader) == MAP_ORDER


def _through_timeouts(epoch: Any, tries: int = 40) -> Any:
    """``epoch()`` again after each ``WorkerTimeout`` that kept the workers (not ``WorkerHung``)."""
    for _ in range(tries - 1):
        try:
            return epoch()
        except WorkerHung:
            raise
        except WorkerTimeout:
            continue
    return epoch()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["raise", "restart"])
def test_a_persistent_timeout_then_the_deadline_of_the_abandoned_task(tmp_path, policy):
    """timeout= fires first and keeps the slow worker; the task it holds, of the abandoned epoch,
    then passes its deadline while the next epoch waits for it: the worker is killed. Restart: its
    successor gets the new epoch's tasks it held, and the epoch is whole. Raise: WorkerHung, and
    the next iter() starts over, whole."""
    gate = td.Gate(str(tmp_path), once=True)
    with DataLoader(td.SlowAt(gate), batch_size=2, num_workers=2, timeout=0.3, task_timeout_s=1.0,
                    persistent_workers=True, multiprocessing_context="fork", on_worker_death=policy) as loader:
        it = iter(loader)
        assert _indices([next(it), next(it)]) == MAP_ORDER[:2]
        with pytest.raises(WorkerTimeout, match="persistent workers were kept") as info:
            next(it)
        assert not isinstance(info.value, WorkerHung)
        del info
        if policy == "restart":
            assert _through_timeouts(lambda: _indices(loader)) == MAP_ORDER
            assert loader.stats()["worker_restarts"] == 1
        else:
            with pytest.raises(WorkerHung, match=r"on task 2 \(sample indices \[4\.\.5\]\) of an earlier epoch, "
                                                 r"abandoned \(the tasks of this one queued behind it\) and was killed"):
                _through_timeouts(lambda: _indices(loader))
            assert _indices(loader) == MAP_ORDER
