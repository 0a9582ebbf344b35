"""A slot's growth: an assigned slot that is too small gets a new, larger segment.

Owns the ring's growth transitions (``SlotGrowth``, mixed into ``transport.ring.Ring``) and each
slot's ``growing`` segment. Runs in the main process. Slot *ids* are stable: the slot keeps its id
and the old segment is *retired* (unlinked, and its name queued so the workers can unmap it). The
new segment is made at once (``resize``) or reserved a part at a time (``begin_resize``, then
``reserve`` until it returns True), so that the main process can see to its workers' replies
between the parts (issue 16). ``resize`` also gives a taken slot far larger than its task asks a
smaller segment (``Ring.take``, after the iterator lowered the ask: ``engine/slot_size.py``).

Promises: each transition refuses (``SlotOwnershipError``) a slot that the named task does not
hold as assigned; until every byte is reserved the new segment stays the slot's ``growing``
segment, which no worker is told of, no pin backend sees, and ``Ring.free`` and ``Ring.close``
unlink like the others; a reservation that fails drops it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from shmloader.transport.segment import Segment
from shmloader.transport.shm_space import explain_enospc
from shmloader.transport.slot import Slot, SlotState


class _Ring(Protocol):
    """What ``SlotGrowth`` uses of the ring it is mixed into (its own methods included)."""

    shm_dir: str

    def _check(self, slot: Slot, owner: Hashable, action: str, *states: SlotState) -> None: ...

    def _new_segment(self, min_bytes: int, reserve: bool = True) -> Segment: ...

    def _created(self, segment: Segment) -> None: ...

    def _retire(self, segment: Segment, told: bool = True, hook: bool = True) -> None: ...

    def _drop_growing(self, slot: Slot) -> None: ...

    def abandon_resize(self, slot: Slot, owner: Hashable) -> None: ...


class SlotGrowth:
    """The ring's methods that give an assigned slot a larger segment (a mixin of ``Ring``)."""

    def resize(self: _Ring, slot: Slot, min_bytes: int, owner: Hashable) -> None:
        """Give an assigned slot a new segment of at least ``min_bytes`` (the batch did not fit, or
        the slot is over ``SHRINK`` x what its task asks: ``Ring.take``)."""
        self._check(slot, owner, "resize", SlotState.ASSIGNED)
        old = slot.segment
        slot.segment = self._new_segment(min_bytes)
        self._retire(old)

    def begin_resize(self: _Ring, slot: Slot, min_bytes: int, owner: Hashable) -> None:
        """Start giving an assigned slot a larger segment: made now, its bytes reserved by ``reserve``."""
        self._check(slot, owner, "resize", SlotState.ASSIGNED)
        self.abandon_resize(slot, owner)  # none in practice: a task is re-sent before it can grow again
        slot.growing = self._new_segment(min_bytes, reserve=False)

    def reserve(self: _Ring, slot: Slot, owner: Hashable, nbytes: int) -> bool:
        """Reserve up to ``nbytes`` more of the slot's growing segment; once every byte is, it replaces
        the slot's segment (the old one retired) and this returns True. A reservation that fails
        (a full directory: ShmSpaceError) drops the growing segment."""
        self._check(slot, owner, "resize", SlotState.ASSIGNED)
        segment = slot.growing
        if segment is None:
            return True
        try:
            with explain_enospc(self.shm_dir, segment.size_bytes):
                if not segment.reserve(nbytes):
                    return False
            self._created(segment)
        except BaseException:
            self._drop_growing(slot)
            raise
        slot.growing = None
        old, slot.segment = slot.segment, segment
        self._retire(old)
        return True

    def abandon_resize(self: _Ring, slot: Slot, owner: Hashable) -> None:
        """Drop the slot's growing segment, if any (its task will not be sent again)."""
        self._check(slot, owner, "abandon the growth of", SlotState.ASSIGNED)
        self._drop_growing(slot)

    def _drop_growing(self: _Ring, slot: Slot) -> None:
        """Unlink the slot's growing segment, if any: no worker was told of it, no pin backend saw it."""
        if slot.growing is not None:
            segment, slot.growing = slot.growing, None
            self._retire(segment, told=False, hook=False)
