"""Who may run a multi-process iterator's step loop, and how another thread stops it.

Owns one iterator's step lock, the ident of the thread that holds it, the stop request, and a
wake-up pipe whose read end sits in the iterator's poll (``StepGuard(pipe=False)``: none, for the
``num_workers=0`` iterator, which waits on no poll). Runs in the main process.

Why: the step loop (``MultiProcessIter._next_data``) reads and changes the pool, the ledger, the
ring and the poll set, and may block in ``poll`` for as long as a worker takes. A ``close()`` from
another thread (a watchdog, a signal-handling thread, the loader's own ``close()``) that tore these
down under it left that ``next()`` waiting forever on pipes that no longer existed, or failing deep
inside (tests/test_close_threads.py). So the thread inside ``next()`` owns the iterator until it
returns, by construction:

- ``step`` runs every step loop; ``next()`` from two threads at once run one after the other;
  ``next()`` from inside the same thread's ``next()`` (a plugin hook) is refused;
- ``close`` is how a closer gets the iterator: at once when no ``next()`` runs; otherwise it sets
  the stop request, wakes the poll, and waits (bounded) for that ``next()`` to return, which it
  does at its next check, raising ``LoaderClosed``. From inside that ``next()`` (a hook, a signal
  handler on the same thread) it sets the request and wakes the poll without waiting: the
  ``next()`` closes the iterator as it returns, with its batch when it has one, else at once
  with ``LoaderClosed`` (a signal handler's close() used to leave the poll it interrupted to wait
  on for a batch, forever when the worker hung);
- the wake-up pipe is written only while it is open, under its own lock, so a late wake-up can
  never land on a file descriptor number the process has since reused.

A Ctrl-C never leaves the step lock held. Python raises a pending SIGINT between bytecodes, most
often right after a C call such as the lock's ``acquire`` has returned: the lock was taken, and
the ``KeyboardInterrupt`` comes before any line of ours could note it. The next ``next()`` then
waited forever, and ``close()`` gave up after ``CLOSE_WAIT_S`` with the workers still running
(tests/test_interrupt_windows.py). So the lock is an ``RLock``, which records its holder itself, in
C, as it is taken; it is taken only inside the ``try`` of ``step`` and ``close``, whose ``finally``
gives it back whenever this thread holds it, however far the ``try`` got: its first call, inline,
is the release itself (refused, harmlessly, when this thread does not hold it), so a Ctrl-C can
come after the release but never between a check of the lock and the release. The body ``step`` runs
and the shutdown a stop request asks for are the callers'; both are inside that ``try``.

A process forked by other code gets each guard's locks anew (``_renew_in_child``): the copies it
inherits may be held by threads it does not have. A copy whose step lock a thread held at the
fork stopped half-way through that thread's step, so stepping it raises ``LoaderError`` (closing
it works), where it used to wait forever (tests/test_fork_held_locks.py).
"""

from __future__ import annotations

import os
import threading
from threading import get_ident
from collections.abc import Callable
from typing import TypeVar

from shmloader.errors import LoaderError
from shmloader.owner import renewed_in_child

T = TypeVar("T")

CLOSE_WAIT_S = 10.0  # how long close() waits for a next() in another thread to notice and return


def reentry_error(what: str) -> LoaderError:
    """The error for ``what`` (``next()``, ``iter(loader)``) called inside the same thread's own ``next()``."""
    return LoaderError(f"{what} was called from inside this iterator's own next() (a plugin hook, a "
                       "signal handler, or with num_workers=0 the dataset, sampler or collate_fn, on the "
                       "thread running it): the iterator cannot step twice at once; do it after next() returns")


def torn_error(what: str, parent: int) -> LoaderError:
    """The error for ``what`` on a copy of an iterator that a thread of ``parent`` was stepping when
    this process was forked from it."""
    return LoaderError(f"{what} on an iterator that another thread of process {parent} was stepping when "
                       f"this process ({os.getpid()}) was forked from it: this copy stopped half-way through "
                       "that step (its sampler may have passed a batch that nobody received). Close it and "
                       "make a new iterator here: iter(loader)")


