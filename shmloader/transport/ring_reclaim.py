"""Giving back the segments of free slots that the ring no longer needs.

Owns which free slots keep a segment (``SlotReclaim``, mixed into ``transport.ring.Ring``). Runs
in the main process. A ring grows while the user holds batches (``list(loader)``, a few batches
kept in a list); once they are dropped, their slots are free, and a free slot's segment is pages
of the shm directory that nothing needs. Promises:

- The ring keeps a segment for at most ``whole_slots`` slots (its steady size, which the iterator
  sets: the pipeline and the batch in use) and one spare free slot, beside the slots in use
  (assigned, filled, leased), wherever in the ring the free ones sit: a slot released while the
  ring holds more segments than that, and a free one already waits, is *spent* at once, as a
  forked one is: its segment retired (unlinked, its name queued for the workers), the slot id
  kept, and ``take`` gives it a fresh segment when the ring needs it again. ``take`` hands out a
  free slot that has a segment before a spent one, so a steady ring renews nothing. The check is
  O(1) per released batch (no scan of the slots); a user who holds a steady window of batches
  releases a slot only as the next task takes one, so nothing is renewed per batch.
- ``shrink_to(keep)`` (the iterator calls it as a persistent loader's next epoch begins) takes
  the free slots at the end of the ring out of it, and spends every other free slot past ``keep``
  segments. A segment whose slot leaves the ring goes to the lowest spent slot, if there is one,
  rather than being retired: segments are named by the task that writes them, not by slot id, so
  the slots that stay keep the live segments, and the ring's ids stay compact.
- The promises of ``transport/ring.py`` hold throughout: only free slots are spent (never one
  assigned, filled or leased, so never one a view of a batch still uses); a spent slot's segment
  is retired once (``close()`` and ``shrink_to`` skip it); a stale release of a slot id finds the
  slot's serial changed and does nothing. A ring with ``whole_slots`` 0 (not set) keeps every segment
  until ``shrink_to`` or ``close()``.
- ``take`` renews a free slot over ``SHRINK`` x what its task asks, or a spent one whose last
  segment was, at the ask (``_shrink``, ``_renew``): the iterator lowers the ask once the recent
  batches are all well below it (``engine/slot_size.py``), so an outlier's large slots go too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Protocol

from shmloader.errors import ShmSpaceError

from shmloader.transport.segment import Segment
from shmloader.transport.slot import Slot, SlotState

__all__ = ["SHRINK", "SlotReclaim"]

SHRINK = 4  # take renews a free slot over this many times the bytes its task asks (engine/slot_size.py)


class _Ring(Protocol):
    """What ``SlotReclaim`` uses of the ring it is mixed into (its own methods included)."""

    slots: list[Slot]
    whole_slots: int
    _free: deque[int]
    _spent: set[int]

    def collect_released(self) -> int: ...

    def _retire(self, segment: Segment, told: bool = True, hook: bool = True) -> None: ...

    def _spend(self, slot: Slot) -> None: ...

    def _drop_last(self) -> None: ...

    def _spend_first_free(self) -> None: ...

    def _spare_free(self) -> bool: ...

    def _hand_down(self, segment: Segment) -> None: ...

    def _new_segment(self, min_bytes: int, reserve: bool = True) -> Segment: ...

    def resize(self, slot: Slot, min_bytes: int, owner: Hashable) -> None: ...


class SlotReclaim:
    """The ring's methods that give back free slots' segments (a mixin of ``Ring``)."""

    def shrink_to(self: _Ring, keep: int) -> None:
        """Keep segments for at most ``keep`` slots beside those in use: the free slots at the end
        go from the ring, every other free one past ``keep`` is spent (the user let go of held batches)."""
        self.collect_released()
        while len(self.slots) > keep and self.slots[-1].state is SlotState.FREE:
            self._drop_last()
        self._free = deque(sorted(self._free, key=lambda i: self.slots[i].spent))  # those with a segment first
        while len(self.slots) - len(self._spent) > keep and self._spare_free():
            self._spend_first_free()

    def _surplus(self: _Ring) -> bool:
        """Whether a slot released now should give its segment back: the ring holds more segments
        than its steady size, and a free slot with a segment already waits for the next task."""
        return 0 < self.whole_slots < len(self.slots) - len(self._spent) and self._spare_free()

    def _spare_free(self: _Ring) -> bool:
        """Whether a free slot with a segment waits (they sit on the left of the free list)."""
        return bool(self._free) and not self.slots[self._free[0]].spent

    def _spend_first_free(self: _Ring) -> None:
        """Retire the segment of the first free slot, which has one, and move it to the spent end
        of the free list (one ``rotate``: a Ctrl-C cannot take it out of the list)."""
        slot = self.slots[self._free[0]]
        try:
            self._retire(slot.segment)
        finally:  # the segment is gone whatever the pin backend raised
            self._spend(slot)
            self._free.rotate(-1)

    def _spend(self: _Ring, slot: Slot) -> None:
        """Mark a free slot whose segment was retired: ``take`` gives it a fresh one first."""
        slot.spent = True
        self._spent.add(slot.id)

    def _drop_last(self: _Ring) -> None:
        """Take the last slot out of the ring; once it is out (close() no longer sees it), its
        segment is unlinked however the rest is cut short."""
        slot = self.slots[-1]
        self._spent.discard(slot.id)  # first: no id past the ring's end is ever in it (_hand_down)
        try:
            self.slots.pop()
            self._free.remove(slot.id)
        finally:
            if not slot.spent and (not self.slots or self.slots[-1] is not slot):
                self._hand_down(slot.segment)

    def _hand_down(self: _Ring, segment: Segment) -> None:
        """Give the segment of a free slot that left the ring to the lowest spent slot; with none, retire it."""
        lowest = min(self._spent, default=None)
        if lowest is None:
            self._retire(segment)
            return
        slot = self.slots[lowest]  # free: only free slots are spent
        slot.segment, slot.spent = segment, False  # no call in between: a Ctrl-C cannot split them
        self._spent.discard(lowest)

    def _renew(self: _Ring, slot: Slot, min_bytes: int) -> None:
        """Give a spent slot a fresh segment, as large as its last one at least, unless that one was
        over ``SHRINK`` x ``min_bytes``: then of ``min_bytes``."""
        size = slot.size_bytes
        slot.segment = self._new_segment(min_bytes if size > SHRINK * min_bytes else max(min_bytes, size))
        slot.spent = False
        self._spent.discard(slot.id)

    def _shrink(self: _Ring, slot: Slot, min_bytes: int, owner: Hashable) -> None:
        """Give a taken slot over ``SHRINK`` x ``min_bytes`` a segment of ``min_bytes`` (the old one
        retired, through the pin backend's hooks in a pinned ring); with no room for it in the
        directory the slot keeps its segment, which is large enough."""
        try:
            self.resize(slot, min_bytes, owner)
        except ShmSpaceError:
            pass
