"""Pre-flight: will the ring fit in the shared-memory directory?

Runs in the main process before a ring is created or its slots grow. Promises a clear
``ShmSpaceError`` (bytes needed, bytes free, remedies) instead of a worker's SIGBUS later, up
front, by comparing the ring's size with the directory's free space. The same error at creation
time (a full directory while a segment reserves its pages) comes from
``shm_space.explain_enospc``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shmloader.transport import shm_space

if TYPE_CHECKING:
    from shmloader.transport.ring import Ring

__all__ = ["CONSUMER_SLOTS", "check_ring_fits", "ring_slots"]

CONSUMER_SLOTS = 2  # slots the consumer may hold beyond the pipeline before the ring grows past it


def ring_slots(num_workers: int, prefetch_factor: int) -> int:
    """The slots a loader needs in steady state: its pipeline plus what the consumer holds."""
    return max(num_workers, 1) * prefetch_factor + CONSUMER_SLOTS


_GIVEN = " (slot_bytes=, SHMLOADER_SLOT_BYTES)"


def check_ring_fits(ring: Ring, slot_bytes: int, slots: int, *, num_workers: int, prefetch_factor: int,
                    given: bool = False) -> None:  # fmt: skip
    """Raise ShmSpaceError unless ``slots`` slots of ``slot_bytes`` fit beside what the ring holds;
    ``given``: the size is the user's ``slot_bytes`` (the message names it), not a measured batch's.

    A slot already that large (or growing to that size) is reused; every other one (and a spent
    one: ``ring.Slot``) needs a new segment, and the segment it replaces frees its pages only once
    no process maps it (workers unmap it when told), so its bytes are not counted as coming back. The bytes of growing
    segments not reserved yet are needed too.
    """
    free = shm_space.shm_free_bytes(ring.shm_dir)
    if free is None:
        return
    growing = [s.growing for s in ring.slots if s.growing is not None]
    reused = min(slots, sum(1 for s in ring.slots if not s.spent  # a spent slot needs a fresh segment
                            and max(s.size_bytes, s.growing.size_bytes if s.growing else 0) >= slot_bytes))
    needed = (slots - reused) * slot_bytes + sum(g.size_bytes - g.reserved for g in growing)
    if needed <= free:
        return
    raise shm_space.space_error(ring.shm_dir, needed, free,
                      f"the slot ring ({slots} slots of {slot_bytes} bytes{_GIVEN if given else ''}: "
                      f"num_workers={num_workers} x "
                      f"prefetch_factor={prefetch_factor} + {CONSUMER_SLOTS} held by the consumer)")
