"""The fake pin backend: the hardware path of the GPU handoff, run on a CPU in CI.

Owns :class:`FakeBackend`, which implements both :class:`~shmloader.gpu.backends.PinBackend` and
:class:`~shmloader.gpu.backends.Transfer` (as httpx's mock transport stands in for the network):
it records every call in order, with the process that made it and whether the segment was still
mapped, and hands out :class:`FakeEvent` objects that complete only when told to (or at once, with
``auto_complete``). Its "device copy" clones every array, so a moved batch shares no memory with
its slot, exactly as a copy to a GPU would not.

Runs in the main process (select it with ``SHMLOADER_PIN_BACKEND=fake``, or pass an instance as
``to_device(..., transfer=)``). Like every backend it belongs to the process that created it
(``gpu.owned``): a call from another process does nothing — and is still recorded, with that
process's pid and ``inert=True``, so a test can prove no such call was even attempted. Calls made
in a forked worker land in the worker's copy of ``calls``; give the backend a ``journal`` (a file
path) to see them from the test: every call is also appended there, one line each, by whichever
process makes it (:func:`read_journal`).

Promises: ``calls`` is the true order of registrations, unregistrations, fences, copies and waits;
registering a segment twice, or unregistering one that was never registered or is no longer
mapped, raises AssertionError (the bug the tests look for).
"""

from __future__ import annotations

import itertools
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmloader.gpu.backends import segment_address
from shmloader.gpu.batch_tree import iter_leaves, map_batch
from shmloader.gpu.owned import Owned, owner_only
from shmloader.owner import ProcessOwner
from shmloader.transport.segment import PAGE_BYTES, Segment

__all__ = ["Call", "FakeBackend", "FakeEvent", "read_journal"]

# method name -> the kind a Call records
_KINDS = {"register_segment": "register", "unregister_segment": "unregister", "fence": "fence",
          "new_stream": "stream", "copy": "copy", "wait": "wait"}


@dataclass(eq=False)
class FakeEvent(Owned):
    """A device event that completes when the test says so (or when synchronized); like a real
    one it answers only in the process that made it (``query`` is True, ``synchronize`` a no-op,
    elsewhere)."""

    serial: int
    done: bool = False
    synchronized: bool = False
    _owner: ProcessOwner = field(default_factory=ProcessOwner, repr=False)

    @owner_only(True)
    def query(self) -> bool:
        return self.done

    @owner_only()
    def synchronize(self) -> None:
        self.synchronized = True
        self.done = True

    def complete(self) -> None:
        self.done = True


@dataclass(frozen=True)
class Call:
    """One recorded call: what, on which segment (or event serial), by which pid, mapped or not,
    and whether it was refused as coming from a process that does not own the backend."""

    kind: str
    target: str
    pid: int
    mapped: bool = True
    inert: bool = False


def read_journal(path: str) -> list[Call]:
    """The calls a backend with ``journal=path`` recorded, from every process, in order."""
    try:
        with open(path, encoding="utf-8") as journal:
            lines = journal.read().splitlines()
    except FileNotFoundError:
        return []
    calls = []
    for line in lines:
        kind, target, pid, mapped, inert = line.split("\t")
        calls.append(Call(kind, target, int(pid), mapped == "1", inert == "1"))
    return calls


@dataclass(eq=False)
class FakeBackend(Owned):
    """Records pin calls; fake streams and events drive the prefetcher without a device."""

    auto_complete: bool = False
    fences_done: bool = True  # a fence completes at once ("the device is idle") unless set False
    name: str = "fake"
    device_pinned: bool = True
    journal: str | None = None  # a file every process appends its calls to (see read_journal)
    calls: list[Call] = field(default_factory=list)
    registered: dict[str, int] = field(default_factory=dict)
    events: list[FakeEvent] = field(default_factory=list)
    fences: list[FakeEvent] = field(default_factory=list)
    sources: list[list[weakref.ref[Any]]] = field(default_factory=list)
    finished: int = 0
    _serial: Any = field(default_factory=itertools.count)
    _owner: ProcessOwner = field(default_factory=ProcessOwner, repr=False)

    def _record(self, kind: str, target: str, mapped: bool = True, inert: bool = False) -> None:
        call = Call(kind, target, os.getpid(), mapped, inert)
        self.calls.append(call)
        if self.journal is not None:
            line = f"{call.kind}\t{call.target}\t{call.pid}\t{int(call.mapped)}\t{int(call.inert)}\n"
            fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())  # one O_APPEND write: whole lines from every process
            finally:
                os.close(fd)

    def _foreign_call(self, method: str, args: tuple[Any, ...]) -> None:
        """A call refused in a process that does not own this backend: recorded, marked inert."""
        target = getattr(args[0], "name", "") if args else ""
        self._record(_KINDS.get(method, method), str(target), inert=True)

    # -- PinBackend ---------------------------------------------------------------------------
    @owner_only()
    def register_segment(self, segment: Segment) -> None:
        if segment.name in self.registered:
            raise AssertionError(f"segment {segment.name} registered twice")
        address = segment_address(segment)
        if address % PAGE_BYTES:
            raise AssertionError(f"segment {segment.name} is not page-aligned: {address:#x}")
        self.registered[segment.name] = address
        self._record("register", segment.name)

    @owner_only()
    def unregister_segment(self, segment: Segment) -> None:
        mapped = not segment.buf.closed
        self._record("unregister", segment.name, mapped)
        if self.registered.pop(segment.name, None) is None:
            raise AssertionError(f"segment {segment.name} unregistered but never registered")
        if not mapped:
            raise AssertionError(f"segment {segment.name} unregistered after it was unmapped")

    def finish(self, batch: Any) -> Any:
        self.finished += 1
        return batch

    @owner_only()
    def fence(self) -> FakeEvent:
        """A release fence: done at once with ``fences_done``, else when the test completes it."""
        event = FakeEvent(next(self._serial), done=self.fences_done, _owner=self._owner)
        self.fences.append(event)
        self._record("fence", str(event.serial))
        return event

    def count(self, kind: str, target: str | None = None) -> int:
        return sum(1 for c in self.calls if c.kind == kind and (target is None or c.target == target))

    # -- Transfer -----------------------------------------------------------------------------
    @owner_only(refuse=True)
    def new_stream(self, device: str) -> str:
        self._record("stream", device)
        return f"fake-stream:{device}"

    @owner_only(refuse=True)
    def copy(self, batch: Any, device: str, stream: Any, non_blocking: bool) -> tuple[Any, FakeEvent]:
        event = FakeEvent(next(self._serial), done=self.auto_complete, _owner=self._owner)
        self.events.append(event)
        self.sources.append([weakref.ref(x) for x in iter_leaves(batch) if isinstance(x, np.ndarray)])
        self._record("copy", str(event.serial))
        return map_batch(batch, _clone), event

    @owner_only()
    def wait(self, moved: Any, event: Any, device: str) -> None:
        self._record("wait", str(getattr(event, "serial", event)))


def _clone(leaf: Any) -> Any:
    """A copy that shares no memory with the slot (a tensor for a numpy array when torch is here)."""
    if isinstance(leaf, np.ndarray):
        if leaf.dtype.hasobject:
            return leaf
        try:
            import torch
        except ImportError:
            return leaf.copy()
        try:
            return torch.from_numpy(leaf).clone()
        except TypeError:  # a dtype torch has no type for
            return leaf.copy()
    clone = getattr(leaf, "clone", None)
    return clone() if callable(clone) else leaf
