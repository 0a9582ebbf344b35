"""A worker's ``TooSmall`` wakes the wait that sleeps on the due batch's worker only.

With in-order, round-robin dispatch of a map-style dataset the wait sleeps on the reply pipe of
the worker whose batch is due next (``WaitAndRecover._head_poller``), not on the others'. A
``TooSmall`` from another worker needs the main process to act (its slot must grow, and the task
be sent again), yet it waited unread in its pipe until the due batch came, so that task's growth
began a batch late, while its worker ran out of tasks. Here task 1's worker answers ``TooSmall``
once the main process sleeps on task 0's worker, and task 0's sample comes once task 1's growth
has begun, or after ``DEADLINE_S`` if it never does: the batch says which.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.engine.growth import Growths
from shmloader.engine.wait import WaitAndRecover

BIG = 1 << 19  # float64s: a 4 MiB sample, four times the first slot
DEADLINE_S = 5.0  # how long task 0's sample waits for task 1's growth before it says it never began


class _GrowsWhileDue(shmloader.Dataset):
    """Sample 0: 1.0 when task 1's growth began before it was made, else 0.0 (after the deadline).
    Sample 1 outgrows the first slot, sent once the main process sleeps on sample 0's worker."""

    def __init__(self, asleep: Any, grown: Any) -> None:
        self.events = (asleep, grown)  # fork context events: set by the main process

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> np.ndarray:
        asleep, grown = self.events
        if i == 1 and not asleep.wait(30):
            raise TimeoutError("the main process never slept on worker 0")
        return np.array([float(grown.wait(DEADLINE_S))]) if i == 0 else np.full(BIG if i == 1 else 4, float(i))


@pytest.mark.timeout(60)
def test_too_small_of_another_worker_grows_while_the_due_batch_is_awaited(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = multiprocessing.get_context("fork")
    asleep, grown = ctx.Event(), ctx.Event()
    head_poller, start = WaitAndRecover._head_poller, Growths.start

    def sleeping_on_head(self: Any, poller: Any) -> Any:
        if self._pool.workers[0].ready:  # its Ready read: only its batch (or a death) ends this sleep
            asleep.set()
        return head_poller(self, poller)

    def growth_starts(self: Growths, rec: Any, min_bytes: int) -> None:
        grown.set()
        start(self, rec, min_bytes)

    monkeypatch.setattr(WaitAndRecover, "_head_poller", sleeping_on_head)
    monkeypatch.setattr(Growths, "start", growth_starts)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(_GrowsWhileDue(asleep, grown), batch_size=1, num_workers=2,
                                  prefetch_factor=2, multiprocessing_context="fork")
    batches = list(loader)
    assert batches[0].tolist() == [[1.0]], "task 1's growth began only after batch 0 came"
    assert [float(b[0, 0]) for b in batches[1:]] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert batches[1].shape == (1, BIG)
