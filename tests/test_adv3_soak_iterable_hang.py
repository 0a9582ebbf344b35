"""An iterable-dataset worker killed for hanging before it read anything of its stream: under the
restart policy it is replaced, as one that died there is.

A worker that dies while it starts, or after an epoch's ``Reset`` reached it but before it
acknowledged it, has read nothing of that epoch's stream, so its successor reads its share from the
start (tests/test_reset_ack.py). A worker that *hangs* there is killed by the deadline (the start-up
deadline, or ``task_timeout_s`` on the task queued behind the ``Reset``), and that kill used to
end the epoch with ``WorkerHung`` ("A worker of an IterableDataset cannot be restarted") though
nothing of the stream was lost: found by stress/combos.py, where spawned workers on a loaded machine
passed their start-up deadline. A hang once the worker reads its stream stays ``WorkerHung``.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import numpy as np
import pytest

import adv3_soak_datasets as ad
from process_helpers import workers_left
from shmloader import DataLoader, WorkerHung
from shmloader.engine import faults

METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]
N = 12
DEADLINE_S = 0.5
# two workers' shards in batches of 2, taken in turn: [0, 2], [1, 3], [4, 6], [5, 7], ...
ORDER = [[w + 2 * (2 * b + j) for j in range(2)] for b in range(N // 4) for w in range(2)]


def batches(loader: Any) -> list[list[int]]:
    return [np.asarray(b)[:, 0].tolist() for b in loader]


@pytest.mark.timeout(60)
def test_a_worker_hung_while_starting_is_replaced(tmp_path: Any, monkeypatch: Any) -> None:
    # the main process's start-up deadline, short; fork only: a spawned worker's imports alone may take
    # longer than that on a loaded machine, and every start would be killed
    monkeypatch.setattr(faults, "START_TIMEOUT_FLOOR_S", DEADLINE_S)
    method = "fork"
    fired = str(tmp_path / "fired")
    loader: DataLoader[Any] = DataLoader(ad.Stream(N), batch_size=2, num_workers=2, task_timeout_s=DEADLINE_S,
                                         worker_init_fn=ad.HangsInInit(fired, 1), on_worker_death="restart",
                                         multiprocessing_context=method)
    with loader:
        assert batches(loader) == ORDER
        assert os.path.exists(fired)  # it did hang, while starting
        assert loader.stats()["worker_restarts"] == 1
    assert workers_left() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_a_worker_hung_before_it_read_the_new_epoch_is_replaced(method: str, tmp_path: Any) -> None:
    arm, fired = str(tmp_path / "arm"), str(tmp_path / "fired")
    loader: DataLoader[Any] = DataLoader(ad.Stream(N, arm, fired, 0), batch_size=2, num_workers=2,
                                         task_timeout_s=DEADLINE_S, persistent_workers=True,
                                         on_worker_death="restart", multiprocessing_context=method)
    with loader:
        assert batches(loader) == ORDER
        open(arm, "w").close()
        assert batches(loader) == ORDER  # the successor read the killed worker's share from its start
        assert os.path.exists(fired)  # it did hang, at the epoch's Reset
        assert loader.stats()["worker_restarts"] == 1
        assert batches(loader) == ORDER
    assert workers_left() == []


@pytest.mark.timeout(60)
def test_without_the_restart_policy_it_is_still_worker_hung(tmp_path: Any) -> None:
    arm, fired = str(tmp_path / "arm"), str(tmp_path / "fired")
    loader: DataLoader[Any] = DataLoader(ad.Stream(N, arm, fired, 1), batch_size=2, num_workers=2,
                                         task_timeout_s=DEADLINE_S, persistent_workers=True)
    with loader:
        assert batches(loader) == ORDER
        open(arm, "w").close()
        with pytest.raises(WorkerHung, match=rf"task_timeout_s={DEADLINE_S} seconds"):
            list(loader)
    assert workers_left() == []
