"""A Ctrl-C (or any error) that lands in one of the GPU handoff's host waits, driven by fake events.

Python runs a SIGINT handler only once the C call it interrupted has returned, so a Ctrl-C during a
device wait (``event.synchronize()``) is raised right after the wait completed. Three waits are
checked here, and each must lose nothing:

- the ring's wait for the oldest release fence at ``max_slots``: the slot stays in the ring (it
  used to be dropped from the cooling queue and never freed: a later ``grow`` raised
  ``RingExhausted`` with every batch dropped);
- the prefetcher's wait for the oldest copy past ``max_held``, right after batch k was made ready:
  batch k is still handed out, at the next ``next()`` (it used to be lost);
- the prefetcher's drain when an epoch stops early: every copy is waited for before its source
  (and slot) is let go, even after one wait raised (the rest used to be let go unwaited for).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import numpy as np
import pytest
from ring_helpers import OWNER, leased

import shmloader
from shmloader.gpu.fake import FakeBackend, FakeEvent
from shmloader.transport.ring import Ring, SlotState

PAGE = 4096


class InterruptedEvent(FakeEvent):
    """A fake event whose ``synchronize`` completes, then raises ``exc`` (a Ctrl-C after the wait);
    with ``before`` it raises without completing (a device error)."""

    exc: type[BaseException] = KeyboardInterrupt
    before = False

    def synchronize(self) -> None:
        if not self.before:
            super().synchronize()
        raise self.exc()


# -- the ring's wait for a fence -------------------------------------------------------------------


def dropped_slot(ring: Ring) -> Any:
    """A new slot, leased and its batch dropped: it cools until its fence completes."""
    slot = ring.grow(PAGE, OWNER)
    buf = leased(ring, slot)
    del buf
    gc.collect()
    return slot


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_a_wait_for_a_fence_cut_short_keeps_the_slot_in_the_ring(tmp_path: Any, exc: type[BaseException]) -> None:
    fences: list[FakeEvent] = []

    def fence() -> FakeEvent:
        event = InterruptedEvent(len(fences)) if not fences else FakeEvent(len(fences))
        event.exc = exc  # type: ignore[attr-defined]
        fences.append(event)
        return event

    ring = Ring(str(tmp_path), max_slots=1, fence=fence)
    try:
        slot = dropped_slot(ring)
        with pytest.raises(exc):
            ring.grow(PAGE, OWNER)  # at max_slots: waits for the fence, and the wait raises
        again = ring.grow(PAGE, OWNER)  # the fence is complete now: the same slot, no RingExhausted
        assert again is slot and slot.state is SlotState.ASSIGNED and ring.cooling == 0
    finally:
        ring.close()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_a_fence_wait_that_fails_before_completing_never_frees_the_slot(tmp_path: Any,
                                                                         exc: type[BaseException]) -> None:
    event = InterruptedEvent(0)
    event.before, event.exc = True, exc
    ring = Ring(str(tmp_path), max_slots=1, fence=lambda: event)
    try:
        slot = dropped_slot(ring)
        with pytest.raises(exc):
            ring.grow(PAGE, OWNER)
        assert slot.state is SlotState.LEASED and ring.cooling == 1  # still cooling: never handed out
        event.complete()
        assert ring.grow(PAGE, OWNER) is slot
    finally:
        ring.close()


# -- the prefetcher's waits --------------------------------------------------------------------------


class SyncInterrupted(FakeBackend):
    """A fake transfer whose copy events' ``synchronize`` number ``at`` (from 0) is interrupted."""

    at = 0
    before = False
    syncs = 0

    def copy(self, batch: Any, device: str, stream: Any, non_blocking: bool) -> tuple[Any, FakeEvent]:
        moved, event = super().copy(batch, device, stream, non_blocking)
        backend, synchronize = self, event.synchronize

        def counted() -> None:
            backend.syncs += 1
            if backend.syncs == backend.at + 1:
                if not backend.before:
                    synchronize()
                raise KeyboardInterrupt
            synchronize()

        event.synchronize = counted  # type: ignore[method-assign]
        return moved, event


def numbers(n: int) -> Any:
    return ({"x": np.full(3, k)} for k in range(n))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("at", [0, 1, 4])
def test_an_interrupt_in_the_wait_past_max_held_loses_no_batch(at: int) -> None:
    fake = SyncInterrupted()  # copies complete only when waited for: every hand-out waits (max_held=0)
    fake.at = at
    steps = iter(shmloader.to_device(numbers(5), "cpu", transfer=fake, max_held=0))
    got: list[int] = []
    interrupted = 0
    while True:
        try:
            got.append(int(next(steps)["x"][0]))
        except StopIteration:
            break
        except KeyboardInterrupt:
            interrupted += 1
            assert got == list(range(at))  # batch ``at`` was not received yet
    assert interrupted == 1 and got == list(range(5))
    assert fake.count("copy") == 5  # nothing was read, or copied, twice


@pytest.mark.timeout(60)
def test_a_source_stays_held_while_its_interrupted_wait_has_not_completed() -> None:
    fake = SyncInterrupted()
    fake.at, fake.before = 0, True  # the wait raises before the copy is done
    moved = shmloader.to_device(numbers(3), "cpu", transfer=fake, max_held=0)
    steps = iter(moved)
    with pytest.raises(KeyboardInterrupt):
        next(steps)
    gc.collect()
    assert not fake.events[0].done and fake.sources[0][0]() is not None  # its slot views are kept
    assert [int(b["x"][0]) for b in steps] == [0, 1, 2]


@pytest.mark.timeout(60)
def test_stopping_early_waits_for_every_copy_even_when_one_wait_is_interrupted() -> None:
    fake = SyncInterrupted()
    fake.at = 0  # the first wait of the drain (batch 0's copy) is interrupted after it completed
    steps = iter(shmloader.to_device(numbers(4), "cpu", transfer=fake, max_held=8))
    next(steps)  # batch 0 held, batch 1 read ahead: neither copy has completed
    with pytest.raises(KeyboardInterrupt):
        steps.close()  # type: ignore[attr-defined]  # the epoch iterator stops as a generator does
    gc.collect()
    for event, sources in zip(fake.events, fake.sources):
        # a source is let go only once its copy is done
        assert event.done or all(ref() is not None for ref in sources), event
    assert all(event.done for event in fake.events)  # the drain went on past the interrupt


def small_loader() -> shmloader.DataLoader:
    return shmloader.DataLoader([np.full(2, i) for i in range(5)], batch_size=1, num_workers=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("at", [0, 2, 4])
def test_a_state_saved_after_an_interrupt_past_max_held_resumes_at_the_batch_not_received(at: int) -> None:
    fake = SyncInterrupted()
    fake.at = at
    moved = shmloader.to_device(small_loader(), "cpu", transfer=fake, max_held=0)
    steps, got, states = iter(moved), [], []
    for _step in range(5 + 1):  # five batches and one interrupt
        with contextlib.suppress(KeyboardInterrupt):
            got.append(int(next(steps)[0][0]))
        states.append((len(got), moved.state_dict()))
    assert got == list(range(5)) and next(steps, None) is None
    for received, state in states:  # each state resumes right after the batches received by then
        resumed = small_loader()
        resumed.load_state_dict(state)
        assert [int(b[0][0]) for b in resumed] == list(range(received, 5)), received
