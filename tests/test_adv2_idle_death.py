"""A persistent worker that dies between epochs (killed while the trainer validates, say), noticed
only as the next epoch starts.

Under the restart policy an iterable dataset's worker that dies holds a position in its stream
only once its epoch has begun for it. A death the main process could see before it sent the next
epoch's ``Reset`` came before that epoch began for the worker, whatever it held of the abandoned
or finished one: nothing of the new epoch is lost. It used to be seen only at the new epoch's
first wait, blamed on the new epoch's tasks and raised as ``WorkerDied`` ("its position in the
stream died with it") although no sample had been read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import adv2_datasets as ad
import fault_datasets as fd
from adv2_helpers import kill_and_wait
from iter_helpers import mp_iter
from shmloader import DataLoader, WorkerDied

N = 24


def firsts(batches: Any) -> list[int]:
    return [int(x) // 10 for b in batches for x in np.asarray(b)[:, 0]]


def stream_samples() -> list[int]:
    return sorted([0, 2, *range(1, N, 2)])  # worker 0's share ends after two samples


@pytest.mark.timeout(30)
@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("first_epoch", ["whole", "broken_off"])
def test_an_iterable_worker_dead_between_epochs_is_replaced_under_the_restart_policy(victim: int,
                                                                                     first_epoch: str) -> None:
    loader: DataLoader[Any] = DataLoader(fd.UnevenStream(N, short=2), batch_size=2, num_workers=2,
                                         persistent_workers=True, on_worker_death="restart")
    with loader:
        it = iter(loader)
        if first_epoch == "whole":
            assert sorted(firsts(it)) == stream_samples()
        else:
            next(it)  # the rest of the epoch is abandoned, tasks of it still at the workers
        kill_and_wait(mp_iter(it)._pool.workers[victim])
        for _ in range(2):
            assert sorted(firsts(loader)) == stream_samples()
        assert loader.stats()["worker_restarts"] == 1


@pytest.mark.timeout(30)
def test_without_the_restart_policy_it_is_still_worker_died() -> None:
    """As torch's persistent iterator raises at the next epoch for a worker that exited."""
    loader: DataLoader[Any] = DataLoader(fd.UnevenStream(N, short=2), batch_size=2, num_workers=2,
                                         persistent_workers=True)
    with loader:
        it = iter(loader)
        assert sorted(firsts(it)) == stream_samples()
        pid = kill_and_wait(mp_iter(it)._pool.workers[1])
        with pytest.raises(WorkerDied, match=f"pid {pid}"):
            list(loader)
        assert sorted(firsts(loader)) == stream_samples()  # iter(loader) starts afresh


@pytest.mark.timeout(30)
@pytest.mark.parametrize("in_order", [True, False])
def test_a_map_style_worker_dead_between_epochs_costs_no_task_an_attempt(tmp_path: Any, in_order: bool) -> None:
    """Its death is no attempt of the new epoch's first task: with max_task_attempts=1 that task
    was named a PoisonTask though it never ran."""
    loader: DataLoader[Any] = DataLoader(ad.ArmedFaults(N, str(tmp_path), {}), batch_size=2, num_workers=2,
                                         persistent_workers=True, on_worker_death="restart", max_task_attempts=1,
                                         in_order=in_order)
    with loader:
        it = iter(loader)
        assert firsts(it) == list(range(N)) or not in_order
        kill_and_wait(mp_iter(it)._pool.workers[0])
        got = firsts(loader)
        assert sorted(got) == list(range(N)) and (got == sorted(got) or not in_order)
        assert loader.stats()["worker_restarts"] == 1


@pytest.mark.timeout(30)
def test_a_successor_that_cannot_start_as_the_epoch_begins_stops_that_iterator_only(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A fork refused while the dead worker is replaced: that ``iter()`` raises, its iterator goes
    (nothing of it left running), and the next ``iter(loader)`` starts afresh."""
    from shmloader.engine.workers import WorkerPool

    loader: DataLoader[Any] = DataLoader(ad.ArmedFaults(N, str(tmp_path), {}), batch_size=2, num_workers=2,
                                         persistent_workers=True, on_worker_death="restart")
    with loader:
        it = mp_iter(iter(loader))
        assert firsts(it) == list(range(N))
        kill_and_wait(it._pool.workers[1])
        with monkeypatch.context() as m:
            m.setattr(WorkerPool, "replace", lambda self, worker_id: (_ for _ in ()).throw(BlockingIOError(11, "no")))
            with pytest.raises(BlockingIOError):
                iter(loader)
        assert it.closed and not it._pool.workers
        assert firsts(loader) == list(range(N))
