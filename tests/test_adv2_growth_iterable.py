"""An iterable dataset's batch that outgrew its slot, when its worker dies before the retry.

The worker keeps such a batch (``TooSmall``) until the task comes back in a larger slot: its
stream has moved past those samples. If that worker's share has ended meanwhile and it dies
while the slot grows, the restart policy replaced it as a worker that "holds no position", and
the grown task went to the successor, whose stream starts afresh: it delivered the share's first
samples again in place of the kept batch (a batch lost, another repeated).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import adv2_datasets as ad
from adv2_helpers import kill_and_wait, lost_kept_batch
from shmloader import DataLoader, WorkerDied
from shmloader.engine.wait import WaitAndRecover

BIG = 3_000_000  # float64 values: 24 MB, a slot that grows in several parts


@pytest.mark.timeout(30)
@pytest.mark.parametrize("in_order", [True, False])
def test_an_ended_worker_that_dies_holding_a_batch_to_retry_is_not_replaced_as_if_it_held_nothing(
        monkeypatch: pytest.MonkeyPatch, in_order: bool) -> None:
    original = WaitAndRecover._grow
    killed: list[int] = []

    def kill_its_worker_first(self: Any) -> None:
        rec = self._growths.waiting[0]
        w = self._pool.workers[rec.worker_id]
        if not killed and rec.worker_id == 0:
            deadline = time.monotonic() + 10
            while not w.exhausted and time.monotonic() < deadline:  # its share's end, read in order
                if w.results.poll(0.05):
                    self._drain(w)
            assert w.exhausted, "worker 0 never said its share had ended"
            killed.append(kill_and_wait(w))
        original(self)

    monkeypatch.setattr(WaitAndRecover, "_grow", kill_its_worker_first)
    loader: DataLoader[Any] = DataLoader(ad.BigThenEnds(12, BIG), batch_size=1, num_workers=2, prefetch_factor=3,
                                         slot_bytes=4096, on_worker_death="restart", in_order=in_order)
    lost_kept_batch(loader, WorkerDied, lambda: killed[0] if killed else -1)
    assert killed, "the retried batch's slot never grew"
