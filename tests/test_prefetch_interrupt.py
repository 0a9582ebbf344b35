"""The device prefetcher when something other than the loader's own error stops a step.

The prefetcher hands out batch k only after it has read batch k+1 from the loader. A
``KeyboardInterrupt`` (Ctrl-C lands where the main process waits, which is that read) or any other
``BaseException`` raised by that read must not cost batch k: it is still the next batch handed out,
its source (and slot) is held until its copy's event completes, and ``state_dict()`` — the one a
Ctrl-C handler saves — still says the caller received k-1 batches.

The interrupt is injected by a wrapper around the loader's iterator that raises as read ``at``
begins, before the loader is asked: exactly what a Ctrl-C at the start of that wait does. One
inside the copy of batch k+1 (the fake backend's copy raising), after the loader handed k+1 over,
must not cost k+1 either: it used to be dropped, and a later ``state_dict()`` counted it.
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


def interrupt_copy(fake: FakeBackend, at: int, exc: type[BaseException] = KeyboardInterrupt) -> None:
    """Make the backend's copy call number ``at`` (from 1) raise ``exc`` as it begins: a Ctrl-C
    inside ``transfer.copy``, after the loader has handed the batch over."""
    copy, calls = fake.copy, [0]

    def copy_or_interrupt(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise exc()
        return copy(*args, **kwargs)

    fake.copy = copy_or_interrupt  # type: ignore[method-assign]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("at", [1, 3])
def test_an_interrupt_inside_the_copy_keeps_the_batch_read(fake: FakeBackend, exc: type, at: int) -> None:
    """The loader had handed batch k+1 over when the interrupt cut its copy short: it was
    dropped, so the caller got k and then k+2. Now it is copied again and comes in its place
    (``at=1``: the very first batch, read with nothing before it)."""
    inner = loader()
    interrupt_copy(fake, at, exc)
    try:
        it = iter(shmloader.to_device(inner, "cpu", max_held=8))
        got = [first_row(next(it))] if at == 3 else []  # batch 0; batch 1 read ahead, batch 2 read
        with pytest.raises(exc):
            next(it)
        got += [first_row(b) for b in it]
        assert got == list(range(ROWS // BATCH))  # nothing lost, nothing repeated
    finally:
        inner.close()


@pytest.mark.timeout(90)
def test_states_saved_around_an_interrupt_inside_the_copy_resume_exactly(fake: FakeBackend) -> None:
    """The handler's state, and one saved after the interrupted batch came, each resume at the
    first batch their caller had not received (before, the later one counted a lost batch)."""
    fake.auto_complete = True
    inner = loader()
    interrupt_copy(fake, 3)
    try:
        prefetcher = shmloader.to_device(inner, "cpu")
        it = iter(prefetcher)
        got = [first_row(next(it))]
        try:
            next(it)
        except KeyboardInterrupt:
            in_handler = json.dumps(prefetcher.state_dict())
        got += [first_row(next(it)), first_row(next(it))]  # batches 1 and 2
        later = json.dumps(prefetcher.state_dict())
        got += [first_row(b) for b in it]
        assert got == list(range(ROWS // BATCH))
        del it
        gc.collect()
    finally:
        inner.close()
    for state, received in ((in_handler, 1), (later, 3)):
        assert json.loads(state)["delivered"] == [[0, received]]
        resumed = loader()
        resumed.load_state_dict(json.loads(state))
        assert [first_row(b) for b in shmloader.to_device(resumed, "cpu")] == list(range(received, ROWS // BATCH))
        resumed.close()
