"""The ring gives back the segments of free slots it no longer needs (``transport/ring_reclaim.py``).

What must hold: past its steady size (``whole_slots``) the ring keeps one spare free segment and
retires the others as their batches are dropped, wherever their slots sit; ``take`` reuses a
slot with a segment before it makes one; ``shrink_to`` hands the segments of the slots it takes
out of the ring to the spent slots below them; a slot a view still uses is never touched; a pin
backend sees each segment retired once, even when its hook raises.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
from shmloader.transport.ring import Ring, SlotState

PAGE = 4096


def _files(tmp_path: Any) -> set[str]:
    return set(os.listdir(tmp_path))


def _leased_ring(tmp_path: Any, n: int, whole: int, **kwargs: Any) -> tuple[Ring, list[Any]]:
    """A ring of ``n`` slots, each leased (its batch's buffer returned), ``whole_slots`` = ``whole``."""
    ring = Ring(str(tmp_path), **kwargs)
    ring.whole_slots = whole
    bufs = []
    for k in range(n):
        slot = ring.grow(PAGE, (0, k))
        ring.fill(slot, (0, k))
        bufs.append(ring.lease(slot, (0, k)))
    return ring, bufs


def _drop_in_order(bufs: list[Any]) -> None:
    """Drop the batches first to last: their releases queue in that order."""
    while bufs:
        del bufs[0]
    gc.collect()


def test_dropped_batches_past_the_steady_size_give_their_segments_back(tmp_path: Any) -> None:
    ring, bufs = _leased_ring(tmp_path, 5, whole=2)
    try:
        _drop_in_order(bufs)
        assert ring.collect_released() == 5 and ring.count(SlotState.FREE) == 5
        live = [s for s in ring.slots if not s.spent]
        assert len(live) == 2 and _files(tmp_path) == {s.segment.name for s in live}
        # the slots with a segment are taken first; then the spent ones get fresh, whole segments
        taken = [s for s in (ring.take(PAGE, (1, k)) for k in range(5)) if s is not None]
        assert {id(s) for s in taken[:2]} == {id(s) for s in live} and ring.created_total == 5 + 3
        assert len(taken) == 5 and all(not s.spent and s.segment.reserved == s.size_bytes for s in taken)
        assert len(_files(tmp_path)) == 5
        for k, s in enumerate(taken):
            ring.free(s, (1, k))
    finally:
        ring.close()
    assert _files(tmp_path) == set()


def test_a_ring_without_a_steady_size_keeps_its_segments_until_shrunk(tmp_path: Any) -> None:
    ring, bufs = _leased_ring(tmp_path, 4, whole=0)
    try:
        _drop_in_order(bufs)
        assert ring.collect_released() == 4 and len(_files(tmp_path)) == 4 and ring.created_total == 4
    finally:
        ring.close()


def test_shrink_hands_the_last_slots_segments_down_and_spends_the_rest(tmp_path: Any) -> None:
    ring, bufs = _leased_ring(tmp_path, 6, whole=3)
    try:
        held = bufs.pop(3)  # a batch still held in the middle of the ring
        _drop_in_order(bufs)
        ring.collect_released()
        last = ring.slots[-1].segment.name
        assert not ring.slots[-1].spent and [s.spent for s in ring.slots] == [False, True, True, False, True, False]
        ring.shrink_to(3)
        assert len(ring.slots) == 4 and ring.slots[3].state is SlotState.LEASED  # the held one stays
        live = [s for s in ring.slots if not s.spent]
        assert ring.slots[3] in live and last in {s.segment.name for s in live}  # handed down, not retired
        assert len(live) == 3 and _files(tmp_path) == {s.segment.name for s in live}
        assert ring.created_total == 6
        held[:4] = b"kept"  # type: ignore[call-overload]  # a char array takes bytes; its stub wants a list
        assert held[:4] == b"kept"
        del held
        gc.collect()
        ring.shrink_to(2)
        assert len(ring.slots) == 2 and all(not s.spent for s in ring.slots) and len(_files(tmp_path)) == 2
        assert ring.created_total == 6  # the ids stayed compact without a fresh segment
    finally:
        ring.close()
    assert _files(tmp_path) == set()


def test_a_pin_backend_sees_each_surplus_segment_retired_once_even_when_its_hook_raises(tmp_path: Any) -> None:
    created: list[str] = []
    retired: list[str] = []

    def on_retire(segment: Any) -> None:
        retired.append(segment.name)
        raise RuntimeError("unpin failed")

    ring, bufs = _leased_ring(tmp_path, 4, whole=2, on_create=lambda s: created.append(s.name), on_retire=on_retire)
    try:
        _drop_in_order(bufs)
        with pytest.raises(RuntimeError, match="unpin failed"):
            ring.collect_released()  # the second release is surplus: its segment goes, the hook raises
        assert len(retired) == 1 and ring.slots[1].spent and ring.slots[1].state is SlotState.FREE
        assert retired[0] not in _files(tmp_path)
        with pytest.raises(RuntimeError):
            ring.collect_released()  # the third: surplus too
        assert ring.collect_released() == 1  # the last stays: the ring holds its steady size
        assert len(retired) == 2 and len(set(retired)) == 2 and len(_files(tmp_path)) == 2
    finally:
        try:
            ring.close()
        except RuntimeError:
            pass
    assert _files(tmp_path) == set() and sorted(set(retired)) == sorted(created)


def test_a_stale_release_of_a_spent_and_renewed_slot_is_ignored(tmp_path: Any) -> None:
    ring, bufs = _leased_ring(tmp_path, 3, whole=1)
    try:
        slot = ring.slots[1]
        serial = slot.lease_serial
        _drop_in_order(bufs)
        ring.collect_released()
        assert slot.spent
        ring._released.append((slot.id, serial, None, False))  # the same release, once more
        ring.take(PAGE, (1, 0))
        ring.take(PAGE, (1, 1))
        assert slot.state is SlotState.ASSIGNED and not slot.spent  # renewed and handed to task (1, 1)
        ring.collect_released()
        assert slot.state is SlotState.ASSIGNED and slot.owner == (1, 1)
        ring.fill(slot, (1, 1))
        assert len(ring.lease(slot, (1, 1))) == slot.size_bytes
    finally:
        ring.close()
