"""A persistent iterable-dataset worker that dies after the main process sent the new epoch's
``Reset`` but before it read anything of that epoch: under the restart policy it is replaced.

The worker acknowledges each ``Reset`` (``ResetDone``) once its iterator is restarted and before
it reads any task of the epoch; a death before that acknowledgement came lost no position in the
stream, so a successor (sent the same ``Reset``) reads the worker's share from its start. It used
to be ``WorkerDied`` ("its position in the stream died with it"): the main process could not tell
whether the worker had read samples. A death after the acknowledgement, while reading the stream,
is still ``WorkerDied``. So is a worker that dies while it starts (before ``Ready``), in any epoch:
it had read nothing either, and used to be ``WorkerDied`` too.

The death is deterministic: the dataset's ``__iter__`` (a plain method, run as the worker restarts
its iterator) SIGKILLs its own process in the second epoch, before it returns its generator.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import numpy as np
import pytest

import start_datasets as sd
from adv2_datasets import ArmedStream, InitFailsInOne, arm
from shmloader import DataLoader, WorkerDied

METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]
N = 16


def firsts(batches: Any) -> list[int]:
    return [int(x) // 10 for b in batches for x in np.asarray(b)[:, 0]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("method", METHODS)
def test_a_worker_dead_before_it_read_the_new_epoch_is_replaced(method: str, victim: int, tmp_path: Any) -> None:
    arm, fired = str(tmp_path / "arm"), str(tmp_path / "fired")
    loader: DataLoader[Any] = DataLoader(sd.DiesAtReset(N, arm, fired, victim), batch_size=2, num_workers=2,
                                         persistent_workers=True, on_worker_death="restart",
                                         multiprocessing_context=method)
    with loader:
        first = firsts(loader)
        assert sorted(first) == list(range(N))
        open(arm, "w").close()
        assert firsts(loader) == first  # the successor read the dead worker's share from its start
        assert os.path.exists(fired)  # it did die, at the epoch's Reset
        assert loader.stats()["worker_restarts"] == 1
        assert firsts(loader) == first  # and the next epoch runs on it as on any worker


@pytest.mark.timeout(60)
def test_without_the_restart_policy_it_is_worker_died(tmp_path: Any) -> None:
    arm, fired = str(tmp_path / "arm"), str(tmp_path / "fired")
    loader: DataLoader[Any] = DataLoader(sd.DiesAtReset(N, arm, fired, 1), batch_size=2, num_workers=2,
                                         persistent_workers=True)
    with loader:
        assert sorted(firsts(loader)) == list(range(N))
        open(arm, "w").close()
        with pytest.raises(WorkerDied, match=r"SIGKILL"):
            list(loader)


@pytest.mark.timeout(60)
def test_a_worker_dead_while_reading_its_stream_is_still_worker_died(tmp_path: Any) -> None:
    """Once the epoch began for it (its Reset acknowledged), a death may have taken samples with it."""
    loader: DataLoader[Any] = DataLoader(ArmedStream(N, str(tmp_path), at=7), batch_size=2, num_workers=2,
                                         persistent_workers=True, on_worker_death="restart")
    with loader:
        assert sorted(firsts(loader)) == list(range(N))
        arm(str(tmp_path))
        with pytest.raises(WorkerDied, match="its position in the stream died with it"):
            list(loader)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_an_iterable_worker_dead_while_starting_is_replaced(method: str, tmp_path: Any) -> None:
    """Killed in ``worker_init_fn``, before its first task: its successor reads its share in full."""
    arm(str(tmp_path))
    loader: DataLoader[Any] = DataLoader(ArmedStream(N, str(tmp_path), at=-1), batch_size=2, num_workers=2,
                                         worker_init_fn=InitFailsInOne(str(tmp_path), 1, "kill"),
                                         on_worker_death="restart", multiprocessing_context=method)
    assert sorted(firsts(loader)) == list(range(N))
    assert os.path.exists(os.path.join(str(tmp_path), "init"))  # worker 1 did die while starting
