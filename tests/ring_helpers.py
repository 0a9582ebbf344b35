"""Driving a ``Ring`` by hand in tests: one owner name for every slot, and a lease in one step."""

from __future__ import annotations

import ctypes
from typing import Any

from shmloader.transport.ring import Ring, SlotState

OWNER = (0, 0)  # the (epoch, task) the engine's ledger would name; any hashable will do


def leased(ring: Ring, slot: Any) -> ctypes.Array:
    """Fill the slot (if the test has not) and lease it, as the ledger does for a batch."""
    if slot.state is SlotState.ASSIGNED:
        ring.fill(slot, OWNER)
    return ring.lease(slot, OWNER)
