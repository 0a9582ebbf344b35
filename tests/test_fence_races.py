"""Release fences against batches dropped at any moment: a slot whose batch another thread (or a
garbage-collector pass) drops between the engine's ``take`` and ``grow`` is cooling like any other,
so at ``max_slots`` the ring waits for its fence instead of raising ``RingExhausted``.
tests/test_fence.py has the fence protocol itself."""

from __future__ import annotations

import gc
from typing import Any

from ring_helpers import OWNER, leased

from shmloader.gpu.fake import FakeEvent
from shmloader.transport.ring import Ring

PAGE = 4096


def test_at_max_slots_a_batch_dropped_after_take_looked_is_waited_for(tmp_path: Any) -> None:
    events: list[FakeEvent] = []

    def fence() -> FakeEvent:
        events.append(FakeEvent(len(events)))
        return events[-1]

    ring = Ring(str(tmp_path), max_slots=2, fence=fence)
    try:
        first, second = ring.grow(PAGE, OWNER), ring.grow(PAGE, OWNER)
        held, dropped = leased(ring, first), leased(ring, second)
        assert ring.take(PAGE, OWNER) is None  # the engine looked: every slot is leased
        del dropped  # ...then the user's other thread drops a batch, its copy still running
        gc.collect()
        assert len(events) == 1 and not events[0].done
        slot = ring.grow(PAGE, OWNER)  # the engine grows: at max_slots, it must wait for that fence
        assert slot is second and events[0].synchronized
        assert len(ring.slots) == 2
        del held
    finally:
        ring.close()
