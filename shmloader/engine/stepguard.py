"""Who may run a multi-process iterator's step loop, and how another thread stops it.

Owns one iterator's step lock, the ident of the thread that holds it, the stop request, and a
wake-up pipe whose read end sits in the iterator's poll. Runs in the main process.

Why: the step loop (``MultiProcessIter._next_data``) reads and changes the pool, the ledger, the
ring and the poll set, and may block in ``poll`` for as long as a worker takes. A ``close()`` from
another thread (a watchdog, a signal-handling thread, the loader's own ``close()``) that tore these
down under it left that ``next()`` waiting forever on pipes that no longer existed, or failing deep
inside (tests/test_close_threads.py). So the thread inside ``next()`` owns the iterator until it
returns, by construction:

- ``enter``/``leave`` bracket every step loop; ``next()`` from two threads at once run one after
  the other; ``next()`` from inside the same thread's ``next()`` (a plugin hook) is refused;
- ``close_begin`` is how a closer gets the iterator: at once when no ``next()`` runs; otherwise it
  sets the stop request, wakes the poll, and waits (bounded) for that ``next()`` to return, which
  it does at its next check, raising ``LoaderClosed``. From inside that ``next()`` (a hook, a
  signal handler on the same thread) it only sets the request: the ``next()`` closes the iterator
  as it returns;
- the wake-up pipe is written only while it is open, under its own lock, so a late wake-up can
  never land on a file descriptor number the process has since reused.
"""

from __future__ import annotations

import os
import threading

from shmloader.errors import LoaderError

CLOSE_WAIT_S = 10.0  # how long close() waits for a next() in another thread to notice and return


class StepGuard:
    __slots__ = ("_lock", "owner", "stop_requested", "wake_fd", "_wake_w", "_pipe_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None  # ident of the thread inside next(), if any
        self.stop_requested = False
        # The read end is polled with the workers' pipes and never read: once written, the
        # iterator is closing, and the pipe stays readable until it is closed with the iterator.
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._pipe_lock = threading.Lock()

    # -- the stepping thread -------------------------------------------------------------------
    def enter(self, what: str) -> None:
        """Take the iterator for one step loop (``what`` names the call, for the error)."""
        me = threading.get_ident()
        if self.owner == me:
            raise LoaderError(f"{what} was called from inside this iterator's own next() (a plugin hook, or "
                              "a signal handler, on the thread running it): the iterator cannot step twice "
                              "at once; do it after next() returns")
        self._lock.acquire()
        self.owner = me

    def leave(self) -> None:
        self.owner = None
        self._lock.release()

    # -- a closer ------------------------------------------------------------------------------
    def close_begin(self) -> bool:
        """Take the iterator to close it: True once taken (call ``close_end`` after). False when the
        caller is the thread inside ``next()`` itself: the request is set, and that ``next()``
        closes the iterator as it returns. Raises ``LoaderError`` if a ``next()`` in another thread
        does not return within ``CLOSE_WAIT_S`` (it still closes the iterator when it does)."""
        if self._lock.acquire(blocking=False):
            return True
        self.stop_requested = True
        if self.owner == threading.get_ident():
            return False
        self._wake()
        if self._lock.acquire(timeout=CLOSE_WAIT_S):
            return True
        raise LoaderError(f"close(): next() running in another thread (ident {self.owner}) did not return "
                          f"within {CLOSE_WAIT_S:g} s of being asked to stop (a plugin hook that blocks?); "
                          "the iterator closes itself when that next() returns")

    def close_end(self) -> None:
        self._lock.release()

    def _wake(self) -> None:
        with self._pipe_lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:
                    pass  # the pipe is full of wake-ups already

    def close_pipe(self) -> None:
        """Close the wake-up pipe (the iterator is shut; nothing polls it any more)."""
        with self._pipe_lock:
            if self._wake_w >= 0:
                os.close(self._wake_w)
                os.close(self.wake_fd)
                self._wake_w = self.wake_fd = -1
