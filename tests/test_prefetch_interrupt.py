"""The device prefetcher when something other than the loader's own error stops a step.

The prefetcher hands out batch k only after it has read batch k+1 from the loader. A
``KeyboardInterrupt`` (Ctrl-C lands where the main process waits, which is that read) or any other
``BaseException`` raised by that read must not cost batch k: it is still the next batch handed out,
its source (and slot) is held until its copy's event completes, and ``state_dict()`` — the one a
Ctrl-C handler saves — still says the caller received k-1 batches.

The interrupt is injected by a wrapper around the loader's iterator that raises as read ``at``
begins, before the loader is asked: exactly what a Ctrl-C at the start of that wait does.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.gpu.fake import FakeBackend

ROWS, COLS, BATCH = 64, 8, 8


def loader() -> shmloader.DataLoader:
    data = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    return shmloader.DataLoader(shmloader.ArrayDataset(data), batch_size=BATCH, num_workers=1, pin_memory=True,
                                persistent_workers=True)


def first_row(batch: Any) -> int:
    (x,) = batch
    return int(np.asarray(x)[0, 0]) // (BATCH * COLS)


class _InterruptedIter:
    """A loader's iterator (its ``_record`` and ``state_of`` too) whose read ``at`` raises first."""

    def __init__(self, it: Iterator[Any], at: int, exc: type[BaseException]) -> None:
        self.it, self.at, self.exc, self.reads = it, at, exc, 0

    def __iter__(self) -> _InterruptedIter:
        return self

    def __next__(self) -> Any:
        self.reads += 1
        if self.reads == self.at + 1:
            raise self.exc()
        return next(self.it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.it, name)


class Interrupted:
    """A loader whose first epoch is interrupted once, as read ``at`` (counting from 0) begins."""

    def __init__(self, inner: shmloader.DataLoader, at: int, exc: type[BaseException] = KeyboardInterrupt) -> None:
        self.inner, self.at, self.exc, self.epochs = inner, at, exc, 0

    def __iter__(self) -> Any:
        self.epochs += 1
        it = iter(self.inner)
        return _InterruptedIter(it, self.at, self.exc) if self.epochs == 1 else it

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_while_reading_ahead_keeps_the_batch_and_its_slot(fake: FakeBackend, exc: type) -> None:
    inner = loader()
    try:
        prefetcher = shmloader.to_device(Interrupted(inner, at=3, exc=exc), "cpu", max_held=8)
        it = iter(prefetcher)
        got = [first_row(next(it)), first_row(next(it))]  # batches 0 and 1; batch 2 is read ahead
        with pytest.raises(exc):
            next(it)  # batch 2 is due, and the read of batch 3 is interrupted
        gc.collect()
        assert fake.sources[2] and all(ref() is not None for ref in fake.sources[2])  # its copy is unfinished
        assert not fake.events[2].done
        got += [first_row(b) for b in it]  # batch 2 comes next: nothing lost, nothing repeated
        assert got == list(range(ROWS // BATCH))
    finally:
        inner.close()


@pytest.mark.timeout(90)
def test_a_state_saved_in_an_interrupt_handler_resumes_at_the_batch_not_received(fake: FakeBackend) -> None:
    fake.auto_complete = True
    inner = loader()
    try:
        prefetcher = shmloader.to_device(Interrupted(inner, at=3), "cpu")
        it = iter(prefetcher)
        got = [first_row(next(it)), first_row(next(it))]
        try:
            next(it)
        except KeyboardInterrupt:  # the usual handler: save a checkpoint, stop
            checkpoint = json.dumps(prefetcher.state_dict())
        assert json.loads(checkpoint)["delivered"] == [[0, 2]]  # the caller has batches 0 and 1, no more
        del it
        gc.collect()
    finally:
        inner.close()
    resumed = loader()
    resumed.load_state_dict(json.loads(checkpoint))
    got += [first_row(b) for b in shmloader.to_device(resumed, "cpu")]
    assert got == list(range(ROWS // BATCH))
    resumed.close()
