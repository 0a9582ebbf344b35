"""The size every task asks its slot to be: up at once for a batch that did not fit, down once the
recent batches have all been well below it.

Owns that size (``SlotSize.bytes``) and a window of the recent batches' sizes. Runs in the main
process; the iterator asks ``bytes`` for each task it dispatches (``engine.send``), tells ``grown``
of each ``TooSmall`` reply and ``observe`` of each filled batch (``engine.wait``). The rule:

- *Up:* a batch that needs more than the size makes it ``GROWTH`` x that batch's bytes (never
  less than before), for that task's slot and every later one.
- *Down:* batches are counted in blocks of ``WINDOW_RINGS`` ring-lengths, keeping the largest
  ``used_bytes`` of the block just ended and of the one before it (O(1) per batch, no scan of the
  slots). As each block ends, if ``GROWTH`` x the largest of those two blocks (at least the first
  size) is under 1/``SHRINK`` of the size, the size drops to it; ``Ring.take`` then renews each
  free slot that is over ``SHRINK`` x the ask as its next task takes it, so an outlier's slots go
  within a ring-length or so. Sizes that vary within a band under ``SHRINK`` x (4x) never lower
  the size, and so renew no segment; a batch past a lowered size grows it again.

Promises: the size never falls below the first one (``slot_bytes=``, or 1 MiB); it drops only at a
block's end, and only as far as a task's slot is then renewed by ``take`` (over ``SHRINK`` x the
ask), so a lowered size is never one that leaves every slot as it was.
"""

from __future__ import annotations

from shmloader.transport.ring import SHRINK
from shmloader.transport.segment import page_round

__all__ = ["GROWTH", "SlotSize", "WINDOW_RINGS"]

GROWTH = 1.25  # a slot that was too small grows to this multiple of the bytes the batch needed
WINDOW_RINGS = 2  # ring-lengths per block: the size follows the largest batch of the last 2 blocks


class SlotSize:
    """The bytes each task's slot is asked to be, following the recent batches up and down."""

    def __init__(self, first: int, ring_length: int) -> None:
        self.bytes = first
        self._floor = first
        self._block = max(1, WINDOW_RINGS * ring_length)
        self._seen = 0  # batches in the current block
        self._block_max = 0  # the largest batch of the current block
        self._last_max = 0  # the largest batch of the block before it

    def grown(self, needed: int) -> int:
        """The size for a batch of ``needed`` bytes that did not fit (``GROWTH`` x, never less than now);
        the caller makes it the size (``grew_to``) once the slot can grow."""
        return max(self.bytes, page_round(int(needed * GROWTH)))

    def grew_to(self, size: int, needed: int) -> None:
        """A slot is growing to ``size`` for a batch of ``needed`` bytes: every later task asks that
        much, and the batch counts in the window now (a block ending before it is filled keeps the size)."""
        self.bytes = size
        if needed > self._block_max:
            self._block_max = needed

    def observe(self, used_bytes: int) -> None:
        """A batch occupying ``used_bytes`` of its slot was filled; at a block's end, maybe lower the size."""
        if used_bytes > self._block_max:
            self._block_max = used_bytes
        self._seen += 1
        if self._seen >= self._block:
            self._end_block()

    def _end_block(self) -> None:
        recent = max(self._last_max, self._block_max)
        self._last_max, self._block_max, self._seen = self._block_max, 0, 0
        target = max(self._floor, page_round(int(recent * GROWTH)))
        if target * SHRINK < self.bytes:
            self.bytes = target
