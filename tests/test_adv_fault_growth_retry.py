"""An iterable dataset's batch that outgrew its slot, when its worker ends after the retry was sent.

The worker keeps such a batch (``TooSmall``) until the task comes back in a larger slot; its
stream has moved past those samples, and its share may have ended meanwhile (``Exhausted`` for
its later tasks). tests/test_adv2_growth_iterable.py kills it while the slot grows. Here the slot
has grown and the task is on its way back to the same worker when that worker is SIGKILLed, or
stopped (SIGSTOP) and killed at its ``task_timeout_s``. The restart policy took it for a worker
whose share had ended and held nothing: its successor, "exhausted" too, passed the task over as
if its answer had been ``Exhausted``, and the epoch ended without that batch, silently. A worker
that kept a batch is not replaceable: its samples died with it (``WorkerDied`` / ``WorkerHung``
naming the IterableDataset), and no batch comes twice.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

import adv2_datasets as ad
from adv2_helpers import kill_and_wait, lost_kept_batch
from shmloader import DataLoader, WorkerDied, WorkerHung
from shmloader.engine.growth import Growths
from shmloader.engine.send import SendTasks

BIG = 3_000_000  # float64 values: 24 MB, a slot that grows in several parts


@pytest.mark.timeout(30)
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_an_ended_worker_that_dies_as_its_grown_task_comes_back_loses_no_batch_silently(
        monkeypatch: pytest.MonkeyPatch, in_order: bool, persistent: bool, how: str) -> None:
    grown: set[Any] = set()
    ended: list[int] = []
    start, send = Growths.start, SendTasks._send

    def note_growth(self: Any, rec: Any, min_bytes: int) -> None:
        grown.add(rec.key)
        start(self, rec, min_bytes)

    def end_it_first(self: Any, w: Any, rec: Any) -> None:
        if rec.key in grown and not ended:  # the grown task, sent again to the worker that kept its batch
            deadline = time.monotonic() + 10
            while not w.exhausted and time.monotonic() < deadline:  # its share's end, read in order
                if w.results.poll(0.05):
                    self._drain(w)
            assert w.exhausted, "worker 0 never said its share had ended"
            if how == "kill":
                ended.append(kill_and_wait(w))
            else:
                w.signal(signal.SIGSTOP)  # hangs until its task deadline kills it
                ended.append(int(w.pid))
        send(self, w, rec)

    monkeypatch.setattr(Growths, "start", note_growth)
    monkeypatch.setattr(SendTasks, "_send", end_it_first)
    loader: DataLoader[Any] = DataLoader(ad.BigThenEnds(12, BIG), batch_size=1, num_workers=2, prefetch_factor=3,
                                         slot_bytes=4096, on_worker_death="restart", in_order=in_order,
                                         persistent_workers=persistent, task_timeout_s=1.0 if how == "stop" else 0)
    with loader:
        lost_kept_batch(loader, WorkerDied if how == "kill" else WorkerHung, lambda: ended[0] if ended else -1)
    assert ended, "the retried batch's slot never grew"
