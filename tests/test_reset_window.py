"""A persistent iterator's next epoch: what ``iter(loader)`` sends while the workers still run
tasks of an abandoned one.

The new epoch's window (``prefetch_factor`` tasks per worker) is sent at ``iter()``, behind the
abandoned tasks, as torch's ``iter()`` sends it (the torch side: tests/test_parity_train_persistent_break.py).
Where a worker still runs more than a window of earlier epochs' tasks (``iter()`` called again
and again while it is slow), ``iter()`` waits for it to catch up to one window (torch's waits for
all): a worker never holds more than two windows of tasks, nor the ring more slots than two
windows and the consumer's, however often ``iter()`` is called.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
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
def test_iter_again_and_again_behind_a_slow_worker_holds_at_most_two_windows() -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(
        SlowWorker(), batch_size=2, num_workers=2, prefetch_factor=2, persistent_workers=True,
        multiprocessing_context="fork")
    with loader:
        held = []
        for _ in range(12):
            it = mp_iter(iter(loader))
            held.append(max(len(w.outstanding) for w in it._pool.workers))
            assert np.asarray(next(it)).tolist() == [[0], [1]]  # task 0: worker 0's, the fast one
            assert len(it._ring.slots) <= 2 * 2 * 2 + 2, f"the ring grew to {len(it._ring.slots)} slots"
        assert max(held) <= 2 * 2, held  # the slow worker: an abandoned window and the new one at most
        assert [np.asarray(b).ravel().tolist() for b in loader] == [[2 * k, 2 * k + 1] for k in range(8)]
