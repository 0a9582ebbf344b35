"""A Ctrl-C that lands while a dropped batch's slot goes back to its ring loses no slot.

Python raises a Ctrl-C at the next bytecode boundary of the main thread, wherever that is: inside
the lease's finalizer (a weakref callback, where Python would print and swallow it: it is delivered
again), or inside
``Ring.collect_released`` between taking a release off its queue and freeing the slot. Either
way the slot must come back to the ring, not stay leased for good (with ``max_slots`` the ring
would then run out of slots for the rest of the job)."""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
from ring_helpers import OWNER, leased

from shmloader.transport import lease as lease_module
from shmloader.transport.ring import Ring, SlotState

PAGE = 4096


def _interrupt_once(real: Any) -> Any:
    """``real``, but its first call raises KeyboardInterrupt first (a Ctrl-C landing at its start)."""
    calls: list[int] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return wrapped


def _run_until_interrupted(deadline_s: float) -> None:
    """Keep the main thread running Python (where a pending SIGINT handler runs) until the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        pass


@pytest.mark.timeout(30)
def test_a_ctrl_c_in_the_lease_finalizer_gives_the_slot_back_and_is_delivered_again(tmp_path: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ring = Ring(str(tmp_path), max_slots=1)
    try:
        slot = ring.grow(PAGE, OWNER)
        buf = leased(ring, slot)
        monkeypatch.setattr(lease_module, "forked_since", _interrupt_once(lease_module.forked_since))
        unraisable: list[Any] = []
        monkeypatch.setattr("sys.unraisablehook", unraisable.append)
        with pytest.raises(KeyboardInterrupt):  # Python would swallow it in the callback: delivered again
            del buf  # the finalizer runs here, and the Ctrl-C lands in it
            gc.collect()
            _run_until_interrupted(10.0)
        assert unraisable == []
        assert ring.collect_released() == 1 and slot.state is SlotState.FREE
        assert ring.grow(PAGE, OWNER) is slot  # at max_slots: the same slot again, no RingExhausted
    finally:
        ring.close()


@pytest.mark.timeout(30)
def test_a_ctrl_c_in_collect_released_loses_no_slot(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ring = Ring(str(tmp_path), max_slots=1)
    try:
        slot = ring.grow(PAGE, OWNER)
        buf = leased(ring, slot)
        del buf
        gc.collect()
        monkeypatch.setattr(ring, "_free_cooled", _interrupt_once(ring._free_cooled))
        with pytest.raises(KeyboardInterrupt):
            ring.collect_released()
        assert ring.collect_released() == 1 and slot.state is SlotState.FREE
        assert ring.grow(PAGE, OWNER) is slot
    finally:
        ring.close()

