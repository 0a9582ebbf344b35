"""The fake pin backend: the hardware path of the GPU handoff, run on a CPU in CI.

Owns :class:`FakeBackend`, which implements both :class:`~shmloader.gpu.backends.PinBackend` and
:class:`~shmloader.gpu.backends.Transfer` (as httpx's mock transport stands in for the network):
it records every call in order, with the process that made it and whether the segment was still
mapped, and hands out :class:`FakeEvent` objects that complete only when told to (or at once, with
``auto_complete``). Its "device copy" clones every array, so a moved batch shares no memory with
its slot, exactly as a copy to a GPU would not.

Runs in the main process (select it with ``SHMLOADER_PIN_BACKEND=fake``, or pass an instance as
``to_device(..., transfer=)``). Promises: ``calls`` is the true order of registrations,
unregistrations, copies and waits; registering a segment twice, or unregistering one that was
never registered or is no longer mapped, raises AssertionError (the bug the tests look for).
"""

from __future__ import annotations

import itertools
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmloader.gpu.backends import iter_leaves, map_batch, segment_address
from shmloader.transport.segment import PAGE_BYTES, Segment


@dataclass(eq=False)
class FakeEvent:
    """A device event that completes when the test says so (or when synchronized)."""

    serial: int
    done: bool = False
    synchronized: bool = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized = True
        self.done = True

    def complete(self) -> None:
        self.done = True


@dataclass(frozen=True)
class Call:
    """One recorded call: what, on which segment (or event serial), by which pid, mapped or not."""

    kind: str
    target: str
    pid: int
    mapped: bool = True


@dataclass(eq=False)
class FakeBackend:
    """Records pin calls; fake streams and events drive the prefetcher without a device."""

    auto_complete: bool = False
    fences_done: bool = True  # a fence completes at once ("the device is idle") unless set False
    name: str = "fake"
    device_pinned: bool = True
    calls: list[Call] = field(default_factory=list)
    registered: dict[str, int] = field(default_factory=dict)
    events: list[FakeEvent] = field(default_factory=list)
    fences: list[FakeEvent] = field(default_factory=list)
    sources: list[list[weakref.ref[Any]]] = field(default_factory=list)
    finished: int = 0
    _serial: Any = field(default_factory=itertools.count)

    # -- PinBackend ---------------------------------------------------------------------------
    def register_segment(self, segment: Segment) -> None:
        if segment.name in self.registered:
            raise AssertionError(f"segment {segment.name} registered twice")
        address = segment_address(segment)
        if address % PAGE_BYTES:
            raise AssertionError(f"segment {segment.name} is not page-aligned: {address:#x}")
        self.registered[segment.name] = address
        self.calls.append(Call("register", segment.name, os.getpid()))

    def unregister_segment(self, segment: Segment) -> None:
        mapped = not segment.buf.closed
        self.calls.append(Call("unregister", segment.name, os.getpid(), mapped))
        if self.registered.pop(segment.name, None) is None:
            raise AssertionError(f"segment {segment.name} unregistered but never registered")
        if not mapped:
            raise AssertionError(f"segment {segment.name} unregistered after it was unmapped")

    def finish(self, batch: Any) -> Any:
        self.finished += 1
        return batch

    def fence(self) -> FakeEvent:
        """A release fence: done at once with ``fences_done``, else when the test completes it."""
        event = FakeEvent(next(self._serial), done=self.fences_done)
        self.fences.append(event)
        self.calls.append(Call("fence", str(event.serial), os.getpid()))
        return event

    def count(self, kind: str, target: str | None = None) -> int:
        return sum(1 for c in self.calls if c.kind == kind and (target is None or c.target == target))

    # -- Transfer -----------------------------------------------------------------------------
    def new_stream(self, device: str) -> str:
        self.calls.append(Call("stream", device, os.getpid()))
        return f"fake-stream:{device}"

    def copy(self, batch: Any, device: str, stream: Any, non_blocking: bool) -> tuple[Any, FakeEvent]:
        event = FakeEvent(next(self._serial), done=self.auto_complete)
        self.events.append(event)
        self.sources.append([weakref.ref(x) for x in iter_leaves(batch) if isinstance(x, np.ndarray)])
        self.calls.append(Call("copy", str(event.serial), os.getpid()))
        return map_batch(batch, _clone), event

    def wait(self, moved: Any, event: Any, device: str) -> None:
        self.calls.append(Call("wait", str(getattr(event, "serial", event)), os.getpid()))


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
