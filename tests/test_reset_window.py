"""A persistent iterator's next epoch: what ``iter(loader)`` does while the workers still run tasks
of an abandoned one.

As torch's ``iter()`` (``_reset``), it first waits for the workers to answer every task of the
abandoned epoch, then sends the new epoch's window (``prefetch_factor`` tasks per worker: the torch
side is tests/test_parity_train_persistent_break.py). So however often ``iter()`` is called while a
worker is slow, no worker holds more than a window of tasks, nor the ring more slots than its steady
size (the window and the consumer's two); sending the new window behind the abandoned one grew the
ring by a window.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import timeout_datasets as td
from iter_helpers import mp_iter

import shmloader
from shmloader.worker_info import get_worker_info


class SlowWorker:
    """Sample i is ``[i]``; worker 1 takes 20 ms a sample (the dataset's cost, not a synchronisation)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> np.ndarray:
        info = get_worker_info()
        if info is not None and info.id == 1:
            time.sleep(0.02)
        return np.array([i])


@pytest.mark.timeout(60)
def test_iter_again_and_again_behind_a_slow_worker_holds_one_window() -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(
        SlowWorker(), batch_size=2, num_workers=2, prefetch_factor=2, persistent_workers=True,
        multiprocessing_context="fork")
    with loader:
        held = []
        for _ in range(12):
            it = mp_iter(iter(loader))
            held.append(max(len(w.outstanding) for w in it._pool.workers))
            assert np.asarray(next(it)).tolist() == [[0], [1]]  # task 0: worker 0's, the fast one
            assert len(it._ring.slots) <= 2 * 2 + 2, f"the ring grew to {len(it._ring.slots)} slots"
        assert max(held) <= 2, held  # the new epoch's window only: the abandoned one was waited for
        assert [np.asarray(b).ravel().tolist() for b in loader] == [[2 * k, 2 * k + 1] for k in range(8)]


@pytest.mark.timeout(60)
def test_an_iterable_worker_killed_while_iter_waits_for_it_is_replaced(tmp_path: Any) -> None:
    """The epoch has not begun for a worker that ``iter()`` waits for: killed there for a hang
    (``task_timeout_s``), it loses no position in the new epoch's stream, so under the restart
    policy its successor takes its place and the epoch is whole (it was a ``WorkerHung`` naming a
    lost stream position)."""
    gate = td.Gate(str(tmp_path), once=True)  # worker 1's first sample (1) blocks, in that process only
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(
        td.SlowStream(gate, n=6, at=1), batch_size=1, num_workers=2, prefetch_factor=1, persistent_workers=True,
        multiprocessing_context="fork", on_worker_death="restart", task_timeout_s=1.0)
    try:
        with loader:
            for _ in range(2):  # each epoch left after worker 0's first batch: worker 1 falls behind
                assert np.asarray(next(iter(loader))).tolist()[0][0] == 0
            # worker 1 now holds two abandoned tasks, more than a window: iter() waits, and kills it
            assert [np.asarray(b).tolist()[0][0] for b in loader] == [0, 1, 2, 3, 4, 5]
            assert loader.stats()["worker_restarts"] == 1
    finally:
        td.release(str(tmp_path))