class StepGuard:
    """One iterator's step lock, its holder's ident, the stop request and the wake-up pipe."""

    __slots__ = ("_lock", "owner", "stop_requested", "wake_fd", "_wake_w", "_pipe_lock", "_blockers", "torn_by_fork",
                 "__weakref__")

    def __init__(self, pipe: bool = True) -> None:
        self._lock = threading.RLock()  # re-entry is refused before it is taken: held at most once
        self.owner: int | None = None  # ident of the thread inside next(), if any (for messages)
        self.stop_requested = False
        self._pipe_lock = threading.Lock()
        self.torn_by_fork: int | None = None  # in a child forked mid-step: the parent's pid (_renew_in_child)
        _GUARDS.add(self)
        # what may keep a next() from returning, for close()'s error: with workers the poll is woken
        self._blockers = ("a plugin hook or the sampler" if pipe else
                          "with num_workers=0 the dataset, sampler or collate_fn, or a plugin hook")
        if not pipe:  # num_workers=0: no poll to wake; its next() checks the request as it returns
            self.wake_fd = self._wake_w = -1
            return
        # The read end is polled with the workers' pipes and never read: once written, the
        # iterator is closing, and the pipe stays readable until it is closed with the iterator.
        self.wake_fd, self._wake_w = os.pipe()
        try:
            os.set_blocking(self._wake_w, False)
        except BaseException:  # no guard is made: nothing else would ever close the pipe
            self.close_pipe()
            raise

    # -- the stepping thread -------------------------------------------------------------------
    def step(self, what: str, body: Callable[[], T], on_stop: Callable[[], None] | None = None) -> T:
        """Run ``body`` owning the iterator (``what`` names the call, for the error); then, if a
        close was asked for meanwhile, ``on_stop`` (the owner closes the iterator). The iterator is
        given back however either ends, a Ctrl-C included."""
        if self.torn_by_fork is not None:
            raise torn_error(what, self.torn_by_fork)
        lock = self._lock
        if lock._is_owned():  # type: ignore[attr-defined]  # _held_here inlined: once per batch
            self._refuse_reentry(what)
        try:
            lock.acquire()
            self.owner = get_ident()
            try:
                return body()
            finally:
                if on_stop is not None and self.stop_requested:  # close() came while this ran
                    on_stop()
        finally:
            # the release is the first call here, made inline: a Ctrl-C is raised after a call
            # returns, or as a Python function starts, so it can come after it, never before it
            try:
                lock.release()
            except RuntimeError:
                pass  # not taken: the acquire itself was cut short
            else:
                self._forget_owner()

    def _refuse_reentry(self, what: str) -> None:
        """Called by the thread that holds the step lock: it may not step again inside its own step."""
        if self._held_here():
            raise reentry_error(what)

    def _held_here(self) -> bool:
        """Whether the calling thread holds the step lock. The lock itself says (as
        ``threading.Condition`` asks it), so there is no moment when it is held and this is False."""
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]

    def _forget_owner(self) -> None:
        """After this thread released the step lock: clear the owner it noted (for messages only),
        unless another thread has taken the lock and noted itself since."""
        if self.owner == get_ident():
            self.owner = None

    # -- a closer ------------------------------------------------------------------------------
    def close(self, shut: Callable[[], None]) -> None:
        """Take the iterator and run ``shut``, then give it back. From inside the thread's own
        ``next()`` (a hook, a signal handler), set the request and wake its poll: that ``next()``
        runs its ``on_stop`` as it returns. Raises ``LoaderError`` if a ``next()`` in another
        thread does not return within ``CLOSE_WAIT_S`` (it still closes the iterator when it does)."""
        if self._held_here():
            self.stop_requested = True
            # a signal handler's close(): its next() may sit in a poll that only a worker would end
            self._wake(blocking=False)
            return
        lock = self._lock
        try:
            self._take_for_close()
            shut()
        finally:
            try:
                lock.release()  # first and inline, as in step()
            except RuntimeError:
                pass  # not taken: the wait for it ran out, or was cut short
            else:
                self._forget_owner()

    def _take_for_close(self) -> None:
        if self._lock.acquire(blocking=False):
            return
        self.stop_requested = True
        self._wake()
        if self._lock.acquire(timeout=CLOSE_WAIT_S):
            return
        raise LoaderError(f"close(): next() running in another thread (ident {self.owner}) did not return "
                          f"within {CLOSE_WAIT_S:g} s of being asked to stop (blocked in {self._blockers}?); "
                          "the iterator closes itself when that next() returns")

    def _wake(self, blocking: bool = True) -> None:
        """Make the iterator's poll return. ``blocking=False`` on the stepping thread itself (a
        signal handler may run while that thread holds the pipe's lock): a wake-up under way, or a
        pipe being closed, makes this one needless."""
        if not self._pipe_lock.acquire(blocking):
            return
        try:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:
                    pass  # the pipe is full of wake-ups already
        finally:
            self._pipe_lock.release()

    def close_pipe(self) -> None:
        """Close the wake-up pipe (the iterator is shut; nothing polls it any more)."""
        with self._pipe_lock:
            if self._wake_w >= 0:
                write_end, read_end = self._wake_w, self.wake_fd
                self._wake_w = self.wake_fd = -1  # first: a closed number is never written to
                try:
                    os.close(write_end)
                finally:
                    os.close(read_end)


def _renew_in_child(guard: StepGuard) -> None:
    """In a forked child, its one thread, before anything else runs there: the guard's locks anew.
    A step lock that another thread held at the fork (not this one: it can take it again) marks
    its iterator's copy as torn (``StepGuard.step`` refuses it)."""
    if guard._lock.acquire(blocking=False):
        guard._lock.release()
    else:
        guard._lock = threading.RLock()
        guard.owner = None
        guard.torn_by_fork = os.getppid()
    guard._pipe_lock = threading.Lock()


_GUARDS = renewed_in_child(_renew_in_child)  # every iterator's
