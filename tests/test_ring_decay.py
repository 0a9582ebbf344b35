"""Slots follow the size tasks ask down as well as up (``Ring.take``, ``engine/slot_size.py``).

What must hold: ``take`` gives a free slot over ``SHRINK`` x the ask a segment of the ask (a
spent one too), and keeps one within that; a slot a view holds is never touched; a pinned ring's
pin backend sees the old segment retired and the new one created; a full directory leaves the
slot its segment. ``SlotSize`` grows at once, lowers only when a whole window of batches is well
below the size, never below the first size, and not for sizes varying within a band.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest

from shmloader.caches import CACHE_LIMIT
from shmloader.engine.slot_size import GROWTH, WINDOW_RINGS, SlotSize
from shmloader.errors import ShmSpaceError
from shmloader.transport.ring import SHRINK, Ring, Slot, SlotState
from shmloader.transport.segment import page_round

PAGE = 4096
MIB = 1 << 20


def _files(tmp_path: Any) -> set[str]:
    return set(os.listdir(tmp_path))


def _free_slot(ring: Ring, size: int, task: int = 0) -> Slot:
    """Add a slot of ``size`` bytes to the ring and free it again."""
    slot = ring.grow(size, (0, task))
    ring.free(slot, (0, task))
    return slot


def _take(ring: Ring, min_bytes: int, owner: tuple[int, int]) -> Slot:
    """The free slot ``take`` hands out (there must be one)."""
    slot = ring.take(min_bytes, owner)
    assert slot is not None
    return slot


def test_take_renews_a_free_slot_far_larger_than_the_ask_and_keeps_one_within(tmp_path: Any) -> None:
    ring = Ring(str(tmp_path))
    try:
        big = _free_slot(ring, 20 * MIB)
        old = big.segment.name
        assert _take(ring, MIB, (1, 0)) is big and big.size_bytes == MIB and ring.created_total == 2
        assert _files(tmp_path) == {big.segment.name} and old in ring.retired_names  # the workers unmap it
        ring.free(big, (1, 0))
        name = big.segment.name
        assert _take(ring, MIB // SHRINK, (1, 1)) is big  # exactly SHRINK x the ask: kept
        assert big.segment.name == name and ring.created_total == 2
        ring.free(big, (1, 1))
    finally:
        ring.close()
    assert _files(tmp_path) == set()


def test_a_spent_slot_is_renewed_at_the_ask_when_its_last_segment_was_far_larger(tmp_path: Any) -> None:
    ring = Ring(str(tmp_path))
    try:
        big, mid = _free_slot(ring, 20 * MIB, 0), _free_slot(ring, 2 * MIB, 1)
        for slot in (big, mid):
            ring._retire(slot.segment)
            ring._spend(slot)
        taken = [_take(ring, MIB, (1, k)) for k in range(2)]
        assert {id(s) for s in taken} == {id(big), id(mid)}
        assert big.size_bytes == MIB and mid.size_bytes == 2 * MIB  # mid is within SHRINK x: as large as before
        assert len(_files(tmp_path)) == 2
        for k, s in enumerate(taken):
            ring.free(s, (1, k))
    finally:
        ring.close()


def test_a_leased_slot_is_never_renewed_whatever_the_ask(tmp_path: Any) -> None:
    ring = Ring(str(tmp_path))
    try:
        big = ring.grow(20 * MIB, (0, 0))
        ring.fill(big, (0, 0), used_bytes=PAGE)
        buf = ring.lease(big, (0, 0))
        buf[:4] = b"kept"  # type: ignore[call-overload]  # a char array takes bytes; its stub wants a list
        small = _free_slot(ring, MIB, 1)
        name = big.segment.name
        assert _take(ring, PAGE, (1, 0)) is small and ring.take(PAGE, (1, 1)) is None
        assert big.state is SlotState.LEASED and big.segment.name == name and buf[:4] == b"kept"
        ring.free(small, (1, 0))
        del buf
        gc.collect()
    finally:
        ring.close()


def test_a_pinned_ring_renews_through_the_pin_backends_hooks(tmp_path: Any) -> None:
    created: list[str] = []
    retired: list[str] = []
    ring = Ring(str(tmp_path), on_create=lambda s: created.append(s.name),
                on_retire=lambda s: retired.append(s.name))
    try:
        big = _free_slot(ring, 20 * MIB)
        old = big.segment.name
        assert _take(ring, MIB, (1, 0)) is big and big.size_bytes == MIB
        assert retired == [old] and created == [old, big.segment.name]
        ring.free(big, (1, 0))
    finally:
        ring.close()
    assert sorted(retired) == sorted(created)


def test_a_full_directory_leaves_the_large_slot_its_segment(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ring = Ring(str(tmp_path))
    try:
        big = _free_slot(ring, 20 * MIB)
        name = big.segment.name

        def full(min_bytes: int, reserve: bool = True) -> Any:
            raise ShmSpaceError("full", needed_bytes=min_bytes, free_bytes=0, directory=str(tmp_path))

        monkeypatch.setattr(ring, "_new_segment", full)
        assert _take(ring, MIB, (1, 0)) is big and big.segment.name == name and big.state is SlotState.ASSIGNED
        ring.free(big, (1, 0))
    finally:
        ring.close()
    assert _files(tmp_path) == set()


def _run(size: SlotSize, used: int, batches: int) -> None:
    for _ in range(batches):
        size.observe(used)


def test_slot_size_grows_at_once_and_lowers_only_after_a_window_well_below_it() -> None:
    size = SlotSize(MIB, ring_length=6)
    block = WINDOW_RINGS * 6
    assert size.grown(256) == MIB  # never below the size
    _run(size, 256, block - 1)
    size.grew_to(size.grown(16 * MIB), 16 * MIB)  # the block ends before the outlier is filled
    assert size.bytes == page_round(int(16 * MIB * GROWTH))
    _run(size, 256, 1)
    assert size.bytes == page_round(int(16 * MIB * GROWTH))
    _run(size, 256, 2 * block - 1)  # until the second block after the outlier's ends, that one is in the window
    assert size.bytes == page_round(int(16 * MIB * GROWTH))
    _run(size, 256, 1)
    assert size.bytes == MIB  # never below the first size


def test_slot_size_stays_for_sizes_within_a_band_and_follows_a_lasting_drop() -> None:
    size = SlotSize(MIB, ring_length=3)
    size.grew_to(size.grown(8 * MIB), 8 * MIB)
    grown = size.bytes
    for k in range(200):
        size.observe(8 * MIB // (1 + k % 3))  # 8/4/2.7 MiB: within SHRINK x
    assert size.bytes == grown
    _run(size, MIB, 4 * WINDOW_RINGS * 3)  # a lasting drop to 1 MiB batches: under 1/SHRINK of the size
    assert size.bytes == page_round(int(MIB * GROWTH)) and size.bytes * SHRINK < grown


def test_the_buffer_types_of_sizes_no_slot_has_any_more_are_not_kept_for_ever(tmp_path: Any) -> None:
    """A ring whose one slot is leased at more sizes than a cache keeps over its life (a loader whose batch
    sizes keep moving up and down) keeps a ctypes buffer type for a bounded number of sizes."""
    ring = Ring(str(tmp_path))
    try:
        slot = ring.grow(PAGE, (0, 0))
        for task in range(2 * CACHE_LIMIT + 10):
            owner = (0, task)
            if task:
                taken = ring.take((task + 1) * PAGE * (SHRINK + 1) if task % 2 else PAGE, owner)
                assert taken is slot
            ring.fill(slot, owner, PAGE)
            buf = ring.lease(slot, owner)
            assert len(buf) == slot.size_bytes
            del buf
            gc.collect()
            ring.collect_released()
        assert len(ring._buffer_types) <= CACHE_LIMIT
    finally:
        ring.close()
