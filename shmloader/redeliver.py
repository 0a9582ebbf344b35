"""A Ctrl-C delivered again a moment later, where it came at a place that would lose it.

Owns :func:`interrupt_main_later`, the one way the package raises SIGINT in the main thread again:
a lease's finalizer (``transport.lease``: Python swallows a KeyboardInterrupt in a weakref
callback) and the command line's SIGINT handler (``cli.interrupt``: a ``__del__``, the resource
sharer, a finalizer that swallowed it) both use it. Promises: the handler runs in the main thread,
as if Ctrl-C had been pressed again, no sooner than ``delay_s`` from the call, so never inside the
code that called it; the timer is a daemon thread, which never keeps the process alive. In a
process forked while a timer is pending, that timer is cancelled (``_cancelled_in_child``): its
interrupt was the parent's, and its ``cancel()`` returns there at once.
"""

from __future__ import annotations

import _thread
import signal
import threading

from shmloader import owner

__all__ = ["SOON_S", "interrupt_main_later"]


def _cancelled_in_child(timer: threading.Timer) -> None:
    """In a forked child: an inherited timer is cancelled, with a fresh event. Its thread was not
    forked, and it may have held its event's lock at the fork (a moment of each wait, and as it
    fires): the child's ``cancel()`` then blocked on that lock forever
    (tests/test_redeliver_fork.py)."""
    timer.finished = threading.Event()
    timer.finished.set()


_PENDING = owner.renewed_in_child(_cancelled_in_child)  # every timer started, while it lives
SOON_S = 0.02  # long enough for the caller to have returned: SIGINT's handler then runs at once


def interrupt_main_later(delay_s: float = SOON_S) -> threading.Timer:
    """Run SIGINT's handler in the main thread ``delay_s`` from now (``_thread.interrupt_main``: a
    KeyboardInterrupt under Python's default handler), from a daemon timer. Returns the timer,
    whose ``cancel()`` drops the interrupt if it has not fired yet."""
    timer = threading.Timer(delay_s, _thread.interrupt_main, (signal.SIGINT,))
    timer.daemon = True
    timer.name = "shmloader-ctrl-c-retry"
    _PENDING.add(timer)
    timer.start()
    return timer


