"""The ledger: the one record of every task in flight, and the only code that moves its slot.

Owns one ``TaskRecord`` per dispatched task, keyed by ``(epoch, task)``, and each record's hold on
its slot. Runs in the main process. Every slot transition of the engine goes through here, and
each one names the task, so the ring checks that the task still holds the slot
(``Ring`` raises ``SlotOwnershipError`` otherwise)::

    assign ──▶ (worker writes) ──▶ fill ──▶ deliver (leased to the user: the record lets go)
       │                             │
       ├── resize (batch too big)    └── drop (abandoned epoch still in the reorder buffer)
       ├── release (failed, exhausted, stale reply)
       └── retry after a death: the record keeps its slot and goes to the successor

A resize is reserved a part at a time while the main process also sees to its workers
(``begin_resize``, then ``reserve`` until it returns True; ``abandon_resize`` or ``release`` drops it).

Promises: a record gives its slot back exactly once — after ``release``, ``deliver`` or ``drop``
it holds no slot (``slot is None``) and a second call is a no-op, never a free of a slot that a
later task now owns; a descriptor is checked against the slot its task was given before any view
is made. See docs/design/ownership.md.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Iterator
from typing import Any

from shmloader.errors import DescriptorError
from shmloader.transport.ring import Ring, Slot

Key = tuple[int, int]  # (epoch, task)


class TaskRecord:
    """One dispatched task: its number, sample indices, worker, and the slot it holds (if any).

    A plain class with ``__slots__`` and its key stored, not derived: the engine reads these
    fields a dozen times per batch (issue 16)."""

    __slots__ = ("epoch", "task", "key", "indices", "slot", "worker_id", "seed_task", "kept_by")

    def __init__(self, epoch: int, task: int, indices: Any, slot: Slot | None,
                 worker_id: int = -1) -> None:
        self.epoch = epoch
        self.task = task
        self.key: Key = (epoch, task)
        self.indices = indices
        self.slot = slot
        self.worker_id = worker_id
        self.seed_task = task  # the number per-task seeding uses (an iterable dataset's: dispatch.Dispatcher.deal)
        # the pid of the worker that keeps this task's batch for its retry in a grown slot (its
        # TooSmall: worker.main ``_remember``), 0 while none does: that worker alone can answer it
        self.kept_by = 0

    def __repr__(self) -> str:
        return f"TaskRecord(epoch={self.epoch}, task={self.task}, worker_id={self.worker_id}, slot={self.slot!r})"


class Ledger:
    """Tasks in flight and their slots, over one ring."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self._inflight: dict[Key, TaskRecord] = {}
        self._per_epoch: dict[int, int] = {}  # epoch -> tasks in flight: in_epoch() is O(1) (issue 16)

    # -- queries ---------------------------------------------------------------------------------
    def get(self, key: Key) -> TaskRecord | None:
        return self._inflight.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._inflight

    def __len__(self) -> int:
        return len(self._inflight)

    def in_epoch(self, epoch: int) -> int:
        """How many tasks of ``epoch`` are in flight."""
        return self._per_epoch.get(epoch, 0)

    def records(self, keys: Iterable[Key] | None = None) -> Iterator[TaskRecord]:
        """The records of ``keys`` (default: all) that are in flight, in the given order."""
        for key in list(self._inflight) if keys is None else keys:
            rec = self._inflight.get(key)
            if rec is not None:
                yield rec

    # -- transitions -----------------------------------------------------------------------------
    def assign(self, epoch: int, task: int, indices: Any, min_bytes: int) -> TaskRecord:
        """A new task in flight, holding a free slot of at least ``min_bytes`` (the ring grows when
        every slot is taken)."""
        key = (epoch, task)
        slot = self.ring.take(min_bytes, key) or self.ring.grow(min_bytes, key)
        rec = TaskRecord(epoch, task, indices, slot)
        self._inflight[key] = rec
        self._per_epoch[epoch] = self._per_epoch.get(epoch, 0) + 1
        return rec

    def begin_resize(self, rec: TaskRecord, min_bytes: int) -> None:
        """The batch did not fit: the task's slot starts growing (its bytes reserved by ``reserve``)."""
        self.ring.begin_resize(self._slot(rec), min_bytes, rec.key)

    def reserve(self, rec: TaskRecord, nbytes: int) -> bool:
        """Reserve up to ``nbytes`` more of the task's growing slot; True once it has its new size."""
        return self.ring.reserve(self._slot(rec), rec.key, nbytes)

    def abandon_resize(self, rec: TaskRecord) -> None:
        """Drop the task's growing segment, if it still holds a slot."""
        if rec.slot is not None:
            self.ring.abandon_resize(rec.slot, rec.key)

    def fill(self, rec: TaskRecord, slot_id: int, used_bytes: int = -1) -> int:
        """The worker wrote the batch, in the first ``used_bytes`` of the slot (-1: not said, all of
        them); returns those bytes. The reply's slot id must be the task's slot."""
        slot = self._slot(rec)
        if slot_id != slot.id:
            raise DescriptorError(f"task {rec.task} was given slot {slot.id}, but its worker's descriptor names "
                                  f"slot {slot_id}; nothing was viewed")
        self.ring.fill(slot, rec.key, used_bytes)
        self._forget(rec.key)
        return slot.used_bytes

    def release(self, rec: TaskRecord) -> None:
        """The task ended without a batch to view (it failed, ran out of data, or belongs to an
        abandoned epoch): its slot, if it still holds one, goes back to the ring, once."""
        self._forget(rec.key)
        if rec.slot is not None:
            slot, rec.slot = rec.slot, None
            self.ring.free(slot, rec.key)

    def deliver(self, rec: TaskRecord) -> ctypes.Array:
        """Hand a filled task's slot to the user: the returned buffer (and the views made on it)
        now hold the slot; the record holds nothing."""
        slot, rec.slot = self._slot(rec), None
        return self.ring.lease(slot, rec.key)

    def drop(self, rec: TaskRecord) -> None:
        """A filled task that will never be delivered (its epoch was abandoned): free its slot."""
        if rec.slot is not None:
            slot, rec.slot = rec.slot, None
            self.ring.free(slot, rec.key)

    # -- internals -------------------------------------------------------------------------------
    def _forget(self, key: Key) -> None:
        if self._inflight.pop(key, None) is not None:
            left = self._per_epoch[key[0]] - 1
            if left:
                self._per_epoch[key[0]] = left
            else:
                del self._per_epoch[key[0]]

    def _slot(self, rec: TaskRecord) -> Slot:
        if rec.slot is None:
            raise DescriptorError(f"task {rec.task} (epoch {rec.epoch}) holds no slot any more; nothing was viewed")
        return rec.slot
