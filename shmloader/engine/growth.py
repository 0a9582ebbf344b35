"""Slots that grow a part at a time, while the main process keeps seeing to its workers (issue 16).

Owns the tasks whose batch did not fit their slot and whose larger segment is being reserved:
each waits here, held by no worker, from its ``TooSmall`` reply until every byte of its new
segment is reserved (``posix_fallocate``, kept so that a full shm directory is an error in the
main process, never a SIGBUS in a worker); then the engine sends it again, to the same worker.
Runs in the main process; ``engine.wait`` drives it whenever the main process would otherwise
block waiting for replies.

Why parts: a 64 MiB batch needs an 80 MiB slot, whose reservation takes tens of milliseconds,
and at start every task in flight grows at once. Reserved in one call each, those reservations
held up the first batch long after it was ready; in parts of ``CHUNK_BYTES``, the earliest task
first, the engine delivers a batch that became due within one part.

How large slots are asked to be, and when that size comes down again, is ``engine/slot_size.py``'s.

Promises: the earliest task (epoch, task) grows first; a task is handed back exactly once, by
``step`` when its slot has grown, or by ``abandon`` with its growth dropped — never both; a growing
segment is named to no worker before it is whole (the ring keeps it apart: ``Slot.growing``).
"""

from __future__ import annotations

from bisect import insort
from operator import attrgetter

from shmloader.engine.ledger import Ledger, TaskRecord

__all__ = ["CHUNK_BYTES", "Growths", "Refused"]

CHUNK_BYTES = 2 << 20  # about half a millisecond of posix_fallocate on tmpfs: the longest a due batch waits
_by_key = attrgetter("key")


class Refused:
    """A task whose slot could not grow (no room in the shm directory): its outcome in the reorder
    buffer, its error raised in place of its batch when it is due. It breaks the loader, but only
    then: the batches due before it, some still in flight when it was refused, come first."""

    __slots__ = ("_error",)

    def __init__(self, error: BaseException) -> None:
        self._error: BaseException | None = error

    def take(self) -> BaseException:
        """The error, once: this outcome holds it no more, so the frames its raise passes through,
        which hold this outcome, do not make a cycle with it (shmloader/kept.py)."""
        error, self._error = self._error, None
        if error is None:
            raise RuntimeError("a refused growth's error was taken twice")
        return error


class Growths:
    """The tasks whose slot is growing, earliest first."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self.waiting: list[TaskRecord] = []  # read it (a cheap test on the hot path), change it through the methods

    def start(self, rec: TaskRecord, min_bytes: int) -> None:
        """The task's batch did not fit: its slot starts growing to ``min_bytes``; it waits here."""
        self._ledger.begin_resize(rec, min_bytes)
        insort(self.waiting, rec, key=_by_key)

    def step(self) -> TaskRecord | None:
        """Reserve the next part of the earliest task's slot; returns that task once its slot has
        its new size (it leaves this set: send it), else None. Raises ShmSpaceError when the
        directory is full (the task stays here, its growth dropped: take it out with ``refuse``)."""
        rec = self.waiting[0]
        if not self._ledger.reserve(rec, CHUNK_BYTES):
            return None
        del self.waiting[0]
        return rec

    def refuse(self) -> TaskRecord:
        """``step`` raised: the earliest task leaves this set, its growth dropped, its slot as it was."""
        return self.waiting.pop(0)

    def abandon(self) -> list[TaskRecord]:
        """Drop every growth (an abandoned epoch); returns the tasks, each still holding its slot."""
        waiting, self.waiting = self.waiting, []
        for rec in waiting:
            self._ledger.abandon_resize(rec)
        return waiting
