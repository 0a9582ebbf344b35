"""One epoch of the device prefetcher, and the batches it has in flight.

Owns :class:`Epoch` (the iterator ``iter(DevicePrefetcher)`` returns), :class:`Copy` (one batch
read: its source, which holds the slot lease, its copy and the copy's event), :class:`Mark` (where
the loader's epoch stood before a look-ahead read) and the events that need no wait (``DONE``, and
``UNCOPIED`` for a batch read whose copy is not enqueued). Runs in the main process, in the
caller's thread, through the :class:`~shmloader.gpu.prefetch.DevicePrefetcher` that made it.
Promises: batch k is handed out while batch k+1 is read and copied; no batch is lost, repeated or
handed out before its copy is waited on, whatever the loader raises for k+1 and wherever a
``KeyboardInterrupt`` or ``SystemExit`` lands; every copy finishes before its source (and slot)
is let go; importing this module imports neither torch nor cupy.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from shmloader import state as _state
from shmloader.engine.caller import TO_DEVICE, Caller
from shmloader.gpu.backends import Event
from shmloader.kept import keep

if TYPE_CHECKING:
    from shmloader.gpu.prefetch import DevicePrefetcher

__all__ = ["DONE", "UNCOPIED", "Copy", "Done", "Epoch", "Mark"]


class Done:
    """An event that has already completed: nothing to wait for."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = Done()
UNCOPIED = Done()  # the event of a batch read whose copy is not enqueued: there is nothing to wait for


class Copy:
    """One batch in flight: its source (which holds the slot lease), its copy and the event
    (``UNCOPIED`` until the copy is enqueued: a Ctrl-C inside the copy leaves it so), and the
    mark from before it was read (where the state stands while it is copied again)."""

    __slots__ = ("source", "moved", "event", "mark")
    moved: Any  # set with the event, and read only once the event is

    def __init__(self, source: Any, mark: Mark | None) -> None:
        self.source, self.mark = source, mark
        self.event: Event = UNCOPIED


class Mark:
    """Where the loader's epoch stood before a look-ahead read: enough to rebuild its record.

    Taken once per batch, so it copies only what changes during an epoch (the delivered tasks,
    the count yielded, whether it finished); the record itself is rebuilt only by ``state_dict``.
    """

    __slots__ = ("save", "record", "low", "above", "yielded", "finished")

    def __init__(self, save: Callable[[_state.EpochRecord], dict[str, Any]], record: _state.EpochRecord) -> None:
        delivered = record.delivered
        self.save, self.record, self.low = save, record, delivered.low
        self.above = tuple(delivered.above) if delivered.above else ()
        self.yielded, self.finished = record.yielded, record.finished

    def state(self) -> dict[str, Any]:
        delivered = _state.TaskSet()
        delivered.low = self.low
        delivered.above.update(self.above)
        record = replace(self.record, delivered=delivered, yielded=self.yielded, finished=self.finished)
        return self.save(record)


