"""A segment is unpinned (and unmapped) only once the fence of its dropped batch has completed.

The ring frees a dropped pinned slot only after its fence; the same must hold when the slot's
segment is not reused but retired: ``close()`` while the slot cools (or before its release was
collected), and a batch held past ``close()`` (its segment lingers) dropped right after a
``non_blocking`` copy. A backend's ``unregister_segment`` must never have to guess whether a copy
still reads the pages: the ring waits for the fence first. Each hook is checked exactly: every
registered segment unregistered once, never twice.
"""

from __future__ import annotations

import gc
from typing import Any

from ring_helpers import OWNER, leased

from shmloader.gpu.fake import FakeEvent
from shmloader.transport.ring import Ring
from shmloader.transport.segment import Segment

PAGE = 4096


class Hooks:
    """Pin hooks and a fence: records, at each unregistration, whether every fence had completed."""

    def __init__(self) -> None:
        self.fences: list[FakeEvent] = []
        self.registered: list[str] = []
        self.unregistered: list[tuple[str, bool]] = []  # (segment, every fence done by then)

    def fence(self) -> FakeEvent:
        self.fences.append(FakeEvent(len(self.fences)))
        return self.fences[-1]

    def register(self, segment: Segment) -> None:
        self.registered.append(segment.name)

    def unregister(self, segment: Segment) -> None:
        assert not segment.buf.closed, f"{segment.name} unregistered after it was unmapped"
        self.unregistered.append((segment.name, all(f.done for f in self.fences)))

    def ring(self, tmp_path: Any) -> Ring:
        return Ring(str(tmp_path), on_create=self.register, on_retire=self.unregister, fence=self.fence)

    def balanced(self) -> bool:
        names = [name for name, _ in self.unregistered]
        return sorted(names) == sorted(self.registered) and len(set(names)) == len(names)


def test_close_waits_for_a_cooling_slots_fence_before_unpinning(tmp_path: Any) -> None:
    hooks = Hooks()
    ring = hooks.ring(tmp_path)
    slot = ring.grow(PAGE, OWNER)
    buf = leased(ring, slot)
    del buf  # dropped right after a non_blocking copy: the fence is pending
    gc.collect()
    assert ring.take(PAGE, OWNER) is None and ring.cooling == 1
    ring.close()
    assert hooks.fences[0].synchronized
    assert hooks.unregistered == [(slot.segment.name, True)] and hooks.balanced()


def test_close_waits_for_the_fence_of_a_release_not_collected_yet(tmp_path: Any) -> None:
    hooks = Hooks()
    ring = hooks.ring(tmp_path)
    slot = ring.grow(PAGE, OWNER)
    buf = leased(ring, slot)
    del buf
    gc.collect()  # released, but nothing has collected it: no take() since
    ring.close()
    assert len(hooks.fences) == 1 and hooks.fences[0].synchronized
    assert hooks.unregistered == [(slot.segment.name, True)] and hooks.balanced()


def test_a_lingering_segment_is_unpinned_only_after_its_drop_is_fenced(tmp_path: Any) -> None:
    hooks = Hooks()
    ring = hooks.ring(tmp_path)
    slot = ring.grow(PAGE, OWNER)
    name = slot.segment.name
    buf = leased(ring, slot)
    ring.close()  # the user still holds the batch: its segment lingers, pinned
    assert hooks.unregistered == []
    del buf  # dropped right after a non_blocking copy of it was enqueued
    gc.collect()
    assert len(hooks.fences) == 1 and hooks.fences[0].synchronized
    assert hooks.unregistered == [(name, True)] and hooks.balanced()


def test_a_fence_that_fails_at_close_still_unpins_every_segment_once(tmp_path: Any) -> None:
    hooks = Hooks()
    ring = hooks.ring(tmp_path)
    first, second = ring.grow(PAGE, OWNER), ring.grow(PAGE, OWNER)
    for slot in (first, second):
        buf = leased(ring, slot)
        del buf
    gc.collect()

    def broken() -> None:
        raise RuntimeError("device lost")

    hooks.fences[0].synchronize = broken  # type: ignore[method-assign]
    ring.close()  # logged, not raised: the segments go all the same
    assert hooks.fences[1].synchronized and hooks.balanced() and len(hooks.unregistered) == 2
