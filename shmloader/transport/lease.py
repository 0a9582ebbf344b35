"""A lease: the finalizer that gives a slot back to its ring once the user's batch is gone.

Owns every lease not yet fired (``LIVE``), each a weak reference to a lease buffer (the ctypes
buffer over a whole slot that every array of a batch is a view of) with its ring's queue and the
slot's serial. Runs in the main process; the finalizer in whatever thread drops the last view.
Promises: a lease fires at most once, outlives its ring, never fires at interpreter exit, never
raises, queues its slot even when a Ctrl-C lands in it (the slot then counts as spent, and the
Ctrl-C, which Python would swallow in a weakref callback, is delivered again), and does nothing
outside the process that made it (``owner.ProcessOwner``). What it
queues says whether other code forked the process while the batch was held
(``owner.forked_since``): such a slot is *spent*, its segment retired, never written again
(``transport/ring.py``, docs/design/slot-lifecycle.md).
"""

from __future__ import annotations

import atexit
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from shmloader.log import logger
from shmloader.owner import ProcessOwner, forked_since
from shmloader.redeliver import interrupt_main_later
from shmloader.transport.segment import Segment

SegmentHook = Callable[[Segment], None]
Fence = Callable[[], Any]  # returns an event (``query()``, ``synchronize()``) or None


Released = tuple[int, int, Any, bool]  # slot id, lease serial, fence event or None, spent (forked since the lease)


def _on_release(released: deque[Released], fence: Fence | None, slot_id: int, serial: int, mark: int,
                creator: ProcessOwner, lingering: dict[int, Segment], on_retire: SegmentHook | None) -> None:
    """The lease's finalizer (any thread): queue the slot, with a fence event when pinned, and
    whether other code forked since the lease (``mark``), which spends the slot.

    Inert outside the creating process: a forked worker collecting an inherited batch must not
    record a device fence (CUDA is not initialised there) nor touch the parent's queue."""
    if not creator.here:
        return
    segment = lingering.pop(slot_id, None)
    if segment is not None:  # the ring closed while this batch was held: retire its segment now,
        try:  # while the dying lease still keeps it mapped, once a copy enqueued before the drop is done
            _fence_now(fence, slot_id)
        finally:
            retire_lingering(segment, on_retire)
        return
    event, spent = None, True  # until both are known: a release cut short retires the slot's segment
    try:
        forked = forked_since(mark)
        if fence is not None:
            try:
                event = fence()
            except Exception as exc:  # never raise in a finalizer. A copy may still read the slot: it
                # is spent, its segment retired (the pin backend waits for the device before it unpins it)
                logger.warning("could not fence slot %d after its batch was dropped: %s; its segment is "
                               "retired rather than written again", slot_id, exc)
                forked = True
        spent = forked
    finally:  # a Ctrl-C landing in here (Python swallows it in a weakref callback) still queues the slot
        released.append((slot_id, serial, event, spent))


def _fence_now(fence: Fence | None, slot_id: int) -> None:
    """Record the fence of a dropped batch whose segment goes now (not back to the ring) and wait
    for it: the pages are unpinned and unmapped next. Never raises an ``Exception``."""
    if fence is None:
        return
    try:
        event = fence()
    except Exception as exc:  # the backend's unpin is the last guard left (torch's waits for the devices)
        logger.warning("could not fence slot %d before its segment is unpinned: %s", slot_id, exc)
        return
    if event is not None:
        wait_fence(event, f"slot {slot_id}")


def wait_fence(event: Any, what: str) -> None:
    """Wait for the fence of a dropped batch before its segment is unpinned and unmapped (a device
    copy may still read it). A wait that fails is logged, never raised as an ``Exception``: the
    segment goes all the same (a Ctrl-C still propagates)."""
    try:
        event.synchronize()
    except Exception as exc:
        logger.warning("could not wait for the fence of %s before unpinning its segment: %s", what, exc)


class Lease(weakref.ref):
    """A lease's finalizer: a weak reference to its buffer whose callback runs ``_on_release``.

    Half the cost of a ``weakref.finalize`` (0.96 against 1.83 µs per lease with its buffer,
    issue 16) with its guarantees: ``LIVE`` holds it until it fires, so a lease outlives its
    ring (a segment that lingers past ``close()`` is still retired), and at interpreter exit it is
    dropped unfired, as a finalizer with ``atexit = False`` is."""

    __slots__ = ("args",)
    args: tuple

    @property
    def alive(self) -> bool:
        return self() is not None


LIVE: dict[int, Lease] = {}  # id -> every lease not yet fired


def lease_died(lease: Lease, _pop: Callable = LIVE.pop) -> None:
    """The weakref callback. A Ctrl-C that lands in it, which Python would print and swallow here,
    is delivered again a moment later (``redeliver.interrupt_main_later``): called in the callback
    itself, SIGINT's handler would run before the callback returned, and be swallowed again."""
    try:
        if _pop(id(lease), None) is not None:  # None: dropped at exit, or fired already
            _on_release(*lease.args)
    except KeyboardInterrupt:
        interrupt_main_later()


@atexit.register
def _drop_leases() -> None:
    LIVE.clear()  # as weakref.finalize does at exit: no lease fires during interpreter teardown


def retire_lingering(segment: Segment, on_retire: SegmentHook | None) -> None:
    """Unpin a segment unlinked at close() whose last view is dying, then let it unmap (the mapping
    goes when the lease's buffer does, right after its finalizer). Never raises."""
    if on_retire is not None:
        try:
            on_retire(segment)
        except Exception as exc:
            logger.warning("could not unpin segment %s after its last batch was dropped: %s", segment.name, exc)
    segment.close()