class Epoch:
    """One epoch of a prefetcher: batch k is handed out while batch k+1 is read and copied.

    Owns the copies read but not yet handed out (``pending``) and, until it is handed out, an
    error the loader raised while batch k+1 was read ahead: batch k (loaded fine) comes first, the
    error at the next ``next()``, and the epoch goes on after it, as it does on the loader itself.
    A ``BaseException`` there (``KeyboardInterrupt``, ``SystemExit``) is raised at once, but batch k
    stays pending: it is the next batch handed out, its source is let go only once its copy is done,
    and ``state_dict()`` stands before it. So does batch k+1 when such an exception lands inside
    its copy, after the loader handed it over: it stays pending, uncopied, and is copied again at
    the next ``next()`` (``_read``), which hands out k, then k+1 in its place. One in the host wait
    past ``max_held`` right after k was made ready keeps k (``ready``): the next ``next()`` hands it out.
    When the epoch ends, or the iterator is dropped early, every copy finishes before its slot is
    let go (``DevicePrefetcher._drain``, a finalizer: the generator's ``finally`` it replaces).
    A loader's iterator it drives is marked so (``engine.caller``): the advice of its errors names
    ``next()`` on this iterator and ``iter()`` on the prefetcher, not ``iter(loader)``.
    """

    def __init__(self, pre: DevicePrefetcher) -> None:
        pre._mark = None
        self.pre = pre
        self.batches = iter(pre.source)  # first: a loader picks its pin backend when it starts
        if isinstance(getattr(self.batches, "caller", None), Caller):  # a loader's iterator: its errors'
            self.batches.caller = TO_DEVICE  # type: ignore[attr-defined]  # advice names our calls
        try:
            self.transfer = pre._epoch_transfer()
            self.stream = self.transfer.new_stream(pre.device)
        except BaseException:  # e.g. "cuda:1" with one device: stop what the epoch started
            _abandon(self.batches, pre.source)
            raise
        self.pending: deque[Copy] = deque()
        self.save = getattr(self.batches, "state_of", None)  # a loader's iterator: its state as of a record
        self.error: BaseException | None = None
        self.error_mark: Mark | None = None  # where the epoch stands once ``error`` is raised
        # (the mark after k) once k+1 is read but a Ctrl-C cut the wait for k short: not read again
        self.ahead: tuple[Mark | None] | None = None
        self.done = False
        # batch k, moved, with the mark after it, when the wait after its hand-out raised: the next one out
        self.ready: tuple[Any, Mark | None] | None = None
        self._drain = weakref.finalize(self, pre._drain, self.pending)
        self._drain.atexit = False  # no device work during interpreter teardown

    def __iter__(self) -> Epoch:
        return self

    def close(self) -> None:
        """Stop early (as a generator's ``close``): every copy finishes, then the slots are let go.
        Inert in a process that inherited this iterator."""
        self.done = True
        self.error = self.ready = None
        self._drain()

    def __next__(self) -> Any:
        pre, pending = self.pre, self.pending
        if self.ready is not None:  # made ready, but the wait after it raised before the caller got it
            (moved, pre._mark), self.ready = self.ready, None
            return moved
        if not pending or pending[0].event is UNCOPIED:  # nothing read ahead, or its copy was cut short
            if self.error is not None:  # read ahead while the batch before it was in the caller's hands
                exc, self.error = self.error, None
                pre._mark = self.error_mark  # handed out as its error: the state is after it now
                try:
                    raise exc
                finally:
                    del exc  # else its traceback holds this frame, which holds it: a cycle only the collector frees
            try:
                self._read()  # an error here has no batch before it to wait for: raised now
            except Exception:
                pre._mark = pre.failed_mark
                raise
            if not pending:
                self._end()
                raise StopIteration
        current = pending[0]  # stays pending until it is handed out: an interrupt must not cost it
        mark = pre._mark
        if self.ahead is None:
            pre._release_finished()  # before the read: the loader may need those slots for it
            try:
                self._read()  # k+1 copies during k's work
            except Exception as exc:  # the loader's error for batch k+1: batch k first
                self.error, self.error_mark = keep(exc), pre.failed_mark
            except BaseException:  # Ctrl-C, SystemExit: batch k is still the next one, its copy is
                pre._mark = mark  # still covered (pending is drained), and the caller has k-1 batches
                raise
        else:  # k+1 was read before a Ctrl-C cut the wait for k short: the state stands after k again
            (pre._mark,), self.ahead = self.ahead, None
        moved = current.moved
        try:
            self.transfer.wait(moved, current.event, pre.device)
        except Exception:  # the wait's own error: k goes as it passes, its source kept until its copy is done
            pending.popleft()
            current.moved = None
            pre.held.append(current)
            raise
        except BaseException:  # Ctrl-C, SystemExit: k stays the next batch, k+1 stays read ahead
            self.ahead, pre._mark = (pre._mark,), mark
            raise
        pending.popleft()
        current.moved = None
        pre.held.append(current)
        del current
        try:
            pre._release_finished()
        except BaseException:  # a Ctrl-C in the wait past max_held: k is still the caller's next batch
            self.ready, pre._mark = (moved, pre._mark), mark
            raise
        return moved

    def _read(self) -> None:
        pending = self.pending
        if pending and pending[-1].event is UNCOPIED:  # read, but a Ctrl-C cut its copy short: copy it again
            self.pre._copy_again(pending, self.transfer, self.stream)
        elif not self.done:
            self.done = not self.pre._start(self.batches, self.transfer, self.stream, pending, self.save)

    def _end(self) -> None:
        self.pre._mark = None  # the epoch ended: the loader's state (the next epoch's start) is right
        self._drain()


def _abandon(batches: Iterator[Any], source: Any) -> None:
    """Close the iterator an epoch made on ``source`` and cannot use: not ``source`` itself (a
    generator the caller passed) nor a loader's persistent iterator, whose workers are the loader's."""
    close = getattr(batches, "close", None)
    if callable(close) and batches is not source and batches is not getattr(source, "_iterator", None):
        close()
