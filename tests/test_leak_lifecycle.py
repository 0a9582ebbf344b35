"""Per-cycle resources stay flat: descriptors across worker restarts and iterator abandonment.

The suite's guards look for processes and segments at the end of a test; these count what they
do not see (descriptors, mappings of ``shml_`` segments) cycle after cycle. Each replaced worker
must give back its three pipe ends, the task pipe's read end the main process keeps open against
SIGPIPE (``WorkerHandle.task_reader``) included, and an abandoned iterator everything it opened.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from iter_helpers import mp_iter
import numpy as np
import pytest
from process_helpers import workers_left

from shmloader import DataLoader, Dataset


class Rows(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(4, i, dtype=np.int64)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mapped_segments() -> int:
    with open("/proc/self/maps") as maps:
        return sum("/shml_" in line for line in maps)


@pytest.mark.timeout(60)
def test_descriptors_stay_flat_across_worker_restarts_and_close() -> None:
    loader: DataLoader[Any] = DataLoader(Rows(), batch_size=2, num_workers=2, on_worker_death="restart",
                                         persistent_workers=True, multiprocessing_context="fork")
    counts = []
    for cycle in range(12):
        it = mp_iter(iter(loader))
        next(it)
        victim = it._pool.workers[cycle % 2]
        os.kill(victim.pid, signal.SIGKILL)
        victim.process.join()
        assert len(list(it)) == 7  # every batch still delivered: the worker was replaced
        counts.append((_fds(), _mapped_segments()))
    assert loader.stats()["worker_restarts"] == 12
    assert counts[-1] <= counts[1], counts  # a leaked pipe end per restart would add 12
    loader.close()
    assert workers_left() == []
    assert _fds() <= counts[0][0] - 6  # the pool's 2 x 3 pipe ends at least, task readers included


@pytest.mark.timeout(60)
def test_abandoned_iterators_give_back_what_they_opened() -> None:
    loader: DataLoader[Any] = DataLoader(Rows(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    persistent: DataLoader[Any] = DataLoader(Rows(), batch_size=2, num_workers=2, persistent_workers=True,
                                             multiprocessing_context="fork")
    counts = []
    for _ in range(20):
        next(iter(loader))  # dropped mid-epoch
        it = iter(persistent)  # replaces the one abandoned last cycle
        next(it)
        counts.append((_fds(), _mapped_segments(), len(workers_left())))
    assert counts[-1] <= counts[1], counts
    persistent.close()
