"""The ledger and the ring's owner checks, without processes (docs/design/ownership.md).

What must hold: every slot transition names the task that holds the slot, and one by any other
party is refused before anything changes; a task record gives its slot back exactly once; a
descriptor naming another slot is refused before a view is made.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from shmloader.engine.ledger import Ledger
from shmloader.errors import DescriptorError, SlotOwnershipError
from shmloader.transport.ring import Ring, SlotState

PAGE = 4096


@pytest.fixture
def ledger(tmp_path: Any) -> Iterator[Ledger]:
    ring = Ring(str(tmp_path))
    yield Ledger(ring)
    ring.close()


def test_a_failed_task_gives_its_slot_back_once_and_never_frees_a_later_owner(ledger: Ledger) -> None:
    failed = ledger.assign(0, 0, [0, 1], PAGE)
    slot = failed.slot
    ledger.release(failed)  # the worker's Failed reply
    assert failed.slot is None and slot is not None and slot.state is SlotState.FREE
    later = ledger.assign(0, 1, [2, 3], PAGE)
    assert later.slot is slot  # the slot went to the next task
    ledger.drop(failed)  # the abandoned epoch drains the failed record: nothing happens
    ledger.release(failed)
    assert slot.state is SlotState.ASSIGNED and slot.owner == (0, 1)


def test_the_ring_refuses_a_transition_by_a_task_that_does_not_hold_the_slot(ledger: Ledger) -> None:
    ring = ledger.ring
    slot = ring.grow(PAGE, (0, 7))
    for action in (lambda: ring.free(slot, (0, 8)), lambda: ring.fill(slot, (1, 7)),
                   lambda: ring.resize(slot, 2 * PAGE, (0, 8))):
        with pytest.raises(SlotOwnershipError, match=r"slot 0 for task \(\d, \d\).*held by task \(0, 7\)"):
            action()
        assert slot.state is SlotState.ASSIGNED and slot.owner == (0, 7)  # nothing changed
    with pytest.raises(SlotOwnershipError, match="refused to lease slot 0"):
        ring.lease(slot, (0, 7))  # not filled yet
    ring.free(slot, (0, 7))
    with pytest.raises(SlotOwnershipError, match="the slot is free"):
        ring.free(slot, (0, 7))  # a second free by the same task


def test_a_descriptor_naming_another_slot_is_refused(ledger: Ledger) -> None:
    a = ledger.assign(0, 0, [0], PAGE)
    b = ledger.assign(0, 1, [1], PAGE)
    assert a.slot is not None and b.slot is not None
    with pytest.raises(DescriptorError, match=f"task 0 was given slot {a.slot.id}, but .* names slot {b.slot.id}"):
        ledger.fill(a, b.slot.id)
    assert a.slot.state is SlotState.ASSIGNED and b.slot.state is SlotState.ASSIGNED


def test_deliver_hands_the_slot_to_the_lease_and_the_record_lets_go(ledger: Ledger) -> None:
    rec = ledger.assign(0, 0, [0], PAGE)
    slot = rec.slot
    assert slot is not None
    ledger.fill(rec, slot.id)
    assert (0, 0) not in ledger and len(ledger) == 0
    buf = ledger.deliver(rec)
    assert rec.slot is None and slot.state is SlotState.LEASED and slot.owner is None
    ledger.drop(rec)  # a delivered record holds nothing to drop
    assert slot.state is SlotState.LEASED
    del buf
    gc.collect()
    assert ledger.ring.collect_released() == 1 and slot.state is SlotState.FREE


def test_in_epoch_counts_only_that_epochs_tasks(ledger: Ledger) -> None:
    ledger.assign(0, 0, [0], PAGE)
    ledger.assign(1, 0, [0], PAGE)
    ledger.assign(1, 1, [1], PAGE)
    assert (ledger.in_epoch(0), ledger.in_epoch(1), len(ledger)) == (1, 2, 3)
    assert [r.key for r in ledger.records([(1, 1), (5, 5), (0, 0)])] == [(1, 1), (0, 0)]
