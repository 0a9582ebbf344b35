"""The stop flag: the main process says "stop now" to one worker past the tasks it has queued.

Owns one flag per worker process, set by the main process (``WorkerPool.shutdown``, and any reap)
and read by the worker before each message it takes off its task pipe. Promises, as torch's
``done_event`` does: once the flag is set the worker starts no task — the one it is running
finishes, every task still queued behind it is skipped, and the worker exits at once — so a stop
waits for one ``__getitem__`` at most, never for ``prefetch_factor`` of them. A worker's successor
(a restart) gets a flag of its own, clear. An epoch's end sets nothing: persistent workers keep
their queue.

Why a semaphore: a multiprocessing ``Event`` costs about a microsecond to read (a lock, a
condition and a semaphore); a ``RawValue`` keeps a descriptor of multiprocessing's heap open in
the main process for good. A semaphore costs no descriptor (its file is unlinked at once under
fork, and when the flag is freed otherwise) and a non-blocking ``acquire`` is read in some 50 ns.
The worker's read takes the flag: it returns True once, and the worker exits on it.

A flag already freed reads as set. Under spawn and forkserver the worker opens the semaphore by
name as it unpickles its process object, and the main process unlinks that name once it has let go
of the worker. An orphan can still be starting then: a fork server killed while the worker
unpickled a slow dataset leaves it running, reparented, while the loader sees it dead and shuts it
down. CPython's own unpickling of the semaphore raised ``FileNotFoundError`` there, before any code
of ours ran, and the bootstrap printed its traceback on the trainer's stderr
(tests/test_orphan_start_quiet.py); the flag now unpickles its semaphore itself, and such a worker
exits at once, quietly (``worker.main.run``).
"""

from __future__ import annotations

import weakref
from multiprocessing.context import BaseContext
from typing import Any, Callable

from shmloader.transport import tracker


class StopFlag:
    """One worker's stop flag, made before the worker starts and passed to it as an argument
    (inherited under fork, pickled with the process under spawn and forkserver)."""

    def __init__(self, ctx: BaseContext) -> None:
        named = ctx.get_start_method() != "fork"
        if named:
            # the semaphore's name stays in /dev/shm until freed, registered with the resource
            # tracker after it is made: a tracker that cannot start then (out of descriptors) left
            # the name there for good (tests/test_iter_fd_limit.py). Started first, it fails first
            # (and a dead one is replaced before CPython writes to it: transport/tracker.py).
            tracker.ensure_running()
        self._sem: Any = ctx.Semaphore(0)
        name = getattr(getattr(self._sem, "_semlock", None), "name", None) if named else None
        if name is not None:  # CPython registered it and unregisters it when freed: a new tracker must know it
            tracker.adopt(name, "semaphore")
            # made after CPython's finalizer of the semaphore, so run before it (weakref callbacks
            # run newest first): the tracker it then writes to lives
            weakref.finalize(self._sem, tracker.forget, name)
        self._set = False  # in the main process: set once, however many paths stop the worker
        self.freed = False  # in a worker: the main process freed the flag before the worker opened it

    def __getstate__(self) -> dict[str, Any]:
        """The semaphore's own state (CPython's check that a process is starting included), not the
        semaphore: its unpickling is ``__setstate__``'s, which survives a name already unlinked."""
        return {"cls": type(self._sem), "sem": self._sem.__getstate__()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._set, self.freed = False, False
        self._sem = state["cls"].__new__(state["cls"])
        try:
            self._sem.__setstate__(state["sem"])
        except FileNotFoundError:  # unlinked: the main process has let go of this worker
            self._sem, self.freed = None, True

    def set(self) -> None:
        """In the main process: from now on the worker starts no task (idempotent)."""
        if not self._set:
            self._set = True
            self._sem.release()

    def reader(self) -> Callable[[bool], bool]:
        """In the worker: a callable that, given False, returns True once the flag is set (and
        takes it). Bound once: the per-message check is one C call. A freed flag reads as set."""
        if self._sem is None:
            return lambda _block: True
        return self._sem.acquire  # type: ignore[no-any-return]
