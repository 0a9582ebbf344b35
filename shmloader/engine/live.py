"""A loader's live iterators: every one it handed out or is building, which ``close()`` stops.

Owns a weak set of iterators and a count of the loader's closes, both under one lock. Runs in the
main process. Why: an iterator used to join the set only once ``iter(loader)`` had built it, so a
``close()`` from another thread while its workers were starting missed it and returned with them
running (tests/test_close_threads.py). Promises: ``iter(loader)`` takes a ``ticket`` as it begins,
and its iterator is ``admit``-ted before it starts anything (a multi-process one inside its step
guard, so a ``close()`` that finds it waits for its build to end and then stops it). A ``close()``
since the ticket refuses the admission with ``LoaderClosed``: every ``close()`` either finds an
iterator or comes before it starts anything, never between.

Also owns the interpreter-exit hook, which stops every multi-process iterator of the process, and
what a thread other than the main one meets after it (``park_if_exiting``): a ``next()`` that the
hook stopped, or a new ``iter(loader)`` with workers, keeps that thread waiting for the interpreter
to end it, as torch's thread stays inside its ``next()``. Why: the stopped ``next()`` raised
``LoaderClosed`` into the thread, whose traceback threading printed as the interpreter went down
(often cut off half-way), and a thread that went on started workers and segments that no hook
would stop any more (the resource tracker warned of leaked shared_memory;
tests/test_adv3_exit_daemon.py). Such a thread is a daemon, or a non-daemon one whose join at exit
a Ctrl-C cut short: the exit hooks run only once threading has joined the non-daemon threads, or
given up on them, and the interpreter then ends every thread left
(tests/test_exit_ctrl_c_threads.py). The main thread is never held: it gets the error, as before.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

from shmloader.engine.iterator import close_each
from shmloader.errors import LoaderClosed
from shmloader.owner import renewed_in_child

# Every multi-process iterator of this process not yet shut, whatever loader made it: closed at
# interpreter exit, so no worker outlives the script that forgot to close its loader.
IN_PROCESS: weakref.WeakSet[Any] = weakref.WeakSet()
EXITING = threading.Event()  # set as the exit hook begins, never cleared
PARK_S = 60.0  # how long a parked daemon thread waits for the interpreter's end before its error


@atexit.register
def _close_all() -> None:
    EXITING.set()  # first: a next() this hook stops sees it as it returns
    close_each(IN_PROCESS)


def _left_to_the_exit() -> bool:
    """Whether the calling thread is one the interpreter's exit will end: the exit hook has run and
    this is not the main thread (a daemon, or a non-daemon thread whose join a Ctrl-C cut short)."""
    return EXITING.is_set() and threading.current_thread() is not threading.main_thread()


def park_if_exiting() -> None:
    """In a thread other than the main one once the exit hook has run: wait for the interpreter to
    end this thread (``PARK_S`` at most, so an exit hook of the application that joins the thread
    still returns: the caller then raises its error). Anywhere else: return at once."""
    if _left_to_the_exit():
        threading.Event().wait(PARK_S)


def refuse_if_exiting() -> None:
    """``iter(loader)`` with workers: in a thread other than the main one once the exit hook has run,
    park, then raise ``LoaderClosed`` (workers started now would outlive the hook); anywhere else
    return at once."""
    if _left_to_the_exit():
        park_if_exiting()
        raise LoaderClosed("iter(loader) in a thread while the interpreter exits: shmloader's exit "
                           "hook has stopped every loader's workers, and starts no new ones")


class LiveIterators:
    """The iterators ``loader.close()`` must stop, and the closes an ``iter(loader)`` must see.
    Owns its lock per process: a child forked by other code gets a lock of its own (``_REGISTRIES``),
    since the copy it inherits may be held by a parent's thread that the child does not have."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the set is added to and listed from several threads
        self._iterators: weakref.WeakSet[Any] = weakref.WeakSet()
        self._closes = 0
        _REGISTRIES.add(self)

    def __len__(self) -> int:
        return len(self._iterators)

    def ticket(self) -> int:
        """Taken as ``iter(loader)`` begins: a close() from then on stops or refuses its iterator."""
        return self._closes

    def admit(self, iterator: Any, ticket: int) -> None:
        """Record ``iterator``, which has started nothing yet; ``LoaderClosed`` if the loader was
        closed since ``ticket`` was taken (its ``iter(loader)`` then starts nothing)."""
        with self._lock:
            if self._closes != ticket:
                raise LoaderClosed("the loader was closed (loader.close(), from another thread) while "
                                   "iter(loader) was starting: nothing was started; iter(loader) again "
                                   "starts afresh")
            self._iterators.add(iterator)

    def close_all(self) -> None:
        """Close every iterator admitted so far (``close_each``: all of them, then the first error);
        an ``iter(loader)`` under way and not admitted yet will be refused."""
        with self._lock:
            self._closes += 1
            iterators = list(self._iterators)
        close_each(iterators)


def _renew_lock(registry: LiveIterators) -> None:
    """In a forked child, its one thread, before anything else runs there: the registry's lock anew."""
    registry._lock = threading.Lock()


_REGISTRIES = renewed_in_child(_renew_lock)  # every loader's
