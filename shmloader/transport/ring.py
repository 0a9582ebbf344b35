"""The slot ring: every segment the loader creates, and each slot's state.

Owns every segment of one loader and each slot's state::

    free ──take──▶ assigned (a worker writes it) ──fill──▶ filled (main, in flight)
      ▲                                                       │ lease
      └──────── the last view of the batch is collected ◀── leased (the user)

Runs in the main process only. Promises: one owner per slot at a time, checked on every
transition: ``take``/``grow`` name the task that now owns the slot, and ``fill``, ``lease``,
``resize`` and ``free`` refuse (``SlotOwnershipError``) a slot that the named task does not hold,
so a stale or doubled free can never hand a slot that another task is writing to a third. A slot
is never handed out while a view of its previous batch is alive; ``close()`` unlinks every
segment, and a segment the user still views stays mapped until the last view dies. The engine's
ledger (``shmloader.engine.ledger``) is the only caller of the transitions. Slot *ids* are stable; a slot that is too
small gets a new, larger segment, at once or a part at a time (``transport/ring_growth.py``).

A lease is a ctypes buffer over the whole slot. Every array of the batch is a numpy view whose
base is that buffer, so the buffer (and with it the slot) lives exactly as long as the last view;
a weak reference to it (``transport.lease.Lease``, kept alive by that module until it fires,
whatever becomes of the ring) queues the slot id for release. The queue is a deque because the finalizer may run in
any thread; the iterator drains it (``collect_released``) before it dispatches.
The finalizer, ``close()`` and segment retirement act only in the process that made the ring
(``owner.ProcessOwner``): a forked worker that garbage-collects an inherited copy does nothing.

A batch held while other code forks the process (``multiprocessing`` under fork passing it to a
child) is the child's too, and MAP_SHARED: its slot must never be written again. Each lease notes
``owner.fork_mark()``; if a fork by other code may have come between the lease and its release
(``owner.forked_since``), the slot is *spent* when released: its segment is retired (the child
keeps its own mapping of it) and ``take`` gives the slot a fresh one. Our own workers' forks do
not count. Slot ids, slot counts and ``max_slots`` are as before; ``created_total`` counts the
fresh segments.

Pinned slots may still be read by a device copy when their last view dies (``x.to("cuda",
non_blocking=True)`` then dropping ``x``). With a ``fence`` (the pin backend's), the finalizer also
records an event on the dropping thread's current stream; the slot *cools* (stays leased) until
that event has completed, and only then is free. Past ``max_slots`` the ring waits for the oldest
fence instead of raising. A segment retired instead (``close()``, or a batch held past it) is
unpinned only once the fences of the batches dropped from it have completed.

A batch the user keeps (``list(loader)``) should cost about its own bytes in the shm directory, as
torch's does (each of its batches is in shared memory of its own size), not a slot as large as the
largest batch yet. So when the ring must grow past ``whole_slots`` (its steady size, which the
iterator sets: the pipeline and the batch in use), each slot the user holds is *trimmed* first: the pages past the bytes its batch occupies (``fill``'s ``used_bytes``) go back
to the directory (``Segment.trim``). A trimmed slot is spent when released, as above: nothing
writes its unreserved pages, ever; ``take`` gives it a fresh, wholly reserved segment. Not in a
pinned ring, whose pages the pin backend holds.

Once the user drops held batches, the ring keeps segments for its steady size and one spare free
slot, beside the slots in use: a slot released past that is spent at once, wherever it sits, and
``shrink_to`` compacts the ring at a persistent loader's next epoch (``transport/ring_reclaim.py``).
``take`` hands out a free slot that has a segment before a spent one.

Slots follow the size tasks ask down as well as up: ``take`` renews a free slot over ``SHRINK`` x
the ask (or spent) at the ask, so once the iterator lowers the ask after an outlier batch
(``engine/slot_size.py``: only when the recent batches are all well below it) its slots go as
their next tasks take them. Only free slots are renewed: never one a task or a view holds.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Hashable
from typing import Any

from shmloader.caches import remember
from shmloader.errors import RingExhausted, ShmSpaceError, SlotOwnershipError
from shmloader.kept import call_each
from shmloader.owner import ProcessOwner, fork_mark
from shmloader.transport.lease import (LIVE, Fence, Lease, Released, SegmentHook, lease_died, retire_lingering,
                                        wait_fence)
from shmloader.transport.ring_growth import SlotGrowth
from shmloader.transport.ring_reclaim import SHRINK, SlotReclaim
from shmloader.transport.segment import Segment, page_round
from shmloader.transport.shm_space import explain_enospc, held_space_error
from shmloader.transport.slot import Slot, SlotState

__all__ = ["SHRINK", "Ring", "Slot", "SlotState"]


class Ring(SlotGrowth, SlotReclaim):
    """A growable ring of slots backed by shared-memory segments of one shm directory; a slot's
    growth is ``SlotGrowth``'s (``transport/ring_growth.py``), giving back the segments of slots
    the ring no longer needs ``SlotReclaim``'s (``transport/ring_reclaim.py``)."""

    def __init__(
        self,
        shm_dir: str,
        *,
        max_slots: int = 0,
        on_create: SegmentHook | None = None,
        on_retire: SegmentHook | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.shm_dir = shm_dir
        self.max_slots = max_slots
        self.slots: list[Slot] = []
        self._free: deque[int] = deque()  # slots with a segment on the left (last freed first), spent ones on the right
        self._spent: set[int] = set()  # ids of the free slots whose segment is retired (Slot.spent)
        self._released: deque[Released] = deque()
        self._cooling: deque[tuple[Slot, int, Any, bool]] = deque()  # dropped, fence not yet completed
        self._fence = fence
        self._on_create = on_create
        self._on_retire = on_retire
        self.retired_names: list[str] = []
        self.created_total = 0
        self.closed = False
        self._creator = ProcessOwner()
        self._leases: dict[int, Lease] = {}  # slot id -> its latest lease's finalizer
        self._untrimmed: dict[int, Slot] = {}  # leased slots not trimmed yet (_trim_held), by id
        self.whole_slots = 0  # the ring grows to this many slots before it trims held ones
        self._buffer_types: dict[int, type[ctypes.Array]] = {}  # size -> ctypes.c_char * size (caches.remember)
        self._lingering: dict[int, Segment] = {}  # unlinked at close, retired when the lease dies

    # -- counts --------------------------------------------------------------------------
    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.slots if s.state is state)

    def has_room(self) -> bool:
        """Whether ``take`` or ``grow`` can give a slot at once, without waiting for a fence or
        raising RingExhausted: the ring is below ``max_slots`` (or has none), or a slot is free
        once the released ones are collected."""
        if not self.max_slots or len(self.slots) < self.max_slots:
            return True
        self.collect_released()
        return bool(self._free)

    # -- slot life cycle -----------------------------------------------------------------
    def take(self, min_bytes: int, owner: Hashable) -> Slot | None:
        """A free slot of at least ``min_bytes`` (resized, or renewed if spent, as needed), now
        assigned to ``owner``; None if none is free. If the new segment cannot be made, the slot
        stays free and the error propagates."""
        self.collect_released()
        if not self._free:
            return None
        slot = self.slots[self._free.popleft()]
        slot.state, slot.owner = SlotState.ASSIGNED, owner
        try:
            if slot.spent:
                self._renew(slot, min_bytes)
            elif slot.size_bytes < min_bytes:
                self.resize(slot, min_bytes, owner)
            elif slot.size_bytes > SHRINK * min_bytes:
                self._shrink(slot, min_bytes, owner)
        except BaseException:
            self._make_free(slot)  # free again, on its side of the free list
            raise
        return slot

    def grow(self, min_bytes: int, owner: Hashable) -> Slot:
        """Add a new slot, assigned to ``owner`` at once. Past ``max_slots`` wait for the oldest
        cooling slot's fence; with none cooling, raise RingExhausted."""
        if self.max_slots and len(self.slots) >= self.max_slots:
            self.collect_released()  # a batch dropped since take() looked (a thread, a GC pass) cools too
            while self._cooling and not self._free:
                self._cool_oldest()
            slot = self.take(min_bytes, owner)
            if slot is not None:
                return slot
            leased = self.count(SlotState.LEASED)
            raise RingExhausted(
                f"the slot ring reached max_slots={self.max_slots} and every slot is in use "
                f"({leased} leased by batches the caller still holds). Drop references to old "
                "batches, or raise max_slots (SHMLOADER_MAX_SLOTS; 0 = no limit)."
            )
        self._trim_held()
        try:
            segment = self._new_segment(min_bytes)
        except ShmSpaceError as exc:
            held = self.count(SlotState.LEASED)
            if held:
                raise held_space_error(exc, len(self.slots), held) from exc
            raise
        try:
            slot = Slot(len(self.slots), segment, SlotState.ASSIGNED, owner)
            self.slots.append(slot)
        except BaseException:  # a Ctrl-C before the slot is in the ring: only the pin backend saw it
            if not self.slots or self.slots[-1].segment is not segment:
                self._retire(segment, told=False)
            raise
        return slot

    def fill(self, slot: Slot, owner: Hashable, used_bytes: int = -1) -> None:
        """The worker wrote ``owner``'s batch in the slot's first ``used_bytes`` (-1: not said, all of
        them): the slot is in flight to the user."""
        self._check(slot, owner, "fill", SlotState.ASSIGNED)
        slot.state = SlotState.FILLED
        slot.used_bytes = slot.size_bytes if used_bytes < 0 else min(used_bytes, slot.size_bytes)

    def lease(self, slot: Slot, owner: Hashable) -> ctypes.Array:
        """Hand ``owner``'s filled slot to the user: a buffer whose collection returns the slot."""
        self._check(slot, owner, "lease", SlotState.FILLED)
        slot.state, slot.owner = SlotState.LEASED, None
        slot.lease_serial += 1
        size = slot.size_bytes
        kind = self._buffer_types.get(size) or remember(self._buffer_types, size, ctypes.c_char * size)
        mark = fork_mark()  # before the buffer exists: a fork from now on is one the batch may be in
        buf = kind.from_buffer(slot.segment.buf)
        lease = Lease(buf, lease_died)
        lease.args = (self._released, self._fence, slot.id, slot.lease_serial, mark, self._creator, self._lingering,
                      self._on_retire)
        LIVE[id(lease)] = self._leases[slot.id] = lease
        self._untrimmed[slot.id] = slot
        return buf

    def free(self, slot: Slot, owner: Hashable) -> None:
        """Return ``owner``'s slot, which no view references (failed, stale or empty task), to the ring."""
        self._check(slot, owner, "free", SlotState.ASSIGNED, SlotState.FILLED)
        self._drop_growing(slot)  # its task ended while the slot grew: the growth is not needed
        self._make_free(slot)

    def _check(self, slot: Slot, owner: Hashable, action: str, *states: SlotState) -> None:
        """Refuse a transition by a party that does not hold the slot (docs/design/ownership.md)."""
        if slot.owner != owner or slot.state not in states or self.slots[slot.id] is not slot:
            raise SlotOwnershipError(
                f"refused to {action} slot {slot.id} for task {owner!r}: the slot is {slot.state.value}"
                + (f" and held by task {slot.owner!r}" if slot.owner is not None else "")
                + " (an engine bug: please report it with this message)")

    def _make_free(self, slot: Slot) -> None:
        """Free the slot: ``take`` hands out a slot that has a segment before one that needs a fresh one."""
        slot.state, slot.owner = SlotState.FREE, None
        if slot.spent:
            self._free.append(slot.id)
        else:
            self._free.appendleft(slot.id)

    def collect_released(self) -> int:
        """Move slots whose last view died, and whose fence has completed, back to free; returns
        how many."""
        n = 0
        while self._released:  # each taken off only once handled: a Ctrl-C in between loses no slot
            slot_id, serial, event, spent = self._released[0]  # (handled twice, a release is stale: no-op)
            if slot_id < len(self.slots):
                if event is None:  # unpinned (or unfenced): free at once
                    n += self._free_cooled(self.slots[slot_id], serial, spent)
                else:
                    self._cooling.append((self.slots[slot_id], serial, event, spent))
            self._released.popleft()
        if self._cooling:
            still: deque[tuple[Slot, int, Any, bool]] = deque()
            for cooling in self._cooling:
                if cooling[2].query():
                    n += self._free_cooled(cooling[0], cooling[1], cooling[3])
                else:
                    still.append(cooling)
            self._cooling = still
        return n

    @property
    def cooling(self) -> int:
        """Slots whose batch was dropped but whose fence has not completed yet."""
        return len(self._cooling)

    def _cool_oldest(self) -> None:
        """Wait for the oldest cooling slot's fence and free it. It leaves the queue only once the
        wait returned: a Ctrl-C (raised as the wait returns) or a device error keeps it cooling, in
        the ring, rather than lost to it for good."""
        slot, serial, event, spent = self._cooling[0]
        event.synchronize()
        self._cooling.popleft()
        self._free_cooled(slot, serial, spent)

    def _free_cooled(self, slot: Slot, serial: int, spent: bool) -> int:
        """Free a released slot unless it was leased again since (a stale release); a spent one's
        segment is retired first."""
        if slot.state is SlotState.LEASED and slot.lease_serial == serial:
            self._untrimmed.pop(slot.id, None)
            # a fork's or trimmed (never written again), or more segments than the ring needs
            if spent or slot.segment.reserved < slot.size_bytes or self._surplus():
                try:
                    self._retire(slot.segment)  # the forked child keeps its own mapping: its batch stays
                finally:  # the segment is gone whatever the pin backend raised: the slot is spent
                    self._spend(slot)
                    self._make_free(slot)
            else:
                self._make_free(slot)
            return 1
        return 0

    def _trim_held(self) -> None:
        """Every slot is taken: give back the pages the held batches do not use (module docstring)."""
        if len(self.slots) < self.whole_slots:  # the steady ring: the batches in use are not kept ones
            return
        untrimmed, self._untrimmed = self._untrimmed, {}
        if self._on_create is not None:  # pinned: the pin backend holds the pages
            return
        for slot in untrimmed.values():
            if slot.state is SlotState.LEASED and not slot.spent:
                slot.segment.trim(slot.used_bytes)

    def close(self) -> None:
        """Unlink every segment; unmap those no view references. Idempotent; a no-op in any process
        but the one that made the ring (a forked worker's inherited copy)."""
        if self.closed or not self._creator.here:
            return
        self.closed = True
        error: BaseException | None = None
        try:
            self._wait_fences()
        except BaseException as exc:  # a Ctrl-C in a wait: every segment goes all the same
            error = exc
        for slot in self.slots:  # each slot whatever the others raise: a later close() is a no-op
            try:
                self._close_slot(slot)
            except BaseException as exc:  # a pin backend's error, a Ctrl-C: raised once all are done
                error = error or exc
        self.slots.clear()
        self._free.clear()
        self._spent.clear()
        self._cooling.clear()
        self._untrimmed.clear()
        if error is not None:
            try:
                raise error
            finally:
                del error  # else its traceback holds this frame, which holds it: a cycle only the collector frees

    def _wait_fences(self) -> None:
        """Before close() unpins and unmaps the segments: wait for the fence of every batch dropped
        but not yet free (cooling, or released and not collected), as its slot would have."""
        events = [released[2] for released in self._released] + [cooling[2] for cooling in self._cooling]
        call_each((e for e in events if e is not None), lambda event: wait_fence(event, "a dropped batch"))

    def _close_slot(self, slot: Slot) -> None:
        try:
            self._drop_growing(slot)
        finally:
            lease = self._leases.get(slot.id)
            if slot.state is SlotState.LEASED and lease is not None and lease.alive:
                self._linger(slot)
            elif not slot.spent:
                self._retire(slot.segment)  # the pin backend synchronises before it unpins

    # -- internals -----------------------------------------------------------------------
    def _new_segment(self, min_bytes: int, reserve: bool = True) -> Segment:
        """A new segment; with ``reserve=False`` sized only, and not yet shown to ``on_create``.
        The caller gets it or nothing: whatever fails once it exists (``on_create``, a Ctrl-C) unlinks
        it. Each caller stores it at once: CPython raises a pending signal after a call into C, as a
        function starts or at a loop's jump back, never as a Python function returns."""
        size = page_round(min_bytes)
        segment: Segment | None = None
        try:
            with explain_enospc(self.shm_dir, size):
                segment = Segment.create(self.shm_dir, size, reserve=reserve)
            self.created_total += 1
            if reserve:
                self._created(segment)
        except BaseException:
            if segment is not None:
                _discard(segment)
            raise
        return segment

    def _created(self, segment: Segment) -> None:
        """Show a fully reserved segment to the pin backend (if that fails, the caller discards it)."""
        if self._on_create is not None:
            self._on_create(segment)

    def _linger(self, slot: Slot) -> None:
        """The user still views this slot: unlink it now, unpin and unmap it when its lease dies
        (the lease's finalizer does), so a batch held past close() stays pinned while it lives."""
        segment = slot.segment
        self._lingering[slot.id] = segment
        segment.unlink()
        self.retired_names.append(segment.name)
        lease = self._leases[slot.id]
        if not lease.alive and self._lingering.pop(slot.id, None) is not None:  # died meanwhile
            retire_lingering(segment, self._on_retire)

    def _retire(self, segment: Segment, told: bool = True, hook: bool = True) -> None:
        """Unlink and unmap; ``told``: workers may map it, so queue its name for them to unmap;
        ``hook``: the pin backend saw it. Neither holds for a growing segment. The segment is gone
        whatever the pin backend's hook raises (a Ctrl-C included): its caller has let go of it."""
        try:
            if hook and self._on_retire is not None:
                self._on_retire(segment)
        finally:
            try:
                _discard(segment)
            finally:
                if told:
                    self.retired_names.append(segment.name)


def _discard(segment: Segment) -> None:
    """Unlink and close a segment that nothing else holds (no worker, no pin backend was told of it)."""
    try:
        segment.unlink()
    finally:
        segment.close()
