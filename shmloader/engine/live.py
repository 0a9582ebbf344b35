"""A loader's live iterators: every one it handed out or is building, which ``close()`` stops.

Owns a weak set of iterators and a count of the loader's closes, both under one lock. Runs in the
main process. Why: an iterator used to join the set only once ``iter(loader)`` had built it, so a
``close()`` from another thread while its workers were starting missed it and returned with them
running (tests/test_close_threads.py). Promises: ``iter(loader)`` takes a ``ticket`` as it begins,
and its iterator is ``admit``-ted before it starts anything (a multi-process one inside its step
guard, so a ``close()`` that finds it waits for its build to end and then stops it). A ``close()``
since the ticket refuses the admission with ``LoaderClosed``: every ``close()`` either finds an
iterator or comes before it starts anything, never between.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

from shmloader.engine.iterator import close_each
from shmloader.errors import LoaderClosed

# Every multi-process iterator of this process not yet shut, whatever loader made it: closed at
# interpreter exit, so no worker outlives the script that forgot to close its loader.
IN_PROCESS: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    close_each(IN_PROCESS)


class LiveIterators:
    """The iterators ``loader.close()`` must stop, and the closes an ``iter(loader)`` must see."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the set is added to and listed from several threads
        self._iterators: weakref.WeakSet[Any] = weakref.WeakSet()
        self._closes = 0

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
