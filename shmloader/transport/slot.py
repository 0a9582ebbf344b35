"""A slot of the ring: its stable id, its current segment, its state and its owner.

Owns nothing but these fields; the ring (``transport/ring.py``) and a slot's growth
(``transport/ring_growth.py``) are the only code that changes them, each transition checked
against the owner (``Ring._check``). Runs in the main process.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

from shmloader.transport.segment import Segment


class SlotState(enum.Enum):
    FREE = "free"
    ASSIGNED = "assigned"
    FILLED = "filled"
    LEASED = "leased"


@dataclass(eq=False)
class Slot:
    """One reusable region: a slot id, its current segment, its state and, while it is assigned or
    filled, the task that owns it (the ledger's key). A ``spent`` slot is free but its segment is
    retired (another's fork may still map it): ``take`` gives it a fresh one first."""

    id: int
    segment: Segment
    state: SlotState = SlotState.FREE
    owner: Hashable | None = None
    lease_serial: int = 0
    growing: Segment | None = None  # the larger segment being reserved for the owner (begin_resize)
    spent: bool = False
    used_bytes: int = 0  # while filled or leased: the bytes its batch occupies from the start (Ring.fill)

    @property
    def size_bytes(self) -> int:
        return self.segment.size_bytes
