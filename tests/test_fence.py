"""Release fences: a dropped pinned batch's slot is reused only after the device copies are done.

torch's pattern ``x = x.to("cuda", non_blocking=True)`` drops the pinned source at once, while the
copy may still be queued on the GPU. torch's caching host allocator keeps its pinned buffer until
an event on the copy's stream completes; shmloader's slots get the same from a fence: an event the
pin backend records on the current stream when the batch's last view dies. What must hold: a slot
whose fence has not completed is never handed to a worker (the ring grows instead); it is free as
soon as the fence completes; at ``max_slots`` the ring waits for the oldest fence rather than
failing; a fence that cannot be recorded is logged, never raised from the finalizer; unpinned and
mlock'd rings have no fence at all.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import numpy as np
import pytest

from ring_helpers import OWNER, leased
import shmloader
from shmloader.gpu.fake import FakeBackend, FakeEvent
from shmloader.transport.ring import Ring, SlotState

PAGE = 4096


def ring_with(fence: Any, tmp_path: Any, max_slots: int = 0) -> Ring:
    return Ring(str(tmp_path), max_slots=max_slots, fence=fence)


def lease_and_drop(ring: Ring, slot: Any) -> None:
    ring.fill(slot, OWNER)
    buf = leased(ring, slot)
    del buf
    gc.collect()


class Fences:
    """A fence factory whose events complete only when the test says so."""

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []

    def __call__(self) -> FakeEvent:
        self.events.append(FakeEvent(len(self.events)))
        return self.events[-1]


def test_a_slot_cools_until_its_fence_completes(tmp_path: Any) -> None:
    fences = Fences()
    ring = ring_with(fences, tmp_path)
    try:
        slot = ring.grow(PAGE, OWNER)
        lease_and_drop(ring, slot)
        assert len(fences.events) == 1  # recorded when the last view died
        assert ring.take(PAGE, OWNER) is None and ring.cooling == 1
        assert slot.state is SlotState.LEASED
        fences.events[0].complete()
        again = ring.take(PAGE, OWNER)
        assert again is slot and ring.cooling == 0
    finally:
        ring.close()


def test_at_max_slots_the_ring_waits_for_the_oldest_fence(tmp_path: Any) -> None:
    fences = Fences()
    ring = ring_with(fences, tmp_path, max_slots=2)
    try:
        first, second = ring.grow(PAGE, OWNER), ring.grow(PAGE, OWNER)
        lease_and_drop(ring, first)
        lease_and_drop(ring, second)
        assert ring.take(PAGE, OWNER) is None
        slot = ring.grow(PAGE, OWNER)  # no RingExhausted: the oldest fence is waited for
        assert slot is first
        assert fences.events[0].synchronized and not fences.events[1].synchronized
        assert len(ring.slots) == 2
    finally:
        ring.close()


def test_a_failing_fence_is_logged_and_the_slot_reused(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise RuntimeError("no stream here")

    ring = ring_with(broken, tmp_path)
    try:
        slot = ring.grow(PAGE, OWNER)
        with caplog.at_level(logging.WARNING, logger="shmloader"):
            lease_and_drop(ring, slot)
        assert any("could not fence slot 0" in r.getMessage() and "no stream here" in r.getMessage()
                   for r in caplog.records)
        assert ring.take(PAGE, OWNER) is slot
    finally:
        ring.close()


def test_without_a_fence_a_dropped_slot_is_free_at_once(tmp_path: Any) -> None:
    ring = ring_with(None, tmp_path)
    try:
        slot = ring.grow(PAGE, OWNER)
        lease_and_drop(ring, slot)
        assert ring.take(PAGE, OWNER) is slot
    finally:
        ring.close()


def test_a_stale_release_after_close_is_ignored(tmp_path: Any) -> None:
    fences = Fences()
    ring = ring_with(fences, tmp_path)
    slot = ring.grow(PAGE, OWNER)
    ring.fill(slot, OWNER)
    buf = leased(ring, slot)
    ring.close()
    del buf
    gc.collect()
    assert ring.collect_released() == 0 and ring.cooling == 0


# -- through a loader ----------------------------------------------------------------------------
ROWS, COLS = 64, 8


def loader(**kwargs: Any) -> shmloader.DataLoader:
    data = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    return shmloader.DataLoader(shmloader.ArrayDataset(data), batch_size=8, num_workers=1, pin_memory=True,
                                persistent_workers=True, prefetch_factor=1, **kwargs)


@pytest.mark.timeout(60)
def test_no_worker_rewrites_a_slot_before_its_fence_completes(fake: FakeBackend) -> None:
    fake.fences_done = False
    dl = loader()
    try:
        for k, (x,) in enumerate(dl):
            expect = np.arange(k * 8 * COLS, (k + 1) * 8 * COLS, dtype=np.float32).reshape(8, COLS)
            np.testing.assert_array_equal(x, expect)
            del x
        ring = dl._iterator._ring
        gc.collect()
        ring.collect_released()
        # Every batch of the epoch was dropped but no fence completed: no slot was ever reused.
        assert len(fake.fences) == ROWS // 8
        assert ring.created_total == len(ring.slots) == ROWS // 8
        for event in fake.fences:
            event.complete()
        ring.collect_released()
        assert ring.count(SlotState.FREE) == len(ring.slots) and ring.cooling == 0
        # The next epoch (fences completing at once) reuses those slots: no new segment, no new
        # registration.
        fake.fences_done = True
        assert sum(1 for _ in dl) == ROWS // 8
        assert ring.created_total == ROWS // 8 and fake.count("register") == ROWS // 8
    finally:
        dl.close()


@pytest.mark.timeout(60)
def test_with_max_slots_a_loader_waits_for_fences_instead_of_failing(fake: FakeBackend) -> None:
    fake.fences_done = False
    dl = loader(max_slots=2)
    try:
        got = [x.copy() for (x,) in dl]
        assert len(got) == ROWS // 8
        np.testing.assert_array_equal(np.concatenate(got), np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS))
        assert len(dl._iterator._ring.slots) <= 2
        assert any(e.synchronized for e in fake.fences)
    finally:
        dl.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["none", "mlock"])
def test_no_fence_without_a_device_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMLOADER_PIN_BACKEND", backend)
    with pytest.warns(UserWarning):  # torch's "no accelerator" warning (mlock pins for no device)
        dl = loader()
        try:
            assert sum(1 for _ in dl) == ROWS // 8
            assert dl._iterator._ring._fence is None
        finally:
            dl.close()
