"""Batches the user keeps (``list(loader)``): what they cost in the shared-memory directory.

What must hold: a batch the user holds costs about its own bytes there, as torch's (each of
its batches is in shared memory of its own size), not a whole slot, which is as large as the
largest batch seen yet; the slot of a held batch is trimmed (the tail its batch does not use
is given back) when the ring must grow, and once the batch is dropped the slot gets a fresh,
wholly reserved segment before a worker writes it again; every batch stays intact.
"""

from __future__ import annotations

import gc
import mmap
import os
from typing import Any

import numpy as np
import pytest
from ring_helpers import OWNER, leased

import shmloader
from shmloader.transport.ring import Ring, SlotState

SHM = "/dev/shm"
PAGE = mmap.PAGESIZE
MIB = 1 << 20


class Sized:
    """Sample ``i`` holds ``sizes[i // 4]`` int32 values, all equal to ``i`` (batches of 4)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return 4 * len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.sizes[i // 4], i, dtype=np.int32)


def _allocated_bytes() -> int:
    """Bytes the segments of this process take in /dev/shm (pages actually backed)."""
    prefix = f"shml_{os.getpid()}_"
    return sum(os.stat(os.path.join(SHM, n)).st_blocks * 512 for n in os.listdir(SHM) if n.startswith(prefix))


def _intact(batch: np.ndarray, k: int) -> bool:
    return all((batch[r] == 4 * k + r).all() for r in range(4))


@pytest.mark.timeout(60)
def test_held_small_batches_cost_their_bytes_not_a_slot_each() -> None:
    # one large batch first makes every later slot 2.5 MiB; then 16 batches of 64 bytes, all kept
    sizes = [1 << 17] + [4] * 16
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Sized(sizes), batch_size=4, num_workers=2)
    it = iter(loader)
    held = [next(it) for _ in sizes]  # the epoch not ended: its segments are all still in /dev/shm
    try:
        assert all(_intact(b, k) for k, b in enumerate(held))
        whole = 2 * 2 + 2 + 1  # ring_slots(2 workers, prefetch 2) + 1: slots not trimmed yet
        slot = 5 * MIB // 2  # 1.25 x the large batch's 2 MiB
        # each held batch costs its own pages (the large one 2 MiB), beside the slots kept whole;
        # a whole slot each would be 17 x 2.5 MiB
        assert _allocated_bytes() <= whole * slot + 2 * MIB + len(held) * PAGE
    finally:
        del held, it
        loader.close()


@pytest.mark.timeout(60)
def test_held_batches_stay_intact_and_later_epochs_reuse_their_slots() -> None:
    sizes = [1 << 15, 4, 1 << 16, 0, 4, 1 << 14, 4, 4]
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Sized(sizes), batch_size=4, num_workers=2,
                                                             persistent_workers=True)
    try:
        for _ in range(3):
            held = list(loader)
            assert len(held) == len(sizes) and all(_intact(b, k) for k, b in enumerate(held))
            again = [_intact(b, k) for k, b in enumerate(loader)]  # the trimmed slots are written again
            assert all(again) and len(again) == len(sizes)
            assert all(_intact(b, k) for k, b in enumerate(held))  # the held ones were not touched
            del held
    finally:
        loader.close()


def test_ring_trims_a_leased_slot_when_it_grows_and_renews_it_when_dropped() -> None:
    ring = Ring(SHM)
    try:
        slot = ring.grow(MIB, OWNER)
        ring.fill(slot, OWNER, used_bytes=100)
        buf = leased(ring, slot)
        buf[:100] = b"x" * 100  # type: ignore[call-overload]  # a char array takes bytes; its stub wants a list
        first = slot.segment
        other = ring.grow(MIB, (0, 1))  # every slot is held: the ring grows, the held one is trimmed
        assert first.reserved == PAGE and buf[:100] == b"x" * 100
        assert os.stat(first.path).st_blocks * 512 <= PAGE  # the tail went back to the directory
        del buf
        gc.collect()
        assert ring.collect_released() == 1
        again = ring.take(MIB, (0, 2))
        assert again is slot and slot.state is SlotState.ASSIGNED
        assert slot.segment is not first and slot.segment.reserved == slot.segment.size_bytes >= MIB
        assert first.name in ring.retired_names
        ring.free(other, (0, 1))
    finally:
        ring.close()
