"""The device prefetcher when a ``KeyboardInterrupt`` lands in the wait for batch k's copy.

Batch k is handed out after batch k+1 has been read and its copy enqueued, and after the caller's
stream was made to wait on k's event (``Transfer.wait``). An interrupt inside that wait must not
cost batch k: the next ``next()`` hands it out (without reading k+2 over k+1), its source is kept
until its copy is done, and a ``state_dict()`` saved in between stands before it. It used to be
dropped there: batch k was lost, and the state counted it as received.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.gpu.fake import FakeBackend

BATCHES = 6


class WaitInterrupted(FakeBackend):
    """A fake transfer whose wait number ``at`` (from 0) raises ``exc`` as it begins."""

    at = 1
    exc: type[BaseException] = KeyboardInterrupt
    waits = 0

    def wait(self, moved: Any, event: Any, device: str) -> None:
        self.waits += 1
        if self.waits == self.at + 1:
            raise self.exc()
        super().wait(moved, event, device)


def make_loader() -> shmloader.DataLoader:
    return shmloader.DataLoader([np.full(2, i) for i in range(BATCHES)], batch_size=1, num_workers=0)


def rest_after(state: dict[str, Any]) -> list[int]:
    resumed = make_loader()
    resumed.load_state_dict(state)
    return [int(batch[0][0]) for batch in resumed]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("at", [0, 1, BATCHES - 1])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_the_wait_for_a_copy_keeps_the_batch(at: int, exc: type[BaseException]) -> None:
    fake = WaitInterrupted(auto_complete=True)
    fake.at, fake.exc = at, exc
    moved = shmloader.to_device(make_loader(), "cpu", transfer=fake)
    steps = iter(moved)
    got: list[int] = []
    saved: list[tuple[list[int], dict[str, Any]]] = []
    while True:
        try:
            got.append(int(next(steps)[0][0]))
        except StopIteration:
            break
        except exc:
            assert got == list(range(at))
        saved.append((list(got), moved.state_dict()))
    assert got == list(range(BATCHES))
    for before, state in saved:
        assert before + rest_after(state) == list(range(BATCHES)), before


def test_the_source_of_a_batch_whose_wait_was_interrupted_is_kept_until_its_copy_is_done() -> None:
    fake = WaitInterrupted()  # events complete only when told to
    fake.at = 0
    batches = ({"x": np.full(3, k)} for k in range(3))
    steps = iter(shmloader.to_device(batches, "cpu", transfer=fake, max_held=8))
    with pytest.raises(KeyboardInterrupt):
        next(steps)
    assert fake.sources[0][0]() is not None  # batch 0's copy is unfinished: its source is held
    assert fake.count("copy") == 2  # batch 1 was read ahead, and is not read again
    first = next(steps)
    assert fake.count("copy") == 2 and float(first["x"][0]) == 0.0
    assert [float(b["x"][0]) for b in steps] == [1.0, 2.0]
